"""Job files (`launch --spec FILE`, torchrig/launch/spec.py): validated with one line naming the
file and the key, merged under the flags given, defaults last; jobs/example.yml documents
every key. The CLI rows run the real task: the console script for the error lines, Invoke's
Program in-process (service.launch replaced) for what reaches the launch."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from torchrig.errors import TorchrigError
from torchrig.job import DEFAULTS
from torchrig.launch import spec as job_spec
from torchrig.launch.plan import parse_env, split_args

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jobs" / "example.yml"
TORCHRIG = Path(sys.executable).parent / "torchrig"

FULL = """\
job: gpt2-a
workdir: proj
module: gpt2.train
args: [--preset, gpt2, --run-name, "my run"]
nodes: 2
nproc_per_node: 4
env: {NCCL_DEBUG: WARN, SEED: 7, DATA_URL: "https://u:p@x/"}
secret_env: [DATA_URL]
requirements: requirements.txt
allow_torch_change: true
max_restarts: 0
start_timeout: 60
rdzv_timeout: 90
exit_barrier_timeout: 30
early_fail_window: 0
data: shards
data_verify: full
backend: slurm
partition: gpu
time: "2:00:00"
"""


def _file(tmp_path, text, name="job.yml"):
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def _error(path, text=None):
    if text is not None:
        path.write_text(text)
    with pytest.raises(TorchrigError) as e:
        job_spec.load(path)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_a_full_file_gives_every_option(tmp_path):
    p = _file(tmp_path, FULL)
    opts = job_spec.merge(job_spec.load(p), {}, str(p))
    assert opts == {
        "job": "gpt2-a", "script": DEFAULTS.script, "module": "gpt2.train",
        "args": "--preset gpt2 --run-name 'my run'",
        "env": ["NCCL_DEBUG=WARN", "SEED=7", "DATA_URL=https://u:p@x/"], "nproc": "4",
        "max_restarts": 0, "start_timeout": 60, "rdzv_timeout": 90, "exit_barrier_timeout": 30,
        "early_fail_window": 0,
        "workdir": str(tmp_path / "proj"), "requirements": "requirements.txt",
        "allow_torch_change": True, "secret_env": ["DATA_URL"],
        "nodes": 2, "backend": "slurm", "partition": "gpu", "time": "2:00:00",
        "data": "shards", "data_verify": "full"}
    assert set(opts) == set(job_spec.OPTION_KEYS) | set(job_spec.SERVICE_KEYS)
    # launch splits the joined list back to the very same arguments
    assert split_args(opts["args"]) == ["--preset", "gpt2", "--run-name", "my run"]


def test_no_file_and_no_flags_is_launchs_defaults():
    opts = job_spec.merge(None, {})
    assert re.fullmatch(r"job-\d{8}-\d{6}", opts.pop("job"))
    assert opts == {"script": DEFAULTS.script, "module": None, "args": "", "env": [],
                    "nproc": DEFAULTS.nproc, "max_restarts": DEFAULTS.max_restarts,
                    "start_timeout": DEFAULTS.start_timeout, "rdzv_timeout": DEFAULTS.rdzv_timeout,
                    "exit_barrier_timeout": DEFAULTS.exit_barrier_timeout, "workdir": None,
                    "early_fail_window": DEFAULTS.early_fail_window,
                    "requirements": None, "allow_torch_change": False, "secret_env": [],
                    "nodes": None, "backend": None, "partition": None, "time": None,
                    "data": None, "data_verify": "quick"}


def test_a_flag_given_wins_over_the_file_and_one_not_given_does_not(tmp_path):
    spec = job_spec.load(_file(tmp_path, FULL))
    given = {"job": "gpt2-b", "args": "--preset tiny", "nproc_per_node": "gpu", "nodes": 1,
             "max_restarts": 5, "backend": "systemd", "time": None, "partition": None,
             "start_timeout": None, "allow_torch_change": False, "env": []}
    opts = job_spec.merge(spec, given)
    assert (opts["job"], opts["args"], opts["nproc"], opts["nodes"], opts["max_restarts"],
            opts["backend"]) == ("gpt2-b", "--preset tiny", "gpu", 1, 5, "systemd")
    # not given (None, an empty list, a switch off): the file's
    assert (opts["time"], opts["partition"], opts["start_timeout"], opts["allow_torch_change"]) \
        == ("2:00:00", "gpu", 60, True)


def test_script_or_module_on_the_command_line_replaces_the_files_choice(tmp_path):
    spec = job_spec.load(_file(tmp_path, FULL))  # module: gpt2.train
    opts = job_spec.merge(spec, {"script": "other.py"})
    assert (opts["script"], opts["module"]) == ("other.py", None)
    spec = job_spec.load(_file(tmp_path, "script: a.py\n"))
    opts = job_spec.merge(spec, {"module": "pkg.main"})
    assert opts["module"] == "pkg.main"
    with pytest.raises(TorchrigError, match=r"^--script and --module: choose one$"):
        job_spec.merge(spec, {"script": "a.py", "module": "m"})


def test_env_flags_win_per_key_and_the_files_other_keys_stay(tmp_path):
    spec = job_spec.load(_file(tmp_path, "env: {A: '1', B: two, C: 3.5, D: true}\n"))
    opts = job_spec.merge(spec, {"env": ["B=flag", "E=new", "B=last"]})
    assert opts["env"] == ["A=1", "B=last", "C=3.5", "D=True", "E=new"]
    assert parse_env(opts["env"]) == {"A": "1", "B": "last", "C": "3.5", "D": "True", "E": "new"}
    # a malformed flag entry is left for launch's own check to refuse, naming --env
    opts = job_spec.merge(spec, {"env": ["oops"]})
    with pytest.raises(TorchrigError, match=r"--env 'oops': expected KEY=VALUE"):
        parse_env(opts["env"])


def test_secret_env_must_name_a_key_of_env_the_files_or_a_flags(tmp_path):
    p = _file(tmp_path, "env: {TOKEN_X: a}\nsecret_env: DATA_URL\n")  # one name: a list of it
    spec = job_spec.load(p)
    assert spec.secret_env == ["DATA_URL"]
    with pytest.raises(TorchrigError) as e:
        job_spec.merge(spec, {}, str(p))
    assert str(e.value).startswith(f"{p}: key 'secret_env': 'DATA_URL' is not a key of env")
    opts = job_spec.merge(spec, {"env": ["DATA_URL=https://u:p@h/"]}, str(p))
    assert opts["secret_env"] == ["DATA_URL"] and "DATA_URL=https://u:p@h/" in opts["env"]


def test_relative_workdir_is_relative_to_the_files_folder(tmp_path, monkeypatch):
    p = _file(tmp_path, "workdir: ../proj\n", "jobs/j.yml")
    monkeypatch.chdir("/")  # not where the file is
    assert job_spec.load(p).workdir == str(tmp_path / "proj")
    _file(tmp_path, "workdir: /srv/proj\n", "jobs/j.yml")
    assert job_spec.load(p).workdir == "/srv/proj"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _file(tmp_path, "workdir: ~/proj\n", "jobs/j.yml")
    assert job_spec.load(p).workdir == str(tmp_path / "home" / "proj")
    # a relative --spec path: the file's folder still (resolved from the current folder)
    monkeypatch.chdir(tmp_path)
    _file(tmp_path, "workdir: proj\n", "jobs/j.yml")
    assert job_spec.load("jobs/j.yml").workdir == str(tmp_path / "jobs" / "proj")


def test_an_unknown_key_names_the_closest_known_one(tmp_path):
    p = tmp_path / "j.yml"
    assert _error(p, "nproc_per_nodes: 2\n") == (
        f"{p}: key 'nproc_per_nodes' is not a job file key; did you mean 'nproc_per_node'?")
    assert _error(p, "scrpt: a.py\n").endswith("did you mean 'script'?")
    assert _error(p, "zzzz: 1\n").endswith("not a job file key; jobs/example.yml lists every key")


@pytest.mark.parametrize("text,expected", [
    ("nodes: two\n", "key 'nodes': expected N or MIN:MAX, whole numbers with 1 <= MIN <= MAX (e.g. 2 or 2:3)"),
    ("nodes: 0\n", "key 'nodes': expected N or MIN:MAX, whole numbers with 1 <= MIN <= MAX (e.g. 2 or 2:3)"),
    ("nodes: true\n", "key 'nodes': expected N or MIN:MAX, whole numbers with 1 <= MIN <= MAX (e.g. 2 or 2:3)"),
    ("max_restarts: -1\n", "key 'max_restarts': expected >= 0, got -1"),
    ("rdzv_timeout: '300'\n", "key 'rdzv_timeout': expected an integer, got '300'"),
    ("allow_torch_change: 'yes'\n", "key 'allow_torch_change': expected true or false, got 'yes'"),
    ("backend: pbs\n", "key 'backend': expected 'systemd' or 'slurm', got 'pbs'"),
    ("nproc_per_node: 0\n", "key 'nproc_per_node': expected a whole number >= 1, or 'gpu'"),
    ("nproc_per_node: gpus\n", "key 'nproc_per_node': expected a whole number >= 1, or 'gpu'"),
    ("env: [A=1]\n", "key 'env': expected a mapping, got ['A=1']"),
    ("env: {1A: x}\n", "key 'env': '1A' is not a valid environment variable name"),
    ("env: {A: [1]}\n", "key 'env': 'A': expected a string or number, got [1]"),
    ("secret_env: [A, 3]\n", "key 'secret_env', entry 2: expected a string, got 3"),
    ("args: [--a, 1]\n", "key 'args': expected a string (quoted as in a shell) or a list of "
                         "strings, got ['--a', 1]"),
    ("args: \"--name 'a b\"\n", "key 'args': No closing quotation in \"--name 'a b\": quote it"),
    ("time: 2:00:00\n", "key 'time': expected a string: quote it (time: '2:00:00')"),
    ("job: Bad_Name\n", "key 'job': use 1-48 lowercase letters, digits, '-' or '_'"),
    ("job: 12\n", "key 'job': expected a string, got 12"),
    ("script: /etc/x.py\n", "key 'script': expected a file in workdir (or in payload/): a relative"),
    ("script: ../x.py\n", "key 'script': expected a file in workdir (or in payload/): a relative"),
    ("requirements: ../r.txt\n", "key 'requirements': expected a file in workdir: a relative"),
    ("module: gpt2/train.py\n", "key 'module': expected a Python module name"),
    ("workdir: \"a\\nb\"\n", "key 'workdir': expected a folder without control characters"),
    ("script: a.py\nmodule: a\n", "script and module are both given: choose one"),
])
def test_a_bad_value_is_one_line_naming_the_file_and_the_key(tmp_path, text, expected):
    p = tmp_path / "j.yml"
    assert _error(p, text).startswith(f"{p}: {expected}")


@pytest.mark.parametrize("text,expected", [
    ("job: a\n  nodes: 2\n", r"line 2, column 8: not valid YAML: mapping values are not allowed"),
    ("job: a\njob: b\n", r"line 2, column 1: not valid YAML: duplicate key 'job'"),
    ("- job: a\n", r"expected a mapping of job keys \(job: \.\.\., script: \.\.\.; see "
                   r"jobs/example.yml\), got a list"),
    ("", r"expected a mapping of job keys .*, got an empty file"),
    ("just text\n", r"expected a mapping of job keys .*, got a str"),
])
def test_a_file_that_is_not_a_job_file_is_one_line(tmp_path, text, expected):
    p = tmp_path / "j.yml"
    assert re.match(re.escape(f"{p}:") + " ?" + expected, _error(p, text))


def test_a_missing_or_unreadable_file_is_one_line(tmp_path):
    assert _error(tmp_path / "nope.yml") == (
        f"{tmp_path / 'nope.yml'}: cannot read the job file (No such file or directory); "
        "check --spec PATH")
    assert "(Is a directory)" in _error(tmp_path)
    p = tmp_path / "bin.yml"
    p.write_bytes(b"job: a\nargs: \xff\n")
    assert _error(p) == f"{p}: line 2: not UTF-8 text (byte 0xff); save the job file as UTF-8"


def test_the_example_validates_and_documents_every_key():
    spec = job_spec.load(EXAMPLE)
    assert spec.job and spec.script and spec.env and spec.secret_env
    text = EXAMPLE.read_text()
    # each key written as a key, or (script/module, Slurm's) as a commented-out one
    missing = [k for k in job_spec.KEYS if not re.search(rf"^(# )?{k}:", text, re.M)]
    assert missing == [], f"document these keys in {EXAMPLE}: {missing}"
    # and the merged example is launch's options (its secret's value given at launch)
    opts = job_spec.merge(spec, {"env": ["DATA_URL=x"]}, str(EXAMPLE))
    assert opts["secret_env"] == ["DATA_URL"] and opts["nproc"] == "gpu"


def test_the_commented_alternatives_in_the_example_validate_too(tmp_path):
    """Uncommenting module (in place of script) and the Slurm keys gives a valid file."""
    text = EXAMPLE.read_text()
    text = re.sub(r"^script:", "# script:", text, flags=re.M)
    text = re.sub(r"^# (module|partition|time):", r"\1:", text, flags=re.M)
    spec = job_spec.load(_file(tmp_path, text))
    assert (spec.module, spec.script, spec.partition, spec.time) == (
        "gpt2.train", None, "gpu", "2:00:00")


# The task itself

def _cli(*args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "INVOKE_"))}
    return subprocess.run([str(TORCHRIG), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**env, "COLUMNS": "200"})


@pytest.mark.parametrize("text,expected", [
    ("nodes: 2\nnproc_per_nodes: 2\n", "key 'nproc_per_nodes' is not a job file key; "
                                       "did you mean 'nproc_per_node'?"),
    ("script: a.py\nmodule: a\n", "script and module are both given: choose one"),
    ("nodes: [\n", "line 2, column 1: not valid YAML"),
])
def test_the_task_says_a_bad_job_file_in_one_error_line(tmp_path, text, expected):
    p = _file(tmp_path, text)
    inv = _file(tmp_path, "hosts:\n  - {name: gpu1, address: 127.0.0.1, port: 1}\n", "inv.yml")
    r = _cli("launch", "-i", str(inv), "--spec", str(p), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {p}: {expected}"), r.stderr


def test_the_task_refuses_a_missing_job_file_before_any_host(tmp_path):
    inv = _file(tmp_path, "hosts:\n  - {name: gpu1, address: 127.0.0.1, port: 1}\n", "inv.yml")
    r = _cli("launch", "-i", str(inv), "--spec", "nope.yml", cwd=tmp_path)
    assert (r.returncode, r.stderr.strip()) == (
        1, "error: nope.yml: cannot read the job file (No such file or directory); "
           "check --spec PATH")


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Runs `torchrig launch ...` in-process through Invoke's Program with service.launch
    replaced: what it was given, then a stop before any host is touched."""
    from torchrig.cli.program import program
    from torchrig.launch import service
    seen = {}

    def fake(fleet, o, nodes=None, backend=None, partition=None, time_limit=None, log=print,
             skip_unhealthy=False):
        seen.update(o=o, nodes=nodes, backend=backend, partition=partition, time=time_limit,
                    hosts=[h.name for h in fleet.hosts], skip_unhealthy=skip_unhealthy)
        raise TorchrigError("stopped before any host")
    monkeypatch.setattr(service, "launch", fake)
    inv = _file(tmp_path, "hosts:\n  - {name: gpu1, connection: local}\n"
                          "  - {name: gpu2, connection: local}\n", "inv.yml")

    def run(*args):
        with pytest.raises(SystemExit) as e:
            program.run(["torchrig", "launch", "-i", str(inv), *args])
        return e.value.code, seen
    return run


