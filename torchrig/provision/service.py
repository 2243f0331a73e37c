"""provision as one service: plan every selected host, check a saved plan, apply the plans the
operator saw. Typed results only; the task (cli/provision.py) asks, renders and picks the exit
status. Everything a result holds for display has been through the one redactor."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..changes.factview import what_changed
from ..secrets import Redactor
from ..session import Fleet
from . import aptshare, planfile, wheelshare
from .apply import HostReport, Planned, apply_host, merge_steps, plan_hosts, scripts_for_digest


@dataclass
class FleetPlan:
    """Phase 1 over the fleet: a plan per host that has one; a report per host that has none
    (unreachable, refused by preflight, or no longer matching a saved plan)."""

    planned: list[Planned]
    failed: list[HostReport] = field(default_factory=list)
    red: Redactor = field(default_factory=Redactor, repr=False)

    @property
    def todo(self) -> list[Planned]:
        """The hosts whose plan changes something."""
        return [p for p in self.planned if p.plan.changes_anything]

    @property
    def ok(self) -> bool:
        return not self.failed

    def reports(self) -> list[HostReport]:
        """Every host's plan as the operator reads it, redacted; hosts without one last."""
        return [self.red.data(p.report) for p in self.planned] + self.failed

    def as_dict(self) -> list[dict]:
        return [r.as_dict() for r in self.reports()]


@dataclass
class ProvisionResult:
    """Phase 2: what apply did on each host (redacted)."""

    reports: list[HostReport]
    wheels: dict = field(default_factory=dict)   # wheelshare.Meet's account, per set
    debs: dict = field(default_factory=dict)     # aptshare.Meet's account, per set

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports)

    @property
    def changed(self) -> int:
        return sum(r.changed for r in self.reports)

    @property
    def failed(self) -> list[HostReport]:
        return [r for r in self.reports if not r.ok]

    def as_dict(self) -> list[dict]:
        return [r.as_dict() for r in self.reports]


def plan(fleet: Fleet, red: Redactor, saved: planfile.SavedPlan | None = None) -> FleetPlan:
    """Gather every selected host's facts (one round trip each, in parallel) and plan; with a
    saved plan, keep only the hosts whose plan is still exactly the saved one."""
    gathered = plan_hosts(fleet)
    planned = [r.value for r in gathered if r.ok and r.value.report.ok]
    failed = [HostReport(r.host, ok=False, error=r.error) for r in gathered if not r.ok]
    failed += [r.value.report for r in gathered if r.ok and not r.value.report.ok]
    fp = FleetPlan(planned, red.data(failed), red)
    if saved is not None:
        fp = against_saved(fp, saved)
    return fp


def against_saved(fp: FleetPlan, saved: planfile.SavedPlan) -> FleetPlan:
    """The plans that match the saved plan: same facts (fingerprint) and the same plan built
    from them (digest); every other host is refused with what differs, nothing applied."""
    keep, failed = [], list(fp.failed)
    for p in fp.planned:
        why = mismatch(p, fp.red, saved)
        if why:
            failed.append(HostReport(p.host.name, ok=False, error=why,
                                     fingerprint=p.plan.fingerprint))
        else:
            keep.append(p)
    return FleetPlan(keep, failed, fp.red)


def mismatch(p: Planned, red: Redactor, saved: planfile.SavedPlan) -> str | None:
    """Why the host's plan now is not the saved one, or None when it is."""
    entry = saved.hosts.get(p.host.name)
    again = ("nothing was applied; review a new plan (torchrig provision --dry-run --save-plan "
             f"{saved.path})")
    if entry is None:
        return (f"not in the saved plan {saved.path} (it has "
                f"{', '.join(sorted(saved.hosts))}); nothing was applied")
    if p.plan.fingerprint != entry.fingerprint:
        what = what_changed(entry.facts, planfile.fact_digests(p.ctx.facts.raw))
        return (f"the host changed since the plan was saved ({saved.created}; "
                + (", ".join(what) if what else f"fingerprint {entry.fingerprint} -> "
                   f"{p.plan.fingerprint}")
                + "): " + again)
    if planfile.plan_digest(red.data(p.report), scripts_for_digest(p, red)) != entry.digest:
        return (f"the host's facts match the saved plan but the plan made from them now differs "
                f"(the inventory, its settings, the payload or torchrig itself changed since "
                f"{saved.created}): "
                + again)
    return None


def save(fp: FleetPlan, path: str) -> int:
    """Write the fleet's plan to `path` (0600, atomically); the number of hosts saved."""
    entries = []
    for p in fp.planned:
        rep = fp.red.data(p.report)
        entries.append(planfile.SavedHost(p.host.name, p.plan.fingerprint,
                                          planfile.plan_digest(rep, scripts_for_digest(p, fp.red)),
                                          planfile.fact_digests(p.ctx.facts.raw), rep.as_dict()))
    planfile.write(path, planfile.dumps(entries))
    return len(entries)


def apply(fleet: Fleet, fp: FleetPlan, reboot: bool, progress=None) -> ProvisionResult:
    """Apply each host's plan (apply_host refuses one whose facts moved since); the hosts
    that had no plan keep their reports. The .debs and the wheels several hosts install are
    fetched once and shared where the hosts meet before their apt and their pip installs
    (aptshare.py, wheelshare.py)."""
    meet = aptshare.Meet(fleet, fp.planned, progress, fp.red)
    wheel_meet = wheelshare.Meet(fleet, fp.planned, progress, fp.red)
    applied = fleet.fan_out(lambda p: apply_host(fleet, p, reboot, progress, meet, wheel_meet),
                            fp.planned, name=lambda p: p.host.name)
    reports = [r.value if r.ok else HostReport(r.host, ok=False, error=r.error) for r in applied]
    if any(p.ctx.cluster and p.ctx.cluster.blocked for p in fp.planned) and \
            any(r.rebooted for r in reports):
        reports = cluster_after_reboots(fleet, reports, progress)
    return ProvisionResult(fp.red.data(reports) + fp.failed, fp.red.data(wheel_meet.account()),
                           fp.red.data(meet.account()))


def cluster_after_reboots(fleet: Fleet, reports: list[HostReport], progress=None) -> list[HostReport]:
    """The Slurm cluster waited for a node's driver, which the reboots have loaded: a host's
    own re-plan after its reboot cannot do that part (slurm.conf describes every node, and the
    others may still be rebooting then), so once every host is back, plan the selected hosts
    again and apply what remains on those that succeeded, in the same reports."""
    ok = {r.host for r in reports if r.ok}
    again = {r.host: r for r in plan_hosts(fleet) if r.host in ok}
    todo = []
    for host, r in again.items():
        if not r.ok or not r.value.report.ok:
            rep = next(x for x in reports if x.host == host)
            rep.ok, rep.error = False, r.error if not r.ok else r.value.report.error
        elif r.value.plan.changes_anything:
            if progress:
                progress.note(host, "every driver is loaded: applying what waited for it")
            todo.append(r.value)
    done = {r.host: r for r in fleet.fan_out(lambda p: apply_host(fleet, p, False, progress), todo,
                                            name=lambda p: p.host.name)}
    for rep in reports:
        r = done.get(rep.host)
        if r is None:
            continue
        if not r.ok:
            rep.ok, rep.error = False, r.error
            continue
        rep.steps = merge_steps(rep.steps, r.value.steps)
        rep.ok, rep.error = r.value.ok, r.value.error
        rep.seconds = round(rep.seconds + r.value.seconds, 2)
    return reports
