"""Operator side of log following: turn onhost/logs/follow.py's records into rank-labelled lines.

Pure: no I/O. One Tracker per `logs` session, fed with every record from every node, and kept
across reconnects: it remembers the byte offset reached in every file, and the file's identity,
so that `Tracker.offsets_for(node)` can be handed back to onhost/logs/follow.py (no loss; a file
replaced meanwhile is read from its start), and it drops records at or before a known offset
(no repetition).

Record format (see onhost/logs/follow.py): TAB-separated, one per line:
    L relpath offset text | E relpath size json | T relpath 0 | I relpath identity |
    W relpath reason | H unix_time

Rank output is the job's text: torchrig/terminal.py's `printable()` neutralises control
characters before a terminal sees them.

Display prefix (`prefix`):
    [gpu2/r3]        node gpu2, global rank 3, stdout, attempt 0
    [gpu2/l1]        global rank not known yet (no `start rank=` line seen): local rank 1
    [gpu2/r3 a1]     attempt 1 (torchrun restarted the local worker group once)
    [gpu2/r3!]       a "!" just before the closing bracket: the line came from stderr
    [gpu2/r3 a1!]    both
The run folder (<rdzv_id>_<random>, new on every torchrun start) is not shown; attempts
restart at 0 in a new run, and the global rank is learned again from that run's start lines.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Pattern, Union

from ..progress import start_ranks

STREAMS = {"stdout.log": "stdout", "stderr.log": "stderr", "error.json": "error"}
_ATTEMPT = re.compile(r"attempt_([0-9]+)")
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() also takes '²', which int() refuses


@dataclass(frozen=True)
class PathInfo:
    run: str
    attempt: int
    local_rank: int
    stream: str  # "stdout" | "stderr" | "error"


def parse_path(relpath: str) -> PathInfo:
    """'<run>/attempt_<N>/<local_rank>/{stdout.log,stderr.log,error.json}' -> PathInfo.

    Raises ValueError for anything else.
    """
    parts = relpath.split("/")
    if len(parts) != 4:
        raise ValueError(f"not a torchrun log path: {relpath!r}")
    run, att, rank, name = parts
    m = _ATTEMPT.fullmatch(att)
    if not run or not m or not _DIGITS.fullmatch(rank) or name not in STREAMS:
        raise ValueError(f"not a torchrun log path: {relpath!r}")
    return PathInfo(run, int(m.group(1)), int(rank), STREAMS[name])


@dataclass(frozen=True)
class Line:
    node: str
    run: str
    attempt: int
    local_rank: int
    global_rank: int | None
    stream: str  # "stdout" | "stderr"
    text: str


@dataclass(frozen=True)
class ErrorReport:
    """One rank's error.json (torch elastic's @record / ErrorHandler output)."""
    node: str
    run: str
    attempt: int
    local_rank: int
    global_rank: int | None
    message: str
    traceback: str
    timestamp: float | None  # unix seconds; None when missing or unreadable
    relpath: str
    raw: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Heartbeat:
    node: str
    time: float


@dataclass(frozen=True)
class Truncated:
    """A file shrank or was replaced (torchrun clears an attempt folder when it restarts a
    node's workers at the same attempt number); its lines start over. `lines`: how many lines
    had been read from its earlier content, which is no longer on disk."""
    node: str
    relpath: str
    lines: int = 0


@dataclass(frozen=True)
class Skipped:
    """The follower found something at a followed name that it does not read (a symlink, a
    FIFO, ...): told once per connection."""
    node: str
    relpath: str
    reason: str


Event = Union[Line, ErrorReport, Heartbeat, Truncated, Skipped]


# Up to 9999-12-31: time.localtime() of more raises (1e20), and nan fails both comparisons.
_MAX_TIMESTAMP = 253402300799.0


def _timestamp(v) -> float | None:
    t = _any_timestamp(v)
    return t if t is not None and 0 <= t <= _MAX_TIMESTAMP else None


def _any_timestamp(v) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        s = v.strip()
        try:
            return float(s)
        except ValueError:
            pass
        try:
            t = _dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            return None
        if t.tzinfo is None:
            t = t.replace(tzinfo=_dt.timezone.utc)
        return t.timestamp()
    return None


def parse_error_json(doc) -> tuple[str, str, float | None]:
    """(message, traceback, timestamp) from an error.json document, tolerant of variants:
    {"message": {"message": M, "extraInfo": {"py_callstack": TB, "timestamp": "1700000000"}}}
    (torch elastic), "message" as a plain string, extraInfo/extra_info at either level,
    "py_callstack"/"traceback", or {"torchrig_unparsed": text} from onhost/logs/follow.py."""
    if not isinstance(doc, dict):
        return (str(doc), "", None)
    if "torchrig_unparsed" in doc:
        return (str(doc["torchrig_unparsed"]).strip(), "", None)
    outer = doc
    msg = doc.get("message")
    inner = msg if isinstance(msg, dict) else {}
    extra = {}
    for d in (inner, outer):
        for k in ("extraInfo", "extra_info", "extrainfo"):
            if isinstance(d.get(k), dict):
                extra = {**d[k], **extra}
    if isinstance(msg, dict):
        message = msg.get("message")
    else:
        message = msg
    if message is None:
        message = outer.get("error") or ""

    def pick(*keys):
        for d in (extra, inner, outer):
            for k in keys:
                if d.get(k) not in (None, ""):
                    return d[k]
        return None

    tb = pick("py_callstack", "traceback", "callstack")
    return (str(message), "" if tb is None else str(tb), _timestamp(pick("timestamp", "time")))


class Tracker:
    """Offsets and learned global ranks across nodes, runs, attempts and reconnects."""

    def __init__(self) -> None:
        self._offsets: dict[str, dict[str, int]] = {}
        self._idents: dict[str, dict[str, str]] = {}  # node -> relpath -> follower's identity
        self._ranks: dict[tuple[str, str, int, int], int] = {}
        self._lines: dict[tuple[str, str], int] = {}  # (node, relpath) -> lines read from it
        self.malformed: list[tuple[str, str]] = []  # (node, record) that could not be parsed

    def offsets_for(self, node: str) -> dict[str, list]:
        """{relpath: [offset, identity or None]} to pass to onhost/logs/follow.py as "offsets" on
        (re)connect."""
        idents = self._idents.get(node, {})
        return {rel: [off, idents.get(rel)] for rel, off in self._offsets.get(node, {}).items()}

    def global_rank(self, node: str, run: str, attempt: int, local_rank: int) -> int | None:
        return self._ranks.get((node, run, attempt, local_rank))

    def _bad(self, node: str, raw: str) -> list:
        if len(self.malformed) < 100:
            self.malformed.append((node, raw))
        return []

    def feed(self, node: str, raw_line: str) -> list[Event]:
        """One record line (trailing newline allowed) -> the events it yields (often one, or
        none for a duplicate, a blank or a malformed record)."""
        raw = raw_line[:-1] if raw_line.endswith("\n") else raw_line
        if not raw:
            return []
        parts = raw.split("\t", 3)
        kind = parts[0]
        try:
            if kind == "H" and len(parts) == 2:
                return [Heartbeat(node, float(parts[1]))]
            if kind == "W" and len(parts) == 3:
                return [Skipped(node, parts[1], parts[2])]
            if kind == "I" and len(parts) == 3:
                parse_path(parts[1])
                self._idents.setdefault(node, {})[parts[1]] = parts[2]
                return []
            if kind in ("L", "E") and len(parts) == 4:
                rel, off, payload = parts[1], int(parts[2]), parts[3]
                info = parse_path(rel)
            elif kind == "T" and len(parts) == 3:
                rel, info = parts[1], parse_path(parts[1])
            else:
                return self._bad(node, raw)
        except ValueError:
            return self._bad(node, raw)

        known = self._offsets.setdefault(node, {})
        key = (node, info.run, info.attempt, info.local_rank)
        if kind == "T":
            known[rel] = 0
            self._idents.get(node, {}).pop(rel, None)
            if info.stream == "stdout":
                self._ranks.pop(key, None)  # the folder was reused: learn the rank again
            return [Truncated(node, rel, self._lines.pop((node, rel), 0))]
        if off <= known.get(rel, 0):
            return []  # already seen (replayed after a reconnect)
        known[rel] = off
        if kind == "L":
            self._lines[(node, rel)] = self._lines.get((node, rel), 0) + 1
        if kind == "E":
            try:
                doc = json.loads(payload)
            except ValueError:
                doc = {"torchrig_unparsed": payload}
            msg, tb, ts = parse_error_json(doc)
            return [ErrorReport(node, info.run, info.attempt, info.local_rank,
                                self._ranks.get(key), msg, tb, ts, rel, doc)]
        if info.stream == "stdout" and key not in self._ranks:
            got = start_ranks(payload)  # the payload's first stdout line on every rank
            if got and got[1] == info.local_rank:
                self._ranks[key] = got[0]
        return [Line(node, info.run, info.attempt, info.local_rank, self._ranks.get(key),
                     info.stream, payload)]


def rank_label(node: str, local_rank: int, global_rank: int | None, attempt: int,
               stderr: bool = False) -> str:
    who = f"r{global_rank}" if global_rank is not None else f"l{local_rank}"
    att = f" a{attempt}" if attempt > 0 else ""
    return f"[{node}/{who}{att}{'!' if stderr else ''}]"


def prefix(item: Line | ErrorReport) -> str:
    """'[gpu2/r3]', '[gpu2/l1]', '[gpu2/r3 a1]', '[gpu2/r3!]' (stderr): see the module doc."""
    return rank_label(item.node, item.local_rank, item.global_rank, item.attempt,
                      stderr=isinstance(item, Line) and item.stream == "stderr")


@dataclass(frozen=True)
class LineFilter:
    """Which lines to show. rank: global rank (lines whose global rank is not known yet do not
    match); pattern: regex searched in the text; node/stream: exact. None: no condition."""
    rank: int | None = None
    pattern: str | Pattern[str] | None = None
    node: str | None = None
    stream: str | None = None

    def __call__(self, line: Line) -> bool:
        if self.rank is not None and line.global_rank != self.rank:
            return False
        if self.node is not None and line.node != self.node:
            return False
        if self.stream is not None and line.stream != self.stream:
            return False
        if self.pattern is not None and not re.search(self.pattern, line.text):
            return False
        return True


def filter_lines(items: Iterable[Event], *, rank: int | None = None,
                 pattern: str | Pattern[str] | None = None, node: str | None = None,
                 stream: str | None = None) -> list[Line]:
    """The Lines among `items` that pass LineFilter(rank, pattern, node, stream)."""
    f = LineFilter(rank, re.compile(pattern) if isinstance(pattern, str) else pattern,
                   node, stream)
    return [i for i in items if isinstance(i, Line) and f(i)]


def first_failure(reports: Iterable[ErrorReport],
                  tracker: Tracker | None = None) -> ErrorReport | None:
    """The earliest failure by error.json timestamp (reports without one come last; ties keep
    input order). With a tracker, a global rank learned after the report arrived is filled in."""
    best, best_key = None, None
    for i, r in enumerate(reports):
        k = (r.timestamp is None, r.timestamp or 0.0, i)
        if best_key is None or k < best_key:
            best, best_key = r, k
    if best is not None and best.global_rank is None and tracker is not None:
        g = tracker.global_rank(best.node, best.run, best.attempt, best.local_rank)
        if g is not None:
            best = replace(best, global_rank=g)
    return best
