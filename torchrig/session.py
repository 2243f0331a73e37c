"""The fleet session: made once per task from the inventory, the selected hosts and the
host-key choice; it holds one connection per host for the life of the task (keepalives and
bounded timeouts: see connections.py) and fans work out over the hosts on a bounded pool,
one per-host Result each (ok / error in an operator's words), never a hang.

Every task talks to hosts through a Fleet, so the host-key choice (`accept_new`) is made
here and nowhere else, and a task that runs many commands on a host (launch waiting for the
workers, provision's steps, logs reconnecting) does one SSH handshake per host, not one per
command.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import invoke
import paramiko

from .connections import JumpHostFailed, Ran, connect, unreachable_why
from .errors import TorchrigError
from .hostkeys import fingerprint
from .inventory import Host, Inventory

T = TypeVar("T")


class Connector(Protocol):
    """What a task may do on one host: SshConnection and LocalConnection (connections.py,
    `connection: local`) both implement it. It is the only way torchrig runs a command on a
    host, and root=True the only way it runs one as root (root directly, else `sudo -n`)."""

    user: str

    def run(self, command: str, *, root: bool = False, **kwargs) -> Any:
        """Invoke's run(): hide, warn, timeout, out_stream/err_stream."""

    def run_input(self, command: str, data: str, timeout: float = 600, *,
                  root: bool = False) -> Ran:
        """`command` with `data` on its stdin; (exit status, stdout, stderr)."""

    def stream(self, command: str, data: str | Iterable[bytes], on_out: Callable[[bytes], None],
               on_err: Callable[[bytes], None], *, root: bool = False,
               timeout: float | None = None, silence: float | None = None) -> int | None:
        """Output chunks as they arrive; the exit status, None after `silence` quiet seconds.
        `data`: the stdin, text sent at once or byte chunks sent as they come."""

    def put(self, local: str, remote: str) -> Any:
        """Copy a local file to the host."""

    def close(self) -> None: ...


@dataclass
class Result:
    host: str
    ok: bool
    value: Any = None
    error: str | None = None
    seconds: float = 0.0


class CannotConnect(TorchrigError):
    """A host's connection could not be opened. Made in one place (Fleet.conn), so every task
    says it in the same words: `str()` is "HOST: REASON" for a task's own error line,
    `reason` is what fan_out's per-host results (and the lines built from them) show."""

    def __init__(self, host: str, reason: str):
        super().__init__(f"{host}: {reason}")
        self.host, self.reason = host, reason


def cannot_connect(host: Host, cxn, exc: BaseException) -> CannotConnect:
    """The one error for a host whose connection could not be opened: which host, what
    failed, what to try. Unreachable hosts read the same in every task."""
    if isinstance(exc, CannotConnect):
        return exc
    why = unreachable_why(exc)
    if why is None:
        return CannotConnect(host.name, describe_error(exc))
    user, port = getattr(cxn, "user", None), getattr(cxn, "port", None) or 22
    where = f"{user + '@' if user else ''}{host.address}:{port}"
    via = f" through jump host {host.jump}" if host.jump else ""
    if isinstance(exc, JumpHostFailed):  # the jump host is the one to look at
        hint = (f"check that the jump host is up and sshd runs there (try: ssh -p {exc.port} "
                f"{exc.login})")
    else:
        hint = (f"check that the host is up and sshd runs there, and its address and port in "
                f"the inventory (try: ssh -p {port} {user + '@' if user else ''}{host.address})")
    return CannotConnect(host.name, f"unreachable: SSH to {where}{via} failed: {why}; {hint}")


def describe_error(exc: BaseException) -> str:
    """Why a host failed, in words an operator can act on."""
    if isinstance(exc, CannotConnect):
        return exc.reason  # the host is named beside it
    if isinstance(exc, TorchrigError):
        return str(exc)
    if isinstance(exc, paramiko.BadHostKeyException):
        return (f"HOST KEY CHANGED for {exc.hostname}: got {exc.key.get_name()} "
                f"{fingerprint(exc.key)}, expected {fingerprint(exc.expected_key)}. "
                "Refusing to connect (possible man-in-the-middle). If the host was reinstalled, "
                "remove its old line from the known_hosts file and accept the new key")
    if isinstance(exc, paramiko.AuthenticationException):
        return f"SSH authentication failed ({exc}); check user and identity_file in the inventory"
    why = unreachable_why(exc)
    if why is not None:  # without the address: Fleet.conn's cannot_connect() adds it
        return f"unreachable: {why}"
    if isinstance(exc, paramiko.SSHException):
        return f"SSH error: {exc}"
    if isinstance(exc, invoke.exceptions.CommandTimedOut):
        return f"command timed out after {exc.timeout}s"
    return f"{type(exc).__name__}: {exc}"


