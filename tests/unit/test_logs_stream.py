"""stream.follow for real on a `connection: local` host: the follower runs as a local process
(as root, as it does on a node), and "drops" are that process killed, so reconnects, retry
windows and resume offsets are driven for real, without SSH."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_logs_follow import append, fake_systemctl, rank_dir

from torchrig import inventory
from torchrig.logs import stream
from torchrig.logs.stream import FollowOptions, Printer, Window, _stream
from torchrig.connections import LocalConnection
from torchrig.session import Fleet

REPO = Path(__file__).resolve().parents[2]
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the follower runs as root (sudo -n otherwise)")


def local_inventory(tmp_path: Path, log_dir: Path) -> Path:
    p = tmp_path / "inv.yml"
    p.write_text(f"hosts:\n  - {{name: head, connection: local, vars: {{log_dir: {log_dir}}}}}\n")
    return p


def followers() -> list[int]:
    """Pids of follower processes (`python3 -I -`) started by this test process."""
    kids: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(pid))
    found, todo = [], [os.getpid()]
    while todo:
        for k in kids.get(todo.pop(), []):
            todo.append(k)
            try:
                argv = Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")[:-1]
            except OSError:
                continue
            if argv and argv[0].endswith(b"python3") and argv[-1] == b"-":
                found.append(k)
    return found


class Run:
    """stream.follow in a thread on one local host, printing into a buffer."""

    def __init__(self, tmp_path: Path, logs: Path, reconnect_for: float):
        inv = inventory.load(local_inventory(tmp_path, logs.parent))
        self.out, self.err = io.StringIO(), io.StringIO()
        o = FollowOptions("job", {"head": str(logs)}, "torchrig-job.service", follow=True,
                    reconnect_for=reconnect_for)
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(inv, o), daemon=True)
        self.thread.start()

    def _run(self, inv, o):
        self.result = stream.follow(Fleet(inv), list(inv.hosts), o, printer=Printer(self.out, False, self.err))

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()

    def wait_for(self, text: str, timeout: float = 30, lines: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.out.getvalue() or len(self.lines()) < lines:
            assert self.thread.is_alive(), f"follow ended early: {self.result}"
            assert time.monotonic() < deadline, f"{text!r} not shown: {self.lines()[-5:]}"
            time.sleep(0.05)

    def drop(self) -> None:
        """Kill the running follower, as a dropped connection ends it."""
        deadline = time.monotonic() + 20
        while not (pids := followers()):
            assert time.monotonic() < deadline, "no follower running"
            time.sleep(0.05)
        for pid in pids:
            os.kill(pid, 9)


@as_root
def test_every_drop_gets_its_own_window_and_no_line_is_lost_or_repeated(tmp_path, monkeypatch):
    env, state = fake_systemctl(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    logs = tmp_path / "logs" / "job"
    f = rank_dir(logs) / "stdout.log"
    append(f, "start rank=0 local_rank=0 host=head\n")
    run = Run(tmp_path, logs, reconnect_for=3)
    n = 0

    def write_for(seconds):
        nonlocal n
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            append(f, f"step={n}\n")
            n += 1
            time.sleep(0.1)

    run.wait_for("start rank=0")
    run.drop()
    write_for(1)
    run.wait_for(f"step={n - 1}\n")
    write_for(4.5)  # longer than reconnect_for since the first drop
    run.drop()
    write_for(1)
    run.wait_for(f"step={n - 1}\n")
    state.write_text("inactive")
    run.thread.join(60)
    assert not run.thread.is_alive()
    assert run.result.lost == {} and run.result.reconnects == 2, run.result
    assert run.lines() == ["[head/r0] start rank=0 local_rank=0 host=head"] + [
        f"[head/r0] step={i}" for i in range(n)]


@as_root
def test_resume_offsets_of_many_files_travel_on_stdin(tmp_path, monkeypatch):
    """600 files with long run names: their offsets (~170 KB of JSON) exceed the 128 KiB a
    single argv word may have, which is where they were before."""
    env, state = fake_systemctl(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    logs = tmp_path / "logs" / "job"
    runs = [f"job_{i:03d}" + "r" * 200 for i in range(3)]
    for run_name in runs:
        for local in range(200):
            append(rank_dir(logs, run=run_name, local=local) / "stdout.log", f"hello {local}\n")
    last = rank_dir(logs, run=runs[-1], local=199) / "stdout.log"
    run = Run(tmp_path, logs, reconnect_for=10)
    run.wait_for("] hello 199\n", lines=600)
    run.drop()
    append(last, "after the drop\n")
    run.wait_for("after the drop")
    state.write_text("inactive")
    run.thread.join(60)
    assert run.result.lost == {} and run.result.reconnects == 1, run.result
    assert len(run.lines()) == 601


def test_window_restarts_after_a_connection_that_worked():
    now = [0.0]
    w = Window(120, clock=lambda: now[0])
    assert w.failed()               # first drop at t=0
    now[0] = 100
    assert w.failed()               # still retrying within its window
    w.worked()                      # reconnected and streamed
    now[0] = 1000
    assert w.failed()               # a second drop long after: a fresh window
    now[0] = 1121
    assert not w.failed()           # that drop's window is over: give up


def test_a_record_cut_by_a_drop_is_never_fed():
    got = []
    rc, err = _stream(LocalConnection(None), r"printf 'L\tr\t5\tab\nL\tr\t90\tcut sho'; echo oops >&2; exit 3",
                      "", got.append, 10)
    assert (rc, err, got) == (3, "oops", ["L\tr\t5\tab"])


@as_root
def test_logs_task_on_a_local_host(tmp_path):
    logs = tmp_path / "logs"
    d = rank_dir(logs / "t-local")
    append(d / "stdout.log", "start rank=0 local_rank=0 host=head\n\x1b]0;retitled\x07step=1\n")
    append(d / "stderr.log", "warn\x1b[2K\n")
    r = subprocess.run([sys.executable, "-m", "invoke", "logs", "-i", str(local_inventory(tmp_path, logs)),
                        "--job", "t-local"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[head/r0] start rank=0 local_rank=0 host=head",
                                     "[head/r0] \\x1b]0;retitled\\x07step=1",
                                     "[head/r0!] warn\\x1b[2K"]
