"""CPU tests for payload/allreduce_bench.py: real torchrun (gloo, 2 processes), a single-process
run, CLI errors, and the nccl-tests arithmetic against published nccl-tests rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch  # a test dependency (pyproject [test]): missing torch fails, never skips

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "payload" / "allreduce_bench.py"
sys.path.insert(0, str(BENCH.parent))
import allreduce_bench as ab  # noqa: E402

SIZES = [4096, 8192, 16384, 32768, 65536]
SMALL = ["--min-bytes", "4096", "--max-bytes", "65536", "--iters", "3"]


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(cmd, timeout=120):
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _fail_msg(p):
    return f"rc={p.returncode}\nSTDOUT:\n{p.stdout[-4000:]}\nSTDERR:\n{p.stderr[-4000:]}"


def _json_line(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(ab.JSON_PREFIX)]
    assert len(lines) == 1, stdout
    return json.loads(lines[0][len(ab.JSON_PREFIX):])


def _check_rows(doc, n):
    factor = 2 * (n - 1) / n
    assert [r["bytes"] for r in doc["rows"]] == SIZES
    for r in doc["rows"]:
        assert r["count"] == r["bytes"] // 4
        assert r["time_us"] > 0 and r["algbw_gbs"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / 1e9 / (r["time_us"] / 1e6))
        assert r["busbw_gbs"] == r["algbw_gbs"] * factor  # exactly
        assert r["wrong"] == 0
    bus = [r["busbw_gbs"] for r in doc["rows"]]
    assert doc["max_busbw_gbs"] == max(bus)
    assert doc["avg_busbw_gbs"] == pytest.approx(sum(bus) / len(bus))
    assert doc["wrong_total"] == 0


# ------------------------------------------------------------------ real torchrun, 2 ranks


@pytest.fixture(scope="module")
def torchrun_2():
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              "2", str(BENCH), *SMALL, "--json", "-"], timeout=180)
    assert p.returncode == 0, _fail_msg(p)
    return p


def test_torchrun_two_ranks_json(torchrun_2):
    doc = _json_line(torchrun_2.stdout)
    assert doc["backend"] == "gloo" and doc["device"] == "cpu" and doc["dtype"] == "float32"
    assert doc["world_size"] == 2 and doc["local_world_size"] == 2 and doc["nnodes"] == 1
    assert len(doc["hosts"]) == 2 and all(isinstance(h, str) and h for h in doc["hosts"])
    assert doc["bus_factor"] == 1.0
    _check_rows(doc, 2)
    assert all(r["busbw_gbs"] > 0 for r in doc["rows"])


def test_torchrun_table_printed_once_by_rank_0(torchrun_2):
    out = torchrun_2.stdout
    assert out.count("# Out of bounds values : 0 OK") == 1, out
    assert out.count("# Avg bus bandwidth") == 1
    for size in SIZES:
        rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] == [str(size)]]
        assert len(rows) == 1, out
        assert rows[0][1:4] == [str(size // 4), "float", "sum"] and rows[0][-1] == "0"
    assert "Traceback" not in out + torchrun_2.stderr


# ------------------------------------------------------------------ single process, world size 1


def test_single_process_world_of_one(tmp_path):
    out = tmp_path / "r.json"
    p = _run([sys.executable, str(BENCH), *SMALL, "--json", str(out)])
    assert p.returncode == 0, _fail_msg(p)
    assert ab.JSON_PREFIX not in p.stdout  # a file was asked for, not stdout
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 1 and doc["nnodes"] == 1 and doc["local_world_size"] == 1
    assert doc["bus_factor"] == 0.0 and len(doc["hosts"]) == 1
    _check_rows(doc, 1)
    assert all(r["busbw_gbs"] == 0.0 for r in doc["rows"])  # 2(n-1)/n = 0, as nccl-tests
    assert doc["max_busbw_gbs"] == 0.0 and doc["avg_busbw_gbs"] == 0.0
    assert "# busbw is not defined for fewer than 2 ranks" in p.stdout  # said, not implied
    assert [f for f in os.listdir(tmp_path)] == ["r.json"]  # no temp file left


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_wrong_elements_are_counted_and_fail(monkeypatch, capsys):
    """In process (world of one): a wrong expected sum makes every element wrong -> exit 1."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(ab, "check_values", lambda rank, n, dtype: (rank + 1, 7))
    rc = ab.main(["--backend", "gloo", "--min-bytes", "1K", "--max-bytes", "2K", "--iters", "1",
                  "--warmup", "0", "--dtype", "float16", "--json", "-"])
    assert rc == 1
    out = capsys.readouterr().out
    doc = _json_line(out)
    assert [r["wrong"] for r in doc["rows"]] == [512, 1024]
    assert doc["wrong_total"] == 1536 and doc["dtype"] == "float16"
    assert "# Out of bounds values : 1536 FAILED" in out


