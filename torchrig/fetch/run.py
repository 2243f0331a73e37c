"""`torchrig fetch`: a job's checkpoint from the node that holds it to the operator, verified.

Every read of the job's folder on the node goes through onhost/fetch/node.py as the job's user (see
there why). Here: find the node with the newest checkpoint; have root there copy candidates
newest first into a private snapshot, hash them and have the job's user load-check each copy
(--all: hash only, no copy); stream the chosen copy into a partial file under --to, resuming
from the bytes already received after a dropped connection (a fresh connection each time),
rename it into place only when its SHA-256 matches the node's, record it in MANIFEST.json with
what was checked, and remove the snapshot."""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import paramiko

from ..errors import TorchrigError
from ..facts import probe
from ..inventory import Host
from ..job import check_job_name
from ..localfiles import EarlyFlush, fsync_dir, write_atomic
from ..onhost import HERE as ONHOST, script
from .. import openssh
from ..connections import ConnectionLost, start_carried, stream_carried
from ..quoting import sh
from ..settings import job_folder
from ..session import CannotConnect, Fleet, describe_error
from . import plan

SCRIPT = ONHOST / "fetch" / "node.py"
RETRIES = 5          # fresh connections in a row after drops without a byte received
SILENCE = 60         # seconds without a byte: the transfer is treated as dropped
# CannotConnect: the fresh connection after a drop could not be opened (yet): one more try
DROPS = (ConnectionLost, CannotConnect, paramiko.SSHException, EOFError, socket.error)


@dataclass
class FetchOptions:
    job: str
    to: Path
    step: int | None = None
    all: bool = False
    bwlimit: int = 0  # bytes per second, 0: no limit


@dataclass
class Fetched:
    name: str
    step: int | None
    size: int
    sha256: str
    transferred: int = 0          # bytes that crossed the network this time
    resumed_at: list[int] = field(default_factory=list)  # offsets resumed from after drops
    already: bool = False         # there and matching: nothing transferred
    checked: dict | None = None   # what the node checked (the manifest's "checked")


@dataclass
class FetchResult:
    job: str
    host: str
    node_dir: str
    to: str
    files: list[Fetched]
    refused: list[dict]           # checkpoints the node refused (not loadable, symlink, ...)
    left_out: list[dict]          # --all: entries not fetched, with why

    def as_dict(self) -> dict:
        return asdict(self)


ROOT_OPS = ("snapshot", "send", "drop")  # root's, on its own private copy (onhost/fetch/node.py)


def _command(host: Host, op: str) -> str:
    s = host.settings
    if op in ROOT_OPS:
        return "cd / && " + sh("python3", "-I", "-", "torchrig-fetch", op)
    return "cd / && " + sh("runuser", "-u", s.service_user, "--", f"{s.venv}/bin/python", "-I",
                           "-", "torchrig-fetch", op)


def _stdin(request: dict) -> str:
    return probe.stdin(request, SCRIPT)


def _ask(fleet: Fleet, host: Host, request: dict, timeout: float = 600) -> dict:
    r = fleet.run(host, _command(host, request["op"]), root=True, data=_stdin(request),
                  timeout=timeout)
    return probe.reply(r.exited, r.stdout, r.stderr, f"fetch's {request['op']} of "
                 f"{request['dir']} on {host.name}")


def node_dir(host: Host, job: str) -> str:
    return job_folder(host.settings.checkpoint_dir, job)


def checked(c: dict, user: str) -> dict:
    """The manifest's record of what the node checked of one file."""
    if c.get("slot") is None:
        return {"sha256": c["sha256"], "load_check": None,
                "how": "not load-checked (--all): the SHA-256 of the bytes read on the node, "
                       "matched by the bytes received"}
    return {"sha256": c["sha256"], "load_check": "ok",
            "how": f"torch.load(weights_only=True) by torch {c.get('torch')} as {user} on the "
                   "node, on a root-only snapshot copied once from node_path; the bytes hashed, "
                   "load-checked and sent are that snapshot's"}


def fetch(fleet: Fleet, o: FetchOptions, log: Callable[[str], None]) -> FetchResult:
    job = check_job_name(o.job)
    early = _start_early(fleet, o)
    try:
        host, folder, good, refused, left_out = _choose(fleet, job, o, log)
        try:
            files = _fetch_chosen(fleet, job, host, folder, good, o, log, early)
        finally:
            _drop(fleet, host, good, log)
    finally:
        if early and early[0] is not None:
            early[0].close()  # not taken (nothing to send) or taken and closed: idempotent
    return FetchResult(job, host.name, folder, str(o.to), files, refused, left_out)


