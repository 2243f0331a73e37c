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

import threading
import time
from pathlib import Path

from ..datasets import run as transfer
from ..datasets.manifest import CHUNK, Manifest, build, dataset_path, hash_file
from ..errors import TorchrigError
from ..secrets import Redactor
from ..session import Fleet, describe_error
from . import wheels
from .apply import Planned, _last_lines, preamble, run_root_script
from .live import StepProgress
from .steps import from_wheels, pip_download

CACHE = transfer.Where(lambda h: h.settings.wheel_cache_dir, make=True)


def share_group(fleet: Fleet, g: wheels.Group, progress: StepProgress | None = None,
                red: Redactor | None = None) -> dict:
    """Swap each sharing host's pip install for the install from its cache (in its plan, in
    place); anything that goes wrong leaves the group on the index and says why."""
    progress, red = progress or StepProgress(), red or Redactor()
    t0 = time.monotonic()
    try:
        return _share(fleet, g, progress) | {"seconds": round(time.monotonic() - t0, 2)}
    except Exception as e:  # noqa: BLE001 - the group installs from the index, as before
        why = red.text(describe_error(e))
        for p in g.needers:
            progress.note(p.host.name, f"wheels not shared ({why}): pip installs from the index")
        return {"error": why}


class Meet:
    """One per provision. Each host's apply calls arrive() before its pip install and left()
    when it ends; a group's share runs in its first needer's arrival (the seed, when nobody
    holds the wheels), the others wait for it there."""

    WAIT = 4 * 3600  # seconds: the seed's steps before its pip install, download and push

    def __init__(self, fleet: Fleet, planned: list[Planned], progress: StepProgress | None = None,
                 red: Redactor | None = None):
        self.fleet, self.progress, self.red = fleet, progress or StepProgress(), red or Redactor()
        self.groups = wheels.groups(planned)
        self.of = {p.host.name: g for g in self.groups for p in g.needers}
        self.ready = {g.name: threading.Event() for g in self.groups}
        self.outcome: dict[str, dict] = {}

    def arrive(self, p: Planned) -> None:
        g = self.of.get(p.host.name)
        if g is None:
            return
        if p is g.needers[0]:
            if not self.ready[g.name].is_set():
                try:
                    self.outcome[g.name] = share_group(self.fleet, g, self.progress, self.red)
                finally:
                    self.ready[g.name].set()
        elif not self.ready[g.name].wait(self.WAIT):
            self.progress.note(p.host.name, "wheels not shared (the seed did not finish): pip "
                                            "installs from the index")

    def left(self, p: Planned) -> None:
        """The host's apply ended: a seed that never arrived (an earlier step failed, the host
        changed since the plan) releases the others to the index."""
        g = self.of.get(p.host.name)
        if g is not None and p is g.needers[0] and not self.ready[g.name].is_set():
            why = f"{p.host.name}, which was to fetch them, stopped before its pip install"
            self.outcome.setdefault(g.name, {"error": why})
            for n in g.needers[1:]:
                self.progress.note(n.host.name, f"wheels not shared ({why}): pip installs "
                                                "from the index")
            self.ready[g.name].set()

    def account(self) -> dict:
        """{set name: what happened} for the report and the bench."""
        return {g.name: self.outcome.get(g.name, {"error": "no host reached its pip install"})
                for g in self.groups}


def _share(fleet: Fleet, g: wheels.Group, progress: StepProgress) -> dict:
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
        return {"shared": False}
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
              progress: StepProgress) -> dict:
    """Every needer gets the wheels (the fan-out), then installs from its cache."""
    pins = wheels.pins(manifest.files)
    res = transfer._distribute(p, None)
    for n in g.needers:
        folder = dataset_path(n.settings.wheel_cache_dir, g.name)
        swap(n, from_wheels(n.settings, wheels.pip_of(n), folder, pins,
                            "this host's cache" if n.host.name == source else source))
    progress.note(p.hosts[0].name, f"wheels: {len(manifest.files)} files, "
                  f"{manifest.size / 2**20:.0f} MiB, {'downloaded once, ' if downloaded else ''}"
                  f"from {source} to {len(p.hosts) - (source != 'this machine')} host(s)")
    return {"shared": True, "downloaded_by": downloaded, "source": source,
            "files": len(manifest.files), "bytes": manifest.size,
            "operator_bytes": res.operator_bytes,
            "hosts": sorted(n.host.name for n in g.needers), "fallbacks": res.fallbacks}


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
