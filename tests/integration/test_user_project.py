"""A user's own project (tests/projects/ddp_six: a plain DDP script, its own package, a
dependency from requirements.txt, a .gitignore'd large file), launched with --workdir on two
testbed nodes (gpu1, gpu4): pushed without what is ignored, its dependency installed once into
a job environment equal on every node, run as a script and as a module, and laid out as a src
layout; and what is refused
before anything starts: an environment changed by hand, a requirement that would replace torch,
a tree over the size bound."""

import re
import shutil
from pathlib import Path

import pytest

from conftest import NODES, invoke, launch, logs, sh, sh_each, status, wait_unit_ended

pytestmark = pytest.mark.provisioned("gpu1", "gpu4")
PROJECT = Path(__file__).resolve().parents[1] / "projects" / "ddp_six"
ENVS = "/opt/torchrig/envs"


@pytest.fixture
def project(tmp_path):
    """A copy of the project, with the large file its .gitignore excludes."""
    p = tmp_path / "ddp_six"
    shutil.copytree(PROJECT, p)
    with open(p / "big.bin", "wb") as f:
        f.write(b"\xff" * (8 << 20))
    return p


def _ran(inv, job):
    for h in NODES.split(","):
        assert wait_unit_ended(inv, h, f"torchrig-{job}.service") == "inactive"
    return logs(inv, job).stdout


def _said(r) -> str:
    """What launch told the operator: its progress lines go to stderr, the result to stdout."""
    return r.stdout + r.stderr


def _env_of(out: str) -> str:
    return re.search(r"job environment ([0-9a-f]{16}):", out).group(1)


def test_a_project_runs_with_its_dependency_installed_once(testbed, project):
    # another local user on the rank-0 node makes Inductor's default cache folder first
    # (/tmp/torchinductor_<service user>), to fill it with the compiled code a job would run
    planted = "/tmp/torchinductor_torchrig"
    sh(testbed, "gpu1", f"rm -rf {planted}; runuser -u nobody -- mkdir -m 0777 {planted} && "
                        f"runuser -u nobody -- touch {planted}/planted")
    # torch.compile: Inductor builds its C++ kernels with the node's compiler and Python.h
    # (provision's base packages), into the job's home
    r = launch(testbed, "u-script", "--workdir", str(project), "--args", "--steps 3 --compile")
    assert r.returncode == 0, r.stdout + r.stderr
    env = _env_of(_said(r))
    assert "gpu1: job environment built in" in _said(r), _said(r)
    assert "gpu4: job environment built in" in _said(r), _said(r)
    out = _ran(testbed, "u-script")
    assert "six 1.16.0 world 4" in out and "finished 3 steps" in out, out
    # the job has a home it can write (torch.hub's folder made there), Inductor caches in it,
    # and its /tmp is its own: the planted folder is not the job's, and is left as it was
    home = "/opt/torchrig/home"
    assert (f"hub {home}/.cache/torch/hub inductor {home}/.cache/torchinductor tmp []"
            in out), out
    got = sh_each(testbed, "gpu1", {"home": f"stat -c '%U %a' {home}",
                                    "hub": f"stat -c %U {home}/.cache/torch/hub",
                                    "planted": f"ls -A {planted}; stat -c %U {planted}",
                                    "kernels": f"find {home}/.cache/torchinductor -name '*.so' "
                                               "-user torchrig | wc -l"})
    assert int(got.pop("kernels")) > 0, got
    assert got == {"home": "torchrig 700", "hub": "torchrig", "planted": "planted\nnobody"}, got
    sh(testbed, "gpu1", f"rm -rf {planted}")
    # it prints no progress lines: status shows the last line rank 0 printed
    st = status(testbed, "u-script")[1]["nodes"]["gpu1"]
    assert st["progress"] is None and st["last_line"] == "finished 3 steps", st
    # the ignored file never reached a node; the project's files did
    stamp = {}
    for h in NODES.split(","):
        got = sh_each(testbed, h, {
            "big": "find /opt/torchrig/workdirs -name big.bin | wc -l",
            "run.py": "find /opt/torchrig/workdirs -path '*/trainer/run.py' | wc -l",
            # six lives in the job environment, the torch venv is untouched
            "six": f"ls -d {ENVS}/{env}/lib/python3*/site-packages/six.py | wc -l",
            "venv six": "ls /opt/torchrig/venv/lib/python3*/site-packages/ | grep -c '^six' || true",
            "stamp": f"stat -c %Y {ENVS}/{env}/.complete"})
        assert got["big"] == "0" and got["run.py"] not in ("0", ""), (h, got)
        assert got["six"] == "1" and got["venv six"] == "0", (h, got)
        assert got["stamp"].isdigit(), (h, got)
        stamp[h] = got["stamp"]

    # a second launch with the same dependencies (as a module this time) installs nothing
    r = launch(testbed, "u-module", "--workdir", str(project), "--module", "trainer.run",
               "--args", "--steps 2 --progress")
    assert r.returncode == 0, r.stdout + r.stderr
    said = _said(r)
    assert _env_of(said) == env
    assert "gpu1: job environment cached" in said and "gpu4: job environment cached" in said
    assert "built" not in said, said
    assert "(0 file(s) sent)" in said   # the release is on the nodes already
    for h in NODES.split(","):
        got = sh_each(testbed, h, {"stamp": f"stat -c %Y {ENVS}/{env}/.complete",
                                   "unit": "grep ExecStart /etc/systemd/system/torchrig-u-module.service"})
        assert got["stamp"] == stamp[h], (h, got)
        assert '"-m" "trainer.run"' in got["unit"], (h, got)
    assert "finished 2 steps" in _ran(testbed, "u-module")
    # its steps, written with the progress module pushed with the release, reach status
    st = status(testbed, "u-module")[1]["nodes"]["gpu1"]
    assert st["progress"].startswith("step=2 loss="), st


