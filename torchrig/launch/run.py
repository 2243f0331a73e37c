"""launch / stop: a torchrun job under systemd on every node, started everywhere or nowhere."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TorchrigError
from ..inventory import Host, Inventory
from ..provision.desired import settings_for
from ..remote import fan_out, flock_lines, run_once, sh
from ..secrets import secret_env_names
from ..verify.run import verify
from .plan import (GPU_SAMPLER, JOB_RE, SAMPLER_PATH, Job, Node, check_job_name, env_path,
                   gpumon_paths, job_of_unit, job_port, launch_marker, parse_env, redact_env,
                   render_env, render_gpumon, render_unit, split_args, unit_name, unit_path)
from .push import push_to

PAYLOAD = Path(__file__).resolve().parents[2] / "payload"
JOBS_DIR = "/etc/torchrig/jobs"
GPU_SAMPLE_S = 30  # seconds between GPU utilisation samples
# a job holds its GPUs (and its release) from start until its unit is fully down: a job that is
# stopping (deactivating) still writes its last checkpoint for up to TimeoutStopSec
BUSY_STATES = "active,activating,deactivating,reloading"
BUSY_UNITS = f"systemctl list-units 'torchrig-*.service' --state={BUSY_STATES} --plain --no-legend"
# Install, start and undo on a node hold a lock (a 0600 file of root's in the jobs folder: the
# folder itself can be opened, so flock'ed, by any local user), so two launches at once see
# each other's units complete and in a known state.
LOCK = flock_lines("{jobs}", "another launch held the lock on {jobs}", 3)
# refuses when the job's own unit is busy: a launch of the same job started it meanwhile
OWN_BUSY = """case "$(systemctl show -p ActiveState --value {name})" in
  active|activating|deactivating|reloading)
    echo "error: job {job} was started on this node meanwhile (another launch at the same time?)" >&2
    exit 3;;
