"""Runs ON THE NODE as the owner of its store: `runuser -u USER -- python3 -I -c BOOT
torchrig-data OP`, this script and its request on stdin (BOOT reads a length line, then the
script; what follows on stdin is the op's byte stream: `recv`'s file bytes, `serve`'s end).

A dataset's store is the service user's data folder, so every file there is read and written
as that user: root never touches a path a job controls. Provision's wheel cache is a store
of root's (run as root, no runuser; the folder 0700, made on first use): no job can write in
it. Layout under the store's folder D:

  D/.torchrig/objects/<sha256>              verified files, content-addressed (0444)
  D/.torchrig/objects.json                  {sha256: [size, mtime_ns, inode]} at verification
  D/.torchrig/incoming/<sha256>.part        a file being received (a cut transfer resumes it)
  D/.torchrig/sets/<NAME>/<hash16>/...      a dataset version: hard links to objects, and
                                            .torchrig-manifest.json (manifest + stat records)
  D/<NAME> -> .torchrig/sets/<NAME>/<hash16> switched atomically (rename of a new link)

A dataset is switched only when every object is here and verified, so a job never sees one
half-written. Ops (JSON reply on stdout, or JSON lines for the long ones; a refusal is one
`error:` line on stderr and exit 3):
  state    which of the manifest's objects are here, and where each partial one resumes
  recv     the bytes of the listed objects from stdin, verified and renamed into place
  serve    the listed objects to the listed peers (token, cluster address) until stdin ends
  pull     the listed objects from a node that serves them
  commit   the version from objects, then the switch; the replaced version's objects go
  ls       the datasets here, each checked (sizes and stat records; "full": re-hashed)
  rm       a dataset, and its objects no other dataset uses
  download one file from an HTTP(S) URL into the store (data.pull's first node)
  adopt    the files of D/.torchrig/download (provision's pip and apt downloads) into the store
"""
import errno
import fcntl
import hashlib
import hmac
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SHA_RE = re.compile(r"[0-9a-f]{64}")
IO = 1 << 20
MANIFEST = ".torchrig-manifest.json"
STALE_PART_S = 7 * 86400  # a partial file no push touched for a week is dropped
SERVE_IDLE_S = 900        # a server that nobody asked anything for this long ends


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(3)


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---- the store -------------------------------------------------------------------------

