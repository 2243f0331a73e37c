"""launch / stop: a torchrun job under systemd on every node, started everywhere or nowhere."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TorchrigError
from ..facts import job_state, probe
from ..inventory import Host, Inventory
from ..onhost import Shell, refusal, script
from ..quoting import sh
from ..resources import PAYLOAD
from ..secrets import Redactor, is_secret
from ..terminal import printable
from ..settings import JOBS_DIR, job_folder, procs_per_node
from ..verify import evaluate, health_run
from ..verify.run import VerifyReport, verify
from ..job import (DEFAULTS, JOB_RE, RUNNING_STATES, check_job_name, gpumon_name, job_of_unit, job_port,
                   health_record, stop_record, unit_name)
from .plan import (Job, Node, check_env_key, job_changes, job_paths, job_units, launch_marker,
                   parse_env, redact_env, split_args, unit_path)
from ..session import Fleet, Outcome, Result, describe_error
from . import deps, elastic, health_gate, push, stage
from .stage import Staged

GPU_SAMPLE_S = 30  # seconds between samples (GPU use for status, metrics for node_exporter)
# a job holds its GPUs (and its release) from start until its unit is fully down: a job that is
# stopping (deactivating) still writes its last checkpoint for up to TimeoutStopSec
BUSY_ARGV = ["systemctl", "list-units", "torchrig-*.service",
             "--state=" + ",".join(RUNNING_STATES), "--plain", "--no-legend"]
BUSY_UNITS = sh(*BUSY_ARGV)  # the same list, re-read under the lock by the start script


@dataclass
class LaunchOptions:
    job: str
    script: str = DEFAULTS.script
    args: str = ""
    env: list[str] = field(default_factory=list)
    nproc: str = DEFAULTS.nproc
    max_restarts: int = DEFAULTS.max_restarts
    dry_run: bool = False
    start_timeout: int = DEFAULTS.start_timeout
    rdzv_timeout: int = DEFAULTS.rdzv_timeout
    exit_barrier_timeout: int = DEFAULTS.exit_barrier_timeout
    # the user's project (None: torchrig's own payload/), run as a script inside it or as a
    # module (torchrun -m); its dependencies from `requirements` (a file in it; None: found)
    workdir: str | None = None
    module: str | None = None
    requirements: str | None = None
    allow_torch_change: bool = False   # a requirement may replace the provisioned torch
    secret_env: list[str] = field(default_factory=list)  # more names whose values are masked
    early_fail_window: int = DEFAULTS.early_fail_window  # see LaunchDefaults; 0: off
    data: str | None = None            # a dataset (`torchrig data.push`) every node must hold
    data_verify: str = "quick"         # quick: sizes and the push's records; full: re-hash
    min_nodes: int | None = None       # an elastic job's MIN (service.launch sets it)


MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def check_options(o: LaunchOptions) -> None:
    """The flags alone: refused with one line before any host is touched."""
    check_job_name(o.job)
    parse_env(o.env)
    if o.data is not None:
        from ..datasets.manifest import check_name
        check_name(o.data)
    if o.data_verify not in ("quick", "full"):
        raise TorchrigError(f"--data-verify {o.data_verify!r}: quick or full")
    split_args(o.args)
    for key in o.secret_env:
        check_env_key(key, "--secret-env")
    root = PAYLOAD if o.workdir is None else Path(o.workdir).expanduser()
    where = "payload/" if o.workdir is None else f"--workdir {o.workdir}"
    if o.module is not None:
        if o.script != DEFAULTS.script:
            raise TorchrigError("--script and --module: give one (a file, or a module to run "
                                "as `python -m`)")
        if not MODULE_RE.fullmatch(o.module):
            raise TorchrigError(f"--module {o.module!r}: a dotted module name (e.g. pkg.train)")
    else:
        script = Path(o.script)
        if script.is_absolute() or ".." in script.parts:
            raise TorchrigError(f"--script {o.script!r}: a path inside {where} (e.g. train.py)")
        if not (root / script).is_file():
            raise TorchrigError(f"--script {o.script!r}: no such file in {root}"
                                + ("" if o.workdir else " (your own project: add --workdir DIR)"))
    if o.nproc != "gpu" and not (re.fullmatch(r"[0-9]{1,4}", o.nproc) and int(o.nproc) >= 1):
        raise TorchrigError(f"--nproc-per-node {o.nproc!r}: a positive number or 'gpu'")


def node_procs(h: Host, nproc: str) -> int:
    """The processes a node runs: --nproc-per-node, or one per GPU the inventory gives."""
    if nproc == "gpu":
        n = procs_per_node(h.settings.accelerator, h.gpus or 0)
        if n < 1:
            raise TorchrigError(f"{h.name}: --nproc-per-node gpu, but the inventory gives no "
                                "`gpus:` count for it; set it or pass a number")
        return n
    try:
        n = int(nproc)
        assert n >= 1
    except (ValueError, AssertionError):
        raise TorchrigError(f"--nproc-per-node {nproc!r}: a positive number or 'gpu'") from None
    return n


def is_payload(o: LaunchOptions) -> bool:
    """The job runs torchrig's example payload (train.py), whose arguments torchrig knows."""
    return o.workdir is None and o.module is None and o.script == DEFAULTS.script


