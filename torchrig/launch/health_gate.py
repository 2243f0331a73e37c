"""launch's health gate: before anything starts, a node whose GPU health is FAIL is refused
with one error naming the host, the GPU and the reason, or left out (--skip-unhealthy, said
so), before --nodes picks them. Health's commands (verify/health_run.py) run as root in the
launch's first probe of each node (run.py); a Slurm launch gathers them in a probe of their own.
With the Slurm backend the node is also drained on the controller with the reason, and
`torchrig health --resume NODE` resumes it once its health is no longer FAIL."""

from __future__ import annotations

from ..errors import TorchrigError
from ..inventory import Host
from ..quoting import sh
from ..session import Fleet
from ..verify import health, health_run

REASON_MAX = 200  # Slurm shows the reason in sinfo -R: the first finding, cut


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


def gate(fleet: Fleet, hosts: list[Host], skip: bool = False, log=print,
         slurm: bool = False) -> list[Host]:
    """The hosts a job may use: all of them, or (skip) the healthy ones; else one error.
    slurm: the unhealthy compute nodes are drained first (Slurm schedules nothing there)."""
    if not hosts:  # nothing to judge (launch's own checks name an empty selection)
        return hosts
    return judge(fleet, health_run.check(fleet, hosts), hosts, skip, log, slurm)


def judge(fleet: Fleet, rep, hosts: list[Host], skip: bool = False, log=print,
          slurm: bool = False) -> list[Host]:
    """gate()'s verdict on a health report already gathered (a systemd launch gathers it in
    its one probe per node: run.py)."""
    if rep.unreachable:  # as launch's own gate words it
        raise TorchrigError("nothing started: " + "; ".join(
            f"{h}: {e}" for h, e in rep.unreachable.items()))
    bad = unhealthy(rep)
    if not bad:
        return hosts
    if slurm:
        for name, reasons in bad.items():
            drain(fleet, name, reasons[0], log)
    why = "; ".join(f"{h}: " + "; ".join(reasons) for h, reasons in bad.items())
    if not skip:
        raise TorchrigError(f"nothing started: unhealthy node(s): {why} (--skip-unhealthy "
                            f"leaves them out; `torchrig health -H {','.join(bad)}` shows all)")
    kept = [h for h in hosts if h.name not in bad]
    if not kept:
        raise TorchrigError(f"nothing started: every selected node is unhealthy: {why}")
    log(f"left out unhealthy node(s) {', '.join(bad)}: {why}")
    return kept


def gate_slurm(fleet: Fleet, hosts: list[Host], skip: bool = False, log=print) -> list[Host]:
    """gate() for a Slurm job: the selected compute nodes are judged (and drained when
    unhealthy); the other hosts pass through (the controller runs no job step)."""
    compute = set(fleet.inv.slurm.compute) if getattr(fleet.inv, "slurm", None) else set()
    ok = gate(fleet, [h for h in hosts if h.name in compute], skip, log, slurm=True)
    return [h for h in hosts if h.name not in compute or h in ok]


def _scontrol(fleet: Fleet, node: str, state: str, *more: str) -> None:
    ctl = fleet.inv.host(fleet.inv.slurm.controller)
    r = fleet.run(ctl, sh("scontrol", "update", f"nodename={node}", f"state={state}", *more),
                  root=True, timeout=30)
    if r.exited != 0:
        raise TorchrigError(f"scontrol update nodename={node} state={state} on {ctl.name} "
                            f"failed: {(r.stderr or r.stdout).strip()[-300:]}")


def drain(fleet: Fleet, node: str, reason: str, log=print) -> None:
    """Drain a compute node of the inventory's Slurm cluster with the health finding as the
    reason (sh() quotes it: it quotes a node's text)."""
    if node not in fleet.inv.slurm.compute:
        return
    _scontrol(fleet, node, "drain", "reason=torchrig health: " + " ".join(reason.split())[:REASON_MAX])
    log(f"drained Slurm node {node} (torchrig health: {reason[:REASON_MAX]}); "
        f"`torchrig health --resume {node}` once fixed")


def resume(fleet: Fleet, host: Host, log=print) -> None:
    """`health --resume NODE`: resume the drained node, unless its health is still FAIL."""
    s = getattr(fleet.inv, "slurm", None)
    if s is None or host.name not in s.compute:
        raise TorchrigError(f"--resume {host.name}: not a compute node of the inventory's "
                            "`slurm:` cluster (only Slurm nodes are drained)")
    rep = health_run.check(fleet, [host])
    if rep.unreachable:
        raise TorchrigError(f"{host.name}: {rep.unreachable[host.name]}")
    bad = unhealthy(rep).get(host.name)
    if bad:
        raise TorchrigError(f"--resume {host.name}: its health is still FAIL: {'; '.join(bad)}")
    _scontrol(fleet, host.name, "resume")
    log(f"resumed Slurm node {host.name}")
