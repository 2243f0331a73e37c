"""status_remote.py (root's reader of a job's folder for `invoke status`), run for real on
files a job could have written."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from torchrig.progress import bundled

SCRIPT = Path(__file__).resolve().parents[2] / "torchrig" / "launch" / "status_remote.py"


def _status(logdir: Path) -> subprocess.CompletedProcess:
    args = {"unit": "torchrig-nosuchjob.service", "logdir": str(logdir),
            "util_file": str(logdir / "gpu_util.csv"), "window_s": 600}
    return subprocess.run([sys.executable, "-I", "-", json.dumps(args)], input=bundled(SCRIPT.read_text()),
                          capture_output=True, text=True, timeout=60)


def test_non_finite_samples_written_by_the_job_are_skipped(tmp_path):
    """The job owns gpu_util.csv: `nan`, `inf` or `1e400` there made the helper die with an
    OverflowError/ValueError traceback, so `status` failed for the operator."""
    now = int(time.time())
    (tmp_path / "gpu_util.csv").write_text(
        f"{now - 5},10,20\nnan,5\n1e400,3\n{now},inf\n{now},nan,1\n-inf,2\n{now - 1},30\n")
    r = _status(tmp_path)
    assert r.returncode == 0, r.stderr
    samples = json.loads(r.stdout)["util_samples"]
    assert [u for _, u in samples] == [[10.0, 20.0], [30.0]]


def test_a_hard_linked_log_is_not_read(tmp_path):
    """A job's stdout.log that is a hard link to another file is not read as root (the log
    follower refuses it too)."""
    other = tmp_path / "someone-elses-file"
    other.write_text("start rank=0\nstep=42 secret-content\n")
    rank = tmp_path / "job" / "run_1" / "attempt_0" / "0"
    rank.mkdir(parents=True)
    os.link(other, rank / "stdout.log")
    r = _status(tmp_path / "job")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["progress"] is None
    os.unlink(rank / "stdout.log")
    (rank / "stdout.log").write_text("start rank=0\nstep=7 loss=1.0\n")
    assert json.loads(_status(tmp_path / "job").stdout)["progress"] == "step=7 loss=1.0"
