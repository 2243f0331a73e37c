"""`torchrig exec`: one ad-hoc command on many hosts, output prefixed per host (like pdsh)."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import TextIO

from .inventory import Host
from .remote import login_user, privileged
from .session import Fleet, Outcome
from .terminal import printable


class PrefixedLines:
    """File-like sink for Fabric's out_stream: writes whole lines as 'host | line', each
    through the terminal sanitiser (the host's output may hold any escape sequence)."""

    _lock = threading.Lock()  # shared: lines from different hosts never interleave mid-line

    def __init__(self, prefix: str, out: TextIO):
        self.prefix, self.out = prefix, out
        self.parts: list[str] = []  # the unfinished line, in pieces: joined once, when it ends

    def write(self, data: str) -> None:
        # Only the new data is split: re-splitting a growing buffer on every chunk made a
        # single long line quadratic (8 MB: 18 s).
        if "\n" not in data:
            if data:
                self.parts.append(data)
            return
        head, *lines = data.split("\n")
        tail = lines.pop()
        self._emit(["".join(self.parts) + head, *lines])
        self.parts = [tail] if tail else []

    def _emit(self, lines: list[str]) -> None:
        if lines:
            with self._lock:
                for line in lines:
                    self.out.write(f"{self.prefix} | {printable(line.rstrip(chr(13)))}\n")
                self.out.flush()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.parts:
            self._emit(["".join(self.parts)])
            self.parts = []


@dataclass
class Exited:
    code: int


def run_on(fleet: Fleet, hosts: list[Host], command: str, *, sudo: bool = False,
           timeout: int | None = None, out: TextIO = sys.stdout) -> Outcome:
    """Run `command` on each host; Result.value is Exited(code). A host that could not run it
    is a Result error, a non-zero exit status a problem: the Outcome fails on either."""
    width = max(len(h.name) for h in hosts)

    def one(h: Host) -> Exited:
        cxn = fleet.conn(h)
        sink = PrefixedLines(h.name.ljust(width), out)
        try:
            line = privileged(command, login_user(cxn)) if sudo else command
            r = cxn.run(line, warn=True, hide=False, out_stream=sink, err_stream=sink,
                        timeout=timeout, in_stream=False)
            return Exited(r.exited)
        finally:
            sink.close()

    results = fleet.fan_out(one, hosts)
    return Outcome("exec", results, [f"{r.host}: exit status {r.value.code}" for r in results
                                     if r.ok and r.value.code != 0])
