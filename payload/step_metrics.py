"""What a run measures of itself: the step line (loss, lr, throughput, MFU, memory), TensorBoard
scalars, the summary --out-json writes, and the --profile-steps trace.

Step times are only real once the host waited for the GPU: the stop agreement's all-reduce does
that (runtime.StopAgreement), so a step's time is taken after it, and the median step time is
taken over the intervals between two such checks.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import time

import torch

import progress
from runtime import DistCtx, all_reduce_scalar, log


def peak_mem(device: torch.device) -> dict[str, float]:
    """Peak memory so far, GiB, labelled: on CUDA what tensors held (alloc) and what the
    caching allocator held (reserved, what nvidia-smi and OOM see); on CPU the peak RSS."""
    if device.type == "cuda":
        return {"alloc": torch.cuda.max_memory_allocated(device) / 2**30,
                "reserved": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}  # KiB


def fmt_step_line(step, loss, lr, tok_s, samples_s, mfu, mem: dict[str, float], epoch) -> str:
    fields = {"step": step, "loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tok_s:.0f}",
              "samples/s": f"{samples_s:.1f}", "mfu": "n/a" if mfu is None else f"{mfu * 100:.1f}%"}
    fields.update({k: f"{v:.2f}GiB" for k, v in mem.items()})
    fields["epoch"] = epoch
    return progress.format_line("step", fields)


class StepMetrics:
    """Throughput and loss over a run: a window (the steps since the last step line) and an
    interval (the steps since the last stop check), the losses the step lines showed.

    fpt: the model's FLOPs per token; peak: the GPU's dense peak FLOP/s (None: MFU unknown)."""

    def __init__(self, ctx: DistCtx, tokens_per_step: int, global_batch: int, fpt: float,
                 peak: float | None):
        self.ctx, self.dev = ctx, ctx.device
        self.tokens_per_step, self.global_batch, self.fpt, self.peak = (
            tokens_per_step, global_batch, fpt, peak)
        self.tb = None  # TensorBoard writer (rank 0, --tensorboard)
        self.window_time, self.window_steps = 0.0, 0  # summed step times: no checkpoint writes
        self.interval_time, self.interval_steps = 0.0, 0  # since the last stop check
        self.step_times: list[float] = []  # time per step, one per interval between stop checks
        self.losses: list[tuple[int, float]] = []
        self.last_loss = float("nan")
        self.start_step = 0
        self.t_start = time.perf_counter()

    def begin(self, step: int, tensorboard: str | None):
        """The run's clock starts at `step`; TensorBoard opens (a warning if it cannot)."""
        if tensorboard and self.ctx.is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(tensorboard)
            except Exception as e:  # ImportError, or tensorboard missing behind torch's shim
                log(self.ctx, f"WARNING: --tensorboard ignored: tensorboard is not importable "
                              f"({e}); pip install tensorboard")
        self.start_step = step
        self.t_start = time.perf_counter()
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dev)

    def step_timed(self, dt: float):
        self.window_steps += 1
        self.window_time += dt
        self.interval_steps += 1
        self.interval_time += dt

    def close_interval(self) -> tuple[float, int]:
        """At a stop check: the interval's (seconds, steps), and a new interval."""
        took = (self.interval_time, self.interval_steps)
        self.step_times.append(self.interval_time / self.interval_steps)
        self.interval_time, self.interval_steps = 0.0, 0
        return took

    def mfu(self, tok_s: float | None) -> float | None:
        return (self.fpt * tok_s / self.ctx.world_size / self.peak) if (self.peak and tok_s) else None

    def log_step(self, step: int, loss_t: torch.Tensor, lr: float, epoch: int):
        """The step line: the loss averaged over ranks, throughput since the last line.
        Collective (the loss's all-reduce)."""
        ctx = self.ctx
        loss_v = all_reduce_scalar(ctx, float(loss_t.item()), "sum") / ctx.world_size
        self.last_loss = loss_v
        self.losses.append((step, loss_v))
        el = max(self.window_time, 1e-9)
        tok_s = self.window_steps * self.tokens_per_step / el
        sam_s = self.window_steps * self.global_batch / el
        mfu = self.mfu(tok_s)
        log(ctx, fmt_step_line(step, loss_v, lr, tok_s, sam_s, mfu, peak_mem(self.dev), epoch))
        if self.tb is not None:
            self.tb.add_scalar("train/loss", loss_v, step)
            self.tb.add_scalar("train/lr", lr, step)
            self.tb.add_scalar("perf/tokens_per_s", tok_s, step)
            if mfu is not None:
                self.tb.add_scalar("perf/mfu", mfu, step)
        self.window_time, self.window_steps = 0.0, 0

    def log_eval(self, step: int, val_loss: float):
        """An evaluation's loss, as TensorBoard's val/loss (the eval line is train.py's)."""
        if self.tb is not None:
            self.tb.add_scalar("val/loss", val_loss, step)

    def loss_text(self) -> str:
        return "nan" if math.isnan(self.last_loss) else f"{self.last_loss:.4f}"

    def summary(self, step: int) -> dict:
        """The measured half of --out-json: steps, losses, median throughput, MFU, peak memory.
        The median skips the first tenth of the intervals (compilation, warm-up)."""
        times = self.step_times
        skip = max(1, len(times) // 10) if len(times) > 1 else 0
        steady = times[skip:] or times
        med_dt = statistics.median(steady) if steady else None
        tok_s_med = self.tokens_per_step / med_dt if med_dt else None
        mem_end = peak_mem(self.dev)
        return {
            "steps": step,
            "steps_run": step - self.start_step,
            "start_step": self.start_step,
            "final_loss": None if math.isnan(self.last_loss) else self.last_loss,
            "losses": self.losses,
            "tokens_per_s_median": tok_s_med,
            "samples_per_s_median": (self.global_batch / med_dt) if med_dt else None,
            "step_time_s_median": med_dt,
            "mfu_median": self.mfu(tok_s_med),
            "flops_per_token": self.fpt,
            "peak_flops": self.peak,
            "peak_mem_gib": mem_end.get("alloc", mem_end.get("rss")),
            "peak_mem_reserved_gib": mem_end.get("reserved"),
        }

    def close(self):
        if self.tb is not None:
            self.tb.close()


class StepProfiler:
    """--profile-steps A:B: a torch.profiler trace of steps A to B on rank 0, written to
    --profile-dir as trace_rank0_stepsA-B.json."""

    def __init__(self, ctx: DistCtx, steps: str | None, out_dir: str | None):
        self.ctx, self.out_dir = ctx, out_dir
        self.range = tuple(int(v) for v in steps.split(":")) if steps else None
        self.prof = None

    def before_step(self, step: int):
        """Called before step `step` + 1 runs."""
        r = self.range
        if r and self.ctx.is_main and self.prof is None and step + 1 == r[0]:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.ctx.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self.prof.__enter__()

    def after_step(self, step: int):
        r = self.range
        if self.prof is not None and step == r[1]:
            self.prof.__exit__(None, None, None)
            os.makedirs(self.out_dir, exist_ok=True)
            trace = os.path.join(self.out_dir, f"trace_rank{self.ctx.rank}_steps{r[0]}-{r[1]}.json")
            self.prof.export_chrome_trace(trace)
            log(self.ctx, f"profile steps={r[0]}:{r[1]} trace={trace}")
            self.prof, self.range = None, None

    def close(self):
        """A run that stopped inside the range: the profiler ends, without a trace."""
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