def check_batch(hosts: list[Host], o: LaunchOptions) -> None:
    """The payload's --global-batch divides at every world size the job may have (an elastic
    job: its first MIN..MAX nodes), from the inventory alone: before any host is touched."""
    if not is_payload(o) or not hosts or elastic.flag_value(split_args(o.args),
                                                             "--global-batch") is None:
        return
    procs = [node_procs(h, o.nproc) for h in hosts]
    sizes = sorted({sum(procs[:k]) for k in range(o.min_nodes or len(hosts), len(hosts) + 1)})
    elastic.check_global_batch(split_args(o.args), sizes)


def _node(inv: Inventory, h: Host, rank: int, nproc: str, interface: str | None) -> Node:
    s = h.settings
    n = node_procs(h, nproc)
    return Node(h.name, h.address, rank, s.venv, s.service_user, s.log_dir, s.checkpoint_dir,
                s.data_dir, n, interface, s.job_env,
                metrics_dir=s.metrics_dir if s.node_exporter else None, gpu_metrics=s.gpu_metrics,
                firewall=s.firewall, home=s.service_home)


def plan_job(inv: Inventory, hosts: list[Host], o: LaunchOptions, release: str,
             interfaces: dict[str, str | None], staged: Staged | None = None) -> Job:
    check_options(o)
    args = split_args(o.args)
    secret_keys = {k for h in hosts for k in h.settings.secret_env} | set(o.secret_env)
    nodes = [_node(inv, h, i, o.nproc, interfaces.get(h.name)) for i, h in enumerate(hosts)]
    payload = is_payload(o)
    if payload and not any(a.startswith("--ckpt-dir") for a in args):
        args = ["--ckpt-dir", job_folder(nodes[0].checkpoint_dir, o.job)] + args
    # where the node has TensorBoard (var tensorboard), rank 0 logs for `torchrig tensorboard`
    first = hosts[0].settings
    if payload and first.tensorboard and not any(a.startswith("--tensorboard") for a in args):
        args = ["--tensorboard", first.tensorboard_dir(o.job)] + args
    port = job_port(o.job, hosts[0].settings.rdzv_port)
    return Job(o.job, o.module or o.script, args, o.max_restarts, port, nodes, release,
               env=parse_env(o.env), secret_keys=secret_keys, rdzv_timeout=o.rdzv_timeout,
               exit_barrier_timeout=o.exit_barrier_timeout, module=o.module is not None,
               support=staged.support if staged else "",
               paths=staged.paths if staged else (),
               python=staged.python if staged else None,
               early_fail_s=o.early_fail_window, data=o.data, min_nodes=o.min_nodes)


@dataclass
class Launched:
    job: Job
    # dry run: host -> [(path, its write, None where the node's file already matches)]
    changes: dict[str, list] = field(default_factory=dict)
    started: bool = False
    seconds: float = 0.0


def check_data(fleet: Fleet, hosts: list[Host], o: LaunchOptions, log=print) -> None:
    """--data: every node holds the same verified bytes of the dataset, or nothing starts."""
    if o.data:
        from ..datasets import run as datasets
        datasets.check(fleet, o.data, full=o.data_verify == "full", hosts=hosts)
        log(f"dataset {o.data}: the same on every node ({o.data_verify} check)")


@dataclass
class Probed:
    """What launch's first probe found on each node, before anything is written."""
    versions: VerifyReport             # verify's fast gate (.also: each node's raw reply)
    health: VerifyReport               # GPU health, as `torchrig health` judges it
    found: dict[str, push.Found]       # what each node holds of the release (src given)


