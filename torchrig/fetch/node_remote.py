"""Runs ON THE NODE as the job's user, never as root (fetch sends it to
`runuser -u SERVICE_USER -- VENV/bin/python -I - torchrig-fetch OP`, the request appended as
`main("<base64 JSON>")`): lists, hashes, load-checks and streams the job's checkpoints.

The checkpoint folder is the job's: it can hold a symlink to /etc/shadow, a hard link, a FIFO.
Running as the job's user means nothing the job could not read itself can leak; on top of that
the folder and every file are opened with O_NOFOLLOW (a symlink is refused, not followed),
non-blocking (a FIFO never hangs the open), and only a regular file with one link is read.
The load check (torch.load with weights_only=True) runs here too, as that user: a crafted
pickle never meets root. Replies: JSON on stdout (list, check) or the raw bytes (read);
a refusal is one `error:` line on stderr and exit 3."""
import base64
import errno
import hashlib
import json
import os
import stat
import sys
import time

IN_PROGRESS = ".tmp_ckpt_"  # payload/runtime.py's TMP_PREFIX: a checkpoint being written
CHUNK = 1 << 20


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
    """Hash (and, with "load", load-check) the named files in order; with "first", stop at
    the first one that passes."""
    dfd = open_dir(req["dir"])
    out = []
    for name in req["names"]:
        fd, st = open_file(dfd, name)
        if fd is None:
            out.append({"name": name, "ok": False, "why": st})
            continue
        try:
            digest = sha256(fd)
            why = load_check(fd) if req["load"] else None
            if why is None and ident(os.fstat(fd)) != ident(st):
                why = "it changed while it was read"
        finally:
            os.close(fd)
        if why:
            out.append({"name": name, "ok": False, "why": why})
            continue
        out.append({"name": name, "ok": True, "size": st.st_size, "sha256": digest,
                    "ident": ident(st)})
        if req["first"]:
            break
    return {"checked": out}


def op_read(req):
    """The file's bytes from `offset` on stdout, at most `bwlimit` bytes/s (0: no limit); the
    same file that was checked (device, inode, size, mtime) or a refusal."""
    fd, st = open_file(open_dir(req["dir"]), req["name"])
    if fd is None:
        fail(f"{req['name']}: {st}")
    if ident(st) != req["ident"]:
        fail(f"{req['name']} changed on the node since it was checked; run fetch again")
    os.lseek(fd, req["offset"], os.SEEK_SET)
    limit, sent, t0 = req.get("bwlimit") or 0, 0, time.monotonic()
    size = min(CHUNK, limit // 4) if limit else CHUNK  # several writes a second when limited
    while True:
        b = os.read(fd, max(size, 4096))
        if not b:
            return
        view = memoryview(b)
        while view:
            view = view[os.write(1, view):]
        sent += len(b)
        if limit:
            ahead = sent / limit - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)


def main(request_b64):
    req = json.loads(base64.b64decode(request_b64))
    reply = {"list": op_list, "check": op_check, "read": op_read}[req["op"]](req)
    if reply is not None:
        sys.stdout.write(json.dumps(reply))
