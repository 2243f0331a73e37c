#!/usr/bin/env python3
"""torchrig training payload: a small GPT trained with DDP under torchrun.

Depends only on the Python standard library and torch.

Launch (one node, 8 GPUs):
    torchrun --standalone --nproc-per-node 8 train.py --preset gpt2 --compile \
        --ckpt-dir /var/lib/torchrig/ckpt --ckpt-every 200

Without torchrun it runs as one process (world size 1, no process group).

Stable, machine-readable output (rank 0 unless noted):
    start rank=R local_rank=L host=H device=D (NAME) world_size=W backend=B pid=P   (every rank)
    config preset=... params=... global_batch=... lr=... precision=... ...
    resume step=S epoch=E ckpt=PATH
    WARNING: skipping unreadable checkpoint PATH: REASON
    step=40 loss=2.3456 lr=3.00e-04 tok/s=12345 samples/s=12.3 mfu=41.2% alloc=1.23GiB reserved=1.50GiB epoch=0
        (tok/s and samples/s: all ranks together, over the steps since the last line;
         mfu: per GPU, 6N+12LHQT FLOPs/token against the dense bf16/fp16 peak table; n/a if unknown)
    ckpt step=S path=PATH write_s=SECONDS
    signal SIGTERM received: stopping after step S       (then a checkpoint at S, exit 0)
    done step=S loss=L ckpt=PATH
    done step=S ckpt=PATH (nothing to train: ...)       (resumed at or past the last step: exit 0)
    param_hash rank=R step=S sha256=HEX                              (every rank, --dump-param-hash)
    batch_size=N                                                       (--find-batch-size)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import json
import math
import os
import random
import re
import resource
import signal
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DistributedSampler

# --------------------------------------------------------------------------------------
# Model: a GPT-2 style decoder (after nanoGPT)
# --------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 256
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


# Byte-level data uses token ids 0..255. The gpt2 preset keeps GPT-2's (padded) vocabulary
# so that the model is GPT-2 124M exactly; the unused embedding rows simply never fire.
PRESETS: dict[str, dict] = {
    # lr: default peak learning rate per --lr-ref-batch (32) samples, scaled linearly.
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=256, seq_len=64, lr=1e-2),
    "small": dict(n_layer=6, n_head=6, n_embd=384, vocab_size=256, seq_len=256, lr=3e-3),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, seq_len=1024, lr=1e-4),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx, targets=None):
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} > block size {self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build_model(preset: str, seq_len: int, dropout: float = 0.0) -> GPT:
    p = PRESETS[preset]
    cfg = GPTConfig(
        block_size=seq_len,
        vocab_size=p["vocab_size"],
        n_layer=p["n_layer"],
        n_head=p["n_head"],
        n_embd=p["n_embd"],
        dropout=dropout,
    )
    return GPT(cfg)


def flops_per_token(model: GPT, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), as nanoGPT's estimate_mfu: 6N + 12*L*H*Q*T."""
    cfg = model.config
    n = model.num_params()
    L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, seq_len
    return 6 * n + 12 * L * H * Q * T


# Dense (no sparsity) bf16/fp16 tensor-core peaks per GPU, FLOP/s, by the words of the name
# nvidia-smi and torch.cuda.get_device_name report. The key with the most words that all
# appear in the name, in order and whole, wins: "H100 NVL" over "H100", and "GB200" is not
# "B200" nor "V100S" "V100".
PEAK_FLOPS: dict[str, float] = {
    "B200": 2250e12,
    "GB200": 2500e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "GH200": 989e12,
    "H100": 989e12,
    "H100 PCIE": 756e12,
    "H100 NVL": 835e12,
    "H800": 989e12,
    "H800 PCIE": 756e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "A30": 165e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX A6000": 155e12,
    "V100": 125e12,
    "V100 PCIE": 112e12,
    "V100S": 130e12,
    "T4": 65e12,
}


def device_peak_flops(device_name: str | None) -> float | None:
    words = re.findall(r"[A-Z0-9]+", (device_name or "").upper())
    best, best_len = None, 0
    for key, peak in PEAK_FLOPS.items():
        k = key.split()
        if len(k) > best_len and any(words[i:i + len(k)] == k for i in range(len(words))):
            best, best_len = peak, len(k)
    return best


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


