"""`invoke logs`: run follow_remote.py on every node over SSH and merge what comes back.

One thread per node. A dropped connection (or one silent past the heartbeat timeout) is
reopened with the offsets the Tracker holds, so lines are neither lost nor repeated.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from ..inventory import Host, Inventory
from ..remote import connect, login_user, privileged, sh, CONNECT_TIMEOUT
from . import merge

FOLLOWER = Path(__file__).parent / "follow_remote.py"
HEARTBEAT_S = 5
SILENCE_S = 20          # no record (not even a heartbeat) for this long: reconnect
COLORS = ["36", "33", "35", "32", "34", "31", "96", "93", "95", "92", "94", "91"]


@dataclass
class Options:
    job: str
    log_dir: dict[str, str]               # host -> the job's log dir on it
    unit: str
    follow: bool = False
    rank: int | None = None
    grep: str | None = None
    since: float | None = None            # unix time: skip files last written before it
    reconnect_for: float = 120.0          # give up on a node after this long unreachable
    color: bool = False


@dataclass
class Outcome:
    lines: int = 0
    errors: list = field(default_factory=list)          # merge.ErrorReport
    lost: dict[str, str] = field(default_factory=dict)  # node -> why we stopped following it
    reconnects: int = 0


def _stream(cxn, command: str, data: str, on_line: Callable[[str], None], silence: float) -> int | None:
    """Run `command` (stdin = data) and call on_line for each stdout line as it arrives.
    Returns the exit status, or None if the connection went silent or dropped."""
    cxn.open()
    chan = cxn.client.get_transport().open_session(timeout=CONNECT_TIMEOUT)
    try:
        chan.exec_command(command)
        chan.sendall(data.encode())
        chan.shutdown_write()
        buf = b""
        last = time.monotonic()
        while True:
            if chan.recv_ready():
                chunk = chan.recv(65536)
                if not chunk:
                    break
                last = time.monotonic()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for ln in lines:
                    on_line(ln.decode("utf-8", errors="replace"))
            elif chan.exit_status_ready() and not chan.recv_ready():
                break
            elif time.monotonic() - last > silence:
                return None
            else:
                time.sleep(0.01)
            while chan.recv_stderr_ready():
                chan.recv_stderr(65536)
        if buf:
            on_line(buf.decode("utf-8", errors="replace"))
        return chan.recv_exit_status()
    finally:
        chan.close()


class Printer:
    """Merged output: one whole line at a time, prefixed [node/rank], coloured per rank.
    Notices about the stream itself go to `err`, so stdout holds the ranks' lines only."""

    def __init__(self, out: TextIO, color: bool, err: TextIO | None = None):
        self.out, self.color, self.lock = out, color, threading.Lock()
        self.err = err or sys.stderr

    def notice(self, text: str) -> None:
        with self.lock:
            self.err.write(f"logs: {text}\n")
            self.err.flush()

    def line(self, item: merge.Line) -> None:
        p = merge.prefix(item)
        if self.color:
            key = item.global_rank if item.global_rank is not None else hash((item.node, item.local_rank))
            p = f"\x1b[{COLORS[key % len(COLORS)]}m{p}\x1b[0m"
        with self.lock:
            self.out.write(f"{p} {item.text}\n")
            self.out.flush()


def follow(inv: Inventory, hosts: list[Host], o: Options, printer: Printer | None = None,
           on_event: Callable | None = None) -> Outcome:
    printer = printer or Printer(sys.stdout, o.color)
    tracker = merge.Tracker()
    keep = merge.LineFilter(o.rank, o.grep)
    result = Outcome()
    lock = threading.Lock()
    script = FOLLOWER.read_text()

    # cleared files, per node, told as one notice per attempt folder: [folder, lines]
    cleared: dict[str, list] = {}

    def tell_cleared(node: str) -> None:
        folder, n = cleared.pop(node, (None, 0))
        if n:
            printer.notice(f"{node}: {folder} started over (torchrun clears an attempt folder when "
                           f"it restarts a node's workers because another node's group changed); "
                           f"{n} line(s) read from it before are no longer on disk "
                           f"(journalctl -u {o.unit} on {node} keeps them)")

    def handle(node: str, raw: str) -> None:
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
            if on_event:
                on_event(ev)

    def node_loop(h: Host) -> None:
        down_since = None
        while True:
            with lock:
                offsets = tracker.offsets_for(h.name)
            args = {"dir": o.log_dir[h.name], "offsets": offsets, "follow": o.follow,
                    "unit": o.unit if o.follow else None, "heartbeat": HEARTBEAT_S,
                    "since": o.since}
            try:
                cxn = connect(h, inv)
                try:
                    rc = _stream(cxn, privileged("python3 - " + sh(json.dumps(args)), login_user(cxn)),
                                 script, lambda ln: handle(h.name, ln), SILENCE_S)
                finally:
                    cxn.close()
                tell_cleared(h.name)
                if rc == 0:
                    return
                why = "connection went silent" if rc is None else f"follower exited {rc}"
            except Exception as e:  # noqa: BLE001 - any transport error: reconnect below
                why = f"{type(e).__name__}: {e}"
            down_since = down_since or time.monotonic()
            if not o.follow or time.monotonic() - down_since > o.reconnect_for:
                with lock:
                    result.lost[h.name] = why
                return
            with lock:
                result.reconnects += 1
            time.sleep(2)

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
    return (f"first failure: {merge.prefix(first)} attempt {first.attempt} at {when}\n"
            f"{first.message}\n{first.traceback or ''}".rstrip())
