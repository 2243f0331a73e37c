"""torchrun's agent output, as the job's unit journal keeps it: why a rank died when it wrote
no error.json, and what each node's agent is waiting for. Pure: text in, data out.

A worker killed by a signal (SIGKILL from the OOM killer, SIGSEGV in an extension, an abort)
never writes error.json; the agent still logs it, glog-prefixed:

    W1130 18:35:24.416000 3103 torch/.../api.py:1028] Sending process 3171 closing signal SIGTERM
    E1130 18:35:24.614000 3103 torch/.../api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 3173) of binary: ...

The SIGTERM lines for the other local workers come *before* the line of the worker whose exit
caused them, so the first failure is the failed worker that was not sent a closing signal,
not the earliest line. When the agent gives up it prints a ChildFailedError summary whose
"Root Cause" block names the rank (global), host, exit code and pid. With LOGLEVEL=INFO (the
launch sets it) the agent also logs every rendezvous result (group_rank, global_ranks), its
restarts, and when it waits at the exit barrier or for nodes to rejoin.

Older torch releases print the same messages with other prefixes, and an operator may hand
over a journal read without `-o cat`; each line is reduced to its message first (see
`_message`, `_agent_line`):

    ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) ...        (<= 2.0)
    [2023-10-13 17:40:02,544] torch.distributed.elastic.multiprocessing.api: [ERROR] failed ...
    Nov 30 18:35:24 gpu2 torchrun[3103]: E1130 18:35:24.614000 3103 torch/...] failed ...

The unit's journal (`journalctl -u <unit> -o cat`) carries, besides the agent's lines, each
worker's output prefixed `[default<local rank>]:` (torchrun's --tee) and systemd's own lines
about the unit (`... has been killed by the OOM killer.`). Kernel lines (`journalctl -k`) name
an OOM-killed process by pid and its memory cgroup (which names the unit).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

# glog prefix (torch >= 2.4): level, MMDD, time, thread/pid, file:line]
_GLOG = re.compile(r"^\[?([IWEF])(\d{4}) (\d\d:\d\d:\d\d(?:\.\d+)?)\s+\d+ \S+:\d+\] ?(.*)$")
# torch 2.1-2.3: "[2023-10-13 17:40:02,544] torch.distributed...: [ERROR] msg" (a paste may
# lose the first "[")
_BRACKETED = re.compile(r"^\[?\d{4}-(\d\d)-(\d\d) (\d\d:\d\d:\d\d)(?:,(\d+))?\] torch\.[\w.]+: "
                        r"\[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\] ?(.*)$")
# torch <= 2.0: Python logging's default format, no time: "ERROR:torch.distributed...:msg"
_PYLOG = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):torch\.[\w.]+:(.*)$")
# journalctl's own prefix, when read without -o cat (short, short-precise, short-iso):
# "Nov 30 18:35:24[.123456] gpu2 torchrun[3103]: msg", "2026-11-30T18:35:24+0000 gpu2 ..."
_JOURNAL = re.compile(r"^(?:([A-Z][a-z]{2}) +(\d{1,2}) (\d\d:\d\d:\d\d(?:\.\d+)?)"
                      r"|\d{4}-(\d\d)-(\d\d)T(\d\d:\d\d:\d\d(?:[.,]\d+)?)(?:Z|[+-]\d\d:?\d\d)?)"
                      r" \S+ [^\s\[\]:]+(?:\[\d+\])?: ?(.*)$")
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug",
                                       "Sep", "Oct", "Nov", "Dec"), 1)}
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\) of binary")
# "Sending process P closing signal SIGTERM"; torch 2.6+: "Closing process P via signal SIGTERM"
_CLOSING = re.compile(r"(?:Sending|Closing) process (\d+) (?:closing|via) signal (\w+)")
_RESTART = re.compile(r"Worker group (\w+)\. (\d+)/(\d+) attempts left; will restart worker group")
_RDZV_START = re.compile(r"\] Rendezvous'ing worker group")
_RDZV_DONE = re.compile(r"Rendezvous complete for workers")
_RESULT_KV = re.compile(r"^\s+(group_rank|group_world_size|global_ranks|local_ranks|restart_count)=(.*)$")
_BARRIER = re.compile(r"Waiting (\d+(?:\.\d+)?) seconds for other agents to finish")
_BARRIER_END = re.compile(r"Done waiting for other agents|Error waiting on exit barrier")
_CONF_JOIN = re.compile(r"rdzv_configs\s*:.*'join_timeout': '?(\d+)")
_CONF_NODES = re.compile(r"^\s+max_nodes\s*:\s*(\d+)")
_CONF_MIN_NODES = re.compile(r"^\s+min_nodes\s*:\s*(\d+)")
_CONF_NPROC = re.compile(r"^\s+nproc_per_node\s*:\s*(\d+)")
_TEE = re.compile(r"^\[default(\d+)\]:(.*)$")
_START = re.compile(r"^start rank=(\d+) local_rank=(\d+)")
_SYSTEMD_STARTED = re.compile(r"^Started torchrig-")
# systemd's lines when the agent has exited: whatever it waited for is over
_SYSTEMD_ENDED = re.compile(r"^torchrig-\S+\.service: (Main process exited|Deactivated successfully|Failed with result)")
_SYSTEMD_OOM = re.compile(r"(?:A process of this unit has been|process \d+ .*) killed by the OOM killer")
_RDZV_TIMEOUT = re.compile(r"RendezvousTimeoutError")
# kernel: "Out of memory: Killed process 123 (python3) ..." / "Memory cgroup out of memory:
# Killed process 123 ..." / "oom-kill:constraint=...,task_memcg=/system.slice/u.service,task=python3,pid=123,uid=..."
_K_KILLED = re.compile(r"(Memory cgroup out of memory|Out of memory)[^:]*: Killed process (\d+)")
_K_OOMKILL = re.compile(r"oom-kill:.*?task_memcg=([^,]*),.*?pid=(\d+)")
# the ChildFailedError summary
_SUM_HEAD = re.compile(r"^\s*(Failures|Root Cause \(first observed failure\)):")
_SUM_ITEM = re.compile(r"^\s*\[\d+\]:\s*$")
_SUM_FIELD = re.compile(r"^\s+(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")
_SUM_RANK = re.compile(r"(-?\d+) \(local_rank: (\d+)\)")
_SUM_EXIT = re.compile(r"(-?\d+) \(pid: (\d+)\)")

LAST_LINES = 20


def signal_name(exitcode: int) -> str | None:
    """-9 -> 'SIGKILL' (a negative exit code is the signal that ended the process)."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


