"""bench/gpu_check.sh's verdict, on CPU: the real script over a stub train.py, and the verdict
module's rules one by one. A failed, skipped or figure-less run must fail the check loudly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import gpu_check_verdict as verdict  # noqa: E402

# Stands in for payload/train.py. Tells its run apart by argv and torchrun's environment;
# STUB_BREAK="run:how,..." breaks named runs: exit (a traceback, status 1), nan, nomfu.
STUB = r'''
import json, os, sys
argv = sys.argv[1:]
name = ("find_batch" if "--find-batch-size" in argv else "compiled" if "--compile" in argv
        else "eager" if "RANK" in os.environ else "plain")
if "--out-json" in argv:  # a speed candidate's: cand-NAME.json
    name = os.path.basename(argv[argv.index("--out-json") + 1])[:-len(".json")]
how = dict(kv.split(":") for kv in os.environ.get("STUB_BREAK", "").split(",") if kv).get(name)
# the candidates' flags change the stub's speed: cuDNN +10%, chunks +5%, CUDA graphs -10%,
# the Triton cross-entropy +1% (under the 2% a winner needs)
speed = 1000.0
for flag, factor in (("cudnn", 1.10), ("--ce-chunks", 1.05), ("reduce-overhead", 0.90),
                     ("triton", 1.01)):
    speed *= factor if flag in argv else 1.0
if how == "exit":
    print("start rank=0 ...")
    print("Traceback (most recent call last):\n  File \"train.py\", line 1, in <module>\n"
          "    raise RuntimeError(msg)\nRuntimeError: stub: NCCL init failed on " + name,
          file=sys.stderr)
    sys.exit(1)
if name == "find_batch":
    print("probe batch_size=64 ok\nbatch_size=57")
    sys.exit(0)
if "--profile-dir" in argv:  # two kernels a step, as torch.profiler's chrome trace has them
    steps = argv[argv.index("--profile-steps") + 1]
    d = argv[argv.index("--profile-dir") + 1]
    os.makedirs(d)
    ev = [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": dur} for t, n, dur in (
        (0, "sm90_xmma_gemm_bf16", 700), (700, "triton_red_fused_stub", 200),
        (1100, "sm90_xmma_gemm_bf16", 700), (1800, "triton_red_fused_stub", 200))]
    with open(os.path.join(d, "trace_rank0_steps" + steps.replace(":", "-") + ".json"), "w") as f:
        json.dump({"traceEvents": ev + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                         "ts": 0, "dur": 5000}]}, f)
m = {"steps": 60, "final_loss": {"nan": float("nan"), "stray": 2.7}.get(how, 2.5),
     "tokens_per_s_median": speed, "mfu_median": None if how == "nomfu" else 0.4,
     "optimizer": "adamw-fused", "batch_size": int(argv[argv.index("--batch-size") + 1]),
     "losses": [[10, 5.0]], "device_name": "stub"}
with open(argv[argv.index("--out-json") + 1], "w") as f:
    json.dump(m, f)
print("step=60 loss=2.5000 lr=1e-4 tok/s=1000 samples/s=1.0 mfu=40.0% alloc=1.00GiB reserved=1.20GiB epoch=0")
print("done step=60 loss=2.5000 ckpt=none")
'''


def run_check(tmp_path, **env):
    stub = tmp_path / "stub_train.py"
    stub.write_text(STUB)
    out = tmp_path / "out"
    e = dict(os.environ, PY=sys.executable, TRAIN=str(stub), REQUIRE_CUDA="0", OUT=str(out),
             TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", **env)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        e.pop(k, None)
    p = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], env=e, capture_output=True,
                       text=True, timeout=600)
    summary = json.loads((out / "gpu_check.json").read_text())
    return p, summary


def test_all_runs_good_passes(tmp_path):
    p, s = run_check(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert s["ok"] is True and s["problems"] == []
    assert s["plain"]["rc"] == 0 and s["eager"]["rc"] == 0 and s["compiled"]["rc"] == 0
    assert s["find_batch"]["batch_size"] == 57
    assert [s[r]["batch_size"] for r in ("plain", "eager", "compiled")] == [57] * 3  # sized by it
    assert s["compile_speedup"] == pytest.approx(1.0)
    assert json.loads(p.stdout)["compiled"]["mfu_median"] == 0.4
    assert list(tmp_path.glob("gpu_check.*")) == []  # scratch directory removed


def test_failing_nan_and_mfu_less_runs_fail_the_check(tmp_path):
    p, s = run_check(tmp_path, STUB_BREAK="plain:exit,compiled:nan,eager:nomfu")
    assert p.returncode == 1, p.stdout + p.stderr  # the old script printed ok: false, exit 0
    assert s["ok"] is False
    fails = [ln for ln in p.stderr.splitlines() if ln.startswith("FAIL ")]
    assert fails == [
        "FAIL plain: exit status 1; first error: RuntimeError: stub: NCCL init failed on plain",
        "FAIL eager: MFU is None: no peak FLOPS known for 'stub' (payload/model.py PEAK_FLOPS) or no "
        "step timed",
        "FAIL compiled: final loss is nan, not a finite number",
    ], p.stderr


def test_budget_skip_is_named_and_fails(tmp_path):
    # 100 s: less than the search, plain and eager each need once the later runs are reserved.
    p, s = run_check(tmp_path, BUDGET_S="100")
    assert p.returncode == 1, p.stdout + p.stderr
    for run, need in (("find_batch", 40), ("plain", 30), ("eager", 30)):
        assert f"{run}: SKIPPED" in p.stderr
        assert s[run]["status"] == "skipped" and s[run]["need_s"] == need
        assert any(x.startswith(f"{run}: skipped: ") and x.endswith("raise BUDGET_S (now 100)")
                   for x in s["problems"]), s["problems"]
    assert "no batch size found: the runs use --batch-size 16" in p.stderr


def test_speed_candidates_run_alone_then_the_winners_together(tmp_path):
    p, s = run_check(tmp_path, CANDIDATES="speed")
    assert p.returncode == 0, p.stdout + p.stderr
    c = s["candidates"]
    # autotune, slowest to compile, after cand-best
    assert list(c) == ["cand-ce-triton", "cand-tune", "cand-cudnn", "cand-ce-chunks",
                       "cand-cudagraphs", "cand-best", "cand-autotune"]
    assert c["cand-ce-triton"]["flags"] == "--ce-kernel triton"
    assert c["cand-tune"]["flags"] == "--compile-tune"
    assert c["cand-ce-triton"]["vs_compiled"] == pytest.approx(1.01)  # not a winner
    assert c["cand-cudnn"]["vs_compiled"] == pytest.approx(1.10)
    assert c["cand-cudagraphs"]["vs_compiled"] == pytest.approx(0.90)
    # the two that won, the faster first; CUDA graphs (slower) left out
    assert c["cand-best"]["flags"] == "--attention cudnn --ce-chunks 16"
    assert c["cand-best"]["vs_compiled"] == pytest.approx(1.155)
    assert json.loads(p.stdout)["candidates"]["cand-ce-chunks"]["tokens_per_s_median"] == 1050.0
    assert (tmp_path / "out" / "cand-best.log").exists()


def test_a_candidate_whose_loss_strays_fails_the_check_and_is_not_among_the_winners(tmp_path):
    p, s = run_check(tmp_path, CANDIDATES="cudnn:--attention cudnn;ce-chunks:--ce-chunks 4",
                     STUB_BREAK="cand-cudnn:stray")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL cand-cudnn: final loss 2.7000 strays from compiled's 2.5000 by more than 5%" \
        in p.stderr.splitlines()
    assert s["candidates"]["cand-best"]["flags"] == "--ce-chunks 4"


def test_profile_sums_the_compiled_and_best_runs_gpu_kernels(tmp_path):
    p, s = run_check(tmp_path, CANDIDATES="cudnn:--attention cudnn", PROFILE="45:46")
    assert p.returncode == 0, p.stdout + p.stderr
    assert s["candidates"]["cand-best"]["flags"] == "--attention cudnn"  # not the profiler's
    for name in ("compiled", "cand-best"):
        text = (tmp_path / "out" / f"{name}_profile.txt").read_text().splitlines()
        assert text[0] == "GPU busy 0.9 ms of a 1.0 ms span per step (4 kernels)"
        assert text[2].split()[:4] == ["0.70", "77.8%", "1", "gemm"]
    assert not (tmp_path / "out" / "cand-cudnn_profile.txt").exists()


def test_trace_top_sums_kernels_by_name_and_family():
    import trace_top
    ev = [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in (
        ("pytorch_flash::flash_fwd_kernel", 0, 300), ("nvjet_tst_256x128", 300, 600),
        ("nvjet_tst_256x128", 1000, 600), ("triton_per_fused_cross_entropy", 1600, 100))]
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000})
    s = trace_top.summarize({"traceEvents": ev}, steps=2)
    assert s["kernels"] == 4 and s["busy_ms_per_step"] == pytest.approx(0.8)
    assert s["span_ms_per_step"] == pytest.approx(0.85)
    assert [(r["name"], r["calls_per_step"]) for r in s["top"]][0] == ("nvjet_tst_256x128", 1)
    assert {f: v["ms_per_step"] for f, v in s["families"].items()} == pytest.approx(
        {"gemm": 0.6, "attention": 0.15, "cross-entropy": 0.05})
    assert trace_top.summarize({"traceEvents": []}, 1) == {"kernels": 0}


def test_no_winner_no_best_run(tmp_path):
    p, s = run_check(tmp_path, CANDIDATES="cudagraphs:--compile-mode reduce-overhead")
    assert p.returncode == 0, p.stdout + p.stderr
    assert list(s["candidates"]) == ["cand-cudagraphs"]
    assert "cand-best: no candidate beat compiled by 2%: not run" in p.stderr


GOOD = {"status": "ran", "rc": 0, "timeout_s": 90, "metrics": True, "final_loss": 2.5,
        "tokens_per_s_median": 1e5, "mfu_median": 0.41, "optimizer": "adamw-fused",
        "batch_size": 16, "device_name": "NVIDIA H200"}


@pytest.mark.parametrize("change, problem", [
    ({}, None),
    ({"rc": 1, "first_error": "torch.OutOfMemoryError: CUDA out of memory."},
     "x: exit status 1; first error: torch.OutOfMemoryError: CUDA out of memory."),
    ({"rc": 137}, "x: timed out after 90s; no error line in x.log"),
    ({"metrics": False}, "x: exited 0 but wrote no metrics (x.json)"),
    ({"tokens_per_s_median": 0.0}, "x: tokens/s is 0.0, not > 0"),
    ({"final_loss": None}, "x: final loss is None, not a finite number"),  # train.py's NaN
    ({"final_loss": float("inf")}, "x: final loss is inf, not a finite number"),
    ({"mfu_median": None}, "x: MFU is None: no peak FLOPS known for 'NVIDIA H200' (payload/model.py "
                           "PEAK_FLOPS) or no step timed"),
    ({"optimizer": "adamw-foreach"}, "x: optimizer is 'adamw-foreach', not adamw-fused"),
    ({"optimizer": None}, "x: optimizer is None, not adamw-fused"),
    ({"batch_size": 0}, "x: batch size is 0, not > 0"),
    ({"status": "skipped", "left_s": 12, "need_s": 90},
     "x: skipped: 12s of the budget left, it needs 90s; raise BUDGET_S (now 540)"),
    ({"status": "missing"}, "x: did not run"),
])
def test_train_run_rules(change, problem):
    got = verdict.run_problems("x", "train", {**GOOD, **change}, 540)
    assert got == ([problem] if problem else [])


def test_find_run_needs_a_positive_batch_size():
    ran = {"status": "ran", "rc": 0, "timeout_s": 120}
    assert verdict.run_problems("f", "find", {**ran, "batch_size": 57}, 540) == []
    assert verdict.run_problems("f", "find", {**ran, "batch_size": 0}, 540) != []
    assert verdict.run_problems("f", "find", ran, 540) == ["f: no batch_size=N > 0 in f.log"]


def test_first_error_line_is_the_ranks_exception_not_torchruns():
    log = "\n".join([
        "start rank=0 local_rank=0 host=h device=cuda:0 (NVIDIA H200) world_size=1",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "train.py", line 1200, in <module>',
        "[rank0]:     raise RuntimeError(msg)",
        "[rank0]: torch._inductor.exc.InductorError: RuntimeError: PyTorch is checking whether "
        "allow_tf32_new is enabled",
        "E1130 12:00:00 torch/distributed/elastic/multiprocessing/api.py failed (exitcode: 1)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])
    assert verdict.first_error_line(log) == (
        "torch._inductor.exc.InductorError: RuntimeError: PyTorch is checking whether "
        "allow_tf32_new is enabled")
    assert verdict.first_error_line("error: --data: no such file: x\n") == \
        "error: --data: no such file: x"
    assert verdict.first_error_line("step=1 loss=2.0\nUserWarning: something\n") is None
