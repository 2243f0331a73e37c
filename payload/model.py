"""The model: a GPT-2 style decoder (after nanoGPT), its size presets, and the FLOPs figures
behind MFU (training FLOPs per token, the GPUs' dense peaks). Depends on torch only (and
ce_kernel.py, which imports triton, for --ce-kernel triton)."""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 256
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    ce_chunks: int = 0  # cross-entropy in this many chunks (ChunkedLinearCE); 0: in one piece
    ce_kernel: str = "torch"  # CE_KERNELS: "triton" trains through ChunkedLinearCE (1 chunk or more)


# Byte-level data uses token ids 0..255. The gpt2 preset keeps GPT-2's (padded) vocabulary
# so that the model is GPT-2 124M exactly; the unused embedding rows simply never fire.
PRESETS: dict[str, dict] = {
    # lr: default peak learning rate per --lr-ref-batch (32) samples, scaled linearly.
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=256, seq_len=64, lr=1e-2),
    "small": dict(n_layer=6, n_head=6, n_embd=384, vocab_size=256, seq_len=256, lr=3e-3),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, seq_len=1024, lr=1e-4),
}


# --attention: which kernel F.scaled_dot_product_attention runs. "auto" leaves torch's choice
# (cuDNN's on an H200 with torch 2.11, as its profile showed); the others enable that backend
# alone, so a kernel that cannot run the shapes fails loudly instead of falling back. The
# enable_*_sdp switches are global and are read when a call picks its kernel, also while
# torch.compile traces the model.
ATTENTION_KERNELS = {
    "flash": "enable_flash_sdp",
    "cudnn": "enable_cudnn_sdp",
    "efficient": "enable_mem_efficient_sdp",
    "math": "enable_math_sdp",
}
CUDA_ONLY_ATTENTION = ("cudnn", "efficient")


# --ce-kernel: what makes the training loss's logits gradient. "torch": torch's operations
# (Inductor's kernels under --compile); "triton": ce_kernel.py's one kernel, through
# ChunkedLinearCE (in one chunk unless --ce-chunks says more).
CE_KERNELS = ("torch", "triton")


def use_ce_kernel(kind: str):
    """Register `kind`'s op before a model that uses it runs (importing ce_kernel imports
    triton, which a torch without CUDA may lack: only when asked)."""
    if kind == "triton":
        importlib.import_module("ce_kernel")  # registers torch.ops.torchrig.ce_rows_


def use_attention(kind: str):
    """Make `kind` (ATTENTION_KERNELS, or "auto") the only SDPA kernel allowed."""
    if kind == "auto":
        return
    for name, switch in ATTENTION_KERNELS.items():
        getattr(torch.backends.cuda, switch)(name == kind)


def chunked_ce(h, weight, targets, rows: int, dtype: torch.dtype, grads: bool,
               kernel: str = "torch"):
    """Mean cross-entropy of `h @ weight.T` against `targets`, `rows` tokens at a time: (loss,
    grad_h, grad_w), the gradients made chunk by chunk when `grads` (None otherwise). The
    matmuls run in `dtype` (autocast's), the softmax and the sums in at least fp32. kernel, with
    grads: "torch" (torch's operations) or "triton", a chunk's loss and logits gradient in one
    kernel, written over its logits (ce_kernel.py; use_ce_kernel first registers its op)."""
    n = h.size(0)
    w = weight.to(dtype)
    acc = torch.promote_types(dtype, torch.float32)
    total = torch.zeros((), dtype=acc, device=h.device)
    grad_h = torch.empty(h.shape, dtype=dtype, device=h.device) if grads else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if grads else None
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, n, rows):
            hc, t = h[s:s + rows].to(dtype), targets[s:s + rows].unsqueeze(1)
            if grads and kernel == "triton":
                g = hc @ w.t()  # the logits; the kernel writes their gradient over them
                total += torch.ops.torchrig.ce_rows_(g, t.view(-1), 1.0 / n).sum()
            else:
                logits = (hc @ w.t()).to(acc)
                lse = torch.logsumexp(logits, dim=1, keepdim=True)
                total += (lse - logits.gather(1, t)).sum()
                if grads:
                    g = torch.exp(logits - lse)  # softmax; minus one at the target, over n: dloss/dlogits
                    g.scatter_add_(1, t, torch.full_like(lse, -1.0))
                    g = (g / n).to(dtype)
            if grads:
                grad_h[s:s + rows] = g @ w
                grad_w += (g.t() @ hc).to(acc)
    return total / n, grad_h, grad_w


class ChunkedLinearCE(torch.autograd.Function):
    """chunked_ce with both gradients made in the forward pass: the [tokens, vocab] logits and
    their gradient only ever exist one chunk at a time. In one piece, GPT-2's 50k vocabulary at
    batch 123 x 1024 held a 23.6 GiB logits gradient on an H200; in 16 chunks its peak fell
    from 76.7 to 49.5 GiB, at 2% of the speed. No FLOP is added (the backward only scales the
    saved gradients). Without gradients (evaluation), the model calls chunked_ce itself."""

    @staticmethod
    def forward(ctx, h, weight, targets, rows: int, dtype: torch.dtype, kernel: str = "torch"):
        loss, grad_h, grad_w = chunked_ce(h, weight, targets, rows, dtype, True, kernel)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h * grad_out).to(h_dtype), (grad_w * grad_out).to(w_dtype), None, None, None, \
            None


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
        h = self.transformer.ln_f(x)
        chunks = self.config.ce_chunks or (1 if self.config.ce_kernel == "triton" else 0)
        if targets is not None and chunks:
            # logits None: they are never held in full (ChunkedLinearCE). Chunks, not rows, are
            # the option: torch.compile traces each chunk, so its compile time grows with them.
            dev = h.device.type
            dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
            args = (h.view(B * T, -1), self.lm_head.weight, targets.view(-1),
                    -(-B * T // chunks), dtype)
            if torch.is_grad_enabled():
                return None, ChunkedLinearCE.apply(*args, self.config.ce_kernel)
            return None, chunked_ce(*args, grads=False)[0]
        logits = self.lm_head(h)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build_model(preset: str, seq_len: int, dropout: float = 0.0,
                vocab_size: int | None = None, ce_chunks: int = 0,
                ce_kernel: str = "torch") -> GPT:
    """The preset's GPT for seq_len tokens; vocab_size: the data's (a token folder's meta.json),
    None: the preset's; ce_chunks: the cross-entropy's chunks (0: in one piece); ce_kernel:
    CE_KERNELS."""
    use_ce_kernel(ce_kernel)
    p = PRESETS[preset]
    cfg = GPTConfig(
        block_size=seq_len,
        vocab_size=vocab_size or p["vocab_size"],
        n_layer=p["n_layer"],
        n_head=p["n_head"],
        n_embd=p["n_embd"],
        dropout=dropout,
        ce_chunks=ce_chunks,
        ce_kernel=ce_kernel,
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
