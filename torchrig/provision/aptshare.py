"""A fresh fleet downloads each .deb once (the wheels' counterpart: wheelshare.py).

What apt downloads depends on the host's apt configuration, which the cuda-repo step makes
(the sources, the driver's pin, apt-get update). So the hosts that install the same packages
on the same platform meet (meeting.py) in their own apply, just before their first apt
install: the group's first host (the seed) downloads, once, every .deb its installs
need, with its own apt into root's cache (apt checks each against its signed index), and
sends them node to node into the others' root-only caches as wheelshare does (each file
checked against its sha256 on arrival). Then each host asks its own apt which .debs its
installs would download, with their SHA-256 from its own signed index (`--print-uris`), and
puts into apt's cache only the shared files whose SHA-256 is that one: apt takes a .deb of
the right size found there without downloading it, and downloads the rest as before.
Anything that goes wrong leaves the host on the index, as without sharing, and says why.

Not shared: the apt lists (each host's apt-get update), and an air-gapped fleet's packages
(apt needs its repositories' lists anyway: point them at a site mirror)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from ..changes.model import AptInstall
from ..datasets import run as transfer
from ..datasets.manifest import CHUNK, build, dataset_path
from ..errors import TorchrigError
from ..secrets import Redactor
from ..session import Fleet
from . import wheels
from .apply import Planned, _last_lines, preamble, run_root_script
from .live import StepProgress
from .meeting import Meeting
from .steps import apt_download, apt_uris, place_debs
from .wheelshare import CACHE, push_set


# ---- pure: who shares, and what apt says it would download --------------------------------

def specs_of(planned: Planned) -> tuple[str, ...]:
    """Every package the host's planned steps apt-get install, in plan order, once each."""
    out: dict[str, None] = {}
    for sp in planned.plan.steps:
        if sp.status == "planned":
            for c in sp.changes:
                if isinstance(c, AptInstall):
                    out.update(dict.fromkeys(c.specs))
    return tuple(out)


@dataclass
class Group:
    key: tuple                                  # (platform, NVIDIA repository)
    hosts: list = field(default_factory=list)   # Planned; the first is the seed

    @property
    def installs(self) -> list[tuple[str, ...]]:
        """Each distinct set of packages the hosts install (an NVSwitch box's driver
        packages differ; the rest is the same): the seed downloads each in turn into one
        folder, where apt finds what an earlier set already brought."""
        return list(dict.fromkeys(specs_of(p) for p in self.hosts))

    @property
    def name(self) -> str:
        """The cache's set for these .debs."""
        key = repr((sorted(self.installs), self.key))
        return "apt-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def groups(planned: list[Planned]) -> list[Group]:
    """Hosts of one platform that apt-get install from the same NVIDIA repository, two or more
    of them, in the order of `planned`."""
    out: dict[tuple, Group] = {}
    for p in planned:
        if specs_of(p):
            key = (wheels.platform(p), p.ctx.repo.url)
            out.setdefault(key, Group(key)).hosts.append(p)
    return [g for g in out.values() if len(g.hosts) >= 2]


# apt-get --print-uris: 'URI' FILE SIZE HASH (HASH: SHA256:hex where the index has one)
URI_LINE = re.compile(r"'[^']*' (\S+\.deb) (\d+) SHA256:([0-9a-f]{64})")


def parse_uris(text: str) -> dict[str, tuple[int, str]]:
    """{file name in apt's cache: (size, sha256)} of each .deb apt would download."""
    return {m.group(1): (int(m.group(2)), m.group(3))
            for m in map(URI_LINE.match, text.splitlines()) if m}


def matching(wanted: dict[str, tuple[int, str]], files: list[dict]) -> list[str]:
    """The shared files (a manifest's entries) that are exactly what apt wants: same name,
    size and SHA-256 as the host's own index says."""
    have = {f["path"]: (f["size"], f["sha256"]) for f in files}
    return sorted(n for n, want in wanted.items() if have.get(n) == want)


# ---- effects: the meeting -----------------------------------------------------------------

class Meet(Meeting):
    """One per provision: the hosts meet before their first apt install; the seed downloads
    and sends, each host puts into apt's cache what its own index asks for."""

    WHAT, FALLBACK = ".debs", "apt downloads from the index"
    STOPPED = "which was to download them, stopped before its installs"

    def __init__(self, fleet: Fleet, planned: list[Planned], progress: StepProgress | None = None,
                 red: Redactor | None = None):
        super().__init__(fleet, groups(planned), progress, red)
        self.files: dict[str, list[dict]] = {}   # set name -> the shared manifest's entries

    def members(self, g: Group) -> list[Planned]:
        return g.hosts

    def share(self, g: Group) -> dict:
        seed = g.hosts[0]
        name, fleet = seed.host.name, self.fleet
        self.progress.note(name, f"downloading the .debs once for {len(g.hosts)} hosts")
        # the store exists (ls makes it) before the download writes into it
        transfer.call(fleet, seed.host, {"op": "ls", "name": g.name}, where=CACHE)
        r = run_root_script(fleet.conn(seed.host), preamble(seed.settings.apt_lock_timeout)
                            + apt_download(seed.settings, [list(i) for i in g.installs]))
        if r.exited != 0:
            raise TorchrigError(f"{name}: apt-get --download-only failed: "
                                f"{_last_lines(r.stderr or r.stdout)}")
        entries = transfer.last(transfer.call(fleet, seed.host, {"op": "adopt", "chunk": CHUNK},
                                              where=CACHE), "entries")["entries"]
        if not entries:
            raise TorchrigError(f"{name}: apt had nothing to download")
        manifest = build(entries)
        transfer.call(fleet, seed.host, {"op": "commit", "name": g.name, "manifest": manifest.doc,
                                         "sha256": manifest.sha256}, where=CACHE)
        p = push_set(fleet, g.name, manifest, {}, [h.host for h in g.hosts])
        p.from_here = False  # this machine has no copy: such a pair fails, the group uses the index
        res = transfer._distribute(p, None)
        self.progress.note(name, f".debs: {len(manifest.files)} files, "
                                 f"{manifest.size / 2**20:.0f} MiB, downloaded once, from {name} "
                                 f"to {len(g.hosts) - 1} host(s)")
        self.files[g.name] = manifest.files
        return {"shared": True, "downloaded_by": name, "files": len(manifest.files),
                "bytes": manifest.size, "fallbacks": res.fallbacks}

    def take(self, p: Planned, g: Group, got: dict) -> None:
        placed = self._place(p, g, self.files[g.name])
        got.setdefault("placed", {})[p.host.name] = placed
        self.progress.note(p.host.name, f".debs: {placed} of {got['downloaded_by']}'s download "
                                        "in apt's cache (SHA-256 as this host's index gives)")

    def _place(self, p: Planned, g: Group, files: list[dict]) -> int:
        """Into this host's apt cache, the shared .debs its own index asks for; their count."""
        cxn, s = self.fleet.conn(p.host), p.settings
        r = run_root_script(cxn, preamble(s.apt_lock_timeout) + apt_uris(list(specs_of(p))))
        if r.exited != 0:
            raise TorchrigError(f"apt-get --print-uris failed: {_last_lines(r.stderr or r.stdout)}")
        names = matching(parse_uris(r.stdout), files)
        if names:
            r = run_root_script(cxn, preamble(s.apt_lock_timeout)
                                + place_debs(dataset_path(s.wheel_cache_dir, g.name), names))
            if r.exited != 0:
                raise TorchrigError(f"cannot put them in apt's cache: "
                                    f"{_last_lines(r.stderr or r.stdout)}")
        return len(names)
