"""CPU tests for payload/train.py: real torchrun (gloo, 2 processes) plus in-process checks.

Kept small (tiny preset, tens of steps) so the file runs in a few minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import torch  # a test dependency (pyproject [test]): missing torch fails, never skips
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "payload" / "train.py"
sys.path.insert(0, str(TRAIN.parent))
import batch_search  # noqa: E402
import checkpoint  # noqa: E402
import cli  # noqa: E402
import config  # noqa: E402
import data  # noqa: E402
import model  # noqa: E402
import optim  # noqa: E402
import progress  # noqa: E402
import train  # noqa: E402

STEP_RE = re.compile(r"^step=(\d+) loss=([0-9.]+|nan) lr=\S+ tok/s=\d+ samples/s=[0-9.]+ "
                     r"mfu=(?:n/a|[0-9.]+%) (?:rss=[0-9.]+GiB|alloc=[0-9.]+GiB reserved=[0-9.]+GiB) "
                     r"epoch=\d+$", re.M)
HASH_RE = re.compile(r"^param_hash rank=(\d+) step=(\d+) sha256=([0-9a-f]{64})$", re.M)
DONE_RE = re.compile(r"^done step=(\d+) loss=(\S+) ckpt=(\S+)$", re.M)


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("TORCHRIG_DATA", None)  # train.py's --data default: each test says its data
    return env


def _torchrun_cmd(args, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), str(TRAIN), "--device", "cpu", *map(str, args)]


def run_torchrun(args, nproc=2, timeout=180, env=None):
    """torchrun of train.py on the CPU; env: variables set for it on top of _env()'s."""
    p = subprocess.run(_torchrun_cmd(args, nproc), cwd=REPO, env={**_env(), **(env or {})},
                       capture_output=True, text=True, timeout=timeout)
    return p


def steps(out: str) -> dict[int, str]:
    return {int(s): loss for s, loss in STEP_RE.findall(out)}


def _fail_msg(p):
    return f"rc={p.returncode}\nSTDOUT:\n{p.stdout[-4000:]}\nSTDERR:\n{p.stderr[-4000:]}"


# ------------------------------------------------------------------ a short 2-rank run


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("short")
    out_json = d / "metrics.json"
    p = run_torchrun(["--max-steps", 40, "--log-every", 5, "--dump-param-hash",
                      "--out-json", out_json])
    assert p.returncode == 0, _fail_msg(p)
    return p, out_json


def test_loss_falls(short_run):
    p, _ = short_run
    s = steps(p.stdout)
    assert sorted(s) == list(range(5, 45, 5)), p.stdout
    losses = [float(s[k]) for k in sorted(s)]
    # synthetic task: starts near ln(256)=5.5, falls toward ln(16)=2.8 and below
    assert losses[-1] < 0.7 * losses[0], losses
    assert min(losses[-3:]) < 3.2, losses


def test_params_identical_on_every_rank(short_run):
    p, _ = short_run
    hashes = HASH_RE.findall(p.stdout)
    assert sorted(int(r) for r, _, _ in hashes) == [0, 1], p.stdout
    assert {int(st) for _, st, _ in hashes} == {40}
    assert len({h for _, _, h in hashes}) == 1, hashes


def test_startup_lines_and_batch_semantics(short_run):
    p, _ = short_run
    starts = re.findall(r"^start rank=(\d) local_rank=(\d) host=\S+ device=cpu .*world_size=2 "
                        r"backend=gloo", p.stdout, re.M)
    assert sorted(starts) == [("0", "0"), ("1", "1")], p.stdout
    cfg = re.search(r"^config .*", p.stdout, re.M).group(0)
    assert "global_batch=16" in cfg  # 8 per rank x 1 accum x 2 ranks
    assert " ddp=on " in cfg  # two ranks: DDP averages the gradients
    # tiny preset lr 1e-2 per 32 samples, scaled linearly to 16
    assert "lr=5.000e-03" in cfg
    assert len(DONE_RE.findall(p.stdout)) == 1  # rank 0 only
    # what status, logs and demo read (progress.py) is what train.py wrote
    assert progress.parse(cfg).fields["global_batch"] == "16"
    assert sorted(progress.start_ranks(ln) for ln in p.stdout.splitlines()
                  if ln.startswith("start ")) == [(0, 0), (1, 1)]
    done = [progress.parse(ln) for ln in p.stdout.splitlines() if progress.is_progress(ln)][-1]
    assert done.kind == "done" and done.fields["step"] == "40", p.stdout


