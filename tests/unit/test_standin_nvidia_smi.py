"""Tests for the testbed's stand-in nvidia-smi and its GPU profiles.

The script runs as a subprocess with every input redirected to tmp files
through the TORCHRIG_STANDIN_* environment overrides.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrig.testbed import gpu_profiles

SCRIPT = gpu_profiles.STANDIN_NVIDIA_SMI
FIXTURES = Path("/work/shared/fixtures")

EXPECTED = {
    "v100s-nvlink-2": (2, "Tesla V100S-PCIE-32GB"),
    "h100-nvswitch-8": (8, "NVIDIA H100 80GB HBM3"),
    "pcie-sys-4": (4, "NVIDIA RTX A6000"),
    "v100-dgx1-8": (8, "Tesla V100-SXM2-32GB"),
    "pcie-nic-8": (8, "NVIDIA GeForce RTX 4090"),
    "single-1": (1, "NVIDIA L4"),
    "a100-nv12-8": (8, "NVIDIA A100-SXM4-80GB"),
}

MSG_NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                 "driver. Make sure that the latest NVIDIA driver is installed and running.\n")


class Box:
    """A simulated server's files, in a tmp dir."""

    def __init__(self, root: Path, profile: str = "v100s-nvlink-2",
                 driver: str | None = "570.133.20", module: str | None = "570.133.20",
                 cuda: str | None = "12.8"):
        self.root = root
        self.profile_name = profile
        self.profile = root / "gpu-profile.json"
        self.driver = root / "driver-version"
        self.cuda = root / "cuda-version"
        self.module = root / "module-version"
        self.persistence = root / "persistence"
        self.fault = root / "fault"
        self.profile.write_text(gpu_profiles.to_json(profile))
        for path, value in ((self.driver, driver), (self.module, module), (self.cuda, cuda)):
            if value is not None:
                path.write_text(value + "\n")

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "TORCHRIG_STANDIN_PROFILE": str(self.profile),
            "TORCHRIG_STANDIN_DRIVER_VERSION_FILE": str(self.driver),
            "TORCHRIG_STANDIN_CUDA_VERSION_FILE": str(self.cuda),
            "TORCHRIG_STANDIN_MODULE_FILE": str(self.module),
            "TORCHRIG_STANDIN_PERSISTENCE_FILE": str(self.persistence),
            "TORCHRIG_STANDIN_FAULT_FILE": str(self.fault),
            "TORCHRIG_STANDIN_HEALTH_FILE": str(self.root / "health.json"),
            "TORCHRIG_STANDIN_TIMESTAMP": "",
        })
        return env

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), *args], env=self.env(),
                              capture_output=True, text=True, timeout=30)


@pytest.fixture
def box(tmp_path):
    return Box(tmp_path)


def make_box(tmp_path, **kw) -> Box:
    return Box(tmp_path, **kw)


# ------------------------------------------------------------ the script ----

def test_script_is_labelled_executable_and_stdlib_only():
    text = SCRIPT.read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/python3"
    assert "TESTBED STAND-IN" in lines[1] and "NOT NVIDIA software" in lines[1]
    assert os.access(SCRIPT, os.X_OK)
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported and imported <= set(sys.stdlib_module_names), imported


# ------------------------------------------------------------- profiles ----

def test_shipped_profiles():
    assert set(EXPECTED) <= set(gpu_profiles.names())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_profile_loads_and_json_round_trips(name):
    profile = gpu_profiles.load(name)
    count, gpu_name = EXPECTED[name]
    assert len(profile["gpus"]) == count
    assert {g["name"] for g in profile["gpus"]} == {gpu_name}
    assert not any(k.startswith("x-") for k in profile)
    assert json.loads(gpu_profiles.to_json(name)) == profile
    topo = profile["topo"].splitlines()
    assert topo[0].split()[:count] == ["GPU%d" % i for i in range(count)]
    assert [line.split()[0] for line in topo[1:count + 1]] == ["GPU%d" % i for i in range(count)]


