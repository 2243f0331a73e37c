"""The probe: runs ON THE HOST (`python3 -I -`, as root for provision and status, as the login
user for verify), one round trip. Standard library only. It parses nothing: it runs the
requested commands concurrently and returns their raw output, and reads the requested files,
so every parser lives on the operator side (torchrig/facts/) and is tested from captured text.

The request travels on stdin with the script (facts/probe.py appends `main("<base64 JSON>")`),
never in a command line. Keys, each optional:
  run      {name: argv | {"argv": argv, "timeout": s, "max_line": n, "max_bytes": n, "keep": text}}
           -> {name: {"rc", "out", "err", "cut"?}}: the output streamed from the command, each
           line at most max_line bytes and max_bytes in all (MAX_LINE, MAX_BYTES by default; the
           rest is read and dropped); "cut" says what a cap cut (see capped()). With "keep":
           only the lines containing that text, the newest max_bytes of them, and "lines": how
           many lines the command printed (a long log filtered here, not shipped whole)
  jobs     how many commands run at once (default 8)
  read     {name: {"path", "limit", "tail": bool, "first_line": bool, "follow": bool, "since"?}}
           -> {name: {"text", "first_line"} | None}; with "since" (a tail read of a file that
           grows: null, or [inode, offset] where the last read ended), only the bytes after that
           offset when the file is still that inode (the last `limit` of them), else its tail,
           plus "ino", "start", "end" (the bytes read; an unfinished UTF-8 character at the end
           is left for the next read) and no first line when it continued
  stat     {path: with_content}  -> {path: {"mode", "is_dir", "owner", "group", "sha256", "content"} | None}
  exists   [path]                -> {path: bool}
  glob     {name: {"pattern", "limit"}}  -> {name: {path: text}} (each match read as by `read`)
  users    [name]                -> {name: {"uid", "shell"} | None}
  host     true                  -> {"arch", "kernel", "euid", "hostname", "disk_free_gb", "time",
                                     "monotonic"} (clocks for ages computed on the operator side)
  tree     {name: {"root", "walk": [regex], "then": [regex], "read": {"name", "tail", "first_line", "mtime"},
                  "most": n, "since"?: {relpath: [inode, offset]}}}
           -> {name: {"dirs": [[relpath, mtime]], "files": {relpath: {...} | None}, "cut"?}}: the
              folders matching `walk` one level per regex; in the newest of them, the first
              `most` folders matching `then` (MAX_FILES by default), and the file `read.name` in each
              (with "since": each file read as `read` reads with "since", its own or null)
  journal  {"unit", "keep", "lines", "ident"?, "after_cursor"?, "kernel_after_cursor"?, "max_line"?}
           -> {"year", "utc_offset", "journal", "kernel", "cursor", "kernel_cursor", "kernel_after",
              "cut"?}: the unit's newest
           `lines` journal lines since its last start (with "ident": the lines of that journal
           identifier instead: a Slurm job's, which belong to no unit of theirs; with
           "after_cursor": every line after that cursor instead, `cursor` being where this read
           ended, for the next), keeping systemd's and torchrun's agent lines (the newest
           5000) and each rank's last `keep` lines (--tee: the ranks' output can be millions
           of lines), each line cut at max_line bytes, plus the newest KERNEL_LINES kernel OOM
           lines since the unit started (with "kernel_after_cursor": those after that cursor,
           "kernel_after" true when the read could start there)
  connect  {"address", "port", "probe": bool} -> {"resolved" | "resolve_error", "route": run result,
            "reverse_error"?, "reachable", "connect_ms" | "connect_error"}
  until    {"seconds", "every", "quick"?, "seen": digest | null} -> "seen": the
           answer's digest. The answer is gathered again every `every` seconds while its digest
           (every key but "host", whose clocks always move) is `seen`, for at most `seconds`
           (with "quick": the files alone, QUICK_KEYS, are looked at every `quick` seconds in
           between, and the whole answer gathered at once when they changed: a folder that
           appears is seen that soon, without a command started per look); a caller
           waiting for something on the host to change (a job's workers to spawn) passes the
           digest of the last answer it got and is answered when the change happens, in one
           round trip, instead of polling; null answers at once

Files are read through descriptors, one name at a time from an O_NOFOLLOW folder descriptor:
the last component is never a symlink (O_NOFOLLOW), only regular files are read (O_NONBLOCK,
then fstat: a FIFO would otherwise block the probe forever), and only with one link (a hard
link in a job's folder may be another user's file). Nothing here writes anything.
"""
import base64
import codecs
import collections
import glob
import grp
import json
import os
import pwd
import re
import stat
import subprocess
import sys
import threading
import time

NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Caps on what one request brings back (a job's output can be gigabytes of long lines): this
# process and the operator hold at most about this much per command, journal line, file.
MAX_LINE = 64 << 10    # bytes of one output line
MAX_BYTES = 32 << 20   # bytes of one command's stdout (its stderr: MAX_ERR)
MAX_ERR = 1 << 20
MAX_FILES = 256        # files one tree request reads (each a 64 KiB tail at most: 16 MiB)
MAX_RANKS = 256        # distinct [defaultN] ranks kept in a journal read (a node has a few)
MAX_KEPT = 16 << 20    # bytes of journal lines one read keeps (the oldest go first)


def lines(stream, max_line, cut):
    """A binary stream's lines (b"...\n"), each at most max_line bytes: the rest of a longer
    line is read and dropped, and counted in cut["lines"]."""
    while True:
        line = stream.readline(max_line + 1)
        if not line:
            return
        if len(line) > max_line and not line.endswith(b"\n"):
            cut["lines"] = cut.get("lines", 0) + 1
            rest = line
            while rest and not rest.endswith(b"\n"):
                rest = stream.readline(1 << 16)
            line = line[:max_line] + b"\n"
        yield line


def capped(stream, max_line, max_bytes):
    """(text, cut) of a binary stream read to its end: lines cut at max_line bytes, and past
    max_bytes in all read and dropped. cut: {} or {"lines": lines cut, "max_line",
    "dropped_bytes": bytes past max_bytes, "max_bytes"}."""
    kept, total, cut = [], 0, {}
    for line in lines(stream, max_line, cut):
        if total + len(line) > max_bytes:
            cut["dropped_bytes"] = cut.get("dropped_bytes", 0) + len(line)
            continue
        kept.append(line)
        total += len(line)
    if cut:
        cut.update(max_line=max_line, max_bytes=max_bytes)
    # output need not be UTF-8 (a vendor string from lspci or nvidia-smi)
    return b"".join(kept).decode(errors="replace"), cut


def kept(stream, max_line, max_bytes, text):
    """(text, cut, lines read) of a binary stream read to its end: only the lines containing
    `text`, and of those the newest max_bytes (the older are dropped, counted in cut like
    capped()'s): a log's newest matching lines are the ones that matter."""
    want, out, total, cut, count = text.encode(), collections.deque(), 0, {}, 0
    for line in lines(stream, max_line, cut):
        count += 1
        if want not in line:
            continue
        out.append(line)
        total += len(line)
        while total > max_bytes:
            old = out.popleft()
            total -= len(old)
            cut["dropped_bytes"] = cut.get("dropped_bytes", 0) + len(old)
    if cut:
        cut.update(max_line=max_line, max_bytes=max_bytes)
    return b"".join(out).decode(errors="replace"), cut, count


def run(argv, timeout=60, max_line=MAX_LINE, max_bytes=MAX_BYTES, keep=None):
    """The command's exit status and its output, streamed and capped (see capped(); with
    `keep`, filtered: see kept())."""
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    except FileNotFoundError:
        return {"rc": 127, "out": "", "err": "%s: command not found" % argv[0]}
    except PermissionError:
        return {"rc": 126, "out": "", "err": "%s: permission denied" % argv[0]}
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        p.kill()
    timer = threading.Timer(timeout, kill)
    timer.start()
    err = {}
    t = threading.Thread(target=lambda: err.update(r=capped(p.stderr, max_line, MAX_ERR)))
    t.start()
    if keep is None:
        out, cut = capped(p.stdout, max_line, max_bytes)
    else:
        out, cut, count = kept(p.stdout, max_line, max_bytes, keep)
    t.join()
    rc = p.wait()
    timer.cancel()
    p.stdout.close()
    p.stderr.close()
    if timed_out.is_set():
        return {"rc": 124, "out": "", "err": "%s: timed out after %ss" % (argv[0], timeout)}
    got = {"rc": rc, "out": out, "err": err["r"][0]}
    if keep is not None:
        got["lines"] = count
    if cut:
        got["cut"] = cut
    return got


def open_dir(path, dir_fd=None, follow=False):
    try:
        return os.open(path, (NOFOLLOW & ~os.O_NOFOLLOW if follow else NOFOLLOW) | os.O_DIRECTORY,
                       dir_fd=dir_fd)
    except OSError:
        return None


NO_SINCE = object()  # a read that keeps no position (not a growing file's tail)


def read_at(dir_fd, name, limit=1 << 20, tail=False, first_line=False, follow=False,
            mtime=False, since=NO_SINCE):
    """A regular single-link file `name` in dir_fd: its first `limit` bytes (or last, with
    tail) and optionally its first line and its mtime, as text; None for anything else.
    follow=True only for root's own files (/etc/os-release is a symlink): any link, any link
    count. since (a tail read): None or [inode, offset] of the last read (see the docstring's
    `read`), so a file that grows is read once, not its whole tail every time."""
    try:
        fd = os.open(name, NOFOLLOW & ~os.O_NOFOLLOW if follow else NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_nlink != 1 and not follow):
            return None
        start = max(0, st.st_size - limit) if tail else 0
        goes_on = (since is not NO_SINCE and isinstance(since, list) and len(since) == 2
                   and since[0] == st.st_ino and isinstance(since[1], int)
                   and 0 <= since[1] <= st.st_size)
        if goes_on:
            start = max(start, since[1])
        with os.fdopen(os.dup(fd), "rb") as fh:
            got = ({"first_line": fh.readline(4096).decode(errors="replace")}
                   if first_line and not goes_on else {})
            if mtime:
                got["mtime"] = st.st_mtime
            fh.seek(start)
            data = fh.read(limit)
    except OSError:
        return None
    finally:
        os.close(fd)
    if since is not NO_SINCE:  # an unfinished character at the end waits for the next read
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        got["text"] = dec.decode(data)
        data = data[:len(data) - len(dec.getstate()[0])]
        got.update(ino=st.st_ino, start=start, end=start + len(data))
    else:
        got["text"] = data.decode(errors="replace")
    got["bytes"] = data
    return got


def read(path, **kw):
    folder, name = os.path.split(path)
    dir_fd = open_dir(folder or ".", follow=kw.get("follow", False))
    if dir_fd is None:
        return None
    try:
        return read_at(dir_fd, name, **kw)
    finally:
        os.close(dir_fd)


def text_only(got):
    return None if got is None else {k: v for k, v in got.items() if k != "bytes"}


def name_of(lookup, ident):
    try:
        return lookup(ident)[0]
    except KeyError:
        return str(ident)


def stat_path(path, content):
    """Mode, owner, sha256 and text as the path resolves, as before the probe: these are
    root's own paths the planners declare (a managed folder may be a symlink an admin made)."""
    try:
        s = os.stat(path)
    except OSError:
        return None
    d = {"mode": s.st_mode & 0o7777, "is_dir": stat.S_ISDIR(s.st_mode),
         "owner": name_of(pwd.getpwuid, s.st_uid), "group": name_of(grp.getgrgid, s.st_gid)}
    if not d["is_dir"]:
        got = read(path, follow=True)
        data = got["bytes"] if got else b""
        d["sha256"] = sha256(data)
        if content:
            d["content"] = data.decode(errors="replace")
    return d


def entries(dir_fd, pattern):
    """Sub-folders of dir_fd whose name matches, as (mtime, name, fd); symlinks skipped."""
    out = []
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return out
    for name in names:
        if re.fullmatch(pattern, name):
            fd = open_dir(name, dir_fd)
            if fd is not None:
                out.append((os.fstat(fd).st_mtime, name, fd))
    return out


def tree(spec):
    top = open_dir(spec["root"])
    found = {"dirs": [], "files": {}}
    if top is None:
        return found
    level = [(os.fstat(top).st_mtime, "", top)]
    for pattern in spec.get("walk", []):
        nxt = []
        for _, rel, fd in level:
            nxt += [(m, rel + name + "/", sub) for m, name, sub in entries(fd, pattern)]
            os.close(fd)
        level = nxt
    found["dirs"] = [[rel.rstrip("/"), m] for m, rel, _ in level]
    if level:
        _, rel, newest = max(level)
        r, most = spec.get("read", {}), spec.get("most", MAX_FILES)
        since = spec["since"] if isinstance(spec.get("since"), dict) else None
        for pattern in spec.get("then", []):
            for _, name, fd in sorted(entries(newest, pattern), key=lambda e: e[1]):
                if len(found["files"]) < most:
                    path = rel + name + "/" + r["name"]
                    found["files"][path] = text_only(read_at(
                        fd, r["name"], limit=r.get("tail", 65536), tail=True,
                        first_line=r.get("first_line", False), mtime=r.get("mtime", False),
                        since=NO_SINCE if since is None else since.get(path)))
                else:
                    found["cut"] = {"files_left_out": found.get("cut", {}).get(
                        "files_left_out", 0) + 1, "most": most}
                os.close(fd)
    for _, _, fd in level:
        os.close(fd)
    return found


TEE = re.compile(r"^\[default(\d+)\]:")


def keep_lines(numbered, keep, others=5000, cut=None):
    """[(i, line)] in journal order -> the lines kept of the unit's newest start on: systemd's
    and the agent's (the newest `others`) and each rank's last `keep` lines, in order; at most
    MAX_RANKS ranks and MAX_KEPT bytes in all (a worker can write any `[defaultN]:` line to
    its journal), what that left out counted in `cut`. The operator's `status --watch` keeps
    its journal with it too (logs/diagnose.py)."""
    other = collections.deque(maxlen=others)
    ranks = {}
    for i, line in numbered:
        if line.startswith("Started torchrig-"):
            other.clear()
            ranks.clear()
        m = TEE.match(line)
        if m and (m.group(1) in ranks or len(ranks) < MAX_RANKS):
            ranks.setdefault(m.group(1), collections.deque(maxlen=keep)).append((i, line))
        elif m:
            if cut is not None:
                cut["ranks_left_out"] = cut.get("ranks_left_out", 0) + 1
                cut["max_ranks"] = MAX_RANKS
        else:
            other.append((i, line))
    kept = sorted(list(other) + [x for d in ranks.values() for x in d])
    total, first = 0, len(kept)
    while first > 0 and total + len(kept[first - 1][1]) + 1 <= MAX_KEPT:
        first -= 1
        total += len(kept[first][1]) + 1
    if first and cut is not None:
        cut["oldest_dropped"] = cut.get("oldest_dropped", 0) + first
        cut["max_kept"] = MAX_KEPT
    return kept[first:]


CURSOR = "-- cursor: "


def journal(spec):
    match = ["-t", spec["ident"]] if spec.get("ident") else ["-u", spec["unit"]]
    since = (["--after-cursor", spec["after_cursor"]] if spec.get("after_cursor")
             else ["-n", str(spec["lines"])])
    p = subprocess.Popen(["journalctl", *match, "-o", "cat", "--no-pager", "-q", "--show-cursor",
                          *since], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL)
    cut, cursor, read = {}, spec.get("after_cursor"), 0

    def numbered():
        nonlocal cursor, read
        for i, raw in enumerate(lines(p.stdout, spec.get("max_line", MAX_LINE), cut)):
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(CURSOR):  # --show-cursor's last line, after the entries
                cursor = line[len(CURSOR):]
            else:
                read += 1
                yield i, line
    kept = keep_lines(numbered(), spec["keep"], cut=cut)
    if p.wait() != 0 and spec.get("after_cursor"):  # the cursor is gone: read afresh
        return {**journal({k: v for k, v in spec.items() if k != "after_cursor"}), "reset": True}
    start = run(["systemctl", "show", "-p", "ExecMainStartTimestamp", "--value", "--", spec["unit"]])["out"].strip()
    got = {"year": int(time.strftime("%Y")), "utc_offset": time.strftime("%z"),
           "journal": "\n".join(ln for _, ln in kept), "cursor": cursor, "read": read,
           **kernel_oom(start, spec.get("kernel_after_cursor"))}
    if cut:
        got["cut"] = {**cut, "max_line": spec.get("max_line", MAX_LINE)}
    return got


KERNEL_LINES = 200  # the newest kernel OOM lines a journal read keeps


def kernel_oom(start, after=None):
    """{"kernel": the kernel's OOM lines since the unit started (`start`, systemd's timestamp;
    the newest KERNEL_LINES), "kernel_cursor": where this read ended, "kernel_after": whether
    it read only the lines after the cursor `after` (a --watch round: what it costs does not
    grow with the kernel's log since the job started)}."""
    argv = ["journalctl", "-k", "-o", "cat", "--no-pager", "-q", "--show-cursor"]
    r = run(argv + (["--after-cursor", after] if after else ["--since", start] if start else []))
    if after and r["rc"] != 0:  # the cursor is gone (rotated, vacuumed): since the start
        return kernel_oom(start)
    cursor, oom = after, []
    for ln in r["out"].splitlines():
        if ln.startswith(CURSOR):
            cursor = ln[len(CURSOR):]
        elif re.search(r"oom|Killed process", ln, re.I):
            oom.append(ln)
    return {"kernel": "\n".join(oom[-KERNEL_LINES:]), "kernel_cursor": cursor,
            "kernel_after": bool(after)}


def connect(peer):
    import socket  # here: only a launch's connectivity check needs it (3 ms of a probe's start)
    net = {}
    try:
        ip = socket.getaddrinfo(peer["address"], peer["port"], socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        net["resolved"] = ip
    except OSError as e:
        net["resolve_error"] = str(e)
        return net
    net["route"] = run(["ip", "-j", "route", "get", ip])
    if peer.get("probe", True):  # launch's fast gate wants the route only
        # c10d's store socket is dual-stack: peers reach it as ::ffff:a.b.c.d, and every
        # rank logs a warning when that address has no name (glibc's hosts file does not
        # map it; DNS does)
        try:
            socket.getnameinfo(("::ffff:" + ip, 0, 0, 0), socket.NI_NAMEREQD)
        except OSError as e:
            net["reverse_error"] = str(e)
        t0 = time.monotonic()
        try:
            with socket.create_connection((ip, peer["port"]), timeout=5):
                net["reachable"] = True
                net["connect_ms"] = round((time.monotonic() - t0) * 1000, 2)
        except OSError as e:
            net["reachable"] = False
            net["connect_error"] = str(e)
    return net


def main(request_b64):
    want = json.loads(base64.b64decode(request_b64))
    out = answer(want)
    until = want.get("until")
    if until:
        end = time.monotonic() + min(float(until["seconds"]), 60.0)
        seen = until.get("seen")
        every = max(0.02, float(until.get("every", 0.1)))
        quick = until.get("quick")
        files = {k: want[k] for k in QUICK_KEYS if k in want}
        # `out`'s digests, taken once per whole answer (the quick looks compare against them)
        mine, looked, full = digest(out), digest(out, QUICK_KEYS), time.monotonic()
        while mine == seen and time.monotonic() < end:
            if quick:  # the files alone between full answers: no command run for them
                time.sleep(max(0.01, float(quick)))
                if time.monotonic() < full + every and digest(answer(files), QUICK_KEYS) == looked:
                    continue
            else:
                time.sleep(every)
            out = answer(want)
            mine, looked, full = digest(out), digest(out, QUICK_KEYS), time.monotonic()
        out["seen"] = mine
    sys.stdout.write(json.dumps(out))


# what `until`'s quick looks gather: this process's own reads of files, no command started
QUICK_KEYS = ("read", "stat", "exists", "glob", "tree")


def sha256(data):
    import hashlib  # here: most probes hash nothing, and loading OpenSSL is 4 ms of a start
    return hashlib.sha256(data).hexdigest()


def digest(out, keys=None):
    """The answer's identity for "until": every key but the host's clocks (or `keys` only)."""
    same = {k: v for k, v in out.items() if k != "host" and (keys is None or k in keys)}
    return sha256(json.dumps(same, sort_keys=True).encode())


def answer(want):
    out = {}
    cmds = want.get("run", {})
    gate = threading.BoundedSemaphore(max(1, min(want.get("jobs", 8), 32)))
    started = {}
    for name, c in cmds.items():
        c = c if isinstance(c, dict) else {"argv": c}
        started[name] = Later(gate, run, c["argv"], c.get("timeout", 60),
                              c.get("max_line", MAX_LINE), c.get("max_bytes", MAX_BYTES), c.get("keep"))
    jour = Later(gate, journal, want["journal"]) if want.get("journal") else None
    # while the commands run, the file system
    out["read"] = {n: text_only(read(r["path"], limit=r.get("limit", 1 << 20), tail=r.get("tail", False),
                                     first_line=r.get("first_line", False), follow=r.get("follow", False),
                                     since=r["since"] if "since" in r else NO_SINCE))
                   for n, r in want.get("read", {}).items()}
    out["stat"] = {p: stat_path(p, c) for p, c in want.get("stat", {}).items()}
    out["exists"] = {p: os.path.exists(p) for p in want.get("exists", [])}
    out["glob"] = {n: {p: (text_only(read(p, limit=g.get("limit", 1 << 20))) or {}).get("text")
                       for p in sorted(glob.glob(g["pattern"]))}
                   for n, g in want.get("glob", {}).items()}
    users = {}
    for u in want.get("users", []):
        try:
            pw = pwd.getpwnam(u)
            users[u] = {"uid": pw.pw_uid, "shell": pw.pw_shell}
        except KeyError:
            users[u] = None
    out["users"] = users
    if want.get("host"):
        st = os.statvfs("/")
        out["host"] = {"arch": os.uname().machine, "kernel": os.uname().release, "euid": os.geteuid(),
                       "hostname": os.uname().nodename,
                       "disk_free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1),
                       "time": time.time(), "monotonic": time.clock_gettime(time.CLOCK_MONOTONIC)}
    out["tree"] = {n: tree(t) for n, t in want.get("tree", {}).items()}
    if want.get("connect"):
        out["connect"] = connect(want["connect"])
    out["run"] = {name: f.result() for name, f in started.items()}
    if jour is not None:
        out["journal"] = jour.result()
    return out


class Later:
    """fn(*args) on a thread of its own once `gate` (at most `jobs` at once) lets it; result()
    waits for it and returns its value or raises its error. What the probe used of
    concurrent.futures' pool, whose import (it brings logging) was a fifth of every probe's
    start on a node. Not a daemon: as with the pool, the probe ends only once its commands
    did, also when it fails before their results are taken."""

    def __init__(self, gate, fn, *args):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._call, args=(gate, fn, args))
        self._thread.start()

    def _call(self, gate, fn, args):
        with gate:
            try:
                self._value = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised by result(), as a future's
                self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
