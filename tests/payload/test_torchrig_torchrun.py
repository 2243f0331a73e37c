"""payload/torchrig_torchrun.py: torchrun whose agent's exit barrier waits as long as the
launch says (torchrun: a fixed 300 s), and which does not restart a first attempt whose
workers all failed within the early window of their spawn (issue 22, item 6)."""

import os
import subprocess
import sys
import time
from pathlib import Path

PAYLOAD = Path(__file__).resolve().parents[2] / "payload"
sys.path.insert(0, str(PAYLOAD))
import torchrig_torchrun as tt  # noqa: E402


def _run(tmp_path, script, *torchrun_args, **env):
    (tmp_path / "w.py").write_text(script)
    env = {**os.environ, "LOGLEVEL": "INFO", "PYTHONPATH": str(PAYLOAD), **env}
    for k in [k for k, v in env.items() if v is None]:
        env.pop(k)
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "torchrig_torchrun", "--standalone", *torchrun_args,
                        "--log-dir", str(tmp_path / "logs"), "--redirects", "3", "w.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    return r, time.monotonic() - t


def _attempts(tmp_path):
    return sorted(p.name for p in (tmp_path / "logs").glob("*/attempt_*"))


def test_exit_barrier_timeout_reaches_the_agent(tmp_path):
    r, _ = _run(tmp_path, "print('hi')\n", "--nproc-per-node", "1", TORCHRIG_EXIT_BARRIER_TIMEOUT="7")
    assert r.returncode == 0, r.stderr
    assert "Waiting 7.0 seconds for other agents to finish" in r.stderr
    r, _ = _run(tmp_path, "print('hi')\n", "--nproc-per-node", "1", TORCHRIG_EXIT_BARRIER_TIMEOUT=None)
    assert "Waiting 300 seconds for other agents to finish" in r.stderr  # plain torchrun


# ---- the decision (pure) -------------------------------------------------------------------

W = 10.0


def test_every_worker_failed_early_ends_the_run():
    assert tt.early_verdict(100.0, {0: (101.0, 2), 1: (101.2, 2)}, 0, W, 101.2) == tt.END
    # one failed, one finished: still a start failure of the whole group
    assert tt.early_verdict(100.0, {0: (101.0, 1), 1: (101.0, 0)}, 0, W, 101.0) == tt.END
    # killed by a signal counts as a failure too
    assert tt.early_verdict(100.0, {0: (103.0, -9)}, 0, W, 103.0) == tt.END


def test_while_the_window_lasts_a_group_with_a_running_worker_waits():
    assert tt.early_verdict(100.0, {0: None, 1: None}, 0, W, 101.0) == tt.WAIT
    assert tt.early_verdict(100.0, {0: (101.0, 2), 1: None}, 0, W, 105.0) == tt.WAIT
    assert tt.early_verdict(100.0, {0: (101.0, 0), 1: None}, 0, W, 109.9) == tt.WAIT


def test_torchrun_decides_after_the_window_on_restarts_when_off_or_on_success():
    # the window passed with a worker still running: torchrun restarts the group as before
    assert tt.early_verdict(100.0, {0: (101.0, 2), 1: None}, 0, W, 110.5) == tt.TORCHRUN
    # a worker seen exited after the window
    assert tt.early_verdict(100.0, {0: (101.0, 2), 1: (111.0, 2)}, 0, W, 111.0) == tt.TORCHRUN
    # a restarted group (restart count 1): torchrun's restarts as configured
    assert tt.early_verdict(100.0, {0: (101.0, 2)}, 1, W, 101.0) == tt.TORCHRUN
    # off
    assert tt.early_verdict(100.0, {0: (101.0, 2)}, 0, 0, 101.0) == tt.TORCHRUN
    assert tt.early_verdict(100.0, {0: (101.0, 2)}, 0, -1, 101.0) == tt.TORCHRUN
    # every worker succeeded at once: torchrun's success
    assert tt.early_verdict(100.0, {0: (101.0, 0), 1: (101.0, 0)}, 0, W, 101.0) == tt.TORCHRUN
    assert tt.early_verdict(100.0, {}, 0, W, 101.0) == tt.TORCHRUN


def test_an_agent_without_the_hooks_keeps_plain_torchrun(caplog):
    class Old:
        def __init__(self, *a, **k):
            self.kw = k
    agent = tt.agent_class(Old, 5, 10.0)(object())
    assert agent.kw == {"exit_barrier_timeout": 5} and agent._torchrig_off
    assert "early-failure rule off: torch's agent has no _start_workers" in caplog.text


