"""torchrig.facts.nccl_tests and busbw against real nccl-tests captures."""

from __future__ import annotations

import pytest

from _fixtures import fixture
from torchrig.facts import busbw, nccl_tests



N03 = "nccl_03_all_reduce_perf_g8_8xA100_SXM4_40GB_oci_bm_gpu4_8.txt"
N04 = "nccl_04_all_reduce_perf_g2_2xRTX2080Ti_pcie_pix_autodl.txt"


# ------------------------------------------------------------------ busbw arithmetic


def test_busbw_factors():
    assert busbw.busbw_factor("all_reduce", 8) == pytest.approx(1.75)
    assert busbw.busbw_factor("all_reduce", 2) == pytest.approx(1.0)
    assert busbw.busbw_factor("all_reduce", 1) == 0.0
    assert busbw.busbw_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert busbw.busbw_factor("all_gather", 8) == pytest.approx(0.875)
    assert busbw.busbw_factor("alltoall", 8) == pytest.approx(0.875)
    assert busbw.busbw_factor("broadcast", 8) == 1.0
    assert busbw.busbw_factor("reduce", 8) == 1.0
    assert busbw.busbw_factor("sendrecv", 8) == 1.0
    with pytest.raises(ValueError):
        busbw.busbw_factor("all_reduce", 0)
    with pytest.raises(ValueError):
        busbw.busbw_factor("gossip", 4)


def test_op_aliases():
    for name in ("all_reduce", "allreduce", "AllReduce", "all_reduce_perf", "all-reduce"):
        assert busbw.canonical_op(name) == "all_reduce"
    assert busbw.canonical_op("ReduceScatter") == "reduce_scatter"
    assert busbw.canonical_op("all_gather_perf") == "all_gather"


def test_algbw_and_busbw():
    assert busbw.algbw(1e9, 1.0) == pytest.approx(1.0)
    assert busbw.algbw(10737418240, 80978e-6) == pytest.approx(132.597, abs=1e-3)
    assert busbw.busbw("all_reduce", 10737418240, 80978e-6, 8) == pytest.approx(232.044, abs=1e-3)
    with pytest.raises(ValueError):
        busbw.algbw(1, 0)


def _time_half_ulp(text: str) -> float:
    """Half a unit in the last printed digit of a time, in us."""
    if "." in text:
        return 0.5 * 10 ** -len(text.split(".")[1])
    return 0.5


def _check_row_arithmetic(row: nccl_tests.Row, n: int, op: str = "all_reduce") -> None:
    factor = busbw.busbw_factor(op, n)
    for half in (row.out_of_place, row.in_place):
        t = half.time_us * 1e-6
        alg = busbw.algbw(row.size, t)
        bus = busbw.busbw(op, row.size, t, n)
        # printed to 2 decimals, time printed to limited precision
        rel_t = _time_half_ulp(half.time_text) / half.time_us
        assert abs(alg - half.algbw_gbs) <= 0.005 + alg * rel_t + 1e-9, (row, half)
        assert abs(bus - half.busbw_gbs) <= 0.005 + bus * rel_t + 1e-9, (row, half)
        # and busbw = algbw * factor between the printed numbers themselves
        assert abs(half.algbw_gbs * factor - half.busbw_gbs) <= 0.005 * (1 + factor) + 1e-9


# ------------------------------------------------------------------ real captures


