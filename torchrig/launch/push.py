"""Push the payload directory to a node: content-hashed releases, only changed files sent,
switched into place atomically, so an interrupted push leaves the previous payload in use.

Layout on the node:  {prefix}/payload/releases/<tree hash>/   (complete, read-only)
                     {prefix}/payload/current -> releases/<tree hash>
A job's unit points at its own release, so a later push never changes a running job's code.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

from ..errors import TorchrigError
from ..onhost import script

SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache"}


def manifest(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every payload file (no caches)."""
    if not root.is_dir():
        raise TorchrigError(f"payload directory {root} not found")
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not SKIP_DIRS & set(rel.parts) and p.suffix != ".pyc":
            out[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def tree_hash(m: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(m.items())).encode()).hexdigest()[:16]


def _tar(root: Path, files: list[str]) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in files:
            info = tar.gettarinfo(str(root / rel), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            with open(root / rel, "rb") as f:
                tar.addfile(info, f)
    return _b64(buf.getvalue())


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def push(cxn, root: Path, prefix: str) -> tuple[str, int]:
    """Make `root` the node's current payload. Returns (release dir, files sent)."""
    m = manifest(root)
    h = tree_hash(m)
    base = f"{prefix}/payload"
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
                          _b64(json.dumps(m, sort_keys=True).encode()), _tar(root, changed)])
        r = cxn.run_input(install, data, timeout=600, root=True)
        if r.exited != 0:
            raise TorchrigError(f"payload push failed: {r.stderr.strip()[-300:]}")
        sent = len(changed)
    r = cxn.run(script("push/switch.sh", base=base, h=h), root=True, hide=True, warn=True)
    if r.exited != 0:
        raise TorchrigError(f"payload switch failed: {r.stderr.strip()[-300:]}")
    return f"{base}/releases/{h}", sent
