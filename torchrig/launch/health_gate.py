"""launch's health gate: before anything starts, a node whose GPU health is FAIL is refused
with one error naming the host, the GPU and the reason, or left out (--skip-unhealthy, said
so). One root probe round trip per node (verify/health_run.py), before --nodes picks them."""

from __future__ import annotations

from ..errors import TorchrigError
from ..inventory import Host
from ..session import Fleet
from ..verify import health, health_run


def unhealthy(rep) -> dict[str, list[str]]:
    """{host: ["check: detail", ...]} of the report's FAILs in the checks a job must not land
    on (health's own, and uncorrectable ECC errors now)."""
    out = {}
    for v in rep.hosts:
        bad = [f"{c.name}: {c.detail}" for c in v.checks
               if c.status == "FAIL" and c.name in health.GATE_CHECKS]
        if bad:
            out[v.host] = bad
    return out


def gate(fleet: Fleet, hosts: list[Host], skip: bool = False, log=print) -> list[Host]:
    """The hosts a job may use: all of them, or (skip) the healthy ones; else one error."""
    rep = health_run.check(fleet, hosts)
    if rep.unreachable:  # as launch's own gate words it
        raise TorchrigError("nothing started: " + "; ".join(
            f"{h}: {e}" for h, e in rep.unreachable.items()))
    bad = unhealthy(rep)
    if not bad:
        return hosts
    why = "; ".join(f"{h}: " + "; ".join(reasons) for h, reasons in bad.items())
    if not skip:
        raise TorchrigError(f"nothing started: unhealthy node(s): {why} (--skip-unhealthy "
                            f"leaves them out; `torchrig health -H {','.join(bad)}` shows all)")
    kept = [h for h in hosts if h.name not in bad]
    if not kept:
        raise TorchrigError(f"nothing started: every selected node is unhealthy: {why}")
    log(f"left out unhealthy node(s) {', '.join(bad)}: {why}")
    return kept