# ------------------------------------------------------------------ CLI errors


def test_backend_nccl_without_cuda_is_a_clear_error():
    p = _run([sys.executable, str(BENCH), "--backend", "nccl"])
    assert p.returncode != 0
    assert "--backend nccl needs CUDA" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout


@pytest.mark.parametrize("argv,needle", [
    (["--min-bytes", "2M", "--max-bytes", "1M"], "larger than --max-bytes"),
    (["--min-bytes", "lots"], "expected a size"),
    (["--min-bytes", "0"], "expected a positive size"),
    (["--min-bytes", "1", "--dtype", "bfloat16"], "at least one bfloat16 element"),
    (["--factor", "1"], "expected an integer >= 2"),
    (["--iters", "0"], "expected a positive integer"),
    (["--warmup", "-1"], "expected a non-negative integer"),
    (["--init-timeout", "0"], "expected a positive number"),
    (["--dtype", "int8"], "invalid choice"),
    (["--backend", "mpi"], "invalid choice"),
])
def test_cli_validation(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        ab.parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_defaults_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU defaults")
    a = ab.parse_args([])
    assert (a.backend, a.device_type, a.min_bytes, a.max_bytes, a.iters, a.warmup, a.factor,
            a.dtype, a.init_timeout) == ("gloo", "cpu", 1 << 20, 64 << 20, 5, 2, 2, "float32",
                                         60.0)
    assert ab.parse_size("1G") == 1 << 30 and ab.parse_size("64k") == 65536
    assert ab.parse_size("8MiB") == 8 << 20 and ab.parse_size("4096") == 4096


def test_cli_defaults_on_gpu_warm_up_as_nccl_tests(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    a = ab.parse_args([])
    assert (a.backend, a.device_type, a.warmup, a.iters) == ("nccl", "cuda", 5, 20)
    assert ab.parse_args(["--warmup", "0"]).warmup == 0


# ------------------------------------------------------------------ nccl-tests arithmetic


def test_bus_factor():
    assert [ab.allreduce_bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    with pytest.raises(ValueError):
        ab.allreduce_bus_factor(0)


@pytest.mark.parametrize("n,nbytes,time_us,algbw,busbw", [
    (8, 10737418240, 80956, 132.63, 232.10),  # published nccl-tests row, 8 GPUs
    (2, 1073741824, 268469, 4.00, 4.00),      # published nccl-tests row, 2 GPUs
])
def test_published_nccl_tests_rows(n, nbytes, time_us, algbw, busbw):
    alg, bus = ab.bandwidths(nbytes, time_us / 1e6, n)
    assert alg == pytest.approx(algbw, abs=0.02)
    assert bus == pytest.approx(busbw, abs=0.02)
    assert ab.algbw_gbs(nbytes, time_us / 1e6) == alg
    assert ab.busbw_gbs(alg, n) == bus == alg * 2 * (n - 1) / n


def test_four_ranks():
    alg, bus = ab.bandwidths(1 << 30, 0.01, 4)
    assert alg == pytest.approx(107.374, abs=1e-3)
    assert bus == alg * 1.5


def test_sweep_sizes():
    assert ab.sweep_sizes(4096, 65536, 2, 4) == SIZES
    assert ab.sweep_sizes(1 << 20, 64 << 20, 2, 4)[-1] == 64 << 20
    assert ab.sweep_sizes(1000, 9000, 3, 4) == [1000, 3000, 9000]
    assert ab.sweep_sizes(6, 54, 3, 4) == [4, 16, 52]  # rounded down to whole elements
    assert ab.sweep_sizes(3, 3, 2, 4) == []


def test_check_values_are_exact():
    assert ab.check_values(0, 2, torch.float32) == (1, 3)
    assert ab.check_values(1, 2, torch.float32) == (2, 3)
    assert ab.check_values(7, 8, torch.bfloat16) == (8, 36)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 2, 8, 22, 23, 63, 64, 300, 5000):
            vals = [ab.check_values(r, n, dtype) for r in range(n)]
            expected = {e for _, e in vals}
            assert len(expected) == 1
            total = sum(v for v, _ in vals)
            assert total == expected.pop() <= ab.exact_int_limit(dtype)
            # the expected sum is exact in the dtype
            assert torch.tensor(float(total), dtype=dtype).item() == total


def test_nnodes_from_env():
    assert ab.nnodes_from_env({}) == 1
    assert ab.nnodes_from_env({"GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "24"}) == 3
    assert ab.nnodes_from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2


def test_summarize():
    rows = [{"busbw_gbs": 1.0, "wrong": 0}, {"busbw_gbs": 3.0, "wrong": 2}]
    assert ab.summarize(rows) == {"max_busbw_gbs": 3.0, "avg_busbw_gbs": 2.0, "wrong_total": 2}
