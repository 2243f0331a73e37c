"""What a training script needs around its model, after torchrun: the distributed setup, the
stop signal and the ranks' agreement to stop, the progress writer (progress.py's lines on
stdout), and a clean exit. Depends on the standard library, torch and progress.py."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import random
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

import progress

# --------------------------------------------------------------------------------------
# Distributed setup
# --------------------------------------------------------------------------------------


@dataclass
class DistCtx:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str = "none"
    device: torch.device = torch.device("cpu")
    initialized: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# A fragmented caching allocator can fail a 20+ GiB allocation (GPT-2's logits and their
# gradient at batch ~120) with a sixth of the GPU reserved but free: on an H200,
# --find-batch-size's answer (123) ran out of memory at its first eager steps with 23 GiB
# "reserved by PyTorch but unallocated". Expandable segments grow one mapping instead of
# carving fixed-size blocks (torchtitan runs with them too). Read when CUDA initializes, so
# it is set before the first CUDA call; a user's own setting wins.
CUDA_ALLOC_CONF = "expandable_segments:True"


def configure_cuda_allocator(env=os.environ) -> None:
    if not (env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF")):
        env["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF


def setup_distributed(device_pref: str = "auto", init_timeout_s: float = 600.0) -> DistCtx:
    """Read torchrun's environment; NCCL on CUDA, gloo otherwise; single process without it."""
    env = os.environ
    configure_cuda_allocator(env)
    under_torchrun = "RANK" in env and "WORLD_SIZE" in env
    rank = int(env.get("RANK", 0))
    local_rank = int(env.get("LOCAL_RANK", 0))
    world = int(env.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() and device_pref != "cpu"
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but CUDA is not available")
    if use_cuda:
        ndev = torch.cuda.device_count()
        if local_rank >= ndev:
            raise RuntimeError(f"LOCAL_RANK={local_rank} but only {ndev} CUDA device(s) visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init_process_group
    else:
        device = torch.device("cpu")
    ctx = DistCtx(rank=rank, local_rank=local_rank, world_size=world, device=device)
    if under_torchrun:
        ctx.backend = "nccl" if use_cuda else "gloo"
        # device_id binds the NCCL communicator to this rank's GPU at init (eager init: no
        # guessing the device, and init errors surface here rather than at the first collective).
        dist.init_process_group(
            backend=ctx.backend,
            timeout=datetime.timedelta(seconds=init_timeout_s),
            **({"device_id": device} if use_cuda else {}),
        )
        ctx.initialized = True
        ctx.rank, ctx.world_size = dist.get_rank(), dist.get_world_size()
    return ctx


def barrier(ctx: DistCtx):
    if ctx.initialized:
        if ctx.backend == "nccl":
            dist.barrier(device_ids=[ctx.device.index])
        else:
            dist.barrier()


def _all_reduce(ctx: DistCtx, value, dtype, op: str):
    t = torch.tensor([value], dtype=dtype, device=ctx.device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                           "min": dist.ReduceOp.MIN}[op])
    return t.item()


def all_reduce_scalar(ctx: DistCtx, value: float, op: str = "sum") -> float:
    if not ctx.initialized:
        return float(value)
    return float(_all_reduce(ctx, float(value), torch.float64 if ctx.backend == "gloo"
                             else torch.float32, op))


def all_reduce_int(ctx: DistCtx, value: int, op: str = "max") -> int:
    """An integer all-reduced exactly (int64: a step number past float32's 2**24 stays exact)."""
    if not ctx.initialized:
        return int(value)
    return int(_all_reduce(ctx, int(value), torch.int64, op))


def count_nodes(ctx: DistCtx) -> int:
    """The nodes the ranks run on: torchrun starts local rank 0 once on each. Collective."""
    return all_reduce_int(ctx, 1 if ctx.local_rank == 0 else 0, "sum")


# Ranks agree on stopping at "check" steps: an all-reduce whose result the host waits for, which
# drains the GPU queue, so not every step: after about SYNC_TARGET_S of steps (SIGTERM is answered
# within that and a step), and at every step that logs, checkpoints or must stop.
SYNC_TARGET_S = 1.0
SYNC_EVERY_MAX = 50


def steps_to_next_check(interval_s: float, steps: int) -> int:
    """From the last interval between checks: steps that make about SYNC_TARGET_S."""
    per_step = interval_s / max(1, steps)
    return max(1, min(SYNC_EVERY_MAX, int(SYNC_TARGET_S / per_step))) if per_step > 0 else 1


def agree_stop(ctx: DistCtx, stop: bool, every: int) -> tuple[bool, int]:
    """One all-reduce: whether any rank stops, and the smallest proposed check interval (the
    slowest rank's), so that every rank checks at the same steps."""
    if not ctx.initialized:
        return stop, every
    t = torch.tensor([1.0 if stop else 0.0, -float(every)],
                     dtype=torch.float64 if ctx.backend == "gloo" else torch.float32,
                     device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    flag, neg_every = t.tolist()
    return flag > 0, int(-neg_every)


class StopAgreement:
    """When the ranks check whether to stop, and whether they do: a check at most every `every`
    steps, proposed from this rank's step time and agreed as the slowest rank's, and at
    --stop-after's step; the caller adds the steps that must check anyway (a step line, a
    checkpoint, the last step)."""

    def __init__(self, ctx: DistCtx, stop_after: int | None = None):
        self.ctx, self.stop_after = ctx, stop_after
        self.next_check, self.every = 1, 1  # the first step checks (a resumed run's too)

    def due(self, step: int) -> bool:
        return step >= self.next_check or step == self.stop_after

    def agree(self, step: int) -> bool:
        """At a check step (the same on every rank): whether any rank stops (a signal, or
        --stop-after reached), and the step of the next check. A single CUDA process waits for
        its GPU here, as the all-reduce makes the ranks of a group wait."""
        ctx = self.ctx
        stop = stop_requested() or (self.stop_after is not None and step >= self.stop_after)
        stop_all, every = agree_stop(ctx, stop, self.every)
        if not ctx.initialized and ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        self.next_check = step + every
        return stop_all

    def interval_took(self, seconds: float, steps: int):
        """The last interval between checks: this rank proposes about SYNC_TARGET_S of steps."""
        self.every = steps_to_next_check(seconds, steps)

    def reason(self) -> str:
        """Why the ranks stop: the signal this rank got, else --stop-after, else a peer."""
        return stopped_by() or ("stop-after" if self.stop_after else "peer")


def finish_distributed(ctx: DistCtx):
    """Leave the process group in step with the peers: a barrier, so that no rank tears down
    its connections while a peer still waits on one of its collectives, then destroy it."""
    if ctx.initialized and dist.is_initialized():
        barrier(ctx)
        dist.destroy_process_group()


def exit_now(rc: int):
    """End the process without interpreter finalization (see train.py's __main__ block)."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(rc)


# --------------------------------------------------------------------------------------
# Progress writer
# --------------------------------------------------------------------------------------


def log(ctx: DistCtx | None, msg: str, all_ranks: bool = False):
    if all_ranks or ctx is None or ctx.is_main:
        # One write() per line: ranks share torchrun's stdout, and print() may split the
        # text and its newline into two writes that interleave with another rank's line.
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()


def emit(ctx: DistCtx | None, kind: str, fields: dict, note: str = "", all_ranks: bool = False):
    """A progress line (progress.py: what `invoke status`, `logs` and `demo` read)."""
    log(ctx, progress.format_line(kind, fields, note), all_ranks)


# --------------------------------------------------------------------------------------
# Stop signal
# --------------------------------------------------------------------------------------

_STOP = {"flag": False, "sig": None}


def _on_signal(signum, frame):
    if _STOP["flag"]:
        # A repeated SIGTERM is the same request, not an escalation: Slurm's scancel signals
        # every process of the step and torchrun forwards its own, so a worker gets it twice;
        # supervisors escalate with SIGKILL after their grace (KillWait, TimeoutStopSec).
        # A second SIGINT is a person at a terminal insisting: KeyboardInterrupt now.
        if signum == signal.SIGINT:
            signal.signal(signum, signal.default_int_handler)
            os.kill(os.getpid(), signum)
        return
    _STOP["flag"] = True
    _STOP["sig"] = signal.Signals(signum).name


def install_signal_handlers():
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_signal)


def stop_requested() -> bool:
    return _STOP["flag"]


def stopped_by() -> str | None:
    """The signal that asked to stop (SIGTERM, SIGINT), if one did."""
    return _STOP["sig"]


# --------------------------------------------------------------------------------------
# Misc helpers
# --------------------------------------------------------------------------------------


def param_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(bytes(t.detach().cpu().clone(memory_format=torch.contiguous_format).untyped_storage()))
    return h.hexdigest()


def seed_everything(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds all CUDA devices


def set_deterministic():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def write_json_atomic(path: str, obj):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
