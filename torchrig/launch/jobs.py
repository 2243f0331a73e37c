"""`torchrig jobs`: every job on the selected hosts, one row each, and `jobs --prune`.

Reading: one probe round trip per node (onhost/launch/jobs_probe.py expands one request per
job unit found there: the unit's properties, its unit file, root's stop record, rank 0's
progress from the job's log folder, read as `status` reads them: facts/job_state.py); with a
Slurm cluster in the inventory, the controller's job records and Slurm's state of them
(squeue, then sacct). Pruning: the plan is made here from those rows (pure), and each node
re-checks it under its launch lock (onhost/launch/prune.sh), so a launch racing the prune
keeps its job. The parsers, the merge and the plan are pure and unit-tested."""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import dataclass, field

from .. import progress as protocol
from ..changes import managed
from ..errors import TorchrigError
from ..facts import job_state, probe, systemd
from ..facts import slurm as slurm_facts
from ..inventory import Host
from ..job import JOB_RE, RUNNING_STATES, gpumon_name, health_record, stop_record, unit_name
from ..onhost import Shell, script
from ..quoting import sh
from ..session import Fleet
from ..settings import JOBS_DIR
from . import slurm
from .plan import DATA_LINE, gpumon_paths, job_paths, unit_path

STATES = ("running", "restarting", "failed", "stopped", "succeeded")
ENDED = ("failed", "stopped", "succeeded")
PLACEHOLDER = "\0JOB\0"  # stands for the job's name in the request sent to the nodes
UNIT_PROPS = job_state.UNIT_PROPS + ["WorkingDirectory", "Description"]
PROGRESS_TAIL = 16 << 10  # bytes of rank 0's stdout.log read for its last progress line
LAUNCH_LINE = "# torchrig launch "  # plan.launch_marker()'s line in the unit file
NODE_RE = re.compile(r"\(node (\d+)/(\d+)\)")  # the unit's Description: "... (node R/N)"


# --- reading a node (pure) ----------------------------------------------------------------------

def request_template(log_dir_of, extra_jobs: list[str] = ()) -> dict:
    """What jobs_probe.py expands on a node. log_dir_of(job) -> the job's log folder there."""
    p = PLACEHOLDER
    unit = unit_name(p)
    return {"unit_dir": unit_path(p).rsplit("/", 1)[0],
            "unit_re": rf"torchrig-({JOB_RE.pattern})\.service", "placeholder": p,
            "common": {"host": True},
            "per_job": {"run": {"unit": systemd.show_argv([unit], UNIT_PROPS)},
                        "tree": {"logs": job_state._ranks_tree(log_dir_of(p), PROGRESS_TAIL)},
                        "read": {"stopped": {"path": stop_record(JOBS_DIR, p), "limit": 4096},
                                 "unitfile": {"path": unit_path(p), "limit": 1 << 16}}},
            "extra_jobs": sorted(extra_jobs), "extra_kinds": ["tree"]}


def stdin(template: dict) -> str:
    """The probe, the expansion and the call: all on stdin, nothing in a command line."""
    b64 = base64.b64encode(json.dumps(template).encode()).decode()
    return (probe.SCRIPT.read_text() + "\n" + script("launch/jobs_probe.py")
            + f'\nmain(expand("{b64}"))\n')


def parse_stop_record(text: str | None) -> float | None:
    """When `torchrig stop` stopped the job (stop.sh's record), or None: no record, or one
    that does not parse (it is root's, but read defensively all the same)."""
    if not text:
        return None
    try:
        d = json.loads(text)
        t = float(d["stopped_at"])
    except (ValueError, TypeError, KeyError):
        return None
    return t if t == t and t > 0 else None


def node_state(props: dict, stopped_at: float | None) -> str:
    """One node's state of a job from its unit (and stop's record):
    restarting: systemd restarts the agent (activating/auto-restart);
    running: the unit runs, starts or stops (a stopping job still writes its checkpoint);
    stopped: `torchrig stop` stopped it while it ran (its record), whatever torchrun's exit;
    failed: the unit failed, or ended with a result other than success;
    succeeded: it ended on its own with success."""
    active = props.get("ActiveState", "")
    if active == "activating" and props.get("SubState") == "auto-restart":
        return "restarting"
    if active in RUNNING_STATES:
        return "running"
    if stopped_at is not None:
        return "stopped"
    if active == "failed" or props.get("Result", "success") not in ("success", ""):
        return "failed"
    return "succeeded"


