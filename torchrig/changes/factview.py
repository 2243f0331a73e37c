"""The host's facts as planners see them: only what was requested. Reading a fact that the
fact request did not ask for is an error, never a silent None or empty default, so a planner
that reads a file, package or unit nobody asked the host about fails in the first unit test
instead of planning a change on every run. Also the plan's fingerprint of the facts."""

from __future__ import annotations

import hashlib
import json
from fnmatch import fnmatchcase
from typing import Any

from ..errors import TorchrigError

# Reported by every gather whatever the request (the dict shape gather returns).
ALWAYS = frozenset({"os_release", "arch", "kernel", "euid", "boot_id", "disk_free_gb", "lspci",
                    "secure_boot", "held", "dpkg_audit", "dpkg_updates_pending", "nvidia_smi",
                    "firewall"})
# Facts keyed by what was requested: request key -> the facts' key.
KEYED = {"packages": "packages", "available": "available", "files": "files",
         "secret_files": "files", "dirs": "dirs", "paths": "paths", "users": "users",
         "units": "units"}
# Change by themselves between plan and apply without anything to re-plan (free space moves
# with every log line; preflight checks it again when applying).
VOLATILE = frozenset({"disk_free_gb"})


class FactNotRequested(TorchrigError):
    pass


class Facts:
    def __init__(self, raw: dict, request: dict):
        self.raw = raw
        self._asked: dict[str, set[str]] = {}
        for key, fact in KEYED.items():
            self._asked.setdefault(fact, set()).update(request.get(key) or [])
        self._venv = request.get("venv")
        self._node = bool(request.get("node"))

    def __getitem__(self, name: str) -> Any:
        if name not in ALWAYS:
            raise FactNotRequested(f"fact {name!r} is not one every gather reports "
                                   f"({', '.join(sorted(ALWAYS))}); use its accessor")
        if name not in self.raw:
            raise FactNotRequested(f"fact {name!r} missing from the gathered facts")
        return self.raw[name]

    def _keyed(self, fact: str, key: str) -> Any:
        if key not in self._asked[fact]:
            raise FactNotRequested(f"fact {fact}[{key!r}] was read by a planner but not "
                                   "requested: add it to provision's fact request "
                                   "(steps.fact_request, or managed.py for a file)")
        return (self.raw.get(fact) or {}).get(key)

    def file(self, path: str) -> dict | None:
        return self._keyed("files", path)

    def pkg(self, name: str) -> str | None:
        return self._keyed("packages", name)

    def installed(self, globs: tuple[str, ...]) -> dict[str, str]:
        """{package: version} of the installed packages matching any of these dpkg globs
        (each one requested as a package)."""
        for g in globs:
            self._keyed("packages", g)
        return {p: v for p, v in sorted((self.raw.get("packages") or {}).items())
                if any(fnmatchcase(p, g) for g in globs)}

    def available(self, spec: str) -> bool | None:
        return self._keyed("available", spec)

    def dir(self, path: str) -> dict | None:
        return self._keyed("dirs", path)

    def path_exists(self, path: str) -> bool:
        return bool(self._keyed("paths", path))

    def user(self, name: str) -> dict | None:
        return self._keyed("users", name)

    def unit(self, name: str) -> dict:
        return self._keyed("units", name) or {}

    def node(self) -> dict:
        """CPU topology, memory, hostname and GPU access (Slurm's node description)."""
        if not self._node:
            raise FactNotRequested("fact node was read but not requested (request 'node')")
        return self.raw.get("node") or {}

    def venv(self, path: str) -> dict:
        if path != self._venv:
            raise FactNotRequested(f"fact venv {path!r} was read but the request asked for "
                                   f"{self._venv!r}")
        return self.raw.get("venv") or {}


def fingerprint(raw: dict) -> str:
    """A short hash of the facts a plan was built from (volatile ones left out)."""
    stable = {k: v for k, v in raw.items() if k not in VOLATILE}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]


def what_changed(old: dict, new: dict, limit: int = 6) -> list[str]:
    """The facts that differ, as `kind[key]` (file contents and credentials never shown)."""
    out = []
    for k in sorted(set(old) | set(new)):
        if k in VOLATILE or old.get(k) == new.get(k):
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}[{sub}]" for sub in sorted(set(a) | set(b), key=str)
                    if a.get(sub) != b.get(sub)]
        else:
            out.append(k)
    return out[:limit] + ([f"{len(out) - limit} more"] if len(out) > limit else [])
