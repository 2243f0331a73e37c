"""torchrun (torch.distributed.run), with the exit barrier's timeout set by the operator and
no restart for a first attempt that could not start.

A node whose workers all finished waits in torchrun's exit barrier for the other nodes'
agents (so that a store it hosts stays up while they finish). torchrun fixes that wait at
300 s and has no flag for it; a node whose worker died meanwhile restarts and waits for a
rejoin that the finished nodes never make, so the whole job hangs for that long. The launch
sets TORCHRIG_EXIT_BARRIER_TIMEOUT (seconds); without it this is plain torchrun.

An early failure: when every local worker of the group's first attempt (restart count 0)
exited within TORCHRIG_EARLY_FAIL_S seconds of its spawn, and one of them with an error, the
cause is in what was started (a misspelt argument, a missing import or dependency), so a
restart would only fail again, max_restarts times: the agent ends the run as failed instead
(torchrun exits 1 and closes the rendezvous, as when its restarts are used up). While that
window lasts, torchrun's own check of the group waits until every local worker has exited
(a group where one worker failed and the others still run is restarted as before, once the
window ends). 0 or unset: plain torchrun. Should torch's agent lack the hooks used here
(SimpleElasticAgent's _start_workers/_monitor_workers and _remaining_restarts), the rule is
left out with one log line and torchrun restarts as usual.

An elastic job's endpoint (torchrig/launch/elastic.py): with TORCHRIG_RDZV_CANDIDATES (the
job's nodes' host:port in launch order) this node joins the first other candidate whose store
answers; when none answers within its turn (TORCHRIG_RDZV_TURN_S times its place in the
list), it hosts the store itself. When torchrun then fails and the store it used no longer
answers (the node hosting it is gone), it exits TORCHRIG_RDZV_LOST_EXIT, which its unit
restarts: the survivors meet again at the next candidate.

A membership change of an elastic job (--nnodes MIN:MAX): torchrun's agents restart their
workers when a node waits to join, each on its own next look, and stop them with SIGTERM. The
example payload stops every rank at one step on a SIGTERM to any (a consistent checkpoint),
so a node whose agent has not looked yet sees its workers end with exit 0 and would take that
as the end of the job (exit barrier, then gone: the new world forms without it). While a node
waits to join, a worker group that succeeded is restarted with the new membership instead;
a job that really finished resumes at its last step and ends at once in the new world.
Should that look come too late (the waiting node already taken into a new round: nothing
waits any more), the node's agent goes to the exit barrier, where the other nodes never
come, since they train on: an elastic job's agent whose workers succeeded and whose exit
barrier then timed out rejoins the rendezvous instead of ending (its store, when it hosts
it, stays up), using one of the job's restarts. A job that really finished passes the
barrier at once.

Run as `python -m torchrig_torchrun <torchrun arguments>` from the payload release. Standard
library and torch only."""
import os
import sys
import time

WAIT, END, TORCHRUN = "wait", "end", "torchrun"


def early_verdict(spawned: float, exits: dict, restart_count: int, window: float,
                  now: float) -> str:
    """What to do with the worker group at `now` (pure). spawned: when its workers were
    started; exits: local rank -> (when it was seen exited, exit code; negative: killed by
    that signal), or None while it runs (every local rank is a key); restart_count: torchrun's
    (TORCHELASTIC_RESTART_COUNT); window: seconds (<= 0: off).
    WAIT: within the window of the first attempt, some worker still runs and none exited late:
    torchrun's check waits (so a worker that fails a moment after another is not killed by
    torchrun first and counted as a failure of its own); END: every worker exited within the
    window and one failed: end the run, no restart; TORCHRUN: torchrun decides."""
    if window <= 0 or restart_count != 0 or not exits:
        return TORCHRUN
    done = [e for e in exits.values() if e is not None]
    if any(t - spawned > window for t, _ in done):
        return TORCHRUN
    if len(done) < len(exits):
        return WAIT if now - spawned <= window else TORCHRUN
    return END if any(code != 0 for _, code in done) else TORCHRUN


def exit_status(pid: int):
    """The worker's exit code (negative: its signal) once it exited, None while it runs. The
    child is left unreaped (WNOWAIT): torchrun collects it as usual. Raises OSError when the
    pid is no child of ours (already reaped)."""
    got = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if got is None or got.si_pid == 0:
        return None
    return got.si_status if got.si_code == os.CLD_EXITED else -got.si_status


def _log(msg: str, *args) -> None:
    try:
        from torch.distributed.elastic.utils.logging import get_logger
        get_logger("torchrig_torchrun").warning(msg, *args)
    except Exception:  # noqa: BLE001 - a log line must not end the run
        print("torchrig_torchrun: " + msg % args, file=sys.stderr, flush=True)


