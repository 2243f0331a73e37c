"""What a training script needs around its model, after torchrun: the distributed setup and
the ranks' stop agreement, the stop signal, checkpoints (atomic, ordered by step, the newest
loadable one found on resume), the progress writer (progress.py's lines on stdout), and a clean
exit. Depends on the standard library, torch and progress.py."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import random
import re
import resource
import signal
import sys
import time
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


def all_reduce_scalar(ctx: DistCtx, value: float, op: str = "sum") -> float:
    if not ctx.initialized:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64 if ctx.backend == "gloo" else torch.float32,
                     device=ctx.device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                           "min": dist.ReduceOp.MIN}[op])
    return float(t.item())


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
# Checkpoints
# --------------------------------------------------------------------------------------

CKPT_RE = re.compile(r"^ckpt_(\d{8,})\.pt$")
TMP_PREFIX = ".tmp_ckpt_"


def ckpt_name(step: int) -> str:
    return f"ckpt_{step:08d}.pt"


def list_checkpoints(ckpt_dir: str) -> list[str]:
    """Complete checkpoint paths, oldest first (temp files are ignored). Ordered by step
    number: names are padded to 8 digits only, so from step 100,000,000 on the name order is
    not the step order."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(ckpt_dir) if (m := CKPT_RE.match(n))]
    return [os.path.join(ckpt_dir, n) for _, n in sorted(found)]


def cleanup_temp_files(ckpt_dir: str) -> list[str]:
    """Remove leftovers of interrupted writes. Only call when no write is in progress."""
    removed = []
    if ckpt_dir and os.path.isdir(ckpt_dir):
        for n in os.listdir(ckpt_dir):
            if n.startswith(TMP_PREFIX):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(ckpt_dir, n))
                    removed.append(n)
    return removed


def fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj, path: str):
    """torch.save to a temp file in the same directory, flush+fsync, os.replace, fsync the dir."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f"{TMP_PREFIX}{os.path.basename(path)}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(d)


def save_checkpoint(ckpt_dir: str, step: int, state: dict, keep: int) -> str:
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, ckpt_name(step))
    atomic_save(state, path)
    if keep and keep > 0:
        for old in list_checkpoints(ckpt_dir)[:-keep]:
            with contextlib.suppress(OSError):
                os.remove(old)
    return path


REQUIRED_KEYS = ("model", "optimizer", "step")


def try_load(path: str):
    """Load a checkpoint with weights_only=True; return (state, None) or (None, reason)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, I/O error, ...
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines else "")
        return None, f"{type(e).__name__}: {why}"
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        return None, "missing keys"
    return state, None


def find_latest_checkpoint(ckpt_dir: str, warn=print):
    """Newest loadable checkpoint (path, state); unreadable newer ones are skipped with a warning."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        state, err = try_load(path)
        if state is not None:
            return path, state
        warn(f"WARNING: skipping unreadable checkpoint {path}: {err}")
    return None, None


def py_random_state_to_plain(st):
    version, internal, gauss = st
    return {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss}


def py_random_state_from_plain(d):
    return (d["version"], tuple(int(v) for v in d["state"].tolist()), d["gauss"])


def capture_rng(device: torch.device) -> dict:
    rng = {
        "python": py_random_state_to_plain(random.getstate()),
        "torch_cpu": torch.get_rng_state(),
        "cuda": None,
    }
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def restore_rng(rng: dict, device: torch.device):
    random.setstate(py_random_state_from_plain(rng["python"]))
    torch.set_rng_state(rng["torch_cpu"])
    if device.type == "cuda" and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"], device)


# --------------------------------------------------------------------------------------
# Misc helpers
# --------------------------------------------------------------------------------------


def param_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(bytes(t.detach().cpu().clone(memory_format=torch.contiguous_format).untyped_storage()))
    return h.hexdigest()


def peak_mem(device: torch.device) -> dict[str, float]:
    """Peak memory so far, GiB, labelled: on CUDA what tensors held (alloc) and what the
    caching allocator held (reserved, what nvidia-smi and OOM see); on CPU the peak RSS."""
    if device.type == "cuda":
        return {"alloc": torch.cuda.max_memory_allocated(device) / 2**30,
                "reserved": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}  # KiB


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


class CheckpointManager:
    """One run's checkpoints in `ckpt_dir` (None: none): the newest loadable one that every rank
    resumes from, and atomic writes that keep the `keep` newest."""

    def __init__(self, ctx: DistCtx, ckpt_dir: str | None, keep: int):
        self.ctx, self.dir, self.keep = ctx, ckpt_dir, keep

    def load_latest(self):
        """(path, state) every rank resumes from, or (None, None). Rank 0 picks the newest
        loadable checkpoint (skipping unreadable ones with a warning); every rank loads that one,
        and when a rank cannot (the folder is not shared between nodes) rank 0 ships its copy."""
        ctx = self.ctx
        if ctx.is_main:
            os.makedirs(self.dir, exist_ok=True)
            cleanup_temp_files(self.dir)
            path, state = find_latest_checkpoint(self.dir, warn=lambda m: log(ctx, m))
        else:
            path, state = None, None
        if ctx.initialized:
            box = [os.path.basename(path) if path else None]
            dist.broadcast_object_list(box, src=0)
            chosen = box[0]
            if chosen and not ctx.is_main:
                path = os.path.join(self.dir, chosen)
                state, _ = try_load(path)
            have = all_reduce_scalar(ctx, 1.0 if (chosen is None or state is not None) else 0.0, "min")
            if have < 1:  # checkpoint dir not shared between nodes: ship rank 0's copy
                box = [state if ctx.is_main else None]
                dist.broadcast_object_list(box, src=0)
                state = box[0]
        return path, state

    def save(self, step: int, state: dict | None) -> str | None:
        """Rank 0 writes `state` (None on the other ranks) and logs it; every rank then waits."""
        path = None
        if self.ctx.is_main:
            t0 = time.perf_counter()
            path = save_checkpoint(self.dir, step, state, self.keep)
            emit(self.ctx, "ckpt", {"step": step, "path": path,
                                    "write_s": f"{time.perf_counter() - t0:.2f}"})
        barrier(self.ctx)  # other ranks wait while rank 0 writes
        return path
