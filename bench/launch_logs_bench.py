"""launch overhead and log delivery on testbed nodes that provision already set up.

    sudo .venv/bin/python bench/launch_logs_bench.py INVENTORY HOST1,HOST2 [--runs 5] [--compare DIR]

launch overhead: wall time of `invoke launch` until every node's workers are spawned (the
rendezvous completed: launch returns only then), payload unchanged (nothing to push); the
payload's own start-up is not in it. Log delivery: 2 nodes x 4 ranks each write 20,000
time-stamped lines as fast as they can (payload/log_flood.py) while `logs -f` runs; lines
per second delivered, lines lost, and the latency from write to arrival (the testbed nodes
share this machine's clock); `invoke logs -f` runs as a user runs it, its stdout read as lines
arrive. --compare DIR: another checkout measured in turn with this one. Writes
bench/out/launch_logs.json."""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"


def invoke(*args, repo=REPO):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=repo, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    if r.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r, time.perf_counter() - t0


FLOOD = re.compile(r"flood rank=(\d+) seq=(\d+) t=([0-9.]+)")


def flood(repo: Path, inv: str, hosts: str, lines: int) -> dict:
    """A flood job followed with `invoke logs -f` of `repo` as a user runs it: lines delivered
    per second, lost, latency from write to arrival (read as they reach the pipe)."""
    job = f"bench-logs-{int(time.time())}"
    invoke("launch", "-i", inv, "-H", hosts, "--job", job, "--script", "log_flood.py",
           "--nproc-per-node", "4", "--args", f"--lines {lines} --delay 5", repo=repo)
    got, lat = {}, []
    t0 = time.perf_counter()  # the ranks start writing ~5 s from now: we are attached by then
    p = subprocess.Popen([sys.executable, "-m", "invoke", "logs", "-i", inv, "-H", hosts, "--job",
                          job, "-f"], cwd=repo, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"})
    for line in p.stdout:
        m = FLOOD.search(line)
        if m:
            got.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
            lat.append(time.time() - float(m.group(3)))
    p.wait()
    dt = time.perf_counter() - t0 - 5
    total = sum(len(x) for x in got.values())
    n = len(hosts.split(","))
    lat.sort()
    return {"ranks": len(got), "lines": total, "lost": n * 4 * lines - total, "seconds": round(dt, 2),
            "lines_per_s": round(total / dt),
            "latency_ms_p50": round(lat[len(lat) // 2] * 1000, 1) if lat else None,
            "latency_ms_p99": round(lat[int(len(lat) * 0.99)] * 1000, 1) if lat else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("hosts")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lines", type=int, default=20000)
    ap.add_argument("--floods", type=int, default=1, help="log floods per checkout (median)")
    ap.add_argument("--compare", type=Path, help="another checkout, measured in turn with this one")
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    inv = str(Path(a.inventory).resolve())
    repos = {"this": REPO, **({"compare": a.compare.resolve()} if a.compare else {})}
    times = {k: [] for k in repos}
    for i in range(a.runs + 1):  # the first run pushes the payload: not counted
        for name, repo in repos.items():
            job = f"bench-launch-{int(time.time())}-{i}-{name}"
            _, dt = invoke("launch", "-i", inv, "-H", a.hosts, "--job", job, "--script",
                           "env_check.py", "--nproc-per-node", "2", repo=repo)
            if i:
                times[name].append(dt)
            invoke("stop", "-i", inv, "-H", a.hosts, "--job", job, repo=repo)
    res = {}
    for name, ts in times.items():
        res[name] = {"launch_overhead_s": {"median": round(statistics.median(ts), 2),
                                           "all": [round(t, 2) for t in ts]}}
        print(f"{name}: launch overhead (2 nodes, to workers spawned everywhere): median "
              f"{statistics.median(ts):.2f}s of {[round(t, 2) for t in ts]}")
    floods = {k: [] for k in repos}
    for _ in range(a.floods):
        for name, repo in repos.items():
            floods[name].append(flood(repo, inv, a.hosts, a.lines))
            print(f"{name}: logs {floods[name][-1]}")
    for name, fs in floods.items():
        best = sorted(fs, key=lambda f: f["lines_per_s"])[len(fs) // 2]  # the median run
        res[name]["logs"] = {**best, "lines_per_s_all": [f["lines_per_s"] for f in fs]}
    (OUT / "launch_logs.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