def probe_nodes(fleet: Fleet, hosts: list[Host], src: stage.Source | None = None) -> Probed:
    """Launch's one probe round trip per node, as root (the kernel log that GPU health reads
    is root's), asking at once everything known before anything is written: GPU health,
    verify's fast version gate, the node's running jobs and (src) whether it holds the
    release already (read only: the push's lock and touch come with the job's install)."""
    base = stage.push_base(src, hosts[0].settings.prefix) if src else ""
    also = probe.merge(health_run.request(), {"run": {"busy": BUSY_ARGV}},
                       push.probe_request(base, src.tree.hash) if src else {})
    rep = verify(fleet, hosts, full=False, also=also, root=True)
    health = health_run.report(hosts, [
        Result(h.name, False, error=rep.unreachable[h.name]) if h.name in rep.unreachable
        else Result(h.name, True, rep.also[h.name]) for h in hosts])
    found = {h: push.found(raw, base, src.tree.hash) for h, raw in rep.also.items()} if src else {}
    return Probed(rep, health, found)


def _gate(fleet: Fleet, hosts: list[Host], job: str,
          requires_python: str | None = None) -> dict[str, str | None]:
    """verify's fast version gate and the node's running jobs, in one probe round trip per
    host (a Slurm launch's: its health gate probes on its own, gate_slurm); see
    judge_versions."""
    rep = verify(fleet, hosts, full=False, also={"run": {"busy": BUSY_ARGV}})
    return judge_versions(rep, hosts, job, requires_python)


def judge_versions(rep: VerifyReport, hosts: list[Host], job: str,
                   requires_python: str | None = None) -> dict[str, str | None]:
    """The job's nodes (hosts, among those probed) against the probe: refuses an unreachable
    node, a busy node, a failed version gate, then a Python the project does not run on
    (its requires-python); returns each node's interface."""
    if rep.unreachable:
        raise TorchrigError("nothing started: " + "; ".join(
            f"{h}: {e}" for h, e in rep.unreachable.items()))
    names = {h.name for h in hosts}
    rep = VerifyReport([v for v in rep.hosts if v.host in names], also=rep.also)
    rep.gate = evaluate.version_gate(rep.hosts)
    for h in hosts:
        _refuse_busy(h, job, rep.also[h.name]["run"]["busy"])
    if rep.gate[0] != "PASS":
        raise TorchrigError("nothing started: the version gate failed: " + "; ".join(rep.gate[2])
                            + " (run `torchrig verify` for details, `torchrig provision` to fix)")
    bad = [f"{v.host}: {c.name}: {c.detail}" for v in rep.hosts for c in v.checks
           if c.status == "FAIL" and c.name in ("driver", "torch")]
    if bad:
        raise TorchrigError("nothing started: " + "; ".join(bad))
    deps.check_python(requires_python, {v.host: v.versions.get("python") for v in rep.hosts})
    first_iface = next((v.interface for v in rep.hosts if v.interface), None)
    return {v.host: v.interface or first_iface for v in rep.hosts}


def busy_jobs(list_units: str) -> list[str]:
    """Job names from `systemctl list-units --plain --no-legend` (samplers and other units
    whose name is not torchrig-<job>.service are not jobs)."""
    units = [ln.split()[0] for ln in list_units.splitlines() if ln.strip()]
    return [j for j in map(job_of_unit, units) if j]


def _refuse_busy(h: Host, job: str, listed: dict) -> None:
    """Nothing starts on a node that runs this job already (or is still stopping it), or, with
    GPUs, any other job. `listed`: the probe's result of BUSY_ARGV on the node."""
    if listed["rc"] != 0:
        raise TorchrigError(f"nothing started: {h.name}: systemctl list-units failed: "
                            f"{listed['err'].strip()[-300:]}")
    running = busy_jobs(listed["out"])
    if job in running:
        raise TorchrigError(f"nothing started: job {job!r} is already running on {h.name} "
                            "(or still stopping); "
                            f"`torchrig stop --job {job}` first, or pick another --job")
    if running and h.settings.accelerator == "cuda":
        raise TorchrigError(f"nothing started: {h.name} already runs job(s) "
                            f"{', '.join(running)} on its GPUs; two jobs would share them. "
                            "Stop it or choose other hosts")


