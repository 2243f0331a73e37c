"""Follow torchrun's per-rank log files on a node and stream them as records on stdout.

Runs ON THE NODE as root, standard library only, Python 3.6+, as `python3 -I -` (isolated:
no module is imported from the working directory or PYTHON* variables) with the whole script
on stdin and its arguments in its first line (stream.follower_input), so nothing shows in
argv (offsets of many restarts x ranks exceed the per-argument limit):

    ARGS = '{"dir": "/var/log/torchrig/JOB", "offsets": {}, "follow": true, ...}'
    <this file>

Arguments (one JSON object, the ARGS string):
    dir           torchrun's --log-dir (torchrig: /var/log/torchrig/<job>/)
    offsets       {relpath: [byte offset, identity or null]}: where the operator already is
                  (resume after reconnect). A file whose identity differs (removed and
                  refilled while the operator was away) is read again from its start.
    follow        false: one pass, then exit. true: keep polling (see exit rules below)
    unit          systemd unit of the job, or null. With follow: exit once
                  `systemctl is-active UNIT` is no longer one of `running` and one more scan
                  found nothing new (drain)
    running       the unit states that count as running (torchrig.job.RUNNING_STATES)
    slurm_job     the job's Slurm id when Slurm runs it (then `unit` only names it): its
                  state comes from `squeue` instead
    slurm_live    the Slurm job states that count as running (torchrig.facts.slurm.LIVE)
    poll          seconds between scans in follow mode (default 0.2)
    idle_exit     with follow: exit after this many seconds without new data (null: never)
    heartbeat     seconds between heartbeat records in follow mode (default 5)
    since         unix time or null: files first seen with an older mtime are skipped
                  (read from their end), so only runs written since then are shown
    flush_partial emit a final line that has no newline yet, at exit: true / false / null.
                  null (default): only when `unit` is given and known to be no longer running
                  (the run is over, so the line will never be completed)

Files followed, relative to dir (torchrun --redirects 3 --tee 3 layout):
    <run>/attempt_<N>/<local_rank>/stdout.log, stderr.log, error.json
<run> is <rdzv_id>_<random>: a new one per torchrun start; attempt_<N+1> per group restart.

The folder and everything in it belong to the job (the service user), and this runs as root:
it is walked through directory descriptors, every component opened with O_NOFOLLOW, so no
symlink is ever followed (not even `dir` itself); a file is read only if it is a regular file
with a single link (a FIFO would block, a hard link may be someone else's file); names other
than torchrun's are skipped. Nothing is ever written there. What is refused is told once (W).

Records, one per line on stdout, fields separated by one TAB, UTF-8 (invalid bytes replaced):
    L<TAB>relpath<TAB>offset<TAB>text   one log line; offset = byte offset just after its
                                        newline (resume point). The text is the line without
                                        its trailing "\\n"/"\\r\\n"; other "\\r" become the two
                                        characters backslash-r (no record ever holds a CR).
                                        The text may itself contain TABs: split at most 3 times.
    E<TAB>relpath<TAB>size<TAB>json     an error.json, once, as JSON on one line (unparsable
                                        content: {"torchrig_unparsed": "<text>"})
    T<TAB>relpath<TAB>0                 the file shrank or was replaced (folder reused):
                                        reading restarts at 0; lines that follow are new
    I<TAB>relpath<TAB>identity          the file's identity, "<inode>:<n>:<sha256 of its first
                                        n bytes, 16 hex>", before its first L/E record of a
                                        session and again while n grows (up to HEAD bytes);
                                        the operator hands it back with the offset on resume
    W<TAB>relpath<TAB>reason            a followed name that is not read (a symlink, a FIFO,
                                        ...), once per session; "." is dir itself
    H<TAB>unix_time                     heartbeat (follow mode), so a dead connection shows

A line longer than MAX_LINE bytes is emitted in pieces of MAX_LINE bytes, cut at multiples of
MAX_LINE from the line's start, the last piece ending at the newline (memory stays bounded);
files are read in CHUNK-sized pieces. Exit status 0 (2: bad arguments).
"""

