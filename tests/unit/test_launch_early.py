"""Issue 22, item 6: a launch's early failure is reported at once. launch's start check
(_confirm) against the real probe run here (a stand-in `systemctl` per node on its PATH and
torchrun's per-rank folders in a temporary log folder): it waits for the workers' spawn, then
watches each node for the early window from that spawn, and reports a failed unit with the
failing rank's last stderr lines, redacted and printable."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchrig import inventory
from torchrig.facts import job_state, probe
from torchrig.launch import plan
from torchrig.launch.run import (EARLY_SLACK_S, WAIT_S, LaunchOptions, _confirm, early_left,
                                 plan_job)
from torchrig.session import fan_out

SECRET = "hf_s3cretvalue0123456789"


class Nodes:
    """Two `connection: local` hosts whose probe runs here; each node's unit state is what
    its stand-in systemctl prints (states[host], a list taken one per probe, the last kept)."""

    def __init__(self, tmp_path: Path, states: dict[str, list[str]]):
        self.tmp, self.states, self.runs = tmp_path, states, []
        p = tmp_path / "inv.yml"
        p.write_text("hosts:\n  - {name: n1, connection: local}\n  - {name: n2, connection: local}\n")
        self.hosts = inventory.load(p).hosts
        self.inv = SimpleNamespace(hosts=self.hosts)
        for h in ("n1", "n2"):
            b = tmp_path / "bin" / h
            b.mkdir(parents=True, exist_ok=True)
            (b / "systemctl").write_text(f"#!/bin/sh\ncat {tmp_path}/state-{h}\n")
            (b / "systemctl").chmod(0o755)
            (b / "journalctl").write_text("#!/bin/sh\necho 'journal line'\n")
            (b / "journalctl").chmod(0o755)

    def run(self, h, cmd, root=False, timeout=60, data=None):
        self.runs.append(h.name)
        todo = self.states[h.name]
        state = todo.pop(0) if len(todo) > 1 else todo[0]
        (self.tmp / f"state-{h.name}").write_text(
            "ActiveState={}\nResult={}\n".format(*state.split("/")))
        env = {**os.environ, "PATH": f"{self.tmp}/bin/{h.name}:{os.environ['PATH']}"}
        argv = [sys.executable, "-I", "-"] if cmd == probe.COMMAND else ["sh", "-c", cmd]
        r = subprocess.run(argv, input=data, capture_output=True, text=True, env=env,
                           timeout=timeout)
        return SimpleNamespace(exited=r.returncode, stdout=r.stdout, stderr=r.stderr)

    def fan_out(self, fn, items=None, name=lambda h: h.name):
        return fan_out(items, fn, name=name)


def _job(tmp_path, window=2, env=None):
    o = LaunchOptions(job="exp1", nproc="2", early_fail_window=window, start_timeout=20,
                      env=[f"{k}={v}" for k, v in (env or {}).items()])
    nodes = Nodes(tmp_path, {})
    job = plan_job(nodes.inv, nodes.hosts, o, "/rel", {"n1": None, "n2": None})
    for n in job.nodes:
        n.log_dir = str(tmp_path / "logs" / n.host)
    return o, job


def _spawn(tmp_path, host, ago=0.0, stderr=None):
    attempt = tmp_path / "logs" / host / "exp1" / "run1_x" / "attempt_0"
    for rank in (0, 1):
        d = attempt / str(rank)
        d.mkdir(parents=True, exist_ok=True)
        (d / "stdout.log").write_text("")
        (d / "stderr.log").write_text((stderr or {}).get(rank, ""))
    t = time.time() - ago
    os.utime(attempt, (t, t))
    return attempt


def test_a_unit_failed_at_once_is_reported_with_the_ranks_stderr_redacted_and_printable(tmp_path):
    o, job = _job(tmp_path, window=90, env={"HF_TOKEN": SECRET})
    nodes = Nodes(tmp_path, {"n1": ["active/success"], "n2": ["active/success", "failed/exit-code"]})
    _spawn(tmp_path, "n1")
    long_ago = "\n".join(f"old line {i}" for i in range(40))
    _spawn(tmp_path, "n2", stderr={
        0: "",  # local rank 0 wrote nothing: rank 1's lines are shown
        1: long_ago + "\nusage: train.py [-h]\n"
           f"train.py: error: unrecognized arguments: --no-such-flag {SECRET} \x1b]0;owned\x07\n"})
    t = time.monotonic()
    problems = _confirm(nodes, nodes.hosts, job, o)
    took = time.monotonic() - t
    assert took < 45, took  # at the second poll, not after the 90 s window
    assert len(problems) == 1
    text = problems[0]
    head, *lines = text.splitlines()
    assert head.startswith("n2: unit failed (exit-code) ") and "after its workers started" in head
    assert head.endswith("; last stderr lines of [n2/l1]:")
    assert len(lines) == 15 and lines[0] == "  old line 27"
    assert lines[-2] == "  usage: train.py [-h]"
    assert lines[-1].startswith("  train.py: error: unrecognized arguments: --no-such-flag ")
    assert SECRET not in text and "\x1b" not in text and "\x07" not in text
    assert "\\x1b]0;owned\\x07" in lines[-1]
    assert nodes.runs.count("n2") == 3  # two polls and one read of the ranks' stderr


def test_a_healthy_start_returns_once_the_window_from_the_spawn_passed(tmp_path):
    o, job = _job(tmp_path, window=3)
    nodes = Nodes(tmp_path, {"n1": ["active/success"], "n2": ["active/success"]})
    _spawn(tmp_path, "n1", ago=1.5)  # spawned 1.5 s ago: 1.5 s of its window left
    _spawn(tmp_path, "n2", ago=1.5)
    t = time.monotonic()
    assert _confirm(nodes, nodes.hosts, job, o) == []
    took = time.monotonic() - t
    assert 1.5 + EARLY_SLACK_S - 0.3 <= took < 1.5 + EARLY_SLACK_S + 15, took  # a loaded machine
    # one probe per node per poll, about every second
    assert nodes.runs.count("n1") == nodes.runs.count("n2") <= 5


def test_no_window_returns_at_the_spawn_and_a_finished_job_is_not_watched(tmp_path):
    o, job = _job(tmp_path, window=0)
    nodes = Nodes(tmp_path, {"n1": ["active/success"], "n2": ["active/success"]})
    _spawn(tmp_path, "n1")
    _spawn(tmp_path, "n2")
    assert _confirm(nodes, nodes.hosts, job, o) == []
    assert sorted(nodes.runs) == ["n1", "n2"]
    o, job = _job(tmp_path, window=60)
    nodes = Nodes(tmp_path, {"n1": ["inactive/success"], "n2": ["inactive/success"]})
    assert _confirm(nodes, nodes.hosts, job, o) == []
    assert sorted(nodes.runs) == ["n1", "n2"]


def test_a_unit_failed_without_rank_output_shows_its_journal(tmp_path):
    o, job = _job(tmp_path, window=5)
    nodes = Nodes(tmp_path, {"n1": ["failed/exit-code"], "n2": ["active/success"]})
    problems = _confirm(nodes, nodes.hosts, job, o)
    assert problems == ["n1: unit failed (exit-code): journal line"]


def test_a_failure_on_one_node_is_reported_while_another_still_waits_on_its_own(tmp_path):
    """Each node is watched on its own: n1's unit fails on its second look while n2 (not
    spawned yet) waits on its node for a change, up to WAIT_S; n1's failure is reported at
    once, not when n2's wait ends (a round of every node's answers would take WAIT_S)."""
    o, job = _job(tmp_path, window=0)
    nodes = Nodes(tmp_path, {"n1": ["active/success", "failed/exit-code"],
                             "n2": ["active/success"]})
    t = time.monotonic()
    problems = _confirm(nodes, nodes.hosts, job, o)
    took = time.monotonic() - t
    assert problems == ["n1: unit failed (exit-code): journal line"]
    assert took < WAIT_S / 2, took


def test_the_early_window_reaches_the_node_and_is_counted_from_the_spawn(tmp_path):
    o, job = _job(tmp_path, window=12)
    assert job.early_fail_s == 12
    assert plan.node_env(job, job.nodes[0])["TORCHRIG_EARLY_FAIL_S"] == "12"
    o, job = _job(tmp_path, window=0)
    assert plan.node_env(job, job.nodes[0])["TORCHRIG_EARLY_FAIL_S"] == "0"
    assert early_left(10, 4.0) == 6 + EARLY_SLACK_S
    assert early_left(10, 25.0) == EARLY_SLACK_S
    assert early_left(10, None) == 10 + EARLY_SLACK_S


def test_spawn_age_and_failure_lines_from_the_probe(tmp_path):
    """The probe's clock and the attempt folder's mtime give the spawn's age; the stderr read
    follows no link a job could plant (a symlinked stderr.log is not read)."""
    from test_facts_probe import run_probe
    attempt = _spawn(tmp_path, "n1", ago=7, stderr={0: "a\n\nb\n"})
    req = job_state.start_request("u.service", str(tmp_path / "logs" / "n1" / "exp1"))
    assert req["run"]["unit"][2] == "--property=ActiveState,Result,ActiveEnterTimestampMonotonic"

    def state(since_start):
        """The unit started `since_start` seconds ago (by the node's monotonic clock)."""
        enter = int((time.clock_gettime(time.CLOCK_MONOTONIC) - since_start) * 1e6)
        req["run"]["unit"] = ["printf", "ActiveState=active\\nResult=success\\n"
                              f"ActiveEnterTimestampMonotonic={enter}\\n"]
        return job_state.start_state("u.service", run_probe(req))
    st, result, workers, ago = state(10)
    assert (st, result, workers) == ("active", "success", 2) and 6.5 < ago < 60
    # the unit started after that folder was made: an earlier launch's run, no worker yet
    assert state(3) == ("active", "success", 0, None)
    req["tree"]["logs"]["root"] = str(tmp_path / "none")
    assert state(10) == ("active", "success", 0, None)
    req["tree"]["logs"]["root"] = str(tmp_path / "logs" / "n1" / "exp1")
    got = run_probe(job_state.failure_request(str(tmp_path / "logs" / "n1" / "exp1")))
    assert job_state.failure_lines(got, 5) == (0, ["a", "b"])
    (attempt / "0" / "stderr.log").unlink()
    secret = tmp_path / "root-only.txt"
    secret.write_text("root's secret\n")
    (attempt / "0" / "stderr.log").symlink_to(secret)
    got = run_probe(job_state.failure_request(str(tmp_path / "logs" / "n1" / "exp1")))
    assert job_state.failure_lines(got, 5) is None


@pytest.mark.parametrize("value,ok", [("0", True), ("15", True), ("-1", False), ("x", False)])
def test_the_flag_takes_whole_seconds_from_zero(value, ok):
    from invoke import Exit
    from torchrig.cli.common import _number
    if ok:
        assert _number("early_fail_window", value, 0) == int(value)
    else:
        with pytest.raises(Exit, match="--early-fail-window"):
            _number("early_fail_window", value, 0)
