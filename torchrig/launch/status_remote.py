"""Runs ON THE NODE as root (python3 -, one round trip): a job's state for `invoke status`.
argv[1]: JSON {"unit": U, "logdir": D, "util_file": F, "window_s": S}"""
import glob
import json
import os
import re
import subprocess
import sys
import time

a = json.loads(sys.argv[1])
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

runs = sorted(glob.glob(os.path.join(a["logdir"], "*", "attempt_*")), key=os.path.getmtime)
out["attempt"] = int(runs[-1].rsplit("_", 1)[1]) if runs else None
out["torchrun_starts"] = len({os.path.dirname(p) for p in runs})
progress, ranks = None, {}
if runs:
    for f in sorted(glob.glob(os.path.join(runs[-1], "*", "stdout.log"))):
        with open(f, "rb") as fh:
            head = fh.readline().decode(errors="replace")
            m = re.match(r"start rank=(\d+)", head)
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - 65536))
            tail = fh.read().decode(errors="replace").splitlines()
        steps = [ln for ln in tail if ln.startswith(("step=", "done step="))]
        rank = int(m.group(1)) if m else None
        ranks[f] = rank
        if steps and (rank == 0 or progress is None):
            progress = steps[-1]
out["progress"] = progress
r = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total",
                    "--format=csv,noheader,nounits"], capture_output=True, text=True, errors="replace")
out["gpus"] = [dict(zip(("index", "util", "mem_used", "mem_total"), (x.strip() for x in ln.split(","))))
               for ln in r.stdout.splitlines() if ln.count(",") == 3] if r.returncode == 0 else []
samples = []
try:
    with open(a["util_file"]) as f:
        for ln in f:
            t, _, utils = ln.strip().partition(",")
            samples.append((float(t), [float(u) for u in utils.split(",") if u.strip()]))
except (OSError, ValueError):
    pass
now = time.time()
out["util_samples"] = [(round(now - t), u) for t, u in samples if now - t <= a["window_s"] * 2]
print(json.dumps(out))
