"""Push the payload directory to a node: content-hashed releases, only changed files sent,
switched into place atomically, so an interrupted push leaves the previous payload in use.

Layout on the node:  <base>/releases/<tree hash>/   (complete, read-only)
                     <base>/current -> releases/<tree hash>
where <base> is {prefix}/payload for torchrig's payload and {prefix}/workdirs for a user's
project (stage.py).
A job's unit points at its own release, so a later push never changes a running job's code.
"""

from __future__ import annotations

import base64
import io
import json
import re
from dataclasses import dataclass, field

from ..errors import TorchrigError
from ..onhost import script
from .tree import Tree, tree_hash



def _tar(tree: Tree, files: list[str]) -> str:
    import tarfile  # only when something is sent (its import is not free on launch's path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in files:
            e = tree.files[rel]
            info = tar.gettarinfo(str(e.source), arcname=rel)  # lstat: a link stays a link
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if e.link is not None:
                tar.addfile(info)
            else:
                with open(e.source, "rb") as f:
                    tar.addfile(info, f)
    return _b64(buf.getvalue())


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class Found:
    """What a node holds of a release: complete (nothing to send), else the release `current`
    points at (src, the base of a delta; "" for none) and its manifest."""
    have: bool
    src: str = ""
    remote: dict = field(default_factory=dict)


MANIFEST_LIMIT = 32 << 20  # a project's manifest: workdir_max_mb's files, ~100 bytes each


def probe_request(base: str, h: str) -> dict:
    """The probe's part that finds release h under base: read only (launch's first probe
    asks it with its gates, in the same round trip). push/probe.sh answers the same, under
    the lock, where no probe came first."""
    return {"exists": [f"{base}/releases/{h}/.complete"],
            # current: root's own link (follow); its manifest names the release (tree_hash)
            "read": {"release": {"path": f"{base}/current/.manifest.json",
                                 "limit": MANIFEST_LIMIT, "follow": True}}}


def found(raw: dict, base: str, h: str) -> Found:
    """probe_request's answer in the probe's raw reply (pure)."""
    if raw["exists"].get(f"{base}/releases/{h}/.complete"):
        return Found(True)
    return _delta_base("", (raw["read"].get("release") or {}).get("text", "{}"))


def _delta_base(src: str, text: str) -> Found:
    try:
        remote = json.loads(text)
    except ValueError:
        remote = {}
    if not isinstance(remote, dict) or not remote:
        return Found(False)
    src = src or tree_hash(remote)
    if not re.fullmatch(r"[0-9a-f]{16}", src.strip()):
        return Found(False)   # no usable release to build on: send everything
    return Found(False, src.strip(), remote)


def switch_script(base: str, h: str) -> str:
    """The root script that makes release h current under base (and sweeps old releases)."""
    return script("push/switch.sh", base=base, h=h)


def push(cxn, tree: Tree, base: str, known: Found | None = None,
         switch: bool = True) -> tuple[str, int]:
    """Make `tree` the node's current release under `base`. Returns (release dir, files sent).
    known: what the node's probe found already (no probe round trip here); switch=False: the
    caller runs switch_script() in its own next root script on the node."""
    m = tree.manifest()
    h = tree.hash
    if known is None:
        r = cxn.run(script("push/probe.sh", base=base, h=h), root=True, hide=True, warn=True)
        if r.exited != 0:
            raise TorchrigError(f"payload probe failed: {r.stderr.strip()[-300:]}")
        out = r.stdout.strip()
        src, _, text = r.stdout.partition("\n")
        known = Found(True) if out == "HAVE" else _delta_base(src.strip() or "-", text)
    sent = 0
    if not known.have:
        changed = [f for f, digest in m.items() if known.remote.get(f) != digest]
        removed = [f for f in known.remote if f not in m]
        install = script("push/install.sh", base=base, h=h, src=known.src)
        data = "\n".join([_b64("".join(f + "\0" for f in removed).encode()),
                          _b64(json.dumps(m, sort_keys=True).encode()), _tar(tree, changed)])
        r = cxn.run_input(install, data, timeout=600, root=True)
        if r.exited != 0:
            raise TorchrigError(f"payload push failed: {r.stderr.strip()[-300:]}")
        sent = len(changed)
    if switch:
        r = cxn.run(switch_script(base, h), root=True, hide=True, warn=True)
        if r.exited != 0:
            raise TorchrigError(f"payload switch failed: {r.stderr.strip()[-300:]}")
    return f"{base}/releases/{h}", sent
