"""What `data` shows: a push's progress per node (rich's live bars on a terminal, a plain line
per node every few seconds otherwise) and `data ls`'s rows and table."""

from __future__ import annotations

import contextlib
import time

from .plan import NodeCopy, agreement, human
from .run import Progress

PLAIN_EVERY_S = 5.0


@contextlib.contextmanager
def live_progress(stream):
    """A Progress that shows itself on `stream`."""
    if stream.isatty():
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress as Bars, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)
        bars = Bars(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(),
                    console=Console(file=stream), transient=False)
        tasks: dict[str, int] = {}

        def show(host: str, d: dict) -> None:
            if host not in tasks:
                from ..terminal import markup
                tasks[host] = bars.add_task(markup(f"{host} <- {d['source']}"), total=d["total"])
            bars.update(tasks[host], completed=d["done"], total=d["total"] or None)

        with bars:
            yield Progress(show)
        return

    from ..terminal import say
    shown: dict[str, float] = {}

    def line(host: str, d: dict) -> None:
        now = time.monotonic()
        finished = d["state"] == "received" or 0 < d["total"] <= d["done"]
        if not finished and now - shown.get(host, 0) < PLAIN_EVERY_S:
            return
        if finished and shown.get(host) == -1:
            return
        shown[host] = -1 if finished else now
        say(progress_line(host, d, now), stream, flush=True)

    yield Progress(line)


def progress_line(host: str, d: dict, now: float) -> str:
    """gpu2: 512.0 MiB of 1.0 GiB from gpu1, 110.2 MiB/s, ETA 5 s"""
    took = max(now - d["t0"], 1e-6)
    rate = d["done"] / took
    if not d["total"]:  # a download of a size not known yet
        return f"{host}: {human(d['done'])} from {d['source']}, {human(rate)}/s"
    left = d["total"] - d["done"]
    eta = f"ETA {left / rate:.0f} s" if rate > 0 and left > 0 else (
        "done" if left <= 0 else "ETA ?")
    return (f"{host}: {human(d['done'])} of {human(d['total'])} from {d['source']}, "
            f"{human(rate)}/s, {eta}")


def ls_rows(found: dict[str, list[dict] | str], name: str | None) -> list[dict]:
    """One row per dataset: per node its version, files, size and problems; agree when every
    reachable node holds the same version with no problem."""
    names = sorted({s["name"] for sets in found.values() if not isinstance(sets, str)
                    for s in sets} | ({name} if name else set()))
    rows = []
    for n in names:
        copies = []
        for host, sets in found.items():
            if isinstance(sets, str):
                copies.append(NodeCopy(host, error=sets))
                continue
            d = next((s for s in sets if s["name"] == n), None)
            copies.append(NodeCopy(host) if d is None else
                          NodeCopy(host, d["sha256"], d["files"], d["bytes"], d["problems"]))
        why = agreement(copies)
        rows.append({"name": n, "agree": not why, "why": why,
                     "nodes": {c.host: {"sha256": c.sha256, "files": c.files, "bytes": c.bytes,
                                        "problems": c.problems, "error": c.error}
                               for c in copies}})
    return rows
