"""`torchrig status`: a job's state on its nodes, one probe round trip per node (unit, restarts,
progress, GPU use and the unit's journal); from those journals the first failed rank and what
each node waits for (logs/diagnose.py); the job's Slurm record when Slurm runs it; and which
job is the newest when the operator names none (every job task's default)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import TorchrigError
from ..facts import job_state, probe
from ..inventory import Host
from ..job import check_job_name, health_record, unit_name
from ..logs import diagnose
from ..quoting import sh
from ..secrets import Redactor
from ..session import Fleet, Outcome
from ..settings import JOBS_DIR
from ..trend import Trend
from .. import progress
from . import elastic, slurm
from .run import GPU_SAMPLE_S, no_job


def latest_job(fleet: Fleet) -> str:
    """The newest job: the systemd job on the first selected host whose env file was written
    last, or the newest Slurm job on the inventory's controller, whichever is newer."""
    first = fleet.hosts[0]
    found = []  # (mtime, job)
    for h, ext in ((first, ".env"),) + (((fleet.inv.host(fleet.inv.slurm.controller), ".slurm"),)
                                          if getattr(fleet.inv, "slurm", None) else ()):
        newest = f"cd {sh(JOBS_DIR)} 2>/dev/null && stat -c '%Y %n' -- *{ext} 2>/dev/null | sort -n | tail -1"
        out = fleet.run(h, newest).stdout.split()
        if len(out) == 2 and out[0].isdigit():
            found.append((int(out[0]), out[1][:-len(ext)]))
    if not found:
        raise TorchrigError(f"no torchrig job found on {first.name}; pass --job NAME")
    return max(found)[1]


def slurm_record(fleet: Fleet, job: str, kept: Watched | None = None) -> slurm.SlurmJob | None:
    """The job's Slurm record when the inventory has a cluster and Slurm runs it, with the
    fleet narrowed to its nodes in Slurm's order; else None (a systemd job). kept: a --watch
    looks the record up in its first round; later rounds ask Slurm only for the job's state."""
    if kept is not None and kept.looked:
        sj = kept.slurm and slurm.refresh(fleet, kept.slurm)
    else:
        sj = slurm.find(fleet, job)
    if kept is not None:
        kept.slurm, kept.looked = sj, True
    if sj is not None and sj.nodes:
        fleet.hosts = slurm.hosts_of(fleet, sj)
    return sj


def journal_ident(job: str, sj: slurm.SlurmJob | None) -> str | None:
    """The identifier a Slurm job's agent lines carry in the journal (None: the unit's own)."""
    return slurm.identifier(job) if sj is not None else None


def lost_nodes(fleet: Fleet, journals: list, sj: slurm.SlurmJob | None) -> list[str]:
    """A Slurm job's nodes whose journal could not be read (powered off, unreachable)."""
    if sj is None:
        return []
    read = {n.host for n in journals}
    return [h.name for h in fleet.hosts if h.name not in read]


def diagnosis(fleet: Fleet, journals: list, job: str, sj: slurm.SlurmJob | None = None) -> dict:
    """From the nodes' journals: the job's first failed rank and what each node waits for;
    for a Slurm job, also its nodes whose journal could not be read (lost)."""
    found = diagnose.failures(journals, unit_name(job))
    return {"failure": found[0].as_dict() if found else None,
            "waiting": diagnose.waiting(journals, len(fleet.hosts)),
            **({"lost_nodes": lost_nodes(fleet, journals, sj)} if sj is not None else {})}


@dataclass
class Watched:
    """What a `status --watch` carries from one round to the next, so that a round reads only
    what is new and round 100 costs what round 1 did: per node its journal (with the cursors
    where the last read ended) and its files' tails (job_state.follow), {host: {"journal",
    "files", "util"}}; the job's Slurm record, looked up once."""
    nodes: dict = field(default_factory=dict)
    slurm: slurm.SlurmJob | None = None
    looked: bool = False


@dataclass
class StatusRound:
    """One look at a job: its nodes' states, the diagnosis, its Slurm record (or None); in a
    --watch, the trend over the rounds so far (a sparkline per node)."""
    job: str
    nodes: "JobStatus"
    diagnosis: dict
    slurm: slurm.SlurmJob | None = None
    trend: Trend | None = None
    elastic: dict | None = None  # an elastic job: elastic.summary()


def look(fleet: Fleet, job: str, kept: Watched | None = None) -> StatusRound:
    """`torchrig status`'s one round (a --watch repeats it, carrying `kept`)."""
    sj = slurm_record(fleet, job, kept)
    if sj is not None and not sj.nodes:
        d = sj.as_dict()
        raise TorchrigError(f"job {job}: slurm job {sj.job_id} {d['state']} ({d['reason']}), "
                            "on no node yet")
    res = node_states(fleet, fleet.hosts, job, sj.as_dict()["state"] if sj else None,
                      journal_ident(job, sj), None if kept is None else kept.nodes)
    return StatusRound(job, res, diagnosis(fleet, res.journals, job, sj), sj,
                       elastic=elastic.summary(list(res), progress.parse_world,
                                               sj.span if sj is not None else None))


