"""launch / status / stop through Slurm: the same payload, env and torchrun command lines as
the systemd launcher (plan.py), one torchrun per node started by srun inside an sbatch job
submitted on the controller as the job's user. The job's record (its Slurm id) is a root file
on the controller; everything else Slurm knows (squeue, sacct)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

from ..errors import TorchrigError
from ..facts import slurm as facts
from ..inventory import Host
from ..onhost import script
from ..quoting import sh
from ..render import render
from ..session import Fleet
from ..settings import JOBS_DIR, job_folder
from ..torchrun import RUN_ID_ENV
from ..job import STOP_GRACE_S
from . import elastic
from .plan import Job, launch_marker, node_env, torchrun_argv

# `--time` as sbatch takes it: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or UNLIMITED
TIME_RE = re.compile(r"(\d+)(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|unlimited|infinite")
PARTITION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")
ENDPOINT = "\0endpoint"  # stands for "$TORCHRIG_RDZV_ENDPOINT" in a rendered command line
# the stop's bound: Slurm's KillWait (provision sets it to STOP_GRACE_S) plus room to see the end
STOP_BOUND_S = STOP_GRACE_S + 60
# the batch script's output (srun's messages) on the first node, hidden from `logs` (a dot
# name is no torchrun run folder)
BATCH_OUT = ".slurm-%j.out"


def cluster(inv):
    """The inventory's `slurm:` section, or one line saying how to add one."""
    s = getattr(inv, "slurm", None)
    if s is None:
        raise TorchrigError(f"{inv.path}: no `slurm:` section, so no Slurm cluster to launch on; "
                            "add one (see inventory/example.yml) and run `torchrig provision`, or "
                            "use --backend systemd")
    return s


def check_slurm_options(partition: str | None, time_limit: str | None) -> None:
    if partition is not None and not PARTITION_RE.fullmatch(partition):
        raise TorchrigError(f"--partition {partition!r}: a Slurm partition name (letters, "
                            "digits, '_', '.', '-')")
    if time_limit is not None and not TIME_RE.fullmatch(time_limit):
        raise TorchrigError(f"--time {time_limit!r}: a Slurm time limit (minutes, H:M:S, "
                            "D-H:M:S or UNLIMITED)")


def record_path(job: str) -> str:
    """The job's Slurm id, on the controller (root's folder: nothing a job can write)."""
    return f"{JOBS_DIR}/{job}.slurm"


def identifier(job: str) -> str:
    """The journal identifier of the job's agent lines: the systemd unit's SyslogIdentifier."""
    return f"torchrig-{job}"


def _words(argv: list[str]) -> str:
    return " ".join('"$TORCHRIG_RDZV_ENDPOINT"' if a == ENDPOINT else sh(a) for a in argv)


def render_step(job: Job) -> str:
    """The per-node script srun runs: each candidate node's env and torchrun (host or peer
    variant, chosen by SLURM_NODEID), exec'ed with its output in the journal. An elastic
    job meets at the allocation's first node too (no list of endpoints to take the store
    over: that node runs the batch script, and Slurm ends the job when it is lost)."""
    nodes = []
    for n in job.nodes:
        env = {**node_env(job, n), RUN_ID_ENV: job.run_id}
        env.pop(elastic.CANDIDATES_ENV, None)
        env = [f"{k}={sh(v)}" for k, v in env.items()]
        nodes.append({"host": sh(n.host), "env": env,
                      "host_argv": _words(torchrun_argv(job, n, ENDPOINT, True)),
                      "peer_argv": _words(torchrun_argv(job, n, ENDPOINT, False))})
    return render("slurm/JOB.step.j2", job=job.name, nodes=nodes,
                  identifier=sh(identifier(job.name)))


def render_sbatch(job: Job, partition: str | None, time_limit: str | None,
                  gpus: int, exclude: list[str]) -> str:
    """The batch script for job.nnodes of the job's candidate nodes (job.nodes: every node the
    payload and folders were prepared on; Slurm picks which). An elastic job asks for MAX
    nodes too (sbatch --nodes=MIN-MAX with one task per node got MIN nodes of MAX idle ones)
    and keeps its allocation when a node is lost (--no-kill)."""
    first = job.nodes[0]
    el = job.min_nodes is not None
    return render("slurm/JOB.sbatch.j2", job=job.name, marker=launch_marker(job),
                  nnodes=job.nnodes, elastic=el,
                  release=job.release, partition=partition, time=time_limit, grace=STOP_GRACE_S,
                  gpus=gpus, exclude=",".join(exclude),
                  output=f"{job_folder(first.log_dir, job.name)}/{BATCH_OUT}",
                  endpoints=[(sh(n.host), sh(f"{n.address}:{job.rdzv_port}")) for n in job.nodes],
                  step=sh(render_step(job)))


