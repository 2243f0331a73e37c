"""--find-batch-size's search: the largest per-GPU batch that fits, and what counts as "does
not fit" (every out-of-memory form CUDA raises)."""

from __future__ import annotations

import torch


def search_batch_size(fits, cap: int) -> int:
    """Largest b in [1, cap] with fits(b), assuming monotonicity: doubling, then binary search.
    Returns 0 if even b=1 does not fit."""
    if not fits(1):
        return 0
    lo = 1
    while lo * 2 <= cap and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, cap + 1)  # first size known (or assumed) not to fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# What CUDA raises when a size does not fit: the caching allocator's OutOfMemoryError, and
# RuntimeErrors from cuBLAS/cuDNN handle or workspace allocation and from raw CUDA calls.
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
               "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE")


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and any(m.lower() in msg.lower() for m in OOM_MARKERS)


def gpu_probe(one_step, b: int, device: torch.device) -> bool:
    """Whether one training step at batch b fits: any out-of-memory form is "no", other
    errors propagate."""
    try:
        one_step(b)
        torch.cuda.synchronize(device)
        return True
    except RuntimeError as e:  # OutOfMemoryError is one
        if not is_oom(e):
            raise
        return False
