"""The root-run follower against what a job can plant in its own log folder (symlinks, FIFOs,
hard links, linked folders, odd names), resume across a file replaced while the operator was
away, and rank text made safe for a terminal. onhost/logs/follow.py runs for real, as in
test_logs_follow.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_logs_follow import L, REL0, RUN, append, args, rank_dir, run_once

from torchrig.logs.merge import ErrorReport, Line, Skipped, Tracker, Truncated, prefix
from torchrig.terminal import printable
from torchrig.logs.stream import Printer, failure_report

SECRET = "root:$y$SECRET-HASH-7f3a:19000:0:99999:7:::"


def secret_file(tmp_path: Path) -> Path:
    """Stands for /etc/shadow: a root-only file outside the log folder."""
    s = tmp_path / "shadow"
    s.write_text(SECRET + "\n")
    s.chmod(0o600)
    return s


def tree(root: Path) -> dict:
    """Every entry under root (links not followed) with its type and mtime."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(dirpath, n))
            out[os.path.relpath(os.path.join(dirpath, n), root)] = (st.st_mode, st.st_mtime_ns)
    return out


def test_planted_links_fifos_and_hard_links_are_refused_not_read(tmp_path):
    shadow = secret_file(tmp_path)
    logs = tmp_path / "logs"
    good = rank_dir(logs, local=0)
    append(good / "stdout.log", "start rank=0 local_rank=0 host=h\nfine\n")
    # local rank 1: stdout.log is a symlink to the secret, stderr.log a FIFO (open() would block)
    r1 = rank_dir(logs, local=1)
    (r1 / "stdout.log").symlink_to(shadow)
    os.mkfifo(r1 / "stderr.log")
    # local rank 2: a hard link to the secret (same file system)
    r2 = rank_dir(logs, local=2)
    os.link(shadow, r2 / "stdout.log")
    # local rank 3: the rank folder itself is a link to a folder holding a stdout.log
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "stdout.log").write_text(SECRET + "\n")
    (logs / RUN / "attempt_0" / "3").symlink_to(elsewhere, target_is_directory=True)
    # a whole run folder and an attempt folder linked elsewhere too
    (logs / "job-1_linked").symlink_to(logs / RUN, target_is_directory=True)
    (logs / RUN / "attempt_7").symlink_to(elsewhere, target_is_directory=True)
    # names torchrun never writes, which would break the record framing or a terminal
    rank_dir(logs, run="x\tL\tfake", local=0)
    rank_dir(logs, run="x\x1b]0;owned\x07", local=0)
    rank_dir(logs, attempt=0, local=0)
    (logs / RUN / "attempt_0" / "\u00b2").mkdir()  # isdigit() but not int()
    before = tree(logs)

    p = subprocess.run([sys.executable, "-"], input=args(logs), capture_output=True, timeout=20)
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode()
    assert "SECRET-HASH" not in out and "owned" not in out and "fake" not in out
    recs = out.split("\n")[:-1]
    assert [t for _, _, t in L(recs)] == ["start rank=0 local_rank=0 host=h", "fine"]
    warned = {r.split("\t")[1]: r.split("\t")[2] for r in recs if r.startswith("W\t")}
    assert warned == {
        f"{RUN}/attempt_0/1/stdout.log": "a symbolic link, not read",
        f"{RUN}/attempt_0/1/stderr.log": "a FIFO, not read",
        f"{RUN}/attempt_0/2/stdout.log": "a file with 2 hard links, not read",
        f"{RUN}/attempt_0/3": "a symbolic link, not followed",
        f"{RUN}/attempt_7": "a symbolic link, not followed",
        "job-1_linked": "a symbolic link, not followed",
    }
    assert tree(logs) == before  # nothing written, created or removed in the job's folder

    # what the operator sees: one notice per refused name, the good rank's lines
    tr, shown, notes = Tracker(), io.StringIO(), io.StringIO()
    pr = Printer(shown, color=False, err=notes)
    for r in recs:
        for ev in tr.feed("gpu1", r):
            if isinstance(ev, Line):
                pr.line(ev)
            elif isinstance(ev, Skipped):
                pr.notice(f"{ev.node}: {ev.relpath}: {ev.reason}")
    assert shown.getvalue() == "[gpu1/r0] start rank=0 local_rank=0 host=h\n[gpu1/r0] fine\n"
    assert "gpu1: job-1_abc123/attempt_0/1/stderr.log: a FIFO, not read" in notes.getvalue()