# as the job's user: sbatch reads the script on stdin; cwd / (root's cwd is not the user's)
def submit_command(user: str) -> str:
    return f"cd / && runuser -u {sh(user)} -- sbatch --parsable"


@dataclass
class SlurmJob:
    name: str
    job_id: str
    state: facts.JobState | None = None       # None: Slurm no longer knows the job
    record: dict = field(default_factory=dict)

    @property
    def nodes(self) -> list[str]:
        if self.state and self.state.nodes:
            return self.state.nodes
        return list(self.record.get("nodes", []))

    @property
    def span(self) -> tuple[int, int] | None:
        """An elastic job's (MIN, MAX) nodes, from its record; None for another job."""
        got = self.record.get("span")
        if isinstance(got, list) and len(got) == 2 and all(type(x) is int for x in got):
            return got[0], got[1]
        return None

    def as_dict(self) -> dict:
        return {"job_id": self.job_id, "state": self.state.state if self.state else "UNKNOWN",
                "nodes": self.nodes, "reason": self.state.reason if self.state else ""}


def query(fleet: Fleet, controller: Host, job_id: str) -> facts.JobState | None:
    """squeue (live and recently ended jobs), else sacct (where accounting keeps them)."""
    r = fleet.run(controller, sh(*facts.squeue_argv(job_id)), timeout=30)
    got = facts.parse_squeue(r.stdout, job_id) if r.exited == 0 else None
    if got is None:
        r = fleet.run(controller, sh(*facts.sacct_argv(job_id)), timeout=30)
        got = facts.parse_sacct(r.stdout, job_id) if r.exited == 0 else None
    return got


def find(fleet: Fleet, job: str) -> SlurmJob | None:
    """The job's record on the controller, with Slurm's state of it; None: not a Slurm job."""
    s = getattr(fleet.inv, "slurm", None)
    if s is None:
        return None
    ctl = fleet.inv.host(s.controller)
    r = fleet.run(ctl, f"cat {sh(record_path(job))} 2>/dev/null || true", timeout=30)
    try:
        rec = json.loads(r.stdout) if r.stdout.strip() else None
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or not re.fullmatch(r"\d+", str(rec.get("job_id", ""))):
        return None
    return SlurmJob(job, str(rec["job_id"]), query(fleet, ctl, str(rec["job_id"])), rec)


def refresh(fleet: Fleet, sj: SlurmJob) -> SlurmJob:
    """The record `find` returned, with Slurm's state of the job now (a `status --watch`
    round: the record itself does not change)."""
    sj.state = query(fleet, fleet.inv.host(cluster(fleet.inv).controller), sj.job_id)
    return sj


def write_record(fleet: Fleet, controller: Host, job: str, rec: dict) -> None:
    """The record, written by root into root's folder; read back by status, logs and stop."""
    r = fleet.run(controller, "bash -c " + sh(script("slurm/record.sh", jobs=JOBS_DIR,
                                                     path=record_path(job))),
                  root=True, timeout=30, data=json.dumps(rec))
    if r.exited != 0:
        raise TorchrigError(f"{controller.name}: writing {record_path(job)} failed: "
                            f"{r.stderr.strip()[-300:]}")


def live_job_named(fleet: Fleet, controller: Host, job: str) -> str | None:
    """The id of a pending or running Slurm job of this name, if any."""
    r = fleet.run(controller, sh("squeue", "--noheader", "--name", identifier(job),
                                 "--format", facts.SQUEUE_FORMAT), timeout=30)
    for ln in r.stdout.splitlines():
        jid = ln.split("|")[0]
        st = facts.parse_squeue(ln, jid)
        if st and st.live:
            return jid
    return None


def hosts_of(fleet: Fleet, sj: SlurmJob) -> list[Host]:
    """The job's nodes as inventory hosts, in Slurm's order (node rank order)."""
    return [fleet.inv.host(n) for n in sj.nodes]


# stop: SIGTERM to every step (scancel's default cancel: SIGCONT+SIGTERM, SIGKILL after
# KillWait); then every node checked for a process of the job (SLURM_JOB_ID in its environ)
def processes_left(fleet: Fleet, h: Host, job_id: str) -> int:
    r = fleet.run(h, "python3 -I - " + sh(job_id), root=True, timeout=30,
                  data=script("slurm/left.py"))
    return int(r.stdout.strip() or 0) if r.exited == 0 else -1


