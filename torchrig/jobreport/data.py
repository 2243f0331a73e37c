"""`torchrig report`'s data: the nodes' raw probe replies (gather.py) -> what the report shows.
Pure: text in, data out. Everything here was written by the job or about it (progress lines,
sampler files): values are parsed defensively (a bad or non-finite number is skipped).

- progress: the ranks' progress lines from the unit's journal (payload/progress.py, through
  torchrig/progress.py), with the journal's time; `attempt` counts the rank's start lines, so a
  resumed run after a torchrun restart is its own series;
- GPU history: the sampler's files (`<time>,<util %>...` and `<time>,<used MiB>,<total MiB>...`);
- events: the unit's start and end (systemd's lines), torchrun's worker-group restarts and
  every worker that failed on its own (not sent a closing signal), from the agent's lines
  (logs/agent.py) with the cause logs/diagnose.py gives it;
- world: rank 0's world lines (one at every (re)start: the step, the world size, the nodes,
  the global batch), with their time: the world size over time of an elastic job;
- what was run: the script and its arguments (the unit's ExecStart), the world size and
  backend (the ranks' start lines), torch's and the driver's versions per node;
- restarts per node: facts/job_state.restarts(), the number `status` shows."""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field

from ..facts import job_state, probe, systemd
from ..launch.plan import script_and_args
from ..logs import agent, diagnose
from ..progress import protocol

_RANK = re.compile(r"^\[default(\d+)\]:")
_SEQ = re.compile(r"(?:^|;)i=([0-9a-f]+)(?:;|$)")  # the journal's sequence number, in a cursor
_ARGV = re.compile(r"\bargv\[\]=(.*?) ; ")  # systemctl show's ExecStart={ path=... ; argv[]=... ; ...}


@dataclass
class Event:
    t: float
    host: str
    kind: str          # start | restart | failure | end
    text: str


@dataclass
class Node:
    host: str
    state: str                                     # the unit's ActiveState
    gpu_util: dict[int, list] = field(default_factory=dict)   # gpu -> [(t, util %)]
    gpu_mem: dict[int, list] = field(default_factory=dict)    # gpu -> [(t, used MiB, total MiB)]
    journal: diagnose.NodeJournal | None = None
    restarts: int | None = None                    # job_state.restarts(): as `status` counts
    script: str | None = None                      # what the unit runs, with its arguments
    args: list[str] = field(default_factory=list)
    started: dict[str, str] = field(default_factory=dict)   # the newest start line's fields
    versions: dict[str, str] = field(default_factory=dict)  # torch, driver
    cut: str | None = None                         # what the probe's caps cut, in words


@dataclass
class JobReport:
    job: str
    generated: float
    nodes: list[Node] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # host -> it has no such job
    unreadable: dict[str, str] = field(default_factory=dict)  # host -> why it could not be read
    cut: dict[str, str] = field(default_factory=dict)  # host -> what the probe's caps cut
    steps: list[dict] = field(default_factory=list)  # {"t", "attempt", "rank", "step", "loss", "tok/s", ...}
    world: list[dict] = field(default_factory=list)  # {"t", "step", "world_size", "nodes", ...}
    events: list[Event] = field(default_factory=list)
    failures: list[diagnose.Failure] = field(default_factory=list)
    bandwidth: dict[str, dict] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        """A node's unit still runs (or stops) the job."""
        return any(n.state in job_state.RUNNING_STATES for n in self.nodes)

    def span(self) -> tuple[float, float] | None:
        """(first start, end): the last end, or now while the job runs; None before a start."""
        starts = [e.t for e in self.events if e.kind == "start"]
        ends = [e.t for e in self.events if e.kind == "end"]
        if not starts:
            return None
        if self.running or not ends:
            return min(starts), max(self.generated, *(e.t for e in self.events))
        return min(starts), max(ends)

    def summary(self) -> dict:
        """steps, first and last loss, median tokens/s (the first interval, start-up, left out),
        restarts (the most of any node: each node's agent restarts its own workers), failures,
        the job's span in seconds (up to now while it runs) and whether it still runs."""
        losses = [s["loss"] for s in self.steps if "loss" in s]
        rates = [s["tok/s"] for s in self.steps[1:] if "tok/s" in s]
        span = self.span()
        ended = any(e.kind == "end" for e in self.events)
        return {"steps": max((s["step"] for s in self.steps), default=None),
                "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
                "median_tok_s": statistics.median(rates) if rates else None,
                "restarts": max((n.restarts or 0 for n in self.nodes), default=0),
                "failures": sum(1 for e in self.events if e.kind == "failure"),
                "running": self.running,
                "seconds": (span[1] - span[0]) if span and (self.running or ended) else None}

    def started(self) -> bool:
        """Whether any node's ranks printed torchrig's start lines (a script of the user's own
        that does not speak the progress protocol prints none)."""
        return any(n.started for n in self.nodes)

    def command(self) -> dict:
        """What was run: the first node's script and arguments and its ranks' world size and
        backend; the versions per node (one value when every node has the same)."""
        first = self.nodes[0] if self.nodes else None
        out = {"script": first.script if first else None, "args": first.args if first else [],
               "nodes": [n.host for n in self.nodes],
               "world_size": first.started.get("world_size") if first else None,
               "backend": first.started.get("backend") if first else None}
        for key in ("torch", "driver"):
            seen = {n.host: n.versions.get(key) or "?" for n in self.nodes}
            out[key] = (next(iter(seen.values())) if len(set(seen.values())) == 1
                        else ", ".join(f"{h} {v}" for h, v in seen.items()))
        return out


