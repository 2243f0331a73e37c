"""verify's judgement from fact tables: real nvidia-smi/topo outputs in, PASS/FAIL out."""

import re
from pathlib import Path

from torchrig.verify import evaluate
from torchrig.verify.evaluate import FAIL, NOT_RUN, PASS, WARN

FIX = Path(__file__).resolve().parents[1] / "fixtures"
TOPO_H100 = (FIX / "topo_08_h100x8_nv18_mlengineering.txt").read_text()
TOPO_PHB = (FIX / "topo_01_2x1080ti_consumer_phb.txt").read_text()


def smi_rows(n, name="NVIDIA H100 80GB HBM3", ecc=0, pers="Enabled", width=16):
    row = ("{i}, {name}, GPU-{i}, 00000000:{i:02X}:00.0, 570.172.08, 81559, {pers}, Enabled, {ecc}, "
           "5, 5, {w}, 16, 0, 1, 9.0")
    return "\n".join(row.format(i=i, name=name, ecc=ecc if i == 1 else 0, pers=pers, w=width)
                     for i in range(n)) + "\n"


def facts(n=8, topo=TOPO_H100, fm="active", **over):
    f = {"smi_query": {"rc": 0, "out": smi_rows(n), "err": ""},
         "topo": {"rc": 0, "out": topo, "err": ""}, "fabricmanager": fm,
         "packages": {"nvidia-open": "570.172.08-1", "libnccl2": "2.26.2-1+cuda12.8"},
         "cuda_toolkit": "12.8.93", "venv_exists": True, "dists": {"torch": "2.13.0+cu128"},
         "python": "3.11.2",
         "torch_runtime": {"torch": "2.13.0+cu128", "cuda": "12.8", "device_count": n, "nccl": "2.26.2"}}
    f.update(over)
    return f


def statuses(v):
    return {c.name: c.status for c in v.checks}


def test_healthy_h100_box_passes():
    v = evaluate.host_verdict("a", facts(), 8, "cuda")
    assert v.status == PASS, v.checks
    assert v.topology == "nvswitch" and v.versions["driver"] == "570.172.08"
    assert v.versions["gpus"] == 8 and v.versions["nccl"] == "2.26.2-1+cuda12.8"


def test_nvswitch_without_fabric_manager_fails_with_reason():
    v = evaluate.host_verdict("a", facts(fm="inactive"), 8, "cuda")
    assert statuses(v)["topology"] == FAIL and v.status == FAIL
    assert "nvidia-fabricmanager" in [c for c in v.checks if c.name == "topology"][0].detail


def test_driver_library_mismatch_is_reported_and_dependent_checks_not_run():
    out = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 570.172\n"
    v = evaluate.host_verdict("a", facts(smi_query={"rc": 18, "out": out, "err": ""}), 8, "cuda")
    st = statuses(v)
    assert st["driver"] == FAIL and "reboot" in [c for c in v.checks if c.name == "driver"][0].detail.lower()
    assert st["gpu-count"] == NOT_RUN and st["topology"] == NOT_RUN
    assert v.status == FAIL


def test_gpu_count_ecc_persistence_pcie():
    f = facts(n=7, smi_query={"rc": 0, "out": smi_rows(7, ecc=3, pers="Disabled", width=8), "err": ""})
    st = statuses(evaluate.host_verdict("a", f, 8, "cuda"))
    assert st["gpu-count"] == FAIL and st["ecc"] == FAIL
    assert st["persistence"] == WARN and st["pcie"] == WARN


def test_cpu_torch_on_a_cuda_host_fails_but_is_fine_with_accelerator_cpu():
    rt = {"torch": "2.13.0+cpu", "cuda": None, "device_count": 0, "nccl": None}
    assert statuses(evaluate.host_verdict("a", facts(torch_runtime=rt), 8, "cuda"))["torch"] == FAIL
    assert statuses(evaluate.host_verdict("a", facts(torch_runtime=rt), 8, "cpu"))["torch"] == PASS


def test_sys_links_advise_gradient_accumulation():
    v = evaluate.host_verdict("a", facts(n=2, topo=TOPO_PHB,
                                         smi_query={"rc": 0, "out": smi_rows(2, "GeForce GTX 1080 Ti"), "err": ""},
                                         torch_runtime={"torch": "2", "cuda": "12.8", "device_count": 2}),
                              2, "cuda")
    assert v.topology == "cpu" and any("accumulation" in a for a in v.advice)


