"""A non-editable install (`pip install .` into a fresh venv) renders a unit and pushes the
payload: templates/ and payload/ are found through torchrig.resources, not through the
checkout's folders (which the installed package cannot see)."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import os, sys
from pathlib import Path
import torchrig
from torchrig import inventory, resources
from torchrig.launch.plan import render_unit
from torchrig.launch.push import manifest, push
from torchrig.launch.run import LaunchOptions, plan_job
from torchrig.remote import LocalConnection

here = Path(torchrig.__file__).resolve().parent
assert here.is_relative_to(Path(sys.prefix).resolve()), f"torchrig imported from {here}"
assert resources.PAYLOAD.is_relative_to(here) and resources.TEMPLATES.is_relative_to(here)
tmp = Path(sys.argv[1])
(tmp / "inv.yml").write_text("hosts:\n  - {name: n1, connection: local, vars: {accelerator: cpu}}\n")
inv = inventory.load(tmp / "inv.yml")
job = plan_job(inv, list(inv.hosts), LaunchOptions(job="j1", nproc="2"), "/opt/r", {})
unit = render_unit(job, job.nodes[0])
assert "ExecStart=" in unit and "train.py" in unit, unit
m = manifest(resources.PAYLOAD)
assert "train.py" in m and "requirements.txt" in m, sorted(m)
if os.geteuid() == 0:  # the push scripts chown to root
    (tmp / "prefix").mkdir(mode=0o755)
    rel, sent = push(LocalConnection(), resources.PAYLOAD, str(tmp / "prefix"))
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


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the checkout")
def test_pip_install_into_a_fresh_venv_renders_a_unit_and_pushes_the_payload(tmp_path):
    src, venv = tmp_path / "src", tmp_path / "venv"
    _copy_checkout(src)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # `pip install .`, offline: the wheel is built with this venv's setuptools, then installed;
    # the dependencies come from this venv's site-packages (a .pth line; .pth files in it,
    # like the editable install's finder, are not run)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-index", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("torchrig-*.whl")
    subprocess.run([*pip, "--python", str(py), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, cwd=tmp_path)
    fresh = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    Path(fresh, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    shutil.rmtree(src)  # nothing of the checkout copy is left to read from
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py), "-I", "-c", PROBE, str(tmp_path)], capture_output=True,
                       text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0 and "INSTALLED-OK" in r.stdout, r.stdout + r.stderr
