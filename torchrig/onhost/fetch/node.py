"""Runs ON THE NODE (the request appended as `main("<base64 JSON>")`). Two kinds of op:

- as the job's user, never as root (`runuser -u SERVICE_USER -- VENV/bin/python -I -
  torchrig-fetch OP`): list the job's folder, hash (--all), stream a file of it (read);
- as a uid no account or process has (setpriv, no groups, no new privileges): load-check the
  file open on a descriptor it is handed (load), so the job cannot ptrace the check;
- as root (`python3 -I - torchrig-fetch OP`): snapshot, send, drop. A checkpoint is checked
  and sent from ONE copy: root copies the bytes the job's user reads (read, once) into a
  private root-only folder (mktemp -d, 0700) beside the job folders (same file system, one
  file at a time, removed after the transfer), hashes them on the way, has an unallocated
  uid load-check that copy through a read-only descriptor (nobody else can open the copy),
  and sends exactly that copy. Rewriting the checkpoint in place after it was read changes
  nothing that is checked or sent.

The checkpoint folder is the job's: it can hold a symlink to /etc/shadow, a hard link, a FIFO.
Running as the job's user means nothing the job could not read itself can leak; on top of that
the folder and every file are opened with O_NOFOLLOW (a symlink is refused, not followed),
non-blocking (a FIFO never hangs the open), and only a regular file with one link is read.
The load check (torch.load with weights_only=True) runs as neither root nor the job's user: a
crafted pickle never meets root, and the job cannot reach into the check. Replies: JSON on stdout (list, check) or the raw bytes (read);
a refusal is one `error:` line on stderr and exit 3."""
import base64
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time

IN_PROGRESS = ".tmp_ckpt_"  # payload/checkpoint.py's TMP_PREFIX: a checkpoint being written
CHUNK = 1 << 20
SNAPSHOT_PREFIX = ".torchrig-fetch-"  # root's private folders in the checkpoint folder
SNAPSHOT_RE = re.compile(re.escape(SNAPSHOT_PREFIX) + r"[A-Za-z0-9_]{4,32}")
STALE_S = 86400  # a snapshot folder no transfer touched for a day: its fetch is gone
TRAILER = "torchrig-fetch: "  # a line of stderr meant for the operator (fetch/run.py)
LOAD_TIMEOUT_S = 1800  # torch.load of the largest checkpoints a node holds takes minutes


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(3)


def open_dir(path, missing_ok=False):
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        if missing_ok:
            return None
        fail(f"{path}: no such folder")
    except OSError as e:
        fail(f"{path}: cannot open it as a folder ({e.strerror}; a symlink is not followed)")


def why_not(st):
    """Why an entry is not read (None: a regular file with one link)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (not followed)"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a FIFO, socket, device or folder)"
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} hard links (could be any file on the node)"
    return None


def ident(st):
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def open_file(dfd, name):
    """(fd, stat) of the regular single-link file `name` in the folder, or (None, why)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError as e:
        return None, ("a symlink (not followed)" if e.errno == errno.ELOOP
                      else f"cannot open it ({e.strerror})")
    st = os.fstat(fd)
    why = why_not(st)
    if why:
        os.close(fd)
        return None, why
    os.set_blocking(fd, True)
    return fd, st


def sha256(fd):
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while True:
        b = os.read(fd, CHUNK)
        if not b:
            return h.hexdigest()
        h.update(b)


def load_check(fd):
    """None when torch loads it with weights_only=True, else why not (one line)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - reported, not raised
        fail(f"cannot import torch in the node's venv for the load check ({e})")
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:  # the descriptor opened with O_NOFOLLOW
            torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated zip, a refused pickle, an I/O error
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        line = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines else "")
        return f"{type(e).__name__}: {line.split('. ')[0][:300]}"  # its first sentence
    return None


def op_list(req):
    """Every entry of the folder: regular single-link files with size, the rest with why not."""
    dfd = open_dir(req["dir"], missing_ok=True)
    if dfd is None:
        return {"exists": False, "files": [], "skipped": []}
    files, skipped = [], []
    for name in sorted(os.listdir(dfd)):
        if name.startswith(IN_PROGRESS):
            skipped.append({"name": name, "why": "a checkpoint still being written"})
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile (the job's --keep)
        why = why_not(st)
        if why:
            skipped.append({"name": name, "why": why})
        else:
            files.append({"name": name, "size": st.st_size, "mtime": st.st_mtime})
    return {"exists": True, "files": files, "skipped": skipped}


def op_check(req):
    """--all (no load check): hash the named files. What is sent later is read again, so the
    operator's hash of the received bytes is what proves them (a changed file fails it)."""
    dfd = open_dir(req["dir"])
    out = []
    for name in req["names"]:
        fd, st = open_file(dfd, name)
        if fd is None:
            out.append({"name": name, "ok": False, "why": st})
            continue
        try:
            digest = sha256(fd)
            changed = ident(os.fstat(fd)) != ident(st)
        finally:
            os.close(fd)
        if changed:
            out.append({"name": name, "ok": False, "why": "it changed while it was read"})
            continue
        out.append({"name": name, "ok": True, "size": st.st_size, "sha256": digest,
                    "ident": ident(st)})
    return {"checked": out}