def test_profile_hardware_details():
    v100 = gpu_profiles.load("v100s-nvlink-2")
    assert v100["nvswitch"] is False
    for g in v100["gpus"]:
        assert (g["memory_mib"], g["compute_cap"], g["power_limit_w"]) == (32768, "7.0", 250)
        assert (g["pcie_gen_max"], g["pcie_width_max"]) == (3, 16)
    assert v100["topo"].splitlines()[1].split()[:3] == ["GPU0", "X", "NV2"]
    assert "Legend:" in v100["topo"] and "GPU NUMA ID" in v100["topo"]

    h100 = gpu_profiles.load("h100-nvswitch-8")
    assert h100["nvswitch"] is True
    for g in h100["gpus"]:
        assert (g["memory_mib"], g["compute_cap"], g["power_limit_w"]) == (81559, "9.0", 700)
        assert (g["pcie_gen_max"], g["pcie_width_max"]) == (5, 16)

    pcie = gpu_profiles.load("pcie-sys-4")
    assert pcie["nvswitch"] is False
    for g in pcie["gpus"]:
        assert (g["memory_mib"], g["compute_cap"], g["power_limit_w"]) == (49140, "8.6", 300)
        assert (g["pcie_gen_max"], g["pcie_width_max"]) == (4, 16)
    rows = [line.split() for line in pcie["topo"].splitlines()[1:5]]
    assert [r[1:5] for r in rows] == [["X", "PXB", "SYS", "SYS"], ["PXB", "X", "SYS", "SYS"],
                                      ["SYS", "SYS", "X", "PIX"], ["SYS", "SYS", "PIX", "X"]]
    assert [r[6] for r in rows] == ["0", "0", "1", "1"]
    assert "NV" not in pcie["topo"].split("Legend:")[0]


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared fixtures not available")
def test_h100_topo_is_the_real_capture_byte_for_byte():
    real = (FIXTURES / "topo_08_h100x8_nv18_mlengineering.txt").read_text()
    assert gpu_profiles.load("h100-nvswitch-8")["topo"] == real


def _write_profile(tmp_path, text):
    path = tmp_path / "broken.yml"
    path.write_text(text)
    return path


GOOD_GPU = """
  - name: X
    memory_mib: 1024
    pci_bus_id: "00000000:01:00.0"
    uuid: GPU-1
    serial: "1"
    vbios_version: "1.0"
    compute_cap: "8.0"
    power_limit_w: 100
    pcie_gen_max: 4
    pcie_gen_current: 4
    pcie_width_max: 16
    pcie_width_current: 16
    ecc_mode: true
    persistence_mode: false
    clocks_max_sm: 1000
"""


def test_validation_accepts_minimal_profile(tmp_path):
    path = _write_profile(tmp_path, "description: d\nnvswitch: false\ntopo: t\ngpus:" + GOOD_GPU)
    assert gpu_profiles.load_path(path)["gpus"][0]["name"] == "X"


