"""SSH to inventory hosts: strict host keys, timeouts, quoting, bounded parallel fan-out.

Fabric's Connection accepts any host key by default (AutoAddPolicy, known_hosts never read)
and waits forever to connect; `connect()` fixes both for the host and every jump hop.
"""

from __future__ import annotations

import base64
import binascii
import errno
import getpass
import hashlib
import logging
import os
import selectors
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import fabric.runners
import invoke
import paramiko
from fabric import Config, Connection

from .errors import TorchrigError
from .inventory import Host, Inventory
from .settings import ENV_NAME

T = TypeVar("T")

CONNECT_TIMEOUT = 10  # seconds; also used for the SSH banner and authentication
# OpenSSH's ServerAliveInterval / ServerAliveCountMax: a server that answers no keepalive for
# ALIVE_INTERVAL * ALIVE_COUNT seconds is gone (frozen, unplugged), even if TCP never says so.
# A command that is merely quiet (apt, a benchmark) is not: sshd still answers.
ALIVE_INTERVAL = 10
ALIVE_COUNT = 3

# paramiko logs its own tracebacks (e.g. "Error reading SSH protocol banner") through Python's
# last-resort handler onto the terminal, before torchrig's one error line. A handler here keeps
# them out; `torchrig --debug` (a root handler) still shows them.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class UnknownHostKey(TorchrigError):
    pass


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style 'SHA256:...' fingerprint of a public key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(address: str, port: int | None) -> str:
    """The name paramiko and OpenSSH look a host up by: 'addr', or '[addr]:port' off port 22."""
    return address if port in (None, 22) else f"[{address}]:{port}"


_known_hosts_lock = threading.Lock()


class HostKeyRevoked(TorchrigError):
    pass


def parse_known_hosts(text: str) -> tuple[list, list[paramiko.PKey], list[str]]:
    """(host key entries, revoked keys, notes) from known_hosts text, read as OpenSSH does:
    a `@revoked` key is never accepted, for any host. `@cert-authority` lines (host
    certificates, which paramiko cannot check) and unreadable lines are skipped with a note;
    paramiko's own loader raises on them."""
    entries, revoked, notes = [], [], []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        marker = None
        if line.startswith("@"):
            marker, _, line = line.partition(" ")
            line = line.strip()
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, n)
        except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError,
                binascii.Error):
            entry = None
        if entry is None:
            notes.append(f"line {n}: not a host key line paramiko can read; skipped")
        elif marker == "@revoked":
            revoked.append(entry.key)
        elif marker == "@cert-authority":
            notes.append(f"line {n}: @cert-authority skipped (torchrig checks host keys, not "
                         "host certificates: list the hosts' own keys)")
        elif marker:
            notes.append(f"line {n}: unknown marker {marker}; skipped")
        else:
            entries.append(entry)
    bad = {k.asbytes() for k in revoked}
    return [e for e in entries if e.key.asbytes() not in bad], revoked, notes


_noted: set[tuple[str, str]] = set()


def _load_known_hosts(client: paramiko.SSHClient, path: str) -> list[paramiko.PKey]:
    """Fill the client's host keys from `path`; the revoked keys for the policy."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise TorchrigError(f"cannot read the known_hosts file {path} ({e.strerror})") from None
    entries, revoked, notes = parse_known_hosts(text)
    with _known_hosts_lock:
        for note in notes:
            if (path, note) not in _noted:  # once per run, not once per host and hop
                _noted.add((path, note))
                print(f"warning: {path}: {note}", file=sys.stderr)
    client.get_host_keys()._entries.extend(entries)  # what HostKeys.load() does per line
    return revoked


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown keys (with the fingerprint and how to accept), or record them
    in the known_hosts file in use when accept_new is set (OpenSSH's accept-new).
    A *changed* key never reaches this policy: paramiko raises BadHostKeyException.
    A key marked @revoked is refused either way."""

    def __init__(self, known_hosts: str, accept_new: bool, revoked=()):
        self.known_hosts = known_hosts
        self.accept_new = accept_new
        self.revoked = {k.asbytes() for k in revoked}

    def missing_host_key(self, client, hostname, key):
        fp = fingerprint(key)
        if key.asbytes() in self.revoked:
            raise HostKeyRevoked(
                f"host key for {hostname} ({key.get_name()} {fp}) is marked @revoked in "
                f"{self.known_hosts}; refusing to connect")
        if not self.accept_new:
            raise UnknownHostKey(
                f"unknown host key for {hostname} ({key.get_name()} {fp}); not in "
                f"{self.known_hosts}. Check the fingerprint out of band, then rerun with "
                "--accept-new-host-keys to record it"
            )
        with _known_hosts_lock:
            os.makedirs(os.path.dirname(self.known_hosts) or ".", mode=0o700, exist_ok=True)
            fd = os.open(self.known_hosts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)
        print(f"{hostname}: recorded new host key {key.get_name()} {fp} in {self.known_hosts}",
              file=sys.stderr)