def fan_out(hosts: Iterable[Any], fn: Callable[[Any], T], parallel: int = 16,
            name: Callable[[Any], str] = lambda h: h.name) -> list[Result]:
    """Run fn(host) for every host on a bounded pool; one Result per host, in input order.
    fn raising marks that host failed; it never stops the others. `name` names an item
    (a Host by default)."""
    hosts = list(hosts)

    def one(h) -> Result:
        t0 = time.monotonic()
        try:
            return Result(name(h), True, fn(h), seconds=time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - every failure becomes that host's result
            return Result(name(h), False, error=describe_error(e), seconds=time.monotonic() - t0)

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(hosts)))) as pool:
        return list(pool.map(one, hosts))


class Fleet:
    """One per task. `conn(host)` opens a host's connection on first use and hands the same one
    back afterwards (reopened if it was lost: a reboot, a dropped link)."""

    def __init__(self, inv: Inventory, hosts: Iterable[Host] | None = None, *,
                 accept_new: bool = False, parallel: int = 16):
        self.inv = inv
        self.hosts = list(inv.hosts if hosts is None else hosts)
        self.parallel = parallel
        self._accept_new = accept_new
        self._conns: dict[str, Connector] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._early: dict[str, BaseException] = {}   # preconnect()'s failures, until first use

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def preconnect(self, hosts: Iterable[Host] | None = None) -> None:
        """Open each host's connection (of `hosts`, default every selected host) on a thread
        now, while the task imports and prepares what it sends: the handshakes overlap that
        CPU time. Each host's lock is taken here, before this returns, so a conn() waits for
        that attempt and takes its connection or its error (an unreachable host is tried
        once, as without this)."""
        for h in self.hosts if hosts is None else hosts:
            lock = self._lock_of(h)
            lock.acquire()  # released by the thread once it has tried
            threading.Thread(target=self._open_early, args=(h, lock), daemon=True).start()

    def _open_early(self, host: Host, lock: threading.Lock) -> None:
        try:
            self._open(host)
        except Exception as e:  # noqa: BLE001 - raised by the host's first conn()
            with self._lock:
                self._early[host.name] = e
        finally:
            lock.release()

    def _lock_of(self, host: Host) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(host.name, threading.Lock())

    def conn(self, host: Host) -> Connector:
        with self._lock_of(host):
            with self._lock:
                early = self._early.pop(host.name, None)
            if early is not None:
                raise early
            return self._open(host)

    def _open(self, host: Host) -> Connector:
        """The host's connection, opened (or reopened) if need be; its lock is held."""
        cxn = self._conns.get(host.name)
        if cxn is not None and (cxn.lost or not cxn.is_connected):
            cxn.close()
            cxn = None
        if cxn is None:
            cxn = connect(host, self.inv, accept_new=self._accept_new)
            try:
                cxn.open()  # connection errors here, not inside the first command
            except Exception as e:  # noqa: BLE001 - every task's one unreachable message
                raise cannot_connect(host, cxn, e) from e
            self._conns[host.name] = cxn
        return cxn

    def drop(self, host: Host) -> None:
        """Close the host's connection (it is about to go away: a reboot); the next conn()
        opens a new one."""
        with self._lock:
            cxn = self._conns.pop(host.name, None)
        if cxn is not None:
            cxn.close()

    def run(self, host: Host, command: str, *, root: bool = False, timeout: float | None = None,
            data: str | None = None):
        """One command on `host` (warn=True: the caller reads .exited), as root with
        root=True; `data` goes to its stdin (never in argv)."""
        cxn = self.conn(host)
        if data is not None:
            return cxn.run_input(command, data, timeout=600 if timeout is None else timeout,
                                 root=root)
        return cxn.run(command, root=root, hide=True, warn=True, timeout=timeout)

    def fan_out(self, fn: Callable[[Any], T], items: Iterable[Any] | None = None,
                name: Callable[[Any], str] = lambda h: h.name) -> list[Result]:
        """fn(item) for every item (the session's hosts by default) on a pool of `parallel`
        threads; one Result per item, in order; a raising fn fails that item only."""
        return fan_out(self.hosts if items is None else items, fn, parallel=self.parallel,
                       name=name)

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for cxn in conns:
            try:
                cxn.close()
            except Exception:  # noqa: BLE001 - closing a dead connection: nothing to do
                pass


@dataclass
class Outcome:
    """A service's typed result over the hosts: what the tasks map to output and an exit
    status. `problems` are failures that are not a host's error (a unit that failed)."""

    what: str                                  # for the error line: "stop of job j1"
    results: list[Result]
    problems: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Result]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[str]:
        return [f"{r.host}: {r.error}" for r in self.results if not r.ok] + self.problems

    def error_line(self) -> str:
        return f"error: {self.what} failed on " + "; ".join(self.failures)

    def as_dict(self) -> dict:
        return {r.host: (r.value if r.ok else {"error": r.error}) for r in self.results}