def launch(fleet: Fleet, hosts: list[Host], o: LaunchOptions, log=print,
           skip_unhealthy: bool = False, pick=None) -> Launched:
    """Start the job on the nodes, everywhere or nowhere. hosts: the nodes (with
    skip_unhealthy: the candidates, the unhealthy ones left out, then pick(healthy) chooses
    the nodes); fleet.hosts becomes the nodes. Round trips per node with nothing to push:
    the probe (every check known up front), the job's files (and the release made current),
    the start (only once every node has its files), the waits until the workers run."""
    t0 = time.monotonic()
    inv = fleet.inv
    if not hosts:
        raise TorchrigError("no hosts selected")
    check_options(o)  # before any host is touched
    check_batch(hosts if pick is None else pick(hosts), o)
    src = stage.source(o, hosts[0])
    pre = probe_nodes(fleet, hosts, None if o.dry_run else src)
    hosts = health_gate.judge(fleet, pre.health, hosts, skip_unhealthy, log)
    if pick is not None:
        hosts = pick(hosts)
        check_batch(hosts, o)
    fleet.hosts = hosts  # what a Ctrl-C of a following task names
    interfaces = judge_versions(pre.versions, hosts, o.job, src.requires_python)
    check_data(fleet, hosts, o, log)
    prefix = hosts[0].settings.prefix
    if o.dry_run:
        staged = Staged(stage.release_of(src, prefix), src.support, src.paths)
    else:
        staged = stage.stage(fleet, hosts, src, log=log, found=pre.found, switch=False)
    job = plan_job(inv, hosts, o, staged.release, interfaces, staged)
    out = Launched(job)
    if o.dry_run:
        out.changes = _dry_run(fleet, hosts, job)
        return out
    by_name = {h.name: h for h in hosts}
    installed = fleet.fan_out(lambda n: _install(fleet, by_name[n.host], job, n, staged.switch),
                              job.nodes, name=lambda n: n.host)
    bad = [f"{r.host}: {r.error}" for r in installed if not r.ok]
    if bad:
        _undo(fleet, hosts, job, remove=True)
        raise TorchrigError("nothing started: installing the job failed: " + "; ".join(bad))
    deadline = time.monotonic() + o.start_timeout
    logdirs = {n.host: job_folder(n.log_dir, job.name) for n in job.nodes}
    started = fleet.fan_out(lambda h: _start(fleet, h, job, logdirs[h.name]), hosts)
    problems = [f"{r.host}: {r.error}" for r in started if not r.ok]
    if not problems:
        problems = _confirm(fleet, hosts, job, o, deadline, started)
    if problems:
        _undo(fleet, hosts, job, remove=False)
        raise TorchrigError(f"job {job.name} did not start on every node, so it was stopped on "
                            "all of them: " + "; ".join(problems))
    out.started = True
    out.seconds = round(time.monotonic() - t0, 2)
    return out


def _dry_run(fleet: Fleet, hosts: list[Host], job: Job) -> dict[str, list]:
    """Each node's files for the job against what is on the node now (one probe of the job's
    managed files per node, nothing else; the env file by hash only)."""
    from ..changes import managed
    from ..changes.factview import Facts
    from ..facts.provision_facts import files_request
    req = managed.launch_request(job.name)
    stat = files_request(req)
    by_name = {h.name: h for h in hosts}

    def one(n: Node):
        r = fleet.run(by_name[n.host], probe.COMMAND, root=True, timeout=60,
                      data=probe.stdin({"stat": stat}))
        raw = probe.reply(r.exited, r.stdout, r.stderr, "reading the job's files")
        return job_changes(job, n, GPU_SAMPLE_S, Facts({"files": raw["stat"]}, req))
    got = fleet.fan_out(one, job.nodes, name=lambda n: n.host)
    bad = [f"{r.host}: {r.error}" for r in got if not r.ok]
    if bad:
        raise TorchrigError("reading the nodes' files failed: " + "; ".join(bad))
    return {r.host: r.value for r in got}


def _common(job_name: str) -> dict:
    """The values every launch script on a node takes (its lock, its own-unit check)."""
    return {"jobs": JOBS_DIR, "name": unit_name(job_name), "job": job_name,
            "running_states": Shell("|".join(RUNNING_STATES)),
            "stop_record": stop_record(JOBS_DIR, job_name),
            "health_record": health_record(JOBS_DIR, job_name)}


