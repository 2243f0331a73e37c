"""logs against what a job can do to its own log folder on a real node (gpu1): the service
user plants a symlink to /etc/shadow and a FIFO as rank logs; a rank file is removed and
refilled while `logs -f` is disconnected. The follower runs as root there, as it always does.
Needs no provisioned host: the service user and log root are made here if missing."""

import re
import shlex
import threading

from conftest import invoke_bg, logs, sh, wait_until

HOST = "gpu1"
USER = "torchrig"  # the service user (provision's default)
LOG_DIR = "/var/log/torchrig"


def as_user(inv, script):
    """Run a shell script on HOST as the service user."""
    return sh(inv, HOST, f"runuser -u {USER} -- sh -c {shlex.quote(script)}")


def job_dir(inv, job):
    """The job's log folder, made by root for the service user as launch makes it (the user
    and the log root are provision's; made here too if this file runs alone)."""
    sh(inv, HOST, f"id -u {USER} >/dev/null 2>&1 || useradd --system {USER}; mkdir -p {LOG_DIR}; "
                  f"rm -rf {LOG_DIR}/{job}; install -d -o {USER} -m 0750 {LOG_DIR}/{job}")
    return f"{LOG_DIR}/{job}/{job}_abc123/attempt_0"


def test_planted_symlink_and_fifo_are_not_read_and_logs_completes(testbed):
    att = job_dir(testbed, "t-plant")
    as_user(testbed, f"mkdir -p {att}/0 {att}/1 && "
                     f"printf 'start rank=0 local_rank=0 host=gpu1\\nhonest line\\n' > {att}/0/stdout.log && "
                     f"ln -s /etc/shadow {att}/1/stdout.log && mkfifo {att}/1/stderr.log && "
                     f"ln -s /root {att}/3")
    shadow_user = sh(testbed, HOST, "cut -d: -f1 /etc/shadow | head -1")
    assert shadow_user == "root"
    for args in ([], ["-f"]):  # one pass, and follow (the unit is not running: drain, end)
        r = logs(testbed, "t-plant", *args, hosts=HOST, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == ["[gpu1/r0] start rank=0 local_rank=0 host=gpu1",
                                         "[gpu1/r0] honest line"]
        assert "root:" not in r.stdout + r.stderr
        assert f"{HOST}: t-plant_abc123/attempt_0/1/stdout.log: a symbolic link, not read" in r.stderr
        assert f"{HOST}: t-plant_abc123/attempt_0/1/stderr.log: a FIFO, not read" in r.stderr
        assert f"{HOST}: t-plant_abc123/attempt_0/3: a symbolic link, not followed" in r.stderr
    # root created nothing in the job's folder, and no follower is left blocked on the FIFO
    assert sh(testbed, HOST, f"find {LOG_DIR}/t-plant -mindepth 1 -user root") == ""
    assert sh(testbed, HOST, "pgrep -f '^python3 (-I )?-( |$)' || true") == ""
    sh(testbed, HOST, f"rm -rf {LOG_DIR}/t-plant")


def test_file_replaced_while_disconnected_is_read_from_its_start(testbed):
    job = "t-swap"
    att = job_dir(testbed, job)
    f = f"{att}/0/stdout.log"
    as_user(testbed, f"mkdir -p {att}/0 && {{ echo 'start rank=3 local_rank=0 host=gpu1 pid=1'; "
                     f"for i in 1 2 3 4 5; do echo old=$i; done; }} > {f}")
    # a running unit with the job's name keeps `logs -f` following
    sh(testbed, HOST, f"systemctl reset-failed torchrig-{job}.service 2>/dev/null; "
                      f"systemd-run --unit torchrig-{job} -p User={USER} sleep 600")
    p = invoke_bg("logs", "-i", str(testbed), "-H", HOST, "--job", job, "-f")
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(p.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until("logs -f to show the first file's 6 lines",
                   lambda: "[gpu1/r3] old=5\n" in out or p.poll() is not None, 120, 0.2)
        assert p.poll() is None, (out, p.stderr.read())
        # the connection's far end stops (a silent link), the file is removed and refilled by
        # the restarted worker, longer than before, then the link drops for good
        pid = sh(testbed, HOST, "pgrep -n -f '^python3 (-I )?-( |$)'")  # the newest: this one
        assert pid.isdigit(), pid
        sh(testbed, HOST, f"kill -STOP {pid}")
        as_user(testbed, f"rm {f} && {{ echo 'start rank=5 local_rank=0 host=gpu1 pid=2'; "
                         f"for i in 1 2 3 4 5 6 7 8 9 10; do echo new=$i; done; }} > {f}")
        sh(testbed, HOST, f"kill -KILL {pid}")
        wait_until("logs -f to reconnect and show the refilled file's 11 lines",
                   lambda: "[gpu1/r5] new=10\n" in out or p.poll() is not None, 120, 0.2)
        assert p.poll() is None, (out, p.stderr.read())
    finally:
        sh(testbed, HOST, f"systemctl stop torchrig-{job}.service", check=False)
        p.wait(timeout=60)
    reader.join(10)
    err = p.stderr.read()
    assert p.returncode == 0, err
    assert out == ["[gpu1/r3] start rank=3 local_rank=0 host=gpu1 pid=1\n"] + [
        f"[gpu1/r3] old={i}\n" for i in range(1, 6)] + [
        "[gpu1/r5] start rank=5 local_rank=0 host=gpu1 pid=2\n"] + [
        f"[gpu1/r5] new={i}\n" for i in range(1, 11)]
    assert re.search(r"gpu1: t-swap_abc123/attempt_0 started over .*; 6 line\(s\) read from it", err), err
