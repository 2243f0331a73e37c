"""The scripts that run on a host (torchrig/onhost/): every bash script, rendered with
representative values (hostile ones among them), passes `bash -n`; every Python one compiles;
a value is always quoted; a missing value is an error naming the file and line."""

import py_compile
import subprocess

import pytest

from torchrig import onhost
from torchrig.errors import TorchrigError
from torchrig.facts import probe
from torchrig.onhost import Shell, script

HOSTILE = "a b'c $(touch /tmp/pwned) `id`;\""
JOB = {"jobs": "/etc/torchrig/jobs", "name": "torchrig-exp1.service", "job": "exp1",
       "running_states": Shell("active|activating"), "stop_record": "/etc/torchrig/jobs/exp1.stopped",
       "health_record": "/etc/torchrig/jobs/exp1.health"}
PUSH = {"base": "/opt/torchrig/payload", "h": "0123456789abcdef"}
DIRS = {"dirs": '{"user": "torchrig", "dirs": [["/var/log/torchrig", "exp1"]]}',
        "dirs_script": Shell(script("launch/jobdirs.py"))}
UNIT = {"unit": "torchrig.tensorboard-exp1-0a1b2c3d.service"}

# every .sh under onhost/, with values of the shapes its callers pass
VALUES = {
    "lib/lock.sh": {"lock_dir": HOSTILE, "lock_holder": Shell("another push held it"),
                    "lock_code": 1},
    "launch/lock.sh": JOB,
    "launch/own_busy.sh": JOB,
    "launch/jobdirs.sh": DIRS,
    "launch/install.sh": {**JOB, **DIRS, "files": Shell("echo files"),
                          "switch": Shell(script("push/switch.sh", **PUSH)),
                          "units": Shell("torchrig-exp1.service torchrig-gpumon@exp1.timer")},
    "launch/start.sh": {**JOB, "busy_units": Shell("systemctl list-units"), "firewall": 1,
                        "table": Shell("inet torchrig"), "firewall_unit": "torchrig.firewall.service",
                        "unit_file": "/etc/systemd/system/torchrig-exp1.service",
                        "marker": "# launch feedc0ffee", "unit_re": r"torchrig-[a-z]+\.service",
                        "exclusive": 0, "enable": 1,
                        "look": Shell(probe.stdin({"host": True}).rstrip("\n"))},
    "launch/undo.sh": {**JOB, "marker": "# launch x", "unit_file": "/etc/u.service",
                       "remove": Shell("rm -f /etc/u.service && systemctl daemon-reload")},
    "launch/stop.sh": {"unit": "torchrig-exp1.service", "sampler": "torchrig-gpumon-exp1.service",
                       "record": "/etc/torchrig/jobs/exp1.stopped"},
    "launch/prune.sh": {"jobs": "/etc/torchrig/jobs", "running_re": "active|activating",
                        "dirs_script": Shell(script("launch/jobdirs.py")),
                        "prune": [{"job": "exp1", "unit": "torchrig-exp1.service",
                                   "timer": "torchrig-gpumon@exp1.timer",
                                   "sampler": "torchrig-gpumon@exp1.service",
                                   "ended": "torchrig-ended@exp1.service",
                                   "unit_file": "/etc/systemd/system/torchrig-exp1.service",
                                   "marker": "# torchrig launch x", "files": Shell("/etc/a /etc/b"),
                                   "dirs": '{"remove": [["/var/log/torchrig", "exp1"]]}'},
                                  {"job": "exp2", "unit": "torchrig-exp2.service",
                                   "timer": "t", "sampler": "s", "ended": "e", "unit_file": "/etc/u",
                                   "marker": "", "files": Shell("/etc/c"), "dirs": ""}]},
    "push/lock.sh": {},
    "push/probe.sh": PUSH,
    "push/install.sh": {**PUSH, "src": ""},
    "push/switch.sh": PUSH,
    "deps/lock.sh": {},
    "deps/ensure.sh": {"envs": "/opt/torchrig/envs", "h": "0123456789abcdef",
                       "venv": "/opt/torchrig/venv", "netrc": "bWFjaGluZQ==", "requirements": "c2l4Cg==",
                       "pip_args": Shell("--index-url http://10.0.0.1/simple"),
                       "protected_check": script("deps/protected.py"),
                       "list_packages": script("deps/packages.py"), "allow_torch_change": 0},
    "slurm/record.sh": {"jobs": "/etc/torchrig/jobs", "path": "/etc/torchrig/jobs/exp1.slurm"},
    "tensorboard/start.sh": {**UNIT, "tb": "/opt/torchrig/venv/bin/tensorboard",
                             "venv": "/opt/torchrig/venv", "user": "torchrig", "job": "exp1",
                             "logdir": HOSTILE, "port": 0, "desc": "torchrig TensorBoard for job exp1"},
    "tensorboard/wait.sh": UNIT,
    "tensorboard/watch.sh": {**UNIT, "beat": 2},
    "tensorboard/stop.sh": UNIT,
    "provision/node_exporter_check.sh": {"url": "http://10.0.0.1:9100/metrics",
                                         "unit": "prometheus-node-exporter.service"},
    "changes/write_file.sh": {"path": "/etc/torchrig/jobs/exp1.env", "folder": "/etc/torchrig/jobs",
                              "data": "aGk=", "mode": "0600", "owner": "root:root"},
    "provision/preamble.sh": {"apt_wait": script("provision/apt_lock_wait.py"),
                              "lock_timeout": 600},
}


