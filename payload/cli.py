"""train.py's command line, built from TrainConfig's fields (config.py): one flag a field, and
the checks that involve more than one option, each with one clear message."""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from config import TrainConfig
from model import PRESETS


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="torchrig payload: GPT training with DDP (launch with torchrun, or alone).",
    )
    groups = {}
    for f in dataclasses.fields(TrainConfig):
        meta = dict(f.metadata)
        group = meta.pop("group")
        if group not in groups:
            groups[group] = p.add_argument_group(group)
        kw = {k: v for k, v in meta.items() if v is not None}
        if f.default is False:
            kw["action"] = "store_true"
        else:
            kw["default"] = f.default
        if "parse" in kw:
            kw["type"] = kw.pop("parse")
        groups[group].add_argument(flag(f.name), **kw)
    return p


def parse_args(argv=None) -> TrainConfig:
    """The run's configuration from argv; a bad value or combination exits 2 with one message."""
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
    return TrainConfig(**vars(args))
