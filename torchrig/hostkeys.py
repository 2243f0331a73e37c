"""Host keys: known_hosts read as OpenSSH reads it (@revoked honoured, @cert-authority and
unreadable lines skipped with a note), unknown keys refused with their fingerprint or recorded
(accept-new), for the host and every jump hop.

Fabric's Connection accepts any host key by default (AutoAddPolicy, known_hosts never read):
connections.connect() calls secure() on every connection it makes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import sys
import threading

import paramiko
from fabric import Connection

from .errors import TorchrigError


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


def secure(cxn: Connection, known_hosts: str, accept_new: bool) -> None:
    revoked = _load_known_hosts(cxn.client, known_hosts)
    cxn.client.set_missing_host_key_policy(HostKeyPolicy(known_hosts, accept_new, revoked))
    if isinstance(cxn.gateway, Connection):  # ProxyJump hops, from ssh_config or inventory
        secure(cxn.gateway, known_hosts, accept_new)


