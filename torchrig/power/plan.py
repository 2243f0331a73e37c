"""What `power` will do: the action, checked, and each selected host's BMC. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import TorchrigError
from ..inventory import Bmc

ACTIONS = ("status", "on", "off", "cycle")
READ_ONLY = ("status",)  # every other action cuts or restores power: it needs --yes


@dataclass(frozen=True)
class Target:
    host: str
    bmc: Bmc
    action: str

    @property
    def where(self) -> str:
        """How every line names it: the host and its BMC's address (never the password)."""
        port = f":{self.bmc.port}" if self.bmc.port else ""
        return f"{self.host} (BMC {self.bmc.address}{port})"


def check_action(action: str) -> str:
    if action not in ACTIONS:
        raise TorchrigError(f"power {action!r}: unknown action; expected one of "
                            f"{', '.join(ACTIONS)} (e.g. torchrig power status --host gpu3)")
    return action


def plan(hosts, action: str, path: str) -> list[Target]:
    """One target per selected host; a host without `bmc:` is refused, naming what to add."""
    check_action(action)
    missing = [h.name for h in hosts if h.bmc is None]
    if missing:
        which = (f"host {missing[0]!r} has" if len(missing) == 1 else
                 f"hosts {', '.join(map(repr, missing))} have")
        raise TorchrigError(f"{path}: {which} no 'bmc:' (address, user, password_env): add it "
                            "to power-control a host out of band, or leave the host out of "
                            "--host")
    return [Target(h.name, h.bmc, action) for h in hosts]


def refuse_without_yes(targets: list[Target], yes: bool) -> None:
    if targets and targets[0].action not in READ_ONLY and not yes:
        action = targets[0].action
        names = ",".join(t.host for t in targets)
        raise TorchrigError(f"power {action} switches the power of {names} through its BMC "
                            f"(a running job there dies); run it again with --yes to do it")