import errno
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import time

CHUNK = 256 * 1024
PASS_BUDGET = 4 * 1024 * 1024  # bytes per file per scan, so one huge file cannot starve others
MAX_LINE = 1024 * 1024
MAX_ERROR_JSON = 4 * 1024 * 1024
HEAD = 4096  # bytes of a file's start hashed into its identity
STREAMS = ("stdout.log", "stderr.log", "error.json")  # this order: start line before stderr
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | CLOEXEC
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | CLOEXEC  # NONBLOCK: a FIFO never blocks
# names torchrun gives (job names are [a-z0-9_-], mkdtemp adds [a-z0-9_]); anything else (a
# newline or TAB would break the record framing, an escape sequence the operator's terminal)
# is skipped
RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}\Z")
ATTEMPT_RE = re.compile(r"attempt_([0-9]{1,9})\Z")
RANK_RE = re.compile(r"[0-9]{1,9}\Z")


class Out:
    def __init__(self):
        self.buf = sys.stdout.buffer
        self.count = 0  # data records (not heartbeats) written

    def record(self, *fields):
        self.buf.write("\t".join(fields).encode("utf-8", "replace") + b"\n")
        self.count += 1

    def heartbeat(self):
        self.buf.write(("H\t%.3f\n" % time.time()).encode())

    def flush(self):
        self.buf.flush()


class Refused(Exception):
    """A name that is there but is not read: its reason goes to the operator once."""


def kind_of(mode):
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "of unknown type"