def install_script(job: Job, n: Node, switch: str = "") -> str:
    """The root script that writes the job's folders (made safely: see onhost/launch/jobdirs.py),
    env file (0600, may hold secrets: sent on stdin, never in a command line), units and the GPU
    sampler on node n, each written by the change engine's one atomic write; first, in a
    subshell (its own lock and folder), `switch`: the release made current (stage.Staged)."""
    files = "\n".join(ch.script for _, ch in job_changes(job, n, GPU_SAMPLE_S))
    return script("launch/install.sh", **_common(job.name), **jobdirs_values(job, n),
                  files=Shell(files), switch=Shell(switch), units=Shell(sh(*job_units(job.name))))


def jobdirs_values(job: Job, n: Node) -> dict:
    """onhost/launch/jobdirs.sh's values: jobdirs.py, and its argument: the job's log and
    checkpoint folders and the service user's home, the user's."""
    return {"dirs_script": Shell(script("launch/jobdirs.py")),
            "dirs": json.dumps({"user": n.user, "dirs": [[n.log_dir, job.name],
                                                         [n.checkpoint_dir, job.name]],
                                "home": n.home})}


def _install(fleet: Fleet, h: Host, job: Job, n: Node, switch: str = "") -> None:
    r = fleet.run(h, "bash -s", root=True, timeout=120, data=install_script(job, n, switch))
    if r.exited != 0:
        raise TorchrigError(refusal(r.stderr) or f"writing the unit failed: {r.stderr.strip()[-300:]}")


def start_script(job: Job, exclusive: bool, firewall: bool = False, look: dict | None = None
                 ) -> str:
    """The root script that starts the job's unit on a node (exclusive: a GPU node; firewall:
    the node's job-port firewall must be loaded), then runs the probe with `look` (launch's
    first start check, job_state.start_request): its reply is the script's stdout."""
    from ..facts.netfilter import TABLE, UNIT
    # Starts under the lock, only the unit this launch wrote, re-checking there that the GPUs
    # are free: two launches at once of different jobs on one GPU node cannot both pass the
    # earlier check and both start.
    return script("launch/start.sh", **_common(job.name), busy_units=Shell(BUSY_UNITS),
                  firewall=int(firewall), table=Shell(sh(*TABLE)), firewall_unit=UNIT,
                  unit_file=unit_path(job.name), marker=launch_marker(job),
                  unit_re=rf"torchrig-{JOB_RE.pattern}\.service", exclusive=int(exclusive),
                  enable=int(job.min_nodes is not None),
                  look=Shell(probe.stdin(look).rstrip("\n") if look else ""))


def _start(fleet: Fleet, h: Host, job: Job, logdir: str):
    """Start the unit, and in the same round trip look at it once -> _confirm's (digest,
    start_state) of the node. The look does not wait: every node's start must be answered
    before any is undone (a node still starting would start after its undo)."""
    unit = unit_name(job.name)
    look = job_state.start_request(unit, logdir)
    script = start_script(job, h.settings.accelerator == "cuda", h.settings.firewall, look)
    r = fleet.run(h, "bash -s", root=True, timeout=400, data=script)
    if r.exited != 0:
        raise TorchrigError(refusal(r.stderr) or f"systemctl start failed: {r.stderr.strip()[-300:]}")
    return _looked(unit, r)


def _looked(unit: str, r) -> tuple:
    """A start check's reply (the start script's or a poll's) -> (its digest, start_state)."""
    raw = probe.reply(r.exited, r.stdout, r.stderr, "checking the job's start")
    return raw.get("seen"), job_state.start_state(unit, raw)


# How long one of _confirm's round trips may wait on a node for its state to change. Nothing
# else waits for it (each node is watched on its own); a new round trip after it starts with
# a new process on the node, a moment in which a change is seen late.
WAIT_S = 10.0
MIN_GAP_S = 0.1  # between two of a node's round trips, however often its answer changes
EARLY_LINES = 15  # stderr lines of the failing rank an early failure's error shows


