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
import tarfile

from ..errors import TorchrigError
from ..onhost import script
from .tree import Tree



def _tar(tree: Tree, files: list[str]) -> str:
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


def push(cxn, tree: Tree, base: str) -> tuple[str, int]:
    """Make `tree` the node's current release under `base`. Returns (release dir, files sent)."""
    m = tree.manifest()
    h = tree.hash
    r = cxn.run(script("push/probe.sh", base=base, h=h), root=True, hide=True, warn=True)
    if r.exited != 0:
        raise TorchrigError(f"payload probe failed: {r.stderr.strip()[-300:]}")
    sent = 0
    if r.stdout.strip() != "HAVE":
        src, _, text = r.stdout.partition("\n")
        try:
            remote = json.loads(text)
        except ValueError:
            remote = {}
        if not re.fullmatch(r"[0-9a-f]{16}", src.strip()):
            src, remote = "", {}   # no usable release to build on: send everything
        changed = [f for f, digest in m.items() if remote.get(f) != digest]
        removed = [f for f in remote if f not in m]
        install = script("push/install.sh", base=base, h=h, src=src.strip())
        data = "\n".join([_b64("".join(f + "\0" for f in removed).encode()),
                          _b64(json.dumps(m, sort_keys=True).encode()), _tar(tree, changed)])
        r = cxn.run_input(install, data, timeout=600, root=True)
        if r.exited != 0:
            raise TorchrigError(f"payload push failed: {r.stderr.strip()[-300:]}")
        sent = len(changed)
    r = cxn.run(script("push/switch.sh", base=base, h=h), root=True, hide=True, warn=True)
    if r.exited != 0:
        raise TorchrigError(f"payload switch failed: {r.stderr.strip()[-300:]}")
    return f"{base}/releases/{h}", sent
