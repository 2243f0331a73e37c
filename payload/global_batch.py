"""A global batch that does not change with the world size: --global-batch G samples per
optimizer step over all ranks, whatever the number of ranks. Each (re)start derives its gradient
accumulation from the world size it finds: G = micro_batch x world_size x grad_accum.

Standard library only: train.py checks it at every start, before the process group, and
torchrig loads this same file (resources.payload_module) to refuse an elastic launch whose
world sizes cannot all share the global batch before anything starts.
"""

from __future__ import annotations


# --batch-size's default (config.py's): here, where torchrig (without torch) reads it too
DEFAULT_MICRO_BATCH = 8


class BatchError(ValueError):
    """A global batch that the micro-batch and world size cannot make up: the message says
    the numbers and what would divide."""


def grad_accum_for(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that micro_batch x world_size x it == global_batch;
    BatchError when no whole number does."""
    per_micro_step = micro_batch * world_size
    if global_batch >= per_micro_step and global_batch % per_micro_step == 0:
        return global_batch // per_micro_step
    raise BatchError(f"--global-batch {global_batch} is not a multiple of --batch-size "
                     f"{micro_batch} x world size {world_size} (= {per_micro_step} samples per "
                     f"micro-step): {_what_divides(global_batch, micro_batch, world_size)}")


def _what_divides(global_batch: int, micro_batch: int, world_size: int) -> str:
    per = micro_batch * world_size
    lo = global_batch // per * per
    nearest = " or ".join(str(g) for g in (lo, lo + per) if g > 0)
    ways = [f"a --global-batch that is a multiple of {per} ({nearest})"]
    if global_batch % world_size == 0:
        share = global_batch // world_size  # samples per rank per step
        fits = max(b for b in range(1, min(micro_batch, share) + 1) if share % b == 0)
        ways.append(f"--batch-size {fits} (a divisor of {share}, the samples per rank)")
    if global_batch % micro_batch == 0:
        sizes = valid_world_sizes(global_batch, micro_batch, limit=8)
        ways.append(f"a world size of {', '.join(map(str, sizes))}")
    return "use " + ", or ".join(ways)


def valid_world_sizes(global_batch: int, micro_batch: int, limit: int | None = None) -> list[int]:
    """The world sizes (ranks) at which --global-batch divides, smallest first (the first
    `limit` of them)."""
    if global_batch % micro_batch:
        return []
    n = global_batch // micro_batch
    sizes = [w for w in range(1, n + 1) if n % w == 0]
    return sizes[:limit] if limit else sizes