def opened(name, flags, dir_fd, refused):
    """os.open(name, flags, dir_fd=dir_fd); None if `name` is not there (yet, or any more), or
    is a regular file where a folder was asked for (the job's own files, e.g. gpumon's
    gpu_util.csv, sit beside the run folders: not torchrun's, nothing to say);
    Refused("<what it is>, <refused>") if it is there but cannot be opened so (a symlink), with
    the system's reason when what it is does not explain it (permission, too many files)."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return None
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            return None
        if flags & os.O_DIRECTORY and stat.S_ISREG(mode):
            return None
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):  # its type is not why it failed
            raise Refused("%s that cannot be opened (%s), %s"
                          % (kind_of(mode), os.strerror(e.errno), refused))
        raise Refused(kind_of(mode) + ", " + refused)


def open_dir(name, dir_fd=None):
    """A descriptor of directory `name` (in dir_fd), never through a symlink; None if missing."""
    return opened(name, OPEN_DIR, dir_fd, "not followed")


def open_file(name, dir_fd):
    """(file object, stat) of regular file `name` in dir_fd, never through a symlink and never
    blocking (O_NONBLOCK); None if it vanished; Refused for anything else."""
    fd = opened(name, OPEN_FILE, dir_fd, "not read")
    if fd is None:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Refused(kind_of(st.st_mode) + ", not read")
    if st.st_nlink == 0:  # removed since the scan (torchrun clearing a folder)
        os.close(fd)
        return None
    if st.st_nlink > 1:  # a hard link to a file the job does not own (e.g. /etc/shadow)
        os.close(fd)
        raise Refused("a file with %d hard links, not read" % st.st_nlink)
    return os.fdopen(fd, "rb"), st


def identity(f, st):
    """'<inode>:<n>:<hash>' of an open file: inode and a hash of its first n <= HEAD bytes, so a
    file removed and refilled (even on a reused inode) does not pass for the old one."""
    head = os.pread(f.fileno(), HEAD, 0)
    return "%d:%d:%s" % (st.st_ino, len(head), hashlib.sha256(head).hexdigest()[:16])


def same_file(f, st, ident):
    """Whether the open file is the one `ident` (from identity()) was taken of."""
    try:
        ino, n, digest = str(ident).split(":")
        ino, n = int(ino), int(n)
    except ValueError:
        return False
    if st.st_ino != ino or st.st_size < n:
        return False
    return hashlib.sha256(os.pread(f.fileno(), n, 0)).hexdigest()[:16] == digest


def text_of(raw):
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    return raw.decode("utf-8", "replace").replace("\r", "\\r")


class Tracked:
    """What LogFile and ErrorFile share: identity across scans and sessions."""

    def __init__(self, rel, expect):
        self.rel = rel
        self.ident = None  # (dev, inode) once opened in this session
        self.gone = False  # missing from a scan after having been opened: a new file if seen again
        self.expect = expect  # identity the operator resumed with, checked at the first open
        self.told = None  # identity last sent (I record)

    def replaced(self, f, st):
        """True if the open file is not the one read so far (this session or the last)."""
        key = (st.st_dev, st.st_ino)
        new = self.gone or (self.ident is not None and key != self.ident)
        if self.expect is not None:
            new = new or not same_file(f, st, self.expect)
            self.expect = None
        self.ident, self.gone = key, False
        return new

    def tell_identity(self, f, st, out, force=False):
        """Send the identity before data of a new session, and again while its hashed head
        grows, so the operator always resumes with the longest head known."""
        n = int(self.told.split(":")[1]) if self.told else -1
        if force or self.told is None or (n < HEAD and st.st_size > n):
            self.told = identity(f, st)
            out.record("I", self.rel, self.told)


class LogFile(Tracked):
    """A .log file: `offset` is what was emitted, `pending` the partial line read after it."""

    def __init__(self, rel, offset, expect=None, since=None):
        Tracked.__init__(self, rel, expect)
        self.offset, self.pending = offset, b""
        self.since = since  # first open: a file last written before it is read from its end

    def restart(self, out):
        out.record("T", self.rel, "0")
        self.offset, self.pending = 0, b""

    def read(self, dir_fd, name, out):
        """Read up to PASS_BUDGET new bytes; return how many were read."""
        opened = open_file(name, dir_fd)
        if opened is None:
            return 0  # vanished between the scan and now
        f, st = opened
        with f:
            if self.since is not None:
                if st.st_mtime < self.since:
                    self.offset = st.st_size
                self.since = None
            pos = self.offset + len(self.pending)
            restart = self.replaced(f, st) or st.st_size < pos
            if not restart and self.told is not None and st.st_size > pos:
                # refilled between two scans on a reused inode: only its head tells
                restart = not same_file(f, st, self.told)
            if restart:
                self.restart(out)
                pos = 0
            self.tell_identity(f, st, out, force=restart)
            if st.st_size == pos:
                return 0
            f.seek(pos)
            done = 0
            # no further than the size whose head was just checked: bytes written after it
            # may belong to a refilled file, checked at the next scan
            budget = min(PASS_BUDGET, st.st_size - pos)
            while done < budget:
                chunk = f.read(min(CHUNK, budget - done))
                if not chunk:
                    break
                done += len(chunk)
                self._consume(chunk, out)
            return done

    def _consume(self, chunk, out):
        data = self.pending + chunk
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            start = self._emit(out, data, start, nl, 1)
        # no newline in sight: keep at most MAX_LINE bytes back
        self.pending = data[self._emit(out, data, start, len(data), 0, keep=True):]

    def _emit(self, out, data, start, end, nl, keep=False):
        """Emit data[start:end] (+ nl newline bytes) as records of at most MAX_LINE bytes of
        text, cut at multiples of MAX_LINE from the line's start; return where emitting stopped.
        keep: the line is unfinished, hold back its last (<= MAX_LINE) bytes."""
        while end - start > MAX_LINE:
            piece = data[start:start + MAX_LINE]
            self.offset += len(piece)
            out.record("L", self.rel, str(self.offset), text_of(piece))
            start += MAX_LINE
        if keep:
            return start
        self.offset += end - start + nl
        out.record("L", self.rel, str(self.offset), text_of(data[start:end]))
        return end + nl

    def flush_partial(self, out):
        if self.pending:
            self.offset += len(self.pending)
            out.record("L", self.rel, str(self.offset), text_of(self.pending))
            self.pending = b""


class ErrorFile(Tracked):
    """error.json: emitted once, whole; emitted again only if replaced (size or identity)."""

    def __init__(self, rel, offset, expect=None, since=None):
        Tracked.__init__(self, rel, expect)
        self.done_size, self.tries = offset or None, 0

    def read(self, dir_fd, name, out, final):
        opened = open_file(name, dir_fd)
        if opened is None:
            return False
        f, st = opened
        with f:
            replaced = self.replaced(f, st)
            if self.done_size is not None:
                if st.st_size == self.done_size and not replaced:
                    return False
                out.record("T", self.rel, "0")  # replaced: a new failure report
                self.done_size = None
            if st.st_size == 0 and not final:
                return False  # being created
            raw = f.read(MAX_ERROR_JSON)
            text = raw.decode("utf-8", "replace")
            try:
                doc = json.loads(text)
            except ValueError:
                # torch writes it with one json.dump: probably caught mid-write. Retry a few scans.
                self.tries += 1
                if self.tries < 10 and not final:
                    return False
                doc = {"torchrig_unparsed": text}
            self.tell_identity(f, st, out, force=True)
        self.tries = 0
        self.done_size = st.st_size
        out.record("E", self.rel, str(st.st_size), json.dumps(doc, sort_keys=True))
        return True


def entries(dir_fd):
    try:
        return os.listdir(dir_fd)
    except OSError:  # vanished
        return []


class Tree:
    """The job's log folder, walked through directory descriptors (see the module doc)."""

    def __init__(self, root, out):
        self.root, self.out, self.warned = root, out, set()

    def refuse(self, rel, why):
        if rel not in self.warned:
            self.warned.add(rel)
            self.out.record("W", rel, why)

    def _sub(self, dir_fd, name, rel):
        try:
            return open_dir(name, dir_fd)
        except Refused as e:
            self.refuse(rel, str(e))
            return None

    def scan(self):
        """Yield (relpath, rank folder descriptor, file name) for the followed files that exist
        now, in a stable order; each descriptor stays open until the next item is asked for."""
        root = self._sub(None, self.root, ".")
        if root is None:
            return
        try:
            for run in sorted(n for n in entries(root) if RUN_RE.match(n)):
                rfd = self._sub(root, run, run)
                if rfd is None:
                    continue
                try:
                    atts = [(int(m.group(1)), n) for n in entries(rfd)
                            for m in [ATTEMPT_RE.match(n)] if m]
                    for _, att in sorted(atts):
                        afd = self._sub(rfd, att, run + "/" + att)
                        if afd is None:
                            continue
                        try:
                            ranks = sorted(int(n) for n in entries(afd) if RANK_RE.match(n))
                            for rank in ranks:
                                rel = "/".join((run, att, str(rank)))
                                kfd = self._sub(afd, str(rank), rel)
                                if kfd is None:
                                    continue
                                try:
                                    names = set(entries(kfd))
                                    for name in STREAMS:
                                        if name in names:
                                            yield rel + "/" + name, kfd, name
                                finally:
                                    os.close(kfd)
                        finally:
                            os.close(afd)
                finally:
                    os.close(rfd)
        finally:
            os.close(root)