def test_version_gate_names_the_odd_one_out():
    a = evaluate.host_verdict("a", facts(), 8, "cuda")
    b = evaluate.host_verdict("b", facts(), 8, "cuda")
    c = evaluate.host_verdict("c", facts(dists={"torch": "2.12.1+cu128"}), 8, "cuda")
    status, table, reasons = evaluate.version_gate([a, b, c])
    assert status == FAIL and table["torch"] == {"a": "2.13.0+cu128", "b": "2.13.0+cu128", "c": "2.12.1+cu128"}
    assert reasons == ["torch differs: most hosts have 2.13.0+cu128; c has 2.12.1+cu128"]
    assert evaluate.version_gate([a, b])[0] == PASS


def test_version_gate_compares_the_nccl_torch_bundles():
    """DDP uses torch's own NCCL: equal torch versions from different wheels (or a torch that
    found another libnccl) can still differ there, and libnccl2 says nothing about it."""
    rt = {"torch": "2.13.0+cu128", "cuda": "12.8", "device_count": 8}
    a = evaluate.host_verdict("a", facts(torch_runtime={**rt, "nccl": "2.26.2"}), 8, "cuda")
    b = evaluate.host_verdict("b", facts(torch_runtime={**rt, "nccl": "2.27.3"}), 8, "cuda")
    c = evaluate.host_verdict("c", facts(torch_runtime={**rt, "nccl": "2.26.2"}), 8, "cuda")
    status, table, reasons = evaluate.version_gate([a, b, c])
    assert status == FAIL and reasons == ["torch_nccl differs: most hosts have 2.26.2; b has 2.27.3"]


def test_version_gate_reason_says_unknown_for_a_host_that_could_not_tell():
    a = evaluate.host_verdict("a", facts(), 8, "cuda")
    b = evaluate.host_verdict("b", facts(cuda_toolkit=None), 8, "cuda")
    status, _, reasons = evaluate.version_gate([a, b, evaluate.host_verdict("c", facts(), 8, "cuda")])
    assert status == FAIL
    assert [r for r in reasons if r.startswith("cuda ")] == [
        f"cuda differs: most hosts have {a.versions['cuda']}; b has unknown"]


def test_version_gate_table_says_unknown_and_where_each_version_comes_from(monkeypatch):
    import io

    from rich.console import Console

    from torchrig import tables
    v = evaluate.host_verdict("h200", facts(cuda_toolkit=None), 8, "cuda")
    out = io.StringIO()
    from torchrig.verify.run import VerifyReport
    rep = VerifyReport(hosts=[v], gate=evaluate.version_gate([v]))
    monkeypatch.setattr(tables, "console", Console(file=out, width=200))
    tables.verify_report(rep)
    text = out.getvalue()
    assert "None" not in text
    assert "cuda toolkit │ unknown" in text and "libnccl2     │ 2.26.2-1+cuda12.8" in text
    assert "torch's nccl │ 2.26.2" in text


def test_unreadable_network_and_missing_venv():
    f = facts(venv_exists=False, dists={},
              network={"address": "10.0.0.1", "port": 29400, "resolved": "10.0.0.1", "reachable": False,
                       "connect_error": "timed out"})
    st = statuses(evaluate.host_verdict("a", f, 8, "cuda"))
    assert st["torch"] == FAIL and st["network"] == FAIL


def test_bandwidth_check_recomputes_busbw_from_raw_numbers():
    # nccl-tests published row: 8 GPUs, 10 GiB in 80956 us -> busbw 232.10 GB/s
    res = {"world_size": 8, "wrong_total": 0,
           "rows": [{"bytes": 10737418240, "time_us": 80956.0, "busbw_gbs": 999.0}]}
    chk = evaluate.bandwidth_check("bw", res, "nvswitch", "NVIDIA A100-SXM4-40GB", None)
    assert chk.status == PASS and "busbw 232.1" in chk.detail  # not the payload's 999
    slow = {**res, "rows": [{"bytes": 10737418240, "time_us": 200000.0}]}
    assert evaluate.bandwidth_check("bw", slow, "nvswitch", "A100", None).status == FAIL
    assert evaluate.bandwidth_check("bw", slow, "nvswitch", "A100", {"nvswitch": 50}).status == PASS
    assert evaluate.bandwidth_check("bw", None, "nvswitch", "", None, "ssh died").status == NOT_RUN
    assert evaluate.bandwidth_check("bw", {**res, "wrong_total": 4}, "nvswitch", "", None).status == FAIL


