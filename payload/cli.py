"""train.py's command line, built from TrainConfig's fields (config.py): one flag a field, and
the checks that involve more than one option, each with one clear message."""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from config import TrainConfig


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
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    if cfg.data is not None and not os.path.isfile(cfg.data):
        parser.error(f"--data: no such file: {cfg.data}")
    if cfg.data is not None and os.path.getsize(cfg.data) <= cfg.seq_len:
        parser.error(f"--data: file too small for --seq-len {cfg.seq_len}")
    if cfg.profile_steps and not cfg.profile_dir:
        parser.error("--profile-steps needs --profile-dir")
    if cfg.ckpt_every and not cfg.ckpt_dir:
        parser.error("--ckpt-every needs --ckpt-dir")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if cfg.precision == "fp16" and not cuda:
        parser.error("--precision fp16 needs CUDA (use fp32 or bf16 on CPU)")
    if cfg.find_batch_size and not cuda and cfg.mem_budget_gb is None:
        parser.error("--find-batch-size on CPU needs --mem-budget-gb")
    if cfg.min_lr_ratio > 1:
        parser.error("--min-lr-ratio must be <= 1")
    return cfg
