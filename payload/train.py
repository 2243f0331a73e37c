#!/usr/bin/env python3
"""torchrig training payload: a small GPT trained with DDP under torchrun.

Depends only on the Python standard library and torch. The files next to it: model.py (the
GPT), data.py, runtime.py (distributed setup, stop signal, checkpoints, progress writer),
progress.py (the output lines), cli.py (the options), batch_search.py (--find-batch-size).
This file is the training: precision, optimizer and schedule, one step, and the Trainer.

Launch (one node, 8 GPUs):
    torchrun --standalone --nproc-per-node 8 train.py --preset gpt2 --compile \
        --ckpt-dir /var/lib/torchrig/ckpt --ckpt-every 200

Without torchrun it runs as one process (world size 1, no process group).

Stable, machine-readable output (progress.py's lines; rank 0 unless noted):
    start rank=R local_rank=L host=H device=D device_name=NAME world_size=W backend=B pid=P (every rank)
    config preset=... params=... global_batch=... lr=... precision=... ... (lr BASE x GLOBAL/REF)
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
A value with a space or a quote is written as a JSON string (device_name="NVIDIA H100 80GB HBM3").
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

import progress
from batch_search import find_batch_size
from cli import parse_args
from data import ByteFileDataset, SyntheticCopyDataset, iterate_batches
from model import build_model, device_peak_flops, flops_per_token
from optim import (autocast_ctx, enable_tf32, lr_at, make_optimizer, make_scaler, resolve_precision,
                   scaled_lr)
from runtime import (CheckpointManager, DistCtx, agree_stop, all_reduce_scalar, capture_rng, emit,
                     exit_now, finish_distributed, install_signal_handlers, log, param_hash,
                     peak_mem, restore_rng, seed_everything, set_deterministic, setup_distributed,
                     steps_to_next_check, stop_requested, stopped_by, write_json_atomic)

# --------------------------------------------------------------------------------------
# The training step
# --------------------------------------------------------------------------------------


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



def fmt_step_line(step, loss, lr, tok_s, samples_s, mfu, mem: dict[str, float], epoch) -> str:
    fields = {"step": step, "loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tok_s:.0f}",
              "samples/s": f"{samples_s:.1f}", "mfu": "n/a" if mfu is None else f"{mfu * 100:.1f}%"}
    fields.update({k: f"{v:.2f}GiB" for k, v in mem.items()})
    fields["epoch"] = epoch
    return progress.format_line("step", fields)


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


class Trainer:
    """One run, in named steps: setup (model, data, optimizer), resume, wrap (compile, DDP),
    then the loop of train_one_step / check_stop / log_progress / checkpoint, and finish."""

    def __init__(self, args, ctx: DistCtx):
        self.args, self.ctx, self.dev = args, ctx, ctx.device
        self.dev_name = torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu"
        self.ckpts = CheckpointManager(ctx, args.ckpt_dir, args.keep)

    def run(self) -> int:
        args, ctx = self.args, self.ctx
        emit(ctx, "start", {"rank": ctx.rank, "local_rank": ctx.local_rank,
                            "host": socket.gethostname(), "device": self.dev,
                            "device_name": self.dev_name, "world_size": ctx.world_size,
                            "backend": ctx.backend, "pid": os.getpid()}, all_ranks=True)
        if self.dev.type == "cuda":
            enable_tf32()
        seed_everything(args.seed + ctx.rank)
        if args.find_batch_size:
            n = find_batch_size(args, ctx, train_step)
            emit(ctx, "batch_size", {"batch_size": n})
            return 0 if n > 0 else 1
        self.setup_model()
        if not self.setup_data():
            return 2
        self.setup_optimizer()
        self.resume()
        if self.step >= self.total_steps:  # e.g. restarted after the final checkpoint
            emit(ctx, "done", {"step": self.step, "ckpt": self.resumed_from},
                 "(nothing to train: the checkpoint is at or past the last step)")
            return 0
        self.wrap_model()
        self.log_config()
        self.loop()
        self.finish()
        return 0

    # ---- setup ----------------------------------------------------------------------

    def setup_model(self):
        """Same init on every rank (DDP also broadcasts rank 0's parameters)."""
        args, dev = self.args, self.dev
        self.precision = resolve_precision(args.precision, dev)
        torch.manual_seed(args.seed)
        self.raw_model = build_model(args.preset, args.seq_len, args.dropout).to(dev)
        seed_everything(args.seed + self.ctx.rank)
        self.n_params = self.raw_model.num_params()
        self.fpt = flops_per_token(self.raw_model, args.seq_len)
        self.peak = device_peak_flops(self.dev_name) if dev.type == "cuda" else None

    def setup_data(self) -> bool:
        args, ctx = self.args, self.ctx
        if args.data:
            self.dataset = ByteFileDataset(args.data, args.seq_len)
        else:
            self.dataset = SyntheticCopyDataset(args.synthetic_samples, args.seq_len, seed=args.seed)
        self.sampler = DistributedSampler(self.dataset, num_replicas=ctx.world_size, rank=ctx.rank,
                                          shuffle=True, seed=args.seed, drop_last=True)
        micro_per_epoch = len(self.sampler) // args.batch_size
        self.steps_per_epoch = micro_per_epoch // args.grad_accum
        self.global_batch = args.batch_size * args.grad_accum * ctx.world_size
        if self.steps_per_epoch < 1:
            log(ctx, f"error: data set of {len(self.dataset)} samples is smaller than one global "
                     f"batch ({self.global_batch} samples)")
            return False
        epochs = args.epochs if args.epochs is not None else (None if args.max_steps else 1)
        self.total_steps = int(min(args.max_steps or float("inf"),
                                   epochs * self.steps_per_epoch if epochs else float("inf")))
        self.warmup = (args.warmup_steps if args.warmup_steps is not None
                       else max(1, min(200, self.total_steps // 20)))
        self.peak_lr = scaled_lr(args.lr, self.global_batch, args.lr_ref_batch)
        self.tokens_per_step = self.global_batch * args.seq_len
        return True

    def setup_optimizer(self):
        self.opt, self.opt_kind = make_optimizer(self.raw_model, self.peak_lr,
                                                 self.args.weight_decay, self.dev)
        self.scaler = make_scaler(self.dev, self.precision)

    def resume(self):
        """From the newest loadable checkpoint: weights, optimizer, scaler, step, data position
        and every rank's RNG state."""
        args, ctx = self.args, self.ctx
        self.step, self.epoch, self.step_in_epoch, self.resumed_from = 0, 0, 0, None
        self.last_ckpt = {"step": None, "path": None}
        if not args.ckpt_dir or args.no_resume:
            return
        path, state = self.ckpts.load_latest()
        if state is None:
            return
        self.raw_model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        data = state.get("data", {})
        self.epoch = int(data.get("epoch", state.get("epoch", 0)))
        self.step_in_epoch = int(data.get("step_in_epoch", 0))
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        rngs = state.get("rng") or []
        if len(rngs) == ctx.world_size:
            restore_rng(rngs[ctx.rank], self.dev)
        else:
            seed_everything(args.seed + ctx.rank + self.step)
        self.resumed_from = path
        self.last_ckpt = {"step": self.step, "path": path}
        emit(ctx, "resume", {"step": self.step, "epoch": self.epoch, "ckpt": path})

    def wrap_model(self):
        args, ctx = self.args, self.ctx
        model = self.raw_model
        if args.compile:
            model = torch.compile(model)
        # One process has nothing to all-reduce: DDP would only add its bucket hooks, and under
        # --compile its graph splitter cuts the model into a graph per bucket.
        self.use_ddp = ctx.world_size > 1
        if self.use_ddp:
            model = DDP(model, device_ids=[self.dev.index] if self.dev.type == "cuda" else None)
        self.model = model

    def log_config(self):
        args, ctx, peak = self.args, self.ctx, self.peak
        emit(ctx, "config", {
            "preset": args.preset, "params": f"{self.n_params / 1e6:.2f}M", "seq_len": args.seq_len,
            "batch_size": args.batch_size, "grad_accum": args.grad_accum,
            "world_size": ctx.world_size, "global_batch": self.global_batch,
            "tokens_per_step": self.tokens_per_step, "lr": f"{self.peak_lr:.3e}",
            "warmup": self.warmup, "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch, "precision": self.precision,
            "compile": args.compile, "ddp": "on" if self.use_ddp else "off",
            "optimizer": f"adamw-{self.opt_kind}", "deterministic": args.deterministic,
            "data": args.data or "synthetic", "flops_per_token": f"{self.fpt:.3e}",
            "peak_flops": "n/a" if peak is None else f"{peak:.3g}"},
            f"(lr {args.lr:g} x {self.global_batch}/{args.lr_ref_batch})")
        self.tb = None
        if args.tensorboard and ctx.is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(args.tensorboard)
            except Exception as e:  # ImportError, or tensorboard missing behind torch's shim
                log(ctx, f"WARNING: --tensorboard ignored: tensorboard is not importable ({e}); "
                         f"pip install tensorboard")

    # ---- the loop -------------------------------------------------------------------

    def loop(self):
        args, dev = self.args, self.dev
        self.prof_range = (tuple(int(v) for v in args.profile_steps.split(":"))
                           if args.profile_steps else None)
        self.prof = None
        self.step_times: list[float] = []  # time per step, one per interval between stop checks
        self.losses: list[tuple[int, float]] = []
        self.last_loss = float("nan")
        self.window_time, self.window_steps = 0.0, 0  # summed step times: no checkpoint writes
        self.interval_time, self.interval_steps = 0.0, 0  # since the last stop check
        self.next_check, self.check_every = self.step + 1, 1
        self.stopped_by = None
        self.start_step = self.step
        self.t_start = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        self.model.train()
        while self.step < self.total_steps and self.stopped_by is None:
            self.sampler.set_epoch(self.epoch)
            batches = iterate_batches(self.dataset, list(iter(self.sampler)), args.batch_size,
                                      skip_batches=self.step_in_epoch * args.grad_accum,
                                      pin=dev.type == "cuda")
            while self.step_in_epoch < self.steps_per_epoch and self.step < self.total_steps:
                self.profile_start()
                t0 = time.perf_counter()
                loss_t, lr = self.train_one_step(batches)
                stop_all = self.check_stop(t0)
                self.profile_stop()
                is_last = self.step >= self.total_steps or stop_all
                if self.step % args.log_every == 0 or is_last:
                    self.log_progress(loss_t, lr)
                if stop_all:
                    self.stopped_by = stopped_by() or ("stop-after" if args.stop_after else "peer")
                    emit(self.ctx, "signal", {},
                         f"{self.stopped_by} received: stopping after step {self.step}")
                    break
                if args.ckpt_every and self.step % args.ckpt_every == 0 and not is_last:
                    self.checkpoint()
            if self.step_in_epoch >= self.steps_per_epoch:
                self.epoch, self.step_in_epoch = self.epoch + 1, 0
        if self.prof is not None:
            self.prof.__exit__(None, None, None)

    def train_one_step(self, batches):
        """One optimizer step at the schedule's learning rate: (loss tensor, lr)."""
        args = self.args
        micro = [next(batches) for _ in range(args.grad_accum)]
        lr = lr_at(self.step, self.peak_lr, self.warmup, self.total_steps, args.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss_t, _ = train_step(self.model, self.opt, micro, device=self.dev,
                               precision=self.precision, scaler=self.scaler, clip=args.clip)
        self.step += 1
        self.step_in_epoch += 1
        return loss_t, lr

    def check_stop(self, t0: float) -> bool:
        """At check steps (the same on every rank), whether the ranks agree to stop; also times
        the step begun at t0: an interval's time is only real once a check drained the GPU queue."""
        args, ctx, step = self.args, self.ctx, self.step
        check = (step >= self.next_check or step >= self.total_steps or step % args.log_every == 0
                 or (args.ckpt_every and step % args.ckpt_every == 0) or step == args.stop_after)
        stop_all = False
        if check:
            stop_local = stop_requested() or (args.stop_after is not None and step >= args.stop_after)
            stop_all, every = agree_stop(ctx, stop_local, self.check_every)
            if not ctx.initialized and self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)
        dt = time.perf_counter() - t0
        self.window_steps += 1
        self.window_time += dt
        self.interval_steps += 1
        self.interval_time += dt
        if check:
            self.step_times.append(self.interval_time / self.interval_steps)
            self.check_every = steps_to_next_check(self.interval_time, self.interval_steps)
            self.next_check = step + every
            self.interval_time, self.interval_steps = 0.0, 0
        return stop_all

    def log_progress(self, loss_t, lr):
        """The step line: the loss averaged over ranks, throughput since the last line."""
        ctx = self.ctx
        loss_v = all_reduce_scalar(ctx, float(loss_t.item()), "sum") / ctx.world_size
        self.last_loss = loss_v
        self.losses.append((self.step, loss_v))
        el = max(self.window_time, 1e-9)
        tok_s = self.window_steps * self.tokens_per_step / el
        sam_s = self.window_steps * self.global_batch / el
        mfu = (self.fpt * tok_s / ctx.world_size / self.peak) if self.peak else None
        log(ctx, fmt_step_line(self.step, loss_v, lr, tok_s, sam_s, mfu, peak_mem(self.dev),
                               self.epoch))
        if self.tb is not None:
            self.tb.add_scalar("train/loss", loss_v, self.step)
            self.tb.add_scalar("train/lr", lr, self.step)
            self.tb.add_scalar("perf/tokens_per_s", tok_s, self.step)
            if mfu is not None:
                self.tb.add_scalar("perf/mfu", mfu, self.step)
        self.window_time, self.window_steps = 0.0, 0

    def profile_start(self):
        r = self.prof_range
        if r and self.ctx.is_main and self.prof is None and self.step + 1 == r[0]:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.dev.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self.prof.__enter__()

    def profile_stop(self):
        r = self.prof_range
        if self.prof is not None and self.step == r[1]:
            self.prof.__exit__(None, None, None)
            os.makedirs(self.args.profile_dir, exist_ok=True)
            trace = os.path.join(self.args.profile_dir, f"trace_rank{self.ctx.rank}_steps{r[0]}-{r[1]}.json")
            self.prof.export_chrome_trace(trace)
            log(self.ctx, f"profile steps={r[0]}:{r[1]} trace={trace}")
            self.prof, self.prof_range = None, None

    # ---- checkpoints and the end ----------------------------------------------------

    def state(self) -> dict | None:
        """The checkpoint's content on rank 0 (None elsewhere); collective: every rank's RNG
        state is gathered."""
        args, ctx = self.args, self.ctx
        ep, sie = self.epoch, self.step_in_epoch
        if sie >= self.steps_per_epoch:
            ep, sie = ep + 1, 0
        rng = capture_rng(self.dev)
        if ctx.initialized:
            gathered = [None] * ctx.world_size if ctx.is_main else None
            dist.gather_object(rng, gathered, dst=0)
            rngs = gathered
        else:
            rngs = [rng]
        if not ctx.is_main:
            return None
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.step,
            "epoch": ep,
            "data": {"epoch": ep, "step_in_epoch": sie, "sampler_seed": args.seed,
                     "world_size": ctx.world_size, "batch_size": args.batch_size,
                     "grad_accum": args.grad_accum},
            "rng": rngs,
            "config": {k: (v if v is None or isinstance(v, (bool, int, float)) else str(v))
                       for k, v in vars(args).items()},
            "model_config": asdict(self.raw_model.config),
            "world_size": ctx.world_size,
            "torch_version": str(torch.__version__),  # TorchVersion is not weights_only-safe
        }

    def checkpoint(self):
        if not self.args.ckpt_dir or self.last_ckpt["step"] == self.step:
            return
        path = self.ckpts.save(self.step, self.state())
        if self.ctx.is_main:
            self.last_ckpt["path"] = path
        self.last_ckpt["step"] = self.step

    def finish(self):
        """The last checkpoint, the parameter hashes, --out-json and the done line."""
        args, ctx, dev = self.args, self.ctx, self.dev
        if args.ckpt_dir:
            self.checkpoint()
        wall = time.perf_counter() - self.t_start
        if args.dump_param_hash:
            emit(ctx, "param_hash", {"rank": ctx.rank, "step": self.step,
                                     "sha256": param_hash(self.raw_model)}, all_ranks=True)
        if not ctx.is_main:
            return
        times = self.step_times
        skip = max(1, len(times) // 10) if len(times) > 1 else 0
        steady = times[skip:] or times
        med_dt = statistics.median(steady) if steady else None
        tok_s_med = self.tokens_per_step / med_dt if med_dt else None
        mfu_med = (self.fpt * tok_s_med / ctx.world_size / self.peak) if (self.peak and tok_s_med) else None
        if args.out_json:
            mem_end = peak_mem(dev)
            write_json_atomic(args.out_json, {
                "steps": self.step,
                "steps_run": self.step - self.start_step,
                "start_step": self.start_step,
                "final_loss": None if math.isnan(self.last_loss) else self.last_loss,
                "losses": self.losses,
                "tokens_per_s_median": tok_s_med,
                "samples_per_s_median": (self.global_batch / med_dt) if med_dt else None,
                "step_time_s_median": med_dt,
                "mfu_median": mfu_med,
                "flops_per_token": self.fpt,
                "peak_flops": self.peak,
                "peak_mem_gib": mem_end.get("alloc", mem_end.get("rss")),
                "peak_mem_reserved_gib": mem_end.get("reserved"),
                "params": self.n_params,
                "preset": args.preset,
                "seq_len": args.seq_len,
                "batch_size": args.batch_size,
                "grad_accum": args.grad_accum,
                "world_size": ctx.world_size,
                "global_batch": self.global_batch,
                "peak_lr": self.peak_lr,
                "precision": self.precision,
                "compile": args.compile,
                "ddp": self.use_ddp,
                "optimizer": f"adamw-{self.opt_kind}",
                "device": str(dev),
                "device_name": self.dev_name,
                "backend": ctx.backend,
                "torch_version": str(torch.__version__),
                "resumed_from": self.resumed_from,
                "stopped_by_signal": self.stopped_by,
                "checkpoint": self.last_ckpt["path"],
                "wall_s": wall,
            })
        if self.tb is not None:
            self.tb.close()
        loss_s = "nan" if math.isnan(self.last_loss) else f"{self.last_loss:.4f}"
        emit(ctx, "done", {"step": self.step, "loss": loss_s,
                           "ckpt": self.last_ckpt["path"] or "none"})


def train(args) -> int:
    install_signal_handlers()
    if args.deterministic:
        set_deterministic()
    ctx = setup_distributed(args.device, args.init_timeout)
    try:
        rc = Trainer(args, ctx).run()
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
    args = parse_args(argv)
    return train(args)


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
