"""One walk over the steps: what each would change on a host, with why it waits or is
skipped. The plan an operator reads and the run that applies it come from the same walk
(each planner runs once per set of facts), and the plan carries a fingerprint of the facts it
was built from, so apply can refuse a host that changed in between."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..changes.factview import fingerprint
from ..changes.model import FileChange
from .steps import STEPS, Change, Ctx, Step, driver_state, preflight


@dataclass
class StepPlan:
    step: Step
    status: str                       # planned | ok | skipped
    changes: list[Change] = field(default_factory=list)
    reason: str | None = None         # why skipped, or why it may have to wait

    def describe(self) -> list[str]:
        return [c.describe() for c in self.changes]

    def diffs(self) -> list[str]:
        return [c.diff() for c in self.changes if isinstance(c, FileChange)]


@dataclass
class Plan:
    host: str
    fingerprint: str                  # of the facts this plan was built from
    driver: str                       # driver state then: 'ok' or a failure kind
    problems: list[str] = field(default_factory=list)   # preflight refusals: nothing planned
    steps: list[StepPlan] = field(default_factory=list)

    @property
    def changes_anything(self) -> bool:
        return any(sp.status == "planned" for sp in self.steps)


def walk(ctx: Ctx, driver: str) -> Iterator[StepPlan]:
    """Each step's plan, in order. A step that needs the driver and has work to do while
    the driver is not usable says so (apply skips it until after a reboot)."""
    for step in STEPS:
        skip = step.enabled(ctx)
        if skip:
            yield StepPlan(step, "skipped", reason=skip)
            continue
        changes = step.plan(ctx)
        reason = None
        if step.needs_driver and changes and driver != "ok":
            reason = f"needs the driver loaded (now: {driver}); a reboot may be needed"
        yield StepPlan(step, "planned" if changes else "ok", changes, reason)


def build_plan(ctx: Ctx, check_preflight: bool = True) -> Plan:
    driver, _ = driver_state(ctx.facts)
    plan = Plan(ctx.host, fingerprint(ctx.facts.raw), driver)
    plan.problems = preflight(ctx) if check_preflight else []
    if not plan.problems:
        plan.steps = list(walk(ctx, driver))
    return plan
