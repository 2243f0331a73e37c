"""train.py's configuration: every option, its type, default and help, declared once.

`TrainConfig` is what a run is given; cli.py builds the command line from its fields (the flag
is the field's name with dashes: `seq_len` is `--seq-len`) and fills one from argv. A field's
`metadata` holds what the command line needs: its group, help, value check (`parse`), choices,
metavar; a bool field is a flag that sets it (store_true); help is argparse's text (% is
written %%). Frozen: nothing in a run changes its configuration, so what the config line and
the checkpoint record is what the run used. seq_len and lr default to the preset's, filled in
when the config is made (TrainConfig(preset="gpt2").seq_len is 1024).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field

from global_batch import DEFAULT_MICRO_BATCH
from model import ATTENTION_KERNELS, CE_KERNELS, PRESETS

# ---- value checks: each an argparse type, one clear message per bad value -------------------


def _number(convert, ok, what):
    """A value convert(s) for which ok holds, else one clear message."""
    def parse(s):
        try:
            v = convert(s)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return parse


pos_int = _number(int, lambda v: v >= 1, "a positive integer")
nonneg_int = _number(int, lambda v: v >= 0, "a non-negative integer")
pos_float = _number(float, lambda v: v > 0 and not math.isinf(v), "a positive number")
nonneg_float = _number(float, lambda v: v >= 0 and not math.isinf(v), "a non-negative number")


def step_range(s):
    """A:B with 1 <= A <= B, normalised to "A:B"."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", s)
    if not m or int(m.group(1)) > int(m.group(2)) or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B, got {s!r}")
    return f"{int(m.group(1))}:{int(m.group(2))}"


# ---- the options -------------------------------------------------------------------------------


def _group(name):
    """A field maker for the options of one --help group."""
    def option(default, help=None, parse=None, **cli):
        return field(default=default, metadata=dict(group=name, help=help, parse=parse, **cli))
    return option


_model = _group("model and data")
_batch = _group("batch and schedule")
_device = _group("device and speed")
_eval = _group("evaluation (token folders)")
_ckpt = _group("checkpoints")
_output = _group("output")
_search = _group("batch-size search")


