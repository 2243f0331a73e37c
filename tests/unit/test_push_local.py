"""The payload push's scripts run for real on this machine (a `connection: local` node) with a
payload of 1,500 files: their manifest and, on the next push, their removal list travel on
stdin (in argv they overflowed one argument: "Argument list too long")."""

import json
import os
from pathlib import Path

import pytest

from torchrig.launch.push import push
from torchrig.launch.tree import payload_tree
from torchrig.connections import LocalConnection

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the push scripts chown to root")


def _payload(d: Path, n: int, tag: str) -> Path:
    sub = d / ("a-rather-long-folder-name-for-the-data-loaders-of-this-experiment-" + tag)
    sub.mkdir(parents=True)
    for i in range(n):
        (sub / f"module_with_a_long_descriptive_name_number_{i:05d}.py").write_text(f"x = {i}\n")
    (d / "train.py").write_text(f"print({tag!r})\n")
    return d


def test_push_of_1500_files_then_their_removal(tmp_path):
    prefix = tmp_path / "prefix"
    prefix.mkdir(mode=0o755)
    cxn = LocalConnection(None)
    big = _payload(tmp_path / "big", 1500, "one")
    rel, sent = push(cxn, payload_tree(big), f"{prefix}/payload")
    assert sent == 1501 and Path(rel, "train.py").read_text() == "print('one')\n"
    on_node = {k: v for k, v in payload_tree(Path(rel)).manifest().items() if k not in (".complete", ".manifest.json")}
    assert on_node == payload_tree(big).manifest() == json.loads(Path(rel, ".manifest.json").read_text())
    small = tmp_path / "small"
    small.mkdir()
    (small / "train.py").write_text("print('two')\n")
    rel2, sent2 = push(cxn, payload_tree(small), f"{prefix}/payload")
    assert sent2 == 1 and rel2 != rel
    left = sorted(p.relative_to(rel2).as_posix() for p in Path(rel2).rglob("*") if p.is_file())
    assert left == [".complete", ".manifest.json", "train.py"]
    assert os.readlink(prefix / "payload" / "current") == "releases/" + Path(rel2).name


def test_a_lock_held_on_the_payload_folder_does_not_block_a_push(tmp_path):
    """The payload folder is 0755: any local user or job can open it and flock it. The push
    used to lock the folder itself, so that held off every launch for 300 s, then failed it.
    Its lock is now a 0600 root file nobody else can open."""
    import fcntl
    import stat
    import threading
    prefix = tmp_path / "prefix"
    (prefix / "payload").mkdir(parents=True)
    fd = os.open(prefix / "payload", os.O_RDONLY | os.O_DIRECTORY)  # what `flock DIR sleep` does
    fcntl.flock(fd, fcntl.LOCK_EX)
    small = tmp_path / "small"
    small.mkdir()
    (small / "train.py").write_text("print('x')\n")
    done = []
    t = threading.Thread(target=lambda: done.append(push(LocalConnection(None), payload_tree(small), f"{prefix}/payload")),
                         daemon=True)
    try:
        t.start()
        t.join(30)
        assert done, "the push waited for a lock another user held on the payload folder"
    finally:
        os.close(fd)
        t.join(60)
    lock = prefix / "payload" / ".lock"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600 and lock.stat().st_uid == 0


def test_a_lock_held_on_the_jobs_folder_does_not_block_a_launch(tmp_path):
    """The same for launch's install/start/undo lock: /etc/torchrig/jobs is 0755."""
    import fcntl
    import stat
    import subprocess
    from torchrig.onhost import script
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    fd = os.open(jobs, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        lock = script("launch/lock.sh", jobs=str(jobs))
        r = subprocess.run(["bash", "-c", "set -eu\n" + lock + "echo locked"],
                           capture_output=True, text=True, timeout=30)
    finally:
        os.close(fd)
    assert r.stdout == "locked\n", r.stderr
    assert stat.S_IMODE((jobs / ".lock").stat().st_mode) == 0o600
