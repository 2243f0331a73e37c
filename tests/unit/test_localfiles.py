"""The one atomic write on the operator's machine: exact mode, whole replacement, a planted
link at the temporary name's place is never followed, nothing left behind on failure."""

import os
import stat

import pytest

from torchrig.localfiles import write_atomic


def test_replaces_whole_with_the_mode_asked_whatever_the_umask(tmp_path):
    p = tmp_path / "MANIFEST.json"
    p.write_text("old, longer than the new text")
    old = os.umask(0o077)
    try:
        write_atomic(p, b"new", 0o644)
    finally:
        os.umask(old)
    assert p.read_bytes() == b"new" and stat.S_IMODE(p.stat().st_mode) == 0o644
    write_atomic(p, b"secret", 0o600)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert sorted(x.name for x in tmp_path.iterdir()) == ["MANIFEST.json"]


def test_a_link_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "out.json").symlink_to(victim)
    write_atomic(tmp_path / "out.json", b"{}", 0o600)
    assert victim.read_text() == "keep" and not (tmp_path / "out.json").is_symlink()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "plan.json"
    p.write_text("old")

    def broken(fd, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(OSError):
        write_atomic(p, b"new", 0o600)
    monkeypatch.undo()
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["plan.json"]


def test_a_link_planted_at_the_temporary_name_is_refused_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "r.html").write_text("old")
    os.symlink(victim, tmp_path / f".r.html.{os.getpid()}.tmp")
    with pytest.raises(FileExistsError):
        write_atomic(tmp_path / "r.html", b"new", 0o644)
    assert victim.read_text() == "keep" and (tmp_path / "r.html").read_text() == "old"



def test_early_flush_syncs_on_its_thread_as_the_file_grows_and_not_for_a_small_one(
        tmp_path, monkeypatch):
    import threading
    import time
    from torchrig import localfiles
    synced = []
    monkeypatch.setattr(localfiles.os, "fdatasync",
                        lambda fd: synced.append((fd, threading.current_thread())))
    fd = os.open(tmp_path / "part", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        small = localfiles.EarlyFlush(fd, every=1000)
        small.wrote(999)
        small.close()
        assert synced == [] and small._thread is None  # no thread, no flush
        flush = localfiles.EarlyFlush(fd, every=1000)
        flush.wrote(600)
        flush.wrote(600)  # past 1000: one flush on the thread
        deadline = time.monotonic() + 10
        while not synced and time.monotonic() < deadline:
            time.sleep(0.005)
        flush.wrote(600)  # 600 since: none
        flush.close()
        assert not flush._thread.is_alive()
        assert [(f, t) for f, t in synced] == [(fd, flush._thread)]
    finally:
        os.close(fd)