def test_the_tasks_options_reach_service_launch_merged(launched, tmp_path, capsys):
    p = _file(tmp_path, FULL.replace("module: gpt2.train\n", "script: train.py\n"), "jobs/j.yml")
    code, seen = launched("--spec", str(p), "--nodes", "1", "--env", "SEED=8", "--env",
                          "EXTRA=1", "--max-restarts", "4", "-j", "gpt2-b", "--dry-run",
                          "--skip-unhealthy")
    assert code == 1 and capsys.readouterr().err.strip() == "error: stopped before any host"
    o = seen["o"]
    assert (o.job, o.script, o.module, o.nproc, o.max_restarts, o.start_timeout, o.rdzv_timeout,
            o.exit_barrier_timeout, o.dry_run) == ("gpt2-b", "train.py", None, "4", 4, 60, 90, 30,
                                                   True)
    assert o.early_fail_window == 0  # the file's
    assert shlex.split(o.args) == ["--preset", "gpt2", "--run-name", "my run"]
    assert o.env == ["NCCL_DEBUG=WARN", "SEED=8", "DATA_URL=https://u:p@x/", "EXTRA=1"]
    assert (o.workdir, o.requirements, o.allow_torch_change, o.secret_env) == (
        str(tmp_path / "jobs" / "proj"), "requirements.txt", True, ["DATA_URL"])
    assert (seen["nodes"], seen["backend"], seen["partition"], seen["time"]) == (
        "1", "slurm", "gpu", "2:00:00")  # N or MIN:MAX, parsed by service.launch
    assert seen["skip_unhealthy"] is True