@dataclass(frozen=True)
class TrainConfig:
    """One run's options (the command line's, cli.py)."""

    # model and data
    preset: str = _model("tiny", "model size: tiny (CPU demo), small, gpt2 (GPT-2 124M)",
                         choices=sorted(PRESETS))
    seq_len: int | None = _model(None, "tokens per sample (default: preset's, tiny 64, gpt2 1024)",
                                 pos_int)
    data: str | None = _model(
        None, "a token folder (train.bin, val.bin, meta.json: prepare_data.py; the model's "
              "vocabulary is meta.json's) or a byte-level text file (default: $TORCHRIG_DATA "
              "when set, which `torchrig launch --data NAME` sets, else the synthetic task)",
        metavar="DIR|FILE")
    synthetic_samples: int = _model(8192, "size of the synthetic data set", pos_int)
    dropout: float = _model(0.0, "dropout probability", nonneg_float)
    # batch and schedule
    batch_size: int = _batch(DEFAULT_MICRO_BATCH, "per-GPU micro-batch (samples)", pos_int)
    grad_accum: int = _batch(1, "micro-batches per optimizer step", pos_int)
    global_batch: int | None = _batch(
        None, "samples per optimizer step over all ranks, the same at every world size: the "
              "micro-batches per step are derived from it at every (re)start (global batch = "
              "--batch-size x world size x micro-batches); instead of --grad-accum", pos_int,
        metavar="G")
    lr: float | None = _batch(
        None, "peak learning rate for a global batch of --lr-ref-batch, scaled linearly with "
              "the real global batch (default: preset's: tiny 1e-2, small 3e-3, gpt2 1e-4)",
        pos_float)
    lr_ref_batch: int = _batch(32, "the global batch --lr is given for", pos_int)
    min_lr_ratio: float = _batch(0.1, "the learning rate at the end of the cosine decay, as a "
                                      "fraction of the peak (<= 1)", nonneg_float)
    warmup_steps: int | None = _batch(None, "linear warmup steps (default: 5%% of the run, at "
                                            "most 200)", nonneg_int)
    weight_decay: float = _batch(0.1, "AdamW weight decay (matrices only)", nonneg_float)
    clip: float = _batch(1.0, "grad-norm clip (0: off)", nonneg_float)
    max_steps: int | None = _batch(None, "stop after this many steps", pos_int)
    epochs: int | None = _batch(None, "passes over the data (default 1 unless --max-steps is "
                                      "given)", pos_int)
    seed: int = _batch(1337, "seed of the model's init, the data order and every rank's RNG",
                       nonneg_int)
    # device and speed
    device: str = _device("auto", "auto: CUDA when available", choices=["auto", "cpu", "cuda"])
    precision: str = _device("auto", "auto: bf16 on sm80+ GPUs (A100, H100), fp16+GradScaler on "
                                     "older ones (V100, T4); fp32 on CPU",
                             choices=["auto", "fp32", "bf16", "fp16"])
    compile: bool = _device(False, "torch.compile the model")
    compile_mode: str = _device("default", "torch.compile's mode, with --compile (reduce-overhead: "
                                           "CUDA graphs)",
                                choices=["default", "reduce-overhead", "max-autotune",
                                         "max-autotune-no-cudagraphs"])
    compile_tune: bool = _device(False, "with --compile: Inductor times launch settings of its "
                                        "own kernels and keeps the fastest (coordinate descent: "
                                        "max-autotune's part without its matmul search; a "
                                        "longer compile)")
    attention: str = _device("auto", "the attention kernel: auto (torch's choice) or that one "
                                     "alone (cudnn and efficient: CUDA only)",
                             choices=["auto", *ATTENTION_KERNELS])
    ce_chunks: int = _device(0, "cross-entropy in K chunks of the micro-batch's tokens, its "
                                "gradients made in the forward pass: the logits (tokens x "
                                "vocabulary) are held a chunk at a time (0: in one piece)",
                             nonneg_int, metavar="K")
    ce_kernel: str = _device("torch", "what makes the loss's logits gradient: torch (its "
                                      "operations) or triton: one kernel a token reads its "
                                      "logits twice and writes the gradient over them, in "
                                      "the forward pass (in one chunk unless --ce-chunks; "
                                      "CUDA, whose torch builds include triton)",
                             choices=list(CE_KERNELS))
    deterministic: bool = _device(False, "deterministic algorithms: resume reproduces an "
                                         "uninterrupted run")
    init_timeout: float = _device(600.0, "process-group init (and collective) timeout, seconds",
                                  pos_float)
    # evaluation
    eval_every: int = _eval(0, "steps between evaluations on val.bin (0: only at the end)",
                            nonneg_int, metavar="N")
    eval_batches: int = _eval(20, "batches of --batch-size windows each rank evaluates (0: no "
                                  "evaluation)", nonneg_int, metavar="N")
    # checkpoints
    ckpt_dir: str | None = _ckpt(None, "checkpoint folder (default: no checkpoints)")
    ckpt_every: int = _ckpt(0, "steps between checkpoints", nonneg_int)
    keep: int = _ckpt(3, "checkpoints kept", pos_int)
    no_resume: bool = _ckpt(False, "ignore existing checkpoints")
    # output
    log_every: int = _output(10, "steps between step lines", pos_int)
    out_json: str | None = _output(None, "rank 0 writes final metrics here")
    tensorboard: str | None = _output(None, "TensorBoard event folder (rank 0)", metavar="DIR")
    profile_steps: str | None = _output(None, "a torch.profiler trace of steps A to B, in "
                                              "--profile-dir", step_range, metavar="A:B")
    profile_dir: str | None = _output(None, "where the profiler's traces go")
    stop_after: int | None = _output(
        None, "testing: behave as if SIGTERM arrived during step S (checkpoint, exit 0); unlike "
              "--max-steps the LR schedule is unchanged", pos_int, metavar="S")
    dump_param_hash: bool = _output(False, "every rank prints a hash of its parameters at the end")
    dump_samples: str | None = _output(
        None, "testing: every rank appends the sample ids it trains on, a line per step, to "
              "DIR/samples.rank<R>", metavar="DIR")
    # batch-size search
    find_batch_size: bool = _search(False, "find the largest per-GPU batch that fits, print "
                                           "batch_size=N, exit")
    mem_budget_gb: float | None = _search(None, "memory budget for --find-batch-size (required "
                                                "on CPU)", pos_float)
    max_batch_size: int = _search(4096, "the largest batch --find-batch-size tries", pos_int)

    def __post_init__(self):
        for name in ("seq_len", "lr"):  # None: the preset's
            if getattr(self, name) is None:
                object.__setattr__(self, name, PRESETS[self.preset][name])