_MEANING = {"SIGSEGV": "segmentation fault", "SIGBUS": "bus error", "SIGABRT": "aborted",
            "SIGFPE": "arithmetic error", "SIGILL": "illegal instruction"}


def describe_exit(exitcode: int, oom: str | None = None) -> str:
    """The cause in words: 'killed by the OOM killer (host memory)', 'killed by SIGSEGV
    (segmentation fault)', 'exited with code 1'."""
    if oom:
        return f"killed by the OOM killer ({oom})"
    sig = signal_name(exitcode)
    if sig is None:
        return f"exited with code {exitcode}"
    return f"killed by {sig}" + (f" ({_MEANING[sig]})" if sig in _MEANING else "")


@dataclass
class Exit:
    local_rank: int
    pid: int
    exitcode: int
    when: str              # node-local 'MMDD HH:MM:SS.ffffff' when the agent saw the failure:
                           # its first closing-signal line (it logs `failed` only after the
                           # others exited, which can take seconds), else the `failed` line
    line: int              # index in the text
    global_rank: int | None = None
    terminated: bool = False   # the agent sent it a closing signal first: a consequence
    episode: int = 0           # worker group failures counted from the unit's start


@dataclass
class AgentLog:
    exits: list[Exit] = field(default_factory=list)
    root_cause: dict | None = None         # the summary's Root Cause block (global rank etc.)
    state: str | None = None                # 'exit-barrier' | 'rejoining' | 'running' | None
    state_since: str = ""                   # 'MMDD HH:MM:SS' when that state began
    barrier_timeout: float | None = None
    join_timeout: int | None = None
    nnodes: int | None = None
    min_nodes: int | None = None            # the launch config's (below nnodes: an elastic job)
    nproc: int = 1                          # processes per node (launch config, else ranks seen)
    restarts: int = 0
    rdzv_timed_out: bool = False
    ended: bool = False                     # systemd logged the agent's exit
    rank_lines: dict[int, list[str]] = field(default_factory=dict)  # local rank -> last lines
    oom_unit: bool = False                  # systemd: a process of the unit was OOM-killed

    def first_failure(self) -> Exit | None:
        """The exit that caused the others, in the newest episode: a worker killed by a signal
        its agent did not send (a SIGKILLed rank breaks its local peers' connections, they exit
        1 at once, and torchrun, which orders failures by error.json time, may name one of
        them as root cause); else the summary's root cause; else the failed worker that was
        not sent a closing signal."""
        last = max((e.episode for e in self.exits), default=0)
        own = [e for e in self.exits if e.episode == last and e.exitcode != 0 and not e.terminated]
        signalled = [e for e in own if e.exitcode < 0]
        if signalled:
            return signalled[0]
        if self.root_cause and self.root_cause.get("pid") is not None:
            for e in reversed(self.exits):
                if e.pid == self.root_cause["pid"]:
                    return e
        return own[0] if own else None


