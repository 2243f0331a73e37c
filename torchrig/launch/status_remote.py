"""Runs ON THE NODE as root (python3 -I -, one round trip): a job's state for `invoke status`.
Sent after payload/progress.py (torchrig.progress.bundled), which parses the job's lines.
argv[1]: JSON {"unit": U, "logdir": D, "util_file": F, "window_s": S}

Everything under D was written by the job (the service user). It is read through descriptors,
one name at a time, never following a symlink (O_NOFOLLOW) and opening only regular files
(O_NONBLOCK, then fstat: a FIFO there would otherwise block this reader forever) with one
link (a hard link may be a file the job cannot read). Nothing
here writes anything."""
import json
import math
import os
import re
import stat
import subprocess
import sys
import time

import progress as protocol  # payload/progress.py, sent ahead of this script (torchrig.progress.bundled)

a = json.loads(sys.argv[1])
NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_dir(name, dir_fd=None):
    try:
        return os.open(name, NOFOLLOW | os.O_DIRECTORY, dir_fd=dir_fd)
    except OSError:
        return None


def read_file(name, dir_fd, tail=65536):
    """(first line, last `tail` bytes) of a regular file; None for anything else."""
    try:
        fd = os.open(name, NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return None  # a hard link may be another user's file (as in follow_remote)
        with os.fdopen(os.dup(fd), "rb") as fh:
            head = fh.readline(4096)
            fh.seek(max(0, st.st_size - tail))
            return head, fh.read(tail)
    finally:
        os.close(fd)


def entries(dir_fd, pattern):
    """Sub-folders of dir_fd whose name matches, as (mtime, name, fd); symlinks skipped."""
    out = []
    for name in os.listdir(dir_fd):
        if re.fullmatch(pattern, name):
            fd = open_dir(name, dir_fd)
            if fd is not None:
                out.append((os.fstat(fd).st_mtime, name, fd))
    return out


out = {}
r = subprocess.run(["systemctl", "show", a["unit"], "-p", "ActiveState", "-p", "SubState", "-p", "Result",
                    "-p", "NRestarts", "-p", "ActiveEnterTimestampMonotonic", "-p", "ExecMainStatus",
                    "-p", "LoadState"], capture_output=True, text=True, errors="replace")
props = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
out["unit"] = props
try:
    start = int(props.get("ActiveEnterTimestampMonotonic", "0")) / 1e6
    out["uptime_s"] = round(time.clock_gettime(time.CLOCK_MONOTONIC) - start, 1) if start else None
except ValueError:
    out["uptime_s"] = None

# <logdir>/<run>/attempt_<N>/<local rank>/stdout.log (torchrun's layout)
runs = []
top = open_dir(a["logdir"])
if top is not None:
    for _, run, run_fd in entries(top, r"[^.].*"):
        runs += [(mtime, run, name, fd) for mtime, name, fd in entries(run_fd, r"attempt_\d+")]
        os.close(run_fd)
runs.sort()
out["attempt"] = int(runs[-1][2].rsplit("_", 1)[1]) if runs else None
out["torchrun_starts"] = len({run for _, run, _, _ in runs})
progress = None
if runs:
    newest = runs[-1][3]
    for _, name, fd in sorted(entries(newest, r"\d+"), key=lambda e: e[1]):
        got = read_file("stdout.log", fd)
        os.close(fd)
        if got is None:
            continue
        ranks = protocol.start_ranks(got[0].decode(errors="replace"))
        tail = got[1].decode(errors="replace").splitlines()
        steps = [ln for ln in tail if protocol.is_progress(ln)]
        rank = ranks[0] if ranks else None
        if steps and (rank == 0 or progress is None):
            progress = steps[-1]
for _, _, _, fd in runs:
    os.close(fd)
out["progress"] = progress
try:
    r = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True, errors="replace",
                       timeout=30)
except (OSError, subprocess.TimeoutExpired):
    r = None
out["gpus"] = [dict(zip(("index", "util", "mem_used", "mem_total"), (x.strip() for x in ln.split(","))))
               for ln in r.stdout.splitlines() if ln.count(",") == 3] if r and r.returncode == 0 else []
samples = []
util_dir, util_name = os.path.split(a["util_file"])
dir_fd = open_dir(util_dir)
got = read_file(util_name, dir_fd, tail=1 << 20) if dir_fd is not None else None
if dir_fd is not None:
    os.close(dir_fd)
for ln in (got[1].decode(errors="replace").splitlines() if got else []):
    try:
        t, _, utils = ln.strip().partition(",")
        t, utils = float(t), [float(u) for u in utils.split(",") if u.strip()]
    except ValueError:
        continue
    if all(map(math.isfinite, [t, *utils])):  # the job can write this file: nan/1e400 too
        samples.append((t, utils))
now = time.time()
out["util_samples"] = [(round(now - t), u) for t, u in samples if now - t <= a["window_s"] * 2]
print(json.dumps(out))
