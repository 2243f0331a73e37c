"""The payload's side of elastic jobs (issue 25): a global batch fixed whatever the world size,
a data order defined over global batches, checkpoints on every node, and the world line."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = REPO / "payload"
sys.path.insert(0, str(PAYLOAD))
import cli  # noqa: E402
import data  # noqa: E402
import global_batch as gb  # noqa: E402
import progress  # noqa: E402
import train  # noqa: E402

# ---- the global batch -------------------------------------------------------------------------


def test_grad_accum_follows_the_world_size():
    assert gb.grad_accum_for(32, 4, 4) == 2
    assert gb.grad_accum_for(32, 4, 2) == 4
    assert gb.grad_accum_for(32, 4, 8) == 1
    assert gb.grad_accum_for(32, 4, 1) == 8


def test_a_global_batch_that_does_not_divide_names_the_numbers_and_what_divides():
    with pytest.raises(gb.BatchError) as e:
        gb.grad_accum_for(30, 4, 4)
    msg = str(e.value)
    assert msg.startswith("--global-batch 30 is not a multiple of --batch-size 4 x world size 4 "
                          "(= 16 samples per micro-step)"), msg
    assert "a multiple of 16 (16 or 32)" in msg
    assert "world size" in msg and "--batch-size" in msg
    with pytest.raises(gb.BatchError) as e:
        gb.grad_accum_for(32, 4, 3)  # 32 samples cannot be split over 3 ranks
    assert "(24 or 36)" in str(e.value) and "a world size of 1, 2, 4, 8" in str(e.value)
    with pytest.raises(gb.BatchError) as e:
        gb.grad_accum_for(36, 8, 3)  # 12 per rank: a micro-batch of 6 fits
    assert "--batch-size 6 (a divisor of 12, the samples per rank)" in str(e.value)
    with pytest.raises(gb.BatchError):
        gb.grad_accum_for(8, 4, 4)  # smaller than one micro-step of every rank
    assert gb.valid_world_sizes(24, 4) == [1, 2, 3, 6] and gb.valid_world_sizes(6, 4) == []


def test_the_command_line_derives_grad_accum_from_torchruns_world_size(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = cli.parse_args(["--device", "cpu", "--batch-size", "4", "--global-batch", "32"])
    assert (cfg.grad_accum, cfg.global_batch) == (4, 32)
    assert cli.parse_args(["--device", "cpu", "--grad-accum", "3"]).grad_accum == 3  # as before
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--device", "cpu", "--batch-size", "4", "--global-batch", "36"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: --global-batch 36 is not a multiple of --batch-size 4 "
                          "x world size 2") and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", "--global-batch", "32", "--grad-accum", "2"])
    assert "drop --grad-accum" in capsys.readouterr().err
    monkeypatch.delenv("RANK")  # no torchrun: one process
    assert cli.parse_args(["--device", "cpu", "--batch-size", "4",
                           "--global-batch", "32"]).grad_accum == 8


def test_a_global_batch_that_does_not_divide_exits_before_training():
    env = {"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "3", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(PAYLOAD / "train.py"), "--device", "cpu",
                        "--batch-size", "4", "--global-batch", "32"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("train.py: error: --global-batch 32 is not a multiple")
    assert "Traceback" not in p.stderr and "start rank" not in p.stdout


# ---- the data order over global batches -------------------------------------------------------



@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_steps_samples_do_not_depend_on_the_world_size(world_size):
    ds = data.SyntheticCopyDataset(100, 8)
    accum = 8 // world_size  # global batch 16 = 2 x world_size x accum

    def source(rank):
        return data.SampledDataset(ds, seed=5, rank=rank, world_size=world_size, batch_size=2,
                                   grad_accum=accum)
    order = data.ShuffledOrder(100, 16, seed=5)
    assert source(0).steps_per_epoch == order.steps_per_epoch == 6  # 100 // 16
    for step in (0, 5, 6, 13):  # the first epoch's first and last, the next epochs'
        shares = [source(r).rank_ids(step) for r in range(world_size)]
        assert all(len(s) == accum and all(len(m) == 2 for m in s) for s in shares)
        got = sorted(i for s in shares for m in s for i in m)
        assert got == sorted(order.step_ids(step)) and len(set(got)) == 16
    epoch0 = [i for k in range(6) for i in order.step_ids(k)]
    assert len(set(epoch0)) == 96  # an epoch: each sample at most once
    assert order.step_ids(6) != order.step_ids(0)  # a new permutation each epoch
    assert data.ShuffledOrder(100, 16, seed=6).step_ids(0) != order.step_ids(0)


def test_rank_share_splits_by_micro_step_then_rank():
    ids = list(range(8))
    assert data.rank_share(ids, 0, 2, 2) == [[0, 1], [4, 5]]
    assert data.rank_share(ids, 1, 2, 2) == [[2, 3], [6, 7]]
    assert data.rank_share(ids, 0, 4, 2) == [[0, 1]]


def test_the_schedule_continues_by_step_at_any_world_size(monkeypatch):
    """With --global-batch fixed, the plan (peak LR, warmup, total steps, steps per epoch) and so
    the LR of every step are the same at 4 ranks and at 2."""
    plans = []
    for w in (4, 2):
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(w))
        cfg = cli.parse_args(["--device", "cpu", "--batch-size", "2", "--global-batch", "16"])
        src = data.SampledDataset(data.SyntheticCopyDataset(500, 8), cfg.seed, 0, w,
                                  cfg.batch_size, cfg.grad_accum)
        plans.append(train.Plan.of(cfg, w, src.steps_per_epoch))
    assert plans[0] == plans[1] and plans[0].global_batch == 16 and plans[0].total_steps == 31


# ---- a run across world sizes: 4 ranks -> 2 ranks (node 0 lost) -> 4 ranks -----------------------
# torchrun on the CPU (gloo), as the launch runs it. A "node" is one torchrun agent with its own
# --ckpt-dir; two agents on this machine make a 2-node world (static rendezvous, node 0 hosting
# the store), so the loss of node 0 and its folder is real to the run.

RUN = ["--device", "cpu", "--deterministic", "--seq-len", 16, "--batch-size", 2,
       "--global-batch", 16, "--synthetic-samples", 80, "--max-steps", 12, "--log-every", 1,
       "--ckpt-every", 4, "--keep", 2]
STEP_LOSS = re.compile(r"^step=(\d+) loss=(\S+)", re.M)


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHRIG_DATA")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


def _agent(args, nproc, node_rank=None, nnodes=1, port=None):
    """One torchrun agent of train.py: standalone, or node `node_rank` of `nnodes`."""
    where = (["--standalone"] if node_rank is None else
             ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr",
              "127.0.0.1", "--master-port", str(port)])
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *where,
                             "--nproc-per-node", str(nproc), str(PAYLOAD / "train.py"),
                             *map(str, RUN), *map(str, args)],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _run(*agents):
    """Wait for the agents; node 0's output (rank 0's lines). An agent left running (its peer
    never came) is ended with its workers (its own process group)."""
    try:
        outs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-4000:]
    return outs[0]


def _two_nodes(tmp, args):
    port = _free_port()
    return _run(*(_agent([*args, "--ckpt-dir", tmp / f"node{n}"], 2, n, 2, port)
                  for n in (0, 1)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _consumed(folder):
    """{global step: (world size, sorted sample ids of every rank)} from --dump-samples."""
    got = {}
    for f in sorted(folder.glob("samples.rank*")):
        for line in f.read_text().splitlines():
            fields = dict(kv.split("=", 1) for kv in line.split())
            world, ids = got.setdefault(int(fields["step"]), (int(fields["world_size"]), []))
            assert world == int(fields["world_size"]), f"step {fields['step']} trained twice"
            ids.extend(map(int, fields["ids"].split(",")))
    return {k: (w, sorted(ids)) for k, (w, ids) in got.items()}


def test_a_run_resized_4_2_4_trains_every_step_on_the_same_samples(tmp_path):
    ref = _run(_agent(["--dump-samples", tmp_path / "ref", "--ckpt-dir", tmp_path / "ref"], 4))
    el = tmp_path / "el"
    dump = ["--dump-samples", el / "samples"]
    first = _two_nodes(el, [*dump, "--stop-after", 5])
    shutil.rmtree(el / "node0")  # node 0 is lost, and its checkpoints with it
    second = _run(_agent([*dump, "--stop-after", 9, "--ckpt-dir", el / "node1"], 2))
    third = _two_nodes(el, dump)  # node 0 is back, with an empty folder

    want, got = _consumed(tmp_path / "ref"), _consumed(el / "samples")
    assert sorted(want) == sorted(got) == list(range(12))
    for k in range(12):
        assert got[k][1] == want[k][1] and len(set(want[k][1])) == 16, f"step {k}"
    assert [got[k][0] for k in range(12)] == [4] * 5 + [2] * 4 + [4] * 3
    # the world lines say what changed; the global batch is the same
    assert progress.parse_world(_line(first, "world")) == dict(
        step=0, world_size=4, nodes=2, global_batch=16, micro_batch=2, grad_accum=2)
    assert _line(second, "world") == ("world step=5 world_size=2 nodes=1 global_batch=16 "
                                      "micro_batch=2 grad_accum=4 from=4")
    assert _line(third, "world") == ("world step=9 world_size=4 nodes=2 global_batch=16 "
                                     "micro_batch=2 grad_accum=2 from=2")
    assert "resume step=9 " in third  # node 1's newest, shipped to node 0's ranks
    assert _line(ref, "done").startswith("done step=12 ") and _line(third, "done").startswith(
        "done step=12 ")
    # the same run: the loss of every step as the uninterrupted run's, up to summation order
    losses = {int(s): float(v) for out in (first, second, third)
              for s, v in STEP_LOSS.findall(out)}
    ref_losses = {int(s): float(v) for s, v in STEP_LOSS.findall(ref)}
    assert sorted(losses) == sorted(ref_losses) == list(range(1, 13))
    assert all(losses[s] == pytest.approx(ref_losses[s], rel=1e-3) for s in losses), (
        losses, ref_losses)
    # every node keeps a copy
    assert (el / "node0" / "ckpt_00000012.pt").exists()
    assert (el / "node1" / "ckpt_00000012.pt").exists()


def _line(out, kind):
    return next(ln for ln in out.splitlines() if progress.parse(ln, (kind,)))
