"""Issue 11: why a rank died when it wrote no error.json (a signal, an OOM kill, an exit code),
and what each node waits for when one node's worker dies while the others finish. Real
torchrun under systemd on gpu1/gpu4 (provisioned once per session by conftest's fleet); the test makes the worker
die from outside (kill, a memory cgroup) so that nothing of it is in the product."""

import re
import secrets
import time
from pathlib import Path

import pytest

from conftest import ENV, NODES, REPO, invoke, launch, logs, sh, status, wait_step

pytestmark = pytest.mark.provisioned("gpu1", "gpu4")

WORKER = "^/opt/torchrig/venv/bin/python[0-9.]* -u train.py"


def wait_ended(inv, job, timeout=240, hosts=("gpu1", "gpu4")):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [sh(inv, h, f"systemctl show -p ActiveState --value torchrig-{job}") for h in hosts]
        if all(s in ("inactive", "failed") for s in states):
            return time.monotonic()
        time.sleep(2)
    raise AssertionError(f"job {job} still running after {timeout}s")


def unique(job):
    """A job name of its own per run: a rerun on the same testbed must not find the steps an
    earlier run of the job logged."""
    return f"{job}-{secrets.token_hex(2)}"


def worker(inv, host="gpu4"):
    """(pid, local rank) of one train.py worker on `host`."""
    deadline = time.monotonic() + 60
    while not (pid := sh(inv, host, f"pgrep -f '{WORKER}' | tail -1")).isdigit():
        assert time.monotonic() < deadline, f"no worker on {host}"
        time.sleep(1)
    env = sh(inv, host, f"tr '\\0' '\\n' < /proc/{pid}/environ | grep '^LOCAL_RANK='")
    return int(pid), int(env.split("=")[1])


def failures(inv, job):
    r = logs(inv, job, "--failures")
    assert r.returncode == 0, r.stderr
    return r.stdout


def _killed_worker_is_named(testbed, job, sig, cause):
    job = unique(job)
    r = launch(testbed, job, "--max-restarts", "0",
               "--args", "--max-steps 100000 --log-every 5 --init-timeout 60")
    assert r.returncode == 0, r.stderr
    wait_step(testbed, job, 5)
    pid, local = worker(testbed)
    sh(testbed, "gpu4", f"kill -{sig} {pid}")
    wait_ended(testbed, job)
    text = failures(testbed, job)
    # gpu1's ranks fail too (their peer is gone) and write error.json; the first failure is gpu4's
    m = re.match(rf"first failure: \[gpu4/r(\d)\] \(local rank {local}, pid {pid}\) {re.escape(cause)} at ",
                 text)
    assert m, text
    assert "then: [gpu1/r" in text, text
    assert f"\nlast lines of [gpu4/r{m.group(1)}]:\n  " in text, text
    r, st = status(testbed, job)
    assert r.returncode == 1
    assert st["failure"]["host"] == "gpu4" and st["failure"]["pid"] == pid
    assert st["failure"]["cause"] == cause and st["failure"]["rank"] == int(m.group(1))
    txt = invoke("status", "-i", str(testbed), "-H", NODES, "--job", job)
    assert f"first failure: rank {m.group(1)} on gpu4 (local rank {local}, pid {pid}) {cause}" in txt.stdout
    return job, text


def test_sigkill_of_a_worker_is_named_with_its_rank(testbed):
    job, text = _killed_worker_is_named(testbed, "t-sigkill", "KILL", "killed by SIGKILL")
    # item 8: testbed hosts resolve each other's addresses, so no c10d hostname warning
    out = logs(testbed, job)
    assert "[gpu1/r0] start rank=0" in out.stdout
    assert "hostname of the client socket cannot be retrieved" not in out.stdout + text


def test_sigsegv_of_a_worker_is_named(testbed):
    _killed_worker_is_named(testbed, "t-sigsegv", "SEGV", "killed by SIGSEGV (segmentation fault)")


def test_exit_code_without_error_json_names_rank_and_its_last_lines(testbed):
    """A data file present on gpu1 only: gpu4's ranks exit 2 (argparse) without error.json;
    gpu1's wait at init until --init-timeout, then fail."""
    job = unique("t-exit")
    data = f"/srv/torchrig/data/{job}.txt"
    sh(testbed, "gpu1", f"head -c 200000 /dev/urandom | base64 > {data}; chmod 644 {data}")
    sh(testbed, "gpu4", f"rm -f {data}")
    try:
        r = launch(testbed, job, "--max-restarts", "0",
                   "--args", f"--data {data} --max-steps 20 --init-timeout 20", timeout=400)
        # gpu4's workers may be gone before launch confirms them: either way it is reported
        wait_ended(testbed, job)
        text = failures(testbed, job)
        assert re.match(r"first failure: \[gpu4/[rl]\d\] \(local rank \d, pid \d+\) exited with code 2 ",
                        text), text + r.stderr
        assert f"--data: {data}: no such file" in text, text  # the payload's own line
    finally:
        sh(testbed, "gpu1", f"rm -f {data}")