def test_nccl03_8xA100():
    r = nccl_tests.parse(fixture(N03))
    p = r.params
    assert (p.n_threads, p.n_gpus) == (1, 8)
    assert (p.min_bytes, p.max_bytes) == (10737418240, 10737418240)
    assert (p.step, p.step_kind) == (2, "factor")
    assert (p.warmup_iters, p.iters, p.agg_iters, p.validation, p.graph) == (5, 20, 1, 1, 0)
    assert len(r.devices) == 8 and r.nranks == 8
    d = r.devices[7]
    assert (d.rank, d.group, d.pid, d.host, d.device) == (7, 0, 1728, "a4bae1424041", 7)
    assert d.bus_id == "0000:da:00" and d.name == "NVIDIA A100-SXM4-40GB"
    assert len(r.rows) == 1
    row = r.rows[0]
    assert (row.size, row.count, row.type, row.redop, row.root) == (10737418240, 2684354560, "float", "sum", -1)
    assert row.out_of_place.time_us == 80978
    assert (row.out_of_place.algbw_gbs, row.out_of_place.busbw_gbs, row.out_of_place.wrong) == (132.60, 232.04, 0)
    assert (row.in_place.time_us, row.in_place.algbw_gbs, row.in_place.busbw_gbs) == (81154, 132.31, 231.54)
    assert r.avg_busbw_gbs == 231.793
    assert (r.out_of_bounds, r.out_of_bounds_ok) == (0, True)
    assert [(x.half, x.busbw_gbs) for x in r.samples()] == [("out-of-place", 232.04), ("in-place", 231.54)]
    assert not r.any_wrong
    _check_row_arithmetic(row, r.nranks)


def test_nccl04_2x2080ti_sweep():
    r = nccl_tests.parse(fixture(N04))
    assert r.params.n_gpus == 2 and r.params.max_bytes == 1073741824
    assert r.nranks == 2
    assert [d.bus_id for d in r.devices] == ["0000:b4:00", "0000:b5:00"]
    assert r.devices[0].host == "autodl-container-xxxxx"
    assert r.devices[0].name == "NVIDIA GeForce RTX 2080 Ti"
    assert len(r.rows) == 28
    assert [row.size for row in r.rows] == [8 * 2**i for i in range(28)]
    assert all(row.count * 4 == row.size for row in r.rows)  # float
    last = r.rows[-1]
    assert last.out_of_place.time_us == 268588 and last.in_place.busbw_gbs == 4.00
    assert r.rows[16].out_of_place.time_text == "150.2"
    assert r.avg_busbw_gbs == 2.05774
    assert r.out_of_bounds_ok is True
    for row in r.rows:
        _check_row_arithmetic(row, r.nranks)


@pytest.mark.parametrize("name", [N03, N04])
def test_avg_busbw_is_mean_of_all_halves(name):
    r = nccl_tests.parse(fixture(name))
    vals = [h.busbw_gbs for row in r.rows for h in (row.out_of_place, row.in_place)]
    # nccl-tests averages unrounded values; each printed one is within 0.005
    assert abs(sum(vals) / len(vals) - r.avg_busbw_gbs) <= 0.005


def test_crlf_and_trailing_space_variants_parse_the_same():
    text = fixture(N04)
    r1 = nccl_tests.parse(text)
    r2 = nccl_tests.parse("\r\n".join(ln + "  " for ln in text.split("\n")))
    assert r1 == r2


# ------------------------------------------------------------- other layouts (hand-trimmed)

# Current layout with "N/A" in-place #wrong (sendrecv, NVIDIA/nccl-tests style), no nThread line.
SENDRECV_NA = """\
#                                                              out-of-place                       in-place          
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       
   134217728      33554432     float     sum      -1   1211.2  110.81  110.81      0   1211.8  110.76  110.76    N/A
  1073741824     268435456     float     sum      -1   5503.4  195.10  195.10      0   5490.5  195.56  195.56    N/A
"""

# Older nccl-tests: no root column, "error" (max abs error) instead of #wrong, devices
# without "Group", bus id as [0x07], NCCL INFO lines mixed into the table.
OLD_LAYOUT = """\
# nThread 1 nGpus 1 minBytes 4096 maxBytes 16384 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
# Using devices
#   Rank  0 Pid  26528 on  dgx-work01 device  0 [0x07] NVIDIA A100-SXM4-40GB
#   Rank  1 Pid  26529 on  dgx-work01 device  1 [0x0a] NVIDIA A100-SXM4-40GB
#
#                                                       out-of-place                       in-place          
#       size         count      type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                       (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       
dgx-work01:26528:26528 [0] NCCL INFO Launch mode Parallel
        4096          1024     float     sum    93.73    0.04    0.04  1e-06    93.15    0.04    0.04  1e-06
        8192          2048     float     sum    96.51    0.08    0.08  0e+00    95.46    0.09    0.09  0e+00
       16384          4096     float     sum    96.70    0.17    0.17  1e-06    94.98    0.17    0.17  1e-06
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.0983333 
"""


