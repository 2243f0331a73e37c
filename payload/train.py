#!/usr/bin/env python3
"""torchrig training payload: a small GPT trained with DDP under torchrun.

Depends only on the Python standard library and torch. This file is the training: one step
(train_step) and the Trainer, which makes a run's parts in __init__ and runs them in run().
The parts live next to it: config.py (TrainConfig, every option) and cli.py (its command line),
model.py (the GPT), data.py (a token folder, whose format is token_format.py's and which
prepare_data.py makes; the synthetic task; a text file), optim.py (precision, optimizer, LR
schedule), checkpoint.py (the Checkpointer), step_metrics.py (the step line, --out-json,
TensorBoard, the profiler), runtime.py (distributed setup, the stop signal and agreement, the
progress writer), progress.py (the output lines), batch_search.py (--find-batch-size).

Launch (one node, 8 GPUs):
    torchrun --standalone --nproc-per-node 8 train.py --preset gpt2 --compile \
        --ckpt-dir /var/lib/torchrig/ckpt --ckpt-every 200

Without torchrun it runs as one process (world size 1, no process group).

Stable, machine-readable output (progress.py's lines; rank 0 unless noted):
    start rank=R local_rank=L host=H device=D device_name=NAME world_size=W backend=B pid=P (every rank)
    config preset=... params=... global_batch=... lr=... precision=... ... (lr BASE x GLOBAL/REF)
    world step=K world_size=N nodes=M global_batch=G micro_batch=B grad_accum=A [from=P]  (every start)
    resume step=S epoch=E ckpt=PATH
    WARNING: skipping unreadable checkpoint PATH: REASON
    step=40 loss=2.3456 lr=3.00e-04 tok/s=12345 samples/s=12.3 mfu=41.2% alloc=1.23GiB reserved=1.50GiB epoch=0
        (tok/s and samples/s: all ranks together, over the steps since the last line;
         mfu: per GPU, 6N+12LHQT FLOPs/token against the dense bf16/fp16 peak table; n/a if unknown)
    ckpt step=S path=PATH write_s=SECONDS
    eval step=S val_loss=L windows=W tokens=T          (a token folder: every --eval-every steps
        and at the end; W windows of --seq-len+1 tokens from val.bin, all ranks together)
    signal SIGTERM received: stopping after step S       (then a checkpoint at S, exit 0)
    done step=S loss=L ckpt=PATH
    done step=S ckpt=PATH (nothing to train: ...)       (resumed at or past the last step: exit 0)
    param_hash rank=R step=S sha256=HEX                              (every rank, --dump-param-hash)
    batch_size=N                                                       (--find-batch-size)
A value with a space or a quote is written as a JSON string (device_name="NVIDIA H100 80GB HBM3").
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

import progress
from batch_search import find_batch_size
from checkpoint import Checkpointer
from cli import parse_args, print_error
from config import TrainConfig
from data import DataError, TokenData, open_source, open_tokens
from model import build_model, device_peak_flops, flops_per_token, use_attention
from optim import (autocast_ctx, enable_tf32, lr_at, make_optimizer, make_scaler, resolve_precision,
                   scaled_lr)
from runtime import (DistCtx, StopAgreement, all_reduce_scalar, count_nodes, emit, exit_now,
                     finish_distributed, install_signal_handlers, log, param_hash, seed_everything,
                     set_deterministic, setup_distributed, write_json_atomic)
from step_metrics import StepMetrics, StepProfiler


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
        # a new step for --compile-mode reduce-overhead's CUDA graphs (their outputs may be
        # reused from here on); nothing otherwise
        torch.compiler.cudagraph_mark_step_begin()
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


def compiled(model, cfg: TrainConfig):
    """torch.compile of the model in --compile-mode; --compile-tune turns on max-autotune's
    coordinate descent alone (torch.compile takes a mode or options, not both; Inductor reads
    the setting as it makes each kernel, on the first steps)."""
    if cfg.compile_tune:
        import torch._inductor.config as inductor_config
        inductor_config.coordinate_descent_tuning = True
    return torch.compile(model, mode=cfg.compile_mode)


@dataclass(frozen=True)
class Plan:
    """The run's batch and schedule, from the config, the world size and this rank's share of
    the data."""
    global_batch: int  # samples per optimizer step, all ranks together
    tokens_per_step: int
    steps_per_epoch: int  # 0: the data holds less than one global batch
    total_steps: int
    warmup: int
    peak_lr: float  # --lr scaled from --lr-ref-batch to the global batch

    @classmethod
    def of(cls, cfg: TrainConfig, world_size: int, steps_per_epoch: int) -> Plan:
        """steps_per_epoch: the data's global batches (data.GlobalOrder)."""
        global_batch = cfg.batch_size * cfg.grad_accum * world_size
        epochs = cfg.epochs if cfg.epochs is not None else (None if cfg.max_steps else 1)
        total = int(min(cfg.max_steps or float("inf"),
                        epochs * steps_per_epoch if epochs else float("inf")))
        warmup = (cfg.warmup_steps if cfg.warmup_steps is not None
                  else max(1, min(200, total // 20)))
        return cls(global_batch, global_batch * cfg.seq_len, steps_per_epoch, total, warmup,
                   scaled_lr(cfg.lr, global_batch, cfg.lr_ref_batch))


@dataclass
class Position:
    """Where the run is (what a checkpoint records): optimizer steps taken, the epoch, and the
    steps taken in it."""
    steps_per_epoch: int
    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0

    def resume_point(self) -> tuple[int, int]:
        """(epoch, step in it) to continue from: after an epoch's last step, the next epoch."""
        if self.step_in_epoch >= self.steps_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.step_in_epoch


class Trainer:
    """One run. __init__ makes everything it holds; run() resumes, wraps the model (compile,
    DDP), loops over steps and finishes (last checkpoint, --out-json, the done line)."""

    def __init__(self, cfg: TrainConfig, ctx: DistCtx, tokens: TokenData | None = None):
        """tokens: cfg.data's token folder (data.open_tokens), None for other data."""
        dev = ctx.device
        self.cfg, self.ctx, self.dev = cfg, ctx, dev
        self.dev_name = device_name(dev)
        self.precision = resolve_precision(cfg.precision, dev)
        # The model: the same init on every rank (DDP also broadcasts rank 0's parameters).
        torch.manual_seed(cfg.seed)
        self.raw_model = build_model(cfg.preset, cfg.seq_len, cfg.dropout,
                                     tokens and tokens.vocab_size, cfg.ce_chunks,
                                     cfg.ce_kernel).to(dev)
        seed_everything(cfg.seed + ctx.rank)
        self.model = self.raw_model  # what steps run: run() compiles it and wraps it in DDP
        # One process has nothing to all-reduce: DDP would only add its bucket hooks, and under
        # --compile its graph splitter cuts the model into a graph per bucket.
        self.use_ddp = ctx.world_size > 1
        # The data in global batches, and the batch and schedule that follow.
        self.data = open_source(cfg, ctx.rank, ctx.world_size, dev.type == "cuda", tokens)
        self.plan = Plan.of(cfg, ctx.world_size, self.data.steps_per_epoch)
        # evaluation on val.bin: token folders only
        self.evals = cfg.eval_batches if tokens is not None else 0
        self.val_loss: float | None = None
        self.opt, self.opt_kind = make_optimizer(self.raw_model, self.plan.peak_lr,
                                                 cfg.weight_decay, dev)
        self.scaler = make_scaler(dev, self.precision)
        # Where the run is, and the parts that save it, measure it and stop it.
        self.pos = Position(self.plan.steps_per_epoch)
        self.ckpt = Checkpointer(ctx, cfg, self.raw_model, self.opt, self.scaler, self.pos)
        self.metrics = StepMetrics(ctx, self.plan.tokens_per_step, self.plan.global_batch,
                                   flops_per_token(self.raw_model, cfg.seq_len),
                                   device_peak_flops(self.dev_name) if dev.type == "cuda" else None)
        self.profiler = StepProfiler(ctx, cfg.profile_steps, cfg.profile_dir)
        self.stop = StopAgreement(ctx, cfg.stop_after)
        self.stopped_by: str | None = None  # once the ranks agreed to stop: why

    def run(self) -> int:
        """The exit status: 0 trained (or stopped, or nothing left to train), 2 too little data."""
        ctx, pos = self.ctx, self.pos
        if self.plan.steps_per_epoch < 1:
            log(ctx, f"error: data set of {self.data.samples} samples is smaller than one global "
                     f"batch ({self.plan.global_batch} samples)")
            return 2
        resumed = self.ckpt.resume()
        self.log_world()
        if pos.step >= self.plan.total_steps:  # e.g. restarted after the final checkpoint
            emit(ctx, "done", {"step": pos.step, "ckpt": resumed},
                 "(nothing to train: the checkpoint is at or past the last step)")
            return 0
        if self.cfg.compile:
            self.model = compiled(self.model, self.cfg)
        if self.use_ddp:
            self.model = DDP(self.model,
                             device_ids=[self.dev.index] if self.dev.type == "cuda" else None)
        self.log_config()
        self.metrics.begin(pos.step, self.cfg.tensorboard)
        self.loop()
        self.finish()
        return 0

    def loop(self):
        """Epochs of steps, until the last step or until the ranks agree to stop: then the
        signal line, and finish() writes the checkpoint."""
        cfg, pos, plan = self.cfg, self.pos, self.plan
        self.model.train()
        while pos.step < plan.total_steps and self.stopped_by is None:
            batches = self.data.batches(pos.step)
            while pos.step_in_epoch < plan.steps_per_epoch and pos.step < plan.total_steps:
                self.profiler.before_step(pos.step)
                t0 = time.perf_counter()
                loss_t, lr = self.train_one_step(batches)
                stop_all = self.check_stop(t0)
                self.profiler.after_step(pos.step)
                is_last = pos.step >= plan.total_steps or stop_all
                if pos.step % cfg.log_every == 0 or is_last:
                    self.metrics.log_step(pos.step, loss_t, lr, pos.epoch)
                if stop_all:
                    self.stopped_by = self.stop.reason()
                    emit(self.ctx, "signal", {},
                         f"{self.stopped_by} received: stopping after step {pos.step}")
                    break
                if self.eval_due(pos.step) and not is_last:
                    self.evaluate()
                if self.ckpt.due(pos.step) and not is_last:
                    self.ckpt.save()
            pos.epoch, pos.step_in_epoch = pos.resume_point()
        self.profiler.close()

    def train_one_step(self, batches):
        """One optimizer step at the schedule's learning rate: (loss tensor, lr)."""
        cfg, pos, plan = self.cfg, self.pos, self.plan
        micro = [next(batches) for _ in range(cfg.grad_accum)]
        if cfg.dump_samples:
            self.dump_samples(pos.step)
        lr = lr_at(pos.step, plan.peak_lr, plan.warmup, plan.total_steps, cfg.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss_t, _ = train_step(self.model, self.opt, micro, device=self.dev,
                               precision=self.precision, scaler=self.scaler, clip=cfg.clip)
        pos.step += 1
        pos.step_in_epoch += 1
        return loss_t, lr

    def dump_samples(self, step: int):
        """--dump-samples: the ids of this rank's samples of global step `step` (0-based: the
        data's index; its step line says step+1), a line appended to DIR/samples.rank<R>."""
        ids = [i for micro in self.data.rank_ids(step) for i in micro]
        os.makedirs(self.cfg.dump_samples, exist_ok=True)
        path = os.path.join(self.cfg.dump_samples, f"samples.rank{self.ctx.rank}")
        with open(path, "a") as f:
            f.write(f"step={step} world_size={self.ctx.world_size} rank={self.ctx.rank} "
                    f"ids={','.join(map(str, ids))}\n")

    def eval_due(self, step: int) -> bool:
        """Whether --eval-every asks for an evaluation after `step` (the last step always
        has one: finish())."""
        return bool(self.evals and self.cfg.eval_every) and step % self.cfg.eval_every == 0

    def evaluate(self):
        """The loss on val.bin, per token, over --eval-batches batches of every rank (the same
        windows each time), all-reduced; rank 0 prints the eval line. Collective. The
        unwrapped model runs it (no DDP, no compiled graph for eval mode), without gradients."""
        cfg, ctx, dev, model = self.cfg, self.ctx, self.dev, self.raw_model
        model.eval()
        total = torch.zeros((), device=dev)
        with torch.no_grad():
            for x, y in self.data.eval_batches(self.evals):
                with autocast_ctx(dev, self.precision):
                    _, loss = model(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))
                total += loss.float()
        model.train()
        # every rank evaluates as many tokens: the mean of the ranks' means is the mean per token
        self.val_loss = all_reduce_scalar(ctx, float(total) / self.evals, "sum") / ctx.world_size
        windows = self.evals * cfg.batch_size * ctx.world_size
        emit(ctx, "eval", {"step": self.pos.step, "val_loss": f"{self.val_loss:.4f}",
                           "windows": windows, "tokens": windows * cfg.seq_len})
        self.metrics.log_eval(self.pos.step, self.val_loss)

    def check_stop(self, t0: float) -> bool:
        """Whether the ranks agree to stop after this step, asked at check steps (the same on
        every rank: those the agreement schedules, and each that logs, checkpoints or is the
        last); then the step begun at t0 is timed: an interval's time is only real once a check
        drained the GPU queue."""
        step = self.pos.step
        check = (self.stop.due(step) or step >= self.plan.total_steps
                 or step % self.cfg.log_every == 0 or self.ckpt.due(step))
        stop_all = self.stop.agree(step) if check else False
        self.metrics.step_timed(time.perf_counter() - t0)
        if check:
            self.stop.interval_took(*self.metrics.close_interval())
        return stop_all

    def log_world(self):
        """The world line of this (re)start: the step it starts from, the world it runs in and
        the world size of the checkpoint it resumed from (from=, when that differs)."""
        cfg, plan = self.cfg, self.plan
        nodes = count_nodes(self.ctx)
        if self.ctx.is_main:
            progress.world(self.pos.step, self.ctx.world_size, nodes, plan.global_batch,
                           cfg.batch_size, cfg.grad_accum, previous=self.ckpt.resumed_world_size)

    def log_config(self):
        cfg, plan, m = self.cfg, self.plan, self.metrics
        emit(self.ctx, "config", {
            "preset": cfg.preset, "params": f"{self.raw_model.num_params() / 1e6:.2f}M",
            "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
            "world_size": self.ctx.world_size, "global_batch": plan.global_batch,
            "tokens_per_step": plan.tokens_per_step, "lr": f"{plan.peak_lr:.3e}",
            "warmup": plan.warmup, "total_steps": plan.total_steps,
            "steps_per_epoch": plan.steps_per_epoch, "precision": self.precision,
            "compile": cfg.compile and cfg.compile_mode, "attention": cfg.attention,
            "ce_chunks": cfg.ce_chunks, "ce_kernel": cfg.ce_kernel,
            "compile_tune": cfg.compile and cfg.compile_tune,
            "ddp": "on" if self.use_ddp else "off",
            "optimizer": f"adamw-{self.opt_kind}", "deterministic": cfg.deterministic,
            "data": cfg.data or "synthetic", "vocab_size": self.raw_model.config.vocab_size,
            "flops_per_token": f"{m.fpt:.3e}",
            "peak_flops": "n/a" if m.peak is None else f"{m.peak:.3g}"},
            f"(lr {cfg.lr:g} x {plan.global_batch}/{cfg.lr_ref_batch})")

    def finish(self):
        """The last checkpoint, the parameter hashes, --out-json and the done line."""
        cfg, ctx, pos = self.cfg, self.ctx, self.pos
        self.ckpt.save()
        if self.evals and self.stopped_by is None:
            self.evaluate()
        wall = time.perf_counter() - self.metrics.t_start
        if cfg.dump_param_hash:
            emit(ctx, "param_hash", {"rank": ctx.rank, "step": pos.step,
                                     "sha256": param_hash(self.raw_model)}, all_ranks=True)
        if not ctx.is_main:
            return
        if cfg.out_json:
            write_json_atomic(cfg.out_json, {
                **self.metrics.summary(pos.step),
                "params": self.raw_model.num_params(),
                "preset": cfg.preset,
                "seq_len": cfg.seq_len,
                "batch_size": cfg.batch_size,
                "grad_accum": cfg.grad_accum,
                "world_size": ctx.world_size,
                "global_batch": self.plan.global_batch,
                "peak_lr": self.plan.peak_lr,
                "precision": self.precision,
                "compile": cfg.compile,
                "compile_mode": cfg.compile_mode if cfg.compile else None,
                "attention": cfg.attention,
                "ce_chunks": cfg.ce_chunks,
                "ce_kernel": cfg.ce_kernel,
                "compile_tune": cfg.compile and cfg.compile_tune,
                "ddp": self.use_ddp,
                "optimizer": f"adamw-{self.opt_kind}",
                "device": str(self.dev),
                "device_name": self.dev_name,
                "backend": ctx.backend,
                "torch_version": str(torch.__version__),
                "resumed_from": self.ckpt.resumed_from,
                "stopped_by_signal": self.stopped_by,
                "checkpoint": self.ckpt.last_path,
                "val_loss": self.val_loss,
                "wall_s": wall,
            })
        self.metrics.close()
        emit(ctx, "done", {"step": pos.step, "loss": self.metrics.loss_text(),
                           "ckpt": self.ckpt.last_path or "none"})


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def run(cfg: TrainConfig, ctx: DistCtx) -> int:
    """This rank's start line, then --find-batch-size's search or the training."""
    emit(ctx, "start", {"rank": ctx.rank, "local_rank": ctx.local_rank,
                        "host": socket.gethostname(), "device": ctx.device,
                        "device_name": device_name(ctx.device), "world_size": ctx.world_size,
                        "backend": ctx.backend, "pid": os.getpid()}, all_ranks=True)
    if ctx.device.type == "cuda":
        enable_tf32()
    use_attention(cfg.attention)
    seed_everything(cfg.seed + ctx.rank)
    tokens = open_tokens(cfg)
    if cfg.find_batch_size:
        n = find_batch_size(cfg, ctx, train_step, tokens and tokens.vocab_size)
        emit(ctx, "batch_size", {"batch_size": n})
        return 0 if n > 0 else 1
    return Trainer(cfg, ctx, tokens).run()


def train(cfg: TrainConfig) -> int:
    install_signal_handlers()
    if cfg.deterministic:
        set_deterministic()
    ctx = setup_distributed(cfg.device, cfg.init_timeout)
    try:
        rc = run(cfg, ctx)
    except BaseException:
        # A failing rank leaves at once: its peers may be gone, so no barrier. torchrun sees
        # the exit status and restarts (or ends) the whole group either way.
        if ctx.initialized and dist.is_initialized():
            dist.destroy_process_group()
        raise
    finish_distributed(ctx)
    return rc


@record
def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        return train(cfg)
    except DataError as e:  # found while training (an id past meta.json's vocab_size)
        print_error(str(e))
        return 2


if __name__ == "__main__":
    # A finished worker exits with os._exit, not through interpreter finalization: the process
    # group's C++ threads (gloo's workers, which take the GIL to free tensors Python dropped,
    # and its connection loop) outlive destroy_process_group, and on some runs one of them
    # called std::terminate while the main thread was finalizing ("terminate called without
    # an active exception", SIGABRT after a clean "done"); torchrun then restarted the
    # finished group or waited in its exit barrier. Everything written is flushed first.
    # @record turns a SystemExit(0) (--help) into a return of None.
    rc = main()
    exit_now(0 if rc is None else rc)
