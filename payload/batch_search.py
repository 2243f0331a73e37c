"""--find-batch-size: the largest per-GPU batch that fits, what counts as "does not fit" (every
out-of-memory form CUDA raises), and the probes on CUDA (real steps) and CPU (a memory model)."""

from __future__ import annotations

import gc
import resource

import torch

from model import build_model
from optim import make_optimizer, make_scaler, resolve_precision
from runtime import DistCtx, all_reduce_scalar, log


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


def find_batch_size(cfg, ctx: DistCtx, train_step, vocab_size: int | None = None) -> int:
    """--find-batch-size: the largest per-GPU batch at which two steps of `train_step` (train.py's)
    fit, on every rank, less 10%; 0 if none does. On CUDA a size fits when it does not run out
    of memory (within --mem-budget-gb, if given); on CPU when the predicted peak memory is
    within --mem-budget-gb. vocab_size: the data's (None: the preset's)."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.preset, cfg.seq_len, cfg.dropout, vocab_size,
                        cfg.ce_chunks, cfg.ce_kernel).to(ctx.device)
    precision = resolve_precision(cfg.precision, ctx.device)
    opt, _ = make_optimizer(model, 1e-4, 0.0, ctx.device)
    vocab = model.config.vocab_size

    def one_step(b):
        x = torch.randint(0, min(vocab, 256), (b, cfg.seq_len))
        # A fresh GradScaler per probe: one that ran out of memory between unscale_ and
        # update would refuse the next probe's unscale_ ("already been called").
        # Two steps: the second runs with the optimizer state and the allocator's blocks as
        # the first left them, which is where training itself first runs out of memory.
        for _ in range(2):
            train_step(model, opt, [(x, x)], device=ctx.device, precision=precision,
                       scaler=make_scaler(ctx.device, precision), clip=cfg.clip)

    if ctx.device.type == "cuda":
        if cfg.mem_budget_gb:
            total = torch.cuda.get_device_properties(ctx.device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, cfg.mem_budget_gb * 2**30 / total), ctx.device)

        def fits(b):
            ok = gpu_probe(one_step, b, ctx.device)
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            log(ctx, f"probe batch_size={b} {'ok' if ok else 'oom'}")
            return ok
    else:
        # CPU: no OOM to catch. Measure peak-RSS growth over a few small batches, take
        # the larger of the measured and analytic per-sample cost, and compare the
        # predicted peak against the budget.
        budget = cfg.mem_budget_gb * 2**30

        def maxrss():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        one_step(1)
        samples = []
        for b in (2, 4, 8):
            one_step(b)
            samples.append((b, maxrss()))
        measured = max(0.0, (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0]))
        mc = model.config
        bytes_per = 4 if precision == "fp32" else 2
        analytic = (cfg.seq_len * mc.n_embd * mc.n_layer * 34 * bytes_per  # activations
                    + cfg.seq_len * mc.vocab_size * 4 * 3)                 # logits + grad
        per_sample = max(measured, analytic)
        base = samples[-1][1] - per_sample * samples[-1][0]
        log(ctx, f"probe base={base / 2**30:.3f}GiB per_sample={per_sample / 2**20:.2f}MiB "
                 f"(measured {measured / 2**20:.2f}MiB, analytic {analytic / 2**20:.2f}MiB)")

        def fits(b):
            pred = base + per_sample * b
            ok = pred <= budget
            log(ctx, f"probe batch_size={b} predicted={pred / 2**30:.3f}GiB {'ok' if ok else 'oom'}")
            return ok

    best = search_batch_size(fits, cfg.max_batch_size)
    best = int(all_reduce_scalar(ctx, best, "min"))
    return max(1, int(best * 0.9)) if best > 0 else 0