class Store:
    def __init__(self, data_dir, make=False):
        self.data = data_dir
        if make and not os.path.lexists(data_dir):
            # the folders above it as any system folder (0755, not this script's umask 027):
            # they also hold folders other users must reach (/var/lib/torchrig/metrics: the
            # jobs' samplers write there, node_exporter reads it)
            old = os.umask(0o022)
            try:
                os.makedirs(os.path.dirname(data_dir), 0o755, exist_ok=True)
            finally:
                os.umask(old)
            os.mkdir(data_dir, 0o700)
        st = os.lstat(data_dir) if os.path.lexists(data_dir) else None
        if st is None or not stat.S_ISDIR(st.st_mode):
            fail(f"{data_dir}: no such folder (run `torchrig provision` on this host)")
        if st.st_uid != os.geteuid():
            fail(f"{data_dir} is not {'root' if make else 'the service user'}'s (owner uid {st.st_uid})")
        if make and st.st_mode & 0o077:
            fail(f"{data_dir} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); "
                 "it must be root's alone (chmod 700)")
        self.top = os.path.join(data_dir, ".torchrig")
        for sub in ("", "objects", "incoming", "sets"):
            path = os.path.join(self.top, sub)
            try:
                os.mkdir(path, 0o750)
            except FileExistsError:
                pass
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                fail(f"{path} is not a folder")
        self.index_path = os.path.join(self.top, "objects.json")

    def obj(self, sha):
        return os.path.join(self.top, "objects", sha)

    def part(self, sha):
        return os.path.join(self.top, "incoming", sha + ".part")

    def lock(self, wait=30, required=True):
        """The store's writer lock (recv, pull, commit, rm, download); when another holds it
        for `wait` seconds: a refusal, or None when not `required`."""
        fd = os.open(os.path.join(self.top, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    if not required:
                        os.close(fd)
                        return None
                    fail("another data push or rm is writing on this node; try again when it ends")
                time.sleep(0.2)

    def index(self):
        try:
            with open(self.index_path) as f:
                doc = json.load(f)
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            return {}

    def save_index(self, index):
        fd, tmp = tempfile.mkstemp(dir=self.top, prefix=".objects.")
        with os.fdopen(fd, "w") as f:
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.index_path)

    def have(self, sha, size, index):
        """The object is here as it was when verified (same size, inode and mtime)."""
        try:
            st = os.lstat(self.obj(sha))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size and \
            index.get(sha) == [st.st_size, st.st_mtime_ns, st.st_ino]

    def is_object(self, sha, st):
        """The file of stat `st` is the store's object `sha` (a link to it, not a copy)."""
        try:
            o = os.lstat(self.obj(sha))
        except FileNotFoundError:
            return False
        return (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino)

    def forget(self, sha):
        """The object's bytes were found changed: its record goes, so the next push's state
        lists it to send again (skipped while a writer holds the store for long)."""
        fd = self.lock(wait=5, required=False)
        if fd is None:
            return
        try:
            index = self.index()
            if index.pop(sha, None) is not None:
                self.save_index(index)
        finally:
            os.close(fd)


def stat_record(st):
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def hash_fd(fd, upto=None, chunk=None):
    """sha256 of the descriptor's first `upto` bytes (all: None); with `chunk`, also each
    chunk's sha256 -> (hash object, [chunk hex])."""
    h, chunks, ch, in_ch, done = hashlib.sha256(), [], hashlib.sha256(), 0, 0
    os.lseek(fd, 0, os.SEEK_SET)
    while upto is None or done < upto:
        want = IO if upto is None else min(IO, upto - done)
        if chunk:
            want = min(want, chunk - in_ch)
        b = os.read(fd, want)
        if not b:
            break
        h.update(b)
        done += len(b)
        if chunk:
            ch.update(b)
            in_ch += len(b)
            if in_ch == chunk:
                chunks.append(ch.hexdigest())
                ch, in_ch = hashlib.sha256(), 0
    return h, chunks


def resume_at(store, f, chunk):
    """Bytes of the partial file of `f` that match its chunk hashes (whole chunks only)."""
    try:
        fd = os.open(store.part(f["sha256"]), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return 0
        whole = min(st.st_size, f["size"]) // chunk
        _, got = hash_fd(fd, whole * chunk, chunk)
    finally:
        os.close(fd)
    good = 0
    for mine, theirs in zip(got, f.get("chunks") or []):
        if mine != theirs:
            break
        good += 1
    return good * chunk


def objects_of(manifest):
    """{sha256: file entry} of a manifest (a content held by several paths is one object)."""
    return {f["sha256"]: f for f in manifest["files"]}


def op_state(req, store):
    index = store.index()
    have, todo = [], []
    for sha, f in sorted(objects_of(req["manifest"]).items()):
        if store.have(sha, f["size"], index):
            have.append(sha)
        else:
            todo.append({"sha256": sha, "size": f["size"],
                         "offset": resume_at(store, f, req["manifest"]["chunk"])})
    return {"have": have, "todo": todo, "current": current_version(store, req["name"])}


# ---- receiving: from stdin (the operator) or from a peer (pull) ---------------------------

class Receiving:
    """One object being written: the partial file from `offset`, hashed as it grows; renamed
    to its object name only when the whole file's sha256 is the expected one."""

    def __init__(self, store, sha, size, offset, chunk):
        self.store, self.sha, self.size = store, sha, size
        self.fd = os.open(store.part(sha), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            fail(f"{store.part(sha)} is not a regular file")
        # the offset was checked against the chunk hashes (state); hash what is kept again,
        # so the whole file's sha256 covers every byte that ends up in the object
        os.ftruncate(self.fd, offset)
        self.h, _ = hash_fd(self.fd, offset)
        self.at = offset
        os.lseek(self.fd, offset, os.SEEK_SET)
        self.last_sync = time.monotonic()

    def write(self, b):
        view = memoryview(b)
        while view:
            view = view[os.write(self.fd, view):]
        self.h.update(b)
        self.at += len(b)
        if time.monotonic() - self.last_sync > 2:  # what arrived survives a cut transfer
            os.fsync(self.fd)
            self.last_sync = time.monotonic()

    def finish(self, index):
        os.fsync(self.fd)
        if self.h.hexdigest() != self.sha:
            os.close(self.fd)
            os.unlink(self.store.part(self.sha))
            return f"sha256 of the received bytes is {self.h.hexdigest()[:16]}..., not {self.sha[:16]}..."
        os.fchmod(self.fd, 0o444)
        st = os.fstat(self.fd)
        os.close(self.fd)
        os.replace(self.store.part(self.sha), self.store.obj(self.sha))
        index[self.sha] = stat_record(st)
        return None

    def close(self):
        try:
            os.fsync(self.fd)
            os.close(self.fd)
        except OSError:
            pass


def receive(store, sends, chunk, read, report, what):
    """Each listed object's bytes from offset to size, read with read(n) -> bytes (b"": the
    stream ended). One JSON line per object done; what arrived of a cut one stays."""
    lock = store.lock()
    index = store.index()
    done = 0
    try:
        for s in sends:  # each checked by check_request
            r = Receiving(store, s["sha256"], s["size"], s["offset"], chunk)
            try:
                while r.at < r.size:
                    b = read(min(IO, r.size - r.at))
                    if not b:
                        report({"cut": s["sha256"], "at": r.at, "from": what})
                        return done
                    r.write(b)
                    done += len(b)
                why = r.finish(index)
            except BaseException:
                r.close()
                raise
            if why:
                report({"bad": s["sha256"], "why": why})
            else:
                report({"done": s["sha256"]})
    finally:
        store.save_index(index)
        os.close(lock)
    return done


def op_recv(req, store):
    stdin = sys.stdin.buffer
    n = receive(store, req["sends"], req["chunk"], stdin.read, out, "the operator")
    out({"received": n})


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            break
        buf += b
    return bytes(buf)


def op_pull(req, store):
    """From a peer's `serve`: the token, then one request line per object, each answered with
    a header line and the bytes."""
    try:
        sock = socket.create_connection((req["peer"], req["port"]), timeout=20)
    except OSError as e:
        out({"unreachable": f"cannot connect to {req['peer']}:{req['port']} ({e.strerror or e})"})
        return
    sock.settimeout(120)
    f = sock.makefile("rb")
    token = (req["token"] + "\n").encode()  # sent with the first request
    got = [0, time.monotonic()]

    def read(n):
        try:
            b = f.read1(n)
        except OSError:  # a reset or a timeout: what arrived stays
            b = b""
        got[0] += len(b)
        if time.monotonic() - got[1] > 1:  # progress for the operator, about once a second
            got[1] = time.monotonic()
            out({"bytes": got[0]})
        return b

    total, cut = 0, []

    def report(obj):
        if "cut" in obj:
            cut.append(obj)
        out(obj)

    for s in req["sends"]:
        # a peer that may not be served here, or a wrong token, is closed at once: a failed
        # send or no answer, either way this pair's fallback, not a failed push
        head = b""
        try:
            sock.sendall(token + (json.dumps({"sha256": s["sha256"], "offset": s["offset"]})
                                  + "\n").encode())
            token = b""
            head = f.readline()
            reply = json.loads(head)
        except (OSError, ValueError) as e:
            why = getattr(e, "strerror", None) or (repr(head[:80]) if head else "no answer")
            out({"unreachable": f"{req['peer']} closed the transfer ({why})"})
            return
        if "error" in reply:
            fail(f"{req['peer']}: {reply['error']}")
        total += receive(store, [s], req["chunk"], read, report, req["peer"])
        if cut:
            out({"unreachable": f"{req['peer']} stopped sending ({len(cut)} object cut)"})
            return
    try:
        sock.sendall(b'{"end": true}\n')
    except OSError:
        pass  # every object is here: the server ends on its own
    sock.close()
    out({"received": total})


# ---- serving: the objects this node holds, to the peers named --------------------------------

def op_serve(req, store):
    allowed = set(req["peers"])
    shas = set(req["objects"])
    token = req["token"].encode()
    bwlimit = req.get("bwlimit") or 0
    fam = socket.AF_INET6 if ":" in req["bind"] else socket.AF_INET
    srv = socket.socket(fam, socket.SOCK_STREAM)
    try:
        srv.bind((req["bind"], 0))
    except OSError as e:
        out({"unreachable": f"cannot listen on {req['bind']} ({e.strerror or e})"})
        return
    srv.listen(16)
    out({"port": srv.getsockname()[1]})
    state = {"last": time.monotonic(), "sent": 0}
    lock = threading.Lock()

    def one(conn, peer):
        conn.settimeout(120)
        try:
            f = conn.makefile("rb")
            if not hmac.compare_digest(f.readline().strip(), token):
                return
            while True:
                line = f.readline()
                if not line:
                    return
                ask = json.loads(line)
                if ask.get("end"):
                    return
                sha, offset = ask.get("sha256"), int(ask.get("offset", 0))
                if sha not in shas:
                    conn.sendall(b'{"error": "not an object of this transfer"}\n')
                    return
                try:
                    fd = os.open(store.obj(sha), os.O_RDONLY | os.O_NOFOLLOW)
                except OSError as e:
                    conn.sendall((json.dumps({"error": f"{sha[:16]}...: {e.strerror}"}) + "\n").encode())
                    return
                try:
                    size = os.fstat(fd).st_size
                    conn.sendall((json.dumps({"size": size}) + "\n").encode())
                    n = send_fd(fd, conn, offset, size, bwlimit)
                finally:
                    os.close(fd)
                with lock:
                    state["sent"] += n
                    state["last"] = time.monotonic()
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def accept():
        while True:
            try:
                conn, addr = srv.accept()
            except OSError:
                return
            with lock:
                state["last"] = time.monotonic()
            if addr[0].removeprefix("::ffff:") not in allowed:
                conn.close()  # only the destination nodes of this transfer
                continue
            threading.Thread(target=one, args=(conn, addr[0]), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    # until the operator ends it (stdin closes), or nobody asked anything for a long time
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), done.set()), daemon=True).start()
    while not done.wait(5):
        with lock:
            if time.monotonic() - state["last"] > SERVE_IDLE_S:
                break
    srv.close()
    out({"served": state["sent"]})


def send_fd(fd, conn, offset, size, bwlimit):
    """The file's bytes from offset to size (socket.sendfile when there is no limit)."""
    if not bwlimit:
        return conn.sendfile(os.fdopen(os.dup(fd), "rb"), offset, size - offset) if size > offset else 0
    os.lseek(fd, offset, os.SEEK_SET)
    sent, t0, step = 0, time.monotonic(), max(min(IO, bwlimit // 4), 4096)
    while offset + sent < size:
        b = os.read(fd, min(step, size - offset - sent))
        if not b:
            break
        conn.sendall(b)
        sent += len(b)
        ahead = sent / bwlimit - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    return sent


# ---- downloading: one file from an HTTP(S) URL (`data.pull`) --------------------------------

def op_download(req, store):
    """The URL's body into the store, hashed as it arrives (and per chunk): the manifest entry.
    The URL and its credentials came on stdin; an Authorization header is not sent on to
    another host by a redirect."""
    import base64
    import http.client
    import urllib.error
    import urllib.parse
    import urllib.request
    parts = urllib.parse.urlsplit(req["url"])
    if parts.scheme not in ("http", "https") or not parts.hostname:
        fail("only http:// and https:// URLs")
    try:
        port = parts.port
    except ValueError as e:
        fail(f"the URL's port: {e}")
    headers = {"User-Agent": "torchrig-data"}
    if parts.username is not None:  # user:password@ in the URL: HTTP basic auth, not in the URL
        pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        bare = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6
        parts = parts._replace(netloc=bare + (f":{port}" if port else ""))
    if req.get("authorization"):
        headers["Authorization"] = req["authorization"]
    host = parts.hostname

    class SameHostAuth(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, r, fp, code, msg, hdrs, newurl):
            new = super().redirect_request(r, fp, code, msg, hdrs, newurl)
            if new is not None and urllib.parse.urlsplit(newurl).hostname != host:
                new.remove_header("Authorization")
            return new

    opener = urllib.request.build_opener(SameHostAuth)
    lock = store.lock()
    fd, tmp = tempfile.mkstemp(dir=os.path.join(store.top, "incoming"), prefix=".download-")
    try:
        try:
            resp = opener.open(urllib.request.Request(urllib.parse.urlunsplit(parts),
                                                      headers=headers), timeout=60)
        except urllib.error.HTTPError as e:
            fail(f"the server answered HTTP {e.code} {e.reason}")
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            fail(f"cannot download it ({getattr(e, 'reason', e)})")
        chunk, h, ch, chunks, size, in_ch, last = req["chunk"], hashlib.sha256(), hashlib.sha256(), [], 0, 0, time.monotonic()

        def read(n):
            try:
                return resp.read(n)
            except (http.client.HTTPException, OSError) as e:  # a reset, a timeout, a cut chunk
                why = getattr(e, "strerror", None) or str(e) or type(e).__name__
                fail(f"the download broke off after {size} bytes ({why})")

        while True:
            b = read(min(IO, chunk - in_ch))
            if not b:
                break
            view = memoryview(b)
            while view:
                view = view[os.write(fd, view):]
            h.update(b)
            ch.update(b)
            size += len(b)
            in_ch += len(b)
            if in_ch == chunk:
                chunks.append(ch.hexdigest())
                ch, in_ch = hashlib.sha256(), 0
            if time.monotonic() - last > 1:
                last = time.monotonic()
                out({"bytes": size})
        if resp.length:  # http.client ends a body cut short of its Content-Length silently
            fail(f"the server closed the connection after {size} of {size + resp.length} bytes")
        if in_ch:
            chunks.append(ch.hexdigest())
        os.fsync(fd)
        os.fchmod(fd, 0o444)
        st = os.fstat(fd)
        sha = h.hexdigest()
        index = store.index()
        if not store.have(sha, size, index):  # else the same bytes are here, verified, linked
            os.replace(tmp, store.obj(sha))
            tmp = None
            index[sha] = stat_record(st)
            store.save_index(index)
        return {"entry": {"size": size, "sha256": sha, "chunks": chunks}}
    finally:
        os.close(fd)
        if tmp:
            os.unlink(tmp)
        os.close(lock)


# ---- adopting: the files a command on the node put in .torchrig/download ---------------------

# a wheel's name, or a .deb's as apt stores it (an epoch's ':' as %3a; '~' in versions)
DOWNLOADED_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+%~-]{0,254}")


def op_adopt(req, store):
    """Each regular file of D/.torchrig/download into the store, hashed (and per chunk), by
    name: the manifest's entries. The folder goes afterwards. Only root's store has one (its
    owner put it there: provision's `pip download` or `apt-get --download-only`, as root)."""
    folder = os.path.join(store.top, "download")
    lock = store.lock()
    try:
        index, entries = store.index(), []
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for name in sorted(os.listdir(dfd)):
                if not DOWNLOADED_RE.fullmatch(name):
                    fail(f"{folder}/{name}: not a plain file name")
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        fail(f"{folder}/{name}: not a regular file")
                    h, chunks = hash_fd(fd, chunk=req["chunk"])
                    if st.st_size % req["chunk"]:  # as download's entries: the tail's too
                        chunks.append(_tail_hash(fd, st.st_size, req["chunk"]))
                    sha = h.hexdigest()
                    if not store.have(sha, st.st_size, index):
                        os.fchmod(fd, 0o444)
                        os.replace(name, store.obj(sha), src_dir_fd=dfd)
                        index[sha] = stat_record(os.fstat(fd))
                finally:
                    os.close(fd)
                entries.append({"path": name, "size": st.st_size, "sha256": sha, "chunks": chunks})
        finally:
            os.close(dfd)
        store.save_index(index)
        shutil.rmtree(folder)
        return {"entries": entries}
    finally:
        os.close(lock)


def _tail_hash(fd, size, chunk):
    """sha256 of the last, partial chunk of a file of `size` bytes."""
    os.lseek(fd, size - size % chunk, os.SEEK_SET)
    return hashlib.sha256(os.read(fd, chunk)).hexdigest()


# ---- versions ---------------------------------------------------------------------------

def set_dir(store, name):
    """sets/NAME, to write in: refused when it is something else than a folder (a link is
    never followed)."""
    path = os.path.join(store.top, "sets", name)
    if os.path.lexists(path) and not stat.S_ISDIR(os.lstat(path).st_mode):
        fail(f"{path} is not a folder; move it away")
    return path


def link_version(store, name):
    """(the version NAME points at (its 16-hex folder name), None); (None, None) when there is
    no NAME; (None, why) when NAME is something else (a folder, or a link the user made:
    neither followed nor listed)."""
    link = os.path.join(store.data, name)
    try:
        st = os.lstat(link)
    except FileNotFoundError:
        return None, None
    if not stat.S_ISLNK(st.st_mode):
        return None, f"{link} exists and is not a torchrig dataset"
    target = os.readlink(link)
    m = re.fullmatch(r"\.torchrig/sets/" + re.escape(name) + r"/([0-9a-f]{16})", target)
    if not m:
        return None, f"{link} points at {target!r}, not at a torchrig dataset"
    return m.group(1), None


def current_version(store, name):
    """The version NAME points at, None if none; refuses a NAME that is something else."""
    version, why = link_version(store, name)
    if why:
        fail(f"{why}; move it away or choose another --name")
    return version


def open_in(top, rel, flags=os.O_RDONLY):
    """`rel` (a/b/c) under the folder `top`, one step at a time, following no symlink on the
    way or at the end (ELOOP or ENOTDIR) and never going up ('..': EINVAL): what a version
    holds is the service user's to change, so a job may have planted a link anywhere in it."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise OSError(errno.EINVAL, "not a plain relative path")
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for d in parts[:-1]:
            sub = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = sub
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)


def not_opened(e):
    return ("missing" if e.errno == errno.ENOENT else
            "a symlink, or not a folder on its way (not followed)"
            if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror)


def read_manifest(store, name, version):
    try:
        fd = open_in(store.top, f"sets/{name}/{version}/{MANIFEST}")
    except OSError as e:
        return None, f"its manifest cannot be read ({not_opened(e)})"
    try:
        with os.fdopen(fd) as f:
            doc = json.load(f)
    except ValueError:
        return None, "its manifest is not JSON"
    if not (isinstance(doc, dict) and isinstance(doc.get("stat"), dict)
            and isinstance(doc.get("manifest"), dict)
            and isinstance(doc["manifest"].get("files"), list)):
        return None, "its manifest is not one torchrig wrote"
    return doc, None


def check_version(store, name, version, full=False):
    """Problems of a dataset version: each file as recorded at the switch (size, inode,
    mtime; with full, its sha256 again)."""
    doc, why = read_manifest(store, name, version)
    if doc is None:
        return None, [why]
    problems = []
    for f in doc["manifest"]["files"]:
        try:
            fd = open_in(store.top, f"sets/{name}/{version}/{f['path']}",
                         os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            problems.append(f"{f['path']}: {not_opened(e)}")
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                problems.append(f"{f['path']}: not a regular file")
            elif st.st_size != f["size"]:
                problems.append(f"{f['path']}: {st.st_size} bytes, the manifest says {f['size']}")
            elif full:
                h, _ = hash_fd(fd)
                if h.hexdigest() != f["sha256"]:
                    problems.append(f"{f['path']}: sha256 {h.hexdigest()[:16]}... differs from "
                                    f"the manifest's {f['sha256'][:16]}...")
                    if store.is_object(f["sha256"], st):  # its record still said verified
                        store.forget(f["sha256"])
            elif doc["stat"].get(f["path"]) != stat_record(st):
                problems.append(f"{f['path']}: changed since it was pushed (modified or replaced)")
            elif not store.is_object(f["sha256"], st):
                problems.append(f"{f['path']}: not the verified file any more (it was received "
                                "again since; a push switches it in)")
        finally:
            os.close(fd)
    return doc, problems


def op_commit(req, store):
    name, manifest, mhash = req["name"], req["manifest"], req["sha256"]
    lock = store.lock()
    try:
        index = store.index()
        missing = [f["path"] for f in manifest["files"]
                   if not store.have(f["sha256"], f["size"], index)]
        if missing:
            fail(f"not every file is here and verified ({len(missing)} missing, e.g. {missing[0]})")
        old = current_version(store, name)
        version = mhash[:16]
        if old == version:
            doc, problems = check_version(store, name, version)
            if doc is not None and doc.get("sha256") == mhash and not problems:
                return {"switched": False, "version": version}
        sdir = set_dir(store, name)
        os.makedirs(sdir, 0o750, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".incoming-", dir=sdir)
        records = {}
        for f in manifest["files"]:
            dst = os.path.join(tmp, f["path"])
            os.makedirs(os.path.dirname(dst), 0o750, exist_ok=True)
            os.link(store.obj(f["sha256"]), dst, follow_symlinks=False)
            records[f["path"]] = stat_record(os.lstat(dst))
        with open(os.path.join(tmp, MANIFEST), "w") as fh:
            json.dump({"name": name, "sha256": mhash, "manifest": manifest, "stat": records,
                       "pushed_at": time.time()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o750)
        final = os.path.join(sdir, version)
        if os.path.lexists(final):  # an older copy of the same version, not as recorded: set
            # aside (dropped below with the other versions) rather than removed first, so NAME
            # points at nothing only between two renames, not for a whole tree's removal
            os.rename(final, tempfile.mkdtemp(prefix=".replaced-", dir=sdir))
        os.rename(tmp, final)
        # the switch: a new link renamed over the old one (atomic: a job sees old or new)
        link = os.path.join(store.data, name)
        tmp_link = os.path.join(store.data, f".{name}.torchrig-{os.getpid()}")
        os.symlink(f".torchrig/sets/{name}/{version}", tmp_link)
        os.rename(tmp_link, link)
        dfd = os.open(store.data, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
        dropped = drop_versions(store, name, keep=version, index=index)
        store.save_index(index)
        clean_parts(store)
        return {"switched": True, "version": version, "replaced": old, "objects_dropped": dropped}
    finally:
        os.close(lock)


def drop_versions(store, name, keep, index):
    """Remove NAME's versions but `keep` (None: all), then the objects only they used (an
    object whose one link left is the store's)."""
    sdir = set_dir(store, name)
    shas = set()
    for v in os.listdir(sdir) if os.path.isdir(sdir) else []:
        if v == keep:
            continue
        doc, _ = read_manifest(store, name, v)
        if doc:
            shas |= {f["sha256"] for f in doc["manifest"]["files"]}
        path = os.path.join(sdir, v)
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:  # not a version: something put there by hand
            os.unlink(path)
    dropped = 0
    for sha in shas:
        try:
            st = os.lstat(store.obj(sha))
        except FileNotFoundError:
            continue
        if st.st_nlink == 1:
            os.unlink(store.obj(sha))
            index.pop(sha, None)
            dropped += 1
    if keep is None and os.path.isdir(sdir):
        os.rmdir(sdir)
    return dropped


def clean_parts(store):
    now = time.time()
    inc = os.path.join(store.top, "incoming")
    for n in os.listdir(inc):
        st = os.lstat(os.path.join(inc, n))
        if now - st.st_mtime > STALE_PART_S:
            os.unlink(os.path.join(inc, n))


def op_ls(req, store):
    # every dataset: the links of this store only; a link or folder a user put in the data
    # folder is neither followed nor listed (nor does it fail the listing of the others)
    names = [req["name"]] if req.get("name") else sorted(
        n for n in os.listdir(store.data) if NAME_RE.fullmatch(n) and link_version(store, n)[0])
    found = []
    for name in names:
        version = current_version(store, name)
        if version is None:
            continue
        doc, problems = check_version(store, name, version, full=req.get("full", False))
        files = doc["manifest"]["files"] if doc else []
        found.append({"name": name, "version": version, "sha256": doc and doc.get("sha256"),
                      "files": len(files), "bytes": sum(f["size"] for f in files),
                      "pushed_at": doc and doc.get("pushed_at"), "problems": problems,
                      "path": os.path.join(store.data, name),
                      **({"manifest": doc["manifest"]} if req.get("manifests") and doc else {})})
    return {"datasets": found}


def op_rm(req, store):
    name = req["name"]
    lock = store.lock()
    try:
        if current_version(store, name) is None:
            return {"removed": False}
        os.unlink(os.path.join(store.data, name))
        index = store.index()
        dropped = drop_versions(store, name, keep=None, index=index)
        store.save_index(index)
        return {"removed": True, "objects_dropped": dropped}
    finally:
        os.close(lock)


def check_request(req):
    """Refuses a request that names anything outside the store, before anything is written:
    a dataset name that is not a plain name; a manifest path that is not a plain relative path
    inside the dataset ('/x', '../x', 'a/../../b', '', '.', twice the same file, a file where
    another path needs a folder, the manifest's own name); an object that is not a sha256; a
    size or offset that is not a count."""
    if req.get("name") is not None and not (isinstance(req["name"], str)
                                            and NAME_RE.fullmatch(req["name"])):
        fail(f"{req['name']!r} is not a dataset name")
    if "manifest" in req:
        check_manifest(req["manifest"])
    for s in req.get("sends") or []:
        if not (isinstance(s, dict) and is_sha(s.get("sha256")) and is_count(s.get("size"))
                and is_count(s.get("offset")) and s["offset"] <= s["size"]):
            fail(f"{s!r} is not an object to receive (sha256, size, offset)")
    for sha in req.get("objects") or []:
        if not is_sha(sha):
            fail(f"{sha!r} is not a sha256")
    if "chunk" in req and not is_count(req["chunk"], 1):
        fail(f"chunk {req['chunk']!r} is not a size")


def check_manifest(manifest):
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), list)
            and is_count(manifest.get("chunk"), 1)):
        fail("the manifest is not one (no files or chunk)")
    paths, folders = set(), set()
    for f in manifest["files"]:
        path = f.get("path") if isinstance(f, dict) else None
        parts = path.split("/") if isinstance(path, str) else [""]
        if any(p in ("", ".", "..") or "\0" in p for p in parts) or path == MANIFEST:
            fail(f"the manifest's path {path!r} is not a plain relative path inside the dataset")
        if not (is_sha(f.get("sha256")) and is_count(f.get("size"))):
            fail(f"the manifest's {path!r} has no sha256 and size")
        if path in paths:
            fail(f"the manifest names {path!r} twice")
        paths.add(path)
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = sorted(paths & folders)
    if clash:
        fail(f"the manifest's {clash[0]!r} is both a file and a folder")


def is_sha(v):
    return isinstance(v, str) and SHA_RE.fullmatch(v) is not None


def is_count(v, least=0):
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def main(req):
    """`req`: the request (the operator appends `main(json.loads(base64 ...))`)."""
    os.umask(0o027)
    check_request(req)
    store = Store(req["data_dir"], make=bool(req.get("make")) and os.geteuid() == 0)
    ops = {"state": op_state, "recv": op_recv, "pull": op_pull, "serve": op_serve,
           "commit": op_commit, "ls": op_ls, "rm": op_rm, "download": op_download,
           "adopt": op_adopt}
    reply = ops[req["op"]](req, store)
    if reply is not None:
        out(reply)
