"""launch, logs, status, stop on two testbed nodes (gpu1, gpu4: V100S pairs) with real systemd,
real torchrun and gloo. A fault is injected only while the job certainly runs: jobs that get one
run until the test stops them, and the test waits (bounded) for the step it needs first."""

import copy
import json
import re
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import (NODES, WORKER, invoke_bg, ip_of, launch, logs, sh, sh_each, status, stop,
                      wait_step, wait_unit_ended, wait_until, write_inventory)

pytestmark = pytest.mark.provisioned("gpu1", "gpu4")
SECRET = "supersecret-7f3a"


def test_dry_run_shows_units_and_changes_nothing(testbed):
    r = launch(testbed, "t-dry", "--dry-run", "--env", f"HF_TOKEN={SECRET}")
    assert r.returncode == 0, r.stderr
    assert "--- gpu1:/etc/systemd/system/torchrig-t-dry.service" in r.stdout
    assert '"--rdzv-backend" "c10d"' in r.stdout and '"is_host=true,join_timeout=300"' in r.stdout
    assert "KillMode=mixed" in r.stdout and "LimitMEMLOCK=infinity" in r.stdout
    assert "HF_TOKEN='***'" in r.stdout and SECRET not in r.stdout + r.stderr
    assert sh(testbed, "gpu1", "ls /etc/systemd/system/torchrig-t-dry.service 2>&1 || true").endswith(
        "No such file or directory")


def ssh_logins(host: str) -> int:
    """sshd's 'Accepted' lines so far in the host's journal (read from the operator's side)."""
    from torchrig.testbed.machines import root_of
    out = subprocess.run(["journalctl", "-D", f"{root_of(host)}/var/log/journal", "-t", "sshd",
                          "-o", "cat", "--no-pager"], capture_output=True, text=True).stdout
    return out.count("Accepted ")


def test_launch_opens_one_ssh_connection_per_node(testbed):
    """One fleet session per task: launch's checks, gate, push, install, start and its wait
    for the workers all go over one connection per node (before: one per command, and one
    per node every second while it waited)."""
    nodes = NODES.split(",")
    before = {h: ssh_logins(h) for h in nodes}
    r = launch(testbed, "t-conns", "--script", "env_check.py", "--nproc-per-node", "2")
    assert r.returncode == 0, r.stderr
    time.sleep(1)  # journald has the last lines on disk
    assert {h: ssh_logins(h) - before[h] for h in nodes} == {h: 1 for h in nodes}


def test_launch_refuses_an_unhealthy_node_and_skip_unhealthy_leaves_it_out(testbed):
    """gpu4's GPU 0 failed a row remap (the stand-in nvidia-smi's injected health)."""
    sh(testbed, "gpu4", """printf %s '{"0": {"remap_failure": true}}' > /etc/torchrig-testbed/health.json""")
    try:
        r = launch(testbed, "t-unhealthy", "--script", "env_check.py", "--nproc-per-node", "2")
        assert r.returncode == 1
        assert ("error: nothing started: unhealthy node(s): gpu4: memory: GPU 0: row remapping "
                "failed") in r.stderr and "--skip-unhealthy" in r.stderr
        assert "No files found" in sh(testbed, "gpu1", "systemctl cat torchrig-t-unhealthy 2>&1 || true")
        r = launch(testbed, "t-unhealthy", "--script", "env_check.py", "--nproc-per-node", "2",
                   "--skip-unhealthy")
        assert r.returncode == 0, r.stderr
        assert "left out unhealthy node(s) gpu4: gpu4: memory: GPU 0" in r.stderr
        assert "started on gpu1 (1 node(s) x 2 process(es))" in r.stdout
    finally:
        sh(testbed, "gpu4", "rm -f /etc/torchrig-testbed/health.json")
        stop(testbed, "t-unhealthy", hosts="gpu1")


BASIC_ARGS = "--max-steps 30 --log-every 5 --ckpt-every 10"


@pytest.fixture(scope="module")
def basic_job(testbed, fleet):
    """t-basic launched and followed to its end, once per file for every test that needs it
    (so each of them passes alone and in any order): (launch result, `logs -f` result)."""
    fleet.provisioned(*NODES.split(","))
    r = launch(testbed, "t-basic", "--args", BASIC_ARGS, early_window=True)  # launch's default
    out = logs(testbed, "t-basic", "-f", timeout=300) if r.returncode == 0 else None
    return r, out


