"""The model: a GPT-2 style decoder (after nanoGPT), its size presets, and the FLOPs figures
behind MFU (training FLOPs per token, the GPUs' dense peaks). Depends on torch only."""

from __future__ import annotations

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


def build_model(preset: str, seq_len: int, dropout: float = 0.0,
                vocab_size: int | None = None) -> GPT:
    """The preset's GPT for seq_len tokens; vocab_size: the data's (a token folder's meta.json),
    None: the preset's."""
    p = PRESETS[preset]
    cfg = GPTConfig(
        block_size=seq_len,
        vocab_size=vocab_size or p["vocab_size"],
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
