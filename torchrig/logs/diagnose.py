"""Why a job failed and what each node waits for, from every node's unit journal (torchrun's
agent lines, see agent.py) and kernel OOM lines, plus the ranks' error.json reports when some
were written. Used by `status` and `logs --failures`.

fetch() is the edge (one probe per node; `status` adds the same journal request to its own
probe instead); the rest is pure."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import agent
from ..terminal import printable
from .merge import rank_label



@dataclass
class NodeJournal:
    host: str
    node_rank: int
    log: agent.AgentLog
    year: int
    utc_offset: str
    kernel: str = ""


@dataclass
class Failure:
    host: str
    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    cause: str                      # in words: 'killed by SIGKILL', 'exited with code 1', ...
    at: float | None                # unix time the agent saw it
    lines: list[str] = field(default_factory=list)   # the rank's last lines
    error: str | None = None        # the rank's error.json message, when it wrote one

    def label(self) -> str:
        return rank_label(self.host, self.local_rank, self.global_rank, 0)

    def as_dict(self) -> dict:
        return {"host": self.host, "rank": self.global_rank, "local_rank": self.local_rank,
                "pid": self.pid, "exitcode": self.exitcode, "cause": self.cause,
                "at": self.at, "error": self.error}


def node_from(host: str, node_rank: int, doc: dict) -> NodeJournal:
    return NodeJournal(host, node_rank, agent.parse(doc.get("journal", "")), int(doc.get("year", 1970)),
                       str(doc.get("utc_offset", "+0000")), doc.get("kernel", ""))


def failures(nodes: list[NodeJournal], unit: str, errors: list | None = None) -> list[Failure]:
    """Each node's first failure (the rank whose exit made its agent stop the others), earliest
    first: the head of the list is the job's first failure. errors: merge.ErrorReport items, used
    for their message (a rank that raised wrote one; a signal leaves none)."""
    out = []
    for n in nodes:
        e = n.log.first_failure()
        if e is None:
            continue
        g = agent.global_rank(e, n.node_rank, n.log.nproc)
        msg = None
        for r in errors or []:
            if r.node == n.host and r.local_rank == e.local_rank and r.message:
                msg = r.message
        out.append(Failure(n.host, e.local_rank, g, e.pid, e.exitcode, cause(n, e, unit),
                           agent.to_unix(e.when, n.year, n.utc_offset),
                           list(n.log.rank_lines.get(e.local_rank, [])), msg))
    out.sort(key=lambda f: (f.at is None, f.at or 0.0))
    return out


def cause(n: NodeJournal, e: agent.Exit, unit: str) -> str:
    """Why the worker of `e` ended, in words; a SIGKILL is the OOM killer's when the kernel (or
    systemd, for the unit's cgroup) says so."""
    oom = None
    if e.exitcode == -9:
        oom = agent.oom_kill(n.kernel, e.pid, unit) or ("cgroup memory limit" if n.log.oom_unit else None)
    return agent.describe_exit(e.exitcode, oom)


def _clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"


def report(found: list[Failure]) -> str | None:
    """`logs --failures` text: the first failure, its cause and the rank's last lines; then the
    failures on other nodes that followed it."""
    if not found:
        return None
    f = found[0]
    out = [f"first failure: {f.label()} (local rank {f.local_rank}, pid {f.pid}) {f.cause} "
           f"at {_clock(f.at)}"]
    if f.error:
        out.append(f"  error: {f.error}")
    if f.lines:
        out.append(f"last lines of {f.label()}:")
        out += ["  " + ln for ln in f.lines]
    for o in found[1:]:
        out.append(f"then: {o.label()} {o.cause} at {_clock(o.at)}"
                   + (f" ({o.error})" if o.error else ""))
    return printable("\n".join(out), newlines=True)


def below_min(nodes: list[NodeJournal], hosts: list[str]) -> str | None:
    """`logs --failures`' line for a job whose agents gave up at a rendezvous (fewer nodes than
    its minimum came back within the rendezvous timeout), naming the nodes whose journal could
    not be read (lost); None when no agent gave up so, or the job is not elastic (its launch
    config's min_nodes below max_nodes: a plain job's agent that gave up waited for a peer,
    not for a minimum)."""
    gave_up = [n.host for n in nodes if n.log.rdzv_timed_out and n.log.min_nodes is not None
               and n.log.nnodes is not None and n.log.min_nodes < n.log.nnodes]
    if not gave_up:
        return None
    read = {n.host for n in nodes}
    lost = [h for h in hosts if h not in read]
    return (f"job ended below MIN: fewer nodes than its minimum (--nodes MIN) were left within "
            f"the rendezvous timeout; {', '.join(gave_up)} gave up"
            + (f"; lost (unreachable): {', '.join(lost)}" if lost else ""))


