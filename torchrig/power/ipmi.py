"""IPMI over LAN through ipmitool (Debian's package, on the operator's machine): its command
line and the reading of its replies. Pure. The password never goes on the command line: `-E`
makes ipmitool read it from IPMI_PASSWORD in its environment (run.py sets it there only)."""

from __future__ import annotations

import re

from ..errors import TorchrigError
from ..inventory import Bmc

PASSWORD_ENV = "IPMI_PASSWORD"  # what ipmitool -E reads
DEFAULT_PORT = 623
MAX_PASSWORD = 20  # IPMI 2.0 passwords are at most 20 bytes (ipmitool refuses longer ones)
# ipmitool's own retry: -N seconds per try, -R tries. A BMC on its management LAN answers in
# milliseconds; with these a dead one is reported in about 6 s (ipmitool's defaults: 20 s).
TIMEOUT_S, RETRIES = 1, 2

STATUS_RE = re.compile(r"^Chassis Power is (on|off)\s*$", re.M)
CONTROL_RE = re.compile(r"^Chassis Power Control: (\S.*)$", re.M)


def argv(bmc: Bmc, action: str) -> list[str]:
    """ipmitool's command line for `chassis power ACTION` (lanplus: IPMI 2.0, RMCP+)."""
    cmd = ["ipmitool", "-I", "lanplus", "-H", bmc.address, "-p", str(bmc.port or DEFAULT_PORT),
           "-U", bmc.user, "-E", "-N", str(TIMEOUT_S), "-R", str(RETRIES)]
    if bmc.cipher_suite is not None:
        cmd += ["-C", str(bmc.cipher_suite)]
    return cmd + ["chassis", "power", action]


def check_password(password: str) -> None:
    if len(password.encode()) > MAX_PASSWORD:
        raise TorchrigError(f"the BMC password is longer than IPMI's {MAX_PASSWORD} bytes; "
                            "set a shorter one on the BMC and in the inventory")


def parse_reply(action: str, stdout: str) -> str:
    """The power state ('on'/'off') for status, the BMC's acknowledgement otherwise."""
    m = (STATUS_RE if action == "status" else CONTROL_RE).search(stdout)
    if not m:
        raise TorchrigError(f"ipmitool's reply to chassis power {action} is not one it "
                            f"gives: {stdout.strip()[:200]!r}")
    return m.group(1) if action == "status" else f"{action} accepted ({m.group(1).strip()})"


def explain_failure(stderr: str, code: int, port: int) -> str:
    """ipmitool's failure in words an operator can act on (without the password: ipmitool
    never prints it, and the caller redacts the line anyway)."""
    text = stderr.strip()
    if "Address lookup for" in text:  # (followed by "Unable to establish ...")
        return "the BMC's address does not resolve on this machine; fix bmc.address"
    if "Unable to establish" in text:
        return ("no IPMI session: wrong user or password, or no IPMI-over-LAN answer on UDP "
                f"port {port}; check bmc.user and its password, that IPMI over LAN is enabled "
                "on the BMC and that this machine reaches it")
    if "Password is too long" in text:
        return f"the password is longer than IPMI's {MAX_PASSWORD} bytes"
    last = text.splitlines()[-1] if text else "no message"
    return f"ipmitool failed (exit {code}): {last[:300]}"
