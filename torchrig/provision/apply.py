"""provision's effects: gather facts (one round trip), plan, apply step by step, reboot."""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

from ..errors import TorchrigError
from ..facts import probe, provision_facts
from ..inventory import Host
from ..onhost import script
from ..connections import login_user
from ..quoting import sh
from ..resources import PAYLOAD
from ..session import Result, describe_error
from ..secrets import Redactor
from ..session import Fleet
from ..changes.factview import fingerprint, what_changed
from ..changes.model import AptInstall, FileChange, b64
from . import firewall, slurm
from .desired import Settings
from .engine import Plan, build_plan
from .live import StepProgress
from .steps import Ctx, Step, Upload, driver_state, fact_request
from .wheels import STEP as WHEELS_STEP

PAYLOAD_REQUIREMENTS = PAYLOAD / "requirements.txt"


def payload_requirements() -> list[str]:
    try:
        lines = PAYLOAD_REQUIREMENTS.read_text().splitlines()
    except OSError:
        return []
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def run_root_script(cxn, script: str, timeout: int = 3600):
    """A bash script run as root, sent on stdin: nothing of it (file contents, credentials)
    appears in any process's command line on the host."""
    return cxn.run_input("bash -s", script, timeout, root=True)


def gather(cxn, s: Settings) -> dict:
    """Every fact the planners need, in one round trip: the probe runs the commands as root
    and returns raw text; facts/provision_facts parses it here."""
    want = fact_request(s)
    r = cxn.run_input(probe.COMMAND, probe.stdin(provision_facts.probe_request(want)),
                      timeout=120, root=True)
    return provision_facts.facts(want, probe.reply(r.exited, r.stdout, r.stderr))


@dataclass
class StepResult:
    name: str
    status: str                      # changed | ok | skipped | failed | planned
    seconds: float = 0.0
    changes: list[str] = field(default_factory=list)
    diffs: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class HostReport:
    host: str
    ok: bool = True
    steps: list[StepResult] = field(default_factory=list)
    error: str | None = None
    reboot_required: bool = False
    rebooted: bool = False
    seconds: float = 0.0
    fingerprint: str | None = None   # of the facts the plan was built from (--json, saved plans)

    @property
    def changed(self) -> int:
        return sum(1 for s in self.steps if s.status == "changed")

    def as_dict(self) -> dict:
        return asdict(self) | {"changed": self.changed}


@dataclass
class Planned:
    """Phase 1 for one host: facts and the plan, nothing changed yet."""
    host: Host
    settings: Settings
    ctx: Ctx
    plan: Plan

    @cached_property
    def report(self) -> HostReport:
        return plan_report(self.plan)


def plan_hosts(fleet: Fleet) -> list[Result]:
    """Phase 1 for the selected hosts: each one's facts (one round trip per host); with an
    inventory `slurm:` cluster among them, the cluster planned over all its hosts' facts
    (slurm.conf lists every node); then each host's plan. A Result per host (value: Planned)."""
    peers = firewall.fleet_addresses(fleet.inv)
    got = fleet.fan_out(lambda h: Ctx(gather(fleet.conn(h), h.settings), h.settings, h.name,
                                      payload_requirements(), address=h.address, fleet=peers,
                                      login=login_user(fleet.conn(h)), ssh_port=h.port or 22))
    spec = fleet.inv.slurm
    cluster = None
    if spec and any(h.name in spec.hosts for h in fleet.hosts):
        cluster = slurm.plan_cluster(spec, {r.host: r.value.facts for r in got if r.ok})
    for r in got:
        if r.ok:
            ctx, host = r.value, fleet.inv.host(r.host)
            ctx.cluster = cluster
            try:
                r.value = Planned(host, host.settings, ctx, build_plan(ctx))
            except Exception as e:  # noqa: BLE001 - as fan_out does: that host fails, not all
                r.ok, r.value, r.error = False, None, describe_error(e)
    return got


def plan_report(plan: Plan) -> HostReport:
    """The plan as an operator reads it (rows with changes and file diffs)."""
    rep = HostReport(plan.host, fingerprint=plan.fingerprint)
    if plan.problems:
        rep.ok = False
        rep.error = "preflight: " + "; ".join(plan.problems)
        rep.steps.append(StepResult("preflight", "failed", error="; ".join(plan.problems)))
        return rep
    rep.steps.append(StepResult("preflight", "ok"))
    rep.steps += [StepResult(sp.step.name, sp.status, changes=sp.describe(), diffs=sp.diffs(),
                             error=sp.reason) for sp in plan.steps]
    return rep


def make_plan(ctx: Ctx) -> HostReport:
    return plan_report(build_plan(ctx))