def _confirm(fleet: Fleet, hosts: list[Host], job: Job, o: LaunchOptions,
             deadline: float | None = None, first: list[Result] | None = None) -> list[str]:
    """Every node active (or already finished cleanly) with its workers spawned, which
    torchrun does only after the rendezvous completed; then, for the early window
    (o.early_fail_window, counted on each node from its workers' spawn), no node's unit
    failed: payload/torchrig_torchrun.py ends a first attempt whose workers all failed within
    that window, and this reports it at once with the failing rank's last stderr lines.
    Each node is watched on its own thread: its round trips wait on the node until its answer
    changes (a rank folder, the unit's state), at most WAIT_S, so a node costs a round trip
    per change, not per poll, and its answer is acted on when it comes: a failure on one node
    is reported while the others still wait on theirs (their waits end when the caller's undo
    changes their units). first: each node's look in its start's round trip (_start; None:
    each node's first look answers at once). deadline: when the workers must have spawned (by
    default o.start_timeout from now)."""
    by_name = {n.host: n for n in job.nodes}
    deadline = time.monotonic() + o.start_timeout if deadline is None else deadline
    unit = unit_name(job.name)
    firsts = {r.host: r for r in first or []}
    pending = {h.name for h in hosts}  # not yet spawned (each node's thread takes its own out)
    stop = threading.Event()  # a problem was found: the other nodes' threads look no more

    def look(h: Host, seen: str | None, until: float):
        wait = max(0.0, min(WAIT_S, until - time.monotonic()))  # none without `seen`
        req = job_state.start_request(unit, job_folder(by_name[h.name].log_dir, job.name),
                                      seen, wait)
        r = fleet.run(h, probe.COMMAND, root=True, timeout=30 + WAIT_S, data=probe.stdin(req))
        return _looked(unit, r)

    def watch(h: Host) -> str | None:
        """The node's problem (TIMED_OUT: its workers did not spawn by the deadline), or None
        once it is confirmed."""
        got = firsts.get(h.name)
        if got is not None and not got.ok:
            return f"{h.name}: {got.error}"
        answer = got.value if got is not None else None
        seen, window_end, last = None, None, 0.0
        while not stop.is_set():
            if answer is None:
                time.sleep(max(0.0, last + MIN_GAP_S - time.monotonic()))
                last = time.monotonic()
                if window_end is None and last >= deadline:
                    return TIMED_OUT
                answer = look(h, seen, deadline if window_end is None else window_end)
            now = time.monotonic()
            digest, (state, result, workers, ago) = answer
            answer, seen = None, digest or seen
            if state == "failed" or (state == "inactive" and result not in ("success", "")):
                return _failed(fleet, hosts, job, h.name, state, result, ago)
            if window_end is None and (workers >= by_name[h.name].nproc
                                       or (state == "inactive" and workers)):
                pending.discard(h.name)
                if o.early_fail_window <= 0 or state == "inactive":
                    return None
                window_end = now + early_left(o.early_fail_window, ago)
            elif window_end is not None and (now >= window_end or state == "inactive"):
                return None  # the window passed (or the job already ended cleanly)
        return None

    def guarded(h: Host) -> str | None:
        try:
            return watch(h)
        except Exception as e:  # noqa: BLE001 - a node's error is that node's problem
            return f"{h.name}: {describe_error(e)}"

    pool = ThreadPoolExecutor(max_workers=max(1, len(hosts)))
    try:
        for f in as_completed([pool.submit(guarded, h) for h in hosts]):
            problem = f.result()
            if problem is None:
                continue
            stop.set()
            if problem != TIMED_OUT:
                return [problem]
            return [f"{h}: workers not started within {o.start_timeout}s (rendezvous "
                    "incomplete?): " + _journal(fleet, h, hosts, job.name)
                    for h in sorted(pending)]
        return []
    finally:
        pool.shutdown(wait=False)  # a thread still waiting on its node ends on its own


TIMED_OUT = "timed out"  # a node's watch: the deadline passed before its workers spawned


EARLY_SLACK_S = 1.0  # the node ends its run and its unit fails within this after the window


def early_left(window: float, ago: float | None) -> float:
    """Seconds the operator still watches a node whose workers were spawned `ago` seconds
    ago (None: unknown, the whole window): the rest of the window and the node's slack."""
    return max(0.0, window - (ago or 0.0)) + EARLY_SLACK_S


def _failed(fleet: Fleet, hosts: list[Host], job: Job, name: str, state: str, result: str,
            ago: float | None) -> str:
    """A unit that failed while launch watched: the failing rank's last stderr lines
    (redacted, each line printable), else the unit's journal."""
    head = f"{name}: unit {state} ({result})"
    h = next(x for x in hosts if x.name == name)
    node = next(n for n in job.nodes if n.host == name)
    try:
        r = fleet.run(h, probe.COMMAND, root=True, timeout=30, data=probe.stdin(
            job_state.failure_request(job_folder(node.log_dir, job.name))))
        got = job_state.failure_lines(probe.reply(r.exited, r.stdout, r.stderr,
                                                  "reading the ranks' stderr"), EARLY_LINES)
    except Exception:  # noqa: BLE001 - diagnostics only: the journal instead
        got = None
    if got is None:
        return f"{head}: " + _journal(fleet, name, hosts, job.name)
    return early_report(head, name, got, ago, _redactor(hosts, job))


