"""One short-flag set for every task (common.SHORT_FLAGS): a letter means the same flag in every
task that has it, and `-h` is each task's help. (That every command the docs show names real
flags is test_docs.py's.)"""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from torchrig.cli import common, tasks  # noqa: E402
from torchrig.cli import logs as cli_logs  # noqa: E402


def _tasks():
    """(dotted name, Task) for every task, the testbed's included."""
    def walk(coll, prefix=""):
        for name, t in coll.tasks.items():
            yield prefix + name, t
        for name, sub in coll.collections.items():
            yield from walk(sub, f"{prefix}{name}.")
    return list(walk(tasks.ns))


def _flags(task) -> dict[str, str]:
    """{'-x' or '--long-name': the long name} for one task's flags."""
    out = {}
    for arg in task.get_arguments():
        long = next(n for n in arg.names if len(n) > 1)
        for n in arg.names:
            out[("-" if len(n) == 1 else "--") + n] = long
        if arg.kind is bool:
            out["--no-" + long] = long
    return out


def test_a_short_flag_means_one_long_flag_in_every_task():
    meaning: dict[str, set] = {}
    for name, t in _tasks():
        for flag, long in _flags(t).items():
            if not flag.startswith("--"):
                meaning.setdefault(flag, set()).add(long)
                assert common.SHORT_FLAGS.get(long.replace("-", "_")) == flag[1], (name, flag, long)
    assert "-h" not in meaning  # Invoke's help, in every task
    assert {f: m for f, m in meaning.items() if len(m) > 1} == {}
    assert meaning["-H"] == {"host"} and meaning["-i"] == {"inventory"}
    # --json has no letter: it was -j, -s or -o depending on the task
    assert all(not any(len(n) == 1 for n in a.names)
               for _, t in _tasks() for a in t.get_arguments() if a.name == "json")


@pytest.mark.parametrize("task", ["provision", "status", "testbed.up"])
def test_dash_h_is_the_tasks_help(task):
    r = subprocess.run([sys.executable, "-m", "invoke", task, "-h"], cwd=REPO, text=True,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"[--core-opts] {task} [--options]" in r.stdout
    assert "-H STRING, --host=STRING" in r.stdout or task == "testbed.up"


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_exec_dash_h_runs_nothing_and_says_where_its_help_is(flag, tmp_path):
    """exec's command is positional: Invoke gave it "-h", and exec ran `bash -c -h` on every
    host (one host here, on a port nothing listens on: no connection may even be tried)."""
    inv = tmp_path / "inv.yml"
    inv.write_text("hosts:\n  - {name: a, address: 127.0.0.1, port: 1}\n")
    r = subprocess.run([sys.executable, "-m", "invoke", "exec", "-i", str(inv), flag], cwd=REPO,
                       text=True, capture_output=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip() == (f"error: exec: {flag} would run as the command on every host; "
                                "for exec's help: torchrig --help exec")


@pytest.mark.parametrize("value,tty,no_color,want", [
    ("false", True, "", False), ("never", True, "", False), ("no", True, "", False),
    ("0", True, "", False), ("true", False, "", True), ("always", False, "1", True),
    ("1", False, "", True), (None, True, "", True), ("auto", True, "", True),
    (None, True, "1", False), (None, True, "0", False), (None, False, "", False)])
def test_color_flag_and_no_color(monkeypatch, value, tty, no_color, want):
    """`logs --color false|never|no|0` printed colour (any non-empty text was true) and
    NO_COLOR was ignored; a flag given wins over NO_COLOR (no-color.org)."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    monkeypatch.setenv("NO_COLOR", no_color)
    assert cli_logs._color(value) is want


def test_a_bad_color_value_is_one_error_line():
    with pytest.raises(cli_logs.Exit) as e:
        cli_logs._color("purple")
    assert e.value.message == ("error: --color 'purple': expected always, never or auto (or "
                               "yes/no, true/false, 1/0)")
