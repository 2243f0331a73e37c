"""launch overhead and log delivery on testbed nodes that provision already set up.

    sudo .venv/bin/python bench/launch_logs_bench.py INVENTORY HOST1,HOST2 [--runs 5]

launch overhead: wall time of `invoke launch` until every node's workers are spawned (the
rendezvous completed: launch returns only then), payload unchanged (nothing to push); the
payload's own start-up is not in it. Log delivery: 2 nodes x 4 ranks each write 20,000
time-stamped lines as fast as they can (payload/log_flood.py) while `logs -f` runs; lines
per second delivered, lines lost, and the latency from write to arrival (the testbed nodes
share this machine's clock). Writes bench/out/launch_logs.json."""

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
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out"


def invoke(*args):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True,
                       text=True, env=os.environ)
    if r.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("hosts")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lines", type=int, default=20000)
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    res = {}
    times = []
    for i in range(a.runs + 1):  # the first run pushes the payload: not counted
        job = f"bench-launch-{int(time.time())}-{i}"
        _, dt = invoke("launch", "-i", a.inventory, "-h", a.hosts, "--job", job, "--script",
                       "env_check.py", "--nproc-per-node", "2")
        if i:
            times.append(dt)
        invoke("stop", "-i", a.inventory, "-h", a.hosts, "--job", job)
    res["launch_overhead_s"] = {"median": round(statistics.median(times), 2),
                                "all": [round(t, 2) for t in times]}
    print(f"launch overhead (2 nodes, to workers spawned everywhere): median "
          f"{statistics.median(times):.2f}s of {[round(t, 2) for t in times]}")

    from torchrig import inventory
    from torchrig.launch.plan import unit_name
    from torchrig.logs.stream import Options, follow
    inv = inventory.load(a.inventory)
    hosts = inv.select(a.hosts)
    job = f"bench-logs-{int(time.time())}"
    invoke("launch", "-i", a.inventory, "-h", a.hosts, "--job", job, "--script", "log_flood.py",
           "--nproc-per-node", "4", "--args", f"--lines {a.lines} --delay 5")
    got, lat = {}, []

    class Sink:
        def line(self, item):
            m = re.match(r"flood rank=(\d+) seq=(\d+) t=([0-9.]+)", item.text)
            if m:
                now = time.time()
                got.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
                lat.append(now - float(m.group(3)))

        def notice(self, text):
            print(f"logs: {text}", file=sys.stderr)

    t0 = time.perf_counter()  # the ranks start writing ~5 s from now: we are attached by then
    out = follow(inv, hosts, Options(job, {h.name: f"/var/log/torchrig/{job}" for h in hosts},
                                     unit_name(job), follow=True), printer=Sink())
    dt = time.perf_counter() - t0 - 5
    total = sum(len(s) for s in got.values())
    lost = len(hosts) * 4 * a.lines - total
    lat.sort()
    res["logs"] = {"ranks": len(got), "lines": total, "lost": lost, "seconds": round(dt, 2),
                   "lines_per_s": round(total / dt), "latency_ms_p50": round(lat[len(lat) // 2] * 1000, 1),
                   "latency_ms_p99": round(lat[int(len(lat) * 0.99)] * 1000, 1),
                   "reconnects": out.reconnects}
    print(f"logs: {total} lines from {len(got)} ranks in {dt:.1f}s = {total / dt:.0f} lines/s, "
          f"lost {lost}, latency p50 {res['logs']['latency_ms_p50']} ms, p99 {res['logs']['latency_ms_p99']} ms")
    (OUT / "launch_logs.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
