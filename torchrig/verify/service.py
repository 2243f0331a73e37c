"""`torchrig verify` as one service: the report over the fleet's selected hosts and, with the
bandwidth sweeps, their records kept on this machine for `torchrig report` (the nodes keep
nothing of them). A typed, redacted result; the task (cli/verify.py) renders it and picks the
exit status."""

from __future__ import annotations

from ..secrets import Redactor
from ..session import Fleet
from . import run, store


def verify(fleet: Fleet, bandwidth: bool = False, red: Redactor | None = None,
           diag: int | None = None) -> run.VerifyReport:
    rep = run.verify(fleet, fleet.hosts, bandwidth=bandwidth, diag=diag)
    if bandwidth:
        store.save(rep.bandwidth, {h.name: h.address for h in fleet.hosts})
    rep.redact(red or Redactor())
    return rep
