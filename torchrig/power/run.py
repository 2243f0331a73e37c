"""`power`'s effects: ipmitool for each target, concurrently, each host's outcome reported."""

from __future__ import annotations

import logging
import os
import subprocess
import warnings

from ..errors import TorchrigError
from ..session import Result, fan_out
from . import ipmi, redfish
from .plan import Target

CALL_TIMEOUT_S = 60  # a BMC that holds the session open: give up, say so


def password(t: Target) -> str:
    pw = t.bmc.secret()
    if not pw:
        raise TorchrigError(f"bmc.password_env {t.bmc.password_env!r} is not set in this "
                            "machine's environment; export it with the BMC's password")
    return pw


def ipmi_call(t: Target) -> str:
    pw = password(t)
    ipmi.check_password(pw)
    # the password reaches ipmitool in its environment only (-E), never in argv
    env = {**os.environ, ipmi.PASSWORD_ENV: pw}
    try:
        r = subprocess.run(ipmi.argv(t.bmc, t.action), env=env, capture_output=True, text=True,
                           errors="replace", timeout=CALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise TorchrigError("ipmitool is not installed on this machine: apt-get install "
                            "ipmitool") from None
    except subprocess.TimeoutExpired:
        raise TorchrigError(f"the BMC did not answer within {CALL_TIMEOUT_S} s") from None
    if r.returncode != 0:
        raise TorchrigError(ipmi.explain_failure(r.stderr, r.returncode,
                                                 t.bmc.port or ipmi.DEFAULT_PORT))
    return ipmi.parse_reply(t.action, r.stdout)


def redfish_call(t: Target) -> str:
    pw = password(t)
    # the password stays in this process (sushy's HTTP auth), never a command line
    import requests
    import sushy
    from sushy import exceptions
    log = logging.getLogger("sushy")
    log.propagate = False  # its own lines would bypass the redactor: errors come as exceptions
    if not log.handlers:
        log.addHandler(logging.NullHandler())
    url = redfish.base_url(t.bmc)
    try:
        with warnings.catch_warnings():  # tls_verify: false was the inventory's choice
            warnings.simplefilter("ignore", requests.packages.urllib3.exceptions.InsecureRequestWarning)
            root = sushy.Sushy(url + "/redfish/v1", auth=sushy.auth.BasicAuth(t.bmc.user, pw),
                               verify=redfish.tls_verify(t.bmc), server_side_retries=0,
                               connect_timeout=10, read_timeout=CALL_TIMEOUT_S)
            systems = root.get_system_collection()
            ident = redfish.pick_system([m.rstrip("/").rsplit("/", 1)[-1]
                                         for m in systems.members_identities], t.bmc.system)
            system = root.get_system(f"{systems.path.rstrip('/')}/{ident}")
            if t.action == "status":
                return redfish.state_word(system.power_state and system.power_state.value)
            allowed = {v.value for v in system.get_allowed_reset_system_values()}
            rt = redfish.reset_type(t.action, allowed)
            system.reset_system(sushy.ResetType(rt))
            return f"{t.action} accepted ({rt})"
    except (exceptions.SushyError, ValueError) as e:
        raise TorchrigError(redfish.explain(type(e).__name__, str(e), url)) from None


CALLS = {"ipmi": ipmi_call, "redfish": redfish_call}


def power(targets: list[Target], parallel: int) -> list[Result]:
    """Every target at once (up to `parallel`); one Result per host, in order."""
    return fan_out(targets, lambda t: CALLS[t.bmc.protocol](t), parallel,
                   name=lambda t: t.host)