def waiting(nodes: list[NodeJournal], nnodes: int) -> dict[str, str]:
    """What each node's agent waits for, in words, with when it gives up (node-local clock)."""
    rejoining = sum(1 for n in nodes if n.log.state == "rejoining")
    out = {}
    for n in nodes:
        lg = n.log
        if lg.state == "exit-barrier":
            out[n.host] = ("finished, waiting for peers at the exit barrier"
                           + _gives_up(lg.state_since, lg.barrier_timeout))
        elif lg.state == "rejoining":
            more = max(nnodes - rejoining, 1)
            out[n.host] = (f"restarting, waiting for {more} more node{'s' if more > 1 else ''} "
                           "to rejoin" + _gives_up(lg.state_since, lg.join_timeout))
    return out


def _gives_up(since: str, timeout: float | None) -> str:
    if not since or timeout is None:
        return ""
    hh, mm, ss = (float(x) for x in since.split(" ")[1].split(":"))
    t = (int(hh * 3600 + mm * 60 + ss + timeout)) % 86400
    return f", gives up at {t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}"


def journal_request(unit: str, keep=agent.LAST_LINES, lines=500000, ident=None,
                    after: dict | None = None) -> dict:
    """The probe's request for the unit's journal (its newest `lines` lines: the ranks' output
    is in it too, of which each rank's last `keep` lines are kept). ident: read the lines of
    this journal identifier instead (a Slurm job's). after: the journal kept by the last
    round of `status --watch` (see merge_journal): only the lines after its cursors, the
    unit's and the kernel's."""
    after = after or {}
    return {"unit": unit, "keep": keep, "lines": lines, **({"ident": ident} if ident else {}),
            **({"after_cursor": after["cursor"]} if after.get("cursor") else {}),
            **({"kernel_after_cursor": after["kernel_cursor"]} if after.get("kernel_cursor")
               else {})}


def merge_journal(prev: dict | None, doc: dict, keep: int) -> dict:
    """`status --watch`: the journal kept so far (the last round's merged doc) and this round's
    probe reply (only the lines after the last round's cursors) -> the journal as one full read
    would keep it (the probe's own rule: from the unit's newest start, the agent's newest lines,
    each rank's last `keep`; the newest kernel OOM lines), with the newest cursors. A reply
    that had to read afresh (a cursor was gone: journal rotated or vacuumed) replaces what was
    kept."""
    from ..facts.probe_host import KERNEL_LINES, keep_lines
    if not prev:
        return doc
    kernel = doc.get("kernel", "")
    if doc.get("kernel_after"):
        kernel = "\n".join((prev.get("kernel", "").splitlines()
                            + kernel.splitlines())[-KERNEL_LINES:])
    kernel = {"kernel": kernel, "kernel_cursor": doc.get("kernel_cursor") or prev.get("kernel_cursor")}
    if doc.get("reset"):
        return {**doc, **kernel}
    lines = prev.get("journal", "").splitlines() + doc.get("journal", "").splitlines()
    kept = keep_lines(enumerate(lines), keep)
    return {**doc, "journal": "\n".join(ln for _, ln in kept),
            "cursor": doc.get("cursor") or prev.get("cursor"), **kernel}


def fetch(fleet, hosts: list, unit: str, keep=agent.LAST_LINES, lines=500000, ident=None):
    """Every node's journal for the unit -> [NodeJournal] (node rank = position in hosts);
    nodes that could not be read are left out."""
    from ..facts import probe
    ranks = {h.name: i for i, h in enumerate(hosts)}

    def one(h):
        r = fleet.run(h, probe.COMMAND, root=True, timeout=60,
                      data=probe.stdin({"journal": journal_request(unit, keep, lines, ident)}))
        return node_from(h.name, ranks[h.name],
                         probe.reply(r.exited, r.stdout, r.stderr, "reading the journal")["journal"])
    return [r.value for r in fleet.fan_out(one, hosts) if r.ok]
