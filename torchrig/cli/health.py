"""health: each GPU's health on the selected hosts, PASS / WARN / FAIL with what to do."""

from __future__ import annotations

import json

from invoke import Exit

from .common import _fleet, _log, _redactor, _warm, fleet_task

DIAG_HELP = "also run DCGM's diagnostic, `dcgmi diag -r N` (1: seconds, 2: minutes, 3: ~10 min)"


def diag_level(diag) -> int | None:
    """--diag's level, or one error line."""
    from torchrig.errors import TorchrigError
    from torchrig.facts.health_facts import DIAG_LEVELS
    if diag is None:
        return None
    if str(diag) not in {str(n) for n in DIAG_LEVELS}:
        raise TorchrigError(f"--diag {diag!r}: 1, 2 or 3 (dcgmi diag's run levels)")
    return int(diag)


@fleet_task(help={"json": "print the report as JSON",
                  "since": "Xid events since this time (ISO, UTC unless it has a zone: "
                           "2026-12-03T14:00) or age (30m, 2h, 1d); default: since boot",
                  "diag": DIAG_HELP,
                  "resume": "a Slurm compute node launch drained for its health: resume it "
                            "(refused while its health is still FAIL)"})
def health(c, inventory=None, host=None, json_=False, since=None, diag=None, resume=None,
           accept_new_host_keys=False):
    """Xid errors, ECC and row remapping, NVLink, PCIe and clock slowdowns per GPU (DCGM with
    --diag): PASS / WARN / FAIL and what to do; exits 1 on a FAIL."""
    from torchrig.errors import TorchrigError
    from torchrig.facts import xid
    from torchrig.verify import health_run
    if resume:
        from torchrig.launch import health_gate
        with _fleet(c, inventory, resume, accept_new_host_keys) as fleet:
            if len(fleet.hosts) != 1:
                raise TorchrigError(f"--resume {resume!r}: one Slurm node")
            health_gate.resume(fleet, fleet.hosts[0], log=_log)
        return
    _warm("torchrig.tables")
    try:
        when = xid.parse_since(since) if since else None
    except ValueError as e:
        raise TorchrigError(str(e)) from None
    level = diag_level(diag)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        red = _redactor(fleet.inv)
        rep = health_run.check(fleet, fleet.hosts, when, level, red)
    render(rep, red, json_, "health")


def render(rep, red, json_: bool, what: str) -> None:
    """verify's and health's report: the tables or --json, and exit 1 unless it passed."""
    from torchrig import tables
    if json_:
        print(json.dumps(red.data(rep.as_dict()), indent=2, default=str))
    else:
        tables.verify_report(rep)
    if not rep.ok:
        raise Exit(f"error: {what} " + rep.status + ": " + "; ".join(rep.failures), code=1)