def test_na_wrong_column():
    r = nccl_tests.parse(SENDRECV_NA)
    assert r.params is None and r.devices == () and r.nranks is None
    assert len(r.rows) == 2
    assert r.rows[0].out_of_place.wrong == 0
    assert r.rows[0].in_place.wrong is None
    assert r.rows[1].in_place.busbw_gbs == 195.56
    assert r.avg_busbw_gbs is None
    for row in r.rows:
        _check_row_arithmetic(row, 8, op="sendrecv")


def test_old_layout_no_root_error_column():
    r = nccl_tests.parse(OLD_LAYOUT)
    assert r.params.n_gpus == 1 and r.params.agg_iters is None and r.params.graph is None
    assert [(d.rank, d.group, d.host, d.bus_id) for d in r.devices] == [
        (0, None, "dgx-work01", "0x07"),
        (1, None, "dgx-work01", "0x0a"),
    ]
    assert r.nranks == 2
    assert len(r.rows) == 3
    row = r.rows[0]
    assert row.root is None and row.redop == "sum"
    assert row.out_of_place.wrong is None and row.out_of_place.error == 1e-06
    assert r.rows[1].in_place.error == 0.0
    assert r.avg_busbw_gbs == pytest.approx(0.0983333)
    for row in r.rows:
        _check_row_arithmetic(row, r.nranks)


def test_wrong_values_detected():
    text = SENDRECV_NA.replace("110.81      0   1211.8", "110.81     12   1211.8")
    r = nccl_tests.parse(text)
    assert r.rows[0].out_of_place.wrong == 12
    assert r.any_wrong


def test_command():
    assert nccl_tests.command() == ["all_reduce_perf", "-b", "8", "-e", "8G", "-f", "2", "-g", "1"]
    argv = nccl_tests.command("AllGather", min_bytes="1M", max_bytes="1G", gpus=8, check=0, binary_dir="/opt/nccl-tests/build/")
    assert argv[0] == "/opt/nccl-tests/build/all_gather_perf"
    assert argv[-2:] == ["-c", "0"] and "-g" in argv and argv[argv.index("-g") + 1] == "8"


def test_non_finite_values_are_not_measurements():
    """A row whose busbw reads inf/nan/1e999 is not a measurement: it used to be kept
    (inf passes every threshold); an unreadable average is None, not a ValueError."""
    text = ("#       size         count      type   redop    root     time   algbw   busbw #wrong"
            "     time   algbw   busbw #wrong\n"
            "     8388608       2097152     float     sum      -1    100.0   83.89  1e999      0"
            "    100.0   83.89  157.29      0\n"
            "    16777216       4194304     float     sum      -1    200.0   83.89  157.29      0"
            "    200.0   83.89     nan      0\n"
            "    33554432       8388608     float     sum      -1    300.0   111.8  209.7      0"
            "    300.0   111.8  209.7      0\n"
            "# Avg bus bandwidth    : 1.2.3\n")
    res = nccl_tests.parse(text)
    assert [r.size for r in res.rows] == [33554432]
    assert {x.busbw_gbs for x in res.samples()} == {209.7} and res.avg_busbw_gbs is None


# ------------------------------------------------------------------ rank count (issue 11)

_MPI_NO_DEVICES = """\
# nThread 1 nGpus 1 minBytes 1073741824 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
  1073741824     268435456     float     sum      -1   9306.7  115.37  201.90      0   9291.5  115.56  202.23      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 202.065
"""


def test_no_device_lines_rank_count_is_unknown_not_nthread_times_ngpus():
    """mpirun -np 8 ... -g 1 with the device lines lost: nThread 1 x nGpus 1 is one process's
    share, not the communicator (the old code said 1 rank)."""
    r = nccl_tests.parse(_MPI_NO_DEVICES)
    assert r.devices == () and r.nranks is None


