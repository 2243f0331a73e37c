"""Root-run Python helpers never import from the working directory: with `python3 -` (or
`-c`, `-m`) Python puts the cwd first on sys.path, so on a `connection: local` host an
operator running invoke from a folder another user can write (a shared checkout, /tmp) would
have root import that user's `json.py`. The helpers run as `python3 -I` (isolated)."""

import os
from pathlib import Path

import pytest

from torchrig import inventory
from torchrig.onhost import script
from torchrig.launch.status import node_states as status
from torchrig.provision.apply import gather as provision_gather
from torchrig.session import Fleet
from torchrig.verify.run import HostOpts, _bench_cmd, gather, host_opts

REPO = Path(__file__).resolve().parents[2]
PLANT = "import pathlib; pathlib.Path({marker!r}).write_text('imported from the cwd')\n"


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A cwd with a planted json.py (every helper imports json); the marker it would write."""
    cwd = tmp_path / "shared"
    cwd.mkdir()
    marker = tmp_path / "pwned"
    for mod in ("json.py", "fcntl.py", "signal.py"):
        (cwd / mod).write_text(PLANT.format(marker=str(marker)))
    monkeypatch.chdir(cwd)
    return marker


def _local_inv(tmp_path):
    p = tmp_path / "inv.yml"
    p.write_text(f"hosts:\n  - {{name: head, connection: local, vars: {{log_dir: {tmp_path}/logs, "
                 "accelerator: cpu}}\n")
    return inventory.load(p)


@pytest.mark.skipif(os.geteuid() != 0, reason="status runs its helper through privileged()")
def test_status_helper_imports_nothing_from_the_cwd(tmp_path, planted):
    inv = _local_inv(tmp_path)
    status(Fleet(inv), inv.hosts, "job1")  # the result does not matter (no unit here)
    assert not planted.exists()


def test_verify_facts_helper_imports_nothing_from_the_cwd(tmp_path, planted):
    inv = _local_inv(tmp_path)
    h = inv.hosts[0]
    try:
        gather(Fleet(inv), h, host_opts(inv, h), None, False)
    except Exception:  # noqa: BLE001 - facts of this machine do not matter here
        pass
    assert not planted.exists()


def test_verify_torch_runtime_imports_nothing_from_the_cwd(tmp_path, planted):
    """The venv's interpreter (`-c`) that verify runs to import torch: this checkout's .venv."""
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "venv").symlink_to(REPO / ".venv")
    p = tmp_path / "inv.yml"
    p.write_text("hosts:\n  - {name: head, connection: local, vars: "
                 f"{{prefix: {tmp_path / 'prefix'}, accelerator: cpu}}}}\n")
    inv = inventory.load(p)
    h = inv.hosts[0]
    facts, _ = gather(Fleet(inv), h, host_opts(inv, h), None, True)
    assert facts["torch_runtime"].get("torch"), facts["torch_runtime"]
    assert not planted.exists()


def test_bench_runs_torchrun_from_its_private_folder():
    """`python -m torch.distributed.run` puts the cwd first on sys.path: the benchmark command
    runs it from its private mktemp folder."""
    o = HostOpts("/v", "/p", "cpu", 29400, {}, "10.0.0.1")
    cmd = _bench_cmd(o, 2, ["--standalone"], {})
    assert cmd.index('cd "$d"') < cmd.index("torch.distributed.run")


def test_launch_jobdirs_helper_is_isolated():
    assert "python3 -I - " in script("launch/jobdirs.sh", dirs="{}", dirs_script="")


def test_provision_facts_helper_imports_nothing_from_the_cwd(tmp_path, planted):
    from torchrig.settings import settings_for
    from torchrig.connections import LocalConnection
    s = settings_for("head", {}, "inv.yml")
    try:
        provision_gather(LocalConnection(None), s)
    except Exception:  # noqa: BLE001 - facts of this machine do not matter here
        pass
    assert not planted.exists()