def test_two_nodes_train_to_completion(testbed, basic_job):
    r, out = basic_job
    assert r.returncode == 0, r.stderr
    assert "job t-basic started on gpu1,gpu4 (2 node(s) x 2 process(es))" in r.stdout
    assert out.returncode == 0, out.stderr   # returned when the job had ended
    starts = re.findall(r"^\[(gpu\d)/r(\d)\] start rank=(\d) ", out.stdout, re.M)
    assert sorted(int(g) for _, g, _ in starts) == [0, 1, 2, 3]
    assert {n for n, _, _ in starts} == {"gpu1", "gpu4"}
    losses = [float(x) for x in re.findall(r"^\[gpu\d/r0\] step=\d+ loss=([0-9.]+)", out.stdout, re.M)]
    assert len(losses) >= 5 and losses[-1] < losses[0], losses
    assert re.search(r"^\[gpu\d/r0\] done step=30 ", out.stdout, re.M)
    _, st = status(testbed, "t-basic")
    assert {n["unit"]["ActiveState"] for n in st["nodes"].values()} == {"inactive"}
    assert any((n["progress"] or "").startswith("done step=30") for n in st["nodes"].values())


def test_dry_run_diffs_against_the_nodes_files(testbed, basic_job):
    """Launch's files go through the change engine: a dry run of the job just run shows its
    files unchanged on the nodes, except the unit's line naming the launch that wrote it and
    the rendezvous run id (new on every launch; a secret file, never shown)."""
    assert basic_job[0].returncode == 0, basic_job[0].stderr
    r = launch(testbed, "t-basic", "--dry-run", "--args", BASIC_ARGS, early_window=True)
    assert r.returncode == 0, r.stderr
    for path in ("/etc/torchrig/jobs/t-basic.env",
                 "/etc/systemd/system/torchrig-gpumon@t-basic.service",
                 "/etc/systemd/system/torchrig-gpumon@t-basic.timer"):
        assert f"--- gpu4:{path}\n(unchanged)\n" in r.stdout, r.stdout
    run_id = r.stdout.split("--- gpu4:/etc/torchrig/jobs/t-basic.run\n")[1].split("\n--- gpu")[0]
    assert "(secret file: contents not shown)" in run_id and "PET_RDZV_ID" not in run_id, run_id
    unit = r.stdout.split("--- gpu1:/etc/systemd/system/torchrig-t-basic.service\n")[1].split("\n--- gpu")[0]
    changed = [ln for ln in unit.splitlines() if ln[:1] in "+-" and ln[:3] not in ("---", "+++")]
    assert [ln[:len("+# torchrig launch ")] for ln in changed] == ["-# torchrig launch ", "+# torchrig launch "], unit


def test_args_and_env_verbatim_and_secret_never_shown(testbed):
    weird_args = ["a b", "it's", 'say "hi"', "$(touch /tmp/pwned)", "; touch /tmp/pwned", "100%", "`id`", "\\n"]
    weird_env = "a b 'c' \"d\" $(id) ; touch /tmp/pwned %h \\x `id`"
    import shlex
    r = launch(testbed, "t-args", "--script", "env_check.py", "--nproc-per-node", "1",
               "--args", shlex.join(weird_args),
               "--env", "TORCHRIG_SHOW_ENV=WEIRD", "--env", "TORCHRIG_HASH_ENV=HF_TOKEN",
               "--env", f"WEIRD={weird_env}", "--env", f"HF_TOKEN={SECRET}")
    assert r.returncode == 0, r.stderr
    out = logs(testbed, "t-args", "-f", timeout=120)
    st_r, st = status(testbed, "t-args")
    checks = [json.loads(m) for m in re.findall(r"ENV_CHECK (.*)$", out.stdout, re.M)]
    assert len(checks) == 2
    import hashlib
    for c in checks:
        assert c["argv"] == weird_args
        assert c["env"] == {"WEIRD": weird_env}
        assert c["sha256"]["HF_TOKEN"] == hashlib.sha256(SECRET.encode()).hexdigest()
    for text in (r.stdout, r.stderr, out.stdout, out.stderr, st_r.stdout, st_r.stderr):
        assert SECRET not in text
    # env_check.py prints no step line: status shows the last line each node's rank printed
    assert st_r.returncode == 0, st_r.stderr
    for n in st["nodes"].values():
        assert n["progress"] is None and n["last_line"].startswith("ENV_CHECK "), n
    for h in ("gpu1", "gpu4"):
        assert sh(testbed, h, "test -e /tmp/pwned && echo PWNED || echo clean") == "clean"
        # the only file holding the secret is the 0600 root env file (the pattern is spelled
        # so that this grep's own command line, which sudo logs, does not contain the secret)
        pattern = SECRET[:-1] + "[" + SECRET[-1] + "]"
        found = sh(testbed, h, f"grep -rlsE -- '{pattern}' /etc /var/log /opt /srv /tmp /home /run || true")
        assert found.split() == ["/etc/torchrig/jobs/t-args.env"]
        assert sh(testbed, h, "stat -c '%a %U' /etc/torchrig/jobs/t-args.env") == "600 root"


