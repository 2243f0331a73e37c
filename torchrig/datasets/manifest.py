"""A dataset's manifest: every file's relative path, size and SHA-256, and for files larger
than one chunk the SHA-256 of each chunk (a cut transfer resumes at the last whole chunk that
matches). Computed once on the operator's machine; its own SHA-256 (of the canonical JSON)
names the dataset's version on every node, so "every node holds the same bytes" is "every
node's check passes against the same manifest hash".

Only regular files are taken: a symlink, FIFO or device in the folder is refused by name (a
dataset that depends on what a link points at on the laptop would not be the same dataset on
the nodes). Empty folders are not kept."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import TorchrigError

CHUNK = 32 << 20   # bytes; a cut transfer of a big file loses at most this much
VERSION = 1
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")   # onhost/data/node.py's, checked there too
RESERVED = (".torchrig",)  # names the node keeps for itself inside a dataset's folder


def dataset_path(data_dir: str, name: str) -> str:
    """Where dataset `name` is on a node (a link to its current version: onhost/data/node.py),
    what a job gets as TORCHRIG_DATA."""
    return f"{data_dir.rstrip('/')}/{name}"


def check_name(name: str | None) -> str:
    if not name:
        raise TorchrigError("--name: which dataset? (`torchrig data.ls` lists them)")
    if not NAME_RE.fullmatch(name):
        raise TorchrigError(f"--name {name!r}: a dataset name is 1-64 letters, digits, '.', '_' "
                            "or '-', starting with a letter or digit")
    return name


@dataclass(frozen=True)
class Manifest:
    doc: dict        # {"version", "chunk", "files": [{"path", "size", "sha256", "chunks"?}]}

    @property
    def sha256(self) -> str:
        return hashlib.sha256(canonical(self.doc)).hexdigest()

    @property
    def files(self) -> list[dict]:
        return self.doc["files"]

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.files)

    def objects(self) -> dict[str, dict]:
        """{sha256: file}: what is stored and sent (paths with equal content share one)."""
        return {f["sha256"]: f for f in self.files}


def canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def build(entries: list[dict], chunk: int = CHUNK) -> Manifest:
    """The manifest of already-hashed entries (path, size, sha256, chunks), sorted by path."""
    files = []
    for e in sorted(entries, key=lambda e: e["path"]):
        f = {"path": e["path"], "size": e["size"], "sha256": e["sha256"]}
        if e["size"] > chunk:
            f["chunks"] = e["chunks"]
        files.append(f)
    return Manifest({"version": VERSION, "chunk": chunk, "files": files})


def hash_file(path: Path, chunk: int = CHUNK) -> dict:
    """size, sha256 and per-chunk sha256s of one local file, in one read."""
    h, ch, chunks, size = hashlib.sha256(), hashlib.sha256(), [], 0
    in_ch = 0
    with open(path, "rb") as f:
        while b := f.read(min(1 << 20, chunk - in_ch)):
            h.update(b)
            ch.update(b)
            size += len(b)
            in_ch += len(b)
            if in_ch == chunk:
                chunks.append(ch.hexdigest())
                ch, in_ch = hashlib.sha256(), 0
    if in_ch:
        chunks.append(ch.hexdigest())
    return {"size": size, "sha256": h.hexdigest(), "chunks": chunks}


def walk(root: Path) -> list[tuple[str, Path]]:
    """(relative path, local path) of every file under `root` (a file: itself), refusing what
    is not a regular file."""
    try:
        st = root.lstat()
    except OSError as e:
        raise TorchrigError(f"{root}: {e.strerror.lower() if e.strerror else e}; data.push takes "
                            "a file or a folder on this machine") from None
    if stat.S_ISREG(st.st_mode):
        return [(root.name, root)]
    if not stat.S_ISDIR(st.st_mode):
        raise TorchrigError(f"{root}: not a file or a folder")
    found, refused = [], []
    for d, dirs, files in os.walk(root, onerror=_walk_error):
        for n in sorted(dirs):
            if os.path.islink(os.path.join(d, n)):  # os.walk does not descend into it
                refused.append(os.path.relpath(os.path.join(d, n), root))
        for n in sorted(files):
            p = Path(d, n)
            rel = p.relative_to(root).as_posix()
            if not stat.S_ISREG(p.lstat().st_mode):
                refused.append(rel)
            elif rel.split("/")[0] not in RESERVED and n != ".torchrig-manifest.json":
                found.append((rel, p))
    if refused:
        raise TorchrigError(f"{root}: {len(refused)} entr{'y is' if len(refused) == 1 else 'ies are'} "
                            f"not a regular file (symlink, FIFO, socket or device), e.g. "
                            f"{', '.join(refused[:3])}; a dataset holds regular files only: copy "
                            "what a link points at, or leave it out")
    if not found:
        raise TorchrigError(f"{root}: no files to push")
    return sorted(found)


def _walk_error(e: OSError) -> None:
    raise TorchrigError(f"{e.filename}: {e.strerror}")


def scan(root: Path, chunk: int = CHUNK) -> tuple[Manifest, dict[str, Path]]:
    """(manifest, {sha256: a local file with that content}) of a file or folder."""
    entries, local = [], {}
    for rel, p in walk(root):
        try:
            e = hash_file(p, chunk)
        except OSError as err:
            raise TorchrigError(f"{p}: cannot read it ({err.strerror})") from None
        entries.append({"path": rel, **e})
        local.setdefault(e["sha256"], p)
    return build(entries, chunk), local
