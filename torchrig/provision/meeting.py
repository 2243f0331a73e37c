"""Where the hosts of one provision meet to share a download, during their applies
(aptshare.py: the .debs, before the first apt install; wheelshare.py: the wheels, before the
pip install). apply.py calls `arrive` at that point of each host's apply and `left` when
the apply ends.

In each group the first member (the seed) does the group's work (download once, send node
to node) in its own arrival, once; the others wait for it there. Then each member, the seed
too, takes its own part. A seed whose apply ends before it arrives (an earlier step failed,
the host changed since the plan) releases the others. Anything that goes wrong leaves the
host on the index, as without sharing, and says why."""

from __future__ import annotations

import threading
import time

from ..secrets import Redactor
from ..session import Fleet, describe_error
from .live import StepProgress


class Meeting:
    """One per provision and kind of download; a subclass says who meets (members), the
    seed's work (share) and each member's part (take)."""

    WAIT = 4 * 3600    # seconds: the seed's steps before it arrives, its download and push
    WHAT = ""          # what is shared, for the notes: ".debs"
    FALLBACK = ""      # what a host does without it: "apt downloads from the index"
    STOPPED = ""       # why the others go without, when the seed's apply ended first

    def __init__(self, fleet: Fleet, groups: list, progress: StepProgress | None = None,
                 red: Redactor | None = None):
        self.fleet, self.progress, self.red = fleet, progress or StepProgress(), red or Redactor()
        self.groups = groups
        self.of = {p.host.name: g for g in groups for p in self.members(g)}
        self.ready = {g.name: threading.Event() for g in groups}
        self.outcome: dict[str, dict] = {}

    # ---- what a subclass says

    def members(self, g) -> list:
        """The group's hosts (Planned) that meet; the first is the seed."""
        raise NotImplementedError

    def share(self, g) -> dict:
        """The seed's work for the group; what happened, for the account. Raises to leave
        the group on the index."""
        raise NotImplementedError

    def take(self, p, g, got: dict) -> None:
        """This member's own part once the share is done (`got`: its outcome). Raises to
        leave this host on the index."""
        raise NotImplementedError

    # ---- the meeting

    def arrive(self, p) -> None:
        g = self.of.get(p.host.name)
        if g is None:
            return
        ready = self.ready[g.name]
        if p is self.members(g)[0]:
            if not ready.is_set():  # once, should the seed arrive again
                t0 = time.monotonic()
                try:
                    self.outcome[g.name] = self.share(g) | {"seconds": round(time.monotonic() - t0, 2)}
                except Exception as e:  # noqa: BLE001 - the group goes to the index, as before
                    self.outcome[g.name] = {"error": self.red.text(describe_error(e))}
                finally:
                    ready.set()
        elif not ready.wait(self.WAIT):
            self._without(p, "the seed did not finish")
            return
        got = self.outcome[g.name]
        if "error" in got:
            self._without(p, got["error"])
            return
        try:
            self.take(p, g, got)
        except Exception as e:  # noqa: BLE001 - this host goes to the index itself
            why = self.red.text(describe_error(e))
            got.setdefault("not_taken", {})[p.host.name] = why
            self._without(p, why)

    def left(self, p) -> None:
        """The host's apply ended: a seed that never arrived releases the others."""
        g = self.of.get(p.host.name)
        if g is not None and p is self.members(g)[0] and not self.ready[g.name].is_set():
            self.outcome.setdefault(g.name, {"error": f"{p.host.name}, {self.STOPPED}"})
            self.ready[g.name].set()

    def account(self) -> dict:
        """{set name: what happened} for the report and the bench."""
        return {g.name: {"hosts": [p.host.name for p in self.members(g)],
                         **self.outcome.get(g.name, {"error": "no host arrived"})}
                for g in self.groups}

    def _without(self, p, why: str) -> None:
        self.progress.note(p.host.name, f"{self.WHAT} not shared ({why}): {self.FALLBACK}")