def test_out_json(short_run):
    p, out_json = short_run
    m = json.loads(out_json.read_text())
    assert m["steps"] == 40 and m["world_size"] == 2 and m["global_batch"] == 16
    assert m["final_loss"] == pytest.approx(float(steps(p.stdout)[40]), abs=1e-4)
    assert m["tokens_per_s_median"] > 0
    assert m["mfu_median"] is None  # no known peak on CPU
    assert m["backend"] == "gloo"


# ------------------------------------------------------------------ accumulation == big batch


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def gloo_world1():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _batches(n, bs, seq_len, seed=0):
    ds = data.SyntheticCopyDataset(n * bs, seq_len, seed=seed)
    return list(data.iterate_batches(ds, list(range(n * bs)), bs))


def test_grad_accum_no_sync_equals_large_batch(gloo_world1):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = model.build_model("tiny", 32)
    k, bs = 4, 2
    micro = _batches(k, bs, 32)
    big = [(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))]
    assert not torch.equal(micro[0][0], micro[1][0])  # micro-batches differ

    def run(batches, opt_name):
        m = model.build_model("tiny", 32)
        m.load_state_dict(base.state_dict())
        ddp = DDP(m)
        calls = []

        def counting_hook(state, bucket):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_hook)
        if opt_name == "sgd":
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
        else:
            opt, _ = optim.make_optimizer(m, 1e-3, 0.1, torch.device("cpu"))
        loss, _ = train.train_step(ddp, opt, batches, device=torch.device("cpu"),
                                   clip=0.0 if opt_name == "sgd" else 1.0)
        return m, float(loss), calls

    for opt_name in ("sgd", "adamw"):
        m_acc, loss_acc, calls_acc = run(micro, opt_name)
        m_big, loss_big, calls_big = run(big, opt_name)
        assert loss_acc == pytest.approx(loss_big, rel=1e-5)
        # gradients were all-reduced once per bucket, on the last micro-batch only
        assert len(calls_acc) == len(calls_big) > 0
        moved = 0
        for (n, a), (_, b), (_, p0) in zip(m_acc.named_parameters(), m_big.named_parameters(),
                                           base.named_parameters()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{opt_name} {n}")
            moved += int(not torch.equal(a, p0))
        assert moved > 0


# ------------------------------------------------------------------ deterministic stop / resume

DET_ARGS = ["--deterministic", "--max-steps", 24, "--log-every", 1, "--batch-size", 4,
            "--grad-accum", 2, "--synthetic-samples", 160, "--dump-param-hash",
            "--ckpt-every", 6, "--keep", 3]


@pytest.fixture(scope="module")
def det_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("det")
    full = run_torchrun([*DET_ARGS, "--ckpt-dir", d / "full"])
    assert full.returncode == 0, _fail_msg(full)
    part1 = run_torchrun([*DET_ARGS, "--ckpt-dir", d / "split", "--stop-after", 13])
    assert part1.returncode == 0, _fail_msg(part1)
    part2 = run_torchrun([*DET_ARGS, "--ckpt-dir", d / "split"])
    assert part2.returncode == 0, _fail_msg(part2)
    return full, part1, part2, d


def test_stop_resume_matches_uninterrupted(det_runs):
    full, part1, part2, d = det_runs
    a, b1, b2 = steps(full.stdout), steps(part1.stdout), steps(part2.stdout)
    assert sorted(a) == list(range(1, 25))
    assert sorted(b1) == list(range(1, 14))  # stopped after step 13
    assert (d / "split" / "ckpt_00000013.pt").exists()
    # 160 samples / (2 ranks * 4 * 2 accum) = 10 steps/epoch: resume mid-epoch 1
    assert "resume step=13 epoch=1" in part2.stdout
    assert sorted(b2) == list(range(14, 25))
    for s in range(1, 25):
        assert (b1 if s <= 13 else b2)[s] == a[s], f"step {s}: {a[s]} vs resumed"
    h_full = {h for _, _, h in HASH_RE.findall(full.stdout)}
    h_res = {h for _, _, h in HASH_RE.findall(part2.stdout)}
    assert len(h_full) == 1 and h_full == h_res
    # losses actually move, so equality above is not vacuous
    assert len(set(a.values())) > 10


def test_checkpoint_contents_and_retention(det_runs):
    _, _, _, d = det_runs
    names = sorted(os.listdir(d / "full"))
    assert names == ["ckpt_00000012.pt", "ckpt_00000018.pt", "ckpt_00000024.pt"]  # keep 3
    st = torch.load(d / "full" / "ckpt_00000024.pt", map_location="cpu", weights_only=True)
    assert st["step"] == 24 and st["data"]["epoch"] == 2 and st["data"]["step_in_epoch"] == 4
    assert len(st["rng"]) == 2 and isinstance(st["rng"][0]["torch_cpu"], torch.Tensor)
    assert not any(k.startswith("module.") or k.startswith("_orig_mod.") for k in st["model"])
    assert st["config"]["batch_size"] == 4 and st["optimizer"]["state"]


def test_corrupt_newest_checkpoint_is_skipped(det_runs, tmp_path):
    _, _, _, d = det_runs
    ck = tmp_path / "ck"
    shutil.copytree(d / "full", ck)
    newest = ck / "ckpt_00000024.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # truncated
    (ck / ".tmp_ckpt_ckpt_00000030.pt.999").write_bytes(b"partial")  # leftover of a killed write
    p = run_torchrun([*DET_ARGS, "--ckpt-dir", ck, "--max-steps", 30])
    assert p.returncode == 0, _fail_msg(p)
    assert re.search(r"^WARNING: skipping unreadable checkpoint \S*ckpt_00000024\.pt", p.stdout,
                     re.M), p.stdout
    assert "resume step=18 " in p.stdout
    assert sorted(steps(p.stdout)) == list(range(19, 31))
    assert DONE_RE.search(p.stdout).group(1) == "30"
    assert not [n for n in os.listdir(ck) if n.startswith(".tmp")]
    torch.load(ck / "ckpt_00000030.pt", weights_only=True)


def test_resume_at_or_past_last_step_exits_0_without_training(det_runs, tmp_path):
    """A group restarted after its final checkpoint (say a peer failed at teardown) must end
    at once: no step, no loss (before: a step-less 'done step=24 loss=nan')."""
    _, _, _, d = det_runs
    ck = tmp_path / "ck"
    shutil.copytree(d / "full", ck)
    for max_steps in (24, 20):  # at, and past (a shorter --max-steps), the last step
        p = run_torchrun([*DET_ARGS, "--ckpt-dir", ck, "--max-steps", max_steps])
        assert p.returncode == 0, _fail_msg(p)
        assert "resume step=24 " in p.stdout
        assert re.search(r"^done step=24 ckpt=\S+ckpt_00000024\.pt \(nothing to train", p.stdout,
                         re.M), p.stdout
        assert not steps(p.stdout) and "loss=" not in p.stdout
    assert sorted(os.listdir(ck)) == sorted(os.listdir(d / "full"))


def test_checkpoints_ordered_by_step_past_eight_digits(tmp_path):
    """Names are padded to 8 digits: from step 100,000,000 on, name order is not step order,
    and --keep must still delete the oldest, and resume must pick the newest."""
    ck = tmp_path / "ck"
    steps_saved = [99_999_998, 99_999_999, 100_000_000, 100_000_001]
    for s in steps_saved:
        checkpoint.save_checkpoint(str(ck), s, {"model": {}, "optimizer": {}, "step": s}, keep=2)
    assert sorted(os.listdir(ck)) == ["ckpt_100000000.pt", "ckpt_100000001.pt"]
    (ck / "ckpt_99999999.pt").write_bytes((ck / "ckpt_100000000.pt").read_bytes())  # an older one
    assert [Path(p).name for p in checkpoint.list_checkpoints(str(ck))] == [
        "ckpt_99999999.pt", "ckpt_100000000.pt", "ckpt_100000001.pt"]
    path, st = checkpoint.find_latest_checkpoint(str(ck))
    assert Path(path).name == "ckpt_100000001.pt" and st["step"] == 100_000_001


# ------------------------------------------------------------------ kill during a write

SAVER = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
import checkpoint
state = {"model": {"w": torch.randn(6_000_000)}, "optimizer": {}, "step": 0}
step = 0
while True:
    step += 1
    state["step"] = step
    checkpoint.save_checkpoint(sys.argv[1], step, state, keep=3)
"""


def test_kill_during_checkpoint_write_leaves_loadable_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    caught_mid_write = 0
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(ck), str(TRAIN.parent)],
                                env=_env())
        try:
            deadline = time.time() + 60
            n_before = len(checkpoint.list_checkpoints(str(ck)))
            while time.time() < deadline:
                names = os.listdir(ck)
                if (len([n for n in names if n.startswith("ckpt_")]) >= min(n_before + 2, 3)
                        and any(n.startswith(checkpoint.TMP_PREFIX) for n in names)):
                    break
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        caught_mid_write += any(n.startswith(checkpoint.TMP_PREFIX) for n in os.listdir(ck))
        ckpts = checkpoint.list_checkpoints(str(ck))
        assert ckpts and all(os.path.basename(c).startswith("ckpt_") for c in ckpts)
        for c in ckpts:
            st = torch.load(c, map_location="cpu", weights_only=True)
            assert st["model"]["w"].numel() == 6_000_000
        path, st = checkpoint.find_latest_checkpoint(str(ck))
        assert path == ckpts[-1] and st["step"] == int(path[-11:-3])
    assert caught_mid_write >= 1  # the kills really hit a write in progress
    checkpoint.cleanup_temp_files(str(ck))
    assert not [n for n in os.listdir(ck) if n.startswith(checkpoint.TMP_PREFIX)]


# ------------------------------------------------------------------ SIGTERM


class LineReader:
    """Collects a process's stdout lines in a thread; wait_for(regex) blocks until seen."""

    def __init__(self, proc):
        self.proc, self.lines, self.cv = proc, [], threading.Condition()
        self.t = threading.Thread(target=self._pump, daemon=True)
        self.t.start()

    def _pump(self):
        for line in self.proc.stdout:
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()

    def wait_for(self, pattern, timeout=120):
        rx = re.compile(pattern)
        end = time.time() + timeout
        with self.cv:
            while True:
                for ln in self.lines:
                    if rx.search(ln):
                        return ln
                left = end - time.time()
                if left <= 0 or (self.proc.poll() is not None and not self.t.is_alive()):
                    raise AssertionError(f"{pattern!r} not seen:\n" + "\n".join(self.lines[-50:]))
                self.cv.wait(min(left, 0.5))

    def text(self):
        self.t.join(30)
        return "\n".join(self.lines)


def _start(cmd):
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, LineReader(proc)


def _check_stopped_checkpoint(out, ck):
    done = DONE_RE.search(out)
    assert done, out
    stop_step = int(done.group(1))
    assert re.search(rf"^signal SIGTERM received: stopping after step {stop_step}$", out, re.M), out
    path = ck / f"ckpt_{stop_step:08d}.pt"
    assert done.group(3) == str(path)
    st = torch.load(path, map_location="cpu", weights_only=True)
    assert st["step"] == stop_step
    return stop_step


LONG = ["--max-steps", 100000, "--log-every", 1, "--dump-param-hash"]


@pytest.mark.parametrize("times", [1, 2])
def test_sigterm_to_workers_checkpoints_and_exits_0(tmp_path, times):
    """What torchrun does on stop: SIGTERM every worker. All stop at one step, exit 0.
    times=2: Slurm's scancel (proctrack/cgroup) signals every process of the step, so each
    worker gets SIGTERM from slurmstepd and again from torchrun, which forwards its own; the
    repeat is the same request, not an escalation."""
    ck = tmp_path / "ck"
    proc, rd = _start(_torchrun_cmd([*LONG, "--ckpt-dir", ck]))
    try:
        pids = [int(rd.wait_for(rf"^start rank={r} .* pid=(\d+)").rsplit("pid=", 1)[1])
                for r in (0, 1)]
        rd.wait_for(r"^step=3 ")
        for i in range(times):
            time.sleep(0.1 * i)  # the handlers ran; the ranks agree on the stop within about 1 s
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = rd.text()
    assert rc == 0, out
    stop_step = _check_stopped_checkpoint(out, ck)
    hashes = HASH_RE.findall(out)
    assert {(int(s)) for _, s, _ in hashes} == {stop_step} and len({h for *_, h in hashes}) == 1
    assert len(hashes) == 2


def test_second_sigint_interrupts_at_once(tmp_path):
    """Ctrl-C twice at a terminal: the second SIGINT is a person insisting (KeyboardInterrupt,
    no checkpoint wait)."""
    code = ("import os, signal, sys, time; sys.path.insert(0, sys.argv[1]); import runtime\n"
            "runtime.install_signal_handlers()\n"
            "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGTERM)\n"
            "assert runtime.stop_requested() and runtime.stopped_by() == 'SIGINT'\n"
            "try:\n    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "except KeyboardInterrupt:\n    print('interrupted'); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code, str(TRAIN.parent)], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (3, "interrupted\n"), r.stderr


def test_sigterm_to_torchrun_checkpoints(tmp_path):
    """SIGTERM to torchrun itself: it forwards SIGTERM to the workers, which stop at the same
    step, checkpoint and exit cleanly. (torchrun 2.13 then re-raises its own SignalException,
    so its exit status is 1 whatever the workers did; the workers' own status is checked in
    the test above and the single-process test below.)"""
    ck = tmp_path / "ck"
    proc, rd = _start(_torchrun_cmd([*LONG, "--ckpt-dir", ck]))
    try:
        rd.wait_for(r"^step=3 ")
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = rd.text()
    stop_step = _check_stopped_checkpoint(out, ck)
    hashes = HASH_RE.findall(out)
    assert len(hashes) == 2 and {int(s) for _, s, _ in hashes} == {stop_step}
    assert "ChildFailedError" not in out and "exitcode" not in out, out


def test_single_process_sigterm_exits_0(tmp_path):
    ck = tmp_path / "ck"
    cmd = [sys.executable, str(TRAIN), "--device", "cpu", *map(str, LONG), "--ckpt-dir", str(ck)]
    proc, rd = _start(cmd)
    try:
        line = rd.wait_for(r"^start rank=0 ")
        assert "world_size=1 backend=none" in line
        rd.wait_for(r"^step=3 ")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = rd.text()
    assert rc == 0, out
    _check_stopped_checkpoint(out, ck)


# ------------------------------------------------------------------ batch-size search, CLI


def test_find_batch_size_cpu_budget():
    cmd = [sys.executable, str(TRAIN), "--device", "cpu", "--find-batch-size",
           "--mem-budget-gb", "1.5", "--max-batch-size", "512"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, _fail_msg(p)
    m = re.search(r"^batch_size=(\d+)$", p.stdout, re.M)
    assert m, p.stdout
    n = int(m.group(1))
    probes = re.findall(r"^probe batch_size=(\d+) predicted=([0-9.]+)GiB (ok|oom)$", p.stdout, re.M)
    ok = [int(b) for b, _, r in probes if r == "ok"]
    assert ok and n == max(1, int(max(ok) * 0.9))
    assert all(float(g) <= 1.5 for _, g, r in probes if r == "ok")
    assert all(float(g) > 1.5 for _, g, r in probes if r == "oom")


def test_search_batch_size_doubling_then_binary():
    seen = []

    def fits(b):
        seen.append(b)
        return b <= 37

    assert batch_search.search_batch_size(fits, 4096) == 37
    assert seen[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert batch_search.search_batch_size(lambda b: True, 100) == 100
    assert batch_search.search_batch_size(lambda b: False, 100) == 0


def test_bad_cli_clear_error_no_traceback():
    p = subprocess.run([sys.executable, str(TRAIN), "--batch-size", "0"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "argument --batch-size: expected a positive integer, got '0'" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout


def test_help_exits_0():
    p = subprocess.run([sys.executable, str(TRAIN), "--help"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stdout.startswith("usage: train.py") and "--ckpt-every" in p.stdout


@pytest.mark.parametrize("argv,needle", [
    (["--profile-steps", "5"], "--profile-steps"),
    (["--profile-steps", "3:5"], "--profile-steps needs --profile-dir"),
    (["--data", "/nonexistent/file.txt"], "no such file"),
    (["--eval-every", "5"], "--eval-every needs a token folder"),
    (["--precision", "fp16", "--device", "cpu"], "fp16 needs CUDA"),
    (["--find-batch-size", "--device", "cpu"], "--mem-budget-gb"),
    (["--preset", "huge"], "invalid choice"),
    (["--lr", "-1"], "positive number"),
    (["--ckpt-every", "5"], "--ckpt-every needs --ckpt-dir"),
    (["--attention", "cudnn", "--device", "cpu"], "--attention cudnn needs CUDA"),
    (["--attention", "efficient", "--device", "cpu"], "--attention efficient needs CUDA"),
    (["--compile-mode", "reduce-overhead"], "--compile-mode needs --compile"),
    (["--compile-tune"], "--compile-tune needs --compile"),
    (["--ce-chunks", "-1"], "non-negative integer"),
])
def test_cli_validation(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


# The command line torchrig's launch, its integration tests and the docs pass: one flag a
# TrainConfig field, in this order (--help's), each with its default.
FLAGS = {
    "--preset": "tiny", "--seq-len": None, "--data": None, "--synthetic-samples": 8192,
    "--dropout": 0.0, "--batch-size": 8, "--grad-accum": 1, "--global-batch": None, "--lr": None,
    "--lr-ref-batch": 32,
    "--min-lr-ratio": 0.1, "--warmup-steps": None, "--weight-decay": 0.1, "--clip": 1.0,
    "--max-steps": None, "--epochs": None, "--seed": 1337, "--device": "auto",
    "--precision": "auto", "--compile": False, "--compile-mode": "default",
    "--compile-tune": False, "--attention": "auto",
    "--ce-chunks": 0, "--ce-kernel": "torch", "--deterministic": False, "--init-timeout": 600.0,
    "--eval-every": 0, "--eval-batches": 20, "--ckpt-dir": None, "--ckpt-every": 0, "--keep": 3,
    "--no-resume": False, "--log-every": 10,
    "--out-json": None, "--tensorboard": None, "--profile-steps": None, "--profile-dir": None,
    "--stop-after": None, "--dump-param-hash": False, "--dump-samples": None, "--find-batch-size": False,
    "--mem-budget-gb": None, "--max-batch-size": 4096,
}


def test_the_command_line_is_the_config():
    actions = [a for a in cli.build_parser()._actions if a.dest != "help"]
    assert {a.option_strings[0]: a.default for a in actions} == FLAGS
    assert list(FLAGS) == [cli.flag(f.name) for f in dataclasses.fields(config.TrainConfig)]
    assert all(a.help for a in actions)
    cfg = cli.parse_args(["--device", "cpu", "--preset", "gpt2", "--compile"])
    assert isinstance(cfg, config.TrainConfig) and cfg.compile and cfg.batch_size == 8
    assert (cfg.seq_len, cfg.lr) == (1024, 1e-4)  # the preset's
    assert config.TrainConfig(preset="gpt2", lr=1.0) == dataclasses.replace(cfg, compile=False,
                                                                            device="auto", lr=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0


def test_plan_and_position():
    cfg = cli.parse_args(["--device", "cpu", "--batch-size", "4", "--grad-accum", "2"])
    plan = train.Plan.of(cfg, world_size=2, steps_per_epoch=12)
    assert (plan.global_batch, plan.tokens_per_step, plan.steps_per_epoch) == (16, 16 * 64, 12)
    assert (plan.total_steps, plan.warmup, plan.peak_lr) == (12, 1, 1e-2 * 16 / 32)
    assert train.Plan.of(dataclasses.replace(cfg, max_steps=1000), 2, 12).total_steps == 1000
    assert train.Plan.of(dataclasses.replace(cfg, max_steps=1000, epochs=2), 2, 12).total_steps == 24
    assert train.Plan.of(cfg, 2, 0).steps_per_epoch == 0  # less than one global batch
    pos = train.Position(steps_per_epoch=12, step=12, epoch=0, step_in_epoch=12)
    assert pos.resume_point() == (1, 0) and train.Position(12, 5, 0, 5).resume_point() == (0, 5)


# ------------------------------------------------------------------ small pure functions


def test_lr_warmup_then_cosine():
    peak = optim.scaled_lr(1e-3, global_batch=128, ref_batch=32)
    assert peak == pytest.approx(4e-3)
    lrs = [optim.lr_at(s, peak, 10, 100, 0.1) for s in range(101)]
    assert lrs[0] == pytest.approx(peak / 10) and lrs[9] == pytest.approx(peak)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))  # linear warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # decay
    assert lrs[55] == pytest.approx(peak * 0.55, rel=1e-6)  # cosine midpoint
    assert lrs[100] == pytest.approx(peak * 0.1)


def test_peak_table_and_flops():
    assert model.device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert model.device_peak_flops("NVIDIA H200") == 989e12
    assert model.device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert model.device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert model.device_peak_flops("Tesla V100-SXM2-32GB") == 125e12
    assert model.device_peak_flops("NVIDIA A10G") == 70e12
    assert model.device_peak_flops("NVIDIA L4") == 121e12
    assert model.device_peak_flops("NVIDIA L40S") == 362e12
    assert model.device_peak_flops("Some Future GPU") is None
    m = model.build_model("gpt2", 1024)
    assert 123e6 < m.num_params() < 125e6  # GPT-2 124M (non-embedding-position count)
    assert model.flops_per_token(m, 1024) == 6 * m.num_params() + 12 * 12 * 12 * 64 * 1024


def test_rng_state_roundtrip_weights_only(tmp_path):
    import random
    random.seed(5)
    torch.manual_seed(5)
    rng = checkpoint.capture_rng(torch.device("cpu"))
    a = (random.random(), torch.rand(3))
    path = tmp_path / "r.pt"
    checkpoint.atomic_save({"rng": rng}, str(path))
    back = torch.load(path, weights_only=True)["rng"]
    random.seed(99)
    torch.manual_seed(99)
    checkpoint.restore_rng(back, torch.device("cpu"))
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_synthetic_data_is_deterministic_and_structured():
    ds = data.SyntheticCopyDataset(10, 32, seed=3)
    x1, y1 = ds[7]
    x2, y2 = data.SyntheticCopyDataset(10, 32, seed=3)[7]
    assert torch.equal(x1, x2) and torch.equal(x1[1:], y1[:-1])
    assert not torch.equal(ds[7][0], data.SyntheticCopyDataset(10, 32, seed=4)[7][0])
    seq = torch.cat([x1, y1[-1:]])
    period = next(p for p in range(2, 9) if torch.equal(seq[p:], seq[:-p]))
    assert 2 <= period <= 8 and int(seq.max()) < 256


# ------------------------------------------------------------------ speed options (issue 26)


@pytest.mark.parametrize("rows", [7, 64, 1000])
def test_chunked_cross_entropy_equals_the_whole_one_in_loss_and_both_gradients(rows):
    # fresh random inputs in float64; 7 does not divide the 96 tokens, 1000 is one chunk
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(96, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (96,), generator=g)
    ref = torch.nn.functional.cross_entropy(h @ w.t(), t)
    ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
    loss = model.ChunkedLinearCE.apply(h, w, t, rows, torch.float64)
    gh, gw = torch.autograd.grad(2.0 * loss, (h, w))  # the upstream gradient scales both
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(gh, 2.0 * ref_gh, atol=1e-12) and torch.allclose(gw, 2.0 * ref_gw,
                                                                          atol=1e-12)
    with torch.no_grad():
        no_grads = model.chunked_ce(h, w, t, rows, torch.float64, grads=False)
        assert no_grads[0].item() == pytest.approx(ref.item(), rel=1e-6)
        assert no_grads[1:] == (None, None)  # no gradient made


def test_the_model_with_chunked_cross_entropy_holds_no_logits_and_trains_the_same():
    x = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(2))
    runs = {}
    for chunks in (0, 5):  # 5 chunks of 39 tokens, the last of 36
        torch.manual_seed(0)
        m = model.build_model("tiny", 64, ce_chunks=chunks).double()
        logits, loss = m(x, y)
        loss.backward()
        runs[chunks] = (logits, loss.item(), {n: p.grad for n, p in m.named_parameters()})
    assert runs[0][0].shape == (3, 64, 256) and runs[5][0] is None
    assert runs[5][1] == pytest.approx(runs[0][1], rel=1e-6)
    grads0, grads5 = runs[0][2], runs[5][2]
    # the tied embedding / lm_head weight gets both of its gradients (the plain loss runs in
    # float32: logits.float())
    assert all(torch.allclose(grads5[n], grads0[n], rtol=1e-4, atol=1e-7) for n in grads0)
    unseen = sorted(set(range(256)) - set(x.flatten().tolist()))  # rows lm_head alone reaches
    assert unseen and grads5["transformer.wte.weight"][unseen].abs().amax(1).min() > 0


def test_attention_kernel_choice_leaves_that_one_alone_and_auto_leaves_torchs():
    switches = {n: getattr(torch.backends.cuda, s.replace("enable_", "") + "_enabled")
                for n, s in model.ATTENTION_KERNELS.items()}
    before = {n: f() for n, f in switches.items()}
    try:
        model.use_attention("math")
        assert {n: f() for n, f in switches.items()} == {
            "flash": False, "cudnn": False, "efficient": False, "math": True}
        model.use_attention("auto")  # changes nothing
        assert switches["math"]() and not switches["flash"]()
        q = torch.randn(1, 2, 8, 4)
        # only the math kernel is allowed, and it runs
        assert torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).shape \
            == q.shape
    finally:
        for n, s in model.ATTENTION_KERNELS.items():
            getattr(torch.backends.cuda, s)(before[n])


def test_speed_options_train_on_cpu_to_the_same_losses_and_say_so(tmp_path):
    """--ce-chunks and --attention math, and the Triton cross-entropy compiled with Inductor's
    kernels tuned (its kernel in Triton's interpreter: there is no GPU here; Inductor's CPU
    kernels are C++, which the tuning leaves as they are), give the plain run's losses; the
    config line and --out-json name the choices."""
    runs = {}
    for name, extra in (("plain", []), ("chunked", ["--ce-chunks", "3", "--attention", "math"]),
                        ("triton", ["--ce-kernel", "triton", "--compile", "--compile-tune"])):
        out = tmp_path / f"{name}.json"
        p = subprocess.run([sys.executable, str(TRAIN), "--device", "cpu", "--max-steps", "6",
                            "--log-every", "2", "--batch-size", "4", "--out-json", str(out),
                            *extra], cwd=REPO, env={**_env(), "TRITON_INTERPRET": "1"},
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, _fail_msg(p)
        runs[name] = (p.stdout, json.loads(out.read_text()))
    for name in ("chunked", "triton"):
        assert {s: float(v) for s, v in steps(runs[name][0]).items()} == pytest.approx(
            {s: float(v) for s, v in steps(runs["plain"][0]).items()}, abs=2e-4)
    assert " attention=math ce_chunks=3 ce_kernel=torch " in runs["chunked"][0]
    assert " compile=False attention=auto ce_chunks=0 ce_kernel=torch " in runs["plain"][0]
    assert " compile=default attention=auto ce_chunks=0 ce_kernel=triton compile_tune=True " \
        in runs["triton"][0]
    assert " ce_kernel=torch compile_tune=False " in runs["plain"][0]
    assert (runs["chunked"][1]["attention"], runs["chunked"][1]["ce_chunks"]) == ("math", 3)
    assert (runs["triton"][1]["compile"], runs["triton"][1]["ce_kernel"],
            runs["triton"][1]["compile_tune"]) == (True, "triton", True)
    assert runs["plain"][1]["compile_tune"] is False


@pytest.mark.parametrize("tune", [False, True])
def test_compile_tune_turns_on_inductors_coordinate_descent_alone(tune, monkeypatch):
    """--compile-tune is max-autotune's coordinate descent without its matmul search: the
    setting Inductor reads as it makes each kernel, on for the run; the mode is left as asked."""
    import torch._inductor.config as inductor_config
    cfg = config.TrainConfig(compile=True, compile_tune=tune, compile_mode="reduce-overhead")
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda m, mode: seen.update(mode=mode) or m)
    m = torch.nn.Linear(2, 2)
    # Inductor's own patch, not monkeypatch: monkeypatch's undo deletes a config entry
    with inductor_config.patch(coordinate_descent_tuning=False, max_autotune=False):
        assert train.compiled(m, cfg) is m
        assert seen == {"mode": "reduce-overhead"}
        assert (inductor_config.coordinate_descent_tuning,
                inductor_config.max_autotune) == (tune, False)
    assert inductor_config.coordinate_descent_tuning is False  # the test leaves it as it was


def test_the_triton_cross_entropy_is_refused_where_it_cannot_run(monkeypatch, capsys):
    """On CPU outside Triton's interpreter, and in a python without triton: one message, exit 2,
    before any model is built."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--device", "cpu", "--ce-kernel", "triton"])
    assert e.value.code == 2
    assert "--ce-kernel triton needs CUDA (on CPU only under Triton's interpreter" \
        in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli.parse_args(["--device", "cpu", "--ce-kernel", "triton"]).ce_kernel == "triton"
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--device", "cpu", "--ce-kernel", "triton"])
    assert e.value.code == 2
    assert "--ce-kernel triton needs the triton package in this python" in capsys.readouterr().err
