"""The payload's side of elastic jobs (issue 25): a global batch fixed whatever the world size,
a data order defined over global batches, checkpoints on every node, and the world line."""

from __future__ import annotations

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
