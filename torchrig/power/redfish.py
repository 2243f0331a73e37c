"""Redfish (DMTF's REST API for BMCs): the service's URL, the reset type for each action, the
power state in words and sushy's errors in words. Pure; run.py makes the calls.

The client is OpenStack's `sushy`: the Redfish library Ironic drives real BMCs with every day
(Dell, HPE, Lenovo, Supermicro quirks handled there, not here), with typed resources
(system.power_state, reset_system and the reset types the BMC allows), Basic or session
auth, and exceptions that separate a refused login from an unreachable BMC. DMTF's own
`redfish` library is a thinner HTTP wrapper: we would parse the resources ourselves."""

from __future__ import annotations

import re

from ..errors import TorchrigError
from ..inventory import Bmc

# action -> reset types to use, first the BMC allows (cycle: PowerCycle is a cold cycle;
# ForceRestart, which every BMC offers, is a hard reset, enough for a hung node)
RESETS = {"on": ("On", "ForceOn"), "off": ("ForceOff",), "cycle": ("PowerCycle", "ForceRestart")}
STATES = {"On": "on", "Off": "off", "PoweringOn": "powering on", "PoweringOff": "powering off",
          "Paused": "paused"}


def base_url(bmc: Bmc) -> str:
    scheme = bmc.scheme or "https"
    port = f":{bmc.port}" if bmc.port else ""
    host = f"[{bmc.address}]" if ":" in bmc.address and not bmc.address.startswith("[") \
        else bmc.address
    return f"{scheme}://{host}{port}"


def tls_verify(bmc: Bmc) -> bool | str:
    return True if bmc.tls_verify is None else bmc.tls_verify


def pick_system(ids: list[str], wanted: str | None) -> str:
    """The ComputerSystem to switch: bmc.system, else the only one the BMC has."""
    if wanted is not None:
        if wanted not in ids:
            raise TorchrigError(f"the BMC has no system {wanted!r} (it has: "
                                f"{', '.join(ids) or 'none'}); fix bmc.system")
        return wanted
    if len(ids) != 1:
        raise TorchrigError(f"the BMC has {len(ids)} systems ({', '.join(ids) or 'none'}); name "
                            "the host's one with bmc.system")
    return ids[0]


def reset_type(action: str, allowed: set[str]) -> str:
    """The reset type for `action` among those the BMC allows (none listed: any)."""
    for rt in RESETS[action]:
        if not allowed or rt in allowed:
            return rt
    raise TorchrigError(f"the BMC allows none of {', '.join(RESETS[action])} for power "
                        f"{action} (it allows: {', '.join(sorted(allowed))})")


def state_word(value: str | None) -> str:
    return STATES.get(value or "", f"unknown ({value})" if value else "unknown")


def explain(kind: str, message: str, url: str) -> str:
    """A sushy exception (its class name and message) in words an operator can act on."""
    if kind == "AccessError":
        return ("the BMC refused the login (HTTP 401/403): wrong user or password, or the user "
                "may not do this; check bmc.user and its password")
    if kind == "ConnectionError":
        m = re.search(r"\[Errno -?\d+\] ([^\"')]+)|(CERTIFICATE_VERIFY_FAILED[^\"')]*)", message)
        why = (m.group(1) or m.group(2)).strip() if m else "no connection"
        hint = ("; for a self-signed certificate set bmc.tls_verify: false or a CA file"
                if m and m.group(2) else "; check bmc.address/port and that this machine "
                "reaches the BMC")
        return f"cannot reach the Redfish service at {url} ({why}){hint}"
    if kind in ("ResourceNotFoundError", "MissingAttributeError", "MalformedAttributeError",
                "JSONDecodeError"):
        return f"no Redfish service at {url}/redfish/v1 (is it the BMC, and does it speak Redfish?)"
    return f"Redfish error ({kind}): {message[:300]}"
