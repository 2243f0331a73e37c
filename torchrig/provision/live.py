"""That provision is alive: per host, the step running and how long it has run. Driver,
toolkit and the torch wheels take minutes on real servers; silence for that long reads as a
hang. On a terminal one table updates in place (rich Live); otherwise (a log file, CI, or
--json) plain 'host | ...' lines on stderr, one when a step starts, one every `every` seconds
while it runs, one when it ends. stdout is never touched (--json stays clean)."""

from __future__ import annotations

import threading
import time
from typing import TextIO

from ..terminal import PrefixedLines, markup

EVERY = 30.0  # seconds between 'still running' lines when not on a terminal


class StepProgress:
    """The interface apply_host reports to; this base says nothing (library callers, tests)."""

    def started(self, host: str, step: str, detail: str) -> None: ...

    def finished(self, host: str, step: str, status: str, seconds: float) -> None: ...

    def note(self, host: str, text: str) -> None: ...

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc) -> None: ...


class _Running(StepProgress):
    """The steps running now, per host, behind a lock (hosts apply on their own threads)."""

    def __init__(self, out: TextIO, clean=lambda s: s, clock=time.monotonic):
        self.out, self.clean, self.clock = out, clean, clock
        self.lock = threading.Lock()
        self.running: dict[str, list] = {}   # host -> [step, started, last line at]

    def line(self, host: str, text: str) -> None:
        PrefixedLines(host, self.out).write(self.clean(text) + "\n")

    def started(self, host, step, detail):
        now = self.clock()
        with self.lock:
            self.running[host] = [step, now, now]
        self.line(host, f"{step}: {detail}")

    def finished(self, host, step, status, seconds):
        with self.lock:
            self.running.pop(host, None)
        self.line(host, f"{step}: {status} in {seconds:.1f}s")

    def note(self, host, text):
        self.line(host, text)


class LineProgress(_Running):
    """Plain lines: a ticker thread writes 'STEP still running (Ns)' every `every` seconds."""

    def __init__(self, out: TextIO, clean=lambda s: s, every: float = EVERY,
                 clock=time.monotonic):
        super().__init__(out, clean, clock)
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def due(self) -> list[tuple[str, str, float]]:
        """(host, step, elapsed) for each step whose last line is `every` seconds old."""
        now, out = self.clock(), []
        with self.lock:
            for host, r in sorted(self.running.items()):
                if now - r[2] >= self.every:
                    r[2] = now
                    out.append((host, r[0], now - r[1]))
        return out

    def _tick(self):
        while not self._stop.wait(min(1.0, self.every / 4)):
            for host, step, elapsed in self.due():
                self.line(host, f"{step}: still running ({elapsed:.0f}s)")


class LiveProgress(_Running):
    """A terminal: the start and end lines scroll above one table (host, step, elapsed)
    that rich redraws in place."""

    def __init__(self, console, clean=lambda s: s, clock=time.monotonic):
        super().__init__(console.file, clean, clock)
        from rich.live import Live
        self.console = console
        self.live = Live(get_renderable=self.table, console=console, refresh_per_second=4,
                         transient=True)

    def table(self):
        from rich.table import Table
        t = Table.grid(padding=(0, 2))
        now = self.clock()
        with self.lock:
            rows = sorted(self.running.items())
        for host, (step, t0, _) in rows:
            t.add_row(f"[bold]{markup(host)}[/]", markup(step), f"{now - t0:.0f}s")
        return t

    def line(self, host, text):  # a note may quote the host's output
        self.console.print(f"{markup(host)} | {markup(self.clean(text))}", soft_wrap=True,
                           highlight=False)

    def __enter__(self):
        self.live.start()
        return self

    def __exit__(self, *exc):
        self.live.stop()


def for_stream(out: TextIO, clean=lambda s: s) -> StepProgress:
    """Live when `out` is a terminal, else plain lines."""
    if out.isatty():
        from rich.console import Console
        return LiveProgress(Console(file=out, highlight=False, emoji=False), clean)
    return LineProgress(out, clean)