def apply_host(fleet: Fleet, p: Planned, reboot: bool,
               progress: StepProgress | None = None, meet=None, wheel_meet=None) -> HostReport:
    """Apply the plan the operator saw, once the host's facts still match it; reboot (with
    --reboot) when the driver needs it, then gather again and apply what remains. Each step's
    start and end go to `progress` (see live.py). `meet` (aptshare.Meet): the host arrives
    there before its first apt install; `wheel_meet` (wheelshare.Meet) before its pip
    install; it leaves both when this ends."""
    try:
        return _apply_host(fleet, p, reboot, progress, meet, wheel_meet)
    finally:
        for m in (meet, wheel_meet):
            if m is not None:
                m.left(p)


def _apply_host(fleet: Fleet, p: Planned, reboot: bool, progress: StepProgress | None,
                meet, wheel_meet=None) -> HostReport:
    t0 = time.monotonic()
    host, s, plan = p.host, p.settings, p.plan
    progress = progress or StepProgress()
    rep = HostReport(host.name, fingerprint=plan.fingerprint)
    if not plan.changes_anything:  # nothing to apply: no second round trip
        rep.steps = [StepResult("preflight", "ok")] + [
            StepResult(sp.step.name, sp.status, error=sp.reason) for sp in plan.steps]
        rep.seconds = round(time.monotonic() - t0, 2)
        return rep
    try:
        cxn = fleet.conn(host)
        now = gather(cxn, s)
        if fingerprint(now) != plan.fingerprint:
            raise TorchrigError(
                "the host changed since the plan was made ("
                + ", ".join(what_changed(p.ctx.facts.raw, now)) + "): nothing was applied; "
                "rerun provision to see the new plan")
        ctx = p.ctx
        first: list[StepResult] | None = None
        for attempt in range(2):
            rep.steps = [StepResult("preflight", "ok")]
            before_apt = (lambda: meet.arrive(p)) if meet is not None and first is None else None
            before_pip = (lambda: wheel_meet.arrive(p)) if wheel_meet is not None else None
            pending_reboot = _apply_plan(cxn, plan, s, rep, progress, before_apt, before_pip)
            if first is not None:
                rep.steps = merge_steps(first, rep.steps)
            if pending_reboot and rep.rebooted:
                # booted with the new driver installed and still no usable module: rebooting
                # again will not help; say where to look
                raise TorchrigError(
                    f"the NVIDIA driver is still not usable after the reboot ({pending_reboot}): "
                    "the kernel module did not load; see `dmesg | grep -i nvidia` on the host "
                    "(Secure Boot refusing an unsigned module, a DKMS build that failed for "
                    "this kernel), fix it, then rerun provision")
            if not pending_reboot:
                break
            first = rep.steps
            if not reboot:
                rep.reboot_required = True
                break
            progress.note(host.name, "rebooting to load the new driver")
            _reboot_and_wait(fleet, host, ctx.facts["boot_id"], s.reboot_timeout)
            rep.rebooted = True
            cxn = fleet.conn(host)
            # the host as it came back: only what is still to do runs
            ctx = Ctx(gather(cxn, s), s, host.name, ctx.payload_requirements,
                      address=host.address, cluster=ctx.cluster, fleet=ctx.fleet,
                      login=ctx.login, ssh_port=ctx.ssh_port)
            plan = build_plan(ctx, check_preflight=False)
    except TorchrigError as e:
        rep.error = str(e)
    failed = [st for st in rep.steps if st.status == "failed"]
    if failed and not rep.error:
        rep.error = f"step {failed[0].name} failed: {failed[0].error}"
    if rep.reboot_required:
        rep.error = rep.error or ("the new NVIDIA driver needs a reboot: steps that need it were "
                                  "skipped; rerun with --reboot (or reboot, then rerun)")
    rep.ok = not rep.error
    rep.seconds = round(time.monotonic() - t0, 2)
    return rep


def _apply_plan(cxn, plan: Plan, s: Settings, rep: HostReport,
                progress: StepProgress, before_apt=None, before_pip=None) -> str | None:
    """Run each planned step's changes as one root script; before_apt() once, before the first
    that apt-get installs; before_pip() before the step whose pip install the hosts may share
    (it may swap that install: its changes are read after). The driver state ('no-driver',
    ...) if a step that needs the driver had to wait for it, else None."""
    state, driver_changed, waiting = plan.driver, False, None
    for sp in plan.steps:
        step = sp.step
        if sp.status == "skipped":
            rep.steps.append(StepResult(step.name, "skipped", error=sp.reason))
            continue
        if any(st.status == "failed" for st in rep.steps):
            rep.steps.append(StepResult(step.name, "skipped", error="an earlier step failed"))
            continue
        if sp.status == "ok":
            rep.steps.append(StepResult(step.name, "ok"))
            continue
        if before_pip is not None and step.name == WHEELS_STEP:
            before_pip()
        changes = sp.changes  # after the meeting, which may have swapped the pip install
        # before the driver check: a step that waits for the driver still downloads with
        # the others (its packages are in the meeting's download)
        if before_apt is not None and any(isinstance(c, AptInstall) for c in changes):
            before_apt()
            before_apt = None
        if step.needs_driver:
            if driver_changed:
                state = _driver_now(cxn)
            if state != "ok":
                waiting = state
                rep.steps.append(StepResult(step.name, "skipped", changes=sp.describe(),
                                            error=f"driver not usable yet ({state}): reboot needed"))
                continue
        t = time.monotonic()
        progress.started(rep.host, step.name, "; ".join(sp.describe()))
        r = run_root_script(cxn, step_script(step, changes, s))
        res = StepResult(step.name, "changed" if r.exited == 0 else "failed",
                         round(time.monotonic() - t, 2), sp.describe())
        progress.finished(rep.host, step.name, res.status, res.seconds)
        if r.exited != 0:
            res.error = _last_lines(r.stderr or r.stdout) + f" (exit {r.exited})"
        rep.steps.append(res)
        if step.reprobes_driver and r.exited == 0:
            driver_changed = True
    return waiting


