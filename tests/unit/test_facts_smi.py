"""torchrig.facts.smi_query against real nvidia-smi captures and hand-made variants."""

from __future__ import annotations


import pytest

from _fixtures import fixture
from torchrig.facts import smi_query



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
    req = (verify_facts.probe_request("/nonexistent", False, None) if who == "verify"
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



# ---------------------------------------------------------------- --query-gpu CSV (issue 11)


def test_string_fields_stay_strings():
    """The old code typed every cell: driver 470.10 became the number 470.1, compute_cap 8.0
    the float 8.0, a serial lost its leading zero."""
    text = ("driver_version, vbios_version, name, compute_cap, serial, pci.bus_id, memory.total [MiB]\n"
            "470.10, 86.00.4D.00.04, Tesla V100-SXM2-32GB, 8.0, 0323617004245, 00000000:18:00.0, 32510 MiB\n")
    (row,) = smi_query.parse_csv(text)
    assert row["driver_version"] == "470.10" and row["compute_cap"] == "8.0"
    assert row["serial"] == "0323617004245" and row["vbios_version"] == "86.00.4D.00.04"
    assert row["memory.total"] == 32510  # numbers are still numbers
    noheader = "470.10, 7.0\n535.104.05, 9.0\n"
    assert smi_query.parse_csv(noheader, ["driver_version", "compute_cap"]) == [
        {"driver_version": "470.10", "compute_cap": "7.0"},
        {"driver_version": "535.104.05", "compute_cap": "9.0"}]


def test_noheader_output_without_a_field_list_is_refused():
    """Old: the first data row became the header and the rest a junk table (one GPU: [])."""
    with pytest.raises(smi_query.QueryError, match="no CSV header line.*pass the field list"):
        smi_query.parse_csv("0, NVIDIA A10, 23028 MiB\n1, NVIDIA A10, 23028 MiB\n")
    with pytest.raises(smi_query.QueryError, match="no CSV header line"):
        smi_query.parse_csv("470.10\n")


def test_text_that_is_not_the_csv_is_refused():
    table = fixture("smi_01_2xRTX2080Ti_driver550_cuda12_4.txt")  # the summary table, not CSV
    with pytest.raises(smi_query.QueryError):
        smi_query.parse_csv(table)
    with pytest.raises(smi_query.QueryError, match="not the expected --query-gpu CSV"):
        smi_query.parse_csv(table, ["index", "name", "memory.total"])
    with pytest.raises(smi_query.QueryError):
        smi_query.parse(table)
    # a header for other fields than asked for
    with pytest.raises(smi_query.QueryError, match="header names index, name"):
        smi_query.parse_csv("index, name\n0, A10\n", ["name", "index"])


def test_query_parse_skips_its_own_header_line():
    header = ", ".join(smi_query.QUERY_FIELDS) + "\n"
    assert smi_query.parse(header + QUERY_H100) == smi_query.parse(QUERY_H100)


def test_h200_header_prints_newer_names_for_the_fields_asked():
    """Captured on an H200 (driver 580.159.04): the header says clocks.current.sm and
    clocks_event_reasons.active for clocks.sm and clocks_throttle_reasons.active."""
    header, with_units, bare = fixture(
        "querygpu_02_1xH200_sampler_fields_header_then_noheader_nounits.txt").splitlines()
    asked = ["index", "name", "uuid", "pci.bus_id", "driver_version", "memory.total",
             "memory.used", "utilization.gpu", "temperature.gpu", "power.draw", "power.limit",
             "clocks.sm", "clocks.max.sm", "ecc.errors.uncorrected.volatile.total",
             "ecc.errors.corrected.volatile.total", "clocks_event_reasons.active",
             "clocks_throttle_reasons.active", "persistence_mode", "compute_cap", "mig.mode.current"]
    for text in (header + "\n" + with_units, header + "\n" + bare, bare):
        (row,) = smi_query.parse_csv(text, asked)
        assert row["name"] == "NVIDIA H200" and row["driver_version"] == "580.159.04"
        assert row["memory.total"] == 143771 and row["clocks.sm"] == 345
        assert row["clocks.max.sm"] == 1980 and row["temperature.gpu"] == 38
        assert row["clocks_throttle_reasons.active"] == row["clocks_event_reasons.active"]
    # the header parsed on its own is keyed by what it prints
    (row,) = smi_query.parse_csv(header + "\n" + with_units)
    assert row["clocks.current.sm"] == 345 and row["power.draw"] == 79.9
    # a header for other fields is still refused
    with pytest.raises(smi_query.QueryError, match="header names"):
        smi_query.parse_csv(header + "\n" + with_units, ["memory.used"] + asked[1:])