def stop(fleet: Fleet, sj: SlurmJob, log=print) -> SlurmJob:
    """scancel the job `find` returned (every step gets SIGTERM and has KillWait to
    checkpoint), wait until Slurm says it ended, then check no process of it is left on any
    of its nodes."""
    ctl = fleet.inv.host(cluster(fleet.inv).controller)
    if sj.state and sj.state.live:
        r = fleet.run(ctl, sh("scancel", sj.job_id), root=True, timeout=60)
        if r.exited != 0:
            raise TorchrigError(f"scancel {sj.job_id} failed: {r.stderr.strip()[-300:]}")
    deadline = time.monotonic() + STOP_BOUND_S
    while time.monotonic() < deadline:
        sj.state = query(fleet, ctl, sj.job_id)
        if sj.state is None or not sj.state.live:
            break
        time.sleep(1)
    else:
        raise TorchrigError(f"slurm job {sj.job_id} still {sj.state.state} after {STOP_BOUND_S}s")
    left = {h.name: processes_left(fleet, h, sj.job_id) for h in hosts_of(fleet, sj)}
    bad = {h: n for h, n in left.items() if n}
    if bad:
        raise TorchrigError("processes of slurm job " + sj.job_id + " left: " +
                            ", ".join(f"{h}: {n}" for h, n in bad.items()))
    return sj


# workers spawned on a node: torchrun makes <log dir>/<run>/attempt_N/<local rank> per worker
def workers_command(logdir: str) -> str:
    return f"ls -d {sh(logdir)}/*/attempt_*/[0-9]* 2>/dev/null | wc -l"


def allocatable(fleet: Fleet, hosts: list[Host], nnodes: int | None) -> tuple[list[Host], int]:
    """(the selected compute hosts, how many of them the job gets: nnodes, or all)."""
    compute = cluster(fleet.inv).compute
    candidates = [h for h in hosts if h.name in compute]
    if not candidates:
        raise TorchrigError(f"no Slurm compute host selected (compute: {', '.join(compute)})")
    n = len(candidates) if nnodes is None else nnodes
    if n > len(candidates):
        raise TorchrigError(f"--nodes {n}: only {len(candidates)} Slurm compute host(s) selected "
                            f"({', '.join(h.name for h in candidates)})")
    return candidates, n


@dataclass
class SlurmLaunched:
    job: Job
    slurm: SlurmJob
    started: bool          # False: still queued when launch stopped waiting
    seconds: float = 0.0


def launch(fleet: Fleet, hosts: list[Host], o, nnodes: int | None, partition: str | None,
           time_limit: str | None, log=print) -> SlurmLaunched:
    """Prepare every selected compute host (payload, folders), submit one sbatch job for
    `nnodes` of them on the controller as the job's user, and wait until every allocated
    node's workers run (or the job is still queued at --start-timeout: then it stays queued)."""
    from . import stage
    from .run import _gate, check_data, check_options, jobdirs_values, plan_job
    t0 = time.monotonic()
    s = cluster(fleet.inv)
    check_options(o)
    check_slurm_options(partition, time_limit)
    src = stage.source(o, hosts[0])
    candidates, n = allocatable(fleet, hosts, nnodes)
    ctl = fleet.inv.host(s.controller)
    running = live_job_named(fleet, ctl, o.job)
    if running:
        raise TorchrigError(f"nothing submitted: job {o.job!r} is already slurm job {running}; "
                            f"`torchrig stop --job {o.job}` first, or pick another --job")
    # a systemd job on these GPUs: refused too
    interfaces = _gate(fleet, candidates, o.job, src.requires_python)
    check_data(fleet, candidates, o, log)
    _same_ids(fleet, [ctl] + [h for h in candidates if h is not ctl],
              candidates[0].settings.service_user)
    staged = stage.stage(fleet, candidates, src, log=log)
    job = plan_job(fleet.inv, candidates, o, staged.release, interfaces, staged)
    job.size = n
    by_name = {h.name: h for h in candidates}

    def dirs(nd):
        r = fleet.run(by_name[nd.host], "bash -s", root=True, timeout=60,
                      data=script("launch/jobdirs.sh", **jobdirs_values(job, nd)))
        if r.exited != 0:
            raise TorchrigError(r.stderr.strip()[-300:])
    made = fleet.fan_out(dirs, job.nodes, name=lambda nd: nd.host)
    bad = [f"{r.host}: {r.error}" for r in made if not r.ok]
    if bad:
        raise TorchrigError("nothing submitted: making the job's folders failed: " + "; ".join(bad))
    gpus = job.nodes[0].nproc if candidates[0].settings.accelerator == "cuda" else 0
    exclude = [c for c in s.compute if c not in by_name]
    batch = render_sbatch(job, partition, time_limit, gpus, exclude)
    r = fleet.run(ctl, submit_command(job.nodes[0].user), root=True, timeout=60, data=batch)
    job_id = facts.parse_sbatch(r.stdout) if r.exited == 0 else None
    if job_id is None:
        raise TorchrigError(f"sbatch on {ctl.name} refused job {job.name}: "
                            f"{(r.stderr or r.stdout).strip()[-300:]}")
    span = {} if job.min_nodes is None else {"span": [job.min_nodes, n]}
    write_record(fleet, ctl, job.name, {"job_id": job_id, "launch_id": job.launch_id,
                                        "nnodes": n, "submitted": time.time(), **span})
    sj = SlurmJob(job.name, job_id, None, {"job_id": job_id})
    log(f"slurm job {job_id} submitted on {ctl.name}")
    started = _confirm(fleet, ctl, job, sj, o.start_timeout)
    write_record(fleet, ctl, job.name, {"job_id": job_id, "launch_id": job.launch_id,
                                        "nnodes": n, "nodes": sj.nodes, **span})
    return SlurmLaunched(job, sj, started, round(time.monotonic() - t0, 2))