def _marker(unitfile: dict | None, start: str = LAUNCH_LINE) -> str:
    text = (unitfile or {}).get("text") or ""
    return next((ln for ln in text.splitlines() if ln.startswith(start)), "")


def node_jobs(raw: dict) -> dict[str, dict]:
    """{job: this node's view of it} from the expanded probe's reply (systemd units only)."""
    clock = raw.get("host") or {}
    out = {}
    for key, ran in sorted(raw.get("run", {}).items()):
        if not key.endswith("/unit"):
            continue
        job = key[:-len("/unit")]
        unit = unit_name(job)
        props = systemd.parse_show(ran.get("out", ""), [unit])[unit] if ran.get("rc") == 0 else {}
        if props.get("LoadState") == "not-found":
            continue
        logs = raw.get("tree", {}).get(f"{job}/logs") or {"dirs": [], "files": {}}
        attempt, _ = job_state.attempts(logs.get("dirs", []))
        stopped = parse_stop_record(((raw.get("read", {}).get(f"{job}/stopped")) or {}).get("text"))
        m = NODE_RE.search(props.get("Description", ""))
        ended = job_state.ended(props, clock.get("time", 0), clock.get("monotonic", 0))
        uptime = job_state.uptime(props, clock.get("monotonic", 0))
        out[job] = {
            "state": node_state(props, stopped),
            "unit": f"{props.get('ActiveState', '?')}/{props.get('SubState', '?')}",
            "node_rank": int(m.group(1)) if m else None,
            "uptime_s": uptime,
            "started_at": (round(clock["time"] - uptime, 1) if uptime is not None
                           else ended and round(ended["ended_at"] - ended["ran_s"], 1)) or None,
            "ended_at": ended.get("ended_at") or stopped,
            "stopped_at": stopped,
            "restarts": job_state.restarts(props, attempt),
            "progress": job_state.progress(logs.get("files", {})),
            "workdir": props.get("WorkingDirectory") or None,
            "marker": _marker(raw.get("read", {}).get(f"{job}/unitfile")),
            "data": _marker(raw.get("read", {}).get(f"{job}/unitfile"),
                            DATA_LINE)[len(DATA_LINE):] or None,
        }
    return out


def slurm_progress(raw: dict, job: str) -> str | None:
    """A Slurm job's last progress line on a node (its logs only: no unit there)."""
    logs = raw.get("tree", {}).get(f"{job}/logs")
    return job_state.progress(logs.get("files", {})) if logs else None


# --- one row per job (pure) ---------------------------------------------------------------------

# The merge rule, across a job's nodes: any node failed -> failed (the job cannot finish as
# launched); else any node waiting for systemd to restart it -> restarting; else any node
# still running (or stopping) -> running; else any node stopped by `torchrig stop` ->
# stopped; else (every node ended on its own with success) -> succeeded.
PRECEDENCE = ("failed", "restarting", "running", "stopped", "succeeded")


def merge_state(states: list[str]) -> str:
    for s in PRECEDENCE:
        if s in states:
            return s
    return "unknown"


def step_loss(line: str | None) -> tuple[str | None, str | None]:
    p = protocol.parse(line) if line else None
    if p is None:
        return None, None
    return p.fields.get("step"), p.fields.get("loss")


