"""What a new user meets, on real testbed hosts: an unreachable host reads the same in every
task (which host, what failed, what to try), `stop` of a job that is not there fails, Ctrl-C
in a follower (`logs -f`, `status --watch`, `launch --follow`) exits 130 saying the job keeps
running, `logs --color false` prints no colour, and `logs` says nothing about the job's own
sampler files. The job runs on the two V100S pairs the launch tests train on."""

import copy
import re
import signal
import subprocess
import sys

import pytest

from conftest import ENV, _sigint_default, NODES, REPO, invoke, ip_of, launch, stop, unit_state, wait_step, \
    wait_until, write_inventory


JOB = "t-msg"
UNREACHABLE = (r"gpu-dead: unreachable: SSH to \w+@{ip}:2 failed: connection refused \(nothing "
               r"listens on that port: sshd stopped, or a wrong port\); check that the host is up "
               r"and sshd runs there, and its address and port in the inventory \(try: ssh -p 2 "
               r"\w+@{ip}\)")


@pytest.fixture(scope="module")
def job(fleet):
    """A job that trains until stopped, on NODES (provisioned here: a module fixture is made
    before a test's `provisioned` mark is honoured); stopped when the module is done."""
    inv = fleet.provisioned(*NODES.split(","))
    r = launch(inv, JOB, "--args", "--max-steps 100000 --log-every 5")
    assert r.returncode == 0, r.stdout + r.stderr
    wait_step(inv, JOB, 5)
    yield inv
    stop(inv, JOB)


def test_an_unreachable_host_reads_the_same_in_every_task(testbed, inventory_doc, tmp_path):
    """A real testbed host's address on a port where nothing listens: verify said "unexpected
    ValueError: max() arg is an empty sequence", status "unexpected NoValidConnectionsError",
    exec and logs each their own words. One line now, from every task."""
    doc = copy.deepcopy(inventory_doc)
    ip = ip_of(testbed, "gpu1")
    doc["hosts"].append({"name": "gpu-dead", "address": ip, "port": 2})
    inv = write_inventory(tmp_path, doc)
    line = UNREACHABLE.format(ip=re.escape(ip))
    for args in (["verify"], ["status", "--job", JOB], ["status"], ["exec", "true"],
                 ["logs", "--job", JOB], ["stop", "--job", JOB], ["metrics"],
                 ["fetch", "--job", JOB], ["report", "--job", JOB]):
        r = invoke(args[0], "--inventory", str(inv), "--host", "gpu-dead", *args[1:], timeout=120)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert len(errors) == 1 and re.search(line, errors[0]), (args, r.stderr)
        assert "unexpected" not in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_verify_names_the_dead_host_beside_the_live_one(testbed, inventory_doc, tmp_path):
    doc = copy.deepcopy(inventory_doc)
    ip = ip_of(testbed, "gpu1")
    doc["hosts"].append({"name": "gpu-dead", "address": ip, "port": 2})
    inv = write_inventory(tmp_path, doc)
    r = invoke("verify", "--inventory", str(inv), "--host", "gpu1,gpu-dead", "--json",
               timeout=300)
    assert r.returncode == 1 and "unexpected" not in r.stderr, r.stderr
    assert re.search(UNREACHABLE.format(ip=re.escape(ip)), r.stderr), r.stderr
    assert '"host": "gpu1"' in r.stdout  # the live host was checked all the same


def test_stop_of_a_job_that_is_not_there_fails(testbed):
    """`stop --job nosuchjob` printed "stopped on 2 node(s)" and exited 0."""
    r = stop(testbed, "nosuchjob")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "stopped on" not in r.stdout
    assert r.stderr.strip() == (f"error: no job 'nosuchjob' on {NODES.replace(',', ', ')}; "
                                "nothing was stopped (`torchrig status` shows the newest job; "
                                "check --job and --host)"), r.stderr


def _interrupted(*args, ready=lambda line: True) -> subprocess.CompletedProcess:
    """The CLI as a user runs it in a terminal: SIGINT (Ctrl-C) once it has printed a line
    that is `ready`.
    SIGINT is set to its default in the child: a test run started in the background (`&`)
    would otherwise hand it down ignored."""
    p = subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=REPO, text=True,
                         env={**__import__("os").environ, **ENV}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         preexec_fn=_sigint_default)
    try:
        first = ""
        while not first or not ready(first.splitlines()[-1]):
            line = p.stdout.readline()
            assert line, first + p.stderr.read()
            first += line
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(args, p.returncode, first + out, err)


@pytest.mark.parametrize("args", [["logs", "--follow"], ["status", "--watch", "2"]])
def test_ctrl_c_in_a_follower_exits_130_and_the_job_keeps_running(job, args):
    """Ctrl-C exited 1 with no message."""
    r = _interrupted(args[0], "--inventory", str(job), "--host", NODES, "--job", JOB, *args[1:])
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"interrupted: job {JOB} keeps running on {NODES}; stop it with: torchrig stop "
        f"--inventory {job} --host {NODES} --job {JOB}"), r.stderr
    assert "Traceback" not in r.stderr
    for h in NODES.split(","):
        assert unit_state(job, h, f"torchrig-{JOB}.service") == "active"


def test_ctrl_c_in_launch_follow_exits_130_and_the_job_keeps_running(job):
    """The hosts and inventory of `job` (provisioned); a job of its own, followed from launch
    (with no early-failure window, as conftest's launch(): the follow starts at once)."""
    inv, j = job, "t-msg-follow"
    try:
        r = _interrupted("launch", "--inventory", str(inv), "--host", NODES, "--job", j,
                         "--follow", "--early-fail-window", "0",
                         "--args", "--max-steps 100000 --log-every 5",
                         ready=lambda line: line.startswith("[gpu"))  # following the ranks
        assert r.returncode == 130, r.stdout + r.stderr
        assert r.stderr.strip().splitlines()[-1] == (
            f"interrupted: job {j} keeps running on {NODES}; stop it with: torchrig stop "
            f"--inventory {inv} --host {NODES} --job {j}"), r.stderr
        assert unit_state(inv, NODES.split(",")[0], f"torchrig-{j}.service") == "active"
    finally:
        stop(inv, j)


def test_logs_colour_follows_the_flag_and_no_sampler_file_is_warned_about(job):
    """`--color false` printed colour (any text was true); the job's own gpu_util.csv and
    gpu_mem.csv were called "not a regular file" on every call."""
    def run(*flags, env=None):
        r = invoke("logs", "--inventory", str(job), "--host", NODES, "--job", JOB, "--rank", "0",
                   *flags, env=env)
        assert r.returncode == 0 and "step=" in r.stdout, r.stdout + r.stderr
        return r
    wait_until("the job's GPU sampler files", lambda: "gpu_util.csv" in invoke(
        "exec", "--inventory", str(job), "--host", NODES.split(",")[0], "--sudo",
        f"ls /var/log/torchrig/{JOB}").stdout, 120)
    for value in ("false", "never", "no", "0"):
        assert "\x1b[" not in run("--color", value).stdout
    assert "\x1b[" in run("--color", "always").stdout
    r = run()
    assert "gpu_util.csv" not in r.stderr and "gpu_mem.csv" not in r.stderr, r.stderr
    assert "not a regular file" not in r.stderr, r.stderr
