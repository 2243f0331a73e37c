"""The fleet session's figures: `invoke launch` overhead (2 nodes) and `invoke status` of 8
hosts, on testbed hosts that provision already set up (whole CLI, as a user runs it).

    sudo .venv/bin/python bench/session_bench.py INVENTORY HOSTS [--runs 5]

launch: wall time of `invoke launch --script env_check.py --nproc-per-node 2` on the first two
HOSTS (payload already pushed: the first run is not counted). status: a job of env_check.py on
every one of HOSTS, then `invoke status --job` of all of them. Medians of --runs. Writes
bench/out/session.json."""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"


def invoke(*args, check=True):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True,
                       text=True)
    dt = time.perf_counter() - t0
    if check and r.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r, dt


def median(times):
    return {"median": round(statistics.median(times), 2), "all": [round(t, 2) for t in times]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("hosts", help="comma-separated; the first two run the launch figure")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    hosts = a.hosts.split(",")
    two = ",".join(hosts[:2])
    res = {"hosts": len(hosts), "runs": a.runs}
    times = []
    for i in range(a.runs + 1):  # the first run may push the payload: not counted
        job = f"bench-launch-{int(time.time())}-{i}"
        _, dt = invoke("launch", "-i", a.inventory, "-h", two, "--job", job, "--script",
                       "env_check.py", "--nproc-per-node", "2")
        if i:
            times.append(dt)
        invoke("stop", "-i", a.inventory, "-h", two, "--job", job)
    res["launch_2_nodes_s"] = median(times)
    print(f"launch overhead (2 nodes): {res['launch_2_nodes_s']}")
    job = f"bench-status-{int(time.time())}"
    invoke("launch", "-i", a.inventory, "-h", a.hosts, "--job", job, "--script", "env_check.py",
           "--nproc-per-node", "1")
    times = []
    for _ in range(a.runs):
        r, dt = invoke("status", "-i", a.inventory, "-h", a.hosts, "--job", job, "--json")
        assert len(json.loads(r.stdout)["nodes"]) == len(hosts), r.stdout
        times.append(dt)
    invoke("stop", "-i", a.inventory, "-h", a.hosts, "--job", job)
    res[f"status_{len(hosts)}_hosts_s"] = median(times)
    print(f"status of {len(hosts)} hosts: {res[f'status_{len(hosts)}_hosts_s']}")
    (OUT / "session.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
