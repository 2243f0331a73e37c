"""Checkpoints: atomic writes (a temp file, fsync, rename, fsync of the folder), names ordered by
step, the `keep` newest kept, the newest loadable one found on resume and shipped to every rank,
and the Checkpointer that saves a run's state into them and restores it.

Every node keeps a copy: each node's local rank 0 writes the same checkpoint into its own
node's --ckpt-dir, and a resume takes the newest step any node holds, so a run that lost a
node (its folder with it) resumes on the survivors from the newest checkpoint.

A checkpoint is a dict loadable with torch.load(weights_only=True): model, optimizer, scaler,
step, epoch, data (the data position), rng (every rank's RNG state), config, model_config,
world_size, torch_version. torchrig reads the names (CKPT_RE, TMP_PREFIX) to fetch them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import socket
import time

import torch
import torch.distributed as dist

from config import TrainConfig
from runtime import DistCtx, all_reduce_int, barrier, emit, log, seed_everything
from token_format import DataError

# --------------------------------------------------------------------------------------
# Files
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
    # host and pid: nodes that share the folder (NFS) each write their own temp file
    tmp = os.path.join(d, f"{TMP_PREFIX}{os.path.basename(path)}.{socket.gethostname()}."
                          f"{os.getpid()}")
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
# A run's checkpoints
# --------------------------------------------------------------------------------------


class Checkpointer:
    """One run's checkpoints in cfg.ckpt_dir (None: none). resume() restores the newest loadable
    one into the run's parts (weights, optimizer, scaler, train.py's Position, every rank's RNG
    state); save() writes them at the current step. Both are collective: every rank calls them."""

    def __init__(self, ctx: DistCtx, cfg: TrainConfig, model, optimizer, scaler, position):
        self.ctx, self.cfg, self.dir, self.keep = ctx, cfg, cfg.ckpt_dir, cfg.keep
        self.model, self.optimizer, self.scaler, self.position = model, optimizer, scaler, position
        self.last_step: int | None = None  # of the newest checkpoint written or resumed from
        self.last_path: str | None = None  # its path (rank 0's knowledge)
        self.resumed_from: str | None = None
        self.resumed_world_size: int | None = None  # the world size that wrote it

    def due(self, step: int) -> bool:
        """Whether --ckpt-every asks for a checkpoint after `step`."""
        return bool(self.cfg.ckpt_every) and step % self.cfg.ckpt_every == 0

    def resume(self) -> str | None:
        """Restore the newest loadable checkpoint, print the resume line; its path, or None."""
        cfg, ctx, pos = self.cfg, self.ctx, self.position
        if not self.dir or cfg.no_resume:
            return None
        path, state = self.load_latest()
        if state is None:
            return None
        saved = (state.get("model_config") or {}).get("vocab_size")
        if saved is not None and saved != self.model.config.vocab_size:
            raise DataError(f"{path}: a model of vocab_size {saved}, the data's is "
                            f"{self.model.config.vocab_size}: resume with the data it was "
                            f"trained on, or start afresh (another --ckpt-dir, or --no-resume)")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        # The data position is the global step: the order is defined over global batches
        # (data.GlobalOrder), so it holds at any world size.
        pos.step = int(state["step"])
        pos.epoch, pos.step_in_epoch = divmod(pos.step, pos.steps_per_epoch)
        rngs = state.get("rng") or []
        if len(rngs) == ctx.world_size:
            restore_rng(rngs[ctx.rank], ctx.device)
        else:
            seed_everything(cfg.seed + ctx.rank + pos.step)
        self.last_step, self.last_path = pos.step, path
        self.resumed_from = path
        self.resumed_world_size = state.get("world_size")
        emit(ctx, "resume", {"step": pos.step, "epoch": pos.epoch, "ckpt": path})
        return path

    def save(self):
        """A checkpoint at the current step, unless there is one (or no --ckpt-dir)."""
        step = self.position.step
        if not self.dir or self.last_step == step:
            return
        path = self.write(step, self.content())
        if self.ctx.is_main:
            self.last_path = path
        self.last_step = step

    def content(self) -> dict | None:
        """The checkpoint's content on each node's local rank 0, the writers (None elsewhere);
        collective: every rank's RNG state is gathered to every rank. The model and optimizer
        are each writer's own: DDP keeps them the same on every rank."""
        cfg, ctx = self.cfg, self.ctx
        ep, sie = self.position.resume_point()
        rng = capture_rng(ctx.device)
        if ctx.initialized:
            rngs = [None] * ctx.world_size
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        if ctx.local_rank != 0:
            return None
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.position.step,
            "epoch": ep,
            "data": {"step": self.position.step, "epoch": ep, "step_in_epoch": sie,
                     "sampler_seed": cfg.seed, "world_size": ctx.world_size,
                     "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum},
            "rng": rngs,
            "config": {k: (v if v is None or isinstance(v, (bool, int, float)) else str(v))
                       for k, v in dataclasses.asdict(cfg).items()},
            "model_config": dataclasses.asdict(self.model.config),
            "world_size": ctx.world_size,
            "torch_version": str(torch.__version__),  # TorchVersion is not weights_only-safe
        }

    def load_latest(self):
        """(path, state) every rank resumes from, or (None, None). Each node's local rank 0
        finds its folder's newest loadable checkpoint (skipping unreadable ones with a warning);
        the newest step any node holds wins; every rank loads it from its own node's folder,
        and when a rank cannot (its node has an older one, or none: a node lost and replaced,
        a folder wiped) the lowest rank that has it ships its copy."""
        ctx = self.ctx
        path, state = None, None
        if ctx.local_rank == 0:
            os.makedirs(self.dir, exist_ok=True)
            cleanup_temp_files(self.dir)
            path, state = find_latest_checkpoint(self.dir,
                                                 warn=lambda m: log(ctx, m, all_ranks=True))
        if not ctx.initialized:
            return path, state
        newest = all_reduce_int(ctx, int(state["step"]) if state is not None else -1, "max")
        if newest < 0:
            return None, None
        path = os.path.join(self.dir, ckpt_name(newest))
        if state is None or int(state["step"]) != newest:
            state, _ = try_load(path) if os.path.exists(path) else (None, None)
        have = state is not None and int(state["step"]) == newest
        src = all_reduce_int(ctx, ctx.rank if have else ctx.world_size, "min")
        if all_reduce_int(ctx, 0 if have else 1, "max"):
            box = [state if ctx.rank == src else None]
            dist.broadcast_object_list(box, src=src)
            state = state if have else box[0]
        return path, state

    def write(self, step: int, state: dict | None) -> str | None:
        """Each node's local rank 0 writes `state` (None on the other ranks) into its node's
        folder; rank 0 logs it; every rank then waits."""
        path = None
        if state is not None:
            t0 = time.perf_counter()
            path = save_checkpoint(self.dir, step, state, self.keep)
            if self.ctx.is_main:
                emit(self.ctx, "ckpt", {"step": step, "path": path,
                                        "write_s": f"{time.perf_counter() - t0:.2f}"})
        barrier(self.ctx)  # other ranks wait while the writers write
        return path
