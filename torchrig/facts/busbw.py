"""Bandwidth arithmetic of nccl-tests (pure).

nccl-tests (doc/PERFORMANCE.md) reports

* ``algbw = S / t`` -- bytes moved by the collective over the time it took, and
* ``busbw = algbw * factor(op, n)`` -- the speed each rank's link must sustain, so
  numbers are comparable across rank counts and with hardware peak bandwidth:

  ==============  =================
  all_reduce      2 (n - 1) / n
  reduce_scatter  (n - 1) / n
  all_gather      (n - 1) / n
  broadcast       1
  reduce          1
  alltoall        (n - 1) / n   (src/alltoall.cu)
  sendrecv        1             (src/sendrecv.cu)
  ==============  =================

GB/s here is 1e9 bytes per second, as nccl-tests prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

_ALIASES = {
    "allreduce": "all_reduce",
    "reducescatter": "reduce_scatter",
    "allgather": "all_gather",
    "alltoall": "alltoall",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "sendrecv": "sendrecv",
}


def canonical_op(op: str) -> str:
    """``"AllReduce"``, ``"all_reduce_perf"``, ``"allreduce"`` -> ``"all_reduce"``."""
    key = op.strip().lower()
    if key.endswith("_perf"):
        key = key[: -len("_perf")]
    key = key.replace("_", "").replace("-", "")
    try:
        return _ALIASES[key]
    except KeyError:
        raise ValueError(f"unknown collective: {op!r}") from None


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 B/s)."""
    if seconds <= 0:
        raise ValueError("seconds must be > 0")
    return nbytes / seconds / 1e9


def busbw_factor(op: str, n: int) -> float:
    """Factor from algbw to busbw for ``op`` over ``n`` ranks (see module doc)."""
    if n < 1:
        raise ValueError("n must be >= 1")
    op = canonical_op(op)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "alltoall"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, sendrecv


def busbw(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s."""
    return algbw(nbytes, seconds) * busbw_factor(op, n)


# ------------------------------------------------------------------ reading a sweep

# A half this many times faster than a smaller message of the same sweep did not move the
# data: a real transfer of more bytes never takes less time.
NO_OP_RATIO = 100.0
# Nor did a half this many times faster than its twin at the same size: both halves move the
# same bytes over the same links (real sweeps keep them within ~1.2x of each other at every
# size), while a no-op in-place half takes ~0.2 us against ~5-12 us even at 8 B, where the
# 100x above never triggers.
TWIN_RATIO = 10.0


@dataclass(frozen=True)
class Sample:
    """One timed collective of a sweep: a (size, half) cell of nccl-tests' table, or a row of
    the project's benchmark (in-place only)."""

    size: int  # bytes
    half: str  # "out-of-place" | "in-place"
    time_us: float
    busbw_gbs: float


def screen(samples: list[Sample]) -> tuple[list[Sample], list[tuple[Sample, str]]]:
    """(valid samples, [(invalid sample, why)]): a time TWIN_RATIO below its twin half at the
    same size, or orders of magnitude (NO_OP_RATIO) below any smaller message of the same
    half, is not a measurement; neither is a time of zero or less."""
    invalid: list[tuple[Sample, str]] = []
    for s in samples:
        if s.time_us <= 0:
            invalid.append((s, f"{s.half} time {s.time_us:g} us at {s.size} B"))
            continue
        twin = [o for o in samples if o.size == s.size and o.half != s.half and o.time_us > 0]
        if twin and s.time_us * TWIN_RATIO <= twin[0].time_us:
            invalid.append((s, f"{s.half} {s.time_us:g} us at {s.size} B vs "
                               f"{twin[0].time_us:g} us {twin[0].half}"))
            continue
        smaller = [o for o in samples if o.size < s.size and o.half == s.half and o.time_us > 0]
        slowest = max(smaller, key=lambda o: o.time_us, default=None)
        if slowest and s.time_us * NO_OP_RATIO <= slowest.time_us:
            invalid.append((s, f"{s.half} {s.time_us:g} us at {s.size} B, but "
                               f"{slowest.time_us:g} us at {slowest.size} B"))
    bad = {id(s) for s, _ in invalid}
    return [s for s in samples if id(s) not in bad], invalid


def at_large_size(samples: list[Sample], min_bytes: int) -> tuple[int, float] | None:
    """(size, busbw): the mean busbw of the samples at the largest size >= min_bytes, the
    bandwidth-bound end of the sweep; None if the sweep never got there."""
    sizes = [s.size for s in samples if s.size >= min_bytes]
    if not sizes:
        return None
    top = max(sizes)
    vals = [s.busbw_gbs for s in samples if s.size == top]
    return top, sum(vals) / len(vals)