def _number(text) -> float | None:
    try:
        v = float(text)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def journal_lines(out: str) -> list[tuple[float, str]]:
    """journalctl -o json lines -> [(unix time, message)] of the unit's newest start on, in
    journal order (a message that is not UTF-8 comes as a list of bytes). With --grep and -n,
    journalctl 252 prints the entries newest first: they are sorted by time and sequence
    number."""
    keyed = []
    for raw in out.splitlines():
        try:
            d = json.loads(raw)
            t = int(d["__REALTIME_TIMESTAMP"]) / 1e6
            seq = _SEQ.search(str(d.get("__CURSOR", "")))
        except (ValueError, KeyError, TypeError):
            continue
        msg = d.get("MESSAGE")
        if isinstance(msg, list):
            msg = bytes(b & 0xFF for b in msg if isinstance(b, int)).decode(errors="replace")
        if isinstance(msg, str):
            keyed.append((t, int(seq.group(1), 16) if seq else 0, msg))
    lines = [(t, msg) for t, _, msg in sorted(keyed, key=lambda k: k[:2])]
    for i in range(len(lines) - 1, -1, -1):
        if agent._SYSTEMD_STARTED.match(lines[i][1]):
            return lines[i:]
    return lines


def history(text: str, width: int) -> dict[int, list]:
    """The sampler's '<time>,v,v,...' lines, `width` values per GPU -> {gpu: [(t, *values)]}
    in time order."""
    out: dict[int, list] = {}
    for ln in text.splitlines():
        vals = [_number(x) for x in ln.strip().split(",")]
        if len(vals) < 1 + width or (len(vals) - 1) % width or vals[0] is None:
            continue
        for g in range((len(vals) - 1) // width):
            row = vals[1 + g * width: 1 + (g + 1) * width]
            if None not in row:
                out.setdefault(g, []).append((vals[0], *row))
    return {g: sorted(v) for g, v in out.items()}


def progress(lines: list[tuple[float, str]]) -> list[dict]:
    """The step and done lines (rank 0 prints them) as numbers, with their time and attempt
    (how many times that local rank had started before)."""
    starts: dict[int, int] = {}
    ranks: dict[int, int] = {}   # local rank -> global rank, from its newest start line
    out = []
    for t, msg in lines:
        m = _RANK.match(msg)
        p = protocol.parse(msg) if m else None
        if p is None:
            continue
        lr = int(m.group(1))
        if p.kind == "start":
            starts[lr] = starts.get(lr, 0) + 1
            ranks[lr] = int(_number(p.fields.get("rank")) or 0)
        elif p.kind in protocol.PROGRESS:
            row = {"t": t, "attempt": max(starts.get(lr, 1) - 1, 0), "rank": ranks.get(lr), "kind": p.kind}
            for k, v in p.fields.items():
                if (x := _number(v)) is not None:
                    row[k] = x
            if "step" in row:
                out.append(row)
    return out


def world(lines: list[tuple[float, str]]) -> list[dict]:
    """The world lines (rank 0 prints one at every (re)start, on whichever node it runs) as
    numbers with their time: {"t", "step", "world_size", "nodes", "global_batch", "micro_batch",
    "grad_accum", and "from" after a resize}."""
    return [{"t": t, **w} for t, msg in lines
            if _RANK.match(msg) and (w := protocol.parse_world(msg)) is not None]


def events(nj: diagnose.NodeJournal, lines: list[tuple[float, str]], unit: str) -> list[Event]:
    """A node's events: systemd's start and end lines and the agent's restart lines at their
    journal time; each worker that failed on its own at the time its agent saw it."""
    host, log = nj.host, nj.log
    out = []
    for t, msg in lines:
        if agent._SYSTEMD_STARTED.match(msg):
            out.append(Event(t, host, "start", "unit started"))
        elif agent._SYSTEMD_ENDED.match(msg):
            out.append(Event(t, host, "end", msg.split(": ", 1)[-1]))
        elif m := agent._RESTART.search(msg):
            out.append(Event(t, host, "restart", f"worker group {m.group(1).lower()}, restarted "
                                                 f"({m.group(2)}/{m.group(3)} attempts left)"))
    ends = [e for e in out if e.kind == "end"]
    out = [e for e in out if e.kind != "end"] + ends[-1:]  # "main process exited", then its result
    for e in log.exits:
        if e.exitcode == 0 or e.terminated:
            continue
        at = agent.to_unix(e.when, nj.year, nj.utc_offset)
        if at is not None:
            g = agent.global_rank(e, nj.node_rank, log.nproc)
            out.append(Event(at, host, "failure", f"rank {g} (local {e.local_rank}, pid {e.pid}) "
                                                  + diagnose.cause(nj, e, unit)))
    return out


def exec_argv(prop: str) -> list[str]:
    """The command line in systemctl show's ExecStart value (its words, as systemd shows them)."""
    m = _ARGV.search(prop or "")
    return m.group(1).split() if m else []


def started(lines: list[tuple[float, str]]) -> dict[str, str]:
    """The fields of the newest rank start line (world_size, backend, device_name ...)."""
    for _, msg in reversed(lines):
        if _RANK.match(msg) and (p := protocol.parse(msg)) is not None and p.kind == "start":
            return dict(p.fields)
    return {}


def _first_line(res: dict | None) -> str | None:
    out = (res or {}).get("out") or ""
    return out.strip().splitlines()[0] if (res or {}).get("rc") == 0 and out.strip() else None


def node(host: str, node_rank: int, reply: dict, unit: str) -> tuple[Node | None, list, list, str | None]:
    """(Node, its progress rows and world lines, its events, why it is left out) from one probe
    reply."""
    run = reply["run"]
    props = systemd.parse_show(run["unit"]["out"], [unit])[unit]
    if props.get("LoadState", "not-found") == "not-found":
        return None, ([], []), [], "no such job on this host"
    lines = journal_lines(run["journal"]["out"])
    year, _, off = run["clock"]["out"].strip().partition(" ")
    nj = diagnose.node_from(host, node_rank, {"journal": "\n".join(m for _, m in lines),
                                              "year": int(year) if year.isdigit() else 1970,
                                              "utc_offset": off or "+0000",
                                              "kernel": run["kernel"]["out"]})
    n = Node(host, props.get("ActiveState", "?"),
             history((reply["read"]["util"] or {}).get("text", ""), 1),
             history((reply["read"]["mem"] or {}).get("text", ""), 2), nj,
             cut=probe.cut_note(run["journal"].get("cut"), "the journal"))
    evs = events(nj, lines, unit)
    # the journal starts at the unit's newest start: its restart lines are torchrun's attempt
    n.restarts = job_state.restarts(props, sum(1 for e in evs if e.kind == "restart"))
    n.script, n.args = script_and_args(exec_argv(props.get("ExecStart", ""))) or (None, [])
    n.started = started(lines)
    n.versions = {k: v for k in ("torch", "driver") if (v := _first_line(run.get(k)))}
    return n, (progress(lines), world(lines)), evs, None


def build(job: str, unit: str, gathered: dict, now: float) -> JobReport:
    """gather.gather()'s result -> JobReport (nodes in order; a node's rank is its position among
    the nodes that have the job)."""
    rep = JobReport(job, now, bandwidth={})
    for host, reply in gathered["nodes"]:
        if isinstance(reply, str):
            rep.unreadable[host] = reply
            continue
        n, (rows, worlds), evs, why = node(host, len(rep.nodes), reply, unit)
        if n is None:
            rep.missing[host] = why
            continue
        rep.nodes.append(n)
        if n.cut:
            rep.cut[host] = n.cut
        rep.steps += rows
        rep.world += worlds
        rep.events += evs
    rep.steps.sort(key=lambda r: r["t"])
    rep.world.sort(key=lambda r: r["t"])
    rep.events.sort(key=lambda e: e.t)
    rep.failures = diagnose.failures([n.journal for n in rep.nodes], unit)
    hosts = {n.host for n in rep.nodes}
    rep.bandwidth = {h: r for h, r in gathered.get("bandwidth", {}).items() if h in hosts}
    return rep