def test_without_a_spec_the_task_is_launchs_defaults(launched):
    code, seen = launched("--job", "exp1")
    o = seen["o"]
    assert code == 1
    assert (o.job, o.script, o.module, o.args, o.env, o.nproc, o.max_restarts, o.workdir,
            o.dry_run) == ("exp1", DEFAULTS.script, None, "", [], DEFAULTS.nproc,
                           DEFAULTS.max_restarts, None, False)
    assert (seen["nodes"], seen["backend"], seen["partition"], seen["time"]) == (
        None, None, None, None)


def test_a_bad_number_flag_is_still_named_with_a_spec(launched, tmp_path, capsys):
    p = _file(tmp_path, "nodes: 2\n")
    code, seen = launched("--spec", str(p), "--nodes", "two")
    assert code == 1 and not seen
    assert capsys.readouterr().err.strip() == ("error: --nodes 'two': expected N or MIN:MAX, "
                                                 "whole numbers with 1 <= MIN <= MAX (e.g. 2 or 2:3)")


def test_the_job_file_in_the_docs_validates(tmp_path):
    text = (REPO / "docs" / "jobs.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S)[1]
    p = _file(tmp_path, block, "jobs/gpt2.yml")
    spec = job_spec.load(p)
    assert spec.workdir == str(tmp_path)  # `..` from jobs/: the folder above it
    assert split_args(job_spec.merge(spec, {})["args"]) == ["--preset", "gpt2", "--batch-size", "16"]