def _same_ids(fleet: Fleet, hosts: list[Host], user: str) -> None:
    """Slurm runs the job under the submitter's numeric uid/gid on every node: the service
    user must have the same ones everywhere, or the job would run as someone else there."""
    got = fleet.fan_out(lambda h: fleet.run(h, f"id -u -- {sh(user)} && id -g -- {sh(user)}",
                                            timeout=30).stdout.split(), hosts)
    ids = {r.host: " ".join(r.value) if r.ok and len(r.value) == 2 else None for r in got}
    if None in ids.values() or len(set(ids.values())) > 1:
        raise TorchrigError(f"nothing submitted: the service user {user!r} must exist with the "
                            "same uid and gid on the controller and every compute host "
                            "(uid gid: " + ", ".join(f"{h} {v or 'missing'}" for h, v in ids.items())
                            + "); create it with one uid everywhere (or from a directory service)")


def _confirm(fleet: Fleet, ctl: Host, job: Job, sj: SlurmJob, timeout: float) -> bool:
    """True once every allocated node spawned its workers (torchrun does so after the
    rendezvous); False if still pending at the timeout. A job that ended or did not spawn
    its workers in time is cancelled: one error line with Slurm's state and reason."""
    deadline = time.monotonic() + timeout
    nproc = {nd.host: nd.nproc for nd in job.nodes}
    logdir = {nd.host: job_folder(nd.log_dir, job.name) for nd in job.nodes}
    while True:
        sj.state = query(fleet, ctl, sj.job_id)
        st = sj.state
        if st is None or (not st.live and st.state != "COMPLETED"):
            raise TorchrigError(f"slurm job {sj.job_id} ended before it started: "
                                f"{st.state + ' (' + st.reason + ')' if st else 'unknown to Slurm'}"
                                f"; its batch output: {logdir[job.nodes[0].host]}/{BATCH_OUT.replace('%j', sj.job_id)} "
                                "on its first node")
        if st.state in ("RUNNING", "COMPLETING", "COMPLETED") and st.nodes:
            hosts = hosts_of(fleet, sj)
            got = fleet.fan_out(lambda h: int(fleet.run(h, workers_command(logdir[h.name]),
                                                        root=True, timeout=30).stdout.strip() or 0),
                                hosts)
            if all(r.ok and r.value >= nproc[r.host] for r in got) or st.state == "COMPLETED":
                return True
        if time.monotonic() >= deadline:
            if st.state == "PENDING":
                return False
            fleet.run(ctl, sh("scancel", sj.job_id), root=True, timeout=60)
            raise TorchrigError(f"slurm job {sj.job_id}: workers not started on every node within "
                                f"{timeout:.0f}s ({st.state} on {','.join(st.nodes)}), so it was "
                                f"cancelled; see `torchrig logs --failures --job {job.name}`")
        time.sleep(1)
