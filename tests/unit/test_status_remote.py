"""status's reading of a job's folder (the probe, root's reader on the host, and
facts/job_state on the operator side), run for real on files a job could have written."""

import os
import subprocess
import sys
import time
from pathlib import Path

from torchrig.facts import job_state, probe

UNIT = "torchrig-nosuchjob.service"


def _status(logdir: Path) -> dict:
    req = job_state.probe_request(UNIT, str(logdir), str(logdir / "gpu_util.csv"), 1 << 16)
    r = subprocess.run([sys.executable, "-I", "-"], input=probe.stdin(req),
                       capture_output=True, text=True, timeout=60)
    return job_state.state(UNIT, probe.reply(r.returncode, r.stdout, r.stderr), 600)


def test_non_finite_samples_written_by_the_job_are_skipped(tmp_path):
    """The job owns gpu_util.csv: `nan`, `inf` or `1e400` there made the helper die with an
    OverflowError/ValueError traceback, so `status` failed for the operator."""
    now = int(time.time())
    (tmp_path / "gpu_util.csv").write_text(
        f"{now - 5},10,20\nnan,5\n1e400,3\n{now},inf\n{now},nan,1\n-inf,2\n{now - 1},30\n")
    samples = _status(tmp_path)["util_samples"]
    assert [u for _, u in samples] == [[10.0, 20.0], [30.0]]


def test_a_hard_linked_log_is_not_read(tmp_path):
    """A job's stdout.log that is a hard link to another file is not read as root (the log
    follower refuses it too)."""
    other = tmp_path / "someone-elses-file"
    other.write_text("start rank=0\nstep=42 secret-content\n")
    rank = tmp_path / "job" / "run_1" / "attempt_0" / "0"
    rank.mkdir(parents=True)
    os.link(other, rank / "stdout.log")
    assert _status(tmp_path / "job")["progress"] is None
    os.unlink(rank / "stdout.log")
    (rank / "stdout.log").write_text("start rank=0\nstep=7 loss=1.0\n")
    assert _status(tmp_path / "job")["progress"] == "step=7 loss=1.0"


def test_status_is_one_probe_round_trip_per_node_journal_included(tmp_path, monkeypatch):
    """`status` read each node twice (the state probe, then a journal script for the
    diagnosis); now one probe per node carries both. Local hosts, stand-in systemctl and
    journalctl on PATH; every command the fleet runs is counted."""
    from torchrig import inventory
    from torchrig.launch.status import node_states as status
    from torchrig.logs import diagnose
    from torchrig.session import Fleet
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "systemctl").write_text("#!/bin/sh\nprintf 'ActiveState=active\\nLoadState=loaded\\n'\n")
    (bin_ / "journalctl").write_text(
        "#!/bin/sh\ncase \" $* \" in *\" -k \"*) ;; *) echo 'Started torchrig-j1.service';; esac\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    inv_file = tmp_path / "inv.yml"
    inv_file.write_text(f"vars: {{log_dir: {tmp_path / 'logs'}}}\n"
                        "hosts:\n  - {name: a, connection: local}\n  - {name: b, connection: local}\n")
    inv = inventory.load(inv_file)
    with Fleet(inv, parallel=2) as fleet:
        ran = []
        real = fleet.run
        monkeypatch.setattr(fleet, "run", lambda h, cmd, **kw: ran.append(h.name) or real(h, cmd, **kw))
        res = status(fleet, inv.hosts, "j1")
    assert res.ok, res.failures
    assert sorted(ran) == ["a", "b"]
    assert [(j.host, j.node_rank) for j in res.journals] == [("a", 0), ("b", 1)]
    assert diagnose.failures(res.journals, "torchrig-j1.service") == []