@pytest.mark.parametrize("text, key", [
    ("nvswitch: false\ntopo: t\ngpus:" + GOOD_GPU, "'description'"),
    ("description: d\nnvswitch: false\ngpus:" + GOOD_GPU, "'topo'"),
    ("description: d\nnvswitch: false\ntopo: t\ngpus:" + GOOD_GPU.replace(
        "    uuid: GPU-1\n", ""), "'uuid'"),
    ("description: d\nnvswitch: false\ntopo: t\ngpus:" + GOOD_GPU.replace(
        '"8.0"', "8.0"), "compute_cap"),
    ("description: d\nnvswitch: no-idea\ntopo: t\ngpus:" + GOOD_GPU, "'nvswitch'"),
    ("description: d\nnvswitch: false\ntopo: t\ngpus:" + GOOD_GPU + "    colour: red\n",
     "'colour'"),
    ("description: d\nnvswitch: false\ntopo: t\ngpus: []\n", "'gpus'"),
    ("description: d\nnvswitch: false\ntopo: t\ngpus:" + GOOD_GPU + GOOD_GPU, "duplicated"),
])
def test_validation_names_file_and_key(tmp_path, text, key):
    path = _write_profile(tmp_path, text)
    with pytest.raises(ValueError) as err:
        gpu_profiles.load_path(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_unknown_profile_name():
    with pytest.raises(ValueError, match="no such GPU profile"):
        gpu_profiles.load("no-such-box")


# ------------------------------------------------------------ listing ----

@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_list_and_query_count_per_profile(tmp_path, name):
    b = make_box(tmp_path, profile=name)
    count, gpu_name = EXPECTED[name]
    profile = gpu_profiles.load(name)

    res = b.run("-L")
    assert res.returncode == 0, res.stdout
    assert res.stdout.splitlines() == [
        "GPU %d: %s (UUID: %s)" % (i, gpu_name, g["uuid"]) for i, g in enumerate(profile["gpus"])]

    res = b.run("--query-gpu=index,name", "--format=csv,noheader")
    assert res.returncode == 0
    assert res.stdout.splitlines() == ["%d, %s" % (i, gpu_name) for i in range(count)]

    res = b.run("--query-gpu=count", "--format=csv,noheader")
    assert res.stdout.splitlines() == [str(count)] * count


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_topo_is_profile_text_verbatim(tmp_path, name):
    res = make_box(tmp_path, profile=name).run("topo", "-m")
    assert res.returncode == 0
    assert res.stdout == gpu_profiles.load(name)["topo"]


# -------------------------------------------------------------- query ----

def test_query_header_units_and_values(box):
    fields = ("index,name,memory.total,memory.used,memory.free,utilization.gpu,"
              "utilization.memory,power.draw,power.limit,clocks.sm,clocks.max.sm,"
              "temperature.gpu,compute_cap")
    res = box.run("--query-gpu=" + fields, "--format=csv")
    assert res.returncode == 0
    assert res.stdout.splitlines() == [
        "index, name, memory.total [MiB], memory.used [MiB], memory.free [MiB], "
        "utilization.gpu [%], utilization.memory [%], power.draw [W], power.limit [W], "
        "clocks.sm [MHz], clocks.max.sm [MHz], temperature.gpu, compute_cap",
        "0, Tesla V100S-PCIE-32GB, 32768 MiB, 0 MiB, 32768 MiB, 0 %, 0 %, 25.00 W, "
        "250.00 W, 1245 MHz, 1597 MHz, 32, 7.0",
        "1, Tesla V100S-PCIE-32GB, 32768 MiB, 0 MiB, 32768 MiB, 0 %, 0 %, 25.00 W, "
        "250.00 W, 1245 MHz, 1597 MHz, 31, 7.0",
    ]


def test_query_nounits_keeps_header_units(box):
    res = box.run("--query-gpu", "memory.total,power.limit,utilization.gpu",
                  "--format", "csv,nounits")
    assert res.returncode == 0
    assert res.stdout.splitlines() == [
        "memory.total [MiB], power.limit [W], utilization.gpu [%]",
        "32768, 250.00, 0",
        "32768, 250.00, 0",
    ]


def test_query_noheader_nounits_and_id(box):
    res = box.run("--query-gpu=index,pci.bus_id,memory.total", "--format=csv,noheader,nounits",
                  "-i", "1")
    assert res.returncode == 0
    assert res.stdout == "1, 00000000:5E:00.0, 32768\n"


def test_query_static_fields(box):
    fields = ("uuid,serial,vbios_version,driver_version,persistence_mode,ecc.mode.current,"
              "ecc.errors.uncorrected.volatile.total,pcie.link.gen.current,pcie.link.gen.max,"
              "pcie.link.width.current,pcie.link.width.max")
    res = box.run("--query-gpu=" + fields, "--format=csv,noheader", "-i", "0")
    assert res.returncode == 0
    assert res.stdout == ("GPU-5c9a1f3e-0b7d-4a61-9e2f-3d8b6c4a1e01, 1561820004817, "
                          "88.00.98.00.01, 570.133.20, Disabled, Enabled, 0, 3, 3, 16, 16\n")


def test_persistence_file_enables_persistence(box):
    query = ("--query-gpu=persistence_mode", "--format=csv,noheader")
    assert box.run(*query).stdout == "Disabled\nDisabled\n"
    box.persistence.write_text("")
    assert box.run(*query).stdout == "Enabled\nEnabled\n"
    assert "Tesla V100S-PCIE-32GB          On  |" in box.run().stdout


def test_invalid_field(box):
    res = box.run("--query-gpu=index,foo", "--format=csv")
    assert res.returncode == 2
    assert res.stdout == 'Field "foo" is not a valid field to query.\n'


@pytest.mark.parametrize("args", [
    ("--bogus",),
    ("--query-gpu=index", "--format=json"),
    ("--query-gpu=index", "--format=csv,sideways"),
    ("--query-gpu=index",),
    ("topo",),
])
def test_bad_arguments_exit_2(box, args):
    assert box.run(*args).returncode == 2


def test_unknown_id_means_no_devices(box):
    res = box.run("-L", "-i", "7")
    assert (res.returncode, res.stdout) == (6, "No devices were found\n")


def test_help_works_without_driver(tmp_path):
    res = make_box(tmp_path, driver=None, module=None).run("--help")
    assert res.returncode == 0
    assert "STAND-IN" in res.stdout and "--query-gpu" in res.stdout


# -------------------------------------------------------------- table ----

def test_default_table(box):
    res = box.run()
    assert res.returncode == 0
    lines = res.stdout.splitlines()
    assert lines[1] == ("| NVIDIA-SMI 570.133.20             Driver Version: 570.133.20     "
                        "CUDA Version: 12.8     |")
    assert all(len(line) == 91 for line in lines if line.strip()), [
        line for line in lines if line.strip() and len(line) != 91]
    assert "|   0  Tesla V100S-PCIE-32GB         Off  |   00000000:3B:00.0 Off |" \
           "                    0 |" in lines
    assert "| N/A   32C    P0             25W /  250W |       0MiB /  32768MiB |" \
           "      0%      Default |" in lines
    assert "|   1  Tesla V100S-PCIE-32GB         Off  |   00000000:5E:00.0 Off |" \
           "                    0 |" in lines
    assert "No running processes found" in res.stdout


def test_default_table_timestamp_line(box):
    env = box.env()
    env["TORCHRIG_STANDIN_TIMESTAMP"] = "Thu Jun  5 17:15:31 2025"
    res = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=30)
    assert res.stdout.splitlines()[0] == "Thu Jun  5 17:15:31 2025"
    del env["TORCHRIG_STANDIN_TIMESTAMP"]
    res = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=30)
    assert res.stdout.splitlines()[1].startswith("+----") and res.stdout[:3].isalpha()


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared fixtures not available")
def test_h100_table_matches_real_capture(tmp_path):
    b = make_box(tmp_path, profile="h100-nvswitch-8", driver="565.57.01",
                 module="565.57.01", cuda="12.7")
    res = b.run()
    real = (FIXTURES / "smi_02_8xH100_SXM_driver565_cuda12_7_thamada.txt").read_text()
    assert res.stdout == real