@dataclass
class JobRow:
    job: str
    backend: str                       # systemd or slurm
    state: str
    nodes: dict[str, str]              # host -> that node's state (systemd), or Slurm's nodes
    started_at: float | None = None
    ended_at: float | None = None      # None while any node runs
    running_s: float | None = None     # while it runs: the longest uptime among its nodes
    restarts: int | None = None
    progress: str | None = None        # rank 0's last progress line (the job wrote it)
    step: str | None = None
    loss: str | None = None
    workdir: str | None = None         # the release the unit runs in (WorkingDirectory)
    slurm_id: str | None = None
    markers: dict[str, str] = field(default_factory=dict)  # host -> the unit's launch line
    data: str | None = None            # the dataset it was launched with (`launch --data`)

    @property
    def running(self) -> bool:
        return any(s not in ENDED for s in self.nodes.values()) if self.backend == "systemd" \
            else self.state not in ENDED

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("job", "backend", "state", "nodes", "started_at",
                                           "ended_at", "running_s", "restarts", "step", "loss",
                                           "progress", "workdir", "slurm_id", "data")}
        return d


def merge(job: str, per_node: dict[str, dict]) -> JobRow:
    """One systemd job's row from {host: node_jobs()[job]} (hosts in selection order)."""
    views = list(per_node.values())
    states = {h: v["state"] for h, v in per_node.items()}
    state = merge_state(list(states.values()))
    ranked = sorted(per_node.items(), key=lambda hv: (hv[1]["node_rank"] is None,
                                                      hv[1]["node_rank"] or 0))
    line = next((v["progress"] for _, v in ranked if v["progress"]), None)
    step, loss = step_loss(line)
    starts = [v["started_at"] for v in views if v["started_at"]]
    ends = [v["ended_at"] for v in views if v["ended_at"]]
    ups = [v["uptime_s"] for v in views if v["uptime_s"] is not None]
    still = any(s not in ENDED for s in states.values())
    restarts = [v["restarts"] for v in views if v["restarts"] is not None]
    return JobRow(job, "systemd", state, states,
                  started_at=min(starts) if starts else None,
                  ended_at=None if still or not ends else max(ends),
                  running_s=max(ups) if still and ups else None,
                  restarts=max(restarts) if restarts else None,
                  progress=line, step=step, loss=loss,
                  workdir=ranked[0][1]["workdir"] if ranked else None,
                  markers={h: v["marker"] for h, v in per_node.items()},
                  data=next((v.get("data") for v in views if v.get("data")), None))


SLURM_STATES = {"COMPLETED": "succeeded", "CANCELLED": "stopped", "PENDING": "pending",
                "REQUEUED": "restarting", "REQUEUE_HOLD": "restarting", "REQUEUE_FED": "restarting",
                "FAILED": "failed", "NODE_FAIL": "failed", "TIMEOUT": "failed",
                "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed", "DEADLINE": "failed",
                "PREEMPTED": "failed"}


def slurm_state(state: str | None) -> str:
    """torchrig's word for Slurm's job state (None: Slurm no longer knows the job)."""
    if state is None:
        return "unknown"
    if state in SLURM_STATES:
        return SLURM_STATES[state]
    return "running" if state in slurm_facts.LIVE else "unknown"


def slurm_row(job: str, job_id: str, st: slurm_facts.JobState | None, record: dict,
              progress: str | None) -> JobRow:
    nodes = (st.nodes if st and st.nodes else list(record.get("nodes", [])))
    step, loss = step_loss(progress)
    return JobRow(job, "slurm", slurm_state(st.state if st else None),
                  {n: (st.state if st else "UNKNOWN") for n in nodes},
                  started_at=record.get("submitted") if isinstance(record.get("submitted"), (int, float)) else None,
                  progress=progress, step=step, loss=loss, slurm_id=job_id)


def parse_records(found: dict[str, str | None]) -> dict[str, dict]:
    """{job: record} from the controller's {path: text} of <JOBS_DIR>/<job>.slurm files."""
    out = {}
    for path, text in found.items():
        job = path.rsplit("/", 1)[-1].removesuffix(".slurm")
        if not JOB_RE.fullmatch(job) or not text:
            continue
        try:
            rec = json.loads(text)
        except ValueError:
            continue
        if isinstance(rec, dict) and re.fullmatch(r"\d+", str(rec.get("job_id", ""))):
            out[job] = rec
    return out


# --- the fleet --------------------------------------------------------------------------------

