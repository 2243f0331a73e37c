"""Issue 9, launch side, tried on the testbed as the attack would be: the service user (what a
job runs as) plants a symlink, a FIFO or a folder, then the operator runs launch/status, and
the test checks that nothing root-owned outside torchrig's own files changed and that the
result is a clear error or safe behaviour. Also: concurrent launches and pushes on one node
(gpu1, provisioned)."""

import copy
import shlex
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import (invoke_bg, launch, sh, status, stop, unit_state, wait_unit_ended, wait_until,
                      write_inventory)

pytestmark = pytest.mark.provisioned("gpu1")

USER = "torchrig"            # the testbed's service user (provision's default)
LOGS = "/var/log/torchrig"
CKPTS = "/srv/torchrig/checkpoints"


def as_user(inv, host, cmd, check=False):
    """`cmd` as the service user: what a job's code could do."""
    return sh(inv, host, f"runuser -u {USER} -- sh -c {shlex.quote(cmd)} 2>&1; echo rc=$?", check=check)


def owner(inv, host, path):
    return sh(inv, host, f"stat -c '%U:%G %a' {shlex.quote(path)}")


def wait_inactive(inv, job, host="gpu1", timeout=240):
    wait_unit_ended(inv, host, f"torchrig-{job}", timeout)


def test_roots_are_roots_and_a_job_cannot_swap_its_folder(testbed):
    """A job that replaces its folder by a symlink got, at the next launch, whatever the link
    named chowned to the service user (root ran `install -d -o <user>` through it)."""
    h = "gpu1"
    sh(testbed, h, "install -d -m 0755 /var/lib/h2-canary && echo keep > /var/lib/h2-canary/f")
    for root in (LOGS, CKPTS):
        assert owner(testbed, h, root) == "root:root 755"
        # the service user cannot create, rename or replace anything in the roots
        out = as_user(testbed, h, f"ln -s /var/lib/h2-canary {root}/t-evil")
        assert "rc=0" not in out, out
    r = launch(testbed, "t-evil", "--args", "--max-steps 3 --log-every 1", hosts=h)
    assert r.returncode == 0, r.stderr
    assert owner(testbed, h, "/var/lib/h2-canary") == "root:root 755"
    assert owner(testbed, h, "/var/lib/h2-canary/f") == "root:root 644"
    for root in (LOGS, CKPTS):
        assert owner(testbed, h, f"{root}/t-evil") == f"{USER}:{USER} 750"
        assert sh(testbed, h, f"test -L {root}/t-evil && echo link || echo dir") == "dir"
    # the job's own folder is the job's to use, not to swap
    wait_inactive(testbed, "t-evil", h)
    out = as_user(testbed, h, f"mv {LOGS}/t-evil {LOGS}/t-evil.old")
    assert "rc=0" not in out, out


def test_leftover_symlink_where_a_job_folder_goes_is_refused(testbed):
    h = "gpu1"
    sh(testbed, h, f"install -d -m 0755 /var/lib/h2-canary; ln -sfn /var/lib/h2-canary {LOGS}/t-left")
    try:
        r = launch(testbed, "t-left", "--args", "--max-steps 3", hosts=h)
        assert r.returncode == 1, r.stdout + r.stderr
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith("error: nothing started"), r.stderr
        assert f"{LOGS}/t-left exists and is a symlink" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert owner(testbed, h, "/var/lib/h2-canary") == "root:root 755"
        assert sh(testbed, h, "ls /etc/systemd/system | grep -c t-left || true") == "0"
    finally:
        sh(testbed, h, f"rm -f {LOGS}/t-left")