def hooks_missing(agent_cls) -> list:
    """The agent's hooks the early rule needs that this torch lacks (names)."""
    return [n for n in ("_start_workers", "_monitor_workers", "_invoke_run")
            if not callable(getattr(agent_cls, n, None))]


def is_elastic(argv: list) -> bool:
    """torchrun's --nnodes is MIN:MAX with MIN below MAX."""
    lo, _, hi = (arg_of(argv, "--nnodes") or "").partition(":")
    return bool(hi) and lo.isdigit() and hi.isdigit() and int(lo) < int(hi)


def agent_class(agent_cls, exit_barrier_timeout=None, early_fail_s: float = 0.0,
                elastic: bool = False):
    """The agent class with `exit_barrier_timeout` defaulting to `exit_barrier_timeout` (None:
    torchrun's), the early-failure rule (module doc) for a window of early_fail_s seconds
    (<= 0: none) and, for an elastic job, the membership rule (module doc). torchrun's
    launcher passes everything but the spec by keyword."""
    early = early_fail_s > 0
    if early and hooks_missing(agent_cls):
        _log("torchrig: early-failure rule off: torch's agent has no %s; failed groups restart "
             "as torchrun's --max-restarts says", ", ".join(hooks_missing(agent_cls)))
        early = False

    class Agent(agent_cls):
        def __init__(self, *args, **kwargs):
            if exit_barrier_timeout is not None and len(args) < 4:
                # (spec, logs_specs, start_method, exit_barrier_timeout, ...)
                kwargs.setdefault("exit_barrier_timeout", exit_barrier_timeout)
            super().__init__(*args, **kwargs)
            self._torchrig_spawned = 0.0
            self._torchrig_exits = {}  # local rank -> (seen exited at, code) | None
            self._torchrig_pids = {}
            self._torchrig_off = not early
            self._torchrig_missed = False  # the last exit barrier timed out

        def _exit_barrier(self):
            t = time.monotonic()
            super()._exit_barrier()  # torch logs a timeout and carries on
            timeout = getattr(self, "_exit_barrier_timeout", None)
            self._torchrig_missed = timeout is not None and time.monotonic() - t >= timeout

        def _invoke_run(self, *args, **kwargs):
            while True:
                self._torchrig_missed = False
                result = super()._invoke_run(*args, **kwargs)
                if not (elastic and result.state.name == "SUCCEEDED" and self._torchrig_missed):
                    return result
                left = getattr(self, "_remaining_restarts", 0)
                if left <= 0:  # each rejoin is one of the job's restarts: bounded
                    _log("torchrig: the other nodes' agents did not come to the exit barrier; "
                         "no restart left to rejoin with: ending")
                    return result
                self._remaining_restarts = left - 1
                _log("torchrig: the local workers ended cleanly, but the other nodes' agents "
                     "did not come to the exit barrier within %ss: they train on (a membership "
                     "change this node missed), not the end of the job; rejoining (%s "
                     "restart(s) left)", getattr(self, "_exit_barrier_timeout", "?"), left - 1)

        def _start_workers(self, worker_group):
            t = time.monotonic()
            ids = super()._start_workers(worker_group)
            if not self._torchrig_off:
                self._torchrig_spawned = t
                self._torchrig_pids = dict(ids)
                self._torchrig_exits = dict.fromkeys(ids)
            return ids

        def _monitor_workers(self, worker_group):
            result = self._torchrig_monitor(worker_group)
            if elastic and result.state.name == "SUCCEEDED":
                try:
                    waiting = worker_group.spec.rdzv_handler.num_nodes_waiting()
                except Exception as e:  # noqa: BLE001 - the store is gone: torchrun's verdict
                    _log("torchrig: membership rule: the rendezvous did not answer (%s: %s)",
                         type(e).__name__, e)
                    waiting = 0
                if waiting > 0:
                    _log("torchrig: the local workers ended cleanly while %s node(s) wait to "
                         "join: a membership change (a peer's workers were stopped for it), "
                         "not the end of the job; restarting with the new membership", waiting)
                    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
                    return RunResult(state=WorkerState.HEALTHY)  # its loop then restarts
            return result

        def _torchrig_monitor(self, worker_group):
            if self._torchrig_off:
                return super()._monitor_workers(worker_group)
            try:
                verdict = self._torchrig_verdict(worker_group)
            except Exception as e:  # noqa: BLE001 - the private API moved: plain torchrun
                self._torchrig_off = True
                _log("torchrig: early-failure rule off (%s: %s); failed groups restart as "
                     "torchrun's --max-restarts says", type(e).__name__, e)
                return super()._monitor_workers(worker_group)
            if verdict == WAIT:
                from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
                return RunResult(state=WorkerState.HEALTHY)
            result = super()._monitor_workers(worker_group)
            if verdict == END and result.is_failed():
                codes = {r: c for r, (_, c) in sorted(self._torchrig_exits.items())}
                last = max(t for t, _ in self._torchrig_exits.values()) - self._torchrig_spawned
                _log("torchrig: every local worker of the first attempt exited within %.1fs of "
                     "its spawn (exit codes by local rank: %s): a start failure (arguments, "
                     "imports, dependencies) that a restart would repeat; ending the run "
                     "without restarting (window TORCHRIG_EARLY_FAIL_S=%ss)",
                     last, codes, early_fail_s)
                self._remaining_restarts = 0  # torchrun's loop then stops the group: FAILED
                self._torchrig_off = True
            return result

        def _torchrig_verdict(self, worker_group) -> str:
            spec = worker_group.spec
            restart_count = spec.max_restarts - self._remaining_restarts
            if restart_count != 0:
                return TORCHRUN
            now = time.monotonic()
            if now - self._torchrig_spawned > early_fail_s:
                return TORCHRUN  # (torchrun may have collected a worker by now)
            for rank, pid in self._torchrig_pids.items():
                if self._torchrig_exits.get(rank) is None:
                    code = exit_status(pid)
                    if code is not None:
                        self._torchrig_exits[rank] = (now, code)
            return early_verdict(self._torchrig_spawned, self._torchrig_exits, restart_count,
                                 early_fail_s, now)
    return Agent


