"""OpenSSH's own `ssh` as a carrier for one bulk stream (fetch's bytes), beside the paramiko
connection everything else uses.

Why: paramiko decrypts in pure Python on its packet thread: a 256 MiB stream spent half its
time waiting on that thread. `ssh` decrypts in C in its own process, so the operator's read,
hash and write overlap it, as scp's do.

The same host, as paramiko connected to it: address, port and user as Fabric resolved them
(ssh_config included), the same identity files, and the host key paramiko verified moments
before written alone into a private known_hosts that `ssh` must match (StrictHostKeyChecking,
HostKeyAlias); `-F /dev/null`, so no other configuration applies. Nothing secret goes in argv:
root is `sudo -n` or root's own login (quoting.privileged), the request travels on stdin.

When the connection's settings cannot be said to `ssh` exactly (a jump host, a ProxyCommand, a
password or key object given in code, Fabric's auth strategies) or there is no `ssh`, carrier()
says why and the caller keeps paramiko."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from .connections import ALIVE_COUNT, ALIVE_INTERVAL, CONNECT_TIMEOUT, popen_start, popen_stream
from .hostkeys import known_hosts_name

# Set to "paramiko" to keep every byte on paramiko (a client whose `ssh` misbehaves).
ENV = "TORCHRIG_BULK_SSH"
# what Fabric passes to paramiko's connect that `ssh` gets as options of its own
PLAIN_KWARGS = {"key_filename", "banner_timeout", "auth_timeout", "timeout"}
# ssh's exit status when it failed itself (could not connect, connection lost)
SSH_FAILED = 255
PIPE_SIZE = 1 << 20  # ssh's stdout pipe: 1 MiB, so ssh rarely waits on the reader


@dataclass(frozen=True)
class Target:
    """What paramiko's connection resolved: where and as whom, the verified host key."""
    address: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    key_type: str
    key_base64: str


def why_not(ssh: str | None, env: str | None, gateway: object, proxycommand: str | None,
            connect_kwargs: dict, strategy: object) -> str | None:
    """Why this connection's bytes cannot go over `ssh` (None: they can). Pure."""
    if env == "paramiko":
        return f"{ENV}=paramiko"
    if ssh is None:
        return "no ssh client on this machine (openssh-client)"
    if gateway is not None:
        return "it is reached through a jump host, which torchrig connects itself"
    if proxycommand:
        return "its ssh_config sets a ProxyCommand"
    other = sorted(set(k for k, v in connect_kwargs.items() if v is not None) - PLAIN_KWARGS)
    if other:
        return f"its connection sets {', '.join(other)}, which ssh cannot be given safely"
    if strategy is not None:
        return "Fabric's authentication strategy is in use"
    return None


def pinned_line(t: Target) -> str:
    """The one known_hosts line `ssh` may accept: the key paramiko verified, under the alias."""
    return f"{known_hosts_name(t.address, t.port)} {t.key_type} {t.key_base64}\n"


def argv(t: Target, known_hosts: str, command: str) -> list[str]:
    """`ssh` running `command` on the target: only the pinned key, no prompt, no forwarding,
    paramiko's timeouts and keepalives. Pure."""
    opts = {"BatchMode": "yes", "StrictHostKeyChecking": "yes",
            "UserKnownHostsFile": known_hosts, "GlobalKnownHostsFile": "/dev/null",
            "HostKeyAlias": known_hosts_name(t.address, t.port), "CheckHostIP": "no",
            "UpdateHostKeys": "no", "ConnectTimeout": str(CONNECT_TIMEOUT),
            "ServerAliveInterval": str(ALIVE_INTERVAL), "ServerAliveCountMax": str(ALIVE_COUNT),
            "ClearAllForwardings": "yes", "LogLevel": "ERROR"}
    out = ["ssh", "-F", "/dev/null", "-T", "-x", "-a"]
    for k, v in opts.items():
        out += ["-o", f"{k}={v}"]
    for f in t.identity_files:
        out += ["-i", f]
    return out + ["-p", str(t.port), "-l", t.user, "--", t.address, command]


def target_of(cxn) -> Target:
    """The Target of an opened SshConnection."""
    key = cxn.client.get_transport().get_remote_server_key()
    files = cxn.connect_kwargs.get("key_filename") or ()
    return Target(cxn.host, int(cxn.port), cxn.user,
                  tuple([files] if isinstance(files, str) else files),
                  key.get_name(), key.get_base64())


def carrier(cxn) -> tuple["Carrier | None", str | None]:
    """(a Carrier for the opened connection `cxn`, None) or (None, why not); (None, None) for
    a connection that is not SSH (`connection: local`: nothing to carry)."""
    if getattr(cxn, "client", None) is None:
        return None, None
    why = why_not(shutil.which("ssh"), os.environ.get(ENV), getattr(cxn, "gateway", None),
                  getattr(cxn, "ssh_config", {}).get("proxycommand"),
                  dict(getattr(cxn, "connect_kwargs", {}) or {}),
                  getattr(getattr(cxn, "authentication", None), "strategy_class", None))
    if why is None and (cxn.client.get_transport() is None
                        or not cxn.client.get_transport().is_active()):
        why = "its connection closed before the key could be read"  # the next try reconnects
    return (None, why) if why else (Carrier(target_of(cxn)), None)


class Carrier:
    """`ssh` to one target, its pinned known_hosts in a private folder while it lives."""

    carried_bytes = False  # set by the caller once a byte came over ssh
    _started: tuple[str, subprocess.Popen] | None = None  # start()'s (command, ssh)

    def __init__(self, target: Target):
        self.target = target
        self._dir = tempfile.TemporaryDirectory(prefix="torchrig-ssh-")
        self.known_hosts = os.path.join(self._dir.name, "known_hosts")
        fd = os.open(self.known_hosts, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(pinned_line(target))

    def start(self, command: str) -> None:
        """Start `ssh` running `command` now, its stdin still to come: its handshake and the
        remote command's start-up overlap what the caller asks meanwhile (fetch's listing).
        The next stream() of the same command takes it; close() ends it if none does."""
        self.close_started()
        argv_ = argv(self.target, self.known_hosts, command)
        self._started = (command, popen_start(argv_, PIPE_SIZE))

    def stream(self, command: str, data, on_out, on_err, *, silence: float | None = None):
        """Connection.stream's contract over `ssh`: the exit status (SSH_FAILED: ssh's own
        failure, a lost connection), None after `silence` seconds without a byte."""
        started = None
        if self._started and self._started[0] == command:
            started, self._started = self._started[1], None
        self.close_started()  # started for another command: not this one's
        return popen_stream(argv(self.target, self.known_hosts, command), data, on_out,
                            on_err, silence=silence, pipe_size=PIPE_SIZE, started=started)

    def close_started(self) -> None:
        """End a started `ssh` no stream() took (the remote command never got its stdin)."""
        if self._started:
            p = self._started[1]
            self._started = None
            p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()

    def close(self) -> None:
        self.close_started()
        self._dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
