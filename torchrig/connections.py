"""Connections to a host, one interface (session.Connector) for two kinds: SSH (Fabric's
Connection with strict host keys, timeouts, keepalives and ProxyJump in OpenSSH's order) and
`connection: local` (the operator's own machine). Each runs a command as the login user, or
as root with root=True (through quoting.privileged: root directly, else `sudo -n`): the one
way anything in torchrig runs as root.

Fabric's Connection waits forever to connect; connect() sets timeouts for the host and every
jump hop, and hostkeys.secure() checks their keys.
"""

from __future__ import annotations

import errno
import fcntl
import getpass
import logging
import os
import select
import selectors
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fabric.runners
import invoke
import paramiko
from fabric import Config, Connection

from .errors import TorchrigError
from .hostkeys import secure
from .inventory import Host, Inventory
from .quoting import doing, privileged

CONNECT_TIMEOUT = 10  # seconds; also used for the SSH banner and authentication
# OpenSSH's ServerAliveInterval / ServerAliveCountMax: a server that answers no keepalive for
# ALIVE_INTERVAL * ALIVE_COUNT seconds is gone (frozen, unplugged), even if TCP never says so.
# A command that is merely quiet (apt, a benchmark) is not: sshd still answers.
ALIVE_INTERVAL = 10
ALIVE_COUNT = 3
# stream(): the most bytes of stdout taken from paramiko's buffer at once. Its buffer holds up
# to a window (2 MiB); each read moves what is left to the front, so reading it in 64 KiB
# bites costs a copy of the rest each time (fetch of 256 MiB: ~0.2 s of 1.8).
RECV = 1 << 20
EOF_GRACE = 1.0

# paramiko logs its own tracebacks (e.g. "Error reading SSH protocol banner") through Python's
# last-resort handler onto the terminal, before torchrig's one error line. A handler here keeps
# them out; `torchrig --debug` (a root handler) still shows them.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class ConnectionLost(TorchrigError):
    pass


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
            why = unreachable_why(e)
            if why is None:
                raise
            gw = self.gateway
            raise JumpHostFailed(gw.user, gw.host, gw.port, why) from e
        return self.gateway.transport.open_channel(
            "direct-tcpip", dest_addr=(self.host, int(self.port)), src_addr=("", 0),
            timeout=CONNECT_TIMEOUT)

    def open(self):
        sock = None
        if not self.is_connected and not self.gateway:  # a jump's channel: its hop's socket
            sock = self.connect_kwargs["sock"] = ssh_socket(self.host, int(self.port))
        try:
            opened = super().open()
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        finally:
            self.connect_kwargs.pop("sock", None)
        if self.transport is not None and not getattr(self, "_watched", False):
            self._watched = True
            _watch(self)
        return opened

    def check_alive(self, command: str, data: str | None = None) -> None:
        if self.lost:
            what = doing(command) + (f" (script on stdin: {doing(data)})" if data else "")
            raise ConnectionLost(f"{self.lost} while running: {what}")

    def run(self, command, *, root: bool = False, **kwargs):
        command = as_root(self, command) if root else command
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

    def stream(self, command: str, data, on_out: Callable[[bytes], None],
               on_err: Callable[[bytes], None], *, root: bool = False,
               timeout: float | None = None, silence: float | None = None) -> int | None:
        """Run `command` (as root with root=True) with `data` on its stdin (text, all sent at
        once; or an iterable of byte chunks, sent as they come: see _feed),
        handing stdout and stderr chunks to on_out/on_err as they arrive. The exit status, or
        None when nothing arrived for `silence` seconds (a dead or frozen peer). The one
        paramiko read loop."""
        command = as_root(self, command) if root else command
        self.open()
        chan = self.client.get_transport().open_session(timeout=CONNECT_TIMEOUT)
        try:
            chan.exec_command(command)
            feeding = _feed(data, chan.sendall, chan.shutdown_write)
            start = last = time.monotonic()
            # sshd can send the exit status while output is still waiting for window space
            # (a fast command, a big output): the status alone does not mean everything was
            # read. Everything has been read once the status, EOF and empty buffers are here;
            # a status without EOF (a child left holding the pipe) ends after EOF_GRACE s
            # without a byte
            while True:
                got = False
                while chan.recv_stderr_ready():
                    on_err(chan.recv_stderr(65536))
                    got = True
                if chan.recv_ready():
                    on_out(chan.recv(RECV))
                    got = True
                elif chan.exit_status_ready() and not chan.recv_stderr_ready() and (
                        chan.eof_received or time.monotonic() - last > EOF_GRACE):
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
                elif chan.eof_received:  # paramiko's pipe stays set after EOF
                    time.sleep(0.005)
                else:  # paramiko's pipe on the channel: wakes as soon as data arrives
                    select.select([chan], [], [], 0.005)
            self.check_alive(command, data)
            feeding.done()
            return chan.recv_exit_status()
        except Exception:
            self.check_alive(command, data)
            raise
        finally:
            chan.close()

    def run_input(self, command: str, data: str, timeout: float = 600, *,
                  root: bool = False) -> "Ran":
        return _collect(self, as_root(self, command) if root else command, data, timeout)