def test_benchmark_copy_goes_to_a_private_folder_removed_afterwards(tmp_path):
    """verify --bandwidth's command, run for real with a stand-in python: the benchmark arrives
    on stdin in a fresh 0700 folder (no fixed /tmp path to plant a symlink in), then is gone."""
    import os
    import subprocess
    from torchrig.verify.run import BENCH, HostOpts, _bench_cmd
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").write_text(
        "#!/bin/sh\nfor a; do case $a in *allreduce_bench.py) f=$a;; esac; done\n"
        "stat -c '%a %U' \"$(dirname \"$f\")\" > \"$OUT\"; echo \"$f\" >> \"$OUT\"; "
        "cmp -s \"$f\" \"$EXPECT\" && echo same >> \"$OUT\"; echo \"$@\" >> \"$OUT\"\n")
    (venv / "bin/python").chmod(0o755)
    cmd = _bench_cmd(HostOpts(str(venv), "/opt/torchrig", "cpu", 29400, {}, "10.0.0.1"), 2,
                     ["--standalone"], {})
    tmpdir = tmp_path / "t"
    tmpdir.mkdir()
    out = tmp_path / "out"
    subprocess.run(["bash", "-c", cmd], input=BENCH.read_text(), text=True, check=True,
                   env={**os.environ, "TMPDIR": str(tmpdir), "OUT": str(out), "EXPECT": str(BENCH)})
    mode, path, same, argv = out.read_text().splitlines()
    assert mode.split()[0] == "700" and path.startswith(f"{tmpdir}/tmp.") and same == "same"
    assert f"--nproc-per-node 2 {path} --min-bytes" in argv
    assert list(tmpdir.iterdir()) == []  # removed when the command ended


# ---------------------------------------------------------------- busbw that cannot be fooled

from torchrig.facts import nccl_tests  # noqa: E402

NCCL03 = (FIX / "nccl_03_all_reduce_perf_g8_8xA100_SXM4_40GB_oci_bm_gpu4_8.txt").read_text()
NCCL04 = (FIX / "nccl_04_all_reduce_perf_g2_2xRTX2080Ti_pcie_pix_autodl.txt").read_text()
GiB = 1 << 30


def _row(size, t_oop, bw_oop, t_ip, bw_ip):
    return (f"{size:>12d} {size // 4:>13d}     float     sum      -1 {t_oop:>8} {0:>7.2f} {bw_oop:>7.2f}"
            f"      0 {t_ip:>8} {0:>7.2f} {bw_ip:>7.2f}      0\n")


def _nccl(devices, rows):
    head = "# nThread 1 nGpus %d minBytes 8 maxBytes %d step: 2(factor) warmup iters: 5 iters: 20 " \
           "agg iters: 1 validation: 1 graph: 0\n#\n# Using devices\n" % (devices, GiB)
    head += "".join(f"#  Rank {i:2d} Group  0 Pid   1728 on box device {i:2d} [0x{i:02x}] "
                    f"Tesla V100-SXM2-32GB\n" for i in range(devices))
    head += ("#       size         count      type   redop    root     time   algbw   busbw #wrong"
             "     time   algbw   busbw #wrong\n")
    return head + "".join(rows)


def test_real_captures_pass_at_the_size_the_threshold_is_defined_for():
    chk = evaluate.nccl_tests_check(nccl_tests.parse(NCCL03), "nvswitch", "NVIDIA A100-SXM4-40GB",
                                    8, None)
    assert chk.status == PASS and "busbw 231.790 GB/s at 10737418240 B over 8 ranks" in chk.detail
    assert "nccl-tests#175" in chk.detail  # the machine row, with its source
    chk = evaluate.nccl_tests_check(nccl_tests.parse(NCCL04), "pcie-switch",
                                    "NVIDIA GeForce RTX 2080 Ti", 2, None)
    assert chk.status == PASS and f"at {GiB} B over 2 ranks" in chk.detail


def test_one_rank_is_not_run_never_pass():
    one = _nccl(1, [_row(GiB, 150.0, 0.0, 2.0, 0.0)])
    chk = evaluate.nccl_tests_check(nccl_tests.parse(one), "nvswitch", "", 1, {"nvswitch": 0})
    assert chk.status == NOT_RUN and "not defined below 2" in chk.detail
    res = {"world_size": 1, "wrong_total": 0, "rows": [{"bytes": GiB, "time_us": 5000.0}]}
    assert evaluate.bandwidth_check("bw", res, "nvswitch", "", {"nvswitch": 0}).status == NOT_RUN