@dataclass
class Listing:
    rows: list[JobRow]
    failures: list[str]                # "host: why" for nodes (or the controller) not read
    raw_rows: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures


def _slurm_jobs(fleet: Fleet) -> tuple[dict[str, tuple[str, object, dict]], list[str]]:
    """{job: (slurm id, its JobState or None, record)} from the controller: its records (one
    probe), then squeue over all their ids, then sacct for those squeue forgot."""
    s = getattr(fleet.inv, "slurm", None)
    if s is None:
        return {}, []
    ctl = fleet.inv.host(s.controller)
    try:
        r = fleet.run(ctl, probe.COMMAND, timeout=60, data=probe.stdin(
            {"glob": {"slurm": {"pattern": slurm.record_path("*"), "limit": 1 << 16}}}))
        recs = parse_records(probe.reply(r.exited, r.stdout, r.stderr,
                                         "reading the Slurm job records")["glob"]["slurm"])
        ids = {job: str(rec["job_id"]) for job, rec in recs.items()}
        states: dict[str, object] = {}
        if ids:
            q = fleet.run(ctl, sh(*slurm_facts.squeue_argv(",".join(sorted(set(ids.values()))))),
                          timeout=30)
            for jid in set(ids.values()):
                states[jid] = slurm_facts.parse_squeue(q.stdout, jid) if q.exited == 0 else None
            gone = sorted(j for j, v in states.items() if v is None)
            if gone:
                a = fleet.run(ctl, sh(*slurm_facts.sacct_argv(",".join(gone))), timeout=30)
                for jid in gone:
                    states[jid] = slurm_facts.parse_sacct(a.stdout, jid) if a.exited == 0 else None
    except TorchrigError as e:
        return {}, [f"{ctl.name} (Slurm controller): {e}"]
    return {job: (ids[job], states.get(ids[job]), recs[job]) for job in recs}, []


def list_jobs(fleet: Fleet, hosts: list[Host]) -> Listing:
    """Every job on the hosts, one row each (systemd jobs in name order, then Slurm's)."""
    sl, failures = _slurm_jobs(fleet)
    names = {h.name for h in hosts}

    def one(h: Host) -> dict:
        extra = [j for j, (_, st, rec) in sl.items()
                 if h.name in ((st.nodes if st and st.nodes else None) or rec.get("nodes", []))]
        tmpl = request_template(h.settings.job_log_dir, extra)
        r = fleet.run(h, probe.COMMAND, root=True, timeout=60, data=stdin(tmpl))
        return probe.reply(r.exited, r.stdout, r.stderr, "reading the node's jobs")
    res = fleet.fan_out(one, hosts)
    failures += [f"{r.host}: {r.error}" for r in res if not r.ok]
    per_job: dict[str, dict[str, dict]] = {}
    for r in res:
        if r.ok:
            for job, v in node_jobs(r.value).items():
                per_job.setdefault(job, {})[r.host] = v
    rows = [merge(job, per_job[job]) for job in sorted(per_job)]
    for job, (jid, st, rec) in sorted(sl.items()):
        nodes = st.nodes if st and st.nodes else rec.get("nodes", [])
        line = None
        for n in nodes:  # rank 0's node first: Slurm's order is the node rank order
            got = next((r for r in res if r.ok and r.host == n), None)
            if got is not None and n in names:
                line = slurm_progress(got.value, job)
                if line:
                    break
        rows.append(slurm_row(job, jid, st, rec, line))
    return Listing(rows, failures)


# --- prune ------------------------------------------------------------------------------------

@dataclass
class PrunePlan:
    prune: list[JobRow]
    kept: list[tuple[str, str]]        # (job, why)