def test_killed_rank_restarts_group_and_resumes(testbed):
    # The job cannot finish before the kill on any machine (a 160-step job could, on a fast
    # one): it runs until `stop`, and the kill lands after step 45 is logged (checkpoints at
    # 20 and 40 exist) while both units are active.
    r = launch(testbed, "t-kill", "--max-restarts", "2",
               "--args", "--max-steps 1000000 --log-every 5 --ckpt-every 20")
    assert r.returncode == 0, r.stderr
    # an operator's `logs -f` that dies does not take the job with it
    follower = invoke_bg("logs", "-i", str(testbed), "-H", NODES, "--job", "t-kill", "-f")
    wait_step(testbed, "t-kill", 45)
    follower.kill()
    follower.wait()
    _, st = status(testbed, "t-kill")
    assert {n["unit"]["ActiveState"] for n in st["nodes"].values()} == {"active"}
    # SIGKILL one worker on gpu4
    pid = sh(testbed, "gpu4", f"pgrep -f {WORKER} | head -1")
    assert pid.isdigit(), pid
    sh(testbed, "gpu4", f"kill -9 {pid}")

    def trained_after_resume():  # the restarted group resumes and trains on
        text = logs(testbed, "t-kill", "--rank", "0", "--grep", r"resume step=|^step=").stdout
        m = list(re.finditer(r"resume step=(\d+) ", text))
        return bool(m and re.search(r"\] step=\d+ ", text[m[-1].end():]))
    wait_until("t-kill's rank 0 to log a step after resuming from a checkpoint",
               trained_after_resume, 300, 3)
    r = stop(testbed, "t-kill")
    assert r.returncode == 0, r.stdout + r.stderr
    out = logs(testbed, "t-kill", "-f", timeout=400)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    # the group was started again (gpu4's agent saw the failure: attempt 1; gpu1's restarted
    # at the same attempt, its first run's files cleared before this follow began) and the
    # run that ended (stopped by the operator) resumed from a checkpoint, not from step 0
    assert re.search(r"^\[gpu4/r\d a[12]\] start rank=", text, re.M), text[-3000:]
    done = list(re.finditer(r"^(\[gpu\d/r0(?: a\d+)?\]) done step=(\d+) ", text, re.M))
    assert done, text[-3000:]
    mine = [ln for ln in text.splitlines() if ln.startswith(done[-1].group(1) + " ")]
    at = max(i for i, ln in enumerate(mine) if "] resume step=" in ln)
    resumed = int(re.search(r"resume step=(\d+) .*ckpt_0*(\d+)\.pt", mine[at]).group(1))
    after = [int(m.group(1)) for ln in mine[at:] for m in [re.search(r"\] step=(\d+) ", ln)] if m]
    assert after and after[0] > resumed >= 20 and int(done[-1].group(2)) >= after[-1]
    # no gaps, no repeats: as many lines as the rank files on the hosts hold, plus those of
    # files torchrun cleared after they were read (a survivor restarted at the same attempt
    # number), which logs counts in a notice; and each file's lines in order
    total = sum(int(sh(testbed, h, "cat /var/log/torchrig/t-kill/*/attempt_*/*/std*.log | wc -l"))
                for h in ("gpu1", "gpu4"))
    cleared = sum(int(n) for n in re.findall(r"started over \(.*?\); (\d+) line\(s\) read from it "
                                             r"before are no longer on disk", out.stderr))
    assert len(text.strip().splitlines()) == total + cleared, out.stderr
    assert after == sorted(after) and len(after) == len(set(after))


