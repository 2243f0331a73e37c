"""Integration tests: a real testbed (nspawn hosts with systemd and sshd) brought up once per
session on its own bridge, state folder and subnet, so a user's testbed is left alone."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ENV = {
    "TORCHRIG_TESTBED_STATE": "/var/lib/torchrig-testbed-tests",
    "TORCHRIG_TESTBED_BRIDGE": "trbt0",
    "TORCHRIG_TESTBED_SUBNET": "10.213.7",
}
# A caller may choose other values (parallel runs: each needs its own state, bridge, subnet).
ENV = {k: os.environ.get(k, v) for k, v in ENV.items()}
os.environ.update(ENV)  # before torchrig.testbed.paths is imported by any test

if platform.system() != "Linux" or os.geteuid() != 0:
    pytest.skip("integration tests need Linux and root (systemd-nspawn, mounts, netns)",
                allow_module_level=True)

N_HOSTS = 4
PROFILES = "v100s-nvlink-2,gpu2=h100-nvswitch-8,gpu3=pcie-sys-4"  # gpu4: a second V100S pair


def invoke(*args, timeout=600, check=False, env=None) -> subprocess.CompletedProcess:
    """Run the toolkit's CLI exactly as a user would."""
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **ENV, **(env or {})})
    if check and r.returncode != 0:
        raise AssertionError(f"invoke {' '.join(args)} failed ({r.returncode}):\n"
                             f"{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    inv = tmp_path_factory.mktemp("testbed") / "testbed.yml"
    invoke("testbed.down", timeout=180)  # leftovers of an aborted earlier run
    invoke("testbed.up", "--hosts", str(N_HOSTS),
           "--profile", PROFILES,
           "--inventory", str(inv), check=True, timeout=900)
    yield inv
    invoke("testbed.down", timeout=180)


@pytest.fixture
def inventory_doc(testbed):
    return yaml.safe_load(testbed.read_text())


def write_inventory(tmp_path, doc, name="inv.yml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc))
    return p