esac
"""


@dataclass
class LaunchOptions:
    job: str
    script: str = "train.py"
    args: str = ""
    env: list[str] = field(default_factory=list)
    nproc: str = "gpu"
    max_restarts: int = 3
    dry_run: bool = False
    start_timeout: int = 180
    rdzv_timeout: int = 300
    accept_new: bool = False
    parallel: int = 16


def check_options(o: LaunchOptions) -> None:
    """The flags alone: refused with one line before any host is touched."""
    check_job_name(o.job)
    parse_env(o.env)
    split_args(o.args)
    script = Path(o.script)
    if script.is_absolute() or ".." in script.parts:
        raise TorchrigError(f"--script {o.script!r}: a path inside payload/ (e.g. train.py)")
    if not (PAYLOAD / script).is_file():
        raise TorchrigError(f"--script {o.script!r}: no such file in {PAYLOAD}")
    if o.nproc != "gpu" and not (re.fullmatch(r"[0-9]{1,4}", o.nproc) and int(o.nproc) >= 1):
        raise TorchrigError(f"--nproc-per-node {o.nproc!r}: a positive number or 'gpu'")


def _node(inv: Inventory, h: Host, rank: int, nproc: str, interface: str | None) -> Node:
    s = settings_for(h.name, h.vars, inv.path)
    acc = h.vars.get("accelerator", "cuda")
    if nproc == "gpu":
        n = 2 if acc == "cpu" else (h.gpus or 0)
        if n < 1:
            raise TorchrigError(f"{h.name}: --nproc-per-node gpu, but the inventory gives no "
                                "`gpus:` count for it; set it or pass a number")
    else:
        try:
            n = int(nproc)
            assert n >= 1
        except (ValueError, AssertionError):
            raise TorchrigError(f"--nproc-per-node {nproc!r}: a positive number or 'gpu'") from None
    env = {str(k): str(v) for k, v in (h.vars.get("env") or {}).items()}
    return Node(h.name, h.address, rank, s.venv, s.service_user, s.log_dir, s.checkpoint_dir,
                s.data_dir, n, interface, env)


def plan_job(inv: Inventory, hosts: list[Host], o: LaunchOptions, release: str,
             interfaces: dict[str, str | None]) -> Job:
    check_options(o)
    args = split_args(o.args)
    first_vars = hosts[0].vars
    secret_keys = set().union(*(secret_env_names(h.vars.get("secret_env"),
                                                 f"{inv.path}: host {h.name!r}: var 'secret_env'")
                                for h in hosts))
    nodes = [_node(inv, h, i, o.nproc, interfaces.get(h.name)) for i, h in enumerate(hosts)]
    if o.script == "train.py" and not any(a.startswith("--ckpt-dir") for a in args):
        args = ["--ckpt-dir", f"{nodes[0].checkpoint_dir}/{o.job}"] + args
    port = job_port(o.job, int(first_vars.get("rdzv_port", 29400)))
    return Job(o.job, o.script, args, o.max_restarts, port, nodes, release, env=parse_env(o.env),
               secret_keys=secret_keys, rdzv_timeout=o.rdzv_timeout)


@dataclass
class Launched:
    job: Job
    rendered: dict[str, dict[str, str]]    # host -> {path: content (secrets redacted)}
    started: bool = False
    seconds: float = 0.0


def _gate(inv: Inventory, hosts: list[Host], o: LaunchOptions) -> dict[str, str | None]:
    """verify's fast version gate (one round trip per host); returns each node's interface."""
    rep = verify(inv, hosts, full=False, accept_new=o.accept_new, parallel=o.parallel)
    if rep.unreachable:
        raise TorchrigError("nothing started: " + "; ".join(
            f"{h}: {e}" for h, e in rep.unreachable.items()))
    if rep.gate[0] != "PASS":
        raise TorchrigError("nothing started: the version gate failed: " + "; ".join(rep.gate[2])
                            + " (run `invoke verify` for details, `invoke provision` to fix)")
    bad = [f"{v.host}: {c.name}: {c.detail}" for v in rep.hosts for c in v.checks
           if c.status == "FAIL" and c.name in ("driver", "torch")]
    if bad:
        raise TorchrigError("nothing started: " + "; ".join(bad))
    first_iface = next((v.interface for v in rep.hosts if v.interface), None)
    return {v.host: v.interface or first_iface for v in rep.hosts}


def busy_jobs(list_units: str) -> list[str]:
    """Job names from `systemctl list-units --plain --no-legend` (samplers and other units
    whose name is not torchrig-<job>.service are not jobs)."""
    units = [ln.split()[0] for ln in list_units.splitlines() if ln.strip()]
    return [j for j in map(job_of_unit, units) if j]


def _active_jobs(inv, h: Host, accept_new) -> list[str]:
    r = run_once(h, inv, BUSY_UNITS, accept_new=accept_new)
    return busy_jobs(r.stdout)


def launch(inv: Inventory, hosts: list[Host], o: LaunchOptions, log=print) -> Launched:
    t0 = time.monotonic()
    if not hosts:
        raise TorchrigError("no hosts selected")
    check_options(o)  # before any host is touched
    busy = fan_out(hosts, lambda h: _active_jobs(inv, h, o.accept_new), parallel=o.parallel)
    for r in busy:
        if not r.ok:
            raise TorchrigError(f"nothing started: {r.host}: {r.error}")
        if o.job in r.value:
            raise TorchrigError(f"nothing started: job {o.job!r} is already running on {r.host} "
                                "(or still stopping); "
                                f"`invoke stop --job {o.job}` first, or pick another --job")
        h = next(x for x in hosts if x.name == r.host)
        if r.value and h.vars.get("accelerator", "cuda") == "cuda":
            raise TorchrigError(f"nothing started: {r.host} already runs job(s) "
                                f"{', '.join(r.value)} on its GPUs; two jobs would share them. "
                                "Stop it or choose other hosts")
    interfaces = _gate(inv, hosts, o)
    prefix = settings_for(hosts[0].name, hosts[0].vars, inv.path).prefix
    if o.dry_run:
        from .push import manifest, tree_hash
        release = f"{prefix}/payload/releases/{tree_hash(manifest(PAYLOAD))}"
    else:
        pushed = fan_out(hosts, lambda h: push_to(h, inv, PAYLOAD, prefix, o.accept_new),
                         parallel=o.parallel)
        bad = [f"{r.host}: {r.error}" for r in pushed if not r.ok]
        if bad:
            raise TorchrigError("nothing started: payload push failed: " + "; ".join(bad))
        releases = {r.value[0] for r in pushed}
        release = releases.pop()
        log(f"payload {release} on {len(hosts)} node(s) "
            f"({sum(r.value[1] for r in pushed)} file(s) sent)")
    job = plan_job(inv, hosts, o, release, interfaces)
    rendered = {n.host: {env_path(job.name): render_env(job, n, redact=True),
                         unit_path(job.name): render_unit(job, n)} for n in job.nodes}
    out = Launched(job, rendered)
    if o.dry_run:
        return out
    by_name = {h.name: h for h in hosts}
    installed = fan_out(job.nodes, lambda n: _install(inv, by_name[n.host], job, n, o.accept_new),
                        parallel=o.parallel, name=lambda n: n.host)
    bad = [f"{r.host}: {r.error}" for r in installed if not r.ok]
    if bad:
        _undo(inv, hosts, job, o, remove=True)
        raise TorchrigError("nothing started: installing the job failed: " + "; ".join(bad))
    started = fan_out(hosts, lambda h: _start(inv, h, job, o.accept_new), parallel=o.parallel)
    problems = [f"{r.host}: {r.error}" for r in started if not r.ok]
    if not problems:
        problems = _confirm(inv, hosts, job, o)
    if problems:
        _undo(inv, hosts, job, o, remove=False)
        raise TorchrigError(f"job {job.name} did not start on every node, so it was stopped on "
                            "all of them: " + "; ".join(problems))
    out.started = True
    out.seconds = round(time.monotonic() - t0, 2)
    return out


INSTALL = """set -euo pipefail
install -d -m 0755 {jobs}
""" + LOCK + OWN_BUSY + """python3 -I - {dirs_args} <<'TORCHRIG_PY'
{dirs_script}
TORCHRIG_PY
umask 077
tmp=$(mktemp {env}.XXXXXX); base64 -d > "$tmp" <<'EOF'
{env_b64}
EOF
chmod 0600 "$tmp"; mv -f "$tmp" {env}
umask 022
tmp=$(mktemp {unit}.XXXXXX); base64 -d > "$tmp" <<'EOF'
{unit_b64}
EOF
chmod 0644 "$tmp"; mv -f "$tmp" {unit}
install -d -m 0755 {sampler_dir}
printf %s {sampler} | base64 -d > {sampler_path}.tmp && chmod 0755 {sampler_path}.tmp && mv -f {sampler_path}.tmp {sampler_path}
{gpumon}
systemctl daemon-reload
systemctl reset-failed {name} 2>/dev/null || true
"""


JOBDIRS_SCRIPT = Path(__file__).parent / "jobdirs_remote.py"


def install_script(job: Job, n: Node) -> str:
    """The root script that writes the job's folders (made safely: see jobdirs_remote.py), env
    file (0600, may hold secrets: sent on stdin, never in a command line) and units on node n."""
    import base64
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    gpumon = "\n".join(f"printf %s {sh(b64(text))} | base64 -d > {sh(path)}"
                        for path, text in render_gpumon(job, n, GPU_SAMPLE_S).items())
    return INSTALL.format(
        sampler_dir=sh(SAMPLER_PATH.rsplit("/", 1)[0]), sampler=sh(b64(GPU_SAMPLER)),
        sampler_path=sh(SAMPLER_PATH), gpumon=gpumon,
        jobs=sh(JOBS_DIR), dirs_script=JOBDIRS_SCRIPT.read_text(),
        dirs_args=sh(json.dumps({"user": n.user, "dirs": [[n.log_dir, job.name],
                                                           [n.checkpoint_dir, job.name]]})),
        env=sh(env_path(job.name)),
        unit=sh(unit_path(job.name)), name=sh(unit_name(job.name)), job=job.name,
        env_b64=b64(render_env(job, n)), unit_b64=b64(render_unit(job, n)))


def _install(inv, h: Host, job: Job, n: Node, accept_new) -> None:
    r = run_once(h, inv, "bash -s", root=True, accept_new=accept_new, timeout=120,
                 data=install_script(job, n))
    if r.exited != 0:
        raise TorchrigError(_refusal(r.stderr) or f"writing the unit failed: {r.stderr.strip()[-300:]}")


def _refusal(stderr: str) -> str | None:
    """The `error: ...` line a node-side script printed, without the prefix."""
    lines = [ln[len("error: "):] for ln in stderr.splitlines() if ln.startswith("error: ")]
    return lines[-1] if lines else None


# Start under the lock, only the unit this launch wrote, re-checking there that the GPUs are
# free: two launches at once of different jobs on one GPU node cannot both pass the earlier
# check and both start.
START = """set -eu
""" + LOCK + """grep -qxF {marker} {unit_file} || {{
  echo "error: another launch of job {job} replaced its unit on this node meanwhile" >&2; exit 3; }}