def send(fd, offset, bwlimit=0, most=None, h=None):
    """The descriptor's bytes from `offset` to stdout (at most `most` of them), at most
    `bwlimit` bytes/s (0: no limit); each chunk also into the hash `h` when one is given."""
    os.lseek(fd, offset, os.SEEK_SET)
    limit, sent, t0 = bwlimit or 0, 0, time.monotonic()
    size = max(min(CHUNK, limit // 4) if limit else CHUNK, 4096)  # several writes a second
    while most is None or sent < most:
        b = os.read(fd, size if most is None else min(size, most - sent))
        if not b:
            return
        if h is not None:
            h.update(b)
        view = memoryview(b)
        while view:
            view = view[os.write(1, view):]
        sent += len(b)
        if limit:
            ahead = sent / limit - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)


def hash_prefix(fd, upto, h):
    """The file's first `upto` bytes into `h` (a resumed read hashes what it does not send)."""
    os.lseek(fd, 0, os.SEEK_SET)
    while upto > 0:
        b = os.read(fd, min(CHUNK, upto))
        if not b:
            fail("the file is shorter than the bytes already received; run fetch again")
        h.update(b)
        upto -= len(b)


def say(**fields):
    """One line for the operator on stderr, beside the bytes on stdout (TRAILER + JSON)."""
    sys.stderr.write(TRAILER + json.dumps(fields) + "\n")
    sys.stderr.flush()


def op_read(req):
    """The file's bytes from `offset` on stdout (at most "most" bytes). With "ident": only the
    same file (device, inode, size, mtime), else a refusal. With "hash" (--all, pipelined: no
    hash before the bytes flow): its ident on stderr first (the operator resumes with it), and
    after the last byte the SHA-256 of the whole file (the prefix not sent included), refused
    if the file changed while it was read."""
    fd, st = open_file(open_dir(req["dir"]), req["name"])
    if fd is None:
        fail(f"{req['name']}: {st}")
    if "ident" in req and ident(st) != req["ident"]:
        fail(f"{req['name']} changed on the node since it was checked; run fetch again")
    if not req.get("hash"):
        send(fd, req.get("offset", 0), req.get("bwlimit") or 0, req.get("most"))
        return
    say(ident=ident(st))
    h, offset = hashlib.sha256(), req.get("offset", 0)
    hash_prefix(fd, offset, h)
    send(fd, offset, req.get("bwlimit") or 0, req.get("most"), h)
    if ident(os.fstat(fd)) != ident(st):
        fail(f"{req['name']} changed while it was read; run fetch again")
    say(sha256=h.hexdigest(), ident=ident(st))


def op_load(req):
    """Load-check the file open on descriptor `fd` (root's snapshot, handed over read-only)."""
    fd = req["fd"]
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        fail("the snapshot handed over is not a regular file")
    why = load_check(fd)
    import torch  # loaded by load_check
    return {"why": why, "torch": torch.__version__}


# ---- root's side: one private copy, checked and sent ------------------------------------

def nobodys_uid():
    """A uid no account and no process has (drawn per check from a range distributions leave
    unallocated): the load check runs there, so no process of the job's user can ptrace it
    and forge its verdict, and it can read nothing but what it is handed and world-readable
    files (the venv)."""
    while True:
        uid = 0x60000000 + int.from_bytes(os.urandom(3), "big")
        if not any(st.st_uid == uid for st in _procs()):
            return uid


def _procs():
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                yield os.stat(f"/proc/{pid}")
            except OSError:
                continue


def as_user(req, op, child, pass_fds=(), uid=None):
    """Popen of this script's op `op` as the job's user (or, with `uid`, as that uid with no
    groups and no new privileges), its request on stdin."""
    who = (["runuser", "-u", req["user"], "--"] if uid is None else
           ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"])
    argv = [*who, req["python"], "-I", "-", "torchrig-fetch", op]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd="/", pass_fds=pass_fds)
    b64 = base64.b64encode(json.dumps(child).encode()).decode()
    p.stdin.write((req["script"] + f'\nmain("{b64}")\n').encode())
    p.stdin.close()
    p.stdin = None  # sent: communicate() must not flush it again
    return p


def user_error(p, err):
    lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    msg = lines[-1] if lines else f"exit {p.returncode}"
    return msg[len("error: "):] if msg.startswith("error: ") else msg


def base_dir(path):
    """The checkpoint folder (root's, 0755 by provision): the snapshots' parent. Refused unless
    root owns it and nobody else may write in it (root writes nowhere a job controls)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        fail(f"{path}: cannot open it ({e.strerror})")
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & 0o022:
        os.close(fd)
        fail(f"{path} is not root's alone (owner uid {st.st_uid}, mode {st.st_mode & 0o7777:o}): "
             "root keeps no snapshot there; run `torchrig provision` on this host")
    return fd


def snapshot_dir(req):
    """(fd of the snapshot folder named in the request, base fd), checked: a folder root made."""
    name = req["snapshot"]
    if not SNAPSHOT_RE.fullmatch(name):
        fail(f"{name!r} is not a fetch snapshot")
    base = base_dir(req["base"])
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
    except OSError as e:
        fail(f"snapshot {name}: {e.strerror} (a fetch of more than a day is cleaned up; run "
             "fetch again)")
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & 0o077:
        fail(f"snapshot {name} is not root's private folder")
    return fd, base


def clean_stale(base):
    now = time.time()
    for name in os.listdir(base):
        if SNAPSHOT_RE.fullmatch(name):
            st = os.stat(name, dir_fd=base, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and now - st.st_mtime > STALE_S:
                shutil.rmtree(name, dir_fd=base, ignore_errors=True)


def copy_one(req, name, size, sfd, slot):
    """Copy what the job's user reads of `name` into slot `slot` of the snapshot, hashing it;
    -> (sha256, bytes) or (None, why)."""
    free = os.statvfs(sfd).f_bavail * os.statvfs(sfd).f_frsize
    if free < size:
        return None, (f"not enough free space for a snapshot beside it ({size} bytes needed, "
                      f"{free} free on {req['base']})")
    out = os.open(slot, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600, dir_fd=sfd)
    h, n = hashlib.sha256(), 0
    p = as_user(req, "read", {"op": "read", "dir": req["dir"], "name": name, "most": size + 1})
    try:
        while b := p.stdout.read(CHUNK):
            h.update(b)
            n += len(b)
            if n > size:  # never more than the listed size onto root's disk
                p.kill()
                break
            view = memoryview(b)
            while view:
                view = view[os.write(out, view):]
        os.fsync(out)
    finally:
        os.close(out)
        err = b"" if n > size else p.stderr.read()  # killed past the size: nothing to say
        p.wait()
    if n > size:
        return None, "it grew while it was copied"
    if p.returncode != 0:
        return None, user_error(p, err)
    return h.hexdigest(), n


def load_one(req, sfd, slot):
    """An unallocated uid (not the job's: a job's process could ptrace its own user's check)
    load-checks the snapshot through a read-only descriptor -> (why, torch)."""
    fd = os.open(slot, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
    try:
        p = as_user(req, "load", {"op": "load", "fd": fd}, pass_fds=(fd,), uid=nobodys_uid())
        try:
            out, err = p.communicate(timeout=LOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            return f"the load check did not end within {LOAD_TIMEOUT_S} s", None
    finally:
        os.close(fd)
    if p.returncode != 0:
        return user_error(p, err), None
    try:
        reply = json.loads(out)
    except ValueError:
        return "the load check gave no answer", None
    return reply["why"], reply["torch"]


def op_snapshot(req):
    """The named checkpoints in order, each copied once into root's private folder, hashed
    and (with "load") load-checked there; the first that passes is kept for `send` (the
    others' copies are removed at once). -> {"snapshot": folder name | None, "checked": [...]}"""
    base = base_dir(req["base"])
    clean_stale(base)
    path = tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX, dir=f"/proc/self/fd/{base}")
    name = os.path.basename(path)
    sfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
    out, kept = [], None
    for i, (ck, size) in enumerate(zip(req["names"], req["sizes"])):
        slot = str(i)
        digest, n = copy_one(req, ck, size, sfd, slot)
        why, torch = (n, None) if digest is None else \
            load_one(req, sfd, slot) if req["load"] else (None, None)
        if why:
            out.append({"name": ck, "ok": False, "why": why})
            try:
                os.unlink(slot, dir_fd=sfd)
            except FileNotFoundError:
                pass
            continue
        out.append({"name": ck, "ok": True, "size": n, "sha256": digest, "slot": slot,
                    "torch": torch})
        kept = name
        break
    if kept is None:
        shutil.rmtree(name, dir_fd=base)
    return {"snapshot": kept, "checked": out}


def op_send(req):
    """A snapshot's bytes from `offset` on stdout (root reads root's own copy)."""
    sfd, _ = snapshot_dir(req)
    os.utime(sfd)  # a transfer in progress: not stale
    if not req["slot"].isdigit():
        fail(f"{req['slot']!r} is not a snapshot slot")
    fd = os.open(req["slot"], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
    send(fd, req["offset"], req.get("bwlimit") or 0)


def op_drop(req):
    """Remove a snapshot folder (the transfer is over)."""
    sfd, base = snapshot_dir(req)
    os.close(sfd)
    shutil.rmtree(req["snapshot"], dir_fd=base)
    return {"dropped": req["snapshot"]}


def main(request_b64):
    req = json.loads(base64.b64decode(request_b64))
    ops = {"list": op_list, "check": op_check, "read": op_read, "load": op_load,
           "snapshot": op_snapshot, "send": op_send, "drop": op_drop}
    reply = ops[req["op"]](req)
    if reply is not None:
        sys.stdout.write(json.dumps(reply))