def watch(fleet: Fleet, job: str, every: float = 0, red: Redactor | None = None,
          sleep=time.sleep) -> Iterator[StatusRound]:
    """`torchrig status`'s rounds, redacted: one look, or with `every` > 0 one every `every`
    seconds until the caller stops; each reads only what its nodes wrote since the last
    round (Watched), and adds its samples to the trend the rounds share."""
    red = red or Redactor()  # the inventory's secrets do not change between rounds
    trend = Trend() if every else None
    kept = Watched() if every else None
    while True:
        rnd = look(fleet, job, kept)
        rnd.diagnosis, rnd.nodes, rnd.trend = red.data(rnd.diagnosis), red.data(rnd.nodes), trend
        rnd.elastic = red.data(rnd.elastic)
        cut_last_lines(rnd.nodes)
        if trend is not None:
            for r in rnd.nodes:
                if r.ok:
                    trend.add(r.host, time.monotonic(), r.value.get("progress"), r.value["gpus"])
        yield rnd
        if not every:
            return
        sleep(every)


# characters of a script's last line status shows (table and JSON alike)
SHOWN_LINE = 200


def cut_last_lines(nodes: "JobStatus", most: int = SHOWN_LINE) -> None:
    """Each node's last line (a script that prints no progress lines: job_state.last_line)
    cut to `most` characters, in place: after the redactor ran, so a secret the cut would
    split is already masked whole."""
    for r in nodes:
        line = r.value.get("last_line") if r.ok and isinstance(r.value, dict) else None
        if isinstance(line, str) and len(line) > most:
            r.value["last_line"] = line[:most - 1] + "…"


@dataclass
class JobStatus(Outcome):
    """status's result: per node the job's state (Outcome), and the nodes' unit journals read
    in the same probe, for diagnose (first failure, what each node waits for)."""
    journals: list = field(default_factory=list)


# status runs often (--watch): the journal's newest lines only, no rank lines (the waits
# and an ended job's failure are at the end)
STATUS_JOURNAL_LINES = 20000
# each line cut at this (the agent's lines are short; the unit's journal keeps whatever a job
# writes to it, up to journald's 48 KiB a line): the 5000 kept lines stay a few MB
STATUS_JOURNAL_MAX_LINE = 4 << 10


def node_states(fleet: Fleet, hosts: list[Host], job: str, slurm_state: str | None = None,
           ident: str | None = None, kept: dict | None = None) -> JobStatus:
    """Per node: unit state, restarts, attempt, uptime, latest progress, GPUs, util samples,
    and its journal: one probe round trip per node. slurm_state: Slurm runs the job (no unit
    on the nodes): its state stands in the unit's, and the journal is read by the job's
    identifier `ident`. kept: Watched.nodes, carried from one `--watch` round to the next:
    each round reads only the journal lines after the last round's cursors and the bytes
    its files grew by."""
    check_job_name(job)
    unit = unit_name(job)
    journals: dict[str, object] = {}
    ranks = {h.name: i for i, h in enumerate(hosts)}

    def one(h: Host) -> dict:
        s = h.settings
        window = s.low_util_minutes * 60
        tail = job_state.util_tail(window, h.gpus, GPU_SAMPLE_S)
        k = None if kept is None else kept.setdefault(h.name, {})
        req = job_state.probe_request(unit, s.job_log_dir(job), s.util_file(job), tail, k,
                                      health_record(JOBS_DIR, job))
        req["journal"] = diagnose.journal_request(unit, keep=0, lines=STATUS_JOURNAL_LINES,
                                                  ident=ident, after=k and k.get("journal"))
        req["journal"]["max_line"] = STATUS_JOURNAL_MAX_LINE
        r = fleet.run(h, probe.COMMAND, root=True, timeout=60, data=probe.stdin(req))
        raw = probe.reply(r.exited, r.stdout, r.stderr, "status")
        doc = diagnose.merge_journal(k and k.get("journal"), raw["journal"], keep=0)
        if k is not None:
            k["journal"] = doc
            job_state.follow(k, raw, tail)
        journals[h.name] = diagnose.node_from(h.name, ranks[h.name], doc)
        d = job_state.state(unit, raw, window)
        d["journal_cut"] = probe.cut_note(raw["journal"].get("cut"), "the journal")
        if slurm_state is not None:
            d["unit"] = {"ActiveState": slurm_state.lower(), "SubState": "slurm"}
        elif d["unit"].get("LoadState") == "not-found":
            raise TorchrigError(no_job(job))
        d["low_util"] = low_utilisation(d["util_samples"], window,
                                        s.low_util_percent)
        return d
    res = fleet.fan_out(one, hosts)
    return JobStatus(f"job {job}", res, [p for r in res if r.ok for p in node_problems(r.host, r.value)],
                     [journals[h.name] for h in hosts if h.name in journals])


def node_problems(host: str, d: dict) -> list[str]:
    """What makes status exit non-zero for one node: its unit failed, or its health watcher
    found a fault (then the reason says why the unit ended)."""
    health = d.get("health") or {}
    if health.get("healthy") is False:
        return [f"{host}: unhealthy: {health.get('reason') or 'a GPU fault'}"]
    return [f"{host}: unit failed"] if d["unit"].get("ActiveState") in FAILED else []


FAILED = ("failed", "node_fail", "timeout", "out_of_memory", "boot_fail", "deadline")  # unit, Slurm


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
