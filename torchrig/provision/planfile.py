"""A saved provision plan: what `provision --save-plan FILE` writes and `provision --plan FILE`
applies. Pure apart from reading and writing the file.

The file holds what the operator reviewed, through the one redactor (no secret is embedded: a
secret setting is referenced as *** and read from the inventory when the plan is applied), and
per host the fingerprint of the facts the plan was built from plus a digest of the plan itself.
Applying rebuilds the plan from the host's facts now and the inventory: a host whose facts moved
(fingerprint) or whose plan came out different (the inventory or payload changed) is refused."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import TorchrigError
from ..localfiles import write_atomic

KIND = "torchrig-provision-plan"
VERSION = 2  # 2: the digest covers the scripts apply runs, not only the rows shown


def plan_digest(report, scripts: list[str]) -> str:
    """A hash of a (redacted) plan report's rows (step, status, changes, diffs, reason) and of
    the root scripts apply would run for it (apply.scripts_for_digest: file bodies as hashes,
    secrets masked). Equal digests mean the operator would read the same plan and the hosts
    would run the same scripts: a plan saved before an upgrade of torchrig that changed what a
    step runs no longer matches after it."""
    rows = [[s.name, s.status, s.changes, s.diffs, s.error] for s in report.steps]
    return hashlib.sha256(json.dumps([rows, scripts], sort_keys=True).encode()).hexdigest()[:16]


def fact_digests(raw: dict) -> dict:
    """Per fact (and per key of a keyed fact) a short hash: enough to name what changed
    between saving and applying without keeping any fact's text (file contents) in the file."""
    def h(v) -> str:
        return hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return {k: ({sub: h(x) for sub, x in v.items()} if isinstance(v, dict) else h(v))
            for k, v in raw.items()}


@dataclass
class SavedHost:
    host: str
    fingerprint: str
    digest: str
    facts: dict          # fact_digests() at save time
    report: dict         # the redacted plan rows as --json shows them


@dataclass
class SavedPlan:
    path: str
    created: str
    hosts: dict[str, SavedHost]


def dumps(entries: list[SavedHost], created: float | None = None) -> str:
    doc = {"kind": KIND, "version": VERSION,
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
           "hosts": [{"host": e.host, "fingerprint": e.fingerprint, "digest": e.digest,
                      "facts": e.facts, "plan": e.report} for e in entries]}
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def loads(text: str, path: str) -> SavedPlan:
    """The saved plan, or one TorchrigError saying why FILE is not one torchrig can apply."""
    def bad(why: str) -> TorchrigError:
        return TorchrigError(f"--plan {path}: not a torchrig provision plan ({why}); make one "
                             "with: torchrig provision --dry-run --save-plan FILE")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise bad(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise bad(f"no \"kind\": \"{KIND}\"")
    if doc.get("version") != VERSION:
        raise bad(f"version {doc.get('version')!r}, this torchrig reads version {VERSION}")
    hosts: dict[str, SavedHost] = {}
    try:
        for e in doc["hosts"]:
            hosts[str(e["host"])] = SavedHost(str(e["host"]), str(e["fingerprint"]),
                                              str(e["digest"]), dict(e["facts"]), dict(e["plan"]))
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"a host entry lacks {e}") from None
    if not hosts:
        raise bad("no hosts")
    return SavedPlan(path, str(doc.get("created", "?")), hosts)


def read(path: str) -> SavedPlan:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TorchrigError(f"--plan {path}: cannot read it ({getattr(e, 'strerror', e)})") from None
    return loads(text, path)


def write(path: str, text: str) -> None:
    """Atomically, mode 0600 from its first byte (localfiles.write_atomic)."""
    try:
        write_atomic(Path(path), text.encode(), 0o600)
    except OSError as e:
        raise TorchrigError(f"--save-plan {path}: cannot write it ({e.strerror})") from None