def test_peak_at_a_mid_size_does_not_pass_a_slow_large_size():
    """Old code: max over every size and both halves (60 at 64 MiB) passed an 8x V100 box
    that runs at 25 GB/s where it matters."""
    text = _nccl(8, [_row(64 << 20, 1900, 60.0, 1900, 60.0), _row(GiB, 75000, 25.0, 75100, 25.0)])
    chk = evaluate.nccl_tests_check(nccl_tests.parse(text), "nvlink", "Tesla V100-SXM2-32GB", 8, None)
    assert chk.status == FAIL and f"busbw 25.000 GB/s at {GiB} B" in chk.detail
    assert "min 95 for nvlink" in chk.detail  # the 8x V100-SXM2 row, not the generic 20


def test_no_op_half_is_flagged_and_left_out():
    """A 1 GiB in-place reduce 'taking' 0.19 us (seen on real machines): busbw in the millions.
    The old code took the max and passed; now that half is flagged and the other half judged."""
    text = _nccl(8, [_row(GiB, 75000, 25.0, "0.19", 9868000.0)])
    chk = evaluate.nccl_tests_check(nccl_tests.parse(text), "nvlink", "Tesla V100-SXM2-32GB", 8, None)
    assert chk.status == FAIL and "busbw 25.000" in chk.detail
    assert "invalid, left out" in chk.detail and "in-place 0.19 us" in chk.detail
    # both halves no-ops: nothing valid is left at the size that counts
    both = _nccl(8, [_row(1 << 20, 40.0, 45.0, 40.0, 45.0), _row(GiB, "0.2", 9e6, "0.19", 9e6)])
    chk = evaluate.nccl_tests_check(nccl_tests.parse(both), "nvlink", "Tesla V100-SXM2-32GB", 8, None)
    assert chk.status == NOT_RUN and "invalid" in chk.detail


def test_payload_no_op_and_short_sweep_are_not_run():
    ok = {"bytes": 1 << 20, "time_us": 900.0}
    noop = {"world_size": 8, "wrong_total": 0, "rows": [ok, {"bytes": GiB, "time_us": 0.19}]}
    chk = evaluate.bandwidth_check("bw", noop, "nvswitch", "NVIDIA H100 80GB HBM3", None, gpu_count=8)
    assert chk.status == NOT_RUN and "invalid" in chk.detail  # old code: busbw 9.9e6, PASS
    short = {"world_size": 8, "wrong_total": 0, "rows": [{"bytes": 16 << 20, "time_us": 100.0}]}
    chk = evaluate.bandwidth_check("bw", short, "nvswitch", "", None)
    assert chk.status == NOT_RUN and f"at or above {GiB} B" in chk.detail  # old: PASS at 16 MiB


def test_unknown_rank_count_is_said_and_zero_busbw_not_passed():
    text = _nccl(0, [_row(GiB, 9306.7, 201.9, 9291.5, 202.23)]).replace("nGpus 0", "nGpus 1")
    chk = evaluate.nccl_tests_check(nccl_tests.parse(text), "nvswitch", "", None, None)
    assert chk.status == PASS and "rank count unknown" in chk.detail
    zero = _nccl(0, [_row(GiB, 150.0, 0.0, 150.0, 0.0)])
    chk = evaluate.nccl_tests_check(nccl_tests.parse(zero), "nvswitch", "", None, {"nvswitch": 0})
    assert chk.status == NOT_RUN


def test_threshold_rows_by_model_count_and_class():
    from torchrig.verify import thresholds
    assert thresholds.lookup("nvlink", "Tesla V100-SXM2-32GB", None, 8).minimum == 95
    assert thresholds.lookup("nvlink", "Tesla V100-SXM2-32GB", None, 4).minimum == 20  # class default
    assert thresholds.lookup("nvswitch", "NVIDIA H100 80GB HBM3", None, 8).expected == 370
    assert thresholds.lookup("nvlink", "NVIDIA H100 PCIe", None, 2).expected == 115
    assert thresholds.lookup("cpu", "NVIDIA H100 PCIe", None, 2).expected == 40
    assert thresholds.lookup("cpu-gloo").min_bytes == 16 << 20
    assert thresholds.lookup("nvswitch", "H100", {"nvswitch": 50}, 8).minimum == 50
    # every row names a source, and a guess says so
    for row in thresholds._data()["machines"] + list(thresholds._data()["classes"].values()):
        src = row["source"]
        assert src.startswith(("estimate:", "fixture:", "NVIDIA/")), src
        assert 0 < row["min"] <= row["expected"], row