class _feed:
    """A command's stdin: `data` as text (sent at once, as it always was) or an iterable of
    byte chunks (a file's bytes, sent while the output is read: a thread, so a long upload
    and the command's replies do not wait on each other). done() re-raises the iterable's
    own error, if it had one (a local file that could not be read)."""

    def __init__(self, data, send: Callable[[bytes], Any], close: Callable[[], Any]):
        self.error: BaseException | None = None
        self.thread = None
        if isinstance(data, (str, bytes)):
            self._run([data.encode() if isinstance(data, str) else data], send, close)
        else:
            self.thread = threading.Thread(target=self._run, args=(data, send, close), daemon=True)
            self.thread.start()

    def _run(self, chunks, send, close) -> None:
        try:
            for chunk in chunks:
                send(chunk)
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command ended or the connection dropped: its exit status says which
        except BaseException as e:  # noqa: BLE001 - handed to done()
            self.error = e
        finally:
            try:
                close()
            except (OSError, EOFError, paramiko.SSHException):
                pass

    def done(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=5)
        if self.error is not None:
            raise self.error


class _AckAtOnce(socket.socket):
    """A socket that acknowledges what it reads at once (Linux's TCP_QUICKACK, which the kernel
    drops again by itself, so set after every read). sshd leaves Nagle's algorithm on for a
    command without a terminal: right after authentication it sends two small messages
    (hostkeys-00, a debug line) that need no reply, and then holds its answer to the first
    channel until they are acknowledged; a delayed ACK made every connection's first command
    wait 40 ms (55 ms against 11 on the testbed, bench/roundtrip_bench.py)."""

    def recv(self, *args):
        data = super().recv(*args)
        if data:  # b"": the peer closed, nothing to acknowledge
            try:
                self.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            except OSError:  # closed here meanwhile (paramiko's close, from another thread)
                pass
        return data


def ssh_socket(host: str, port: int) -> socket.socket:
    """The TCP connection to an SSH server: Nagle's algorithm off, and (on Linux) every read
    acknowledged at once (_AckAtOnce). paramiko sets no socket option; with Nagle on, a small
    SSH message sent while an earlier one is unacknowledged waits for the server's delayed ACK
    (40 ms on Linux): measured on the testbed, 44 ms per command's channel (2 ms without) and
    62 ms per handshake (18 ms). paramiko writes each SSH packet whole, so nothing is sent in
    tinier pieces for it. Errors as paramiko's own connect raises them (unreachable_why reads
    both)."""
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not hasattr(socket, "TCP_QUICKACK"):  # macOS: no such option
        return sock
    timeout = sock.gettimeout()
    quick = _AckAtOnce(sock.family, sock.type, sock.proto, fileno=sock.detach())
    quick.settimeout(timeout)
    return quick