def test_every_script_has_representative_values():
    shell = {n for n in onhost.names() if n.endswith(".sh")}
    assert shell == set(VALUES), "a new .sh under onhost/ needs its values here"


@pytest.mark.parametrize("name", sorted(VALUES))
def test_rendered_bash_passes_bash_n(name):
    text = script(name, **VALUES[name])
    r = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"onhost/{name}: bash -n: {r.stderr}"
    assert "{{" not in text and "{%" not in text and "{#" not in text


@pytest.mark.parametrize("name", [n for n in onhost.names() if n.endswith(".py")])
def test_python_scripts_compile(name, tmp_path):
    py_compile.compile(str(onhost.HERE / name), cfile=str(tmp_path / "x.pyc"), doraise=True)
    assert script(name) == (onhost.HERE / name).read_text()  # sent as it is


def test_a_value_is_quoted_and_shell_text_is_not():
    text = script("tensorboard/wait.sh", unit=HOSTILE)
    r = subprocess.run(["bash", "-c", text.splitlines()[0] + '\nprintf %s "$u"'],
                       capture_output=True, text=True, timeout=30)
    assert r.stdout == HOSTILE
    assert "exit 7; }" in script("lib/lock.sh", lock_dir=Shell('"$base"'),
                                 lock_holder=Shell("x"), lock_code=7)


def test_a_missing_value_names_the_file_and_line():
    with pytest.raises(TorchrigError, match=r"onhost/launch/stop.sh:\d+: .*sampler"):
        script("launch/stop.sh", unit="u", record="r")


def test_a_none_value_is_refused():
    with pytest.raises(TorchrigError, match="is None"):
        script("launch/stop.sh", unit="u", record="r", sampler=None)


def test_python_scripts_take_no_substitution():
    with pytest.raises(TorchrigError, match="argv or on stdin"):
        script("slurm/left.py", job="x")


def test_no_script_is_left_as_a_python_string():
    """A script that runs on a host is a file under onhost/, not a string in a module: no bash
    script body (`set -e...`), heredoc'd Python or shebang in torchrig's modules (the testbed,
    which builds its simulated hosts' own files, aside)."""
    import re
    pkg = onhost.HERE.parent
    shapes = re.compile(r'"""(set -e|#!/bin/|python3 -I - .*<<)|<<.TORCHRIG_PY')
    bad = [f"{p.relative_to(pkg)}:{n}" for p in pkg.rglob("*.py")
           if onhost.HERE not in p.parents and "testbed" not in p.parts
           for n, line in enumerate(p.read_text().splitlines(), 1) if shapes.search(line)]
    assert not bad, bad