def _message(raw: str) -> tuple[str, str]:
    """(message, the journal's 'MMDD HH:MM:SS' or ''): the line without journalctl's prefix."""
    j = _JOURNAL.match(raw)
    if not j:
        return raw, ""
    if j.group(1):
        mon = _MONTHS.get(j.group(1))
        return j.group(7), (f"{mon:02d}{int(j.group(2)):02d} {j.group(3)}" if mon else "")
    return j.group(7), f"{j.group(4)}{j.group(5)} {j.group(6).replace(',', '.')}"


def _agent_line(msg: str, journal_when: str) -> tuple[str, str] | None:
    """(when 'MMDD HH:MM:SS[.fff]', message) of a line torchrun's agent logged, in any of the
    prefixes torch has used; None for any other line. Python logging's default format has no
    time: the journal's, when there is one."""
    if g := _GLOG.match(msg):
        return f"{g.group(2)} {g.group(3)}", g.group(4)
    if b := _BRACKETED.match(msg):
        frac = f".{b.group(4)}" if b.group(4) else ""
        return f"{b.group(1)}{b.group(2)} {b.group(3)}{frac}", b.group(5)
    if p := _PYLOG.match(msg):
        return journal_when, p.group(1)
    return None


def parse(text: str) -> AgentLog:
    """One run of the unit (from its last `Started torchrig-...` line, when present)."""
    msgs = [_message(raw) for raw in text.splitlines()]
    lines = [m for m, _ in msgs]
    for i in range(len(lines) - 1, -1, -1):
        if _SYSTEMD_STARTED.match(lines[i]):
            lines, msgs = lines[i:], msgs[i:]
            break
    log = AgentLog()
    closing: set[int] = set()
    summary: list[dict] = []               # the ChildFailedError summary's entries
    noticed = ""                           # the current episode's first closing-signal line
    nproc = None
    ranks: dict[int, int] = {}             # local -> global, from the newest rendezvous/start line
    result: dict[str, str] = {}
    in_result = False
    summary_block, item = None, None
    tails: dict[int, list[str]] = {}
    for i, raw in enumerate(lines):
        tee = _TEE.match(raw)
        if tee:
            lr, body = int(tee.group(1)), tee.group(2)
            tails.setdefault(lr, []).append(body)
            del tails[lr][:-LAST_LINES]
            s = _START.match(body)
            if s and int(s.group(2)) == lr:
                ranks[lr] = int(s.group(1))
            continue
        if _SYSTEMD_OOM.search(raw):
            log.oom_unit = True
        if _SYSTEMD_ENDED.match(raw):
            log.state = None
            log.ended = True
        if _RDZV_TIMEOUT.search(raw):
            log.rdzv_timed_out = True
        g = _agent_line(raw, msgs[i][1])
        body, when = (g[1], g[0]) if g else (raw, "")
        if in_result:
            kv = _RESULT_KV.match(body)
            if kv:
                result[kv.group(1)] = kv.group(2)
                continue
            if body.strip() == "":
                continue
            in_result = False
            _apply_result(result, ranks)
        # the launch config block: glog prefixes each of its lines, Python logging only the first
        c = _CONF_JOIN.search(body)
        if c:
            log.join_timeout = int(c.group(1))
        n = _CONF_NODES.match(body)
        if n:
            log.nnodes = int(n.group(1))
        n = _CONF_MIN_NODES.match(body)
        if n:
            log.min_nodes = int(n.group(1))
        n = _CONF_NPROC.match(body)
        if n:
            nproc = int(n.group(1))
        if g:
            m = _FAILED.search(body)
            if m:
                pid = int(m.group(3))
                log.exits.append(Exit(int(m.group(2)), pid, int(m.group(1)), noticed or when, i,
                                      terminated=pid in closing, episode=log.restarts))
                continue
            m = _CLOSING.search(body)
            if m:
                closing.add(int(m.group(1)))
                noticed = noticed or when
                continue
            if _RESTART.search(body):
                log.restarts += 1
                log.state, log.state_since = "rejoining", when
                closing, noticed = set(), ""
                continue
            if _RDZV_START.search(body):
                if log.state != "rejoining":
                    log.state, log.state_since = "rendezvous", when
                continue
            if _RDZV_DONE.search(body):
                in_result, result = True, {}
                log.state, log.state_since = "running", when
                continue
            m = _BARRIER.search(body)
            if m:
                log.state, log.state_since = "exit-barrier", when
                log.barrier_timeout = float(m.group(1))
                continue
            if _BARRIER_END.search(body):
                log.state = None
                continue
        h = _SUM_HEAD.match(raw)
        if h:
            summary_block = "root" if h.group(1).startswith("Root") else "other"
            continue
        if summary_block and _SUM_ITEM.match(raw):
            item = {}
            summary.append(item)
            if summary_block == "root":
                log.root_cause = item
            continue
        f = _SUM_FIELD.match(raw)
        if summary_block and item is not None and f:
            key, val = f.group(1), f.group(2).strip()
            item[key] = val
            if key == "rank" and (r := _SUM_RANK.match(val)):
                item["global_rank"], item["local_rank"] = int(r.group(1)), int(r.group(2))
            if key == "exitcode" and (x := _SUM_EXIT.match(val)):
                item["exitcode"], item["pid"] = int(x.group(1)), int(x.group(2))
            continue
        if raw.startswith("====="):
            summary_block, item = (None, None) if summary_block else (summary_block, item)
    if in_result:
        _apply_result(result, ranks)
    # a worker the summary lists but no `failed` line names (torchrun logs one per episode)
    logged = {e.pid for e in log.exits}
    when = log.exits[-1].when if log.exits else ""
    for it in summary:
        if "pid" in it and it["pid"] not in logged and "local_rank" in it:
            log.exits.append(Exit(it["local_rank"], it["pid"], it.get("exitcode", 0), when, len(lines),
                                  terminated=it["pid"] in closing, episode=log.restarts))
    for e in log.exits:
        e.global_rank = ranks.get(e.local_rank)
    for it in summary:
        for e in log.exits:
            if e.pid == it.get("pid") and "global_rank" in it:
                e.global_rank = it["global_rank"]
    if log.exits or log.root_cause:
        log.state = None if log.state in ("running", "rendezvous") else log.state
    log.rank_lines = tails
    seen = [e.local_rank for e in log.exits] + list(tails)
    log.nproc = nproc or (max(seen) + 1 if seen else 1)
    return log


