"""verify's checks of the inventory's Slurm cluster: every compute node registered and idle
with the GPUs verify found as GRES, munge credentials accepted both ways between the
controller and each compute node, and a two-node srun. cluster_checks() is the edge (SSH);
the judging is pure."""

from __future__ import annotations

from ..facts import slurm as facts
from ..quoting import sh
from ..session import CannotConnect, describe_error
from .evaluate import Check

SRUN_TIMEOUT_S = 60


def node_checks(sinfo: dict[str, facts.NodeState], compute: list[str],
                gpus_found: dict[str, int]) -> list[Check]:
    """sinfo against the inventory: registered, idle, GRES = the GPUs verify counted."""
    out = []
    for name in compute:
        n = sinfo.get(name)
        if n is None:
            out.append(Check(f"slurm node {name}", "FAIL", "not registered with slurmctld "
                             "(not in sinfo): run `torchrig provision` on the cluster's hosts"))
            continue
        problems = []
        if not n.idle:
            problems.append(f"state {n.state}" + (f" ({n.reason})" if n.reason not in ("", "none") else "")
                            + ("" if n.state in ("mixed", "allocated") else
                               f": `scontrol update nodename={name} state=resume` once fixed"))
        want = gpus_found.get(name)
        if want is not None and n.gpus != want:
            problems.append(f"GRES gpu:{n.gpus} but verify found {want} GPU(s): reprovision "
                            "so slurm.conf and gres.conf match the host")
        out.append(Check(f"slurm node {name}", "FAIL" if problems else "PASS",
                         "; ".join(problems) or f"idle, gpu:{n.gpus}"))
    return out


def munge_check(results: dict[tuple[str, str], tuple[bool, str]]) -> Check:
    """results[(encoder, decoder)] = unmunge's verdict."""
    bad = [f"{a} -> {b}: {why}" for (a, b), (ok, why) in results.items() if not ok]
    return Check("munge", "FAIL" if bad else "PASS",
                 "; ".join(bad) + (" (same /etc/munge/munge.key everywhere? clocks in sync? "
                                   "`torchrig provision` distributes the key)" if bad else "")
                 or f"{len(results)} credential(s) decoded across the cluster")


def srun_check(rc: int, out: str, err: str, nodes: list[str]) -> Check:
    got = sorted(set(out.split()))
    if rc == 0 and got == sorted(nodes):
        return Check("slurm srun", "PASS", f"ran on {', '.join(got)}")
    why = (err.strip().splitlines() or [f"exit {rc}"])[-1]
    return Check("slurm srun", "FAIL", f"srun on {', '.join(nodes)}: {why}"
                 + (f" (ran on: {', '.join(got)})" if got else ""))


def cluster_checks(fleet, hosts, gpus_found: dict[str, int]) -> list[Check]:
    """The checks above on the selected compute hosts (the controller is asked too)."""
    s = fleet.inv.slurm
    compute = [h.name for h in hosts if h.name in s.compute]
    if not compute:
        return []
    ctl = fleet.inv.host(s.controller)
    try:
        r = fleet.run(ctl, sh(*facts.SINFO), timeout=30)
    except CannotConnect as e:  # the cluster cannot be checked; the hosts' report stands
        return [Check("slurm", "FAIL", f"controller {ctl.name}: {e.reason}")]
    if r.exited != 0:
        return [Check("slurm", "FAIL", f"sinfo on {ctl.name}: {r.stderr.strip()[-200:]} "
                      "(slurmctld running? `torchrig provision`)")]
    checks = node_checks(facts.parse_sinfo(r.stdout), compute, gpus_found)
    checks.append(munge_check(_munge(fleet, ctl, [fleet.inv.host(c) for c in compute
                                                  if c != ctl.name])))
    idle = [c.name.split()[-1] for c in checks if c.name.startswith("slurm node ") and c.status == "PASS"]
    if len(idle) >= 2:
        pair = idle[:2]
        user = fleet.inv.host(pair[0]).settings.service_user
        try:
            r = fleet.run(ctl, "cd / && " + sh("runuser", "-u", user, "--", "srun", "--nodes=2",
                                               "--ntasks-per-node=1", f"--nodelist={','.join(pair)}",
                                               "--time=1", "hostname", "--short"),
                          root=True, timeout=SRUN_TIMEOUT_S)
        except CannotConnect as e:
            checks.append(Check("slurm srun", "FAIL", f"controller {ctl.name}: {e.reason}"))
        else:
            checks.append(srun_check(r.exited, r.stdout, r.stderr, pair))
    return checks


def _munge(fleet, ctl, computes) -> dict[tuple[str, str], tuple[bool, str]]:
    """A credential made on one host, decoded on the other, both ways per compute host. The
    credential travels on stdin through the operator's session: never in an argv."""
    def cred(h):
        r = fleet.run(h, "munge --no-input", timeout=30)
        return r.stdout if r.exited == 0 else None

    def decode(h, c):
        if c is None:
            return False, "munge could not make a credential (munged running?)"
        r = fleet.run(h, "unmunge", timeout=30, data=c)
        return facts.unmunge_ok(r.stdout + r.stderr)

    out = {}
    for h in computes:
        for a, b in ((ctl, h), (h, ctl)):
            try:
                out[(a.name, b.name)] = decode(b, cred(a))
            except Exception as e:  # noqa: BLE001 - an unreachable host is a failed check
                out[(a.name, b.name)] = (False, describe_error(e))
    return out