def preamble(lock_timeout: int) -> str:
    """What every step's root script starts with (onhost/provision/preamble.sh): apt-get and
    dpkg that wait for the dpkg lock, and a private TORCHRIG_TMP folder."""
    return script("provision/preamble.sh", apt_wait=script("provision/apt_lock_wait.py"),
                  lock_timeout=int(lock_timeout))


def step_script(step: Step, changes: list, s: Settings, upload=lambda data: b64(data)) -> str:
    """One step's root script: the preamble, the step's upload if it has one (its bytes as
    `upload` gives them), then each change's snippet."""
    body = "\n".join(c.script for c in changes)
    up = step.upload(s)
    if up:
        # the operator's file travels inside the root script, into its private folder
        body = f"printf %s {sh(upload(_read_upload(up)))} | base64 -d > {up.dest}\n" + body
    return preamble(s.apt_lock_timeout) + body + "\n"


def scripts_for_digest(p: Planned, red: Redactor) -> list[str]:
    """Every planned step's root script as a saved plan's digest covers it: the very script
    apply would run (so a torchrig upgrade that changes a generated script or a file's body
    changes the digest), with each file body and upload as its SHA-256, a secret file's as its
    masked text, and the rest through the redactor: no secret shapes the digest (secrets are
    read from the inventory when the plan is applied)."""
    def body(c):
        if not isinstance(c, FileChange) or c.content is None:
            return c
        shown = red.text(c.shown or "(secret)") if c.secret else \
            hashlib.sha256(c.content.encode()).hexdigest()
        return replace(c, content=shown, current=None)
    return [red.text(step_script(sp.step, [body(c) for c in sp.changes], p.settings,
                                 upload=lambda data: hashlib.sha256(data).hexdigest()))
            for sp in p.plan.steps if sp.status == "planned"]


def _read_upload(up: Upload) -> bytes:
    try:
        return Path(up.local).read_bytes()
    except OSError as e:
        raise TorchrigError(f"var {up.var}: cannot read {up.local} ({e.strerror})") from None


def merge_steps(before: list[StepResult], after: list[StepResult]) -> list[StepResult]:
    """One row per step over a reboot: 'changed' if either pass changed it."""
    prev = {st.name: st for st in before}
    out = []
    for st in after:
        old = prev.get(st.name)
        if old and old.status == "changed" and st.status in ("ok", "skipped"):
            st = old
        elif old and old.status == "changed" and st.status == "changed":
            st = StepResult(st.name, "changed", round(old.seconds + st.seconds, 2),
                            old.changes + st.changes)
        out.append(st)
    return out


SMI_TIMEOUT = 60  # seconds: nvidia-smi on a wedged GPU can hang for good


def _driver_now(cxn) -> str:
    # bounded on the host (a timed-out SSH command would leave nvidia-smi running there);
    # exit 124 reads as state 'unknown'
    r = cxn.run(f"timeout -k 5 {SMI_TIMEOUT} nvidia-smi --query-gpu=driver_version --format=csv,noheader",
                hide=True, warn=True, timeout=SMI_TIMEOUT + 30)
    return driver_state({"nvidia_smi": {"rc": r.exited, "output": (r.stdout + r.stderr).strip()}})[0]


def _last_lines(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-600:]


def _reboot_and_wait(fleet: Fleet, host: Host, old_boot: str, timeout: int):
    # a transient timer, so the SSH command returns before the host goes down
    fleet.run(host, "systemd-run --on-active=1 --timer-property=AccuracySec=100ms "
              "/bin/systemctl reboot", root=True)
    fleet.drop(host)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(2)
        try:
            r = fleet.run(host, "cat /proc/sys/kernel/random/boot_id; "
                          "systemctl is-system-running --wait", timeout=120)
            boot = r.stdout.split()[0] if r.stdout.split() else ""
            if boot and boot != old_boot:
                return
        except Exception:  # noqa: BLE001 - down while rebooting: keep polling until deadline
            pass
        fleet.drop(host)  # reached the old boot, or none: the next poll connects afresh
    raise TorchrigError(f"host did not come back over SSH within {timeout}s after the reboot "
                        "(var reboot_timeout)")
