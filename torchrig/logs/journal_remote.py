"""Runs ON THE NODE as root (python3 -I -): the job unit's journal since its last start, for
torchrig.logs.agent. argv[1]: JSON {"unit": U, "keep": N, "lines": L, "ident": I or absent}

The journal also holds every rank's output (torchrun --tee), which can be millions of lines:
kept are the agent's and systemd's lines (the newest 5000) and the last N lines of each local
rank, in their original order. Kernel OOM lines since the unit started come separately.
Prints JSON {"year", "utc_offset", "journal", "kernel"}. Writes nothing."""
import collections
import json
import re
import subprocess
import sys
import time

a = json.loads(sys.argv[1])
TEE = re.compile(r"^\[default(\d+)\]:")
# a Slurm job's agent lines carry the unit's SyslogIdentifier but belong to no unit of theirs
match = ["-t", a["ident"]] if a.get("ident") else ["-u", a["unit"]]
p = subprocess.Popen(["journalctl", *match, "-o", "cat", "--no-pager", "-n", str(a["lines"])],
                     stdout=subprocess.PIPE, text=True, errors="replace")
other = collections.deque(maxlen=5000)
ranks = {}
for i, line in enumerate(p.stdout):
    line = line.rstrip("\n")
    if line.startswith("Started torchrig-"):
        other.clear()
        ranks.clear()
    m = TEE.match(line)
    if m:
        ranks.setdefault(m.group(1), collections.deque(maxlen=a["keep"])).append((i, line))
    else:
        other.append((i, line))
p.wait()
kept = sorted(list(other) + [x for d in ranks.values() for x in d])
start = subprocess.run(["systemctl", "show", "-p", "ExecMainStartTimestamp", "--value", a["unit"]],
                       capture_output=True, text=True).stdout.strip()
kernel = subprocess.run(["journalctl", "-k", "-o", "cat", "--no-pager"] + (["--since", start] if start else []),
                        capture_output=True, text=True, errors="replace").stdout
kernel = [ln for ln in kernel.splitlines() if re.search(r"oom|Killed process", ln, re.I)][-200:]
off = time.strftime("%z")
print(json.dumps({"year": int(time.strftime("%Y")), "utc_offset": off,
                  "journal": "\n".join(ln for _, ln in kept), "kernel": "\n".join(kernel)}))
