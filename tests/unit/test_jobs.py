"""`torchrig jobs` (launch/jobs.py): a node's jobs read in one probe (expanded on the node per
job unit), the per-node states and the one row per job, stop's record, the prune plan and its
node script, and the removal of a job's folder that follows no symlink."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrig.facts import probe
from torchrig.launch import jobs
from torchrig.onhost import script

PROPS_RUNNING = {"ActiveState": "active", "SubState": "running", "Result": "success"}


def node(state, rank=0, **kw):
    d = {"state": state, "unit": "", "node_rank": rank, "uptime_s": None, "started_at": None,
         "ended_at": None, "stopped_at": None, "restarts": 0, "progress": None,
         "workdir": "/opt/torchrig/payload/releases/abc", "marker": "# torchrig launch x"}
    d.update(kw)
    return d


@pytest.mark.parametrize("props,stopped,want", [
    (PROPS_RUNNING, None, "running"),
    ({"ActiveState": "deactivating", "SubState": "stop-sigterm"}, None, "running"),
    ({"ActiveState": "activating", "SubState": "auto-restart"}, None, "restarting"),
    ({"ActiveState": "inactive", "SubState": "dead", "Result": "success"}, None, "succeeded"),
    ({"ActiveState": "failed", "SubState": "failed", "Result": "exit-code"}, None, "failed"),
    ({"ActiveState": "inactive", "SubState": "dead", "Result": "exit-code"}, None, "failed"),
    # stop resets torchrun's exit 1 (SIGTERM): its record says stopped, not succeeded
    ({"ActiveState": "inactive", "SubState": "dead", "Result": "success"}, 1.7e9, "stopped"),
    # a record does not make a job that runs again read stopped
    (PROPS_RUNNING, 1.7e9, "running"),
])
def test_node_state(props, stopped, want):
    assert jobs.node_state(props, stopped) == want


def test_merge_rule_failed_first_then_restarting_running_stopped_succeeded():
    assert jobs.merge_state(["succeeded", "failed", "running"]) == "failed"
    assert jobs.merge_state(["running", "restarting"]) == "restarting"
    assert jobs.merge_state(["stopped", "running"]) == "running"
    assert jobs.merge_state(["succeeded", "stopped"]) == "stopped"
    assert jobs.merge_state(["succeeded", "succeeded"]) == "succeeded"


def test_one_row_per_job_rank_0s_progress_and_times():
    row = jobs.merge("j1", {
        "b": node("succeeded", 1, progress="step=9 loss=1.0", ended_at=200.0, started_at=100.0),
        "a": node("succeeded", 0, progress="step=10 loss=0.5000 tok/s=3", ended_at=210.0,
                  started_at=99.0, restarts=2)})
    assert (row.state, row.step, row.loss, row.restarts) == ("succeeded", "10", "0.5000", 2)
    assert (row.started_at, row.ended_at, row.running_s) == (99.0, 210.0, None)
    assert row.nodes == {"b": "succeeded", "a": "succeeded"} and not row.running
    running = jobs.merge("j1", {"a": node("running", uptime_s=30.0, started_at=1.0),
                                "b": node("succeeded", 1, ended_at=5.0)})
    assert running.running and running.ended_at is None and running.running_s == 30.0


def test_stop_record_is_read_defensively():
    assert jobs.parse_stop_record('{"stopped_at": 1700000000, "was": "active", "by": "stop"}\n') == 1.7e9
    for bad in (None, "", "x", "{}", '{"stopped_at": "nan"}', '{"stopped_at": -1}', "[1]"):
        assert jobs.parse_stop_record(bad) is None


def test_stop_script_records_before_it_stops_and_only_a_running_job():
    from torchrig.launch.run import stop_script
    text = stop_script("exp1")
    record, stop = text.index("/etc/torchrig/jobs/exp1.stopped"), text.index('systemctl stop "$u"')
    assert record < stop
    assert 'case "$was" in active|activating|reloading|deactivating)' in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)



def test_plan_prune_never_takes_a_running_job_and_honours_older_than():
    day = 86400
    rows = [jobs.merge("old", {"a": node("succeeded", ended_at=1000.0)}),
            jobs.merge("new", {"a": node("failed", ended_at=10 * day)}),
            jobs.merge("run", {"a": node("running"), "b": node("succeeded", 1, ended_at=1.0)}),
            jobs.merge("nodate", {"a": node("stopped")}),
            jobs.slurm_row("sl", "12", None, {}, None)]
    now = 10 * day + 100
    plan = jobs.plan_prune(rows, now, older_than_days=2)
    assert [r.job for r in plan.prune] == ["old"]
    kept = dict(plan.kept)
    assert "never pruned" in kept["run"] and "less than 2 day" in kept["new"]
    assert "unknown" in kept["nodate"] and "Slurm" in kept["sl"]
    assert sorted(r.job for r in jobs.plan_prune(rows, now).prune) == ["new", "nodate", "old"]


def test_prune_files_are_launchs_and_the_record():
    files = jobs.job_files("j1")
    assert files == ["/etc/torchrig/jobs/j1.env", "/etc/torchrig/jobs/j1.run",
                     "/etc/systemd/system/torchrig-j1.service",
                     "/etc/systemd/system/torchrig-gpumon@j1.service",
                     "/etc/systemd/system/torchrig-gpumon@j1.timer",
                     "/etc/systemd/system/torchrig-ended@j1.service",
                     "/etc/systemd/system/torchrig-health@j1.service",
                     "/etc/systemd/system/torchrig-health@j1.timer",
                     "/etc/torchrig/jobs/j1.stopped", "/etc/torchrig/jobs/j1.health"]


def test_prune_script_checks_again_under_the_lock(tmp_path):
    from torchrig import inventory
    inv_file = tmp_path / "inv.yml"
    inv_file.write_text("hosts:\n  - {name: a, connection: local}\n")
    h = inventory.load(inv_file).hosts[0]
    row = jobs.merge("j1", {"a": node("succeeded", ended_at=1.0)})
    text = jobs.prune_script(h, [row], with_logs=True, with_checkpoints=False)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert text.index("flock") < text.index("systemctl show -p ActiveState")
    assert "grep -qxF '# torchrig launch x' /etc/systemd/system/torchrig-j1.service" in text
    assert '"remove": [["/var/log/torchrig", "j1"]]' in text and "/srv/torchrig/checkpoints" not in text
    assert jobs.parse_prune("pruned j1\nkept j2 still active\n/var/log/torchrig/j1: removed\n") == {
        "pruned": ["j1"], "kept": {"j2": "still active"}, "notes": ["/var/log/torchrig/j1: removed"]}


def test_slurm_states_and_records():
    assert [jobs.slurm_state(s) for s in ("RUNNING", "COMPLETED", "CANCELLED", "FAILED",
                                          "NODE_FAIL", "PENDING", None)] == \
        ["running", "succeeded", "stopped", "failed", "failed", "pending", "unknown"]
    recs = jobs.parse_records({"/etc/torchrig/jobs/a.slurm": '{"job_id": "7", "nodes": ["g1"]}',
                               "/etc/torchrig/jobs/B!.slurm": '{"job_id": "8"}',
                               "/etc/torchrig/jobs/c.slurm": '{"job_id": "x"}',
                               "/etc/torchrig/jobs/d.slurm": "not json"})
    assert recs == {"a": {"job_id": "7", "nodes": ["g1"]}}


def test_one_probe_reads_every_job_unit_on_the_node(tmp_path, monkeypatch):
    """The expansion (onhost/launch/jobs_probe.py) run for real with the probe: two job
    units in a unit folder (and a sampler unit and a non-job file, not jobs), a stand-in
    systemctl, rank 0's progress in the log folder."""
    units = tmp_path / "units"
    units.mkdir()
    for name in ("torchrig-j1.service", "torchrig-j2.service", "torchrig-gpumon@j1.timer",
                 "torchrig.firewall.service", "torchrig-BAD.service"):
        (units / name).write_text("# torchrig launch abc\n[Unit]\n")
    logs = tmp_path / "logs"
    att = logs / "j1" / "run_x" / "attempt_0" / "0"
    att.mkdir(parents=True)
    (att / "stdout.log").write_text("start rank=0 world=2\nstep=4 loss=2.5 tok/s=10\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "systemctl").write_text(
        "#!/bin/sh\ncase \"$*\" in *j1*) printf 'ActiveState=active\\nSubState=running\\n"
        "LoadState=loaded\\nWorkingDirectory=/opt/r/1\\nDescription=torchrig job j1 (node 0/2)\\n"
        "NRestarts=0\\n';; *) printf 'ActiveState=inactive\\nSubState=dead\\nResult=success\\n"
        "LoadState=loaded\\n';; esac\n")
    (bin_ / "systemctl").chmod(0o755)
    tmpl = jobs.request_template(lambda j: f"{logs}/{j}")
    tmpl["unit_dir"] = str(units)
    tmpl["per_job"]["read"]["stopped"]["path"] = str(tmp_path / (jobs.PLACEHOLDER + ".stopped"))
    (tmp_path / "j2.stopped").write_text('{"stopped_at": 1700000000}')
    r = subprocess.run([sys.executable, "-I", "-"], input=jobs.stdin(tmpl), capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"})
    got = jobs.node_jobs(probe.reply(r.returncode, r.stdout, r.stderr))
    assert sorted(got) == ["j1", "j2"]
    assert got["j1"]["state"] == "running" and got["j1"]["progress"] == "step=4 loss=2.5 tok/s=10"
    assert got["j1"]["workdir"] == "/opt/r/1" and got["j1"]["node_rank"] == 0
    assert got["j2"]["state"] == "stopped" and got["j2"]["ended_at"] == 1.7e9


def _remove(root: Path, job: str) -> str:
    arg = json.dumps({"remove": [[str(root), job]]})
    r = subprocess.run([sys.executable, "-I", "-", arg], input=script("launch/jobdirs.py"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="jobdirs.py walks root-owned folders only")
def test_removing_a_job_folder_never_follows_a_planted_symlink():
    import shutil
    import tempfile
    tmp_path = Path(tempfile.mkdtemp(prefix="torchrig-unit-", dir="/var/lib"))  # root's chain
    try:
        _removal(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _removal(tmp_path):
    root = tmp_path / "logroot"
    victim = tmp_path / "victim"
    (victim / "in").mkdir(parents=True)
    (victim / "file").write_text("keep")
    (victim / "in" / "file").write_text("keep")
    os.chmod(tmp_path, 0o755)
    root.mkdir(mode=0o755)
    (root / "j1").symlink_to(victim)                   # the job's folder replaced by a link
    (root / "j2").mkdir()
    (root / "j2" / "planted").symlink_to(victim / "in")  # a link inside the job's folder
    (root / "j2" / "log.txt").write_text("x")
    assert "removed (it was not a folder" in _remove(root, "j1")
    assert _remove(root, "j2").strip().endswith("removed")
    assert _remove(root, "j3").strip().endswith("absent")
    assert not (root / "j1").exists() and not (root / "j1").is_symlink() and not (root / "j2").exists()
    assert (victim / "file").read_text() == "keep" and (victim / "in" / "file").read_text() == "keep"


def test_the_table_sanitises_what_a_job_wrote(capsys):
    from torchrig import tables
    row = jobs.merge("j1", {"a": node("running", uptime_s=65.0, started_at=1.7e9,
                                      progress="step=7 loss=\x1b]0;owned\x07[bold]1.5 tok/s=1")}).as_dict()
    row2 = jobs.merge("j2", {"a": node("stopped", ended_at=1.7e9 + 100, started_at=1.7e9),
                             "b": node("failed", 1, ended_at=1.7e9 + 50)}).as_dict()
    tables.jobs_table([row, row2], now=1.7e9 + 200)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "running for 1m05s" in out and "ended 2023-11-14" in out
    assert "a:stopped, b" in out or "a:stopped" in out


def _make(arg: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-", json.dumps(arg)],
                          input=script("launch/jobdirs.py"), capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(os.geteuid() != 0, reason="jobdirs.py walks root-owned folders only")
def test_the_service_users_home_is_made_its_own_0700_and_a_planted_link_is_refused():
    import pwd
    import shutil
    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix="torchrig-unit-", dir="/var/lib"))  # root's chain
    try:
        os.chmod(tmp, 0o755)
        nobody = pwd.getpwnam("nobody")
        home = tmp / "prefix" / "home"
        arg = {"user": "nobody", "dirs": [], "home": str(home)}
        assert _make(arg).returncode == 0
        st = home.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (nobody.pw_uid, nobody.pw_gid, 0o700)
        assert (home.parent.stat().st_uid, home.parent.stat().st_mode & 0o777) == (0, 0o755)
        os.chmod(home, 0o777)                          # made right again at the next launch
        assert _make(arg).returncode == 0 and home.stat().st_mode & 0o777 == 0o700
        victim = tmp / "victim"
        victim.mkdir(mode=0o755)
        home.rmdir()
        home.symlink_to(victim)                        # root's prefix is not the job's: only root
        r = _make(arg)                                 # could plant it, and it is still not followed
        assert r.returncode == 3 and "is a symlink: torchrig does not follow" in r.stderr
        assert victim.stat().st_uid == 0 and victim.stat().st_mode & 0o777 == 0o755
        home.unlink()
        os.chmod(home.parent, 0o777)                   # a prefix others can write: nothing made
        r = _make(arg)
        assert r.returncode == 3 and "root creates job folders only where root alone" in r.stderr
        assert not home.exists()
    finally:
        shutil.rmtree(tmp)
