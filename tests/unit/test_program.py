"""The `torchrig` command (torchrig/cli/program.py): Invoke's Program over the task collection.
Run as the installed console script (the editable install's .venv/bin/torchrig), from a folder
that is not the checkout, with the config files and the environment a user would have."""

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from torchrig.cli.tasks import ns
from torchrig.resources import EXAMPLE_INVENTORY

TORCHRIG = Path(sys.executable).parent / "torchrig"


@pytest.fixture
def user(tmp_path):
    """A user's folder and home, none of the checkout's files or config around."""
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "INVOKE_"))}
    env["HOME"] = str(tmp_path / "home")

    def run(*argv, extra_env=None, cwd=tmp_path / "work"):
        return subprocess.run([str(TORCHRIG), *argv], cwd=cwd, env={**env, **(extra_env or {})},
                              capture_output=True, text=True, timeout=120)
    run.tmp = tmp_path
    return run


def _inventory(path: Path, host: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"hosts:\n  - {{name: {host}, connection: local, vars: {{accelerator: cpu}}}}\n")
    return path


def _host_read(r) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)[0]["name"]


def test_version_names_torchrig_and_the_libraries_a_bug_report_needs(user):
    r = user("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{d} {version(d)}" for d in
                                     ("torchrig", "invoke", "fabric", "paramiko")]


def test_list_shows_every_task_of_the_collection(user):
    r = user("--list")
    assert r.returncode == 0, r.stderr
    listed = set(re.findall(r"^  (\S+)", r.stdout, re.M))
    assert listed == set(ns.task_names), listed ^ set(ns.task_names)


def test_shell_completion_is_invokes_for_the_torchrig_name(user):
    r = user("--print-completion-script", "bash")
    assert r.returncode == 0 and "complete -F" in r.stdout and " torchrig" in r.stdout, r.stdout
    r = user("--complete", "--", "torchrig", "prov")
    assert r.returncode == 0 and "provision" in r.stdout.split(), r.stdout


def test_inventory_from_flag_then_environment_then_config_file_then_the_folder(user):
    t = user.tmp
    _inventory(t / "work/inventory/hosts.yml", "from-folder")
    assert _host_read(user("hosts", "--json")) == "from-folder"
    cfg = t / "home/.torchrig.yaml"
    cfg.write_text(f"torchrig:\n  inventory: {_inventory(t / 'cfg.yml', 'from-config')}\n")
    assert _host_read(user("hosts", "--json")) == "from-config"
    env = {"TORCHRIG_INVENTORY": str(_inventory(t / "env.yml", "from-env"))}
    assert _host_read(user("hosts", "--json", extra_env=env)) == "from-env"
    _inventory(t / "work/flag.yml", "from-flag")
    assert _host_read(user("hosts", "--json", "-i", "flag.yml", extra_env=env)) == "from-flag"
    # a config file named with -f, as Invoke's runtime level
    (t / "other.yaml").write_text(f"torchrig:\n  inventory: {_inventory(t / 'o.yml', 'from-f')}\n")
    assert _host_read(user("-f", str(t / "other.yaml"), "hosts", "--json")) == "from-f"


def test_no_inventory_says_the_three_ways_to_give_one(user):
    r = user("hosts")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == ("error: inventory/hosts.yml: cannot read the inventory (No such file or "
                        "directory); pass --inventory PATH, set TORCHRIG_INVENTORY, or start one "
                        "with: torchrig init\n")


def test_init_writes_the_example_where_tasks_read_it_and_never_replaces_one(user):
    r = user("init")
    assert r.returncode == 0, r.stderr
    written = user.tmp / "work/inventory/hosts.yml"
    assert written.read_text() == EXAMPLE_INVENTORY.read_text()
    r = user("hosts", "--json")  # the example is a valid inventory
    assert r.returncode == 0 and json.loads(r.stdout), r.stderr
    written.write_text("# mine\n")
    r = user("init")
    assert r.returncode == 1
    assert r.stderr == "error: inventory/hosts.yml exists: edit it, or pass --inventory NEW_PATH\n"
    assert written.read_text() == "# mine\n"
    r = user("init", extra_env={"TORCHRIG_INVENTORY": str(user.tmp / "lab/a.yml")})
    assert r.returncode == 0 and (user.tmp / "lab/a.yml").is_file(), r.stderr


def test_a_reader_that_leaves_early_gets_no_traceback(user):
    r = subprocess.run(f"{TORCHRIG} --list | head -n 1", shell=True, capture_output=True,
                       text=True, cwd=user.tmp, timeout=60)
    assert r.stdout.strip() and r.stderr == "", r.stderr


def test_the_checkout_invoke_reads_the_same_collection():
    import tasks
    from torchrig.cli import program
    assert tasks.ns is ns is program.program.namespace
