"""Where the hosts meet just before their pip install (apply.py calls Meet.arrive before the
python-venv step: after base-packages, so a bare seed has the venv module's pip), each group
of hosts that install the same wheels (wheels.py) gets them from the index once. One host
(the seed) downloads them as root into root's wheel cache (var wheel_cache_dir, 0700), or a
selected host already holds them there; the others receive them node to node over the
cluster network as data.push's fan-out sends a dataset (onhost/data/node.py, run as root on
that root-only store: a short-lived server bound to the
source's inventory address that serves only its destination's address with a one-time
token), each file checked against its sha256 on arrival. Each host's pip step then installs
from its own cache with `--no-index --require-hashes` (pip checks every wheel again), and
falls back to the index if that install fails. Anything else that goes wrong leaves the
group on the index, as without sharing, and says why."""

from __future__ import annotations

from pathlib import Path

from ..datasets import run as transfer
from ..datasets.manifest import CHUNK, Manifest, build, dataset_path, hash_file
from ..errors import TorchrigError
from ..secrets import Redactor
from ..session import Fleet
from . import wheels
from .apply import Planned, _last_lines, preamble, run_root_script
from .live import StepProgress
from .meeting import Meeting
from .steps import from_wheels, pip_download

CACHE = transfer.Where(lambda h: h.settings.wheel_cache_dir, make=True)


class Meet(Meeting):
    """One per provision: the hosts meet before their pip install; a group's share runs in
    its first needer's arrival (the seed, when nobody holds the wheels), then each needer's
    pip install becomes the install from its own cache."""

    WHAT, FALLBACK = "wheels", "pip installs from the index"
    STOPPED = "which was to fetch them, stopped before its pip install"

    def __init__(self, fleet: Fleet, planned: list[Planned], progress: StepProgress | None = None,
                 red: Redactor | None = None):
        super().__init__(fleet, wheels.groups(planned), progress, red)
        self.pins: dict[str, list[str]] = {}   # set name -> pip's pins (name==version --hash=)

    def members(self, g: wheels.Group) -> list[Planned]:
        return g.needers

    def share(self, g: wheels.Group) -> dict:
        got, self.pins[g.name] = _share(self.fleet, g, self.progress)
        return got

    def take(self, p: Planned, g: wheels.Group, got: dict) -> None:
        old = wheels.pip_of(p)
        if got["shared"] and old is not None:
            source = "this host's cache" if p.host.name == got["source"] else got["source"]
            swap(p, from_wheels(p.settings, old, dataset_path(p.settings.wheel_cache_dir, g.name),
                                self.pins[g.name], source))


def _share(fleet: Fleet, g: wheels.Group, progress: StepProgress) -> tuple[dict, list | None]:
    """The group's wheels into every needer's cache: what happened, and pip's pins."""
    local_dir = g.needers[0].settings.pip_wheels_dir
    if local_dir:  # the operator's own copy: this machine seeds one host, then node to node
        manifest, local = from_operator(local_dir)
        p = push_set(fleet, g.name, manifest, local, [n.host for n in g.needers])
        return _installs(g, p, manifest, None, "this machine", progress)
    listed = fleet.fan_out(lambda p: transfer.last(transfer.call(
        fleet, p.host, {"op": "ls", "name": g.name, "manifests": True}, where=CACHE),
        "datasets")["datasets"], g.hosts, name=lambda p: p.host.name)
    held = {r.host: r.value[0] for r in listed if r.ok and r.value and not r.value[0]["problems"]}
    holder = next((p for p in g.hosts if p.host.name in held), None)
    if holder is None and len(g.needers) < 2:
        return {"shared": False}, None
    if holder is None:
        holder = g.needers[0]
        manifest = _download(fleet, holder, g, progress)
        downloaded = holder.host.name
    else:
        manifest = Manifest(held[holder.host.name]["manifest"])
        downloaded = None
    p = push_set(fleet, g.name, manifest, {}, [holder.host] + [
        n.host for n in g.needers if n is not holder and n.host.name not in held])
    p.from_here = False  # this machine has no copy: such a pair fails, the group uses the index
    return _installs(g, p, manifest, downloaded, holder.host.name, progress)


def push_set(fleet: Fleet, name: str, manifest: Manifest, local: dict, hosts: list):
    """Set `name` from hosts[0] (or this machine's `local` files) to the others' root caches."""
    return transfer._Push(fleet, manifest, local, name, 0, lambda text: None,
                          transfer.Progress(), hosts=hosts, where=CACHE)


def _installs(g: wheels.Group, p, manifest: Manifest, downloaded: str | None, source: str,
              progress: StepProgress) -> tuple[dict, list]:
    """Every needer gets the wheels (the fan-out); pip's pins for their installs."""
    res = transfer._distribute(p, None)
    progress.note(p.hosts[0].name, f"wheels: {len(manifest.files)} files, "
                  f"{manifest.size / 2**20:.0f} MiB, {'downloaded once, ' if downloaded else ''}"
                  f"from {source} to {len(p.hosts) - (source != 'this machine')} host(s)")
    return {"shared": True, "downloaded_by": downloaded, "source": source,
            "files": len(manifest.files), "bytes": manifest.size,
            "operator_bytes": res.operator_bytes, "fallbacks": res.fallbacks}, wheels.pins(manifest.files)


def from_operator(folder: str) -> tuple[Manifest, dict]:
    """The manifest of the wheels in the operator's folder (var pip_wheels_dir: what `pip
    download` wrote, for the hosts' platform) and where each is here."""
    root = Path(folder).expanduser()
    files = sorted(p for p in root.glob("*.whl") if p.is_file()) if root.is_dir() else []
    if not files:
        raise TorchrigError(f"var pip_wheels_dir: no .whl file in {folder} on this machine "
                            "(fill it with `pip download --only-binary=:all: -d DIR ...`)")
    entries, local = [], {}
    for f in files:
        e = hash_file(f, CHUNK)
        entries.append({"path": f.name, **e})
        local.setdefault(e["sha256"], f)
    return build(entries), local


def _download(fleet: Fleet, seed: Planned, g: wheels.Group, progress: StepProgress):
    """The seed's `pip download` into its cache, adopted into the cache's store: the
    manifest (file names, sizes, sha256) the others receive and pip pins."""
    name = seed.host.name
    progress.note(name, f"downloading the wheels once for {len(g.needers)} hosts")
    r = run_root_script(fleet.conn(seed.host),
                        preamble(seed.settings.apt_lock_timeout) + pip_download(seed.settings, g.pip))
    if r.exited != 0:
        raise TorchrigError(f"{name}: pip download failed: {_last_lines(r.stderr or r.stdout)}")
    entries = transfer.last(transfer.call(fleet, seed.host, {"op": "adopt", "chunk": CHUNK},
                                          where=CACHE), "entries")["entries"]
    manifest = build(entries)
    transfer.call(fleet, seed.host, {"op": "commit", "name": g.name, "manifest": manifest.doc,
                                     "sha256": manifest.sha256}, where=CACHE)
    return manifest


def swap(p: Planned, cmd) -> None:
    """In the host's plan, its pip install from the index becomes `cmd`."""
    old = wheels.pip_of(p)
    for sp in p.plan.steps:
        if sp.step.name == wheels.STEP:
            sp.changes = [cmd if c is old else c for c in sp.changes]