class SyntheticCopyDataset(Dataset):
    """Deterministic byte sequences with learnable structure.

    Sample i is a random pattern of 2..8 letters from a 16-letter alphabet (chosen by a
    generator seeded with (seed, i)), repeated to fill seq_len+1 tokens. A model first
    learns the alphabet (loss ln 256 -> ln 16), then to copy the period (induction).
    """

    ALPHABET = torch.tensor(list(b"abcdefghijklmnop"), dtype=torch.long)

    def __init__(self, num_samples: int, seq_len: int, seed: int = 0):
        self.n = num_samples
        self.seq_len = seq_len
        self.seed = seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        period = int(torch.randint(2, 9, (1,), generator=g))
        pattern = self.ALPHABET[torch.randint(0, len(self.ALPHABET), (period,), generator=g)]
        reps = (self.seq_len + 1 + period - 1) // period
        seq = pattern.repeat(reps)[: self.seq_len + 1]
        return seq[:-1], seq[1:]


class ByteFileDataset(Dataset):
    """Non-overlapping windows of seq_len+1 bytes from a file."""

    def __init__(self, path: str, seq_len: int):
        with open(path, "rb") as f:
            raw = f.read()
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len if len(self.data) > seq_len else 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = int(i) * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def iterate_batches(dataset, indices, batch_size: int, skip_batches: int = 0, pin: bool = False):
    """Yield (x, y) batches of the given per-rank indices, skipping the first skip_batches.
    pin: in page-locked memory, so that the copy to the GPU is asynchronous."""
    nb = len(indices) // batch_size
    for b in range(skip_batches, nb):
        items = [dataset[i] for i in indices[b * batch_size : (b + 1) * batch_size]]
        x, y = torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
        yield (x.pin_memory(), y.pin_memory()) if pin else (x, y)


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


def setup_distributed(device_pref: str = "auto", init_timeout_s: float = 600.0) -> DistCtx:
    """Read torchrun's environment; NCCL on CUDA, gloo otherwise; single process without it."""
    env = os.environ
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


def log(ctx: DistCtx | None, msg: str, all_ranks: bool = False):
    if all_ranks or ctx is None or ctx.is_main:
        # One write() per line: ranks share torchrun's stdout, and print() may split the
        # text and its newline into two writes that interleave with another rank's line.
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()


# --------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------

_STOP = {"flag": False, "sig": None}


def _on_signal(signum, frame):
    if _STOP["flag"]:
        # Second signal: fall back to the default action (terminate / KeyboardInterrupt).
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
        os.kill(os.getpid(), signum)
        return
    _STOP["flag"] = True
    _STOP["sig"] = signal.Signals(signum).name


def install_signal_handlers():
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_signal)


def stop_requested() -> bool:
    return _STOP["flag"]


# --------------------------------------------------------------------------------------
# Precision, optimizer, schedule, training step
# --------------------------------------------------------------------------------------


def enable_tf32():
    """TF32 for fp32 matmuls (cuBLAS) and convolutions (cuDNN), through the legacy API only.

    torch >= 2.9 also has per-backend `fp32_precision` settings; once those are set, every
    read of the legacy flags raises ("mix of the legacy and new APIs"), and the compiler reads
    them (torch.get_float32_matmul_precision) while lowering, so --compile died (pytorch
    issue 166387). The legacy setters keep both families readable on every torch we support.
    """
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


def auto_cuda_precision(capability: tuple[int, int]) -> str:
    """--precision auto on a GPU of this compute capability: bf16 from sm80 (Ampere) on.

    Not torch.cuda.is_bf16_supported(): it counts emulation, so it says True on V100 (sm70)
    and T4 (sm75), where bf16 is emulated and slow; those get fp16 with a GradScaler.
    """
    return "bf16" if tuple(capability) >= (8, 0) else "fp16"


def resolve_precision(pref: str, device: torch.device) -> str:
    if device.type == "cuda":
        if pref == "auto":
            return auto_cuda_precision(torch.cuda.get_device_capability(device))
        return pref
    if pref == "auto":
        return "fp32"
    if pref == "fp16":
        raise RuntimeError("--precision fp16 needs CUDA")
    return pref


