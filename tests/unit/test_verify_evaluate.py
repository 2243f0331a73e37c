"""verify's judgement from fact tables: real nvidia-smi/topo outputs in, PASS/FAIL out."""

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