def answers(endpoint: str, timeout: float = 2.0) -> bool:
    """Whether something listens at host:port (a rendezvous store)."""
    import socket
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def pick_endpoint(candidates: list, me: str, turn_s: float, probe=answers,
                  clock=time.monotonic, sleep=time.sleep) -> tuple:
    """(endpoint, is_host): the first other candidate that answers; else, once this node's
    turn (turn_s per place before it in the list) has passed, this node's own endpoint, as
    the store's host."""
    place = candidates.index(me) if me in candidates else len(candidates)
    deadline = clock() + turn_s * place
    while True:
        for c in candidates:
            if c != me and probe(c):
                return c, False
        if clock() >= deadline:
            return me, True
        sleep(1.0)


def with_endpoint(argv: list, endpoint: str, is_host: bool) -> list:
    """torchrun's arguments with --rdzv-endpoint and --rdzv-conf's is_host replaced."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--rdzv-endpoint":
            out[i + 1] = endpoint
        elif a == "--rdzv-conf":
            conf = [kv for kv in out[i + 1].split(",") if not kv.startswith("is_host=")]
            out[i + 1] = ",".join([f"is_host={'true' if is_host else 'false'}"] + conf)
    return out


def arg_of(argv: list, flag: str):
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag), None)


def _seconds(name: str):
    v = os.environ.get(name)
    if not v:
        return None
    try:
        return float(v)
    except ValueError:
        _log("torchrig: %s=%r is not a number of seconds; ignored", name, v)
        return None


if __name__ == "__main__":
    from torch.distributed.launcher import api
    from torch.distributed.run import main
    barrier, early_s = _seconds("TORCHRIG_EXIT_BARRIER_TIMEOUT"), _seconds("TORCHRIG_EARLY_FAIL_S")
    elastic = is_elastic(sys.argv)
    if barrier is not None or (early_s or 0) > 0 or elastic:
        api.LocalElasticAgent = agent_class(api.LocalElasticAgent, barrier, early_s or 0.0,
                                            elastic)
    cands = [c for c in os.environ.get("TORCHRIG_RDZV_CANDIDATES", "").split(",") if c]
    if not cands:
        sys.exit(main())
    port = cands[0].rpartition(":")[2]
    me = f"{arg_of(sys.argv, '--local-addr')}:{port}"
    endpoint, is_host = pick_endpoint(cands, me, _seconds("TORCHRIG_RDZV_TURN_S") or 0.0)
    _log("torchrig: rendezvous at %s (%s)", endpoint, "hosting it" if is_host else "joining")
    sys.argv = with_endpoint(sys.argv, endpoint, is_host)
    try:
        sys.exit(main())
    except Exception as e:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
        lost = int(os.environ.get("TORCHRIG_RDZV_LOST_EXIT") or 0)
        if lost and not is_host and not isinstance(e, (ChildFailedError, RendezvousClosedError)) \
                and not answers(endpoint):
            _log("torchrig: the rendezvous store at %s is gone (%s: %s); exiting %s so that "
                 "the unit starts again at the next endpoint", endpoint, type(e).__name__, e, lost)
            sys.exit(lost)
        raise
