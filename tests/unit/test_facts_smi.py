"""torchrig.facts.smi_query and smi_table against real nvidia-smi captures and hand-made variants."""

from __future__ import annotations


import pytest

from _fixtures import fixture
from torchrig.facts import smi_query, smi_table



# ---------------------------------------------------------------- smi_query


def test_query_command():
    argv = smi_query.command()
    assert argv[0] == "nvidia-smi"
    assert argv[1] == "--query-gpu=" + ",".join(smi_query.QUERY_FIELDS)
    assert argv[2] == "--format=csv,noheader,nounits"
    assert smi_query.QUERY_FIELDS[0] == "index" and smi_query.QUERY_FIELDS[-1] == "compute_cap"
    assert len(smi_query.QUERY_FIELDS) == 16


# Hand-made in the shape nvidia-smi prints for command(): ", " separated, no units.
# Values taken from the smi_02 (H100) and smi_01 (RTX 2080 Ti) captures where they exist.
QUERY_H100 = (
    "0, NVIDIA H100 80GB HBM3, GPU-8e5f4a3c-1d2b-4c6e-9f0a-1b2c3d4e5f60, 00000000:18:00.0, "
    "565.57.01, 81559, Enabled, Enabled, 0, 5, 5, 16, 16, 0, 1, 9.0\n"
    "1, NVIDIA H100 80GB HBM3, GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9, 00000000:2A:00.0, "
    "565.57.01, 81559, Enabled, Enabled, 0, 1, 5, 16, 16, 0, 1, 9.0\n"
)
QUERY_2080TI = (
    "0, NVIDIA GeForce RTX 2080 Ti, GPU-11111111-2222-3333-4444-555555555555, 00000000:B4:00.0, "
    "550.90.07, 11264, Enabled, [N/A], [N/A], 1, 3, 16, 16, 0, 1, 7.5\r\n"
    "1, NVIDIA GeForce RTX 2080 Ti, GPU-66666666-7777-8888-9999-000000000000, 00000000:B5:00.0, "
    "550.90.07, 11264, Disabled, [N/A], [Not Supported], [Unknown Error], 3, 8, 16, 7, 5, 7.5\r\n"
)


def test_query_parse_typed():
    gpus = smi_query.parse(QUERY_H100)
    assert len(gpus) == 2
    g = gpus[1]
    assert g.index == 1
    assert g.name == "NVIDIA H100 80GB HBM3"
    assert g.uuid.startswith("GPU-")
    assert g.pci_bus_id == "00000000:2A:00.0"
    assert g.driver_version == "565.57.01"
    assert g.memory_total_mib == 81559
    assert g.persistence_mode is True
    assert g.ecc_mode is True
    assert g.ecc_errors_uncorrected_volatile == 0
    assert (g.pcie_gen_current, g.pcie_gen_max) == (1, 5)  # idle GPUs downtrain the link
    assert (g.pcie_width_current, g.pcie_width_max) == (16, 16)
    assert g.utilization_gpu_pct == 0
    assert g.memory_used_mib == 1
    assert g.compute_cap == "9.0" and g.compute_cap_tuple == (9, 0)


def test_query_parse_na_and_crlf():
    gpus = smi_query.parse(QUERY_2080TI)
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].ecc_mode is None and gpus[0].ecc_errors_uncorrected_volatile is None
    assert gpus[1].persistence_mode is False
    assert gpus[1].ecc_errors_uncorrected_volatile is None  # [Not Supported]
    assert gpus[1].pcie_gen_current is None  # [Unknown Error]
    assert gpus[1].pcie_width_current == 8
    assert gpus[1].compute_cap_tuple == (7, 5)


def test_query_parse_empty_and_bad_width():
    assert smi_query.parse("") == []
    with pytest.raises(smi_query.QueryError):
        smi_query.parse("0, NVIDIA H100, GPU-x\n")


def test_query_parse_raises_on_nvml_failure():
    with pytest.raises(smi_query.QueryError) as ei:
        smi_query.parse("Failed to initialize NVML: Driver/library version mismatch\n")
    assert ei.value.failure is not None and ei.value.failure.kind == "driver-library-mismatch"


