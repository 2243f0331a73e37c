"""What a training step is made of: numeric precision (TF32, autocast, the GradScaler), the AdamW
optimizer and the learning-rate schedule (linear warmup, cosine decay, the LR scaled with the
global batch)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn


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