class Follower:
    def __init__(self, root, offsets, out, since=None):
        self.tree, self.out, self.files, self.since = Tree(root, out), out, {}, since
        for rel, off in (offsets or {}).items():
            off, ident = (off, None) if isinstance(off, int) else off
            self.files[rel] = self._new(rel, int(off), ident)

    def _new(self, rel, off, ident=None, since=None):
        kind = ErrorFile if rel.endswith("/error.json") else LogFile
        return kind(rel, off, ident, since)

    def one_pass(self, final=False):
        """Read whatever is new; True if anything was emitted (heartbeats excluded)."""
        before = self.out.count
        more = True
        while more:  # repeat while some file hit its per-scan budget
            more = False
            seen = set()
            for rel, dir_fd, name in self.tree.scan():
                seen.add(rel)
                st = self.files.get(rel)
                if st is None:  # --since: files last written before it are read from their end
                    st = self.files[rel] = self._new(rel, 0, since=self.since)
                try:
                    if isinstance(st, ErrorFile):
                        st.read(dir_fd, name, self.out, final)
                    elif st.read(dir_fd, name, self.out) >= PASS_BUDGET:
                        more = True
                except Refused as e:
                    self.tree.refuse(rel, str(e))
                self.out.flush()
            for rel, st in self.files.items():
                if rel not in seen and st.ident is not None:
                    st.gone = True  # deleted (torchrun clears an attempt folder before reuse)
        return self.out.count > before

    def flush_partials(self):
        for st in self.files.values():
            if isinstance(st, LogFile):
                st.flush_partial(self.out)
        self.out.flush()


