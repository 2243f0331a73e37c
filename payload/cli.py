"""train.py's command line, built from TrainConfig's fields (config.py): one flag a field, and
the checks that involve more than one option, each with one clear message. --data defaults to
$TORCHRIG_DATA (what `torchrig launch --data NAME` sets) when set; the data it names is checked
here, before any process group: a bad one is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys

import torch

from config import TrainConfig
from data import DataError, TokenData
from global_batch import BatchError, grad_accum_for
from model import CUDA_ONLY_ATTENTION

DATA_ENV = "TORCHRIG_DATA"  # what `torchrig launch --data NAME` sets: the dataset's folder


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
    where = "--data"
    if cfg.data is None and os.environ.get(DATA_ENV):
        cfg, where = dataclasses.replace(cfg, data=os.environ[DATA_ENV]), f"{DATA_ENV} (--data)"
    try:
        check_data(cfg)
    except DataError as e:
        print_error(f"{where}: {e}")
        raise SystemExit(2) from None
    if cfg.eval_every and not (cfg.data and os.path.isdir(cfg.data)):
        parser.error("--eval-every needs a token folder (--data DIR; see prepare_data.py)")
    if cfg.profile_steps and not cfg.profile_dir:
        parser.error("--profile-steps needs --profile-dir")
    if cfg.ckpt_every and not cfg.ckpt_dir:
        parser.error("--ckpt-every needs --ckpt-dir")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if cfg.precision == "fp16" and not cuda:
        parser.error("--precision fp16 needs CUDA (use fp32 or bf16 on CPU)")
    if cfg.attention in CUDA_ONLY_ATTENTION and not cuda:
        parser.error(f"--attention {cfg.attention} needs CUDA (use auto, flash or math on CPU)")
    if cfg.ce_kernel == "triton":
        if not (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            parser.error("--ce-kernel triton needs CUDA (on CPU only under Triton's interpreter, "
                         "TRITON_INTERPRET=1: for tests)")
        if importlib.util.find_spec("triton") is None:
            parser.error("--ce-kernel triton needs the triton package in this python (CUDA "
                         "builds of torch install it; pip install triton)")
    if cfg.compile_mode != "default" and not cfg.compile:
        parser.error("--compile-mode needs --compile")
    if cfg.compile_tune and not cfg.compile:
        parser.error("--compile-tune needs --compile")
    if cfg.find_batch_size and not cuda and cfg.mem_budget_gb is None:
        parser.error("--find-batch-size on CPU needs --mem-budget-gb")
    if cfg.min_lr_ratio > 1:
        parser.error("--min-lr-ratio must be <= 1")
    if cfg.global_batch is not None:
        if cfg.grad_accum != 1:
            parser.error("--global-batch derives the micro-batches per step from the world size: "
                         "drop --grad-accum")
        try:
            cfg = dataclasses.replace(cfg, grad_accum=grad_accum_for(
                cfg.global_batch, cfg.batch_size, world_size_from_env()))
        except BatchError as e:
            print_error(str(e))
            raise SystemExit(2) from None
    return cfg


def world_size_from_env(env=os.environ) -> int:
    """The world size this start runs at: torchrun's WORLD_SIZE, 1 without torchrun (as
    runtime.setup_distributed reads it)."""
    return int(env["WORLD_SIZE"]) if "RANK" in env and "WORLD_SIZE" in env else 1


def check_data(cfg: TrainConfig):
    """DataError unless cfg.data (when given) is a token folder the run can read or a byte-level
    text file longer than --seq-len."""
    if cfg.data is None:
        return
    if os.path.isdir(cfg.data):
        TokenData(cfg.data, cfg.seq_len)
    elif not os.path.isfile(cfg.data):
        raise DataError(f"{cfg.data}: no such file or folder (a token folder from "
                        "prepare_data.py, or a text file)")
    elif os.path.getsize(cfg.data) <= cfg.seq_len:
        raise DataError(f"{cfg.data}: file too small for --seq-len {cfg.seq_len}")


def print_error(message: str):
    """`train.py: error: MESSAGE`, one line on stderr. Every rank that fails prints it: torchrun
    ends a group's other ranks as soon as one exits, and `torchrig logs --failures` shows
    the failed rank's own last lines."""
    sys.stderr.write(f"train.py: error: {message}\n")
    sys.stderr.flush()
