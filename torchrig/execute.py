"""`torchrig exec`: one ad-hoc command on many hosts, output prefixed per host (like pdsh)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from .inventory import Host
from .session import Fleet, Outcome
from .terminal import PrefixedLines


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
            r = cxn.run(command, root=sudo, warn=True, hide=False, out_stream=sink,
                        err_stream=sink, timeout=timeout, in_stream=False)
            return Exited(r.exited)
        finally:
            sink.close()

    results = fleet.fan_out(one, hosts)
    return Outcome("exec", results, [f"{r.host}: exit status {r.value.code}" for r in results
                                     if r.ok and r.value.code != 0])