def _apply_result(result: dict[str, str], ranks: dict[int, int]) -> None:
    """'local_ranks=[0, 1]' / 'global_ranks=[2, 3]' of a rendezvous result -> local -> global."""
    try:
        local = [int(x) for x in re.findall(r"-?\d+", result.get("local_ranks", ""))]
        glob = [int(x) for x in re.findall(r"-?\d+", result.get("global_ranks", ""))]
    except ValueError:
        return
    if local and len(local) == len(glob):
        ranks.update(zip(local, glob))


def oom_kill(kernel_text: str, pid: int | None, unit: str) -> str | None:
    """'host memory' or 'cgroup memory limit' when the kernel log shows an OOM kill of `pid`
    or of a process in `unit`'s cgroup; None otherwise."""
    kind = None
    for raw in kernel_text.splitlines():
        m = _K_KILLED.search(raw)
        if m and pid is not None and int(m.group(2)) == pid:
            return "cgroup memory limit" if m.group(1).startswith("Memory cgroup") else "host memory"
        m = _K_OOMKILL.search(raw)
        if m and (f"/{unit}" in m.group(1) or (pid is not None and int(m.group(2)) == pid)):
            kind = "cgroup memory limit" if "CONSTRAINT_MEMCG" in raw else "host memory"
    return kind


def global_rank(e: Exit, node_rank: int, nproc: int) -> int:
    """The rank the agent gave it (rendezvous result / summary / the rank's start line), else
    node rank x processes per node + local rank (torchrun's static assignment)."""
    return e.global_rank if e.global_rank is not None else node_rank * nproc + e.local_rank


def to_unix(when: str, year: int, utc_offset: str) -> float | None:
    """A glog 'MMDD HH:MM:SS.ffffff' (node-local, no year) -> unix time, given the node's
    year and UTC offset ('+0100') when it was read; a month after the current one is last year."""
    import datetime as dt
    m = re.fullmatch(r"(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?", when or "")
    o = re.fullmatch(r"([+-])(\d\d)(\d\d)", utc_offset or "")
    if not m or not o:
        return None
    mon, day, hh, mm, ss = (int(x) for x in m.groups()[:5])
    frac = float("0." + m.group(6)) if m.group(6) else 0.0
    sign = 1 if o.group(1) == "+" else -1
    tz = dt.timezone(sign * dt.timedelta(hours=int(o.group(2)), minutes=int(o.group(3))))
    try:
        t = dt.datetime(year, mon, day, hh, mm, ss, tzinfo=tz)
    except ValueError:
        return None
    if t > dt.datetime.now(tz) + dt.timedelta(days=1):
        t = t.replace(year=year - 1)
    return t.timestamp() + frac