def test_sampler_and_status_never_follow_what_the_job_planted(testbed):
    """The GPU sampler ran as root appending to <log_dir>/<job>/gpu_util.csv: a symlink there
    made root create or append to any file. status opened the job's files as root: a symlink
    read root-only files, a FIFO blocked it forever."""
    h = "gpu1"
    r = launch(testbed, "t-plant", "--args", "--max-steps 3 --log-every 1", hosts=h)
    assert r.returncode == 0, r.stderr
    wait_inactive(testbed, "t-plant", h)
    d = f"{LOGS}/t-plant"
    sampler = (f"systemctl start $(ls /etc/systemd/system | grep gpumon | grep -F t-plant | "
               "grep '[.]service$')")
    # the sampler works, as the service user
    sh(testbed, h, f"rm -f {d}/gpu_util.csv; {sampler}")
    assert owner(testbed, h, f"{d}/gpu_util.csv").startswith(f"{USER}:")
    assert sh(testbed, h, f"cat {d}/gpu_util.csv").count(",") >= 1
    # a symlink in its place: root must not create /etc/h2-nologin
    as_user(testbed, h, f"rm -f {d}/gpu_util.csv; ln -s /etc/h2-nologin {d}/gpu_util.csv")
    sh(testbed, h, sampler)
    assert sh(testbed, h, "test -e /etc/h2-nologin && echo CREATED || echo absent") == "absent"
    # status: the newest attempt holds a symlink to a root-only file and a FIFO
    sh(testbed, h, "umask 077; echo 'step=424242 loss=0 root-only' > /root/h2-secret")
    as_user(testbed, h, f"mkdir -p {d}/zz_fake/attempt_9/0 {d}/zz_fake/attempt_9/1 && "
                        f"ln -s /root/h2-secret {d}/zz_fake/attempt_9/0/stdout.log && "
                        f"mkfifo {d}/zz_fake/attempt_9/1/stdout.log && "
                        f"rm -f {d}/gpu_util.csv && mkfifo {d}/gpu_util.csv")
    t0 = time.monotonic()
    r, st = status(testbed, "t-plant", hosts=h)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 40, f"status took {took:.0f}s"
    assert "424242" not in r.stdout + r.stderr
    assert st["nodes"][h]["unit"]["ActiveState"] == "inactive"


def test_a_job_that_is_still_stopping_holds_its_gpus(testbed, inventory_doc, tmp_path):
    """deactivating (up to TimeoutStopSec while it writes its last checkpoint) is busy."""
    doc = copy.deepcopy(inventory_doc)
    doc["vars"]["accelerator"] = "cuda"
    inv = write_inventory(tmp_path, doc)
    h = "gpu1"
    unit = "torchrig-t-stopping"
    sh(testbed, h, f"systemd-run --unit {unit} -p KillMode=mixed -p TimeoutStopSec=120 "
                   "/bin/sh -c 'trap \"\" TERM; sleep 600'")
    try:
        # stop only once the shell certainly ignores SIGTERM (SigIgn bit 15 of its main pid),
        # then it stays deactivating until TimeoutStopSec on any machine speed
        ignores_term = (f"pid=$(systemctl show -p MainPID --value {unit}); "
                        "echo $(( 0x$(awk '/^SigIgn:/ {print $2}' /proc/$pid/status) >> 14 & 1 ))")
        wait_until(f"{unit}'s shell to ignore SIGTERM", lambda: sh(testbed, h, ignores_term, check=False) == "1",
                   60, 0.5)
        sh(testbed, h, f"systemctl stop --no-block {unit}")
        wait_until(f"{unit} to be deactivating", lambda: unit_state(testbed, h, unit) == "deactivating",
                   60, 0.5)
        r = launch(inv, "t-after", "--args", "--max-steps 3", hosts=h)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "already runs job(s) t-stopping" in r.stderr, r.stderr
    finally:
        sh(testbed, h, "systemctl kill -s KILL torchrig-t-stopping; systemctl stop torchrig-t-after; true",
           check=False)


def test_two_launches_at_once_on_a_gpu_node(testbed, inventory_doc, tmp_path):
    """Both pass the early busy check; exactly one may start on the GPUs, the other is refused
    with a clear line (never both on the same GPUs, never a push failure)."""
    doc = copy.deepcopy(inventory_doc)
    doc["vars"]["accelerator"] = "cuda"
    inv = write_inventory(tmp_path, doc)
    procs = [invoke_bg("launch", "-i", str(inv), "-H", "gpu1", "--job", job,
                       "--args", "--max-steps 100000 --log-every 50") for job in ("t-race-a", "t-race-b")]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
        codes = sorted(p.returncode for p in procs)
        assert codes == [0, 1], outs
        err = next(e for p, (_, e) in zip(procs, outs) if p.returncode == 1)
        assert "\nerror: " in "\n" + err and "Traceback" not in err, err
        assert "already runs job(s)" in err or "another job started on this node's GPUs" in err, err
        running = sh(testbed, "gpu1", "systemctl list-units 'torchrig-t-race-*' --state=active "
                                      "--plain --no-legend | wc -l")
        assert running == "1"
    finally:
        stop(testbed, "t-race-a", hosts="gpu1")
        stop(testbed, "t-race-b", hosts="gpu1")