def _watch(cxn: SshConnection) -> None:
    """OpenSSH's ServerAlive*: every ALIVE_INTERVAL s a keepalive@openssh.com request that sshd
    must answer (it refuses it, which is an answer); none within ALIVE_INTERVAL * ALIVE_COUNT s
    closes the transport, which ends every read and command waiting on it."""
    transport = cxn.transport
    where = f"{cxn.user}@{cxn.host}" + (f":{cxn.port}" if cxn.port not in (None, 22) else "")

    def keepalive():
        try:
            transport.global_request("keepalive@openssh.com", None, True)
        except (EOFError, OSError, paramiko.SSHException):
            pass  # the connection closed meanwhile (the task is done): nothing to report

    def probe_loop():
        while transport.is_active():
            probe = threading.Thread(target=keepalive, daemon=True)
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

    def run(self, command: str, *, root: bool = False, **kwargs):
        return self._ctx.run(as_root(self, command) if root else command, **kwargs)

    def stream(self, command: str, data, on_out: Callable[[bytes], None],
               on_err: Callable[[bytes], None], *, root: bool = False,
               timeout: float | None = None, silence: float | None = None) -> int | None:
        """SshConnection.stream in a local bash."""
        return popen_stream(["bash", "-c", as_root(self, command) if root else command], data,
                            on_out, on_err, timeout=timeout, silence=silence)

    def run_input(self, command: str, data: str, timeout: float = 600, *,
                  root: bool = False) -> "Ran":
        return _collect(self, as_root(self, command) if root else command, data, timeout)

    def put(self, local: str, remote: str) -> None:
        shutil.copyfile(local, remote)

    def close(self) -> None:
        pass


def popen_start(argv: list[str], pipe_size: int = 0) -> subprocess.Popen:
    """A local process for popen_stream(), started ahead of its stdin (its start-up, e.g.
    ssh's handshake, overlaps whatever the caller does before it has the data). pipe_size: a
    larger stdout pipe (F_SETPIPE_SZ), so a fast writer rarely waits on the reader."""
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    if pipe_size:
        try:
            fcntl.fcntl(p.stdout.fileno(), fcntl.F_SETPIPE_SZ, pipe_size)
        except OSError:
            pass  # over /proc/sys/fs/pipe-max-size: the default pipe still works
    return p


def popen_stream(argv: list[str], data, on_out: Callable[[bytes], None],
                 on_err: Callable[[bytes], None], *, timeout: float | None = None,
                 silence: float | None = None, pipe_size: int = 0,
                 started: subprocess.Popen | None = None) -> int | None:
    """Connector.stream's contract for a local process (a local bash, OpenSSH's ssh): `data`
    on its stdin, stdout and stderr chunks handed over as they come, the exit status or None
    after `silence` seconds without a byte. `started`: that process, already started by
    popen_start(argv, pipe_size) (it is ended here as one started here would be)."""
    p = started or popen_start(argv, pipe_size)
    try:
        read = max(pipe_size, 65536)
        feeding = _feed(data, p.stdin.write, p.stdin.close)
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
                chunk = os.read(key.fd, read)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_ -= 1
                else:
                    key.data(chunk)
        feeding.done()
        return p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            try:
                f.close()
            except OSError:
                pass


def _jump(inv: Inventory, spec: str, accept_new: bool) -> Connection:
    """A jump host: an inventory host name, or 'user@host:port' shorthand."""
    for h in inv.hosts:
        if h.name == spec:
            return connect(h, inv, accept_new=accept_new)
    cxn = SshConnection(spec, config=_config(), connect_timeout=CONNECT_TIMEOUT)
    secure(cxn, inv.known_hosts, accept_new)
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
    secure(cxn, inv.known_hosts, accept_new)
    return cxn


def login_user(cxn) -> str:
    return getattr(cxn, "user", None) or getpass.getuser()


def as_root(cxn, command: str) -> str:
    """`command` as the connection runs it with root=True (see quoting.privileged)."""
    return privileged(command, login_user(cxn))


def stream_carried(carrier, cxn, command: str, data, on_out, on_err, *, root: bool = False,
                   silence: float | None = None):
    """cxn.stream's contract with the bytes carried by `carrier` (OpenSSH's ssh to the same
    host: torchrig/openssh.py), root as cxn runs it: root's wrapping stays in this module."""
    return carrier.stream(as_root(cxn, command) if root else command, data, on_out, on_err,
                          silence=silence)


def start_carried(carrier, cxn, command: str, *, root: bool = False) -> None:
    """Have `carrier` start `command` (root as cxn runs it) now, ahead of its stdin: a later
    stream_carried() of the same command takes that process (see openssh.Carrier.start)."""
    carrier.start(as_root(cxn, command) if root else command)


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


def unreachable_why(exc: BaseException) -> str | None:
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


