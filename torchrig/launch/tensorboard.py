"""`torchrig tensorboard`: TensorBoard on a job's rank-0 node, reached from the operator's machine.

On the node TensorBoard runs as a transient systemd unit, as the job's unprivileged user (it
reads files the job wrote, so never as root), bound to 127.0.0.1 there. The operator reaches it
through a local port forwarded over the task's one SSH connection (direct-tcpip: the host key
was checked, jump hosts are honoured); nothing is opened on the node's network. Ctrl-C stops the
unit and the forward. Should the operator's side vanish without a Ctrl-C (laptop closed, SSH
cut), a watch script on the node, tied to its own SSH channel, stops the unit once that channel
is gone: no TensorBoard is left behind either way. A `connection: local` node is the operator's
machine: TensorBoard listens on the asked port there, and no forward is needed."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import TorchrigError
from ..facts import tensorboard as facts
from ..forward import Forward
from ..inventory import Host
from ..connections import CONNECT_TIMEOUT
from ..onhost import refusal, script
from ..session import Fleet
from ..job import check_job_name

READY_TIMEOUT = 120  # seconds for TensorBoard to say where it serves (it imports a lot)
BEAT_S = 2           # the watch script's heartbeat: how soon a vanished operator is noticed


def unit_name(job: str) -> str:
    """A transient unit per run. Not `torchrig-<job>.service`-shaped: launch and status count
    those as jobs."""
    return f"torchrig.tensorboard-{job}-{os.urandom(4).hex()}.service"


@dataclass
class Board:
    host: str
    unit: str
    user: str
    remote_port: int = 0      # where TensorBoard listens on the node (127.0.0.1)
    url: str = ""             # what the operator opens
    stopped: str = ""         # how it ended, once it did
    ended_by_itself: bool = False


def start_script(h: Host, job: str, unit: str, port: int) -> str:
    s = h.settings
    return script("tensorboard/start.sh", tb=f"{s.venv}/bin/tensorboard", venv=s.venv,
                  user=s.service_user, logdir=s.tensorboard_dir(job), job=job, unit=unit,
                  port=port, desc=f"torchrig TensorBoard for job {job}")


def _wait_ready(fleet: Fleet, h: Host, unit: str) -> int:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        r = fleet.run(h, script("tensorboard/wait.sh", unit=unit), root=True, timeout=30)
        state, journal = facts.parse_wait(r.stdout)
        port = facts.serving_port(journal)
        if port is not None and state == "active":
            return port
        tail = " | ".join(journal.strip().splitlines()[-3:]) or "(no output)"
        if state not in ("active", "activating"):
            raise TorchrigError(f"TensorBoard ended on {h.name} before serving ({state}): {tail}")
        if time.monotonic() > deadline:
            raise TorchrigError(f"TensorBoard on {h.name} did not serve within {READY_TIMEOUT}s: "
                                f"{tail}")
        time.sleep(0.5)


def stop(fleet: Fleet, h: Host, unit: str) -> str:
    """Stop the unit; 'gone' once systemd no longer has it running, else its state."""
    r = fleet.run(h, script("tensorboard/stop.sh", unit=unit), root=True, timeout=120)
    load, _, active = r.stdout.strip().partition(" ")
    if load == "not-found" or active in ("inactive", "failed"):
        return "gone"
    raise TorchrigError(f"TensorBoard unit {unit} on {h.name} is still {active or load}")


def serve(fleet: Fleet, h: Host, job: str, port: int, on_ready: Callable[[Board], None]) -> Board:
    """Start TensorBoard for `job` on `h`, forward 127.0.0.1:`port` here to it (SSH hosts), call
    on_ready, and serve until Ctrl-C (or SIGTERM); then stop both. Returns the Board, stopped."""
    check_job_name(job)
    cxn = fleet.conn(h)
    board = Board(h.name, unit_name(job), h.settings.service_user)
    unit = board.unit
    fwd = None
    watcher_done = threading.Event()
    # Ctrl-C even where SIGINT came in ignored (started in the background by a shell)
    old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # over SSH any free port on the node; on the operator's own machine the asked one
        r = fleet.run(h, "bash -s", root=True, timeout=60,
                      data=start_script(h, job, unit, port if h.is_local else 0))
        if r.exited != 0:
            raise TorchrigError(refusal(r.stderr) or f"starting TensorBoard on {h.name} failed: "
                                f"{r.stderr.strip()[-300:]}")
        board.remote_port = _wait_ready(fleet, h, unit)

        def watch():
            try:
                cxn.stream(script("tensorboard/watch.sh", unit=unit, beat=BEAT_S),
                           "", lambda b: None, lambda b: None, root=True)
            except Exception:  # noqa: BLE001 - the connection went away: the node stops it
                pass
            finally:
                watcher_done.set()
        threading.Thread(target=watch, name="tensorboard watch", daemon=True).start()
        url_port = board.remote_port
        if not h.is_local:
            transport = cxn.transport
            fwd = Forward(lambda peer: transport.open_channel(
                "direct-tcpip", ("127.0.0.1", board.remote_port), peer,
                timeout=CONNECT_TIMEOUT), port)
            url_port = fwd.port
        board.url = f"http://127.0.0.1:{url_port}/"
        on_ready(board)
        while not watcher_done.wait(0.5):  # until Ctrl-C, or the unit ended on its own
            pass
        board.ended_by_itself = True
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if fwd is not None:
            fwd.close()
        gone = stop(fleet, h, unit)
    board.stopped = ("TensorBoard ended on the node by itself" if board.ended_by_itself
                     else "stopped") + f"; its unit {unit} is {gone}"
    return board


def _interrupt(*_):
    raise KeyboardInterrupt