def test_single_gpu_box_says_1_gpu():
    from torchrig.testbed import gpu_profiles
    f = facts(n=1, topo=gpu_profiles.load("single-1")["topo"],
              smi_query={"rc": 0, "out": smi_rows(1, "NVIDIA L4"), "err": ""},
              torch_runtime={"torch": "2", "cuda": "12.8", "device_count": 1, "nccl": "2"})
    v = evaluate.host_verdict("a", f, 1, "cuda")
    topo_chk = next(c for c in v.checks if c.name == "topology")
    assert v.topology == "single" and topo_chk.detail == "1 GPU, single"  # old: "1 GPUs"
    f["smi_query"]["out"] = smi_rows(1, "NVIDIA L4")
    cnt = next(c for c in evaluate.host_verdict("a", f, 2, "cuda").checks if c.name == "gpu-count")
    assert cnt.status == FAIL and cnt.detail.startswith("1 GPU visible")


def test_single_gpu_box_bandwidth_says_why_not_run():
    res = {"world_size": 1, "wrong_total": 0, "rows": [{"bytes": GiB, "time_us": 5000.0}]}
    chk = evaluate.bandwidth_check("bandwidth (in node)", res, "single", "NVIDIA L4", None, gpu_count=1)
    assert chk.status == NOT_RUN and "not defined below 2 ranks" in chk.detail


def test_peer_address_without_a_name_warns_with_the_fix():
    net = {"address": "10.0.0.1", "port": 29400, "resolved": "10.0.0.1", "reachable": True,
           "interface": "eth0", "reverse_error": "[Errno -3] Temporary failure in name resolution"}
    v = evaluate.host_verdict("a", facts(network=net), 8, "cuda")
    st = statuses(v)
    assert st["network"] == PASS and st["name-resolution"] == WARN and v.status != FAIL
    detail = [c for c in v.checks if c.name == "name-resolution"][0].detail
    assert "::ffff:10.0.0.1 NAME" in detail and "cannot be retrieved" in detail
    named = {k: x for k, x in net.items() if k != "reverse_error"}
    assert "name-resolution" not in statuses(evaluate.host_verdict("a", facts(network=named), 8, "cuda"))


# ------------------------------------------------- nccl-tests runs that failed, or measured a no-op

def _fx(name):
    return (FIX / name).read_text()


def test_an_nccl_warning_in_a_run_that_finished_is_a_warn_not_a_fail():
    """NCCL_DEBUG=WARN on a box without InfiniBand: a healthy run prints this line first
    (nccl-tests#82); it FAILed the box. It is FAIL only beside a non-zero exit or no table."""
    warn = "gpu1:14926:14926 [0] misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so[.1]\n"
    n03 = _fx("nccl_03_all_reduce_perf_g8_8xA100_SXM4_40GB_oci_bm_gpu4_8.txt")
    assert evaluate.nccl_tests_run_check(0, n03, "", "nvswitch", "NVIDIA A100-SXM4-40GB", 8,
                                         None).status == PASS
    chk = evaluate.nccl_tests_run_check(0, warn + n03, "", "nvswitch", "NVIDIA A100-SXM4-40GB", 8, None)
    assert chk.status == WARN and "NCCL warned: gpu1:14926:14926 [0] misc/ibvwrap.cc:63" in chk.detail
    for rc, out in ((1, warn + n03), (0, warn)):  # died after it, or never printed a table
        chk = evaluate.nccl_tests_run_check(rc, out, "", "nvswitch", "NVIDIA A100-SXM4-40GB", 8, None)
        assert chk.status == FAIL and "Failed to open libibverbs" in chk.detail, (rc, chk)