def test_pcie_table_fan_and_ecc_off(tmp_path):
    res = make_box(tmp_path, profile="pcie-sys-4").run()
    assert "|   3  NVIDIA RTX A6000              Off  |   00000000:89:00.0 Off |" \
           "                  Off |" in res.stdout.splitlines()
    assert "| 30%   35C    P8             21W /  300W |" in res.stdout


@pytest.mark.parametrize("driver, expected", [("550.90.07", "12.4"), ("535.183.01", "12.2"),
                                              ("999.1.1", "12.8")])
def test_cuda_version_from_driver_branch_without_cuda_file(tmp_path, driver, expected):
    res = make_box(tmp_path, driver=driver, module=driver, cuda=None).run()
    assert res.returncode == 0
    assert "CUDA Version: %-9s|" % expected in res.stdout.splitlines()[1]


def test_minimal_q(box):
    res = box.run("-q")
    assert res.returncode == 0
    assert "Driver Version                            : 570.133.20" in res.stdout
    assert "Attached GPUs                             : 2" in res.stdout
    assert res.stdout.count("Product Name") == 2


# ------------------------------------------------------- driver states ----

@pytest.mark.parametrize("args", [(), ("-L",), ("topo", "-m"),
                                  ("--query-gpu=index", "--format=csv")])
