"""onhost/logs/follow.py run for real (`python -`, arguments and script on stdin, as over SSH)
against a temp dir laid out like torchrun's --log-dir; its records fed through merge.Tracker."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path


from torchrig.logs.merge import ErrorReport, Line, Tracker, Truncated, prefix
from torchrig.logs.stream import follower_input

RUN = "job-1_abc123"


def rank_dir(root: Path, run: str = RUN, attempt: int = 0, local: int = 0) -> Path:
    d = root / run / f"attempt_{attempt}" / str(local)
    d.mkdir(parents=True, exist_ok=True)
    return d


def append(path: Path, data: str | bytes) -> None:
    with open(path, "ab") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def args(root: Path, **kw) -> bytes:
    a = {"dir": str(root), "offsets": {}, "follow": False, "unit": None, "poll": 0.05,
         "idle_exit": None}
    a.update(kw)
    return follower_input(a).encode()


def run_once(root: Path, env=None, ident=False, **kw) -> list[str]:
    """The records of one pass (I records left out unless `ident`)."""
    p = subprocess.run([sys.executable, "-"], input=args(root, **kw),
                       capture_output=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr.decode()
    assert b"\r" not in p.stdout
    recs = p.stdout.decode("utf-8").split("\n")[:-1] if p.stdout else []
    return recs if ident else [r for r in recs if not r.startswith("I\t")]


def start(root: Path, env=None, **kw) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdin.write(args(root, **kw))
    p.stdin.close()
    p.stdin = None  # so communicate() does not touch it again
    return p


def read_until(p: subprocess.Popen, pred, got: list[str], timeout: float = 20) -> None:
    """Read records into `got` until pred(record) holds (readline blocks: guarded by a timer)."""
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        while True:
            raw = p.stdout.readline()
            assert raw, f"follower ended before the expected record; got {got}"
            rec = raw.decode()[:-1]
            got.append(rec)
            if pred(rec):
                return
    finally:
        timer.cancel()


def finish(p: subprocess.Popen, got: list[str], timeout: float = 30) -> None:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err.decode()
    got.extend(out.decode().split("\n")[:-1])


def L(recs, rel=None):
    """(relpath, offset, text) of the L records, optionally for one file."""
    out = []
    for r in recs:
        if r.startswith("L\t"):
            _, rp, off, text = r.split("\t", 3)
            if rel is None or rp == rel:
                out.append((rp, int(off), text))
    return out


def rebuild(lines) -> bytes:
    """File bytes from (rel, offset, text) records, using the offsets: each record covers
    [previous offset, offset): its text plus "\\n" or "\\r\\n", or nothing (a split piece).
    Fails if the offsets do not add up exactly."""
    data, prev = [], 0
    for _, off, text in lines:
        b = text.replace("\\r", "\r").encode()  # undo the CR escape (none of these logs has "\\r")
        tail = {0: b"", 1: b"\n", 2: b"\r\n"}[off - prev - len(b)]
        data += [b, tail]
        prev = off
    return b"".join(data)


REL0 = f"{RUN}/attempt_0/0/stdout.log"


def test_complete_partial_crlf_and_tabs(tmp_path):
    d = rank_dir(tmp_path)
    append(d / "stdout.log", "a\nb\tc\nwin\r\nbar 1\rbar 2\n\nünï\npart")
    recs = run_once(tmp_path)
    assert L(recs) == [(REL0, 2, "a"), (REL0, 6, "b\tc"), (REL0, 11, "win"),
                       (REL0, 23, "bar 1\\rbar 2"), (REL0, 24, ""), (REL0, 30, "ünï")]
    # the unfinished line is kept back unless asked for
    again = run_once(tmp_path, flush_partial=True)
    assert L(again)[-1] == (REL0, 34, "part")
    assert rebuild(L(again)) == (d / "stdout.log").read_bytes()


def test_resume_with_offsets_no_repeats_no_gaps(tmp_path):
    d0, d1 = rank_dir(tmp_path, local=0), rank_dir(tmp_path, local=1)
    append(d0 / "stdout.log", "start rank=0 local_rank=0 host=gpu1 device=cuda:0 world_size=4\n")
    append(d1 / "stdout.log", "start rank=1 local_rank=1 host=gpu1 device=cuda:1 world_size=4\n")
    for i in range(50):
        append(d0 / "stdout.log", f"step={i} loss={i / 7:.4f}\t✓\n")
        append(d1 / "stderr.log", f"warn {i}\n")
    append(d0 / "stdout.log", "step=50 lo")  # a partial line at the cut

    tr = Tracker()
    first = run_once(tmp_path, ident=True)
    ev1 = [e for r in first for e in tr.feed("gpu1", r)]
    offs = tr.offsets_for("gpu1")
    assert offs[REL0][0] == len((d0 / "stdout.log").read_bytes()) - len("step=50 lo")

    append(d0 / "stdout.log", "ss=1.0\n" + "".join(f"step={i}\n" for i in range(51, 80)))
    append(d1 / "stderr.log", "late warning\n")
    second = run_once(tmp_path, offsets=offs, ident=True)
    ev2 = [e for r in second for e in tr.feed("gpu1", r)]
    # the remote side resumed exactly: nothing at or before the given offsets came again
    assert not [r for r in second if r.startswith("T\t")]
    for rel, off, _ in L(second):
        assert off > offs[rel][0] if rel in offs else True
    for rank, name in ((d0, "stdout.log"), (d1, "stdout.log"), (d1, "stderr.log")):
        rel = str((rank / name).relative_to(tmp_path))
        assert rebuild(L(first, rel) + L(second, rel)) == (rank / name).read_bytes(), rel
    lines = [e for e in ev1 + ev2 if isinstance(e, Line) and e.local_rank == 0]
    assert "step=50 loss=1.0" in [l.text for l in lines]
    # a replay of everything (reconnect without offsets) yields nothing new to the tracker
    assert [e for r in run_once(tmp_path) for e in tr.feed("gpu1", r)] == []
    # global ranks learned from the start lines, per file
    assert {(e.local_rank, e.global_rank) for e in ev1 + ev2 if isinstance(e, Line)} == {(0, 0), (1, 1)}


def test_follow_sees_new_attempt_and_run_mid_follow(tmp_path):
    d = rank_dir(tmp_path, local=0)
    append(d / "stdout.log", "start rank=3 local_rank=0 host=gpu2 device=cuda:0 world_size=8\n")
    append(d / "stdout.log", "step=1\n")
    p = start(tmp_path, follow=True, idle_exit=1.5, heartbeat=0.2)
    got: list[str] = []
    read_until(p, lambda r: r.endswith("\tstep=1"), got)
    assert got[0].startswith("H\t")

    append(d / "stdout.log", "hal")  # a line written in two pieces
    time.sleep(0.3)
    append(d / "stdout.log", "f\n")
    # torchrun restarts the worker group: attempt_1, new global rank for local rank 0
    d1 = rank_dir(tmp_path, attempt=1, local=0)
    append(d1 / "stdout.log", "start rank=5 local_rank=0 host=gpu2 device=cuda:0 world_size=8\n")

    def writer():
        for i in range(20):
            append(d1 / "stdout.log", f"a1 step={i}\n")
            time.sleep(0.02)
        # systemd restarts torchrun: a new run folder, attempt_0 again
        d2 = rank_dir(tmp_path, run="job-1_zzz999", attempt=0, local=0)
        append(d2 / "stdout.log", "start rank=7 local_rank=0 host=gpu2 device=cuda:0 world_size=8\n")
        append(d2 / "stderr.log", "oops\n")

    t = threading.Thread(target=writer)
    t0 = time.time()
    t.start()
    t.join()
    finish(p, got)
    assert time.time() - t0 < 15
    assert any(r.startswith("H\t") for r in got[1:])  # heartbeats keep coming

    tr = Tracker()
    lines = [e for r in got for e in tr.feed("gpu2", r) if isinstance(e, Line)]
    shown = [f"{prefix(l)} {l.text}" for l in lines]
    assert shown[:3] == ["[gpu2/r3] start rank=3 local_rank=0 host=gpu2 device=cuda:0 world_size=8",
                         "[gpu2/r3] step=1", "[gpu2/r3] half"]
    a1 = [s for s in shown if s.startswith("[gpu2/r5 a1] a1 step=")]
    assert a1 == [f"[gpu2/r5 a1] a1 step={i}" for i in range(20)]
    assert shown[-1] == "[gpu2/r7!] oops"
    assert rebuild(L(got, f"{RUN}/attempt_1/0/stdout.log")) == (d1 / "stdout.log").read_bytes()


def test_truncation_in_follow_and_on_resume(tmp_path):
    d = rank_dir(tmp_path)
    f = d / "stdout.log"
    append(f, "one\ntwo\nthree\n")
    p = start(tmp_path, follow=True, idle_exit=1.5)
    got: list[str] = []
    read_until(p, lambda r: r.endswith("\tthree"), got)
    with open(f, "wb") as fh:  # truncated in place
        fh.write(b"new\n")
    finish(p, got)
    tail = [r for r in got if r[0] not in "HI"][-2:]
    assert tail == [f"T\t{REL0}\t0", f"L\t{REL0}\t4\tnew"]

    tr = Tracker()
    ev = [e for r in got for e in tr.feed("n", r)]
    assert Truncated("n", REL0, lines=3) in ev  # one, two, three: no longer in the file
    assert [e.text for e in ev if isinstance(e, Line)] == ["one", "two", "three", "new"]
    assert tr.offsets_for("n")[REL0][0] == 4

    # on resume, an offset beyond the file's size also means truncation
    recs = run_once(tmp_path, offsets={REL0: 100})
    assert recs == [f"T\t{REL0}\t0", f"L\t{REL0}\t4\tnew"]


def test_attempt_folder_deleted_and_reused(tmp_path):
    d = rank_dir(tmp_path, attempt=0, local=1)
    rel = f"{RUN}/attempt_0/1/stdout.log"
    append(d / "stdout.log", "start rank=1 local_rank=1 host=h\nold\n")
    other = rank_dir(tmp_path, attempt=0, local=0)
    append(other / "stdout.log", "start rank=0 local_rank=0 host=h\n")
    p = start(tmp_path, follow=True, idle_exit=1.5, heartbeat=0.1)
    got: list[str] = []
    read_until(p, lambda r: r.endswith("\told"), got)
    shutil.rmtree(tmp_path / RUN / "attempt_0")  # torchrun clears the folder before reuse
    for _ in range(2):  # heartbeats come after scans: the second one follows a whole scan
        read_until(p, lambda r: r.startswith("H\t"), got)
    d = rank_dir(tmp_path, attempt=0, local=1)
    # a new file with more bytes than the old offset: only "replaced" can tell
    append(d / "stdout.log", "start rank=6 local_rank=1 host=h\nnew content, longer than before\n")
    finish(p, got)
    recs = [r for r in got if r[0] not in "HI" and rel in r]
    assert recs[-3:] == [f"T\t{rel}\t0", f"L\t{rel}\t33\tstart rank=6 local_rank=1 host=h",
                         f"L\t{rel}\t65\tnew content, longer than before"]
    tr = Tracker()
    lines = [e for r in got for e in tr.feed("h", r) if isinstance(e, Line)]
    assert [prefix(l) for l in lines if l.local_rank == 1] == ["[h/r1]", "[h/r1]", "[h/r6]", "[h/r6]"]

    # files in the offsets that no longer exist are simply skipped
    shutil.rmtree(tmp_path / RUN)
    assert run_once(tmp_path, offsets={rel: 65}) == []


def test_error_json_once_and_with_rank(tmp_path):
    d = rank_dir(tmp_path, attempt=0, local=2)
    append(d / "stdout.log", "start rank=10 local_rank=2 host=gpu3 device=cuda:2 world_size=16\n")
    append(d / "stderr.log", "Traceback (most recent call last):\n")
    doc = {"message": {"message": "RuntimeError: CUDA error: out of memory",
                       "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  x\n",
                                     "timestamp": "1700000000"}}}
    (d / "error.json").write_text(json.dumps(doc, indent=2))
    recs = run_once(tmp_path, ident=True)
    e_recs = [r for r in recs if r.startswith("E\t")]
    rel = f"{RUN}/attempt_0/2/error.json"
    size = (d / "error.json").stat().st_size
    assert len(e_recs) == 1 and e_recs[0].startswith(f"E\t{rel}\t{size}\t")
    assert json.loads(e_recs[0].split("\t", 3)[3]) == doc
    # error.json comes after the rank's stdout, so the global rank is known
    assert [r.split("\t")[1].rsplit("/", 1)[1] for r in recs if r[0] != "I"] == [
        "stdout.log", "stderr.log", "error.json"]
    tr = Tracker()
    ev = [e for r in recs for e in tr.feed("gpu3", r)]
    (rep,) = [e for e in ev if isinstance(e, ErrorReport)]
    assert (rep.node, rep.attempt, rep.local_rank, rep.global_rank) == ("gpu3", 0, 2, 10)
    assert rep.message == "RuntimeError: CUDA error: out of memory"
    assert rep.traceback.startswith("Traceback") and rep.timestamp == 1700000000.0
    # resumed: not reported again
    assert [r for r in run_once(tmp_path, offsets=tr.offsets_for("gpu3")) if r[0] == "E"] == []


def test_unparsable_error_json_is_still_reported(tmp_path):
    d = rank_dir(tmp_path)
    (d / "error.json").write_text('{"message": trunc')
    (rec,) = run_once(tmp_path)
    kind, _, _, payload = rec.split("\t", 3)
    assert kind == "E" and json.loads(payload) == {"torchrig_unparsed": '{"message": trunc'}


def test_big_file_read_in_chunks_and_overlong_line(tmp_path):
    d = rank_dir(tmp_path)
    body = "".join(f"line {i:07d} " + "x" * 80 + "\n" for i in range(60000))  # ~5.6 MB
    append(d / "stdout.log", body)
    append(d / "stdout.log", "y" * (2 * 1024 * 1024 + 5) + "\nend\n")
    recs = run_once(tmp_path)
    got = L(recs)
    assert len(got) == 60000 + 3 + 1  # 60000 lines, a 2 MiB + 5 line in 3 pieces, "end"
    assert [len(t) for _, _, t in got[60000:60003]] == [1024 * 1024, 1024 * 1024, 5]
    assert rebuild(got) == (d / "stdout.log").read_bytes()


def fake_systemctl(tmp_path: Path) -> tuple[dict, Path]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    state = tmp_path / "unit-state"
    state.write_text("active")
    tool = bindir / "systemctl"
    tool.write_text(f'#!/bin/sh\n[ "$1" = is-active ] || exit 2\ncat "{state}"\necho\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return env, state


def test_follow_ends_when_unit_stops_after_draining(tmp_path):
    env, state = fake_systemctl(tmp_path)
    logs = tmp_path / "logs"
    d = rank_dir(logs)
    append(d / "stdout.log", "start rank=0 local_rank=0 host=h\n")
    p = start(logs, env=env, follow=True, unit="torchrig-job.service")
    got: list[str] = []
    read_until(p, lambda r: r.startswith("L\t"), got)
    state.write_text("activating")  # e.g. systemd's restart delay: still going
    time.sleep(1.6)
    assert p.poll() is None, "exited while the unit was still running"
    append(d / "stdout.log", "done step=10\nlast words without newline")
    state.write_text("inactive")
    finish(p, got, timeout=20)
    texts = [t for _, _, t in L(got)]
    # drained, and the final partial line is emitted since the run is over
    assert texts[-2:] == ["done step=10", "last words without newline"]
    assert L(got)[-1][1] == (d / "stdout.log").stat().st_size


def test_missing_dir_and_bad_arguments(tmp_path):
    assert run_once(tmp_path / "nope") == []
    script = follower_input({}).split("\n", 1)[1]
    p = subprocess.run([sys.executable, "-"], input=("ARGS = '{not json'\n" + script).encode(),
                       capture_output=True, timeout=30)
    assert p.returncode == 2 and b"bad arguments" in p.stderr


def test_one_pass_flushes_the_partial_line_only_once_the_unit_is_over(tmp_path):
    env, state = fake_systemctl(tmp_path)
    logs = tmp_path / "logs"
    d = rank_dir(logs)
    append(d / "stdout.log", "x\nunfinished")
    assert [t for _, _, t in L(run_once(logs, env=env, unit="u"))] == ["x"]  # still active
    state.write_text("failed")
    assert [t for _, _, t in L(run_once(logs, env=env, unit="u"))] == ["x", "unfinished"]