def plan_prune(rows: list[JobRow], now: float, older_than_days: float | None = None) -> PrunePlan:
    """Which jobs a prune removes (pure): systemd jobs that ended on every node they are on
    (and, with older_than_days, ended at least that long ago); a running job is never in it,
    nor a Slurm job (its files are the nodes' logs and the controller's record: not pruned)."""
    out = PrunePlan([], [])
    for row in rows:
        if row.backend != "systemd":
            out.kept.append((row.job, "a Slurm job: not pruned"))
        elif row.running:
            out.kept.append((row.job, f"{row.state}: a job that runs is never pruned"))
        elif older_than_days is not None and row.ended_at is None:
            out.kept.append((row.job, "its end time is unknown (systemd forgot it): kept by "
                                      "--older-than; prune without it to remove it"))
        elif older_than_days is not None and now - row.ended_at < older_than_days * 86400:
            out.kept.append((row.job, f"ended less than {older_than_days:g} day(s) ago"))
        else:
            out.prune.append(row)
    return out


def ended_unit(job: str) -> str:
    """The unit the job's unit starts once it ended (managed.JOB_ENDED)."""
    return managed.JOB_ENDED.path(job).rsplit("/", 1)[1]


def job_files(job: str) -> list[str]:
    """A job's files on a node that a prune removes: launch's (plan.job_paths: env, run id,
    unit, sampler units, the unit started once it ended) and stop's record."""
    files = job_paths(job)
    files += [p for p in gpumon_paths(job) if p not in files]
    return files + [stop_record(JOBS_DIR, job), health_record(JOBS_DIR, job)]


def prune_script(h: Host, rows: list[JobRow], with_logs: bool, with_checkpoints: bool) -> str:
    s = h.settings
    items = []
    for row in rows:
        dirs = ([[s.log_dir, row.job]] if with_logs else []) + \
               ([[s.checkpoint_dir, row.job]] if with_checkpoints else [])
        items.append({"job": row.job, "unit": unit_name(row.job),
                      "timer": gpumon_name(row.job, "timer"), "sampler": gpumon_name(row.job),
                      "ended": ended_unit(row.job),
                      "unit_file": unit_path(row.job), "marker": row.markers.get(h.name, ""),
                      "files": Shell(sh(*job_files(row.job))),
                      "dirs": json.dumps({"remove": dirs}) if dirs else ""})
    return script("launch/prune.sh", jobs=JOBS_DIR, prune=items,
                  running_re="|".join(RUNNING_STATES),
                  dirs_script=Shell(script("launch/jobdirs.py")))


def parse_prune(out: str) -> dict:
    """prune.sh's lines: {"pruned": [job], "kept": {job: why}, "notes": [line]}."""
    got: dict = {"pruned": [], "kept": {}, "notes": []}
    for ln in out.splitlines():
        word, _, rest = ln.partition(" ")
        if word == "pruned" and JOB_RE.fullmatch(rest):
            got["pruned"].append(rest)
        elif word == "kept" and rest:
            job, _, why = rest.partition(" ")
            got["kept"][job] = why
        elif ln.strip():
            got["notes"].append(ln)
    return got


@dataclass
class Pruned:
    plan: PrunePlan
    nodes: dict[str, dict]             # host -> parse_prune()
    failures: list[str]


def prune(fleet: Fleet, hosts: list[Host], listing: Listing, older_than_days: float | None,
          with_logs: bool, with_checkpoints: bool, now: float | None = None) -> Pruned:
    """Prune what plan_prune picks from a complete listing: with a node unread, a job could
    still run there, so nothing is pruned."""
    if listing.failures:
        raise TorchrigError("nothing pruned: not every node could be read ("
                            + "; ".join(listing.failures) + ")")
    plan = plan_prune(listing.rows, time.time() if now is None else now, older_than_days)
    todo = {h.name: [r for r in plan.prune if h.name in r.nodes] for h in hosts}
    targets = [h for h in hosts if todo[h.name]]

    def one(h: Host) -> dict:
        r = fleet.run(h, "bash -s", root=True, timeout=600,
                      data=prune_script(h, todo[h.name], with_logs, with_checkpoints))
        if r.exited != 0:
            from ..onhost import refusal
            raise TorchrigError(refusal(r.stderr) or f"prune failed: {r.stderr.strip()[-300:]}")
        return parse_prune(r.stdout)
    res = fleet.fan_out(one, targets)
    return Pruned(plan, {r.host: r.value for r in res if r.ok},
                  [f"{r.host}: {r.error}" for r in res if not r.ok])