def test_version_mismatch(tmp_path, args):
    b = make_box(tmp_path, driver="570.133.20", module="565.57.01")
    res = b.run(*args)
    assert res.returncode == 18
    assert res.stdout == ("Failed to initialize NVML: Driver/library version mismatch\n"
                          "NVML library version: 570.133\n")


@pytest.mark.parametrize("args", [(), ("-L",), ("--query-gpu=index", "--format=csv")])
def test_missing_module_file(tmp_path, args):
    res = make_box(tmp_path, module=None).run(*args)
    assert (res.returncode, res.stdout) == (9, MSG_NO_DRIVER)


def test_missing_driver_file(tmp_path):
    res = make_box(tmp_path, driver=None).run("-L")
    assert (res.returncode, res.stdout) == (9, MSG_NO_DRIVER)


def test_invalid_field_reported_before_driver_state(tmp_path):
    res = make_box(tmp_path, module=None).run("--query-gpu=foo", "--format=csv")
    assert res.returncode == 2


@pytest.mark.parametrize("fault, code, message", [
    ("driver-library-mismatch", 18,
     "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 570.133\n"),
    ("no-devices", 6, "No devices were found\n"),
    ("nvml-unknown", 255, "Failed to initialize NVML: Unknown Error\n"),
    ("gpu-fallen-off", 15,
     "Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error\n"),
    ("cosmic-ray", 255, "Failed to initialize NVML: Unknown Error\n"),
])
def test_fault_injection(box, fault, code, message):
    assert box.run("-L").returncode == 0
    box.fault.write_text(fault + "\nsecond line is ignored\n")
    for args in [("-L",), (), ("--query-gpu=index", "--format=csv")]:
        res = box.run(*args)
        assert (res.returncode, res.stdout) == (code, message), args
    box.fault.unlink()
    assert box.run("-L").returncode == 0


# (class, advice that must be there) verify derives from what the stand-in prints
VERDICTS = {
    "v100-dgx1-8": ("nvlink", "2 CPU sockets (disjoint CPU Affinity sets"),
    "pcie-nic-8": ("cpu", "2 NUMA nodes"),
    "single-1": ("single", None),
    "a100-nv12-8": ("nvswitch", "fabricmanager"),
}


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_verify_reads_each_box_right_from_the_standins_output(tmp_path, name):
    """The stand-in's real output (query CSV + topo -m), through verify's judgement."""
    from torchrig.facts import smi_query
    from torchrig.verify import evaluate
    b = make_box(tmp_path, profile=name)
    q = b.run(*smi_query.command()[1:])  # argv without "nvidia-smi"
    t = b.run("topo", "-m")
    count = EXPECTED[name][0]
    facts = {"smi_query": {"rc": q.returncode, "out": q.stdout, "err": q.stderr},
             "topo": {"rc": t.returncode, "out": t.stdout, "err": t.stderr},
             "fabricmanager": "active", "venv_exists": True, "dists": {"torch": "2.13.0+cpu"},
             "torch_runtime": {"torch": "2.13.0+cpu", "cuda": None, "device_count": 0}}
    v = evaluate.host_verdict("h", facts, count, "cpu")
    cls, advice = VERDICTS[name]
    assert v.topology == cls and v.status == "PASS", v.checks
    assert [g["name"] for g in v.gpus] == [EXPECTED[name][1]] * count
    if advice:
        assert any(advice in a for a in v.advice), v.advice
    else:
        assert v.advice == []
    topo_detail = next(c.detail for c in v.checks if c.name == "topology")
    assert topo_detail.startswith("1 GPU," if count == 1 else f"{count} GPUs,")


