"""The host's facts as planners see them: only what was requested, by the declarations in
facts/provision_facts.FACTS. Reading a fact that the fact request did not ask for is an
error, never a silent None or empty default, so a planner that reads a file, package or unit
nobody asked the host about fails in the first unit test instead of planning a change on
every run. Also the plan's fingerprint of the facts (volatile facts left out)."""

from __future__ import annotations

import hashlib
import json
from fnmatch import fnmatchcase
from typing import Any

from ..errors import TorchrigError
from ..facts import provision_facts


class FactNotRequested(TorchrigError):
    pass


class Facts:
    """`raw`: the facts dict (provision_facts.facts); `request`: the want it was gathered
    for, with "facts": the plain facts the planners named (steps.fact_request). What a planner
    may read follows from provision_facts.FACTS: a plain fact when named, a keyed one for the
    keys asked."""

    def __init__(self, raw: dict, request: dict):
        self.raw = raw
        self._asked = {f.name: f.asked(request) for f in provision_facts.FACTS if not f.plain}
        self._named = set(request.get("facts") or ())
        self._plain = provision_facts.plain()  # once per view, not once per read

    def __getitem__(self, name: str) -> Any:
        if name not in self._plain:
            raise FactNotRequested(f"fact {name!r} is not a plain fact "
                                   f"({', '.join(sorted(self._plain))}) "
                                   "in facts/provision_facts.py; use its accessor")
        if name not in self._named:
            raise FactNotRequested(f"fact {name!r} was read but no planner names it: add it to "
                                   "the reads of the step that reads it (provision/steps.py)")
        if name not in self.raw:
            raise FactNotRequested(f"fact {name!r} missing from the gathered facts")
        return self.raw[name]

    def _keyed(self, fact: str, key: str) -> Any:
        if key not in self._asked[fact]:
            raise FactNotRequested(f"fact {fact}[{key!r}] was read by a planner but not "
                                   "requested: add it to the reads of the step that reads it "
                                   "(provision/steps.py; a file: managed.py)")
        return (self.raw.get(fact) or {}).get(key)

    def _whole(self, fact: str, what: str) -> dict:
        if what not in self._asked[fact]:
            raise FactNotRequested(f"fact {fact} {what!r} was read but the request asked for "
                                   f"{sorted(self._asked[fact], key=str)!r}")
        return self.raw.get(fact) or {}

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
        return self._whole("node", True)

    def venv(self, path: str) -> dict:
        return self._whole("venv", path)


def fingerprint(raw: dict) -> str:
    """A short hash of the facts a plan was built from (volatile ones left out)."""
    volatile = provision_facts.volatile()
    stable = {k: v for k, v in raw.items() if k not in volatile}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]


def what_changed(old: dict, new: dict, limit: int = 6) -> list[str]:
    """The facts that differ, as `kind[key]` (file contents and credentials never shown)."""
    out, volatile = [], provision_facts.volatile()
    for k in sorted(set(old) | set(new)):
        if k in volatile or old.get(k) == new.get(k):
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}[{sub}]" for sub in sorted(set(a) | set(b), key=str)
                    if a.get(sub) != b.get(sub)]
        else:
            out.append(k)
    return out[:limit] + ([f"{len(out) - limit} more"] if len(out) > limit else [])