def test_nccl_tests_failure_lines_fail_the_run_not_leave_it_not_run():
    """all_reduce_perf printing `Test NCCL failure` / `Test CUDA failure` / `NCCL WARN` (and
    exiting non-zero) is a broken box, not a check that could not run."""
    n05 = _fx("nccl_05_all_reduce_perf_g4_4xRTX4090_test_nccl_failure_3_devices_shown.txt")
    chk = evaluate.nccl_tests_run_check(1, n05, "", "pcie-switch", "NVIDIA GeForce RTX 4090", 4, None)
    assert chk.status == FAIL and "Test NCCL failure common.cu:1005 'unhandled CUDA error'" in chk.detail
    # the rows measured before the failure do not make it pass (a real multi-node run)
    n06 = _fx("nccl_06_all_reduce_perf_multinode_test_nccl_failure_after_17G.txt")
    chk = evaluate.nccl_tests_run_check(1, n06, "", "nvswitch", "NVIDIA H100 80GB HBM3", 8, None)
    assert chk.status == FAIL and "Test NCCL failure common.cu:1204" in chk.detail
    n08 = _fx("nccl_08_all_reduce_perf_mpirun_2nodes_nccl_warn_connection_closed.txt")
    chk = evaluate.nccl_tests_run_check(1, "", n08, "nvlink", "Tesla V100-SXM2-32GB", 8, None)
    assert chk.status == FAIL and "NCCL WARN Net : Connection closed by remote peer" in chk.detail
    # a CUDA failure with exit 0 still fails; a non-zero exit saying nothing is NOT RUN
    n04 = _fx("nccl_04_all_reduce_perf_g2_2xRTX2080Ti_pcie_pix_autodl.txt")
    chk = evaluate.nccl_tests_run_check(0, n04 + "box: Test CUDA failure common.cu:892 'out of memory'\n",
                                        "", "pcie-switch", "NVIDIA GeForce RTX 2080 Ti", 2, None)
    assert chk.status == FAIL and "Test CUDA failure" in chk.detail
    chk = evaluate.nccl_tests_run_check(127, "", "all_reduce_perf: not found", "pcie-switch", "", 2, None)
    assert chk.status == NOT_RUN and "not found" in chk.detail
    chk = evaluate.nccl_tests_run_check(0, n04, "", "pcie-switch", "NVIDIA GeForce RTX 2080 Ti", 2, None)
    assert chk.status == PASS


def test_in_place_no_ops_at_small_sizes_are_flagged():
    """In-place halves of ~0.2 us against ~5 us out-of-place at small sizes: real (nccl_07, one
    RTX 5090, where one rank makes in-place a no-op); here put into the real 2-rank 2080 Ti
    sweep (nccl_04, derived). Such a half moved nothing; the old 100x screen let a 50x one
    through and the run PASSed unflagged."""
    n07 = nccl_tests.parse(_fx("nccl_07_all_reduce_perf_g1_1xRTX5090_inplace_noop_small_sizes.txt"))
    assert [r.in_place.time_us for r in n07.rows] == [0.20, 0.19, 0.18, 0.15]
    text = _fx("nccl_04_all_reduce_perf_g2_2xRTX2080Ti_pcie_pix_autodl.txt").splitlines(True)
    noop = []
    for ln in text:
        toks = ln.split()
        if toks and toks[0].isdigit() and int(toks[0]) <= 64:  # 8..64 B rows: in-place 0.2 us
            parts = re.split(r"(\S+)", ln)   # cells at odd indexes, spacing kept
            parts[2 * 9 + 1] = "0.20"          # the in-place time, 10th cell
            ln = "".join(parts)
        noop.append(ln)
    res = nccl_tests.parse("".join(noop))
    assert [r.in_place.time_us for r in res.rows if r.size <= 64] == [0.20] * 4
    chk = evaluate.nccl_tests_check(res, "pcie-switch", "NVIDIA GeForce RTX 2080 Ti", 2, None)
    assert chk.status == WARN and "in-place 0.2 us at 8 B" in chk.detail, chk
    assert "invalid, left out" in chk.detail


def test_a_mangled_topo_row_fails_the_topology_check_instead_of_a_wrong_class():
    """A lost separator in GPU4's row (affinity and NUMA run together): the old parser read the
    box as nvswitch with GPU4 on no NUMA node and passed."""
    mangled = TOPO_H100.replace("52-103,156-207  1", "52-103,156-2071", 1)
    v = evaluate.host_verdict("a", facts(topo=mangled), 8, "cuda")
    topo = {c.name: c for c in v.checks}["topology"]
    assert topo.status == FAIL and "row GPU4" in topo.detail and "lost separator" in topo.detail
    assert v.advice == []
