"""A non-editable install (`pip install .` into a fresh venv) renders a unit and pushes the
payload: templates/ and payload/ are found through torchrig.resources, not through the
checkout's folders (which the installed package cannot see). And the wheel, installed as a
user without root, gives the `torchrig` command and no torch."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import os, sys
from pathlib import Path
import torchrig
from torchrig import inventory, resources
from torchrig.launch.plan import render_unit
from torchrig.launch.push import push
from torchrig.launch.tree import payload_tree
from torchrig.launch.run import LaunchOptions, plan_job
from torchrig.connections import LocalConnection

here = Path(torchrig.__file__).resolve().parent
assert here.is_relative_to(Path(sys.prefix).resolve()), f"torchrig imported from {here}"
assert resources.PAYLOAD.is_relative_to(here) and resources.TEMPLATES.is_relative_to(here)
tmp = Path(sys.argv[1])
(tmp / "inv.yml").write_text("hosts:\n  - {name: n1, connection: local, vars: {accelerator: cpu}}\n")
inv = inventory.load(tmp / "inv.yml")
job = plan_job(inv, list(inv.hosts), LaunchOptions(job="j1", nproc="2"), "/opt/r", {})
unit = render_unit(job, job.nodes[0])
assert "ExecStart=" in unit and "train.py" in unit, unit
m = payload_tree(resources.PAYLOAD).manifest()
assert "train.py" in m and "requirements.txt" in m, sorted(m)
if os.geteuid() == 0:  # the push scripts chown to root
    (tmp / "prefix").mkdir(mode=0o755)
    rel, sent = push(LocalConnection(), payload_tree(resources.PAYLOAD), str(tmp / "prefix" / "payload"))
    assert sent == len(m) and (Path(rel) / "train.py").read_bytes() == (resources.PAYLOAD / "train.py").read_bytes()
print("INSTALLED-OK", here)
"""


def _copy_checkout(dst: Path) -> None:
    """The files git would hand out (tracked and new, not ignored), links kept as links."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src, to = REPO / name, dst / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, to, follow_symlinks=False)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel .` of the checkout (offline, this venv's setuptools), as a user's build gets it."""
    if shutil.which("git") is None:
        pytest.skip("needs git to list the checkout")
    tmp = tmp_path_factory.mktemp("wheel")
    _copy_checkout(tmp / "src")
    subprocess.run([sys.executable, "-m", "pip", "-q", "wheel", "--no-deps", "--no-index",
                    "--no-build-isolation", "-w", str(tmp / "dist"), str(tmp / "src")],
                   check=True, cwd=tmp)
    shutil.rmtree(tmp / "src")  # nothing of the checkout copy is left to read from
    whl, = (tmp / "dist").glob("torchrig-*.whl")
    return whl


def test_pip_install_into_a_fresh_venv_renders_a_unit_and_pushes_the_payload(tmp_path, wheel):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # the dependencies come from this venv's site-packages (a .pth line; .pth files in it,
    # like the editable install's finder, are not run)
    subprocess.run([sys.executable, "-m", "pip", "-q", "--python", str(py), "install",
                    "--no-deps", "--no-index", str(wheel)], check=True, cwd=tmp_path)
    fresh = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    Path(fresh, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py), "-I", "-c", PROBE, str(tmp_path)], capture_output=True,
                       text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0 and "INSTALLED-OK" in r.stdout, r.stdout + r.stderr


# run as a user without root (nobody) when the tests run as root
AS_USER = (["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
           if os.geteuid() == 0 else [])


def test_the_wheel_gives_a_torchrig_command_to_a_user_without_root_or_torch(wheel):
    """What a laptop gets from `pip install torchrig` (pipx is the same into its own venv): a
    venv of its own, the dependencies resolved from the configured package sources, a
    `torchrig` command that works from any folder; torch is not among what it installs."""
    home = Path(tempfile.mkdtemp(prefix="torchrig-user-"))  # /tmp/..., reachable by nobody
    try:
        shutil.copy(wheel, home)
        (home / "elsewhere").mkdir()
        (home / "elsewhere" / "lab.yml").write_text(
            "hosts:\n  - {name: box1, connection: local, vars: {accelerator: cpu}}\n")
        if AS_USER:
            for p in [home, *home.rglob("*")]:
                os.chown(p, 65534, 65534)
        env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}

        def run(*argv, cwd=home / "elsewhere"):
            return subprocess.run([*AS_USER, *map(str, argv)], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=600)
        r = run(shutil.which("python3", path=env["PATH"]), "-m", "venv", home / "venv")
        assert r.returncode == 0, r.stderr
        r = run(home / "venv/bin/pip", "install", "-q", home / wheel.name)
        assert r.returncode == 0, r.stdout + r.stderr
        cmd = home / "venv/bin/torchrig"
        r = run(cmd, "--version")
        assert r.returncode == 0, r.stderr
        names = [ln.split()[0] for ln in r.stdout.splitlines()]
        assert names == ["torchrig", "invoke", "fabric", "paramiko"], r.stdout
        assert r.stdout.splitlines()[0] == "torchrig " + version("torchrig"), r.stdout
        r = run(cmd, "--list")
        assert r.returncode == 0 and all(t in r.stdout.split() for t in
                                         ("provision", "verify", "launch", "logs", "init")), r.stdout
        r = run(cmd, "hosts", "-i", "lab.yml", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)[0]["name"] == "box1", r.stdout + r.stderr
        r = run(home / "venv/bin/python", "-c", "import torch")
        assert r.returncode != 0 and "No module named 'torch'" in r.stderr, r.stdout + r.stderr
    finally:
        shutil.rmtree(home, ignore_errors=True)
