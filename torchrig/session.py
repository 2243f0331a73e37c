"""The fleet session: made once per task from the inventory, the selected hosts and the
host-key choice; it holds one connection per host for the life of the task (keepalives and
bounded timeouts: see remote.py) and fans work out over the hosts.

Every task talks to hosts through a Fleet, so the host-key choice (`accept_new`) is made
here and nowhere else, and a task that runs many commands on a host (launch waiting for the
workers, provision's steps, logs reconnecting) does one SSH handshake per host, not one per
command.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from .inventory import Host, Inventory
from .remote import Ran, Result, cannot_connect, connect, fan_out, login_user, privileged

T = TypeVar("T")


class Connector(Protocol):
    """What a task may do on one host: SshConnection (remote.py) and LocalConnection
    (`connection: local`) both implement it."""

    user: str

    def run(self, command: str, **kwargs) -> Any:
        """Invoke's run(): hide, warn, timeout, out_stream/err_stream."""

    def run_input(self, command: str, data: str, timeout: float = 600) -> Ran:
        """`command` with `data` on its stdin; (exit status, stdout, stderr)."""

    def stream(self, command: str, data: str, on_out: Callable[[bytes], None],
               on_err: Callable[[bytes], None], *, timeout: float | None = None,
               silence: float | None = None) -> int | None:
        """Output chunks as they arrive; the exit status, None after `silence` quiet seconds."""

    def put(self, local: str, remote: str) -> Any:
        """Copy a local file to the host."""

    def close(self) -> None: ...


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

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def conn(self, host: Host) -> Connector:
        with self._lock:
            lock = self._locks.setdefault(host.name, threading.Lock())
        with lock:
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
        """One command on `host` (warn=True: the caller reads .exited). root=True runs it
        through privileged(); `data` goes to its stdin (never in argv)."""
        cxn = self.conn(host)
        line = privileged(command, login_user(cxn)) if root else command
        if data is not None:
            return cxn.run_input(line, data, timeout=600 if timeout is None else timeout)
        return cxn.run(line, hide=True, warn=True, timeout=timeout)

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
