"""`launch --workdir` of a user project with a dependency (tests/projects/ddp_six: six from
requirements.txt), on testbed hosts that provision already set up, whole CLI as a user runs it:

- cold: no job environment on the nodes (removed before the run): each node builds it
  (venv, pip's dry run, pip install) before anything starts;
- warm: the same launch again: the environment is found (cached) and checked;
- floor: in the same round, a launch of torchrig's own payload script (`--script
  env_check.py`, no project, no environment) on the same nodes: what every launch costs.

Every launch has --early-fail-window 0, so each returns when every worker spawned (a job
still running is otherwise watched for that window: 10 s by default, the same for all).

    sudo .venv/bin/python bench/project_bench.py INVENTORY HOSTS [--nodes 2,8] [--runs 3]

Medians of --runs per node count; each job is stopped after its launch returned (not timed).
Writes bench/out/project.json."""

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
PROJECT = REPO / "tests" / "projects" / "ddp_six"


def invoke(*args, check=True):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    dt = time.perf_counter() - t0
    if check and r.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r, dt


def launch(inv, hosts, job, *extra):
    # --early-fail-window 0: launch returns once every worker spawned (what each figure
    # measures), not WINDOW seconds later for a job still running, while a job that ends
    # sooner (env_check.py) would skip that wait
    r, dt = invoke("launch", "-i", inv, "-H", hosts, "--job", job, "--nproc-per-node", "2",
                   "--early-fail-window", "0", *extra)
    invoke("stop", "-i", inv, "-H", hosts, "--job", job)
    return r, dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("hosts", help="comma-separated; --nodes N takes the first N")
    ap.add_argument("--nodes", default="2,8")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    hosts = a.hosts.split(",")
    results = {}
    for n in map(int, a.nodes.split(",")):
        sel = ",".join(hosts[:n])
        rows = {"cold": [], "warm": [], "floor": [], "build_s": []}
        launch(a.inventory, sel, f"bench-prime-{n}", "--workdir", str(PROJECT))  # release pushed
        for i in range(a.runs):
            tag = f"{int(time.time())}-{i}"
            invoke("exec", "-i", a.inventory, "-H", sel, "--sudo", "rm -rf /opt/torchrig/envs")
            r, dt = launch(a.inventory, sel, f"bench-cold-{n}-{tag}", "--workdir", str(PROJECT))
            rows["cold"].append(dt)
            rows["build_s"] += [float(s) for s in re.findall(r"job environment built in ([0-9.]+)s", r.stdout + r.stderr)]
            r, dt = launch(a.inventory, sel, f"bench-warm-{n}-{tag}", "--workdir", str(PROJECT))
            assert "built" not in r.stdout + r.stderr, r.stderr
            rows["warm"].append(dt)
            _, dt = launch(a.inventory, sel, f"bench-floor-{n}-{tag}", "--script", "env_check.py")
            rows["floor"].append(dt)
        med = {k: round(statistics.median(v), 2) for k, v in rows.items() if v}
        results[f"{n}_nodes"] = {**{f"{k}_median_s": v for k, v in med.items()},
                                 "all_s": {k: [round(x, 2) for x in v] for k, v in rows.items()},
                                 "warm_over_floor": round(med["warm"] / med["floor"], 2),
                                 "cold_over_floor": round(med["cold"] / med["floor"], 2)}
        print(n, "nodes:", json.dumps(results[f"{n}_nodes"]), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "project.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
