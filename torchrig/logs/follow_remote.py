"""Follow torchrun's per-rank log files on a node and stream them as records on stdout.

Runs ON THE NODE, standard library only, Python 3.6+:

    python3 - '{"dir": "/var/log/torchrig/JOB", "offsets": {}, "follow": true, ...}' < follow_remote.py

Arguments (one JSON object, argv[1]):
    dir           torchrun's --log-dir (torchrig: /var/log/torchrig/<job>/)
    offsets       {relpath: byte offset}: where the operator already is (resume after reconnect)
    follow        false: one pass, then exit. true: keep polling (see exit rules below)
    unit          systemd unit of the job, or null. With follow: exit once
                  `systemctl is-active UNIT` is no longer active/activating/reloading/deactivating
                  and one more scan found nothing new (drain)
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
    H<TAB>unix_time                     heartbeat (follow mode), so a dead connection shows

A line longer than MAX_LINE bytes is emitted in pieces of MAX_LINE bytes, cut at multiples of
MAX_LINE from the line's start, the last piece ending at the newline (memory stays bounded);
files are read in CHUNK-sized pieces. Exit status 0 (2: bad arguments).
"""

import json
import os
import subprocess
import sys
import time

CHUNK = 256 * 1024
PASS_BUDGET = 4 * 1024 * 1024  # bytes per file per scan, so one huge file cannot starve others
MAX_LINE = 1024 * 1024
MAX_ERROR_JSON = 4 * 1024 * 1024
STREAMS = ("stdout.log", "stderr.log", "error.json")  # this order: start line before stderr
RUNNING = ("active", "activating", "reloading", "deactivating")


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


def text_of(raw):
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    return raw.decode("utf-8", "replace").replace("\r", "\\r")


class LogFile:
    """A .log file: `offset` is what was emitted, `pending` the partial line read after it."""

    def __init__(self, rel, offset):
        self.rel, self.offset, self.pending = rel, offset, b""
        self.ident = None  # (dev, inode) once opened in this session
        self.gone = False  # missing from a scan after having been opened: a new file if seen again

    def restart(self, out):
        out.record("T", self.rel, "0")
        self.offset, self.pending = 0, b""

    def read(self, path, out):
        """Read up to PASS_BUDGET new bytes; return how many were read."""
        try:
            f = open(path, "rb")
        except OSError:
            return 0  # vanished between the scan and now
        with f:
            st = os.fstat(f.fileno())
            ident = (st.st_dev, st.st_ino)
            pos = self.offset + len(self.pending)
            replaced = self.gone or (self.ident is not None and ident != self.ident)
            if replaced or st.st_size < pos:
                self.restart(out)
                pos = 0
            self.ident, self.gone = ident, False
            if st.st_size == pos:
                return 0
            f.seek(pos)
            done = 0
            while done < PASS_BUDGET:
                chunk = f.read(min(CHUNK, PASS_BUDGET - done))
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


class ErrorFile:
    """error.json: emitted once, whole; emitted again only if replaced (size or inode change)."""

    def __init__(self, rel, offset):
        self.rel, self.done_size, self.ident, self.tries = rel, offset or None, None, 0
        self.gone = False

    def read(self, path, out, final):
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                ident = (st.st_dev, st.st_ino)
                if self.done_size is not None:
                    same = not self.gone and self.ident in (None, ident)
                    self.gone = False
                    if st.st_size == self.done_size and same:
                        self.ident = ident
                        return False
                    out.record("T", self.rel, "0")  # replaced: a new failure report
                    self.done_size = None
                if st.st_size == 0 and not final:
                    return False  # being created
                raw = f.read(MAX_ERROR_JSON)
        except OSError:
            return False
        text = raw.decode("utf-8", "replace")
        try:
            doc = json.loads(text)
        except ValueError:
            # torch writes it with one json.dump: probably caught mid-write. Retry a few scans.
            self.tries += 1
            if self.tries < 10 and not final:
                return False
            doc = {"torchrig_unparsed": text}
        self.tries = 0
        self.done_size, self.ident = st.st_size, ident
        out.record("E", self.rel, str(st.st_size), json.dumps(doc, sort_keys=True))
        return True


def listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:  # missing, vanished, not a directory
        return []


def scan(root):
    """Yield relpaths of the followed files that exist now, in a stable order."""
    for run in listdir(root):
        rp = os.path.join(root, run)
        attempts = [a for a in listdir(rp) if a.startswith("attempt_") and a[8:].isdigit()]
        for att in sorted(attempts, key=lambda a: int(a[8:])):
            ap = os.path.join(rp, att)
            ranks = [r for r in listdir(ap) if r.isdigit()]
            for rank in sorted(ranks, key=int):
                names = set(listdir(os.path.join(ap, rank)))
                for name in STREAMS:
                    if name in names:
                        yield "/".join((run, att, rank, name))


class Follower:
    def __init__(self, root, offsets, out, since=None):
        self.root, self.out, self.files, self.since = root, out, {}, since
        for rel, off in (offsets or {}).items():
            self.files[rel] = self._new(rel, int(off))

    @staticmethod
    def _new(rel, off):
        return ErrorFile(rel, off) if rel.endswith("/error.json") else LogFile(rel, off)

    def one_pass(self, final=False):
        """Read whatever is new; True if anything was emitted (heartbeats excluded)."""
        before = self.out.count
        more = True
        while more:  # repeat while some file hit its per-scan budget
            more = False
            seen = set()
            for rel in scan(self.root):
                seen.add(rel)
                st = self.files.get(rel)
                path = os.path.join(self.root, *rel.split("/"))
                if st is None:
                    start = 0
                    if self.since is not None:  # --since: files last written before it are skipped
                        try:
                            info = os.stat(path)
                            if info.st_mtime < self.since:
                                start = info.st_size
                        except OSError:
                            pass
                    st = self.files[rel] = self._new(rel, start)
                if isinstance(st, ErrorFile):
                    st.read(path, self.out, final)
                elif st.read(path, self.out) >= PASS_BUDGET:
                    more = True
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


def unit_state(unit):
    """'active', 'inactive', ... or None when systemd cannot be asked."""
    try:
        p = subprocess.run(["systemctl", "is-active", unit], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, universal_newlines=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() or None


def main(argv):
    try:
        args = json.loads(argv[1])
        root = args["dir"]
    except (IndexError, ValueError, KeyError, TypeError) as e:
        sys.stderr.write("follow_remote: bad arguments: %r\n" % (e,))
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
            state = unit_state(unit)
            over = state is not None and state not in RUNNING
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
                state = unit_state(unit)
                stopped = state is not None and state not in RUNNING
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
        code = main(sys.argv)
    except (BrokenPipeError, KeyboardInterrupt):
        # the operator went away: nobody is left to read anything
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        code = 0
    sys.exit(code)