def test_a_src_layout_project_imports_its_package(testbed, project):
    """The project packaged as PyPA recommends (pyproject.toml, its package under src/) with
    the requirements.txt such projects have (`-e .`): its requires-python checked against the
    nodes' Python, its dependency read from [project] dependencies, its package importable
    from src/ as `pip install -e .` makes it on the user's laptop."""
    (project / "src").mkdir()
    shutil.move(project / "trainer", project / "src" / "trainer")
    (project / "requirements.txt").write_text("-e .  # the project and its dependencies\n")
    toml = ('[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
            '[project]\nname = "trainer"\nversion = "0.1"\ndependencies = ["six==1.16.0"]\n'
            'requires-python = "{}"\n')
    # a Python the nodes do not have (the testbed's Debian 12: 3.11): refused by name, before
    # anything is sent
    (project / "pyproject.toml").write_text(toml.format(">=3.12"))
    r = launch(testbed, "u-src", "--workdir", str(project), "--module", "trainer.run")
    assert r.returncode == 1, _said(r)
    assert re.search(r"nothing started: pyproject.toml says requires-python '>=3.12', and the "
                     r"torch venv runs Python 3\.11\.\d+ on gpu1, gpu4", r.stderr), _said(r)
    assert "file(s) sent" not in _said(r), _said(r)
    (project / "pyproject.toml").write_text(toml.format(">=3.10"))
    r = launch(testbed, "u-src", "--workdir", str(project), "--module", "trainer.run",
               "--args", "--steps 2")
    assert r.returncode == 0, _said(r)
    assert "its packages import from src too (the src layout)" in _said(r), _said(r)
    assert "1 requirement(s) from requirements.txt" in _said(r), _said(r)
    out = _ran(testbed, "u-src")
    assert "six 1.16.0 world 4" in out and "finished 2 steps" in out, out


def test_a_job_file_launch_then_an_environment_changed_by_hand_is_refused(testbed, project):
    spec = project.parent / "job.yml"   # the workdir relative to the job file's folder
    spec.write_text("job: u-spec\nworkdir: ddp_six\nscript: train.py\nargs: [--steps, '2']\n"
                    "nproc_per_node: 1\nenv: {SPEC_SAYS: hello}\n")
    r = invoke("launch", "-i", str(testbed), "-H", NODES, "--spec", str(spec), "--nproc-per-node", "2")
    assert r.returncode == 0, _said(r)
    assert "job u-spec started on gpu1,gpu4 (2 node(s) x 2 process(es))" in r.stdout  # flag wins
    env = _env_of(_said(r))
    assert "finished 2 steps" in _ran(testbed, "u-spec")
    assert sh(testbed, "gpu1", "grep SPEC_SAYS /etc/torchrig/jobs/u-spec.env") == "SPEC_SAYS='hello'"
    sh(testbed, "gpu4", f"/opt/torchrig/venv/bin/python -m pip --python {ENVS}/{env}/bin/python uninstall -q -y six")
    try:
        r = launch(testbed, "u-changed", "--workdir", str(project), "--args", "--steps 1")
        assert r.returncode == 1
        err = r.stderr
        assert "nothing started: the job environments differ" in err, err
        assert "gpu4: changed since it was built: six 1.16.0 -> absent" in err, err
        assert "six: gpu1 1.16.0, gpu4 absent" in err, err
        for h in NODES.split(","):
            assert sh(testbed, h, "test -e /etc/systemd/system/torchrig-u-changed.service && echo yes || echo no") == "no"
    finally:
        sh(testbed, "gpu4", f"rm -rf {ENVS}/{env}")   # built afresh by the next launch


def test_a_requirement_replacing_torch_is_refused(testbed, project):
    (project / "requirements.txt").write_text("six==1.16.0\ntorch==2.5.0\n")
    r = launch(testbed, "u-torch", "--workdir", str(project))
    assert r.returncode == 1
    assert "requirements.txt: 'torch==2.5.0' would replace the provisioned torch 2.13.0" in r.stderr
    assert "--allow-torch-change" in r.stderr and "Traceback" not in r.stderr


def test_an_oversized_tree_is_refused_before_anything_is_sent(testbed, project):
    (project / ".gitignore").write_text("")   # big.bin now counts: 8 MiB
    with open(project / "huge.dat", "wb") as f:   # sparse: 600 MiB of size, no disk
        f.truncate(600 << 20)
    before = {h: sh(testbed, h, "ls /opt/torchrig/workdirs/releases 2>/dev/null | sort") for h in NODES.split(",")}
    r = launch(testbed, "u-huge", "--workdir", str(project))
    assert r.returncode == 1
    assert "608.0 MiB to send, over the 500.0 MiB bound" in r.stderr, r.stderr
    assert "huge.dat (600.0 MiB), big.bin (8.0 MiB)" in r.stderr
    for h in NODES.split(","):
        assert sh(testbed, h, "ls /opt/torchrig/workdirs/releases 2>/dev/null | sort") == before[h]