def test_two_launches_of_one_job_at_once(testbed):
    """Both pass the early 'already running' check; one runs the job, the other is refused
    with a clear line and leaves the running job alone."""
    procs = [invoke_bg("launch", "-i", str(testbed), "-H", "gpu1", "--job", "t-twice",
                       "--args", "--max-steps 100000 --log-every 50") for _ in range(2)]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
        assert sorted(p.returncode for p in procs) == [0, 1], outs
        err = next(e for p, (_, e) in zip(procs, outs) if p.returncode == 1)
        assert "\nerror: " in "\n" + err and "Traceback" not in err, err
        assert ("meanwhile" in err or "already running" in err), err
        assert sh(testbed, "gpu1", "systemctl show -p ActiveState --value torchrig-t-twice") == "active"
    finally:
        stop(testbed, "t-twice", hosts="gpu1")


def _payload(tmp_path, tag):
    p = tmp_path / f"payload-{tag}"
    (p / "pkg").mkdir(parents=True, exist_ok=True)
    (p / "train.py").write_text(f"print({tag!r})\n")
    for i in range(20):
        (p / "pkg" / f"m{i}.py").write_text(f"X = {i}  # {tag}\n")
    return p


def test_concurrent_pushes_to_one_node_all_succeed(testbed, tmp_path):
    """Today 11 in 20 concurrent pushes failed (`mv: cannot move ... Directory not empty`)."""
    from torchrig.inventory import load
    from torchrig.launch.push import push
    from torchrig.launch.tree import payload_tree
    from torchrig.session import Fleet
    inv = load(testbed)
    h = inv.select("gpu1")[0]

    def one_launch(payload):  # a session, so a connection, of its own: six launches at once
        with Fleet(inv) as fleet:
            return push(fleet.conn(h), payload_tree(payload), "/opt/torchrig/payload")

    for rnd in range(3):
        payload = _payload(tmp_path, f"race{rnd}")
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda _: one_launch(payload), range(6)))
        releases = {rel for rel, _ in got}
        assert len(releases) == 1
        rel = releases.pop()
        assert sh(testbed, "gpu1", f"cat {rel}/train.py; test -f {rel}/.complete && echo complete") \
            == f"print('race{rnd}')\ncomplete"
        assert sh(testbed, "gpu1", "readlink /opt/torchrig/payload/current") == "releases/" + rel.rsplit("/", 1)[1]
        assert sh(testbed, "gpu1", "ls -a /opt/torchrig/payload/releases | grep -c incoming || true") == "0"


def test_a_release_about_to_be_used_is_not_swept(testbed, tmp_path):
    """A launch that finds its release already on the node (pushed long ago) writes its unit a
    moment later: a push by another launch meanwhile must not delete that release."""
    from torchrig.inventory import load
    from torchrig.launch.push import push as push_payload
    from torchrig.launch.tree import payload_tree
    from torchrig.session import Fleet
    inv = load(testbed)
    h = inv.select("gpu1")[0]
    fleet = Fleet(inv)
    push = lambda tag: push_payload(fleet.conn(h), payload_tree(_payload(tmp_path, tag)), "/opt/torchrig/payload")  # noqa: E731
    first, _ = push("old")
    older = [push(f"mid{i}")[0] for i in range(4)]
    sh(testbed, "gpu1", f"touch -d '3 hours ago' /opt/torchrig/payload/releases/*; touch -d '4 hours ago' {first}")
    assert push("old") == (first, 0)       # found on the node: nothing sent
    push("new")                            # another launch's push sweeps old releases
    assert sh(testbed, "gpu1", f"test -f {first}/.complete && echo kept || echo deleted") == "kept"
    # the sweep still works: unreferenced releases beyond the 5 newest, not used for hours
    push("newer")
    gone = [r for r in older if sh(testbed, "gpu1", f"test -e {r} && echo kept || echo gone") == "gone"]
    assert gone, "nothing was swept"
    # every release a unit points at is still there
    # (the payload's releases, and user projects' under workdirs/ that earlier tests launched)
    refs = sh(testbed, "gpu1", "grep -ho '/opt/torchrig/[a-z]*/releases/[0-9a-f]*' /etc/systemd/system/torchrig-*.service 2>/dev/null | sort -u || true")
    for ref in refs.split():
        assert sh(testbed, "gpu1", f"test -f {ref}/.complete && echo ok") == "ok"