def test_fifo_in_follow_mode_and_linked_log_folder(tmp_path):
    logs = tmp_path / "logs"
    d = rank_dir(logs)
    os.mkfifo(d / "stdout.log")
    append(d / "stderr.log", "warn\n")
    # follow mode: the FIFO is told once, the other file still streams, idle_exit ends it
    p = subprocess.run([sys.executable, "-"], input=args(logs, follow=True, idle_exit=1.0),
                       capture_output=True, timeout=20)
    recs = [r for r in p.stdout.decode().split("\n")[:-1] if r[0] in "WL"]
    assert recs == [f"W\t{REL0}\ta FIFO, not read", f"L\t{RUN}/attempt_0/0/stderr.log\t5\twarn"]
    # the job's folder itself replaced by a link (its parent owned by the job): not followed
    link = tmp_path / "job-link"
    link.symlink_to(logs, target_is_directory=True)
    assert run_once(link) == ["W\t.\ta symbolic link, not followed"]


def test_file_replaced_while_away_is_read_from_its_start(tmp_path):
    d = rank_dir(tmp_path)
    f = d / "stdout.log"
    append(f, "start rank=3 local_rank=0 host=gpu2 pid=100\n" + "".join(f"step={i}\n" for i in range(5)))
    tr = Tracker()
    ev = [e for r in run_once(tmp_path, ident=True) for e in tr.feed("gpu2", r)]
    assert prefix(ev[-1]) == "[gpu2/r3]"
    offs = tr.offsets_for("gpu2")
    assert offs[REL0][0] == f.stat().st_size and offs[REL0][1]

    # torchrun removes the folder and the new worker refills it (longer than the old offset)
    # while the operator is disconnected
    f.unlink()
    append(f, "start rank=5 local_rank=0 host=gpu2 pid=200\n" + "".join(f"again={i}\n" for i in range(9)))
    again = run_once(tmp_path, offsets=offs, ident=True)
    ev = [e for r in again for e in tr.feed("gpu2", r)]
    assert ev[0] == Truncated("gpu2", REL0, lines=6)
    lines = [e for e in ev if isinstance(e, Line)]
    assert [l.text for l in lines] == ["start rank=5 local_rank=0 host=gpu2 pid=200"] + [
        f"again={i}" for i in range(9)]
    assert {prefix(l) for l in lines} == {"[gpu2/r5]"}  # the rank learned again

    # the same inode rewritten in place (truncated, then refilled past the old offset)
    offs = tr.offsets_for("gpu2")
    with open(f, "r+b") as fh:
        fh.truncate(0)
        fh.write(b"start rank=6 local_rank=0 host=gpu2 pid=300\n" + b"x" * 300 + b"\n")
    ev = [e for r in run_once(tmp_path, offsets=offs, ident=True) for e in tr.feed("gpu2", r)]
    assert isinstance(ev[0], Truncated)
    assert [prefix(e) + " " + e.text[:12] for e in ev if isinstance(e, Line)] == [
        "[gpu2/r6] start rank=6", "[gpu2/r6] " + "x" * 12]

    # the same file grown meanwhile: resumed where it was, nothing again
    offs = tr.offsets_for("gpu2")
    append(f, "more\n")
    recs = run_once(tmp_path, offsets=offs, ident=True)
    assert [r for r in recs if r[0] in "LT"] == [f"L\t{REL0}\t{f.stat().st_size}\tmore"]


def test_error_json_replaced_with_same_size_while_away_is_reported_again(tmp_path):
    d = rank_dir(tmp_path)
    (d / "error.json").write_text(json.dumps({"message": "first failure AAAA"}))
    tr = Tracker()
    ev = [e for r in run_once(tmp_path, ident=True) for e in tr.feed("n", r)]
    assert [e.message for e in ev if isinstance(e, ErrorReport)] == ["first failure AAAA"]
    (d / "error.json").unlink()
    (d / "error.json").write_text(json.dumps({"message": "other failure BB"}))  # same size
    ev = [e for r in run_once(tmp_path, offsets=tr.offsets_for("n"), ident=True)
          for e in tr.feed("n", r)]
    assert [e.message for e in ev if isinstance(e, ErrorReport)] == ["other failure BB"]


def test_printable_neutralises_terminal_controls_keeps_tabs():
    attack = "a\tb\x1b]0;owned\x07\x1b[2J\x1b[1A\r\x08\x7f\x9b31m\u00e9\u2713"
    got = printable(attack)
    assert got == ("a\tb\\x1b]0;owned\\x07\\x1b[2J\\x1b[1A\\x0d\\x08\\x7f\\x9b31m\u00e9\u2713")
    assert printable("one\ntwo") == "one\\x0atwo"
    assert printable("one\ntwo\x1b", newlines=True) == "one\ntwo\\x1b"