def _secure(cxn: Connection, known_hosts: str, accept_new: bool) -> None:
    revoked = _load_known_hosts(cxn.client, known_hosts)
    cxn.client.set_missing_host_key_policy(HostKeyPolicy(known_hosts, accept_new, revoked))
    if isinstance(cxn.gateway, Connection):  # ProxyJump hops, from ssh_config or inventory
        _secure(cxn.gateway, known_hosts, accept_new)


class ConnectionLost(TorchrigError):
    pass


def _doing(command: str) -> str:
    """A command line, shortened for an error message ('while running ...'): the script
    inside privileged()'s `sudo -n -- bash -c '...'` wrapper, first line, at most 80 chars."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = []
    if words[:3] == ["sudo", "-n", "--"]:
        words = words[3:]
    if words[:2] == ["bash", "-c"] and len(words) == 3:
        command = words[2]
    lines = [ln.strip() for ln in command.splitlines()
             if ln.strip() and not ln.lstrip().startswith(("#", "set -"))]
    first = lines[0] if lines else command.strip()
    return first if len(first) <= 80 else first[:77] + "..."


class SshConnection(Connection):
    """Fabric's Connection, plus: `ProxyJump a,b` from ~/.ssh/config is followed in OpenSSH's
    order (a first, then b through a; Fabric 3 starts at b); opening a jump channel times out;
    and keepalives close a connection whose server stopped answering (_watch), so a run on it
    ends with ConnectionLost instead of waiting forever."""

    lost: str | None = None

    def get_gateway(self):
        spec = self.ssh_config.get("proxyjump")
        if spec is None:
            return super().get_gateway()
        hops = [h.strip() for h in spec.split(",") if h.strip()]
        if spec.strip().lower() == "none" or any(
                self.derive_shorthand(h)["host"] == self.host for h in hops):
            return None  # `none`, or a wildcard Host block that names this very host
        gw = None
        for hop in hops:
            gw = SshConnection(hop, config=self.config.clone(), connect_timeout=CONNECT_TIMEOUT,
                               **({"gateway": gw} if gw is not None else {}))
        return gw

    def open_gateway(self):
        if not isinstance(self.gateway, Connection):
            return super().open_gateway()
        try:
            self.gateway.open()
        except Exception as e:  # noqa: BLE001 - the jump host's own failure, named as such
            why = _unreachable_why(e)
            if why is None:
                raise
            gw = self.gateway
            raise JumpHostFailed(gw.user, gw.host, gw.port, why) from e
        return self.gateway.transport.open_channel(
            "direct-tcpip", dest_addr=(self.host, int(self.port)), src_addr=("", 0),
            timeout=CONNECT_TIMEOUT)

    def open(self):
        opened = super().open()
        if self.transport is not None and not getattr(self, "_watched", False):
            self._watched = True
            _watch(self)
        return opened

    def check_alive(self, command: str, data: str | None = None) -> None:
        if self.lost:
            what = _doing(command) + (f" (script on stdin: {_doing(data)})" if data else "")
            raise ConnectionLost(f"{self.lost} while running: {what}")

    def run(self, command, **kwargs):
        try:
            result = super().run(command, **kwargs)
        except Exception:
            self.check_alive(command)
            raise
        self.check_alive(command)
        return result

    def put(self, *args, **kwargs):
        try:
            return super().put(*args, **kwargs)
        except Exception:
            self.check_alive("a file upload (sftp)")
            raise

    def stream(self, command: str, data: str, on_out: Callable[[bytes], None],
               on_err: Callable[[bytes], None], *, timeout: float | None = None,
               silence: float | None = None) -> int | None:
        """Run `command` with `data` on its stdin (all sent at once), handing stdout and stderr
        chunks to on_out/on_err as they arrive. The exit status, or None when nothing arrived
        for `silence` seconds (a dead or frozen peer). The one paramiko read loop."""
        self.open()
        chan = self.client.get_transport().open_session(timeout=CONNECT_TIMEOUT)
        try:
            chan.exec_command(command)
            chan.sendall(data.encode())
            chan.shutdown_write()
            start = last = time.monotonic()
            # the server sends a channel's data before its exit status: once the status is
            # here and the buffers are empty, everything has been read
            while True:
                got = False
                while chan.recv_stderr_ready():
                    on_err(chan.recv_stderr(65536))
                    got = True
                if chan.recv_ready():
                    on_out(chan.recv(65536))
                    got = True
                elif chan.exit_status_ready() and not chan.recv_stderr_ready():
                    break
                now = time.monotonic()
                if timeout is not None and now - start > timeout:
                    raise invoke.exceptions.CommandTimedOut(None, timeout)
                if got:
                    last = now
                elif silence is not None and now - last > silence:
                    return None
                elif not chan.get_transport() or not chan.get_transport().is_active():
                    break  # the connection is gone: check_alive below says why
                else:
                    time.sleep(0.005)
            self.check_alive(command, data)
            return chan.recv_exit_status()
        except Exception:
            self.check_alive(command, data)
            raise
        finally:
            chan.close()

    def run_input(self, command: str, data: str, timeout: float = 600) -> "Ran":
        return _collect(self, command, data, timeout)


def _watch(cxn: SshConnection) -> None:
    """OpenSSH's ServerAlive*: every ALIVE_INTERVAL s a keepalive@openssh.com request that sshd
    must answer (it refuses it, which is an answer); none within ALIVE_INTERVAL * ALIVE_COUNT s
    closes the transport, which ends every read and command waiting on it."""
    transport = cxn.transport
    where = f"{cxn.user}@{cxn.host}" + (f":{cxn.port}" if cxn.port not in (None, 22) else "")

    def probe_loop():
        while transport.is_active():
            probe = threading.Thread(target=transport.global_request,
                                     args=("keepalive@openssh.com", None, True), daemon=True)
            probe.start()
            probe.join(ALIVE_INTERVAL * ALIVE_COUNT)
            if probe.is_alive() and transport.is_active():
                cxn.lost = (f"SSH connection to {where} lost: the server answered no keepalive "
                            f"for {ALIVE_INTERVAL * ALIVE_COUNT}s (host frozen or unreachable)")
                transport.close()
                return
            for _ in range(ALIVE_INTERVAL * 10):
                if not transport.is_active():
                    return
                time.sleep(0.1)

    threading.Thread(target=probe_loop, name=f"keepalive {where}", daemon=True).start()


def _linear(runner: type) -> type:
    """Invoke's runner joins all output so far on every chunk it reads, to feed watchers, even
    when there are none: quadratic in a command's output (`exec` of one 8 MB line took 18 s)."""
    class Linear(runner):
        def respond(self, buffer_):
            if self.watchers:
                super().respond(buffer_)
    Linear.__name__ = runner.__name__
    return Linear