def _start_early(fleet: Fleet, o: FetchOptions):
    """--all from one host: the carrier decided and its `ssh` for the first read started
    before the listing, so ssh's handshake and the node's start-up overlap the listing's round
    trip -> (carrier or None, why not) for the first file's transfer; None when nothing was
    started (several hosts: which one holds the checkpoints is not known yet; no --all: the
    snapshot comes first; a failed connection: the listing reports it)."""
    if not o.all or len(fleet.hosts) != 1:
        return None
    host = fleet.hosts[0]
    try:
        cxn = fleet.conn(host)
        over, not_over = openssh.carrier(cxn)
        if over is not None:
            start_carried(over, cxn, _command(host, "read"), root=True)
    except (TorchrigError, *DROPS):
        return None
    return over, not_over


def _fetch_chosen(fleet: Fleet, job: str, host: Host, folder: str, good: list[dict],
                  o: FetchOptions, log: Callable[[str], None], early=None) -> list[Fetched]:
    to = Path(o.to)
    try:
        to.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TorchrigError(f"--to {to}: cannot make that folder ({e.strerror or e})") from None
    manifest = to / plan.MANIFEST
    doc = plan.parse_manifest(manifest.read_text() if manifest.exists() else None, job,
                              str(manifest))
    files: list[Fetched] = []
    try:
        for c in good:
            files.append(_transfer(fleet, host, folder, c, to, o.bwlimit, log, early))
            early = None  # the first file's
    finally:  # what arrived is recorded even when a later file fails
        entries = [{"job": job, "name": f.name, "step": f.step, "size": f.size,
                    "sha256": f.sha256, "node": host.name, "node_path": f"{folder}/{f.name}",
                    "checked": f.checked,
                    "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                   for f in files]
        new = plan.merge_manifest(doc, entries)
        if files and (new != doc or not manifest.exists()):
            write_atomic(manifest, (json.dumps(new, indent=2) + "\n").encode(), 0o644)
    return files


def _choose(fleet: Fleet, job: str, o: FetchOptions, log: Callable[[str], None]):
    """(host, its folder, the checked files to fetch, refused, left out): the node holding the
    newest checkpoint, and there the newest that loads (or step N, or every file)."""
    listed = fleet.fan_out(lambda h: _ask(fleet, h, {"op": "list", "dir": node_dir(h, job)}, 60))
    listings = {r.host: r.value for r in listed if r.ok}
    name = plan.choose_host(listings)
    down = [f"{r.host}: {r.error}" for r in listed if not r.ok]
    if name is None:
        where = ", ".join(h.name for h in fleet.hosts)
        raise TorchrigError(f"no checkpoint of job {job} on {where}" +
                            (f" (could not look on: {'; '.join(down)})" if down else ""))
    for d in down:
        log(f"warning: not looked at (it may hold newer checkpoints): {d}")
    host = next(h for h in fleet.hosts if h.name == name)
    folder, listing = node_dir(host, job), listings[name]
    listed_files = {f["name"]: f for f in listing["files"]}
    if o.all:  # pipelined: no hash before the bytes flow (the node hashes what it sends)
        names, left_out = plan.all_files(listing)
        checked = [{"name": n, "ok": True, "size": listed_files[n]["size"], "sha256": None,
                    "mtime": listed_files[n]["mtime"]} for n in names]
    else:
        names, left_out = plan.candidates(listing, o.step)
        s = host.settings
        request = {"op": "snapshot", "base": s.checkpoint_dir, "dir": folder, "names": names,
                   "sizes": [listed_files[n]["size"] for n in names], "load": True,
                   "user": s.service_user, "python": f"{s.venv}/bin/python",
                   "script": script("fetch/node.py")}
        reply = _ask(fleet, host, request, 3600)  # copying, hashing and loading big files
        checked = [{**c, "snapshot": reply.get("snapshot")} for c in reply["checked"]]
    by_name = {c["name"]: c for c in checked}
    good = [by_name[n] for n in names if by_name.get(n, {}).get("ok")]
    refused = [{"name": c["name"], "why": c["why"]} for c in checked if not c["ok"]]
    if not o.all:  # checkpoint names the node would not even open count as refused
        refused, left_out = left_out + refused, []
    for r in left_out:
        log(f"{name}: left out {r['name']}: {r['why']}")
    for r in refused:
        log(f"{name}: refused {r['name']}: {r['why']}")
    if refused and good and not o.all:
        log(f"{name}: taking {good[0]['name']}, the newest checkpoint that loads")
    if not good:
        raise TorchrigError(f"no loadable checkpoint of job {job} on {name} among "
                            f"{', '.join(names) or 'none'} ({folder})")
    return host, folder, good, refused, left_out


def _drop(fleet: Fleet, host: Host, good: list[dict], log: Callable[[str], None]) -> None:
    """Remove the node's snapshot (a failure is only a warning: the node removes snapshots no
    transfer touched for a day)."""
    for name in {c["snapshot"] for c in good if c.get("snapshot")}:
        try:
            _ask(fleet, host, {"op": "drop", "base": host.settings.checkpoint_dir,
                               "dir": host.settings.checkpoint_dir, "snapshot": name}, 600)
        except (TorchrigError, *DROPS) as e:
            log(f"warning: {host.name}: snapshot {name} in {host.settings.checkpoint_dir} not "
                f"removed ({e}); the node removes it after a day")


def _sha256_file(path: Path, upto: int | None = None) -> hashlib._Hash:
    h, left = hashlib.sha256(), upto
    with open(path, "rb") as f:
        while left is None or left > 0:
            b = f.read(1 << 20 if left is None else min(1 << 20, left))
            if not b:
                break
            h.update(b)
            if left is not None:
                left -= len(b)
    return h


def _transfer(fleet: Fleet, host: Host, folder: str, c: dict, to: Path, bwlimit: int,
              log: Callable[[str], None], early=None) -> Fetched:
    """One file into a partial file under `to`, resumed after drops, renamed into place when
    the SHA-256 of the bytes received is the node's. A snapshot's hash is known before the
    transfer; --all's arrives after the last byte (the node hashes while it sends). early:
    _start_early()'s carrier, already decided."""
    name, size, digest = c["name"], c["size"], c["sha256"]
    if not plan.safe_name(name):  # candidates and all_files only pass safe names; kept anyway
        raise TorchrigError(f"{host.name}: refusing to write {name!r} (not a plain file name)")
    final = to / name
    here = final.is_file() and not final.is_symlink() and final.stat().st_size == size
    ours = None  # this side's hash of the file here, computed while the node hashes its own
    if here:
        pool = concurrent.futures.ThreadPoolExecutor(1)  # hashlib lets go of the GIL
        ours = pool.submit(lambda: _sha256_file(final).hexdigest())
        pool.shutdown(wait=False)
    if here and digest is None:  # --all, a file of that size here: the node's hash decides
        c = {**c, **_check_one(fleet, host, folder, name)}
        digest = c["sha256"]
    got = Fetched(name, plan.step_of(name), size, digest)
    if ours is not None and ours.result() == digest:
        got.already, got.checked = True, checked(c, host.settings.service_user)
        return got
    pipelined = c.get("slot") is None  # --all: the file itself, its hash in the trailer
    part = to / plan.part_name(name, digest or plan.partial_key(size, c["mtime"]))
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    said: dict = {"ident": c["ident"]} if c.get("ident") else {}
    over: openssh.Carrier | None = None  # ssh carrying the bytes, when it can
    flush = EarlyFlush(fd)
    try:
        try:  # two fetches appending to one partial file would garble it
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TorchrigError(f"another fetch is writing {part}; wait for it") from None
        have = os.fstat(fd).st_size
        offset = plan.resume_offset(have, size)
        os.ftruncate(fd, offset)
        h = _sha256_file(part, offset)
        os.lseek(fd, offset, os.SEEK_SET)
        drops, decided = 0, False
        # --all asks at least once (a complete partial file still needs the node's hash)
        while offset < size or (pipelined and "sha256" not in said):
            err = bytearray()

            def write(chunk: bytes) -> None:
                nonlocal offset
                try:
                    os.write(fd, chunk)
                except OSError as e:  # not a drop: no retry
                    raise TorchrigError(f"cannot write {part} ({e.strerror})") from None
                h.update(chunk)
                offset += len(chunk)
                got.transferred += len(chunk)
                flush.wrote(len(chunk))

            if pipelined:  # the same file on every resume: the ident the first read gave
                request = {"op": "read", "dir": folder, "name": name, "offset": offset,
                           "bwlimit": bwlimit, "hash": True,
                           **({"ident": said["ident"]} if "ident" in said else {})}
            else:  # the snapshot that was hashed and load-checked
                request = {"op": "send", "base": host.settings.checkpoint_dir, "dir": folder,
                           "snapshot": c["snapshot"], "slot": c["slot"], "offset": offset,
                           "bwlimit": bwlimit}
            start, rc, why = offset, None, ""
            try:
                cxn = fleet.conn(host)
                if not decided:  # once per file
                    over, not_over = early or openssh.carrier(cxn)
                    if not_over:
                        log(f"{host.name}: {name}: carried over paramiko, not ssh ({not_over})")
                    decided = True
                if over is not None:  # the same command, root as paramiko does it
                    rc = stream_carried(over, cxn, _command(host, request["op"]),
                                        _stdin(request), write, err.extend, root=True,
                                        silence=SILENCE)
                    alive = rc not in (None, openssh.SSH_FAILED)
                else:
                    rc = cxn.stream(_command(host, request["op"]), _stdin(request), write,
                                    err.extend, root=True, silence=SILENCE)
                    alive = cxn.is_connected and not cxn.lost
            except DROPS as e:
                alive, why = False, describe_error(e) or type(e).__name__  # the host is named already
            told, message = plan.node_says(bytes(err))
            if over is not None and offset > start:
                over.carried_bytes = True
            if over is not None and rc == openssh.SSH_FAILED and not over.carried_bytes:
                log(f"{host.name}: {name}: ssh could not connect ({message[-200:] or 'exit 255'});"
                    " carried over paramiko instead")
                over.close()
                over = None
                continue
            said.update(told)
            outcome = plan.after_read(rc, alive, start, offset, size)
            if outcome == "done" and (not pipelined or "sha256" in said or rc == 3):
                break
            if outcome == "grew":
                raise TorchrigError(f"{host.name}: {name} grew while it was read; run fetch again")
            if outcome == "failed" or (outcome == "done" and rc == 3):
                raise TorchrigError(f"{host.name}: reading {name} failed (exit {rc}): "
                                    f"{message[-400:] or 'no message'}")
            drops = 1 if offset > start else drops + 1  # bounded: drops in a row, no progress
            why = why or ("connection lost" if not alive else
                          f"the transfer ended early (exit {rc})" if rc is not None
                          else f"no data for {SILENCE}s")
            if drops > RETRIES:
                raise TorchrigError(f"{host.name}: {name}: gave up after {RETRIES} tries in a "
                                    f"row without progress at byte {offset} of {size} ({why}); "
                                    "run fetch again to resume")
            log(f"{host.name}: {name}: transfer dropped at byte {offset} of {size} ({why}); "
                f"resuming with a fresh connection (retry {drops} of {RETRIES})")
            got.resumed_at.append(offset)
            fleet.drop(host)
            time.sleep(min(0.5 * 2 ** (drops - 1), 5))
        flush.close()
        os.fsync(fd)
    finally:
        flush.close()
        os.close(fd)
        if over is not None:
            over.close()
    if pipelined:
        c = {**c, "sha256": said["sha256"], "ident": said["ident"]}
    got.sha256, got.checked = c["sha256"], checked(c, host.settings.service_user)
    if h.hexdigest() != got.sha256:
        part.unlink()
        raise TorchrigError(f"{host.name}: {name}: SHA-256 of the received bytes "
                            f"({h.hexdigest()[:16]}...) is not the node's ({got.sha256[:16]}...); "
                            "the partial file was removed: run fetch again")
    os.replace(part, final)
    fsync_dir(to)
    return got


def _check_one(fleet: Fleet, host: Host, folder: str, name: str) -> dict:
    """--all with a file of the right size already here: the node's hash of its file (the
    one round trip that can spare the transfer)."""
    c = _ask(fleet, host, {"op": "check", "dir": folder, "names": [name]}, 3600)["checked"][0]
    if not c["ok"]:
        raise TorchrigError(f"{host.name}: {name}: {c['why']}")
    return {"sha256": c["sha256"], "ident": c["ident"]}