""" + OWN_BUSY + """busy=$({busy_units} | awk '{{print $1}}' | grep -xE {unit_re} | grep -vxF {name} || true)
if [ {exclusive} = 1 ] && [ -n "$busy" ]; then
  echo "error: another job started on this node's GPUs meanwhile: $(echo $busy)" >&2; exit 3
fi
systemctl start {name}
"""


def start_script(job: Job, exclusive: bool) -> str:
    """The root script that starts the job's unit on a node (exclusive: a GPU node)."""
    return START.format(jobs=sh(JOBS_DIR), busy_units=BUSY_UNITS, name=sh(unit_name(job.name)),
                        unit_file=sh(unit_path(job.name)), marker=sh(launch_marker(job)),
                        job=job.name, unit_re=sh(rf"torchrig-{JOB_RE.pattern}\.service"),
                        exclusive=int(exclusive))


def _start(inv, h: Host, job: Job, accept_new) -> None:
    script = start_script(job, h.vars.get("accelerator", "cuda") == "cuda")
    r = run_once(h, inv, "bash -s", root=True, accept_new=accept_new, timeout=400, data=script)
    if r.exited != 0:
        raise TorchrigError(_refusal(r.stderr) or f"systemctl start failed: {r.stderr.strip()[-300:]}")


PROBE = """u={unit}; d={logdir}
state=$(systemctl show -p ActiveState --value "$u"); result=$(systemctl show -p Result --value "$u")
workers=$(ls -d "$d"/*/attempt_*/[0-9]* 2>/dev/null | wc -l)
echo "$state $result $workers"
"""