_Remote = _linear(fabric.runners.Remote)
_Local = _linear(invoke.runners.Local)


class LocalConnection:
    """`connection: local` hosts: the operator's own machine, the same Connector interface."""

    lost = None

    def __init__(self, host: Host | None = None):
        self.host = "localhost"
        self.user = getpass.getuser()
        self._ctx = invoke.Context(invoke.Config(overrides={
            "run": {"hide": True, "in_stream": False}, "runners": {"local": _Local}}))

    def open(self) -> None:
        pass

    @property
    def is_connected(self) -> bool:
        return True

    def run(self, command: str, **kwargs):
        return self._ctx.run(command, **kwargs)

    def stream(self, command: str, data: str, on_out: Callable[[bytes], None],
               on_err: Callable[[bytes], None], *, timeout: float | None = None,
               silence: float | None = None) -> int | None:
        """SshConnection.stream in a local bash."""
        p = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            try:
                p.stdin.write(data.encode())
                p.stdin.close()
            except BrokenPipeError:
                pass
            sel = selectors.DefaultSelector()
            sel.register(p.stdout, selectors.EVENT_READ, on_out)
            sel.register(p.stderr, selectors.EVENT_READ, on_err)
            deadline = None if timeout is None else time.monotonic() + timeout
            open_ = 2
            while open_:
                wait = [w for w in (silence, deadline and deadline - time.monotonic())
                        if w is not None]
                ready = sel.select(timeout=max(0, min(wait)) if wait else None)
                if deadline is not None and time.monotonic() >= deadline:
                    raise invoke.exceptions.CommandTimedOut(None, timeout)
                if not ready:
                    return None
                for key, _ in ready:
                    chunk = key.fileobj.read1(65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        open_ -= 1
                    else:
                        key.data(chunk)
            return p.wait()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
            p.stderr.close()

    def run_input(self, command: str, data: str, timeout: float = 600) -> "Ran":
        return _collect(self, command, data, timeout)

    def put(self, local: str, remote: str) -> None:
        shutil.copyfile(local, remote)

    def close(self) -> None:
        pass


def _jump(inv: Inventory, spec: str, accept_new: bool) -> Connection:
    """A jump host: an inventory host name, or 'user@host:port' shorthand."""
    for h in inv.hosts:
        if h.name == spec:
            return connect(h, inv, accept_new=accept_new)
    cxn = SshConnection(spec, config=_config(), connect_timeout=CONNECT_TIMEOUT)
    _secure(cxn, inv.known_hosts, accept_new)
    return cxn


def _config() -> Config:
    return Config(overrides={
        "timeouts": {"connect": CONNECT_TIMEOUT},
        "connect_kwargs": {"banner_timeout": CONNECT_TIMEOUT, "auth_timeout": CONNECT_TIMEOUT},
        "run": {"hide": True, "in_stream": False},
        "runners": {"remote": _Remote}})


def connect(host: Host, inv: Inventory, accept_new: bool = False):
    """A Connection for `host` (not yet opened) that verifies host keys and times out."""
    if host.is_local:
        return LocalConnection(host)
    kwargs: dict[str, Any] = {
        "config": _config(),
        "connect_timeout": CONNECT_TIMEOUT,
        "connect_kwargs": {"banner_timeout": CONNECT_TIMEOUT, "auth_timeout": CONNECT_TIMEOUT},
    }
    if host.user:
        kwargs["user"] = host.user
    if host.port:
        kwargs["port"] = host.port
    if host.identity_file:
        kwargs["connect_kwargs"]["key_filename"] = [host.identity_file]
    if host.jump:
        kwargs["gateway"] = _jump(inv, host.jump, accept_new)
    cxn = SshConnection(host.address, **kwargs)
    _secure(cxn, inv.known_hosts, accept_new)
    return cxn


# --- quoting ---------------------------------------------------------------------------------

def sh(*argv: Any) -> str:
    """One shell command line from argv, every word quoted."""
    return shlex.join(str(a) for a in argv)


def with_env(command: str, env: dict[str, str]) -> str:
    """Prefix `command` with env assignments, names checked and values quoted."""
    for k in env:
        if not ENV_NAME.fullmatch(k):
            raise TorchrigError(f"environment variable name {k!r} is not valid")
    return sh("env", *(f"{k}={v}" for k, v in env.items()), "bash", "-c", command)


def privileged(command: str, user: str | None) -> str:
    """Run a (possibly compound) command line as root: directly when the login user is root,
    else through passwordless sudo (-n: fail at once rather than wait for a password).
    The whole line goes to bash as one quoted argument, so `a && b` runs entirely as root."""
    wrapped = sh("bash", "-c", command)
    return wrapped if user == "root" else f"sudo -n -- {wrapped}"


def refusal(stderr: str) -> str | None:
    """The `error: ...` line a node-side script printed, without the prefix."""
    lines = [ln[len("error: "):] for ln in stderr.splitlines() if ln.startswith("error: ")]
    return lines[-1] if lines else None


def login_user(cxn) -> str:
    return getattr(cxn, "user", None) or getpass.getuser()


def run_priv(cxn, command: str, **kwargs):
    """Run `command` as root on `cxn` (see privileged())."""
    return cxn.run(privileged(command, login_user(cxn)), **kwargs)


@dataclass
class Ran:
    exited: int
    stdout: str
    stderr: str


def _collect(cxn, command: str, data: str, timeout: float) -> Ran:
    """run_input(): `command` with `data` on its stdin, all sent at once. (Invoke feeds
    in_stream in small sleeps: a 6 KB script took a minute.) Data on stdin never shows in
    `ps` on the host, which is why scripts carrying file contents or credentials travel
    this way."""
    out, err = bytearray(), bytearray()
    rc = cxn.stream(command, data, out.extend, err.extend, timeout=timeout)
    return Ran(rc, out.decode(errors="replace"), err.decode(errors="replace"))


# --- fan-out ---------------------------------------------------------------------------------

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


class JumpHostFailed(Exception):
    """The jump host itself could not be reached: its address and reason, not the target's."""

    def __init__(self, user: str | None, address: str, port: int, why: str):
        self.login = f"{user + '@' if user else ''}{address}"
        self.where, self.port, self.why = f"{self.login}:{port}", port, why
        super().__init__(f"jump host {self.where}: {why}")


# errno of the socket error -> what it means for an SSH connection
_NET_ERRORS = {
    errno.ECONNREFUSED: "connection refused (nothing listens on that port: sshd stopped, or "
                        "a wrong port)",
    errno.EHOSTUNREACH: "no route to the host (it is down, or not on a network this machine "
                        "reaches)",
    errno.ENETUNREACH: "network unreachable from this machine",
    errno.ETIMEDOUT: "no answer (the host is down, or a firewall drops the port)",
    errno.ECONNRESET: "the connection was reset during the SSH handshake",
}


def _unreachable_why(exc: BaseException) -> str | None:
    """What failed when a host could not be reached over the network, or None when `exc` is
    not that (authentication, host keys: their own words in describe_error)."""
    if isinstance(exc, JumpHostFailed):
        return f"the jump host {exc.where} could not be reached: {exc.why}"
    if isinstance(exc, paramiko.ChannelException):  # direct-tcpip refused by the jump host
        return (f"the jump host could not open a connection to it ({exc.text or exc.code}: "
                "the host is down, sshd stopped, or a wrong address or port)")
    if isinstance(exc, paramiko.ssh_exception.ProxyCommandFailure):
        return f"its ProxyCommand failed ({exc})"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        exc = next(iter(exc.errors.values()), exc)  # one per address tried; the first says it
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the address ({exc.strerror})"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {CONNECT_TIMEOUT}s (the host is down, or a firewall drops the port)"
    code = getattr(exc, "errno", None) or {ConnectionRefusedError: errno.ECONNREFUSED,
                                            ConnectionResetError: errno.ECONNRESET}.get(type(exc))
    if isinstance(exc, OSError) and code in _NET_ERRORS:
        return _NET_ERRORS[code]
    if isinstance(exc, OSError):
        return f"network error: {exc.strerror or exc}"
    if isinstance(exc, EOFError) or (isinstance(exc, paramiko.SSHException) and (
            "protocol banner" in str(exc) or "No existing session" in str(exc))):
        return f"no SSH server answered on that port ({str(exc) or type(exc).__name__})"
    return None


def cannot_connect(host: Host, cxn, exc: BaseException) -> CannotConnect:
    """The one error for a host whose connection could not be opened: which host, what
    failed, what to try. Unreachable hosts read the same in every task."""
    if isinstance(exc, CannotConnect):
        return exc
    why = _unreachable_why(exc)
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
    why = _unreachable_why(exc)
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