def test_parse_csv_header_with_units_fixture():
    rows = smi_query.parse_csv(fixture("querygpu_01_lms_timestamp_pstate_csv_header_units.txt"))
    assert len(rows) == 5
    r = rows[0]
    assert list(r) == [
        "timestamp",
        "pstate",
        "temperature.gpu",
        "utilization.gpu",
        "utilization.memory",
        "memory.total",
        "memory.free",
        "memory.used",
    ]
    assert r["timestamp"] == "2024/01/16 14:44:16.977"
    assert r["pstate"] == "P8"
    assert r["temperature.gpu"] == 25
    assert r["utilization.gpu"] == 0
    assert r["memory.total"] == 23028
    assert r["memory.free"] == 22494
    assert r["memory.used"] == 21
    assert [x["memory.used"] for x in rows] == [21, 7, 7, 7, 21]
    assert rows[-1]["timestamp"] == "2024/01/16 14:44:17.095"


def test_parse_csv_noheader_with_fields_and_units():
    text = "0, NVIDIA A10, 23028 MiB, 150.00 W, [N/A], Enabled\n"
    rows = smi_query.parse_csv(text, ["index", "name", "memory.total", "power.limit", "ecc.mode.current", "x"])
    assert rows == [
        {
            "index": 0,
            "name": "NVIDIA A10",
            "memory.total": 23028,
            "power.limit": 150.0,
            "ecc.mode.current": None,
            "x": True,
        }
    ]
    # a header line that matches the fields is skipped
    hdr = "index, memory.total [MiB]\n0, 100 MiB\n"
    assert smi_query.parse_csv(hdr, ["index", "memory.total"]) == [{"index": 0, "memory.total": 100}]


@pytest.mark.parametrize(
    "text, code, kind",
    [
        ("Failed to initialize NVML: Driver/library version mismatch\n", 18, "driver-library-mismatch"),
        (
            "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 535.183\n",
            18,
            "driver-library-mismatch",
        ),
        (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.\n\n",
            9,
            "no-driver",
        ),
        ("No devices were found\n", 6, "no-devices"),
        ("Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error\n", 15, "fallen-off-bus"),
        (
            "Unable to determine the device handle for gpu 0000:41:00.0: GPU is lost.  "
            "Reboot the system to recover this GPU\n",
            15,
            "fallen-off-bus",
        ),
        ("Failed to initialize NVML: Unknown Error\n", 255, "nvml-unknown"),
        ("bash: nvidia-smi: command not found\n", 127, "not-installed"),
        ("", 127, "not-installed"),
        ("sh: 1: nvidia-smi: not found\n", 127, "not-installed"),
        ('Field "compute_cap" is not a valid field to query.\n', 2, "invalid-field"),
        ("Failed to initialize NVML: Insufficient Permissions\n", 4, "nvml-error"),
        ("something odd\n", 3, "unknown"),
    ],
)
def test_detect_failure(text, code, kind):
    f = smi_query.detect_failure(text, code)
    assert f is not None and f.kind == kind
    assert f.kind in smi_query.FAILURE_KINDS
    assert f.advice


