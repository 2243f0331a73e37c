"""CPU tests for the payload's GPU-only decisions: TF32 flags, precision per GPU generation,
DDP only with more than one process. No GPU here: what CUDA would report is stubbed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import torch

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = REPO / "payload"
sys.path.insert(0, str(PAYLOAD))
import batch_search  # noqa: E402
import data  # noqa: E402
import model  # noqa: E402
import optim  # noqa: E402
import runtime  # noqa: E402
import step_metrics  # noqa: E402
import train  # noqa: E402
from test_train import _env, _fail_msg, run_torchrun  # noqa: E402

# Every getter of both TF32 APIs. In a fresh interpreter, since the flags are process-global.
TF32_SCRIPT = f"""
import sys, torch
sys.path.insert(0, {str(PAYLOAD)!r})
import optim
from model import build_model
optim.enable_tf32()
got = {{
    "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
    "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
    "float32_matmul_precision": torch.get_float32_matmul_precision(),
    "cuda.matmul.fp32_precision": torch.backends.cuda.matmul.fp32_precision,
    "cudnn.conv.fp32_precision": torch.backends.cudnn.conv.fp32_precision,
    "cudnn.rnn.fp32_precision": torch.backends.cudnn.rnn.fp32_precision,
    "fp32_precision": torch.backends.fp32_precision,
}}
# What --compile does with these flags set: Inductor reads the matmul precision while lowering.
torch.manual_seed(0)
model = build_model("tiny", 16)
x = torch.randint(0, 256, (2, 16))
_, loss = torch.compile(model)(x, x)
loss.backward()
got["compiled_loss"] = loss.item()
print(repr(got))
"""


def test_tf32_flags_stay_readable_and_compile_works():
    p = subprocess.run([sys.executable, "-c", TF32_SCRIPT], env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, _fail_msg(p)  # the old code raised "mix of the legacy and new APIs"
    got = eval(p.stdout.strip().splitlines()[-1])
    assert got["cuda.matmul.allow_tf32"] is True and got["cudnn.allow_tf32"] is True
    assert got["float32_matmul_precision"] == "high"
    assert got["cuda.matmul.fp32_precision"] == "tf32"
    assert got["cudnn.conv.fp32_precision"] == "tf32"
    assert 4.0 < got["compiled_loss"] < 7.0  # about ln 256: an untrained model's loss


@pytest.mark.parametrize("capability, expected", [
    ((7, 0), "fp16"),  # V100: bf16 only emulated
    ((7, 5), "fp16"),  # T4
    ((8, 0), "bf16"),  # A100
    ((8, 6), "bf16"),  # A10, RTX 30xx
    ((8, 9), "bf16"),  # L4, L40S
    ((9, 0), "bf16"),  # H100, H200
    ((10, 0), "bf16"),  # B200
])
def test_auto_precision_by_compute_capability(capability, expected, monkeypatch):
    # What torch says on a V100: bf16 "supported" (emulation counts by default).
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    assert optim.resolve_precision("auto", cuda) == expected
    assert optim.resolve_precision("bf16", cuda) == "bf16"  # an explicit choice is kept
    assert optim.auto_cuda_precision(capability) == expected


def test_world_size_1_under_torchrun_is_not_wrapped_in_ddp(tmp_path):
    out_json = tmp_path / "m.json"
    p = run_torchrun(["--max-steps", 3, "--log-every", 1, "--out-json", out_json], nproc=1)
    assert p.returncode == 0, _fail_msg(p)
    assert "backend=gloo" in p.stdout  # a process group exists, as under torchrun with NCCL
    cfg = next(ln for ln in p.stdout.splitlines() if ln.startswith("config "))
    assert " ddp=off " in cfg, cfg
    m = json.loads(out_json.read_text())
    assert m["ddp"] is False and m["world_size"] == 1 and m["steps"] == 3
    assert m["optimizer"] == "adamw-foreach"  # fused only on CUDA


# Names as `nvidia-smi --query-gpu=name` (and torch.cuda.get_device_name) print them.
@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA H800", 989e12),
    ("NVIDIA H800 PCIe", 756e12),
    ("NVIDIA H20", 148e12),
    ("NVIDIA B200", 2250e12),
    ("NVIDIA GB200", 2500e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA A800-SXM4-80GB", 312e12),
    ("NVIDIA A10G", 70e12),
    ("NVIDIA A10", 125e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA L40", 181e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA RTX A6000", 155e12),
    ("Tesla V100-SXM2-32GB", 125e12),
    ("Tesla V100-PCIE-16GB", 112e12),
    ("Tesla V100S-PCIE-32GB", 130e12),
    ("Tesla T4", 65e12),
    ("NVIDIA GeForce RTX 4090", None),
    ("", None),
    (None, None),
])
def test_peak_flops_by_real_device_names(name, peak):
    assert model.device_peak_flops(name) == peak


@pytest.mark.parametrize("exc, oom", [
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
     True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (RuntimeError("NCCL error: unhandled system error"), False),
    (ValueError("out of memory"), False),
])
def test_every_out_of_memory_form_is_does_not_fit(exc, oom, monkeypatch):
    assert batch_search.is_oom(exc) is oom
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def step(b):
        if b > 4:
            raise exc

    assert batch_search.gpu_probe(step, 4, torch.device("cuda", 0)) is True
    if oom:
        assert batch_search.gpu_probe(step, 8, torch.device("cuda", 0)) is False
    else:  # a real fault is not a batch size: it stops the search
        with pytest.raises(type(exc)):
            batch_search.gpu_probe(step, 8, torch.device("cuda", 0))


def test_each_batch_size_probe_gets_a_fresh_grad_scaler(monkeypatch):
    made = []

    def make_scaler(device, precision):  # a real scaler, as fp16 on CUDA gets
        made.append(torch.amp.GradScaler("cpu"))
        return made[-1]

    monkeypatch.setattr(batch_search, "make_scaler", make_scaler)
    args = train.parse_args(["--preset", "tiny", "--seq-len", "16", "--device", "cpu",
                             "--find-batch-size", "--mem-budget-gb", "4"])
    assert batch_search.find_batch_size(args, runtime.DistCtx(), train.train_step) > 0
    # the CPU path probes 1, 2, 4, 8, two steps each, a fresh scaler per step
    assert len(made) == 8 and len({id(s) for s in made}) == 8


def test_each_batch_size_probe_runs_two_optimizer_steps(monkeypatch):
    """On an H200 a size that passed one probe step ran out of memory in training: the second
    step (optimizer state made, allocator blocks as the first step left them) is where it
    fails, so each size is probed with two."""
    sizes = []
    real = train.train_step

    def train_step(model, opt, micro, **kw):
        sizes.append(micro[0][0].shape[0])
        return real(model, opt, micro, **kw)

    args = train.parse_args(["--preset", "tiny", "--seq-len", "16", "--device", "cpu",
                             "--find-batch-size", "--mem-budget-gb", "4"])
    batch_search.find_batch_size(args, runtime.DistCtx(), train_step)
    assert sizes == [1, 1, 2, 2, 4, 4, 8, 8]


@pytest.mark.parametrize("env, expected", [
    ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}),  # the user's choice wins
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"},
     {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}),   # torch's newer name too
])
def test_cuda_allocator_defaults_to_expandable_segments(env, expected):
    runtime.configure_cuda_allocator(env)
    assert env == expected


def test_setup_distributed_configures_the_allocator_before_cuda(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    runtime.setup_distributed("cpu")
    import os
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_nccl_process_group_is_bound_to_the_ranks_gpu(monkeypatch):
    seen = {}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(runtime.dist, "get_world_size", lambda: 2)
    ctx = runtime.setup_distributed("auto", 30)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)
    assert seen["set_device"] == torch.device("cuda", 1)  # set before the group
    assert ctx.device == torch.device("cuda", 1) and ctx.initialized


def test_step_line_labels_allocated_and_reserved_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 1.5 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 2 * 2**30)
    mem = step_metrics.peak_mem(torch.device("cuda", 0))
    assert mem == {"alloc": 1.5, "reserved": 2.0}
    line = step_metrics.fmt_step_line(10, 2.0, 1e-4, 1000.0, 1.0, 0.4, mem, 0)
    assert line.endswith(" mfu=40.0% alloc=1.50GiB reserved=2.00GiB epoch=0"), line
    assert list(step_metrics.peak_mem(torch.device("cpu"))) == ["rss"]


def test_stop_check_interval_follows_step_time():
    assert runtime.steps_to_next_check(30.0, 1) == 1  # a compiling first step: check again at once
    assert runtime.steps_to_next_check(1.0, 10) == 10  # 0.1 s steps: about a second between checks
    assert runtime.steps_to_next_check(0.01, 10) == runtime.SYNC_EVERY_MAX
    assert runtime.steps_to_next_check(0.0, 3) == 1


def test_batches_are_pinned_for_the_gpu(monkeypatch):
    pinned = []

    def pin(t):
        pinned.append(t)
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    ds = data.SyntheticCopyDataset(8, 16)
    assert len(list(data.iterate_batches(ds, list(range(8)), 4))) == 2 and pinned == []
    assert len(list(data.iterate_batches(ds, list(range(8)), 4, pin=True))) == 2
    assert len(pinned) == 4  # x and y of each batch


def test_stop_checks_are_not_every_step(tmp_path):
    """Single process, gloo-free: a run of 0.1 s steps checks (and syncs) far less than every
    step, yet --stop-after still stops at exactly its step."""
    code = f"""
import sys
sys.path.insert(0, {str(PAYLOAD)!r})
import runtime, train
calls = []
real = runtime.agree_stop
def counting(ctx, stop, every):
    calls.append(stop)
    return real(ctx, stop, every)
runtime.agree_stop = counting
rc = train.main(["--device", "cpu", "--max-steps", "40", "--log-every", "20", "--stop-after", "33"])
print("checks", len(calls), "rc", rc)
"""
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, _fail_msg(p)
    assert "signal stop-after received: stopping after step 33" in p.stdout
    n = int(p.stdout.split("checks ")[1].split()[0])
    assert n < 33, p.stdout  # the old loop agreed on every step