def _confirm(inv, hosts: list[Host], job: Job, o: LaunchOptions) -> list[str]:
    """Every node active (or already finished cleanly) with its workers spawned, which
    torchrun does only after the rendezvous completed."""
    by_name = {n.host: n for n in job.nodes}
    deadline = time.monotonic() + o.start_timeout
    pending = {h.name for h in hosts}
    while pending and time.monotonic() < deadline:
        def probe(h: Host):
            n = by_name[h.name]
            r = run_once(h, inv, PROBE.format(unit=sh(unit_name(job.name)),
                                              logdir=sh(f"{n.log_dir}/{job.name}")),
                         root=True, accept_new=o.accept_new, timeout=30)
            state, result, workers = (r.stdout.split() + ["", "", "0"])[:3]
            return state, result, int(workers or 0)
        results = fan_out([h for h in hosts if h.name in pending], probe, parallel=o.parallel)
        for r in results:
            if not r.ok:
                return [f"{r.host}: {r.error}"]
            state, result, workers = r.value
            if state == "failed" or (state == "inactive" and result not in ("success", "")):
                return [f"{r.host}: unit {state} ({result}): " + _journal(inv, r.host, hosts, job.name, o)]
            if workers >= by_name[r.host].nproc or (state == "inactive" and workers):
                pending.discard(r.host)
        if pending:
            time.sleep(1)
    return [f"{h}: workers not started within {o.start_timeout}s (rendezvous incomplete?): "
            + _journal(inv, h, hosts, job.name, o) for h in sorted(pending)]


def _journal(inv, name: str, hosts: list[Host], job: str, o: LaunchOptions) -> str:
    h = next(x for x in hosts if x.name == name)
    try:
        r = run_once(h, inv, sh("journalctl", "-u", unit_name(job), "-n", "5", "-o", "cat",
                                "--no-pager"), root=True, accept_new=o.accept_new, timeout=30)
        return " | ".join(ln for ln in r.stdout.strip().splitlines()[-5:]) or "(no journal lines)"
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return f"(journal unavailable: {e})"


# What a failed launch undoes: only a unit that this launch wrote (a launch of the same job at
# the same time may have replaced it, or started it), stopped and, if asked, removed.
UNDO = """[ -d {jobs} ] || exit 0
""" + LOCK + """grep -qxF {marker} {unit_file} 2>/dev/null || exit 0
systemctl stop {name}
{remove}
"""