def slurm_state(job_id, live):
    """'active' while Slurm holds the job, 'inactive' once it ended, None: cannot ask."""
    try:
        p = subprocess.run(["squeue", "--noheader", "--states", "all", "--jobs", str(job_id),
                            "--format", "%T"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, universal_newlines=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    return "active" if p.stdout.strip() in live else "inactive"


def unit_state(unit, slurm_job, slurm_live):
    """'active', 'inactive', ... or None when systemd (Slurm) cannot be asked."""
    if slurm_job:
        return slurm_state(slurm_job, slurm_live)
    try:
        p = subprocess.run(["systemctl", "is-active", unit], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, universal_newlines=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() or None


def main(text):
    try:
        args = json.loads(text)
        root, running, slurm_live = args["dir"], args["running"], args["slurm_live"]
    except (ValueError, KeyError, TypeError) as e:
        sys.stderr.write("follow: bad arguments: %r\n" % (e,))
        return 2
    follow = bool(args.get("follow"))
    unit = args.get("unit")
    poll = float(args.get("poll") or 0.2)
    idle_exit = args.get("idle_exit")
    hb_every = float(args.get("heartbeat") or 5.0)
    flush_partial = args.get("flush_partial")

    out = Out()
    fol = Follower(root, args.get("offsets"), out, args.get("since"))
    over = False  # the unit is known to have stopped
    if not follow:
        if unit:
            state = unit_state(unit, args.get("slurm_job"), slurm_live)
            over = state is not None and state not in running
        fol.one_pass(final=True)
    else:
        out.heartbeat()
        out.flush()
        last_data = last_hb = time.time()
        last_unit_check = 0.0
        while True:
            stopped = False
            now = time.time()
            if unit and now - last_unit_check >= max(poll, 1.0):
                last_unit_check = now
                state = unit_state(unit, args.get("slurm_job"), slurm_live)
                stopped = state is not None and state not in running
            # unit state first, then scan: whatever was written before it stopped is read now
            got = fol.one_pass(final=stopped)
            now = time.time()
            if got:
                last_data = now
            if stopped and not got:
                over = True
                break
            if idle_exit is not None and now - last_data >= float(idle_exit):
                break
            if now - last_hb >= hb_every:
                out.heartbeat()
                out.flush()
                last_hb = now
            if not got:
                time.sleep(poll)
    if flush_partial or (flush_partial is None and over):
        fol.flush_partials()
    out.flush()
    return 0


if __name__ == "__main__":
    try:
        code = main(globals().get("ARGS"))
    except (BrokenPipeError, KeyboardInterrupt):
        # the operator went away: nobody is left to read anything
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        code = 0
    sys.exit(code)
