"""fetch end to end on a `connection: local` host (the node script really runs, through
runuser, with the real torch load check): the job's user here is root, so the O_NOFOLLOW and
regular-file checks alone must keep a planted symlink to a root-only file out; a corrupt newest
checkpoint is refused; a partial file from an earlier run is resumed, and a wrong one caught
by the hash. The testbed test (tests/integration/test_fetch.py) adds a real SSH drop."""

import getpass
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrig import inventory
from torchrig.errors import TorchrigError
from torchrig.fetch import plan
from torchrig.fetch.run import FetchOptions, fetch
from torchrig.session import Fleet

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the node side runs through runuser")
SECRET = b"root:SECRET-HASH-7f3a:19000:0:99999:7:::\n"


@pytest.fixture(scope="module")
def prefix():
    """The node's prefix: a venv any uid can run, as a node's /opt/torchrig/venv is (fetch's
    load check runs as a uid no account has). This machine's own Python may live under /root
    (0700), so the venv is Debian's python3 of the same minor version reading this one's
    packages (torch) through a .pth file, in a folder every uid can traverse."""
    import shutil
    import sysconfig
    import tempfile
    base = Path(tempfile.mkdtemp(prefix="torchrig-test-prefix-"))
    os.chmod(base, 0o755)
    py = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([py, "-m", "venv", "--without-pip", str(base / "venv")], check=True)
    site = base / f"venv/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = subprocess.run(["setpriv", "--reuid=1610612736", "--regid=1610612736", "--clear-groups",
                            str(base / "venv/bin/python"), "-I", "-c", "import torch"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, ("a uid with no account cannot import torch from this venv "
                                   f"(its folders must be world-readable): {probe.stderr[-300:]}")
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def node(tmp_path, prefix):
    """A local 'node': a venv any uid can run (prefix), a job folder with checkpoints 10, 20,
    a corrupt 30, and a symlink (40, to a root-only file) and a FIFO (50) planted by the job."""
    job = tmp_path / "ckpt/j1"
    job.mkdir(parents=True)
    for step in (10, 20, 30):
        torch.save({"model": {"w": torch.full((64, 64), float(step))}, "step": step},
                   job / f"ckpt_{step:08d}.pt")
    good = (job / "ckpt_00000030.pt").read_bytes()
    (job / "ckpt_00000030.pt").write_bytes(good[: len(good) // 2])  # torn write
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    (job / "ckpt_00000040.pt").symlink_to(secret)
    os.mkfifo(job / "ckpt_00000050.pt")
    inv_file = tmp_path / "inv.yml"
    inv_file.write_text(json.dumps({"hosts": [{"name": "n1", "connection": "local", "vars": {
        "prefix": str(prefix), "checkpoint_dir": str(tmp_path / "ckpt"),
        "log_dir": str(tmp_path / "log"), "data_dir": str(tmp_path / "data"),
        "service_user": getpass.getuser()}}]}))
    return inventory.load(inv_file), job, tmp_path / "out"


def run(inv, to, **kw):
    log = []
    with Fleet(inv) as fleet:
        res = fetch(fleet, FetchOptions(job="j1", to=to, **kw), log=log.append)
    return res, log


def leaked(folder) -> bool:
    return any(SECRET in p.read_bytes() for p in folder.rglob("*") if p.is_file())


def test_refuses_planted_and_corrupt_checkpoints_and_takes_the_previous(node):
    inv, job, out = node
    res, log = run(inv, out)
    assert [f.name for f in res.files] == ["ckpt_00000020.pt"] and res.host == "n1"
    assert (out / "ckpt_00000020.pt").read_bytes() == (job / "ckpt_00000020.pt").read_bytes()
    why = {r["name"]: r["why"] for r in res.refused}
    assert why["ckpt_00000040.pt"] == "a symlink (not followed)"
    assert why["ckpt_00000050.pt"].startswith("not a regular file")
    assert why["ckpt_00000030.pt"]  # torch's own words (a torn zip)
    assert "n1: taking ckpt_00000020.pt, the newest checkpoint that loads" in log
    manifest = json.loads((out / "MANIFEST.json").read_text())
    [entry] = manifest["files"]
    assert manifest["job"] == entry["job"] == "j1" and entry["step"] == 20 and entry["node"] == "n1"
    assert entry["sha256"] == res.files[0].sha256 and entry["size"] == res.files[0].size
    assert not leaked(out)
    with pytest.raises(TorchrigError, match="ckpt_00000040.pt is a symlink"):
        run(inv, out, step=40)
    with pytest.raises(TorchrigError, match="--to .*/ckpt_00000020.pt/x: cannot make that folder"):
        run(inv, out / "ckpt_00000020.pt/x", all=True)   # a file where a folder must be
    res, _ = run(inv, out / "all", all=True)  # --all: every regular file, nothing planted
    assert [f.name for f in res.files] == ["ckpt_00000010.pt", "ckpt_00000020.pt", "ckpt_00000030.pt"]
    assert {e["name"] for e in res.left_out} == {"ckpt_00000040.pt", "ckpt_00000050.pt"}
    assert not leaked(out) and not (out / "all/ckpt_00000040.pt").exists()


def all_part(out, job, name):
    """--all's partial file: keyed by the listed size and mtime (no hash before the bytes)."""
    st = (job / name).stat()
    return out / plan.part_name(name, plan.partial_key(st.st_size, st.st_mtime))


def test_second_fetch_transfers_nothing_and_a_partial_file_is_resumed_or_caught(node):
    inv, job, out = node  # --all: no load check, so no torch import on the node side
    run(inv, out, all=True)
    manifest = (out / "MANIFEST.json").read_bytes()
    again, _ = run(inv, out, all=True)
    assert [(f.already, f.transferred) for f in again.files] == [(True, 0)] * 3
    assert (out / "MANIFEST.json").read_bytes() == manifest
    data = (job / "ckpt_00000010.pt").read_bytes()
    part = all_part(out, job, "ckpt_00000010.pt")
    (out / "ckpt_00000010.pt").unlink()
    part.write_bytes(data[:1000])   # an interrupted earlier fetch
    res, _ = run(inv, out, all=True)
    assert res.files[0].transferred == len(data) - 1000 and not part.exists()
    assert (out / "ckpt_00000010.pt").read_bytes() == data
    (out / "ckpt_00000010.pt").unlink()
    part.write_bytes(b"x" * 1000)   # not a prefix of the file: the hash says so
    with pytest.raises(TorchrigError, match="SHA-256 of the received bytes"):
        run(inv, out, all=True)
    assert not part.exists() and not (out / "ckpt_00000010.pt").exists()


def test_two_fetches_never_write_one_partial_file(node):
    import fcntl
    inv, job, out = node
    run(inv, out / "x", all=True)
    (out / "x/ckpt_00000010.pt").unlink()
    part = all_part(out / "x", job, "ckpt_00000010.pt")
    with open(part, "wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)   # a fetch in progress
        with pytest.raises(TorchrigError, match="another fetch is writing"):
            run(inv, out / "x", all=True)


def _our_fetch_reader() -> int | None:
    """The pid of this test's own node-side reader (a descendant of this process)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    for pid in parent:
        p = pid
        while p in parent and p != os.getpid():
            p = parent[p]
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if p == os.getpid() and b"python" in argv[0] and argv[-3:-1] == [b"torchrig-fetch", b"read"]:
                return pid  # the python reading the file, not runuser above it
        except OSError:
            pass
    return None


def test_a_transfer_whose_reader_dies_resumes_from_the_bytes_received(node):
    import threading
    import time
    inv, job, out = node
    data = os.urandom(300_000)
    (job / "data.bin").write_bytes(data)
    killed = []

    def kill_mid_way():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not killed:
            parts = list(out.glob(".data.bin.*.part"))
            if parts and parts[0].stat().st_size > 60_000 and (pid := _our_fetch_reader()):
                os.kill(pid, 9)
                killed.append(parts[0].stat().st_size)
            time.sleep(0.05)

    t = threading.Thread(target=kill_mid_way)
    t.start()
    res, log = run(inv, out, all=True, bwlimit=150_000)
    t.join()
    [f] = [f for f in res.files if f.name == "data.bin"]
    assert killed and len(f.resumed_at) == 1 and killed[0] <= f.resumed_at[0] < len(data), (killed, f)
    assert f.transferred == len(data) and (out / "data.bin").read_bytes() == data
    assert any("data.bin: transfer dropped at byte" in m for m in log), log


def raw_pickle(marker, size) -> bytes:
    """A pickle that runs `touch marker` when loaded without weights_only, padded to `size`."""
    import pickle

    class Boom:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    data = pickle.dumps(Boom(), protocol=2)
    return data + b"\0" * (size - len(data))


def test_a_checkpoint_rewritten_in_place_after_the_hash_is_never_sent_as_checked(node, tmp_path):
    """The job's user swaps a raw pickle for a good checkpoint while fetch looks at it (same
    inode, size and mtime) and back: what arrives is exactly what was load-checked."""
    import hashlib
    import subprocess
    import time
    inv, job, out = node
    good = job / "ckpt_00000020.pt"
    target, marker = job / "ckpt_00000060.pt", tmp_path / "pwned"
    target.write_bytes(raw_pickle(marker, good.stat().st_size))
    bad = target.read_bytes()
    attacker = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "..",
                                                              "swap_attack.py"),
                                 str(target), str(good), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout.readline() == "watching\n"
        res, log = run(inv, out)
        deadline = time.monotonic() + 10
        while attacker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        attacker.kill()
    did = attacker.stdout.read()
    assert "rewrote with the good checkpoint" in did, did   # the attack happened
    why = {r["name"]: r["why"] for r in res.refused}
    assert "Weights only load failed" in why.get("ckpt_00000060.pt", ""), why
    manifest = {e["name"]: e for e in json.loads((out / "MANIFEST.json").read_text())["files"]}
    assert [f.name for f in res.files] == list(manifest) == ["ckpt_00000020.pt"]
    for f in res.files:
        data = (out / f.name).read_bytes()
        assert data != bad
        torch.load(out / f.name, weights_only=True)
        c = manifest[f.name]["checked"]
        assert c["sha256"] == hashlib.sha256(data).hexdigest() == f.sha256
        assert c["load_check"] == "ok" and "snapshot" in c["how"], c
    assert not marker.exists()
    assert not list((tmp_path / "ckpt").glob(".torchrig-fetch-*"))  # the snapshot is gone


def test_a_byte_corrupted_mid_stream_is_refused_at_the_end(node, monkeypatch):
    """--all hashes while the bytes flow: a flipped byte on the way is caught by the node's
    hash that comes after the last byte, and nothing is left in place as complete."""
    from torchrig.connections import LocalConnection
    inv, job, out = node
    real, seen = LocalConnection.stream, [0]

    def corrupting(self, command, data, on_out, on_err, **kw):
        def out_(chunk):
            if seen[0] <= 500 < seen[0] + len(chunk):  # byte 500 of the first file
                i = 500 - seen[0]
                chunk = chunk[:i] + bytes([chunk[i] ^ 1]) + chunk[i + 1:]
            seen[0] += len(chunk)
            on_out(chunk)
        return real(self, command, data, out_, on_err, **kw)

    monkeypatch.setattr(LocalConnection, "stream", corrupting)
    with pytest.raises(TorchrigError, match="SHA-256 of the received bytes"):
        run(inv, out, all=True)
    assert not (out / "ckpt_00000010.pt").exists()
    assert not all_part(out, job, "ckpt_00000010.pt").exists()


def test_a_partial_file_of_another_version_is_not_appended_to(node):
    """--all keys its partial file by the listed size and mtime: a rewritten file starts over."""
    inv, job, out = node
    run(inv, out, all=True)
    (out / "ckpt_00000010.pt").unlink()
    part = all_part(out, job, "ckpt_00000010.pt")
    part.write_bytes((job / "ckpt_00000010.pt").read_bytes()[:1000])
    st = (job / "ckpt_00000010.pt").stat()
    os.utime(job / "ckpt_00000010.pt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    res, _ = run(inv, out, all=True)  # a new mtime: a new partial file, not appended to
    assert res.files[0].transferred == st.st_size and part.exists()


def test_bytes_over_ssh_and_back_to_paramiko_when_ssh_cannot_connect(node, monkeypatch, tmp_path):
    """The carrier as an SSH host gets it (openssh.carrier), `ssh` a stand-in on PATH: first a
    local bash (the bytes come through it, hashed and checked), then one that cannot connect
    (exit 255, nothing sent): the file still arrives, over the connection's own stream."""
    from torchrig import openssh
    inv, job, out = node
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    ssh = bin_ / "ssh"
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    target = openssh.Target("n1", 22, "root", (), "ssh-ed25519", "K")
    monkeypatch.setattr(openssh, "carrier", lambda cxn: (openssh.Carrier(target), None))
    ssh.write_text(f'#!/bin/bash\necho x >> {tmp_path}/calls\nexec bash -c "${{@: -1}}"\n')
    ssh.chmod(0o755)
    res, log = run(inv, out / "a", all=True)
    assert [f.name for f in res.files] == ["ckpt_00000010.pt", "ckpt_00000020.pt", "ckpt_00000030.pt"]
    assert (tmp_path / "calls").read_text().count("x") == 3
    assert not [m for m in log if "paramiko" in m or "ssh" in m], log
    assert (out / "a/ckpt_00000020.pt").read_bytes() == (job / "ckpt_00000020.pt").read_bytes()
    ssh.write_text("#!/bin/bash\necho 'Host key verification failed.' >&2\nexit 255\n")
    res, log = run(inv, out / "b", all=True)
    assert [f.transferred for f in res.files] == [f.size for f in res.files]
    assert (out / "b/ckpt_00000020.pt").read_bytes() == (job / "ckpt_00000020.pt").read_bytes()
    assert [m for m in log if "ssh" in m] == [f"n1: {f.name}: ssh could not connect (Host key verification failed.); "
                   "carried over paramiko instead" for f in res.files], log
