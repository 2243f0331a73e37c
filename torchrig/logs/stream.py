"""`torchrig logs`: run onhost/logs/follow.py on every node over SSH and merge what comes back.

One thread per node. A dropped connection (or one silent past the heartbeat timeout) is
reopened with the offsets (and file identities) the Tracker holds, so lines are neither lost
nor repeated; each drop gets its own `reconnect_for` window. `connection: local` hosts run the
follower as a local process, the same way.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

from ..facts import slurm as slurm_facts
from ..inventory import Host
from ..job import RUNNING_STATES
from ..onhost import script
from ..session import Fleet, describe_error
from ..terminal import printable
from . import merge

FOLLOWER_CMD = "python3 -I -"  # isolated: root imports nothing from the cwd or PYTHON* vars
HEARTBEAT_S = 5
SILENCE_S = 20          # no record (not even a heartbeat) for this long: reconnect
RETRY_S = 2             # pause between reconnects
STDERR_KEEP = 2000      # characters of the follower's stderr kept to say why it failed
COLORS = ["36", "33", "35", "32", "34", "31", "96", "93", "95", "92", "94", "91"]


@dataclass
class FollowOptions:
    job: str
    log_dir: dict[str, str]               # host -> the job's log dir on it
    unit: str
    follow: bool = False
    rank: int | None = None
    grep: str | None = None
    since: float | None = None            # unix time: skip files last written before it
    reconnect_for: float = 120.0          # give up on a node after this long unreachable (per drop)
    color: bool = False
    slurm_job: str | None = None          # Slurm runs the job: its state from squeue, not systemd


@dataclass
class FollowOutcome:
    lines: int = 0
    errors: list = field(default_factory=list)          # merge.ErrorReport
    lost: dict[str, str] = field(default_factory=dict)  # node -> why we stopped following it
    reconnects: int = 0


def follower_input(args: dict) -> str:
    """What goes on the follower's stdin: its arguments as the script's first line, then the
    script. `python3 -` reads its program from stdin, so the arguments (offsets of every file
    ever read: too long for one argv word after many restarts) never touch argv. The states
    that count as a running job go with them, from their one definition."""
    args = {**args, "running": list(RUNNING_STATES), "slurm_live": sorted(slurm_facts.LIVE)}
    return f"ARGS = {json.dumps(args)!r}\n" + script("logs/follow.py")


class _Lines:
    """Bytes in, whole lines out: a record cut short by a dropped connection is never fed
    (its offset would claim the whole line)."""

    def __init__(self, on_line: Callable[[str], None]):
        self.buf, self.on_line = b"", on_line

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        if b"\n" in chunk:
            *lines, self.buf = self.buf.split(b"\n")
            for ln in lines:
                self.on_line(ln.decode("utf-8", errors="replace"))


def _tail(b: bytes) -> str:
    return b[-STDERR_KEEP:].decode("utf-8", errors="replace").strip()


def _stream(cxn, command: str, data: str, on_line: Callable[[str], None],
            silence: float, *, root: bool = False) -> tuple[int | None, str]:
    """Run `command` (stdin = data; as root with root=True) and call on_line for each whole
    stdout line as it arrives.
    Returns (exit status or None if the connection went silent or dropped, stderr's tail)."""
    lines, err = _Lines(on_line), bytearray()

    def keep_err(chunk: bytes) -> None:
        err.extend(chunk)
        del err[:-STDERR_KEEP]

    rc = cxn.stream(command, data, lines.feed, keep_err, root=root, silence=silence)
    return rc, _tail(bytes(err))


class Window:
    """Reconnect window of one node: `reconnect_for` seconds from the first failure since the
    last connection that worked, so every drop gets its own window, however late it comes."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock, self.down_since = seconds, clock, None

    def worked(self) -> None:
        self.down_since = None

    def failed(self) -> bool:
        """Note a failure; True while retrying is still within the window."""
        now = self.clock()
        if self.down_since is None:
            self.down_since = now
        return now - self.down_since <= self.seconds


class Printer:
    """Merged output: one whole line at a time, prefixed [node/rank], coloured per rank.
    Notices about the stream itself go to `err`, so stdout holds the ranks' lines only."""

    def __init__(self, out: TextIO, color: bool, err: TextIO | None = None):
        self.out, self.color, self.lock = out, color, threading.Lock()
        self.err = err or sys.stderr

    def notice(self, text: str) -> None:
        with self.lock:
            self.err.write(f"logs: {printable(text)}\n")
            self.err.flush()

    def line(self, item: merge.Line) -> None:
        p = merge.prefix(item)
        if self.color:
            key = item.global_rank if item.global_rank is not None else hash((item.node, item.local_rank))
            p = f"\x1b[{COLORS[key % len(COLORS)]}m{p}\x1b[0m"
        with self.lock:
            self.out.write(f"{p} {printable(item.text)}\n")
            self.out.flush()


def follow(fleet: Fleet, hosts: list[Host], o: FollowOptions, printer: Printer | None = None,
           on_event: Callable | None = None) -> FollowOutcome:
    printer = printer or Printer(sys.stdout, o.color)
    tracker = merge.Tracker()
    keep = merge.LineFilter(o.rank, o.grep)
    result = FollowOutcome()
    lock = threading.Lock()

    # cleared files, per node, told as one notice per attempt folder: [folder, lines]
    cleared: dict[str, list] = {}
    refused: set = set()  # Skipped events told (the follower tells them again on reconnect)

    def tell_cleared(node: str) -> None:
        folder, n = cleared.pop(node, (None, 0))
        if n:
            printer.notice(f"{node}: {folder} started over (torchrun clears an attempt folder when "
                           f"it restarts a node's workers because another node's group changed); "
                           f"{n} line(s) read from it before are no longer on disk "
                           f"(journalctl -u {o.unit} on {node} keeps them)")

    def handle(node: str, raw: str) -> list:
        with lock:
            events = tracker.feed(node, raw)
        for ev in events:
            if isinstance(ev, merge.Truncated):
                # the T records of one folder come together: add them up, tell once
                folder = ev.relpath.rsplit("/", 2)[0]
                if cleared.get(node, [folder])[0] != folder:
                    tell_cleared(node)
                cleared.setdefault(node, [folder, 0])[1] += ev.lines
            else:
                tell_cleared(node)  # before the folder's new lines (or a heartbeat: no more T)
            if isinstance(ev, merge.Line) and keep(ev):
                printer.line(ev)
                with lock:
                    result.lines += 1
            elif isinstance(ev, merge.ErrorReport):
                with lock:
                    result.errors.append(ev)
            elif isinstance(ev, merge.Skipped) and ev not in refused:
                refused.add(ev)
                printer.notice(f"{node}: {ev.relpath}: {ev.reason} (written by the job; the "
                               f"follower reads only regular files and follows no link)")
            if on_event:
                on_event(ev)
        return events

    def node_loop(h: Host) -> None:
        window = Window(o.reconnect_for)
        while True:
            with lock:
                offsets = tracker.offsets_for(h.name)
            args = {"dir": o.log_dir[h.name], "offsets": offsets, "follow": o.follow,
                    "unit": o.unit if o.follow else None, "heartbeat": HEARTBEAT_S,
                    "slurm_job": o.slurm_job,
                    "since": o.since}
            heard = [0]  # events of this connection, the opening heartbeat not counted

            def on_line(ln: str) -> None:
                heard[0] += len(handle(h.name, ln))

            try:
                cxn = fleet.conn(h)
                rc, err = _stream(cxn, FOLLOWER_CMD, follower_input(args), on_line, SILENCE_S,
                                  root=True)
                tell_cleared(h.name)
                if rc == 0:
                    return
                why = "connection went silent" if rc is None else f"follower exited {rc}"
                why += f": {err.splitlines()[-1]}" if err else ""
            except Exception as e:  # noqa: BLE001 - any transport error: reconnect below
                why = describe_error(e)
            fleet.drop(h)  # silent or dropped: the next try opens a fresh connection
            # it worked if it brought more than the opening heartbeat (a follower that fails
            # on start every time, having read nothing new, must not retry forever)
            if heard[0] > 1:
                window.worked()
            if not o.follow or not window.failed():
                with lock:
                    result.lost[h.name] = printable(why)
                return
            with lock:
                result.reconnects += 1
            time.sleep(RETRY_S)

    threads = [threading.Thread(target=node_loop, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)  # short joins keep Ctrl-C responsive
    return result


def failure_report(errors: list, tracker: merge.Tracker | None = None) -> str | None:
    first = merge.first_failure(errors, tracker)
    if first is None:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(first.timestamp)) if first.timestamp else "?"
    text = f"{first.message}\n{first.traceback or ''}".rstrip()
    return (f"first failure: {merge.prefix(first)} attempt {first.attempt} at {when}\n"
            + printable(text, newlines=True))
