"""Quoting: one shell command line from argv, env assignments, and the privileged wrapper
(root directly, or passwordless sudo) that connections apply to a command run as root
(Connector's root=True: the only way to run as root)."""

from __future__ import annotations

import shlex
from typing import Any

from .errors import TorchrigError
from .settings import ENV_NAME


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


def doing(command: str) -> str:
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


