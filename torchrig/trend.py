"""What `status` shows over time (pure): durations and end times in words, and the small
trend `status --watch` keeps per node (tokens/s and GPU use as sparklines), so a stall is
visible at a glance."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from . import progress as protocol

BARS = "▁▂▃▄▅▆▇█"
WIDTH = 20  # samples a sparkline shows (the newest)


def duration(seconds: float | None) -> str:
    """'45s', '3m05s', '2h04m', '3d02h'; '' when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return ""
    s = int(round(seconds))
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60),
                                      ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // sub_size:02d}{sub}"
    return f"{s}s"


def ended_text(ended_at: float, ran_s: float | None, now: float) -> str:
    """'ran 1m52s, ended 2026-11-30 23:41:07 UTC (5m00s ago)'."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ended_at))
    ago = duration(now - ended_at)
    return (f"ran {duration(ran_s)}, " if ran_s is not None else "") + \
        f"ended {when}" + (f" ({ago} ago)" if ago else "")


def sparkline(values: list[float | None], width: int = WIDTH) -> str:
    """One bar per value (the newest `width`), scaled from 0 to the largest; ' ' where a value
    is unknown. A stall reads as a drop to the lowest bar."""
    vals = list(values)[-width:]
    top = max((v for v in vals if v is not None), default=0.0)
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
        else:
            i = 0 if top <= 0 else min(len(BARS) - 1, int(v / top * (len(BARS) - 1) + 0.5))
            out.append(BARS[max(0, i)])
    return "".join(out)


def _number(text) -> float | None:
    try:
        v = float(text)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v >= 0 else None


def tokens_per_s(progress_line: str | None) -> tuple[int | None, float | None]:
    """(step, tok/s) of a progress line (the job wrote it: anything unreadable is None)."""
    p = protocol.parse(progress_line) if progress_line else None
    if p is None or p.kind not in ("step", "done"):
        return None, None
    step = _number(p.fields.get("step"))
    return (None if step is None else int(step)), _number(p.fields.get("tok/s"))


def gpu_use(gpus: list[dict]) -> float | None:
    """The node's GPUs' mean utilisation %, None without a reading."""
    utils = [u for u in (_number(g.get("util")) for g in gpus) if u is not None]
    return sum(utils) / len(utils) if utils else None


@dataclass
class _Node:
    tok: deque = field(default_factory=lambda: deque(maxlen=WIDTH))
    gpu: deque = field(default_factory=lambda: deque(maxlen=WIDTH))
    step: int | None = None
    rate: float | None = None
    changed: float | None = None   # when the step last advanced
    longest_gap: float = 0.0       # the longest wait between two advances so far


class Trend:
    """The samples of one `status --watch`, per node. tokens/s is the latest progress line's
    rate while new steps keep coming; once no step was logged for twice the longest gap seen
    between two logged steps, the job is stalled and the sample is 0."""

    def __init__(self):
        self.nodes: dict[str, _Node] = {}

    def add(self, host: str, t: float, progress_line: str | None, gpus: list[dict]) -> None:
        n = self.nodes.setdefault(host, _Node())
        step, rate = tokens_per_s(progress_line)
        if step is not None and step != n.step:
            if n.changed is not None:
                n.longest_gap = max(n.longest_gap, t - n.changed)
            n.step, n.rate, n.changed = step, rate, t
        stalled = (n.changed is not None and n.longest_gap > 0
                   and t - n.changed > 2 * n.longest_gap)
        n.tok.append(None if n.step is None else (0.0 if stalled else n.rate))
        n.gpu.append(gpu_use(gpus))

    def line(self, host: str) -> str:
        """'tok/s ▁▃▅▇ 1.2e+04  gpu ▂▂▂▁ 37%' for the node ('' before any sample)."""
        n = self.nodes.get(host)
        if n is None:
            return ""
        parts = []
        if any(v is not None for v in n.tok):
            parts.append(f"tok/s {sparkline(list(n.tok))} {_short(n.tok[-1])}")
        if any(v is not None for v in n.gpu):
            parts.append(f"gpu {sparkline(list(n.gpu))} {_short(n.gpu[-1], '%')}")
        return "  ".join(parts)

    def as_dict(self) -> dict:
        return {h: {"tokens_per_s": list(n.tok), "gpu_util": list(n.gpu)}
                for h, n in self.nodes.items()}


def _short(v: float | None, unit: str = "") -> str:
    if v is None:
        return "?"
    return (f"{v:.0f}" if v < 1e4 else f"{v:.3g}") + unit
