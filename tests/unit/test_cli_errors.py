"""Every bad input is one `error:` line naming what is wrong, exit status 1, no traceback.

Each row runs the real CLI (`python -m invoke ...`, as a user would) on an input that printed a
traceback, or was silently accepted, before. None needs a testbed: hosts that must be reached
are a closed port or a local listener that is not an SSH server.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _fixtures import tcp_server

REPO = Path(__file__).resolve().parents[2]
HOST = "hosts:\n  - {name: gpu1, address: 127.0.0.1, port: 1}\n"  # port 1: connection refused
TWO = HOST + "  - {name: gpu2, address: 127.0.0.1, port: 1}\n"
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg")) + HOST


def cli(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


@pytest.fixture(scope="module")
def not_ssh():
    """A port that answers, but not as an SSH server."""
    def answer(c):
        c.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
        c.close()
    srv = tcp_server(answer)
    yield srv.getsockname()[1]
    srv.close()


# (id, task args with {inv}/{kh} placeholders, inventory text (bytes allowed), expected error)
SLURM_INV = HOST + "slurm:\n  controller: gpu1\n  compute: [gpu1]\n"
ROWS = [
    ("backend-unknown", ["launch", "-i", "{inv}", "--backend", "pbs"], HOST,
     r"--backend 'pbs': systemd or slurm"),
    ("partition-without-slurm", ["launch", "-i", "{inv}", "--partition", "gpu"], HOST,
     r"--partition and --time are Slurm's: add --backend slurm"),
    ("slurm-without-cluster", ["launch", "-i", "{inv}", "--backend", "slurm"], HOST,
     r"{inv}: no `slurm:` section, so no Slurm cluster to launch on"),
    ("backend-var-slurm", ["launch", "-i", "{inv}"], "vars: {backend: slurm}\n" + HOST,
     r"{inv}: no `slurm:` section"),
    ("backend-var-bad", ["launch", "-i", "{inv}"], "vars: {backend: pbs}\n" + HOST,
     r"{inv}: host 'gpu1': var 'backend': expected 'systemd' or 'slurm'"),
    ("slurm-time-word", ["launch", "-i", "{inv}", "--backend", "slurm", "--time", "1h"], SLURM_INV,
     r"--time '1h': a Slurm time limit"),
    ("slurm-partition-option", ["launch", "-i", "{inv}", "--backend", "slurm", "--partition",
                                "--wrap=id"], SLURM_INV, r"--partition '--wrap=id': a Slurm partition name"),
    ("jobs-prune-flag-alone", ["jobs", "-i", "{inv}", "--with-logs"], HOST,
     r"--older-than, --with-logs and --with-checkpoints go with --prune"),
    ("jobs-older-than-word", ["jobs", "-i", "{inv}", "--prune", "--older-than", "week"], HOST,
     r"--older-than 'week': expected a number >= 0"),
    ("jobs-prune-unreachable", ["jobs", "-i", "{inv}", "--prune"], HOST,
     r"nothing pruned: not every node could be read \(gpu1: unreachable"),
    ("rank-not-a-number", ["logs", "-i", "{inv}", "--job", "j", "--rank", "abc"], HOST,
     r"--rank 'abc': expected a whole number >= 0"),
    ("timeout-with-unit", ["exec", "-i", "{inv}", "--timeout", "5s", "true"], HOST,
     r"--timeout '5s': expected a whole number >= 1"),
    ("plan-not-a-plan", ["provision", "-i", "{inv}", "--plan", "{inv}"], HOST,
     r"--plan {inv}: not a torchrig provision plan \(not JSON: .*\); make one with: "
     r"torchrig provision --dry-run --save-plan FILE"),
    ("save-plan-applies-nothing", ["provision", "-i", "{inv}", "--save-plan", "p.json"], HOST,
     r"--save-plan saves a plan without applying it: add --dry-run"),
    ("nodes-word", ["launch", "-i", "{inv}", "--nodes", "two"], TWO,
     r"--nodes 'two': expected N or MIN:MAX, whole numbers with 1 <= MIN <= MAX \(e\.g\. 2 or 2:3\)$"),
    ("nodes-negative", ["launch", "-i", "{inv}", "--nodes=-1", "--dry-run"], TWO,
     r"--nodes '-1': expected N or MIN:MAX"),
    ("nodes-min-above-max", ["launch", "-i", "{inv}", "--nodes", "3:2"], TWO,
     r"--nodes '3:2': expected N or MIN:MAX"),
    # an elastic job of the payload whose global batch cannot be the same at 2 and 4 ranks:
    # refused before any (here unreachable) host is touched
    ("global-batch-elastic", ["launch", "-i", "{inv}", "--nodes", "1:2", "--nproc-per-node",
                              "2", "--args", "--global-batch 16"], TWO,
     r"nothing started: at a world size of 4 ranks \(of 2, 4\): --global-batch 16 is not a "
     r"multiple of --batch-size 8 x world size 4"),
    ("int-default-flag", ["launch", "-i", "{inv}", "--max-restarts", "x"], HOST,
     r"--max-restarts 'x': expected a whole number >= 0"),
    ("since-overflow", ["logs", "-i", "{inv}", "--job", "j", "--since", "1e999"], HOST,
     r"--since '1e999': expected a number >= 0"),
    ("fetch-step-word", ["fetch", "-i", "{inv}", "--job", "j", "--step", "last"], HOST,
     r"--step 'last': expected a whole number >= 0"),
    ("fetch-step-and-all", ["fetch", "-i", "{inv}", "--job", "j", "--step", "1", "--all"], HOST,
     r"--step and --all: choose one"),
    ("fetch-job-path", ["fetch", "-i", "{inv}", "--job", "../etc"], HOST,
     r"--job '../etc': use 1-48 lowercase letters"),
    ("fetch-unreachable", ["fetch", "-i", "{inv}", "--job", "j"], HOST,
     r"no checkpoint of job j on gpu1 \(could not look on: gpu1: unreachable: SSH to "),
    ("tensorboard-port", ["tensorboard", "-i", "{inv}", "--job", "j", "--port", "http"], HOST,
     r"--port 'http': expected a whole number >= 0"),
    ("tensorboard-port-range", ["tensorboard", "-i", "{inv}", "--job", "j", "--port", "70000"],
     HOST, r"--port 70000: expected a port number up to 65535"),
    ("not-utf8", ["hosts", "-i", "{inv}"], b"hosts:\n  - {name: gpu\xff1}\n",
     r"{inv}: line 2: not UTF-8 text \(byte 0xff\); save the inventory as UTF-8"),
    ("list-as-key", ["hosts", "-i", "{inv}"], HOST + "? [a, b]\n: 1\n",
     r"{inv}: line 3, column 3: not valid YAML: a mapping key must be a plain value, not a list"),
    ("env-as-list", ["hosts", "-i", "{inv}"], "vars:\n  env: [A, B]\n" + HOST,
     r"{inv}: host 'gpu1': var 'env': expected a mapping, got \['A', 'B'\]"),
    ("env-bad-name", ["hosts", "-i", "{inv}"], "vars:\n  env: {\"FOO\\n\": 1}\n" + HOST,
     r"{inv}: host 'gpu1': var 'env': 'FOO\\n' is not a valid environment variable name"),
    ("prefix-newline", ["hosts", "-i", "{inv}"],
     "vars:\n  prefix: \"/opt/x\\nLD_PRELOAD=/tmp/evil.so\"\n" + HOST,
     r"{inv}: host 'gpu1': var 'prefix': expected an absolute path without control characters"),
    ("log-dir-relative", ["hosts", "-i", "{inv}"], "vars:\n  log_dir: logs\n" + HOST,
     r"{inv}: host 'gpu1': var 'log_dir': expected an absolute path without control characters "
     r"\(newline, tab, ...\), got 'logs'"),
    ("misspelt-var", ["hosts", "-i", "{inv}"],
     "hosts:\n  - name: gpu1\n    vars: {driver_verison: 550}\n",
     r"{inv}: host 'gpu1': var 'driver_verison' is not a var torchrig reads; "
     r"did you mean 'driver_version'\?"),
    ("jump-self-by-default", ["exec", "-i", "{inv}", "true"],
     "defaults: {jump: bastion}\nhosts:\n  - {name: gpu1}\n  - {name: bastion}\n",
     r"{inv}: host 'bastion': jump 'bastion' \(from defaults.jump\) is the host itself; "
     r"set `jump: none` on it"),
    ("jump-cycle", ["exec", "-i", "{inv}", "true"],
     "hosts:\n  - {name: a, jump: b}\n  - {name: b, jump: c}\n  - {name: c, jump: a}\n",
     r"{inv}: host 'a': jump hosts form a cycle: a -> b -> c -> a"),
    ("billion-laughs", ["hosts", "-i", "{inv}"], LAUGHS,
     r"{inv}: its aliases expand to more than 100000 values; refused"),
    ("known-hosts-markers", ["exec", "-i", "{inv}", "true"],
     "known_hosts: {kh}\n" + HOST, r"failed on 1 of 1 host\(s\): gpu1: unreachable: SSH to "),
    ("not-an-ssh-server", ["exec", "-i", "{inv}", "true"],
     "hosts:\n  - {name: gpu1, address: 127.0.0.1, port: {port}}\n",
     r"failed on 1 of 1 host\(s\): gpu1: unreachable: SSH to \S+ failed: no SSH server answered "
     r"on that port \(Error reading SSH protocol banner"),
]


@pytest.mark.parametrize("args,text,expected", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_one_error_line(tmp_path, not_ssh, args, text, expected):
    inv, kh = tmp_path / "inv.yml", tmp_path / "known_hosts"
    key = tmp_path / "ca"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    pub = (tmp_path / "ca.pub").read_text().split()[:2]
    kh.write_text(f"@cert-authority *.example.com {' '.join(pub)}\n@revoked * {' '.join(pub)}\n")
    sub = {"{inv}": str(inv), "{kh}": str(kh), "{port}": str(not_ssh)}
    if isinstance(text, str):
        for k, v in sub.items():
            text = text.replace(k, v)
        text = text.encode()
    inv.write_bytes(text)
    r = cli(*(sub.get(a, a) for a in args))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "paramiko" not in out, out
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert re.match("error: " + expected.replace("{inv}", re.escape(str(inv))), errors[0]), errors[0]


def test_known_hosts_markers_are_warned_once(tmp_path):
    """The @cert-authority line is skipped with one warning per run, not one per host."""
    kh = tmp_path / "known_hosts"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")],
                   check=True)
    kh.write_text("@cert-authority * " + " ".join((tmp_path / "k.pub").read_text().split()[:2]))
    inv = tmp_path / "inv.yml"
    inv.write_text(f"known_hosts: {kh}\n" + TWO)
    r = cli("exec", "-i", str(inv), "true")
    assert r.stderr.count("@cert-authority skipped") == 1, r.stderr
    assert "InvalidHostKey" not in r.stdout + r.stderr


def test_bad_config_setting_is_one_error_line(tmp_path):
    """Invoke casts INVOKE_TORCHRIG_* to the default's type itself: int('x') was a traceback."""
    inv = tmp_path / "inv.yml"
    inv.write_text(HOST)
    r = cli("exec", "-i", str(inv), "true", env={"INVOKE_TORCHRIG_PARALLEL": "x"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "error: torchrig.parallel 'x': expected a whole number >= 1"


# every task that reaches hosts, with the arguments it needs to get that far
REACHING = [["exec", "true"], ["provision"], ["verify"], ["launch"], ["logs", "--job", "j"],
            ["logs", "--follow"], ["status"], ["status", "--job", "j"], ["stop", "--job", "j"],
            ["metrics"], ["fetch", "--job", "j"], ["report", "--job", "j"],
            ["tensorboard", "--job", "j"]]
UNREACHABLE = ("gpu1: unreachable: SSH to root@127.0.0.1:1 failed: connection refused (nothing "
               "listens on that port: sshd stopped, or a wrong port); check that the host is up "
               "and sshd runs there, and its address and port in the inventory (try: ssh -p 1 "
               "root@127.0.0.1)")


@pytest.mark.parametrize("args", REACHING, ids=[" ".join(a) for a in REACHING])
def test_an_unreachable_host_reads_the_same_in_every_task(tmp_path, args):
    """One dead port was 'unexpected ValueError: max() arg is an empty sequence' (verify),
    'unexpected NoValidConnectionsError' (status), 'cannot connect: ...' (exec) and
    'NoValidConnectionsError: ...' (logs). Now one line: which host, what failed, what to try."""
    inv = tmp_path / "inv.yml"
    inv.write_text("defaults: {user: root}\n" + HOST)
    r = cli(args[0], "-i", str(inv), *args[1:])
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and UNREACHABLE in errors[0], r.stderr
    assert "unexpected" not in r.stderr and "Error:" not in errors[0], r.stderr