SHORT_JOBS = 10
SHORT_JOBS_AT_ONCE = 5


def test_short_jobs_end_cleanly_every_time(testbed):
    """A finished job ends cleanly every time. Before: on a fast machine 2 of 15 such jobs had
    a rank abort at teardown after `done` ("terminate called without an active exception"),
    and torchrun then ran the job again from its final checkpoint or waited 5 minutes in its
    exit barrier. Every job here must end inactive, exit 0, in one attempt, one torchrun run.
    The jobs are launched a few at a time (they overlap, as they did one after another: a job
    may still run while the next starts); every one of them still goes through its teardown."""
    jobs = [f"t-short{i}" for i in range(SHORT_JOBS)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(SHORT_JOBS_AT_ONCE) as ex:
        for r in ex.map(lambda job: launch(testbed, job, "--args",
                                           "--max-steps 6 --log-every 2 --ckpt-every 3"), jobs):
            assert r.returncode == 0, r.stderr
    units = " ".join(f"torchrig-{job}" for job in jobs)
    running = list(jobs)

    def all_ended():  # one command per node for every job's unit
        states = {h: sh(testbed, h, f"systemctl show -p ActiveState --value {units}", check=False).split()
                  for h in NODES.split(",")}
        running[:] = sorted({f"{job} on {h}: {s}" for h, st in states.items()
                             for job, s in zip(jobs, st) if s not in ("inactive", "failed")}
                            | {f"{h}: {st}" for h, st in states.items() if len(st) != len(jobs)})
        return not running
    # a rank that aborts at teardown leaves its peer node in torchrun's 300 s exit barrier
    try:
        wait_until("every short job to end", all_ended, 240, interval=5)
    except AssertionError as e:
        raise AssertionError(f"{e}; still running: {running}") from None
    with ThreadPoolExecutor(SHORT_JOBS_AT_ONCE) as ex:
        ended = dict(zip(jobs, ex.map(lambda job: status(testbed, job)[1], jobs)))
        texts = dict(zip(jobs, ex.map(lambda job: logs(testbed, job).stdout, jobs)))
    for job, st in ended.items():
        assert st, job
        for node, n in st["nodes"].items():
            u = n["unit"]
            assert (u["ActiveState"], u["Result"], u["ExecMainStatus"], u["NRestarts"]) == \
                ("inactive", "success", "0", "0"), (job, node, u)
            assert (n["attempt"], n["torchrun_starts"]) == (0, 1), (job, node, n)
        assert any((n["progress"] or "").startswith("done step=6 loss=")
                   for n in st["nodes"].values()), (job, st)
        text = texts[job]
        assert len(re.findall(r"\] start rank=\d ", text)) == 4, (job, text[-2000:])
        for bad in ("resume step=", "terminate called", "Fatal Python error", "Traceback"):
            assert bad not in text, (job, bad, text[-2000:])
    print(f"{len(jobs)} jobs ended cleanly in {time.monotonic() - t0:.0f}s")


# "sigterm" once every worker on the node has a SIGTERM pending (bit 15 of its pending set),
# "gone" when none is left, else "waiting"
STOPPED_TERM = (f"ps=$(pgrep -f {WORKER}); [ -n \"$ps\" ] || {{ echo gone; exit; }}; "
                "for p in $ps; do m=$(awk '/^ShdPnd:/ {print $2}' /proc/$p/status 2>/dev/null); "
                "[ $(( (0x${m:-0} >> 14) & 1 )) = 1 ] || { echo waiting; exit; }; done; echo sigterm")


def test_survivor_restart_clears_its_folder_and_logs_says_so(testbed):
    """A healthy node whose peer's group failed restarts its workers at the same attempt
    number, and torchrun clears that attempt folder first. `logs -f` must say how many lines
    it had shown from it (they are gone from disk), then follow the new files from 0.
    The job runs until the test stops it (after gpu1 resumed and trained on), so the faults
    land while it runs on any machine speed."""
    r = launch(testbed, "t-clear", "--max-restarts", "2",
               "--args", "--max-steps 1000000 --log-every 5 --ckpt-every 20")
    assert r.returncode == 0, r.stderr
    wait_step(testbed, "t-clear", 25)  # a checkpoint exists
    # gpu1's workers cannot notice the failure (stopped), so its agent sees a membership change
    sh(testbed, "gpu1", f"pkill -STOP -f {WORKER}")
    follower = invoke_bg("logs", "-i", str(testbed), "-H", NODES, "--job", "t-clear", "-f")
    lines, errs = [], []
    readers = [threading.Thread(target=lambda f=f, into=into: into.extend(iter(f.readline, "")),
                                daemon=True)
               for f, into in ((follower.stdout, lines), (follower.stderr, errs))]
    for t in readers:
        t.start()
    try:
        # gpu4's group fails: all its ranks at once (one alone would leave its peer rank in a
        # collective with the stopped gpu1, which torchrun kills only after its 30 s grace)
        killed = sh(testbed, "gpu4", f"pkill -9 -e -f {WORKER}")
        assert "killed" in killed, killed
        # gpu1's agent stops its (stopped) workers for the restart: once its SIGTERM is pending
        # they are let go, so they end on it instead of at torchrun's SIGKILL 30 s later
        wait_until("gpu1's agent to send its stopped workers SIGTERM",
                   lambda: sh(testbed, "gpu1", STOPPED_TERM, check=False) in ("sigterm", "gone"), 120, 1)
        sh(testbed, "gpu1", f"pkill -CONT -f {WORKER} || true")

        def resumed_and_trained():
            mine = [ln for ln in list(lines) if ln.startswith("[gpu1/r0] ")]
            at = [i for i, ln in enumerate(mine) if re.match(r"\[gpu1/r0\] resume step=[1-9]", ln)]
            return bool(at and any("] step=" in ln for ln in mine[at[-1]:]))
        wait_until("logs -f to show gpu1's rank 0 resume from a checkpoint and train on",
                   resumed_and_trained, 400, 1)
    finally:
        r = stop(testbed, "t-clear")
    assert r.returncode == 0, r.stdout + r.stderr
    follower.wait(timeout=400)  # it ends when the job has ended
    for t in readers:
        t.join(30)
    out, err = "".join(lines), "".join(errs)
    assert follower.returncode == 0, err
    notes = re.findall(r"^logs: (gpu\d): (\S+) started over \(.*?\); (\d+) line\(s\) read from it "
                       r"before are no longer on disk", err, re.M)
    assert notes and {n for n, _, _ in notes} == {"gpu1"}, err
    assert all(re.fullmatch(r"[0-9a-f]{32}_\w+/attempt_0", f) and int(k) > 0 for _, f, k in notes), notes
    total = sum(int(sh(testbed, h, "cat /var/log/torchrig/t-clear/*/attempt_*/*/std*.log | wc -l"))
                for h in ("gpu1", "gpu4"))
    assert len(out.strip().splitlines()) == total + sum(int(k) for _, _, k in notes), err
    # gpu1 stayed in attempt 0 (a membership change is not a retry), resumed from a checkpoint
    # and ended when stopped
    assert re.search(r"^\[gpu\d/r0\] done step=\d+ ", out, re.M), out[-3000:]
    assert re.search(r"^\[gpu1/r0\] resume step=([1-9]\d*) ", out, re.M), out[-3000:]


def test_stop_leaves_no_process_and_checkpoints(testbed):
    r = launch(testbed, "t-stop", "--args", "--max-steps 100000 --log-every 5 --ckpt-every 1000")
    assert r.returncode == 0, r.stderr
    wait_step(testbed, "t-stop", 10)
    r = stop(testbed, "t-stop")
    assert r.returncode == 0, r.stdout + r.stderr
    for h in ("gpu1", "gpu4"):
        # [t]: the pattern must not match the shell running this very pgrep
        assert sh(testbed, h, "pgrep -fc '[t]rain.py|[t]orch.distributed.run|[t]orchrig_torchrun' || true") == "0"
    # graceful SIGTERM: a checkpoint at the step where the job stopped
    ck = sh(testbed, "gpu1", "ls /srv/torchrig/checkpoints/t-stop/ 2>/dev/null; "
                             "ls /srv/torchrig/checkpoints/t-stop 2>/dev/null | wc -l") + \
        sh(testbed, "gpu4", "ls /srv/torchrig/checkpoints/t-stop/ 2>/dev/null || true")
    assert re.search(r"ckpt_\d+\.pt", ck), ck
    # a job the operator stopped reads as stopped, not failed (torchrun exits 1 on SIGTERM)
    _, st = status(testbed, "t-stop")
    assert {n["unit"]["ActiveState"] for n in st["nodes"].values()} == {"inactive"}, st


def test_down_host_means_nothing_started(testbed, inventory_doc, tmp_path):
    doc = copy.deepcopy(inventory_doc)
    subnet = doc["hosts"][0]["address"].rsplit(".", 1)[0]
    doc["hosts"].append({"name": "gpu-dead", "address": f"{subnet}.251", "gpus": 2,
                         "groups": ["testbed"]})
    inv = write_inventory(tmp_path, doc)
    r = launch(inv, "t-dead", hosts="gpu1,gpu4,gpu-dead", timeout=200)
    assert r.returncode == 1
    assert "nothing started" in r.stderr and "gpu-dead" in r.stderr
    for h in ("gpu1", "gpu4"):
        assert sh(testbed, h, "ls /etc/systemd/system/ | grep -c t-dead || true") == "0"


def test_two_jobs_and_conflicts(testbed, inventory_doc, tmp_path):
    # t-one runs until stopped, so the conflict checks below find it running on any machine
    # speed (a 40-step job could end before the second launch's check)
    a = launch(testbed, "t-one", "--args", "--max-steps 1000000 --log-every 10")
    b = launch(testbed, "t-two", "--args", "--max-steps 40 --log-every 10")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    again = launch(testbed, "t-one", "--args", "--max-steps 40")
    assert again.returncode == 1 and "job 't-one' is already running on gpu1" in again.stderr
    # on GPU hosts two jobs would share the GPUs: refused before anything is touched
    doc = copy.deepcopy(inventory_doc)
    doc["vars"]["accelerator"] = "cuda"
    r = launch(write_inventory(tmp_path, doc), "t-three")
    assert r.returncode == 1 and "already runs job(s)" in r.stderr and "share them" in r.stderr
    r = stop(testbed, "t-one")
    assert r.returncode == 0, r.stdout + r.stderr
    for job, done in (("t-one", r"\d+"), ("t-two", "40")):
        out = logs(testbed, job, "-f", timeout=300)
        assert re.search(rf"^\[gpu\d/r0\] done step={done} ", out.stdout, re.M), (job, out.stdout[-2000:])
    # launched again under its name with --max-steps 20: its units, still loaded by systemd
    # from the first run, are read again from their new files (install reloads only then)
    r = launch(testbed, "t-one", "--args", "--max-steps 20 --log-every 10")
    assert r.returncode == 0, r.stderr
    ran = sh(testbed, "gpu1", "systemctl show -p ExecStart --value torchrig-t-one.service")
    assert "--max-steps 20 " in ran and "1000000" not in ran, ran
    out = logs(testbed, "t-one", "-f", timeout=300)  # resumed past step 20: ends at once
    assert re.search(r"^\[gpu\d/r0\] done step=\d+ .*\(nothing to train: the checkpoint is at or "
                     r"past the last step\)$", out.stdout, re.M), out.stdout[-2000:]


def test_power_off_node_survivors_end_in_bounded_time(testbed):
    from torchrig.testbed import machines
    r = launch(testbed, "t-power", "--max-restarts", "1", "--rdzv-timeout", "30",
               "--args", "--max-steps 100000 --log-every 5 --ckpt-every 50 --init-timeout 60")
    assert r.returncode == 0, r.stderr
    wait_step(testbed, "t-power", 10)
    machines.power_off("gpu4")              # the power cord: no shutdown, no goodbye
    t0 = time.monotonic()
    try:
        wait_unit_ended(testbed, "gpu1", "torchrig-t-power", timeout=240)  # the survivor
        took = time.monotonic() - t0
        r, st = status(testbed, "t-power", hosts="gpu1,gpu4")
        assert r.returncode == 1 and "gpu4" in r.stderr
        assert "error" in st["nodes"]["gpu4"]
        print(f"survivor ended {took:.0f}s after the power-off")
    finally:
        machines.stop("gpu4")
        machines.start("gpu4")
        machines.wait_ssh(ip_of(testbed, "gpu4"), timeout=120)


CONNECT = ("python3 -I -c 'import socket, sys\n"
           "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close(); print(\"open\")\n"
           "except OSError as e: print(\"closed\", e.errno)' ")


def connect_cmd(user, address, port) -> str:
    """Prints 'open' or 'closed <errno>': a TCP connection as `user` (root: `sudo`)."""
    return f"runuser -u {user} -- {CONNECT} {address} {port}"


def test_rendezvous_port_closed_to_strangers_while_the_job_trains(testbed):
    """torch's c10d store has no authentication and unpickles what it reads: only the job's
    nodes reach it (a host outside the fleet, here the operator's machine on the testbed's
    bridge, is refused, as on gloo's ports), and on the nodes only root and the service user
    (another local user is refused on the store's node and on the other node), while the job
    trains across both nodes. The run id is random, never the job name, and only root reads it."""
    from torchrig.job import job_port
    job, port = "t-fw", job_port("t-fw", 29400)
    r = launch(testbed, job, "--args", "--max-steps 1000000 --log-every 5 --ckpt-every 1000")
    assert r.returncode == 0, r.stderr
    step = wait_step(testbed, job, 10)
    store = ip_of(testbed, "gpu1")
    # the ephemeral ports gloo's workers listen on
    listening = sh(testbed, "gpu1", "ss -Htln | awk '{print $4}'")
    gloo = sorted(p for p in {int(a.rsplit(":", 1)[1]) for a in listening.split()} if p >= 32768)
    assert gloo, listening
    # each node's checks in one command (user mallory made first): (user, address, port) ->
    # what is expected. gloo's listeners: the service user reaches them, another local user
    # does not (on the node itself, and from the other node of the fleet)
    expect = {"gpu1": {("torchrig", store, port): "open",   # the job's own user
                       ("mallory", store, port): "closed",
                       ("root", "127.0.0.1", port): "open",
                       ("mallory", "127.0.0.1", port): "closed",
                       ("torchrig", store, gloo[0]): "open",
                       ("mallory", store, gloo[0]): "closed"},
              "gpu4": {("torchrig", store, port): "open",
                       ("mallory", store, port): "closed",
                       ("mallory", store, gloo[0]): "closed"}}
    for h, want in expect.items():
        got = sh_each(testbed, h, {"user": "id mallory >/dev/null 2>&1 || useradd --no-create-home mallory",
                                   **{k: connect_cmd(*k) for k in want}})
        assert {k: (got[k].split() or ["?"])[0] for k in want} == want, (h, got)
    # from outside the fleet: the store and gloo's ports
    for p in (port, *gloo):
        with pytest.raises(OSError):
            socket.create_connection((store, p), timeout=5).close()
    # the job still trains across both nodes
    wait_step(testbed, job, step + 10)
    got = sh_each(testbed, "gpu1", {"run": f"cat /etc/torchrig/jobs/{job}.run",
                                    "mode": f"stat -c '%a %U' /etc/torchrig/jobs/{job}.run",
                                    "runs": f"ls /var/log/torchrig/{job}/",
                                    "seen": f"ps -eo args; cat /etc/systemd/system/torchrig-{job}.service"})
    run_id = got["run"].split("PET_RDZV_ID=")[1].split()[0]
    assert len(run_id) == 32 and got["mode"] == "600 root", got["mode"]
    runs = got["runs"]
    assert f"{run_id}_" in runs and f"{job}_" not in runs, runs
    assert got["seen"] and run_id not in got["seen"]
    assert stop(testbed, job).returncode == 0
