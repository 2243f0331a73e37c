"""torchrig's per-job sampler: runs ON THE NODE from the job's payload release, as the job's
service user (torchrig-gpumon@JOB.service, every few seconds while the job runs). Standard
library only; `python3 -I` (nothing from the environment or the working directory).

One `nvidia-smi --query-gpu` call per sample gives both the line `invoke status` reads
(appended to gpu_util.csv in the job's log folder) and the GPU series; the job series come from
rank 0's progress lines (progress.py, the one protocol) in torchrun's newest attempt and from
the unit's state. All go to <textfile dir>/torchrig_<job>.prom for node_exporter's textfile
collector, written to a temporary name in that folder and renamed over the old file (a scrape
never reads half a file). Names and help are metrics.py's.

Everything read here was written by the job (same user): files are opened without following
a last-component symlink and only when regular (a FIFO would block the sampler), and the tail
of each file only.
"""
import argparse
import json
import os
import stat
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the release folder (root's): progress.py and metrics.py beside us
import metrics  # noqa: E402
import progress  # noqa: E402

TAIL = 65536
STATE_FILE = ".gpumon-state.json"  # in the job's log folder: when the last progress line was first seen
BUSY = ("active", "activating", "deactivating", "reloading")
NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def run(argv, timeout=20):
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return 127, ""
    return r.returncode, r.stdout.decode(errors="replace")


def read(path, limit=TAIL, tail=True):
    """(the last `limit` bytes, or the first with tail=False, as text; mtime) of a regular
    file, or (None, None)."""
    try:
        fd = os.open(path, NOFOLLOW)
    except OSError:
        return None, None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, None
        if tail:
            os.lseek(fd, max(0, st.st_size - limit), os.SEEK_SET)
        return os.read(fd, limit).decode(errors="replace"), st.st_mtime
    finally:
        os.close(fd)


def digits(name):
    return name.isascii() and name.isdigit()  # int() takes other scripts' digits too


def subdirs(path, pred):
    """The folders (not links) in `path` whose name passes `pred`, oldest first."""
    try:
        found = [(e.stat(follow_symlinks=False).st_mtime, e.name, e) for e in os.scandir(path)
                 if e.is_dir(follow_symlinks=False) and pred(e.name)]
    except OSError:  # gone meanwhile (torchrun removes an attempt's folder before reusing it)
        return []
    return [e for _, _, e in sorted(found)]


def last_progress(logdir):
    """(rank, fields, line, is the file's last line, mtime) of the last progress line in the
    newest attempt of the newest run (rank 0's, else the first rank with one), and that
    attempt's number; (None, ...) when there is none."""
    runs = subdirs(logdir, lambda n: not n.startswith("."))
    if not runs:
        return None, None
    attempts = subdirs(runs[-1].path, lambda n: n.startswith("attempt_") and digits(n[8:]))
    if not attempts:
        return None, None
    newest = attempts[-1]
    found = None
    for rank_dir in sorted(subdirs(newest.path, digits), key=lambda e: int(e.name)):
        log = os.path.join(rank_dir.path, "stdout.log")
        text, mtime = read(log)
        if not text:
            continue
        ranks = progress.start_ranks((read(log, 4096, tail=False)[0] or "").split("\n", 1)[0])
        lines = text.splitlines()
        idx = [i for i, ln in enumerate(lines) if progress.is_progress(ln)]
        if not idx:
            continue
        rank = ranks[0] if ranks else int(rank_dir.name)
        line = lines[idx[-1]]
        is_last = not any(ln.strip() for ln in lines[idx[-1] + 1:])
        got = (rank, progress.parse(line).fields, line, is_last, mtime)
        if rank == 0:
            found = got
            break
        found = found or got
    return found, int(newest.name[8:])


def progress_age(logdir, line, is_last, mtime, now):
    """Seconds since the last progress line appeared: its file's mtime when it is the file's
    last line, else the time this sampler first saw it (remembered in the job's log folder)."""
    if line is None:
        return None
    if is_last and mtime:
        seen = mtime
    else:
        path = os.path.join(logdir, STATE_FILE)
        text, _ = read(path, 4096)
        try:
            old = json.loads(text or "{}")
        except ValueError:
            old = {}
        seen = old.get("seen") if old.get("line") == line else None
        if not isinstance(seen, (int, float)):
            seen = now
            try:
                write_atomic(logdir, STATE_FILE, json.dumps({"line": line, "seen": now}), 0o600)
            except OSError as e:  # the age then counts from this sample on: say why
                print("gpumon: cannot remember the progress line in %s: %s" % (logdir, e),
                      file=sys.stderr)
    return now - seen


def unit_state(unit):
    rc, out = run(["systemctl", "show", "-p", "ActiveState", "-p", "NRestarts", unit])
    props = dict(ln.split("=", 1) for ln in out.splitlines() if "=" in ln)
    restarts = props.get("NRestarts", "")
    return props.get("ActiveState") or None, int(restarts) if restarts.isdigit() else None


def append(path, text):
    """`text` appended to a regular file (made if missing), never through a link or into a
    FIFO: the job can put either where `invoke status`'s file goes."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def write_atomic(folder, name, text, mode=0o644):
    """`name` in `folder` replaced whole: a temporary file there (O_EXCL: never an existing
    one, never through a link), flushed, then renamed over it."""
    tmp = os.path.join(folder, ".%s.%d.%d.tmp" % (name, os.getpid(), time.monotonic_ns()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask would take the other users' read (node_exporter's)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, os.path.join(folder, name))
    except OSError:
        os.unlink(tmp)
        raise


def sample(a, now):
    """The samples of one round, and nvidia-smi's answer ("" when it failed)."""
    rc, csv = run(["nvidia-smi", "--query-gpu=" + ",".join(metrics.GPU_FIELDS),
                   "--format=csv,noheader,nounits"])
    csv = csv if rc == 0 else ""
    state, nrestarts = unit_state(a.unit)
    found, attempt = last_progress(a.logdir)
    rank, fields, line, is_last, mtime = found or (0, None, None, False, None)
    restarts = metrics.restarts(nrestarts, attempt)
    out = []
    if a.gpu and state in BUSY:  # an ended job holds no GPU: no GPU series under its name
        out += metrics.gpu_samples(csv, a.job, a.node)
    if a.health_record:  # root's file (healthwatch.py's): read, never written, here
        out += metrics.health_samples(a.job, a.node, read(a.health_record, tail=False)[0])
    out += metrics.job_samples(a.job, a.node, rank, fields,
                               progress_age(a.logdir, line, is_last, mtime, now),
                               restarts, state, now)
    return out, csv


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--unit", required=True, help="the job's systemd unit")
    p.add_argument("--logdir", required=True, help="the job's log folder (torchrun's --log-dir)")
    p.add_argument("--util-file", help="append '<time>,<util %%>...' here (invoke status)")
    p.add_argument("--mem-file", help="append '<time>,<used MiB>,<total MiB>...' here")
    p.add_argument("--textfile-dir", help="node_exporter's textfile folder (none: no .prom file)")
    p.add_argument("--health-record", help="the health watcher's verdict (torchrig_node_healthy)")
    p.add_argument("--no-gpu", dest="gpu", action="store_false",
                   help="no GPU series (dcgm-exporter exports them)")
    a = p.parse_args(argv)
    now = time.time()
    samples, csv = sample(a, now)
    rc = 0
    for path, line in ((a.util_file, metrics.util_line(csv, now)),
                       (a.mem_file, metrics.mem_line(csv, now))):
        if path and line:
            try:
                append(path, line + "\n")
            except OSError as e:
                print("gpumon: %s: not appended (%s)" % (path, e), file=sys.stderr)
    if a.textfile_dir:
        try:
            write_atomic(a.textfile_dir, metrics.prom_name(a.job), metrics.render(samples))
        except OSError as e:
            print("gpumon: %s: cannot write %s (%s)" % (a.textfile_dir, metrics.prom_name(a.job), e),
                  file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
