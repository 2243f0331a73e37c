"""`power`'s effects: ipmitool for each target, concurrently, each host's outcome reported."""

from __future__ import annotations

import os
import subprocess

from ..errors import TorchrigError
from ..session import Result, fan_out
from . import ipmi
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


CALLS = {"ipmi": ipmi_call}


def power(targets: list[Target], parallel: int) -> list[Result]:
    """Every target at once (up to `parallel`); one Result per host, in order."""
    return fan_out(targets, lambda t: CALLS[t.bmc.protocol](t), parallel,
                   name=lambda t: t.host)
