"""The testbed's private network: one bridge, one persistent netns per host.

Each host's network namespace outlives its container, so a reboot (nspawn exits 133 and is
started again) keeps the same interface and address with nothing to re-attach.
No default route and no forwarding: the hosts reach only the bridge.
"""

from __future__ import annotations

import json
import subprocess

from ..errors import TorchrigError
from .paths import BRIDGE, GATEWAY_IP, SUBNET, netns, veth


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _exists(kind: str, name: str) -> bool:
    if kind == "netns":
        return name in _ip("netns", "list").stdout.split()
    return _ip("link", "show", name, check=False).returncode == 0


def taken_by(routes: list[dict], bridge: str) -> list[str]:
    """The devices other than `bridge` in `ip -j route show <subnet>/24`'s answer."""
    return sorted({r["dev"] for r in routes if r.get("dev") and r["dev"] != bridge})


def ensure_bridge() -> None:
    # another bridge on the same /24 (a second testbed left on the default subnet) would take
    # this one's addresses: its hosts' keys would meet ours in known_hosts, traffic would split
    others = taken_by(json.loads(_ip("-j", "route", "show", f"{SUBNET}.0/24").stdout or "[]"),
                      BRIDGE)
    if others:
        raise TorchrigError(f"the testbed's subnet {SUBNET}.0/24 is already on {', '.join(others)} "
                            "(another testbed?): set TORCHRIG_TESTBED_SUBNET (and "
                            "TORCHRIG_TESTBED_BRIDGE, TORCHRIG_TESTBED_STATE) to a free one")
    if not _exists("link", BRIDGE):
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{GATEWAY_IP}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")


def remove_bridge() -> None:
    if _exists("link", BRIDGE):
        _ip("link", "del", BRIDGE)


def add_host(name: str, ip: str) -> None:
    ns, v = netns(name), veth(name)
    if not _exists("netns", ns):
        _ip("netns", "add", ns)
    if not _exists("link", v):
        _ip("link", "add", v, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
    _ip("link", "set", v, "master", BRIDGE, "up")
    _ip("-n", ns, "link", "set", "eth0", "up")
    _ip("-n", ns, "link", "set", "lo", "up")


def remove_host(name: str) -> None:
    if _exists("link", veth(name)):
        _ip("link", "del", veth(name))
    if _exists("netns", netns(name)):
        _ip("netns", "del", netns(name))


def set_link(name: str, up: bool) -> None:
    """Cable pulled / plugged back: for tests of a host that vanishes mid-run."""
    _ip("link", "set", veth(name), "up" if up else "down")