def _redactor(hosts: list[Host], job: Job) -> Redactor:
    """The hosts' secrets and the job's own secret env values (--env, secret_env names)."""
    red = Redactor.for_hosts(hosts)
    return Redactor(red.values + [v for k, v in job.env.items()
                                  if k in job.secret_keys or is_secret(k)])


def early_report(head: str, host: str, got: tuple[int, list[str]], ago: float | None,
                 red: Redactor) -> str:
    """The error for a rank that failed at start: its last stderr lines, redacted and
    printable (a job's text never reaches the terminal raw), indented under the unit's state."""
    rank, lines = got
    when = f" {ago:.0f}s after its workers started" if ago is not None else ""
    return (f"{head}{when}; last stderr lines of [{host}/l{rank}]:\n"
            + "\n".join("  " + printable(red.text(ln)) for ln in lines))


def _journal(fleet: Fleet, name: str, hosts: list[Host], job: str) -> str:
    h = next(x for x in hosts if x.name == name)
    try:
        r = fleet.run(h, sh("journalctl", "-u", unit_name(job), "-n", "5", "-o", "cat",
                            "--no-pager"), root=True, timeout=30)
        return " | ".join(ln for ln in r.stdout.strip().splitlines()[-5:]) or "(no journal lines)"
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return f"(journal unavailable: {e})"


def undo_script(job: Job, remove: bool) -> str:
    """What a failed launch undoes: only a unit that this launch wrote (a launch of the same
    job at the same time may have replaced it, or started it), stopped and, if asked, removed."""
    rm = (sh("rm", "-f", *job_paths(job.name))
          + " && systemctl daemon-reload") if remove else ""
    return script("launch/undo.sh", **_common(job.name), marker=launch_marker(job),
                  unit_file=unit_path(job.name), remove=Shell(rm))


def _undo(fleet: Fleet, hosts: list[Host], job: Job, remove: bool) -> list:
    script = undo_script(job, remove)
    return fleet.fan_out(lambda h: fleet.run(h, "bash -s", root=True, timeout=400,
                                             data=script).exited, hosts)


def stop_script(job: str) -> str:
    """The root script that stops the job's unit on a node and says its state and the
    processes left."""
    return script("launch/stop.sh", unit=unit_name(job), sampler=gpumon_name(job),
                  record=stop_record(JOBS_DIR, job))


def no_job(job: str) -> str:
    """A node that has no unit of the job (never launched there, or a misspelt name)."""
    return f"no job {job!r} on this host"


def stop(fleet: Fleet, hosts: list[Host], job: str) -> Outcome:
    """Stop the job everywhere; report per node the final state and processes left. A node
    without the job is not a failure (a 2-node job in a 3-host inventory; its value is None),
    unless no selected node has it: then nothing was stopped, and that is the error."""
    check_job_name(job)

    def one(h: Host):
        r = fleet.run(h, stop_script(job), root=True, timeout=600)
        state, left = (r.stdout.split() + ["unknown", "0"])[:2]
        if state == "not-found":
            return None
        if state not in ("inactive", "failed") or left != "0":
            raise TorchrigError(f"job still {state} with {left} process(es) left")
        return state
    out = Outcome(f"stop of job {job}", fleet.fan_out(one, hosts))
    return nowhere(out, job, hosts)


def nowhere(out: Outcome, job: str, hosts: list[Host]) -> Outcome:
    """The stop's outcome, or the error that no selected node has the job at all."""
    if out.results and all(r.ok and r.value is None for r in out):
        raise TorchrigError(f"{no_job(job).replace('this host', ', '.join(h.name for h in hosts))}"
                            "; nothing was stopped (`torchrig status` shows the newest job; "
                            "check --job and --host)")
    return out


def describe(job: Job) -> dict:
    return {"job": job.name, "nodes": [n.host for n in job.nodes], "rdzv_port": job.rdzv_port,
            "release": job.release, "args": job.args,
            "env": redact_env(job.env, job.secret_keys)}