def autocast_ctx(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_scaler(device: torch.device, precision: str):
    if device.type == "cuda" and precision == "fp16":
        return torch.amp.GradScaler("cuda")
    return None


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device):
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs), "fused"
        except (RuntimeError, TypeError):
            pass
    return torch.optim.AdamW(groups, foreach=True, **kwargs), "foreach"


def lr_at(step: int, peak_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to peak_lr over `warmup` steps, then cosine decay to min_ratio*peak at `total`."""
    min_lr = peak_lr * min_ratio
    if warmup > 0 and step < warmup:
        return peak_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    span = max(1, total - warmup)
    progress = (step - warmup) / span
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - min_lr)


def scaled_lr(lr: float, global_batch: int, ref_batch: int) -> float:
    return lr * global_batch / ref_batch


def train_step(model, optimizer, micro_batches, *, device, precision="fp32", scaler=None,
               clip: float = 0.0):
    """One optimizer step over len(micro_batches) accumulated micro-batches.

    Gradients are averaged over micro-batches (loss / k); on DDP models gradient all-reduce is
    skipped (model.no_sync()) on all but the last micro-batch. Returns the mean loss (detached
    tensor, no host sync) and the grad norm (tensor or None).
    """
    k = len(micro_batches)
    is_ddp = isinstance(model, DDP)
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro_batches):
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        sync_ctx = model.no_sync() if (is_ddp and i < k - 1) else contextlib.nullcontext()
        with sync_ctx:
            with autocast_ctx(device, precision):
                _, loss = model(x, y)
            loss = loss / k
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
        total += loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = None
    if clip and clip > 0:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


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


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _int_at_least(low, what):
    """An argparse type: an integer >= low, else one clear message."""
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return parse


_pos_int = _int_at_least(1, "a positive integer")
_nonneg_int = _int_at_least(0, "a non-negative integer")


def _pos_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
    if not (v > 0) or math.isinf(v):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
    return v


def _nonneg_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {s!r}")
    if not (v >= 0) or math.isinf(v):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {s!r}")
    return v


def _step_range(s):
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", s)
    if not m or int(m.group(1)) > int(m.group(2)) or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B, got {s!r}")
    return f"{int(m.group(1))}:{int(m.group(2))}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="torchrig payload: GPT training with DDP (launch with torchrun, or alone).",
    )
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="model size: tiny (CPU demo), small, gpt2 (GPT-2 124M)")
    g.add_argument("--seq-len", type=_pos_int, default=None,
                   help="tokens per sample (default: preset's, tiny 64, gpt2 1024)")
    g.add_argument("--data", default=None, help="byte-level text file (default: synthetic task)")
    g.add_argument("--synthetic-samples", type=_pos_int, default=8192,
                   help="size of the synthetic data set")
    g.add_argument("--dropout", type=_nonneg_float, default=0.0)
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--batch-size", type=_pos_int, default=8, help="per-GPU micro-batch (samples)")
    g.add_argument("--grad-accum", type=_pos_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=_pos_float, default=None,
                   help="peak learning rate for a global batch of --lr-ref-batch, scaled linearly "
                        "with the real global batch (default: preset's: tiny 1e-2, small 3e-3, "
                        "gpt2 1e-4)")
    g.add_argument("--lr-ref-batch", type=_pos_int, default=32)
    g.add_argument("--min-lr-ratio", type=_nonneg_float, default=0.1)
    g.add_argument("--warmup-steps", type=_nonneg_int, default=None,
                   help="linear warmup steps (default: 5%% of the run, at most 200)")
    g.add_argument("--weight-decay", type=_nonneg_float, default=0.1)
    g.add_argument("--clip", type=_nonneg_float, default=1.0, help="grad-norm clip (0: off)")
    g.add_argument("--max-steps", type=_pos_int, default=None, help="stop after this many steps")
    g.add_argument("--epochs", type=_pos_int, default=None,
                   help="passes over the data (default 1 unless --max-steps is given)")
    g.add_argument("--seed", type=_nonneg_int, default=1337)
    g = p.add_argument_group("device and speed")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: bf16 on sm80+ GPUs (A100, H100), fp16+GradScaler on older ones "
                        "(V100, T4); fp32 on CPU")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms: resume reproduces an uninterrupted run")
    g.add_argument("--init-timeout", type=_pos_float, default=600.0,
                   help="process-group init (and collective) timeout, seconds")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--ckpt-dir", default=None)
    g.add_argument("--ckpt-every", type=_nonneg_int, default=0, help="steps between checkpoints")
    g.add_argument("--keep", type=_pos_int, default=3, help="checkpoints kept")
    g.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    g = p.add_argument_group("output")
    g.add_argument("--log-every", type=_pos_int, default=10)
    g.add_argument("--out-json", default=None, help="rank 0 writes final metrics here")
    g.add_argument("--tensorboard", default=None, metavar="DIR")
    g.add_argument("--profile-steps", type=_step_range, default=None, metavar="A:B")
    g.add_argument("--profile-dir", default=None)
    g.add_argument("--stop-after", type=_pos_int, default=None, metavar="S",
                   help="testing: behave as if SIGTERM arrived during step S (checkpoint, exit 0); "
                        "unlike --max-steps the LR schedule is unchanged")
    g.add_argument("--dump-param-hash", action="store_true",
                   help="every rank prints a hash of its parameters at the end")
    g = p.add_argument_group("batch-size search")
    g.add_argument("--find-batch-size", action="store_true",
                   help="find the largest per-GPU batch that fits, print batch_size=N, exit")
    g.add_argument("--mem-budget-gb", type=_pos_float, default=None,
                   help="memory budget for --find-batch-size (required on CPU)")
    g.add_argument("--max-batch-size", type=_pos_int, default=4096)
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = PRESETS[args.preset]["seq_len"]
    if args.lr is None:
        args.lr = PRESETS[args.preset]["lr"]
    if args.data is not None and not os.path.isfile(args.data):
        parser.error(f"--data: no such file: {args.data}")
    if args.data is not None and os.path.getsize(args.data) <= args.seq_len:
        parser.error(f"--data: file too small for --seq-len {args.seq_len}")
    if args.profile_steps and not args.profile_dir:
        parser.error("--profile-steps needs --profile-dir")
    if args.ckpt_every and not args.ckpt_dir:
        parser.error("--ckpt-every needs --ckpt-dir")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.precision == "fp16" and not cuda:
        parser.error("--precision fp16 needs CUDA (use fp32 or bf16 on CPU)")
    if args.find_batch_size and not cuda and args.mem_budget_gb is None:
        parser.error("--find-batch-size on CPU needs --mem-budget-gb")
    if args.min_lr_ratio > 1:
        parser.error("--min-lr-ratio must be <= 1")
    return args


# --------------------------------------------------------------------------------------
# Batch-size search
# --------------------------------------------------------------------------------------


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


def find_batch_size(args, ctx: DistCtx) -> int:
    torch.manual_seed(args.seed)
    model = build_model(args.preset, args.seq_len, args.dropout).to(ctx.device)
    precision = resolve_precision(args.precision, ctx.device)
    opt, _ = make_optimizer(model, 1e-4, 0.0, ctx.device)
    vocab = model.config.vocab_size

    def one_step(b):
        x = torch.randint(0, min(vocab, 256), (b, args.seq_len))
        # A fresh GradScaler per probe: one that ran out of memory between unscale_ and
        # update would refuse the next probe's unscale_ ("already been called").
        train_step(model, opt, [(x, x)], device=ctx.device, precision=precision,
                   scaler=make_scaler(ctx.device, precision), clip=args.clip)

    if ctx.device.type == "cuda":
        if args.mem_budget_gb:
            total = torch.cuda.get_device_properties(ctx.device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, args.mem_budget_gb * 2**30 / total), ctx.device)

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
        budget = args.mem_budget_gb * 2**30

        def maxrss():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        one_step(1)
        samples = []
        for b in (2, 4, 8):
            one_step(b)
            samples.append((b, maxrss()))
        measured = max(0.0, (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0]))
        cfg = model.config
        bytes_per = 4 if precision == "fp32" else 2
        analytic = (args.seq_len * cfg.n_embd * cfg.n_layer * 34 * bytes_per  # activations
                    + args.seq_len * cfg.vocab_size * 4 * 3)                  # logits + grad
        per_sample = max(measured, analytic)
        base = samples[-1][1] - per_sample * samples[-1][0]
        log(ctx, f"probe base={base / 2**30:.3f}GiB per_sample={per_sample / 2**20:.2f}MiB "
                 f"(measured {measured / 2**20:.2f}MiB, analytic {analytic / 2**20:.2f}MiB)")

        def fits(b):
            pred = base + per_sample * b
            ok = pred <= budget
            log(ctx, f"probe batch_size={b} predicted={pred / 2**30:.3f}GiB {'ok' if ok else 'oom'}")
            return ok

    best = search_batch_size(fits, args.max_batch_size)
    best = int(all_reduce_scalar(ctx, best, "min"))
    return max(1, int(best * 0.9)) if best > 0 else 0


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def fmt_step_line(step, loss, lr, tok_s, samples_s, mfu, mem: dict[str, float], epoch) -> str:
    mfu_s = "n/a" if mfu is None else f"{mfu * 100:.1f}%"
    return (f"step={step} loss={loss:.4f} lr={lr:.2e} tok/s={tok_s:.0f} samples/s={samples_s:.1f} "
            f"mfu={mfu_s} {' '.join(f'{k}={v:.2f}GiB' for k, v in mem.items())} epoch={epoch}")


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


def train(args) -> int:
    install_signal_handlers()
    if args.deterministic:
        set_deterministic()
    ctx = setup_distributed(args.device, args.init_timeout)
    try:
        rc = _train(args, ctx)
    except BaseException:
        # A failing rank leaves at once: its peers may be gone, so no barrier. torchrun sees
        # the exit status and restarts (or ends) the whole group either way.
        if ctx.initialized and dist.is_initialized():
            dist.destroy_process_group()
        raise
    finish_distributed(ctx)
    return rc


def finish_distributed(ctx: DistCtx):
    """Leave the process group in step with the peers: a barrier, so that no rank tears down
    its connections while a peer still waits on one of its collectives, then destroy it."""
    if ctx.initialized and dist.is_initialized():
        barrier(ctx)
        dist.destroy_process_group()


def exit_now(rc: int):
    """End the process without interpreter finalization (see the __main__ block)."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(rc)


def _train(args, ctx: DistCtx) -> int:
    dev = ctx.device
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    log(ctx, f"start rank={ctx.rank} local_rank={ctx.local_rank} host={socket.gethostname()} "
             f"device={dev} ({dev_name}) world_size={ctx.world_size} backend={ctx.backend} "
             f"pid={os.getpid()}", all_ranks=True)
    if dev.type == "cuda":
        enable_tf32()
    seed_everything(args.seed + ctx.rank)

    if args.find_batch_size:
        n = find_batch_size(args, ctx)
        log(ctx, f"batch_size={n}")
        return 0 if n > 0 else 1

    precision = resolve_precision(args.precision, dev)

    # Model (same init on every rank; DDP also broadcasts rank 0's parameters).
    torch.manual_seed(args.seed)
    raw_model = build_model(args.preset, args.seq_len, args.dropout).to(dev)
    seed_everything(args.seed + ctx.rank)
    n_params = raw_model.num_params()
    fpt = flops_per_token(raw_model, args.seq_len)
    peak = device_peak_flops(dev_name) if dev.type == "cuda" else None

    # Data
    if args.data:
        dataset = ByteFileDataset(args.data, args.seq_len)
    else:
        dataset = SyntheticCopyDataset(args.synthetic_samples, args.seq_len, seed=args.seed)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank,
                                 shuffle=True, seed=args.seed, drop_last=True)
    micro_per_epoch = len(sampler) // args.batch_size
    steps_per_epoch = micro_per_epoch // args.grad_accum
    global_batch = args.batch_size * args.grad_accum * ctx.world_size
    if steps_per_epoch < 1:
        log(ctx, f"error: data set of {len(dataset)} samples is smaller than one global batch "
                 f"({global_batch} samples)")
        return 2
    epochs = args.epochs if args.epochs is not None else (None if args.max_steps else 1)
    total_steps = min(args.max_steps or float("inf"),
                      epochs * steps_per_epoch if epochs else float("inf"))
    total_steps = int(total_steps)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, min(200, total_steps // 20))
    peak_lr = scaled_lr(args.lr, global_batch, args.lr_ref_batch)

    opt, opt_kind = make_optimizer(raw_model, peak_lr, args.weight_decay, dev)
    scaler = make_scaler(dev, precision)

    # Resume: rank 0 picks the newest loadable checkpoint; every rank loads that one.
    start_step, epoch, step_in_epoch, resumed_from = 0, 0, 0, None
    if args.ckpt_dir and not args.no_resume:
        if ctx.is_main:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            cleanup_temp_files(args.ckpt_dir)
            path, state = find_latest_checkpoint(args.ckpt_dir, warn=lambda m: log(ctx, m))
        else:
            path, state = None, None
        if ctx.initialized:
            box = [os.path.basename(path) if path else None]
            dist.broadcast_object_list(box, src=0)
            chosen = box[0]
            if chosen and not ctx.is_main:
                state, err = try_load(os.path.join(args.ckpt_dir, chosen))
                path = os.path.join(args.ckpt_dir, chosen)
            have = all_reduce_scalar(ctx, 1.0 if (chosen is None or state is not None) else 0.0, "min")
            if have < 1:  # checkpoint dir not shared between nodes: ship rank 0's copy
                box = [state if ctx.is_main else None]
                dist.broadcast_object_list(box, src=0)
                state = box[0]
        if state is not None:
            raw_model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            if scaler is not None and state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            start_step = int(state["step"])
            data = state.get("data", {})
            epoch = int(data.get("epoch", state.get("epoch", 0)))
            step_in_epoch = int(data.get("step_in_epoch", 0))
            if step_in_epoch >= steps_per_epoch:
                epoch, step_in_epoch = epoch + 1, 0
            rngs = state.get("rng") or []
            if len(rngs) == ctx.world_size:
                restore_rng(rngs[ctx.rank], dev)
            else:
                seed_everything(args.seed + ctx.rank + start_step)
            resumed_from = path
            log(ctx, f"resume step={start_step} epoch={epoch} ckpt={path}")
            del state
    if start_step >= total_steps:  # e.g. restarted after the final checkpoint: nothing to do
        log(ctx, f"done step={start_step} ckpt={resumed_from} (nothing to train: the checkpoint "
                 f"is at or past the last step)")
        return 0

    model = raw_model
    if args.compile:
        model = torch.compile(model)
    # One process has nothing to all-reduce: DDP would only add its bucket hooks, and under
    # --compile its graph splitter cuts the model into a graph per bucket.
    use_ddp = ctx.world_size > 1
    if use_ddp:
        model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)

    tokens_per_step = global_batch * args.seq_len
    log(ctx, f"config preset={args.preset} params={n_params / 1e6:.2f}M seq_len={args.seq_len} "
             f"batch_size={args.batch_size} grad_accum={args.grad_accum} world_size={ctx.world_size} "
             f"global_batch={global_batch} tokens_per_step={tokens_per_step} lr={peak_lr:.3e} "
             f"(lr {args.lr:g} x {global_batch}/{args.lr_ref_batch}) warmup={warmup} "
             f"total_steps={total_steps} steps_per_epoch={steps_per_epoch} precision={precision} "
             f"compile={args.compile} ddp={'on' if use_ddp else 'off'} optimizer=adamw-{opt_kind} "
             f"deterministic={args.deterministic} "
             f"data={args.data or 'synthetic'} flops_per_token={fpt:.3e} "
             f"peak_flops={'n/a' if peak is None else f'{peak:.3g}'}")

    tb = None
    if args.tensorboard and ctx.is_main:
        try:
            from torch.utils.tensorboard import SummaryWriter
            tb = SummaryWriter(args.tensorboard)
        except Exception as e:  # ImportError, or tensorboard missing behind torch's shim
            log(ctx, f"WARNING: --tensorboard ignored: tensorboard is not importable ({e}); "
                     f"pip install tensorboard")

    prof_range = tuple(int(v) for v in args.profile_steps.split(":")) if args.profile_steps else None
    prof = None

    def make_state(step, ep, sie):
        if sie >= steps_per_epoch:
            ep, sie = ep + 1, 0
        rng = capture_rng(dev)
        if ctx.initialized:
            gathered = [None] * ctx.world_size if ctx.is_main else None
            dist.gather_object(rng, gathered, dst=0)
            rngs = gathered
        else:
            rngs = [rng]
        if not ctx.is_main:
            return None
        return {
            "model": raw_model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "step": step,
            "epoch": ep,
            "data": {"epoch": ep, "step_in_epoch": sie, "sampler_seed": args.seed,
                     "world_size": ctx.world_size, "batch_size": args.batch_size,
                     "grad_accum": args.grad_accum},
            "rng": rngs,
            "config": {k: (v if v is None or isinstance(v, (bool, int, float)) else str(v))
                       for k, v in vars(args).items()},
            "model_config": asdict(raw_model.config),
            "world_size": ctx.world_size,
            "torch_version": str(torch.__version__),  # TorchVersion is not weights_only-safe
        }

    last_ckpt = {"step": None, "path": resumed_from}
    if resumed_from is not None:
        last_ckpt["step"] = start_step

    def checkpoint(step, ep, sie):
        if not args.ckpt_dir or last_ckpt["step"] == step:
            return
        state = make_state(step, ep, sie)  # collective (RNG gather)
        if ctx.is_main:
            t0 = time.perf_counter()
            path = save_checkpoint(args.ckpt_dir, step, state, args.keep)
            log(ctx, f"ckpt step={step} path={path} write_s={time.perf_counter() - t0:.2f}")
            last_ckpt["path"] = path
        last_ckpt["step"] = step
        barrier(ctx)  # other ranks wait while rank 0 writes

    step = start_step
    step_times: list[float] = []  # time per step, one per interval between stop checks
    losses: list[tuple[int, float]] = []
    last_loss = float("nan")
    window_time, window_steps = 0.0, 0  # summed step times: excludes checkpoint writes
    interval_time, interval_steps = 0.0, 0  # since the last stop check
    next_check, check_every = start_step + 1, 1
    stopped_by = None
    t_start = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    model.train()
    while step < total_steps and stopped_by is None:
        sampler.set_epoch(epoch)
        indices = list(iter(sampler))
        batches = iterate_batches(dataset, indices, args.batch_size,
                                  skip_batches=step_in_epoch * args.grad_accum,
                                  pin=dev.type == "cuda")
        while step_in_epoch < steps_per_epoch and step < total_steps:
            if prof_range and ctx.is_main and prof is None and step + 1 == prof_range[0]:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if dev.type == "cuda":
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                prof = torch.profiler.profile(activities=acts, record_shapes=True)
                prof.__enter__()
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(args.grad_accum)]
            lr = lr_at(step, peak_lr, warmup, total_steps, args.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            loss_t, _ = train_step(model, opt, micro, device=dev, precision=precision,
                                   scaler=scaler, clip=args.clip)
            step += 1
            step_in_epoch += 1
            check = (step >= next_check or step >= total_steps or step % args.log_every == 0
                     or (args.ckpt_every and step % args.ckpt_every == 0)
                     or step == args.stop_after)  # the same steps on every rank
            stop_all = False
            if check:
                stop_local = stop_requested() or (args.stop_after is not None
                                                  and step >= args.stop_after)
                stop_all, every = agree_stop(ctx, stop_local, check_every)
                if not ctx.initialized and dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            dt = time.perf_counter() - t0
            window_steps += 1
            window_time += dt
            interval_steps += 1
            interval_time += dt
            if check:  # the GPU queue is drained: the interval's time is real
                step_times.append(interval_time / interval_steps)
                check_every = steps_to_next_check(interval_time, interval_steps)
                next_check = step + every
                interval_time, interval_steps = 0.0, 0
            if prof is not None and step == prof_range[1]:
                prof.__exit__(None, None, None)
                os.makedirs(args.profile_dir, exist_ok=True)
                trace = os.path.join(args.profile_dir,
                                     f"trace_rank{ctx.rank}_steps{prof_range[0]}-{prof_range[1]}.json")
                prof.export_chrome_trace(trace)
                log(ctx, f"profile steps={prof_range[0]}:{prof_range[1]} trace={trace}")
                prof, prof_range = None, None
            is_last = step >= total_steps or stop_all
            if step % args.log_every == 0 or is_last:
                loss_v = all_reduce_scalar(ctx, float(loss_t.item()), "sum") / ctx.world_size
                last_loss = loss_v
                losses.append((step, loss_v))
                el = max(window_time, 1e-9)
                tok_s = window_steps * tokens_per_step / el
                sam_s = window_steps * global_batch / el
                mfu = (fpt * tok_s / ctx.world_size / peak) if peak else None
                mem = peak_mem(dev)
                log(ctx, fmt_step_line(step, loss_v, lr, tok_s, sam_s, mfu, mem, epoch))
                if tb is not None:
                    tb.add_scalar("train/loss", loss_v, step)
                    tb.add_scalar("train/lr", lr, step)
                    tb.add_scalar("perf/tokens_per_s", tok_s, step)
                    if mfu is not None:
                        tb.add_scalar("perf/mfu", mfu, step)
                window_time, window_steps = 0.0, 0
            if stop_all:
                stopped_by = _STOP["sig"] or ("stop-after" if args.stop_after else "peer")
                log(ctx, f"signal {stopped_by} received: stopping after step {step}")
                break
            if args.ckpt_every and step % args.ckpt_every == 0 and not is_last:
                checkpoint(step, epoch, step_in_epoch)
        if step_in_epoch >= steps_per_epoch:
            epoch, step_in_epoch = epoch + 1, 0

    if prof is not None:
        prof.__exit__(None, None, None)
    if args.ckpt_dir:
        checkpoint(step, epoch, step_in_epoch)
    wall = time.perf_counter() - t_start

    if args.dump_param_hash:
        log(ctx, f"param_hash rank={ctx.rank} step={step} sha256={param_hash(raw_model)}",
            all_ranks=True)

    if ctx.is_main:
        skip = max(1, len(step_times) // 10) if len(step_times) > 1 else 0
        steady = step_times[skip:] or step_times
        med_dt = statistics.median(steady) if steady else None
        tok_s_med = tokens_per_step / med_dt if med_dt else None
        mfu_med = (fpt * tok_s_med / ctx.world_size / peak) if (peak and tok_s_med) else None
        if args.out_json:
            mem_end = peak_mem(dev)
            write_json_atomic(args.out_json, {
                "steps": step,
                "steps_run": step - start_step,
                "start_step": start_step,
                "final_loss": None if math.isnan(last_loss) else last_loss,
                "losses": losses,
                "tokens_per_s_median": tok_s_med,
                "samples_per_s_median": (global_batch / med_dt) if med_dt else None,
                "step_time_s_median": med_dt,
                "mfu_median": mfu_med,
                "flops_per_token": fpt,
                "peak_flops": peak,
                "peak_mem_gib": mem_end.get("alloc", mem_end.get("rss")),
                "peak_mem_reserved_gib": mem_end.get("reserved"),
                "params": n_params,
                "preset": args.preset,
                "seq_len": args.seq_len,
                "batch_size": args.batch_size,
                "grad_accum": args.grad_accum,
                "world_size": ctx.world_size,
                "global_batch": global_batch,
                "peak_lr": peak_lr,
                "precision": precision,
                "compile": args.compile,
                "ddp": use_ddp,
                "optimizer": f"adamw-{opt_kind}",
                "device": str(dev),
                "device_name": dev_name,
                "backend": ctx.backend,
                "torch_version": str(torch.__version__),
                "resumed_from": resumed_from,
                "stopped_by_signal": stopped_by,
                "checkpoint": last_ckpt["path"],
                "wall_s": wall,
            })
        if tb is not None:
            tb.close()
        loss_s = "nan" if math.isnan(last_loss) else f"{last_loss:.4f}"
        log(ctx, f"done step={step} loss={loss_s} ckpt={last_ckpt['path'] or 'none'}")
    return 0


@record
def main(argv=None) -> int:
    args = parse_args(argv)
    return train(args)


if __name__ == "__main__":
    # A finished worker exits with os._exit, not through interpreter finalization: the process
    # group's C++ threads (gloo's workers, which take the GIL to free tensors Python dropped,
    # and its connection loop) outlive destroy_process_group, and on some runs one of them
    # called std::terminate while the main thread was finalizing ("terminate called without
    # an active exception", SIGABRT after a clean "done"); torchrun then restarted the
    # finished group or waited in its exit barrier. Everything written is flushed first.
    exit_now(main())
