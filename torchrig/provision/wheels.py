"""A fresh fleet downloads each wheel once (pure part; wheelshare.py runs it): which hosts
of a provision install the same wheels, the cache's name for them, and the pinned, hashed
requirements pip installs them by.

Hosts share when their python-venv step runs the same pip install (requirements, index,
trusted host) on the same platform (distro release and architecture: the same wheels fit),
and either two or more of them need it or a selected host of that platform already holds
the wheels in its cache (an air-gapped fleet provisioned from one node's cache), or the
operator has them (var pip_wheels_dir: one host or more, the index never asked)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from .steps import PipInstall

STEP = "python-venv"
# name-version(-build)?-python-abi-platform.whl (PEP 427: '-' inside a part is written '_')
WHEEL = re.compile(r"([A-Za-z0-9_.]+)-([A-Za-z0-9_.+!]+)(-\d[A-Za-z0-9_.]*)?-[^-]+-[^-]+-[^-]+\.whl")


@dataclass
class Group:
    name: str                   # the cache's set for these wheels (a node.py dataset name)
    pip: PipInstall             # what the needers' pip step installs
    needers: list = field(default_factory=list)   # Planned whose step runs `pip`
    others: list = field(default_factory=list)    # Planned of the same platform that do not

    @property
    def hosts(self) -> list:
        return self.needers + self.others


def pip_of(planned) -> PipInstall | None:
    """The host's planned pip install from pip_index_url (TensorBoard's own stays per host)."""
    for sp in planned.plan.steps:
        if sp.step.name == STEP and sp.status == "planned":
            return next((c for c in sp.changes
                         if isinstance(c, PipInstall) and c.var == "pip_index_url"), None)
    return None


def platform(planned) -> tuple:
    ctx = planned.ctx
    return (ctx.distro, ctx.arch)


def set_name(pip: PipInstall, trusted: str | None, plat: tuple, local: str | None = None) -> str:
    key = repr((sorted(pip.reqs), pip.index_url, trusted, plat) + ((local,) if local else ()))
    return "pip-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def groups(planned: list) -> list[Group]:
    """The groups of hosts that may share one download, in the order of `planned` (a
    group's first needer is its seed when nobody holds the wheels yet)."""
    out: dict[str, Group] = {}
    for p in planned:
        pip = pip_of(p)
        if pip is not None:
            name = set_name(pip, p.settings.pip_trusted_host, platform(p), p.settings.pip_wheels_dir)
            out.setdefault(name, Group(name, pip)).needers.append(p)
    for g in out.values():
        plat = platform(g.needers[0])
        g.others = [p for p in planned
                    if platform(p) == plat and all(p is not n for n in g.needers)]
    return [g for g in out.values()
            if len(g.needers) >= 2 or g.others or g.needers[0].settings.pip_wheels_dir]


def pins(files: list[dict]) -> list[str]:
    """`name==version --hash=sha256:...` per wheel of a manifest (a project with two files of
    one version gets both hashes). A file that is not a wheel: ValueError."""
    by: dict[tuple[str, str], list[str]] = {}
    for f in files:
        m = WHEEL.fullmatch(f["path"])
        if not m:
            raise ValueError(f"{f['path']} is not a wheel")
        by.setdefault((m.group(1), m.group(2)), []).append(f["sha256"])
    return [f"{name}=={ver} " + " ".join(f"--hash=sha256:{h}" for h in sorted(hashes))
            for (name, ver), hashes in sorted(by.items())]
