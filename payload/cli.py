"""train.py's command line: every option with its check, one clear message per bad value."""

from __future__ import annotations

import argparse
import math
import os
import re

import torch

from model import PRESETS


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