def test_rank_count_from_nccls_init_lines():
    old = "node1:1234:1234 [0] NCCL INFO comm 0x5581d4a0 rank 0 nranks 16 cudaDev 0 busId 7000 - Init COMPLETE\n"
    new = ("h100-2:895544:895544 [0] NCCL INFO comm 0x55d0c2b0 rank 3 nRanks 16 nNodes 2 "
           "localRanks 8 localRank 3 MNNVL 0\n")
    assert nccl_tests.parse(old + _MPI_NO_DEVICES).nranks == 16
    assert nccl_tests.parse(_MPI_NO_DEVICES + new).nranks == 16
    # device lines win: one per rank
    assert nccl_tests.parse(fixture(N03) + old).nranks == 8


def test_mpirun_tag_output_prefix():
    """mpirun --tag-output: every line starts with [jobid,rank]<stdout>:. The old parser saw
    no device lines and no rows at all."""
    tagged = "".join(f"[1,0]<stdout>:{ln}\n" for ln in fixture(N03).splitlines())
    r = nccl_tests.parse(tagged)
    assert r.nranks == 8 and len(r.rows) == 1 and r.avg_busbw_gbs == 231.793


# ------------------------------------------------- outputs cut short, failed, or named only at the end

N05 = "nccl_05_all_reduce_perf_g4_4xRTX4090_test_nccl_failure_3_devices_shown.txt"
N06 = "nccl_06_all_reduce_perf_multinode_test_nccl_failure_after_17G.txt"
N08 = "nccl_08_all_reduce_perf_mpirun_2nodes_nccl_warn_connection_closed.txt"
N09 = "nccl_09_rccl_all_reduce_perf_tail_collective_concluded.txt"
N10 = "nccl_10_all_reduce_perf_2x8xH100_device_list_cut_short.txt"


def test_rank_count_from_the_highest_rank_when_the_device_list_is_cut_short():
    """The highest `Rank N` line says there are at least N+1 ranks, whatever number of
    device lines survived. Derived from a real 2x8 H100 list (nccl_10, itself cut off at
    rank 12): the view starts at rank 8, as a paste or a scrollback does. The old count was
    one per device line: 5."""
    text = fixture(N10)
    assert nccl_tests.parse(text).nranks == 13
    cut = "\n".join(ln for ln in text.splitlines()
                    if not any(f"Rank  {i} " in ln for i in range(8)))
    r = nccl_tests.parse(cut)
    assert len(r.devices) == 5 and r.nranks == 13


def test_collective_named_only_in_the_closing_line():
    """nccl-tests (and rccl-tests) close with '# Collective test concluded: all_reduce_perf';
    a capture that lost its head names the collective only there."""
    r = nccl_tests.parse(fixture(N09))
    assert r.collective == "all_reduce_perf"
    assert len(r.rows) == 4 and r.avg_busbw_gbs == pytest.approx(142.652)


def test_test_failure_and_nccl_warn_lines_are_read():
    assert nccl_tests.parse(fixture(N03)).failures == ()
    r = nccl_tests.parse(fixture(N05))
    assert r.failures[0] == "c2211f46f318: Test NCCL failure common.cu:1005 'unhandled CUDA error'"
    assert ".. c2211f46f318 pid 3288: Test failure common.cu:891" in r.failures
    r = nccl_tests.parse(fixture(N06))
    assert len(r.rows) == 5 and len(r.failures) == 8
    r = nccl_tests.parse(fixture(N08))
    assert r.failures == ("NCCL failure common.cu:921 'unhandled system error'",)
    assert r.warnings == ("server1:6601:6625 [0] include/socket.h:385 NCCL WARN Net : Connection "
                          "closed by remote peer",)
    cuda = "gpu1: Test CUDA failure common.cu:892 'out of memory'\n"
    assert nccl_tests.parse(fixture(N04) + cuda).failures == (cuda.strip(),)