def test_detect_failure_details():
    f = smi_query.detect_failure(
        "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 535.183\n", 18
    )
    assert "reboot" in f.advice and "hold" in f.advice
    assert "535.183" in f.message
    f = smi_query.detect_failure("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9)
    assert "Secure Boot" in f.advice
    f = smi_query.detect_failure("Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error\n", 0)
    assert f.kind == "fallen-off-bus" and f.bus_id == "0000:3B:00.0"


def test_detect_failure_none_on_data():
    assert smi_query.detect_failure(QUERY_H100, 0) is None
    assert smi_query.detect_failure(fixture("smi_02_8xH100_SXM_driver565_cuda12_7_thamada.txt"), 0) is None
    assert smi_query.detect_failure("", 0) is None


# ---------------------------------------------------------------- smi_table


def test_table_smi01_2080ti_wide_layout():
    t = smi_table.parse(fixture("smi_01_2xRTX2080Ti_driver550_cuda12_4.txt"))
    assert (t.smi_version, t.driver_version, t.cuda_version) == ("550.90.07", "550.90.07", "12.4")
    assert t.timestamp == "Thu Jun  5 17:15:31 2025"
    assert len(t.gpus) == 2
    g0, g1 = t.gpus
    assert (g0.index, g1.index) == (0, 1)
    assert g0.name == "NVIDIA GeForce RTX 2080 Ti" and not g0.name_truncated
    assert g0.persistence_mode is True
    assert g0.bus_id == "00000000:B4:00.0" and g1.bus_id == "00000000:B5:00.0"
    assert (g0.memory_used_mib, g0.memory_total_mib) == (1, 11264)
    assert g0.ecc_uncorrected is None  # N/A on GeForce
    assert (g0.fan_pct, g0.temperature_c, g0.perf_state) == (29, 31, "P8")
    assert (g0.power_usage_w, g0.power_cap_w) == (20.0, 250.0)
    assert (g0.utilization_gpu_pct, g0.compute_mode, g0.mig_mode) == (0, "Default", None)
    assert t.processes == ()


def test_table_smi02_8xH100():
    t = smi_table.parse(fixture("smi_02_8xH100_SXM_driver565_cuda12_7_thamada.txt"))
    assert (t.smi_version, t.driver_version, t.cuda_version) == ("565.57.01", "565.57.01", "12.7")
    assert t.timestamp is None
    assert [g.index for g in t.gpus] == list(range(8))
    assert {g.name for g in t.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert [g.bus_id[-7:] for g in t.gpus] == [
        "18:00.0", "2A:00.0", "3A:00.0", "5D:00.0", "9A:00.0", "AB:00.0", "BA:00.0", "DB:00.0",
    ]  # fmt: skip
    assert all(g.memory_total_mib == 81559 and g.memory_used_mib == 1 for g in t.gpus)
    assert all(g.persistence_mode and g.ecc_uncorrected == 0 for g in t.gpus)
    assert t.gpus[0].fan_pct is None and t.gpus[0].power_usage_w == 100.0
    assert t.gpus[7].power_usage_w == 75.0 and t.gpus[7].power_cap_w == 700.0
    assert all(g.mig_mode == "Disabled" for g in t.gpus)
    assert t.processes == ()


def test_table_smi05_v100_old_narrow_layout():
    t = smi_table.parse(fixture("smi_05_1xV100SXM2_32GB_driver525_cuda12_0_oldwidth.txt"))
    assert (t.smi_version, t.driver_version, t.cuda_version) == ("525.105.17", "525.105.17", "12.0")
    assert len(t.gpus) == 1
    g = t.gpus[0]
    assert g.name == "Tesla V100-SXM2..." and g.name_truncated
    assert g.persistence_mode is True
    assert g.bus_id == "00000000:00:09.0"
    assert (g.memory_used_mib, g.memory_total_mib) == (308, 32768)
    assert (g.power_usage_w, g.power_cap_w) == (38.0, 300.0)
    assert g.ecc_uncorrected == 0
    assert t.processes == ()  # empty table, no "No running processes found" line


# Hand-made: narrow layout with processes, with and without the GI/CI columns,
# CRLF line ends, and a persistence-off GPU with a "Off" ECC cell.
TABLE_WITH_PROCS = """\
+-----------------------------------------------------------------------------+
| NVIDIA-SMI 470.82.01    Driver Version: 470.82.01    CUDA Version: 11.4     |
|-------------------------------+----------------------+----------------------+
| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | GPU-Util  Compute M. |
|                               |                      |               MIG M. |
|===============================+======================+======================|
|   0  Tesla P100-PCIE...  Off  | 00000000:0B:00.0 Off |                  Off |
| N/A   42C    P0    29W / 250W |   1234MiB / 16280MiB |     87%   E. Process |
|                               |                      |                  N/A |
+-------------------------------+----------------------+----------------------+
|   1  Tesla P100-PCIE...  Off  | 00000000:0C:00.0 Off |                    0 |
| N/A   40C    P0    27W / 250W |      0MiB / 16280MiB |      0%      Default |
|                               |                      |                  N/A |
+-------------------------------+----------------------+----------------------+

+-----------------------------------------------------------------------------+
| Processes:                                                                  |
|  GPU   GI   CI        PID   Type   Process name                  GPU Memory |
|        ID   ID                                                   Usage      |
|=============================================================================|
|    0   N/A  N/A     21345      C   python train.py                  1231MiB |
|    0   N/A  N/A      1409      G   /usr/lib/xorg/Xorg                  3MiB |
+-----------------------------------------------------------------------------+
""".replace("\n", "\r\n")

TABLE_OLD_PROCS = """\
+-----------------------------------------------------------------------------+
| NVIDIA-SMI 375.26                 Driver Version: 375.26                    |
|-------------------------------+----------------------+----------------------+
| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | GPU-Util  Compute M. |
|===============================+======================+======================|
|   0  GeForce 840M        Off  | 0000:03:00.0     Off |                  N/A |
| N/A   47C    P0    N/A /  N/A |    242MiB /  2002MiB |     24%      Default |
+-------------------------------+----------------------+----------------------+

+-----------------------------------------------------------------------------+
| Processes:                                                       GPU Memory |
|  GPU       PID  Type  Process name                               Usage      |
|=============================================================================|
|    0      1409    G   /usr/lib/xorg/Xorg                           149MiB |
|    0      2774  C+G   /usr/lib/firefox/firefox                       1MiB |
+-----------------------------------------------------------------------------+
"""


def test_table_processes_and_exclusive_mode():
    t = smi_table.parse(TABLE_WITH_PROCS)
    assert t.cuda_version == "11.4"
    assert len(t.gpus) == 2
    g0 = t.gpus[0]
    assert g0.persistence_mode is False and g0.ecc_uncorrected is None
    assert (g0.utilization_gpu_pct, g0.compute_mode) == (87, "E. Process")
    assert g0.memory_used_mib == 1234
    assert t.gpus[1].ecc_uncorrected == 0
    assert len(t.processes) == 2
    p = t.processes[0]
    assert (p.gpu, p.gi, p.ci, p.pid, p.type, p.name, p.memory_mib) == (
        0, None, None, 21345, "C", "python train.py", 1231,
    )  # fmt: skip
    assert t.processes[1].type == "G" and t.processes[1].memory_mib == 3


def test_table_old_2line_layout_without_cuda_version():
    t = smi_table.parse(TABLE_OLD_PROCS)
    assert (t.smi_version, t.driver_version, t.cuda_version) == ("375.26", "375.26", None)
    assert len(t.gpus) == 1
    g = t.gpus[0]
    assert g.name == "GeForce 840M" and g.bus_id == "0000:03:00.0"
    assert (g.power_usage_w, g.power_cap_w) == (None, None)
    assert (g.memory_used_mib, g.memory_total_mib) == (242, 2002)
    assert g.mig_mode is None
    assert [(p.pid, p.type, p.name, p.memory_mib) for p in t.processes] == [
        (1409, "G", "/usr/lib/xorg/Xorg", 149),
        (2774, "C+G", "/usr/lib/firefox/firefox", 1),
    ]
    assert t.processes[0].gi is None


def test_table_without_banner_raises():
    with pytest.raises(ValueError):
        smi_table.parse("No devices were found\n")


# ------------------------------------------------------- numbers and bytes that are not readings


def test_query_parse_overflowing_number_is_a_value_error():
    """'1e999' used to raise OverflowError (int(inf)), which no caller catches: verify and
    launch aborted for every host. Now it is this host's QueryError (a ValueError)."""
    row = QUERY_H100.splitlines()[0].replace(", 81559,", ", 1e999,")
    with pytest.raises(smi_query.QueryError, match="not a finite number: '1e999'"):
        smi_query.parse(row + "\n")
    assert smi_query.convert("1e999") is None


def test_verdict_of_a_host_with_overflowing_smi_value():
    from torchrig.verify.evaluate import host_verdict
    row = QUERY_H100.splitlines()[0].replace(", 81559,", ", 1e999,")
    v = host_verdict("gpu1", {"smi_query": {"rc": 0, "out": row + "\n", "err": ""}}, 1, "cuda")
    driver = next(c for c in v.checks if c.name == "driver")
    assert driver.status == "FAIL" and "1e999" in driver.detail


@pytest.mark.parametrize("who", ["verify", "provision"])
def test_the_probe_survives_non_utf8_output(tmp_path, who):
    """lspci and nvidia-smi may print bytes that are not UTF-8 (a vendor string): the probe
    decodes with replacement instead of dying with UnicodeDecodeError on the host."""
    import os
    import subprocess
    import sys
    from torchrig.facts import probe, provision_facts, verify_facts
    for tool in ("nvidia-smi", "lspci"):
        stub = tmp_path / tool
        stub.write_bytes(b"#!/bin/sh\nprintf 'GPU \\377\\376 caf\\351\\n'\n")
        stub.chmod(0o755)
    req = (verify_facts.probe_request("index", "/nonexistent", False, None) if who == "verify"
           else provision_facts.probe_request({}))
    r = subprocess.run([sys.executable, "-I", "-"], input=probe.stdin(req).encode(),
                       capture_output=True, timeout=120,
                       env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                            "LC_ALL": "C.UTF-8"})
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    raw = probe.reply(0, r.stdout.decode(), "")
    got = (verify_facts.facts("/nonexistent", None, raw)["smi_query"]["out"] if who == "verify"
           else provision_facts.facts({}, raw)["lspci"])
    assert "GPU \ufffd\ufffd caf\ufffd" in got