# --------------------------------------------------------------- health ----

def _health(b: Box) -> dict:
    from torchrig.verify import health
    got = {k: dict(zip(("rc", "out", "err"), (r.returncode, r.stdout, r.stderr)))
           for k, r in (("health_xml", b.run("-q", "-x")), ("nvlink_status", b.run("nvlink", "-s")),
                        ("nvlink_errors", b.run("nvlink", "-e")))}
    got["kernel_journal"] = {"rc": 0, "out": "", "err": ""}
    got["kernel_dmesg"] = {"rc": 0, "out": "", "err": ""}  # the testbed's stand-in dmesg
    return {c.name: c for c in health.checks(got, b.run("topo", "-m").stdout)}


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_every_profile_is_healthy_by_default_for_the_products_parsers(tmp_path, profile):
    got = _health(make_box(tmp_path, profile=profile))
    assert {c.status for c in got.values()} == {"PASS"}, got
    if profile == "h100-nvswitch-8":
        assert got["nvlink"].detail.startswith("144 links up")  # 8 GPUs x NV18


def test_injected_health_faults_are_what_the_product_reads(box):
    (box.root / "health.json").write_text(json.dumps({"1": {
        "remap_failure": True, "links_down": [0], "nvlink_replays": 7, "pcie_replays": 3,
        "throttle_reasons": 0x80}}))
    got = _health(box)
    assert got["memory"].status == "FAIL" and "GPU 1: row remapping failed" in got["memory"].detail
    assert got["nvlink"].status == "FAIL" and "GPU 1: 1 of the 2 NVLinks" in got["nvlink"].detail
    assert "link 0 replay errors 7" in got["nvlink"].detail
    assert got["pcie-link"].status == "WARN" and got["clocks"].status == "WARN"
    assert "power brake" in got["clocks"].detail


def test_xml_needs_q(box):
    assert box.run("-x").returncode == 2


# ---------------------------------------------------------------- dcgmi ----

DCGMI = SCRIPT.with_name("dcgmi")


def _dcgm(b: Box, *args, engine=True):
    env = b.env()
    env["TORCHRIG_STANDIN_DCGM_FILE"] = str(b.root / "dcgm")
    if engine:
        (b.root / "dcgm").write_text("")
    r = subprocess.run([sys.executable, str(DCGMI), *args], env=env, capture_output=True,
                       text=True, timeout=30)
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr}


@pytest.mark.parametrize("level,tests", [("1", 9), ("3", 9 + 5 * 2)])
def test_dcgmi_diag_passes_on_a_healthy_box(box, level, tests):
    from torchrig.facts import dcgm_diag
    from torchrig.verify import health
    r = _dcgm(box, "diag", "-r", level, "-j")
    assert r["rc"] == 0 and len(dcgm_diag.parse(r["out"])) == tests
    assert health.diag_check({"dcgm_diag": r}).status == "PASS"


def test_dcgmi_diag_fails_the_memory_tests_of_an_injected_fault(box):
    from torchrig.verify import health
    (box.root / "health.json").write_text(json.dumps({"1": {"remap_pending": True}}))
    c = health.diag_check({"dcgm_diag": _dcgm(box, "diag", "-r", "2", "-j")})
    assert c.status == "FAIL" and "GPU Memory GPU 1: FAIL (GPU 1 has uncorrectable memory" in c.detail


def test_dcgmi_without_its_host_engine_is_not_run(box):
    from torchrig.verify import health
    c = health.diag_check({"dcgm_diag": _dcgm(box, "diag", "-r", "1", "-j", engine=False)})
    assert c.status == "NOT RUN" and "host engine" in c.detail.lower()
