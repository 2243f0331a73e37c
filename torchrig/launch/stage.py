"""What a job runs, put on every node before anything starts: the code (torchrig's payload/, or
the user's project with `--workdir`) as a verified release, and the project's dependencies as
a job environment equal on every node. Both backends (run.py, slurm.py) call stage()."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import TorchrigError
from ..inventory import Host
from ..resources import PAYLOAD
from ..session import Fleet
from . import deps
from .imports import check_module, import_roots
from .push import Found, push, switch_script
from .tree import SUPPORT_DIR, Tree, payload_tree, project_tree, with_support

PAYLOAD_BASE = "payload"     # {prefix}/payload: torchrig's own payload's releases
WORKDIR_BASE = "workdirs"    # {prefix}/workdirs: users' projects' releases


@dataclass
class Source:
    """What the launch pushes, read once on the operator's machine."""
    tree: Tree
    base: str                          # PAYLOAD_BASE or WORKDIR_BASE
    support: str                       # where torchrig's files are in the release
    requirements: deps.Requirements | None = None
    allow_torch_change: bool = False
    # the project's package folders (imports.py), on PYTHONPATH after its top; and where
    # that was read
    paths: tuple[str, ...] = ()
    paths_from: str = ""
    requires_python: str | None = None  # pyproject.toml's, checked against the nodes' Python


@dataclass
class Staged:
    release: str                       # the release folder on every node
    support: str
    paths: tuple[str, ...] = ()        # Source.paths
    python: str | None = None          # the job environment's python (None: the torch venv)
    sent: int = 0                      # files sent, all nodes together
    envs: dict[str, deps.Built] | None = None
    switch: str = ""                   # stage(switch=False): the root script that makes the
                                       # release current, for the caller's next script per node


def source(o, first: Host) -> Source:
    """The launch's code and dependencies (o: LaunchOptions); refused before any host is
    touched where they cannot be pushed as they are."""
    if o.workdir is None:
        if o.requirements is not None:
            raise TorchrigError("--requirements: a file of your project; add --workdir")
        return Source(payload_tree(PAYLOAD), PAYLOAD_BASE, "")
    s = first.settings
    tree = project_tree(Path(o.workdir), s.workdir_max_mb << 20)
    pyproject, cfg = deps.read_pyproject(tree.root), tree.root / "setup.cfg"
    reqs = deps.find(tree.root, o.requirements, pyproject)
    if reqs is not None:
        deps.check_torch(reqs, s.torch_version, o.allow_torch_change)
    paths, paths_from = import_roots(tree.files, pyproject,
                                     cfg.read_text(errors="replace") if "setup.cfg" in tree.files else None)
    if o.module is not None:
        check_module(o.module, tree.files, paths)
    return Source(with_support(tree, PAYLOAD), WORKDIR_BASE, SUPPORT_DIR, reqs,
                  o.allow_torch_change, paths, paths_from, deps.requires_python(pyproject))


def push_base(src: Source, prefix: str) -> str:
    return f"{prefix}/{src.base}"


def release_of(src: Source, prefix: str) -> str:
    return f"{push_base(src, prefix)}/releases/{src.tree.hash}"


def stage(fleet: Fleet, hosts: list[Host], src: Source, log=print,
          found: dict[str, Found] | None = None, switch: bool = True) -> Staged:
    """Push the release to every node and make its job environment there, in one pass per
    node (nodes in parallel); anything short of every node ready is an error, and nothing
    has started. found: what each node's probe found of the release already (push.
    probe_request, asked by the caller's probe: no round trip for it here); switch=False:
    the release is made current by the caller's next root script on each node
    (Staged.switch), not in a round trip of its own."""
    s = hosts[0].settings
    prefix = s.prefix
    env = None
    if src.requirements is not None:
        h = env = deps.env_hash(src.requirements, s.torch_version, s.venv, s.deps_index_url,
                                src.allow_torch_change)
        text = deps.ensure_script(src.requirements, prefix, h, s.venv, s.deps_index_url, s.pip_trusted_host,
                                  src.allow_torch_change)
        log(f"job environment {h}: {len(src.requirements.lines)} requirement(s) from "
            f"{src.requirements.source}")

    def one(host: Host):
        cxn = fleet.conn(host)
        release, sent = push(cxn, src.tree, push_base(src, prefix),
                             (found or {}).get(host.name), switch)
        built = None
        if env is not None:
            t0 = time.monotonic()
            built = deps.ensure(
                lambda cmd, data, timeout: fleet.run(host, cmd, root=True, timeout=timeout,
                                                     data=data),
                src.requirements, env, host.settings.deps_timeout, text)
            log(f"  {host.name}: job environment {built.state} in "
                f"{time.monotonic() - t0:.1f}s ({len(built.packages)} packages)")
        return release, sent, built

    pushed = fleet.fan_out(one, hosts)
    bad = [f"{r.host}: {r.error}" for r in pushed if not r.ok]
    if bad:
        raise TorchrigError("nothing started: staging the job failed: " + "; ".join(bad))
    releases = {r.value[0] for r in pushed}
    if len(releases) != 1:
        raise TorchrigError(f"nothing started: the nodes hold different releases: {releases}")
    out = Staged(releases.pop(), src.support, src.paths, sent=sum(r.value[1] for r in pushed),
                 switch="" if switch else switch_script(push_base(src, prefix), src.tree.hash))
    log(f"{src.base} {out.release} on {len(hosts)} node(s) ({out.sent} file(s) sent)")
    if src.paths:
        log(f"  its packages import from {', '.join(src.paths)} too ({src.paths_from})")
    if env is not None:
        out.envs = {r.host: r.value[2] for r in pushed}
        diff = deps.differences(out.envs)
        if diff:
            raise TorchrigError("nothing started: the job environments differ: " + "; ".join(diff)
                                + f" (remove {deps.envs_dir(prefix)}/{env} on the node named "
                                "and launch again: it is built afresh)")
        out.python = f"{deps.envs_dir(prefix)}/{env}/bin/python"
    return out
