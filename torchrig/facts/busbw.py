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
