"""status_remote.py (root's reader of a job's folder for `invoke status`), run for real on
files a job could have written."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "torchrig" / "launch" / "status_remote.py"


def _status(logdir: Path) -> subprocess.CompletedProcess:
    args = {"unit": "torchrig-nosuchjob.service", "logdir": str(logdir),
            "util_file": str(logdir / "gpu_util.csv"), "window_s": 600}
    return subprocess.run([sys.executable, "-I", "-", json.dumps(args)], input=SCRIPT.read_text(),
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