def test_an_elastic_group_that_ended_cleanly_while_a_node_waits_to_join_restarts(caplog):
    """The full run's failure: gpu1 came back, gpu4's agent stopped its workers for the new
    membership, the payload's stop agreement ended gpu5's workers with exit 0 before gpu5's
    agent looked, and gpu5 took that for the end of the job: the world formed without it."""
    from types import SimpleNamespace as NS
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    class Base:
        def __init__(self, *a, **k):
            pass

        def _start_workers(self, wg):
            return {}

        def _invoke_run(self):
            pass

        def _monitor_workers(self, wg):
            return RunResult(state=wg.state)

    def group(state, waiting):
        def num_nodes_waiting():
            if isinstance(waiting, Exception):
                raise waiting
            return waiting
        return NS(state=state, spec=NS(rdzv_handler=NS(num_nodes_waiting=num_nodes_waiting)))

    elastic, plain = tt.agent_class(Base, elastic=True)(), tt.agent_class(Base)()
    S, F = WorkerState.SUCCEEDED, WorkerState.FAILED
    assert elastic._monitor_workers(group(S, 1)).state == WorkerState.HEALTHY
    assert "while 1 node(s) wait to join: a membership change" in caplog.text
    assert elastic._monitor_workers(group(S, 0)).state == S  # the job's end
    assert elastic._monitor_workers(group(F, 1)).state == F  # torchrun's own restart
    assert plain._monitor_workers(group(S, 1)).state == S    # a plain job: torchrun's rules
    assert elastic._monitor_workers(group(S, OSError("store gone"))).state == S
    assert [tt.is_elastic(["--nnodes", v]) for v in ("2:3", "2:2", "3", "x:3", "1:10")] == \
        [True, False, False, False, True]
    assert not tt.is_elastic([])


def test_an_elastic_node_whose_exit_barrier_timed_out_rejoins(caplog):
    """The full run's second failure: gpu4's workers ended with exit 0 (a peer's stop) after
    the node waiting to join had already been taken into a new round, so its agent found
    nobody waiting, went to the exit barrier and, the others training on, left after its
    timeout: its store gone, the world re-formed without it. Now an elastic agent whose
    workers succeeded and whose barrier timed out runs again (a new rendezvous); a barrier
    passed in time is the job's end, and a plain job keeps torchrun's rules."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    class Base:
        def __init__(self, *a, exit_barrier_timeout=0.2, **k):
            self._exit_barrier_timeout = exit_barrier_timeout
            self._remaining_restarts = restarts
            self.runs, self.barriers = 0, list(barriers)

        def _exit_barrier(self):
            time.sleep(self.barriers.pop(0))  # torch: logs a timeout and returns

        def _invoke_run(self, role="default"):
            self.runs += 1  # torch: rendezvous, start, monitor; on success the barrier
            self._exit_barrier()
            return RunResult(state=WorkerState.SUCCEEDED)

    barriers, restarts = [0.25, 0.0], 3  # the first barrier times out (0.2 s), the second is met
    elastic = tt.agent_class(Base, elastic=True)()
    assert elastic._invoke_run().state == WorkerState.SUCCEEDED and elastic.runs == 2
    assert "did not come to the exit barrier within 0.2s: they train on" in caplog.text
    assert elastic._remaining_restarts == 2  # the rejoin used one of the job's restarts
    barriers, restarts = [0.25, 0.25, 0.25], 1  # bounded: one rejoin left, then the end
    bounded = tt.agent_class(Base, elastic=True)()
    assert bounded._invoke_run().state == WorkerState.SUCCEEDED and bounded.runs == 2
    assert "no restart left to rejoin with: ending" in caplog.text
    barriers = [0.0]
    ended = tt.agent_class(Base, elastic=True)()
    assert ended._invoke_run().state == WorkerState.SUCCEEDED and ended.runs == 1
    barriers = [0.25]
    plain = tt.agent_class(Base, 0.2)()
    assert plain._invoke_run().state == WorkerState.SUCCEEDED and plain.runs == 1


# ---- real torchrun ---------------------------------------------------------------------------

FAIL = "import sys\nprint('error: unrecognized arguments: --stepz', file=sys.stderr)\nsys.exit(2)\n"


def test_a_group_that_fails_at_once_is_not_restarted(tmp_path):
    r, took = _run(tmp_path, FAIL, "--nproc-per-node", "2", "--max-restarts", "3",
                   "--monitor-interval", "0.1", TORCHRIG_EARLY_FAIL_S="30")
    assert r.returncode == 1, r.stderr
    assert "a start failure (arguments, imports, dependencies)" in r.stderr
    assert "exit codes by local rank: {0: 2, 1: 2}" in r.stderr
    assert "will restart worker group" not in r.stderr
    assert _attempts(tmp_path) == ["attempt_0"]
    assert took < 60, took


def test_without_the_window_torchrun_restarts(tmp_path):
    r, _ = _run(tmp_path, FAIL, "--nproc-per-node", "1", "--max-restarts", "1",
                TORCHRIG_EARLY_FAIL_S="0")
    assert r.returncode == 1
    assert "will restart worker group" in r.stderr
    assert _attempts(tmp_path) == ["attempt_0", "attempt_1"]


PARTIAL = '''import os, sys, time
# local rank 0 fails at once; local rank 1 runs on: not a start failure of the whole group
if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    sys.exit(0)
if os.environ["LOCAL_RANK"] == "0":
    sys.exit(3)
time.sleep(600)
'''


def test_one_worker_failing_while_another_runs_is_restarted_after_the_window(tmp_path):
    r, took = _run(tmp_path, PARTIAL, "--nproc-per-node", "2", "--max-restarts", "1",
                   TORCHRIG_EARLY_FAIL_S="3")
    assert r.returncode == 0, r.stderr
    assert "will restart worker group" in r.stderr
    assert _attempts(tmp_path) == ["attempt_0", "attempt_1"]
    assert "start failure" not in r.stderr
    assert took < 60, took