def undo_script(job: Job, remove: bool) -> str:
    rm = (sh("rm", "-f", unit_path(job.name), env_path(job.name), *gpumon_paths(job.name))
          + " && systemctl daemon-reload") if remove else ""
    return UNDO.format(jobs=sh(JOBS_DIR), marker=sh(launch_marker(job)),
                       unit_file=sh(unit_path(job.name)), name=sh(unit_name(job.name)), remove=rm)


def _undo(inv, hosts: list[Host], job: Job, o: LaunchOptions, remove: bool) -> list:
    script = undo_script(job, remove)
    return fan_out(hosts, lambda h: run_once(h, inv, "bash -s", root=True, accept_new=o.accept_new,
                                             timeout=400, data=script).exited,
                   parallel=o.parallel)


STOP_CHECK = """u={unit}
was=$(systemctl show -p ActiveState --value "$u")
systemctl stop "$u"
# torchrun exits 1 when SIGTERM stops it (the workers checkpoint and exit 0): a job stopped
# here did not fail, so it should not read 'failed' afterwards. One that had failed before
# the stop keeps its state.
case "$was" in active|activating|reloading) systemctl reset-failed "$u" 2>/dev/null || true;; esac
cg=$(systemctl show -p ControlGroup --value "$u")
left=0
if [ -n "$cg" ] && [ -f "/sys/fs/cgroup$cg/cgroup.procs" ]; then left=$(wc -l < "/sys/fs/cgroup$cg/cgroup.procs"); fi
echo "$(systemctl show -p ActiveState --value "$u") $left"
"""


def stop(inv, hosts: list[Host], job: str, accept_new=False, parallel=16) -> list:
    """Stop the job everywhere; report per node the final state and processes left."""
    check_job_name(job)

    def one(h: Host):
        r = run_once(h, inv, STOP_CHECK.format(unit=sh(unit_name(job))), root=True,
                     accept_new=accept_new, timeout=600)
        state, left = (r.stdout.split() + ["unknown", "0"])[:2]
        if state not in ("inactive", "failed") or left != "0":
            raise TorchrigError(f"job still {state} with {left} process(es) left")
        return state
    return fan_out(hosts, one, parallel=parallel)


STATUS_SCRIPT = Path(__file__).parent / "status_remote.py"


def status(inv, hosts: list[Host], job: str, accept_new=False, parallel=16) -> list:
    """Per node: unit state, restarts, attempt, uptime, latest progress, GPUs, util samples."""
    check_job_name(job)

    def one(h: Host) -> dict:
        s = settings_for(h.name, h.vars, inv.path)
        window = int(h.vars.get("low_util_minutes", 30)) * 60
        args = {"unit": unit_name(job), "logdir": f"{s.log_dir}/{job}",
                "util_file": f"{s.log_dir}/{job}/gpu_util.csv", "window_s": window}
        r = run_once(h, inv, "python3 -I - " + sh(json.dumps(args)), root=True,
                     accept_new=accept_new, timeout=60, data=STATUS_SCRIPT.read_text())
        if r.exited != 0:
            raise TorchrigError(f"status failed: {r.stderr.strip()[-300:]}")
        d = json.loads(r.stdout)
        if d["unit"].get("LoadState") == "not-found":
            raise TorchrigError(f"no job {job!r} on this host")
        d["low_util"] = low_utilisation(d["util_samples"], window,
                                        float(h.vars.get("low_util_percent", 20)))
        return d
    return fan_out(hosts, one, parallel=parallel)


def low_utilisation(samples: list, window_s: int, threshold: float) -> str | None:
    """A warning when every GPU sample over the last window_s seconds is below threshold %
    (the guide: a job idling at 15% for a weekend wastes real money). None otherwise."""
    recent = [(age, u) for age, u in samples if age <= window_s]
    if not recent or max(age for age, _ in recent) < window_s * 0.9:
        return None  # not enough history to judge
    peak = max((max(u) if u else 0.0) for _, u in recent)
    if peak < threshold:
        return (f"GPU utilisation below {threshold:g}% (peak {peak:g}%) for the last "
                f"{window_s // 60} min: check the input pipeline or batch size")
    return None


def describe(job: Job) -> dict:
    return {"job": job.name, "nodes": [n.host for n in job.nodes], "rdzv_port": job.rdzv_port,
            "release": job.release, "args": job.args,
            "env": redact_env(job.env, job.secret_keys)}


def job_json(job: Job) -> str:
    return json.dumps(describe(job))
