"""fetch's pure parts: which node holds the job's checkpoints, which checkpoints to try in
which order, which names may be written on the operator's side, where a partial transfer
resumes, and the MANIFEST.json beside the fetched files."""

from __future__ import annotations

import hashlib
import json
import re

from ..errors import TorchrigError

# payload/checkpoint.py's CKPT_RE (the name the payload gives a checkpoint); a unit test checks
# that the two agree, the payload being stdlib + torch and not importable here
CKPT_RE = re.compile(r"^ckpt_(\d{8,})\.pt$")
MANIFEST = "MANIFEST.json"
# a name from the node written on the operator's side: one plain name, no path separator,
# no '..', not hidden (the partial files are), not the manifest
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")


def step_of(name: str) -> int | None:
    m = CKPT_RE.match(name)
    return int(m.group(1)) if m else None


def checkpoints(listing: dict) -> list[dict]:
    """The listing's checkpoint files, newest (highest step) first, each with its step."""
    found = [{**f, "step": s} for f in listing.get("files", []) if (s := step_of(f["name"])) is not None]
    return sorted(found, key=lambda f: f["step"], reverse=True)


def choose_host(listings: dict[str, dict]) -> str | None:
    """The host holding the newest checkpoint (rank 0 writes them; with c10d any node can be
    rank 0, and a restart can move it), or None when no host holds one."""
    best = [(cks[0]["step"], host) for host, lst in listings.items() if (cks := checkpoints(lst))]
    return max(best)[1] if best else None


def candidates(listing: dict, step: int | None) -> tuple[list[str], list[dict]]:
    """(checkpoint names to try in order, checkpoints refused at listing with why): newest
    first (the first that loads is taken), or only step `step` when asked for one. A
    checkpoint name the node would not read (a symlink, a FIFO, a hard link) is refused, and
    asking for its step is an error naming why."""
    cks = checkpoints(listing)
    refused = [s for s in listing.get("skipped", []) if step_of(s["name"]) is not None]
    if step is None:
        return [c["name"] for c in cks], refused
    named = [c["name"] for c in cks if c["step"] == step]
    bad = [s for s in refused if step_of(s["name"]) == step]
    if bad:
        raise TorchrigError(f"--step {step}: {bad[0]['name']} is {bad[0]['why']}: refused")
    if not named:
        have = ", ".join(str(c["step"]) for c in sorted(cks, key=lambda c: c["step"])) or "none"
        raise TorchrigError(f"--step {step}: no such checkpoint (steps there: {have})")
    return named, []


def safe_name(name: str) -> bool:
    return bool(SAFE_NAME.fullmatch(name)) and ".." not in name and name != MANIFEST


def all_files(listing: dict) -> tuple[list[str], list[dict]]:
    """--all: (names to fetch, entries left out with why): every regular file whose name is
    safe to write here; the node's own refusals (symlinks, FIFOs, hard links) are left out too."""
    names, left = [], list(listing.get("skipped", []))
    for f in listing.get("files", []):
        if safe_name(f["name"]):
            names.append(f["name"])
        else:
            left.append({"name": f["name"], "why": "a name that is not safe to write here"})
    return names, left


def part_name(name: str, sha256: str) -> str:
    """The partial file beside the target: hidden, and tied to the content it will hold (a
    later fetch of the same file resumes it; a different file never appends to it)."""
    return f".{name}.{sha256[:16]}.part"


# onhost/fetch/node.py's TRAILER: its lines on stderr meant for the operator (a test keeps
# the two equal)
NODE_SAYS = "torchrig-fetch: "


def node_says(err: bytes) -> tuple[dict, str]:
    """A pipelined read's stderr -> (what the node said, its lines merged in order: "ident"
    first, "sha256" after the last byte), the rest of the text (an error to show)."""
    said, rest = {}, []
    for line in err.decode(errors="replace").splitlines():
        if line.startswith(NODE_SAYS):
            try:
                fields = json.loads(line[len(NODE_SAYS):])
            except ValueError:
                fields = None
            if isinstance(fields, dict):
                said.update(fields)
                continue
        rest.append(line)
    return said, "\n".join(rest).strip()


def partial_key(size: int, mtime: float) -> str:
    """--all's partial-file key before any hash is known: the listed size and mtime (another
    version of the file never appends to this one's partial file)."""
    return hashlib.sha256(f"{size}:{mtime!r}".encode()).hexdigest()


def resume_offset(have: int, size: int) -> int:
    """Where to resume: the bytes already received, or 0 if the partial file is longer than
    the file (not ours to append to)."""
    return have if 0 <= have <= size else 0


def after_read(rc: int | None, alive: bool, start: int, offset: int, size: int) -> str:
    """What one read of a file from byte `start` means, `offset` bytes now being here:
    "done" (all bytes here); "grew" (more bytes than the node said the file had); "failed" (the node refused,
    exit 3, or the command failed without a byte on a live connection: asking again would
    fail the same way); else "dropped": ask again from `offset`, on a fresh connection (exit
    status None or -1: the connection or the node's process died, as SSH reports it)."""
    if offset > size:
        return "grew"
    if offset == size:  # every byte is here, whatever the exit status: the hash decides
        return "done"
    if rc == 3 or (alive and rc is not None and rc > 0 and offset == start):
        return "failed"
    return "dropped"


def parse_manifest(text: str | None, job: str, where: str) -> dict:
    """An existing MANIFEST.json (None: none yet), refused if it is not torchrig's or belongs
    to another job (the folder is then someone else's)."""
    if text is None:
        return {"job": job, "files": []}
    try:
        doc = json.loads(text)
        ok = isinstance(doc, dict) and isinstance(doc.get("files"), list)
    except ValueError:
        ok = False
    if not ok:
        raise TorchrigError(f"{where} is not a torchrig manifest; move it away or choose another --to")
    if doc.get("job") != job:
        raise TorchrigError(f"{where} belongs to job {doc.get('job')!r}, not {job!r}; "
                            "choose another --to")
    return doc


def merge_manifest(doc: dict, entries: list[dict]) -> dict:
    """The manifest with `entries` recorded by name; an entry whose file did not change (same
    hash) keeps its first record, so fetching what is already there changes nothing."""
    files = {f["name"]: f for f in doc["files"]}
    for e in entries:
        old = files.get(e["name"])
        if old is None or old.get("sha256") != e["sha256"]:
            files[e["name"]] = e
    return {**doc, "files": [files[n] for n in sorted(files)]}