def test_worker_over_its_memory_limit_is_named(testbed):
    """The kernel OOM-kills a worker whose memory cgroup is over its limit. The testbed's
    hosts cannot set a unit's MemoryMax (their cgroup tree is read-only) nor read the kernel
    log, so the test, as root on this machine, moves the worker into a memory cgroup of its own
    with a limit below its use; the node sees a worker killed by SIGKILL."""
    cg_root = Path("/sys/fs/cgroup/memory")
    if not (cg_root / "memory.limit_in_bytes").exists():
        import pytest
        pytest.skip("needs a cgroup v1 memory hierarchy on this machine")
    job = unique("t-oom")
    r = launch(testbed, job, "--max-restarts", "0",
               "--args", "--max-steps 100000 --log-every 5 --init-timeout 60")
    assert r.returncode == 0, r.stderr
    wait_step(testbed, job, 5)
    pid, local = worker(testbed)
    # the same process as this machine sees it: the worker whose namespace pid is `pid` in
    # this testbed's gpu4 (other testbeds on this machine have a gpu4 too)
    mine = f"/{ENV['TORCHRIG_TESTBED_BRIDGE']}-gpu4/"
    host_pid = None
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            status_txt = (p / "status").read_text()
            cg = (p / "cgroup").read_text()
        except OSError:
            continue
        ns = re.search(r"^NSpid:\s+\d+\s+(\d+)$", status_txt, re.M)
        if (ns and int(ns.group(1)) == pid and mine in cg and f"/torchrig-{job}.service" in cg
                and "train.py" in (p / "cmdline").read_text()):
            host_pid = int(p.name)
    assert host_pid, "worker not found from this machine"
    cg = cg_root / f"torchrig-test-oom-{host_pid}"
    cg.mkdir()
    try:
        (cg / "cgroup.procs").write_text(str(host_pid))
        # v1 moves no earlier charges and refuses a limit below the use: just above what the
        # worker has charged here since the move, so its next pages are over the limit
        use = int((cg / "memory.usage_in_bytes").read_text())
        (cg / "memory.limit_in_bytes").write_text(str(use + 8192))
        wait_ended(testbed, job)
        text = failures(testbed, job)
        assert re.match(rf"first failure: \[gpu4/r\d\] \(local rank {local}, pid {pid}\) killed by SIGKILL",
                        text), text
    finally:
        for _ in range(20):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(1)


FAULT = '''import os, signal, sys, time
# test_launch_failures only (written and removed by the test): node 0's ranks finish at once,
# node 1's local rank 1 kills itself once a little later
print(f"start rank={os.environ['RANK']} local_rank={os.environ['LOCAL_RANK']}", flush=True)
if os.environ["GROUP_RANK"] == "0":
    time.sleep(2)
    sys.exit(0)
if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(6)
    print("dying now", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(600)
'''


def test_worker_dies_while_others_finish_status_says_what_each_waits_for(testbed):
    job = unique("t-finish")
    script = REPO / "payload" / "_test_launch_failures_fault.py"
    script.write_text(FAULT)
    try:
        r = launch(testbed, job, "--script", script.name, "--max-restarts", "1",
                   "--rdzv-timeout", "30", "--exit-barrier-timeout", "35")
    finally:
        script.unlink()
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    seen = {}
    while time.monotonic() - t0 < 60 and len(seen) < 2:
        _, st = status(testbed, job)
        seen.update(st["waiting"])
        time.sleep(2)
    assert re.fullmatch(r"finished, waiting for peers at the exit barrier, gives up at \d\d:\d\d:\d\d",
                        seen.get("gpu1", "")), seen
    assert re.fullmatch(r"restarting, waiting for 1 more node to rejoin, gives up at \d\d:\d\d:\d\d",
                        seen.get("gpu4", "")), seen
    took = wait_ended(testbed, job, timeout=200) - t0
    # the operator's bounds (exit barrier 35 s, rendezvous 30 s) and a loaded machine's slack,
    # far below torchrun's own 300 s (it ended 0.4 s past the bare bounds at load 20)
    assert took < 35 + 30 + 60, took
    text = failures(testbed, job)
    assert re.match(r"first failure: \[gpu4/r[23]\] \(local rank 1, pid \d+\) killed by SIGKILL ", text), text
    assert "dying now" in text
    print(f"job ended {took:.0f}s after launch")


def test_typo_in_args_ends_launch_at_once_stopped_everywhere_without_restart(testbed):
    """Issue 22, item 6: train.py's argparse exits 2 on every rank of the first attempt, within
    the early window of their spawn: launch exits 1 at once with that stderr line, the job is
    stopped on both nodes, and torchrun did not restart (no attempt_1, no restart line). The
    window is given large so that a loaded testbed's slow start is inside it: a failure inside
    it returns at once whatever its length."""
    job = unique("t-typo")
    t = time.monotonic()
    r = launch(testbed, job, "--args", "--no-such-flag", "--early-fail-window", "90")
    took = time.monotonic() - t
    assert r.returncode == 1, r.stdout + r.stderr
    assert "did not start on every node, so it was stopped on all of them" in r.stderr, r.stderr
    assert "train.py: error: unrecognized arguments: --no-such-flag" in r.stderr, r.stderr
    assert re.search(r"last stderr lines of \[gpu[14]/l[01]\]:", r.stderr), r.stderr
    # today's launch returned 0 here and the job failed ~34 s later after 3 restarts; this
    # bound is the whole launch (gate, push, rendezvous, the failure, the stop everywhere):
    # 55 s on a testbed machine at load 18 (2 cores)
    assert took < 90, took
    ended = 0
    for h in NODES.split(","):
        assert sh(testbed, h, f"systemctl show -p ActiveState --value torchrig-{job}") in ("inactive", "failed")
        assert sh(testbed, h, f"pgrep -fc '{WORKER}' || true") == "0"
        attempts = sh(testbed, h, f"cd /var/log/torchrig/{job} && ls -d */attempt_* || true").split()
        assert attempts and all(a.endswith("/attempt_0") for a in attempts), (h, attempts)
        journal = sh(testbed, h, f"journalctl -u torchrig-{job} --no-pager -o cat")
        assert "will restart worker group" not in journal, (h, journal[-2000:])
        ended += "ending the run without restarting" in journal
    assert ended >= 1  # the node whose failure launch saw ended its run itself
    print(f"launch failed after {took:.1f}s")