def test_printer_and_failure_report_never_pass_escapes(tmp_path):
    d = rank_dir(tmp_path)
    append(d / "stdout.log", "start rank=0 local_rank=0 host=h\n\x1b]0;pwned\x07title\tcol\n"
                             "\x1b[2K\x1b[1Aerased\n")
    (d / "error.json").write_text(json.dumps({"message": "boom\x1b[31m", "extraInfo": {
        "py_callstack": "Traceback\n  \x1b]52;c;Y29weQ==\x07clip\n", "timestamp": "1700000000"}}))
    tr, out, err = Tracker(), io.StringIO(), io.StringIO()
    pr = Printer(out, color=True, err=err)
    reports = []
    for r in run_once(tmp_path, ident=True):
        for ev in tr.feed("h", r):
            if isinstance(ev, Line):
                pr.line(ev)
            elif isinstance(ev, ErrorReport):
                reports.append(ev)
    pr.notice("h: folder \x1b[2J")
    text = out.getvalue()
    # the only escapes left are the printer's own colour codes around the prefix
    assert text.replace("\x1b[36m", "").replace("\x1b[0m", "").count("\x1b") == 0
    assert "\\x1b]0;pwned\\x07title\tcol\n" in text and "\\x1b[2K\\x1b[1Aerased\n" in text
    assert "\x1b" not in err.getvalue()
    rep = failure_report(reports)
    assert "\x1b" not in rep and "\x07" not in rep
    assert "boom\\x1b[31m" in rep and "\n  \\x1b]52;c;Y29weQ==\\x07clip" in rep


def test_file_refilled_on_the_same_inode_between_two_scans(tmp_path):
    """In follow mode too: rewritten in place, longer, before the next scan sees it shrink."""
    from test_logs_follow import finish, read_until, start
    f = rank_dir(tmp_path) / "stdout.log"
    append(f, "start rank=1 local_rank=0 host=h\nold\n")
    p = start(tmp_path, follow=True, idle_exit=2.0, poll=1.0)
    got: list[str] = []
    read_until(p, lambda r: r.endswith("\told"), got)
    with open(f, "r+b") as fh:  # one write: a scan never sees the file shorter
        fh.write(b"start rank=4 local_rank=0 host=h\nnew content, and longer than before\n")
    finish(p, got)
    tr = Tracker()
    shown = [prefix(e) + " " + e.text for r in got for e in tr.feed("h", r) if isinstance(e, Line)]
    assert shown == ["[h/r1] start rank=1 local_rank=0 host=h", "[h/r1] old",
                     "[h/r4] start rank=4 local_rank=0 host=h",
                     "[h/r4] new content, and longer than before"]


def test_the_jobs_own_files_beside_the_runs_are_not_warned_about(tmp_path):
    """gpumon's gpu_util.csv / gpu_mem.csv sit in the job's log folder beside torchrun's run
    folders, and their names look like a run's: `logs` warned on every call that they were
    "not a regular file" (they are). A regular file where a folder is looked for is skipped
    without a word; a planted link in its place is still refused."""
    logs = tmp_path / "logs"
    append(rank_dir(logs) / "stdout.log", "start rank=0 local_rank=0 host=h\n")
    for name in ("gpu_util.csv", "gpu_mem.csv"):
        (logs / name).write_text("1700000000,0,35\n")
    (logs / "job-1_planted").symlink_to(tmp_path, target_is_directory=True)
    recs = run_once(logs)
    assert [t for _, _, t in L(recs)] == ["start rank=0 local_rank=0 host=h"]
    assert [r for r in recs if r.startswith("W\t")] == [
        "W\tjob-1_planted\ta symbolic link, not followed"]


def test_a_refusal_says_why_when_the_files_type_does_not(tmp_path, monkeypatch):
    """A regular file that could not be opened for another reason (here: too many open files)
    is not called "not a regular file": the system's reason is given."""
    import errno
    import importlib.util
    from torchrig.onhost import HERE
    spec = importlib.util.spec_from_file_location("follow", HERE / "logs" / "follow.py")
    fr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fr)
    (tmp_path / "stdout.log").write_text("x\n")
    real = os.open

    def failing(name, flags, *a, **kw):
        if name == "stdout.log":
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(name, flags, *a, **kw)
    monkeypatch.setattr(fr.os, "open", failing)
    dfd = real(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(fr.Refused) as e:
            fr.open_file("stdout.log", dfd)
    finally:
        os.close(dfd)
    assert str(e.value) == "a regular file that cannot be opened (Too many open files), not read"
