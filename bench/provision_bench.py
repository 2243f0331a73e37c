"""Provision wall time on a testbed of its own: a fresh provision of N hosts in parallel, then
no-change reruns on 1 host and on all N (median of 5 each, whole CLI as a user runs it).

    sudo .venv/bin/python bench/provision_bench.py [--hosts 8] [--runs 5]
    sudo .venv/bin/python bench/provision_bench.py --inventory INV --hosts 8 --compare DIR

--inventory: hosts provision already set up (no testbed of its own, no fresh run): the
no-change reruns only. --compare DIR: another checkout (e.g. `git archive` of the commit
before a change) whose reruns alternate with this one's, round by round, so both see the
same load. Writes bench/out/provision.json. Needs root (the testbed)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the bench testbed's own, unless the environment names another one
ENV = {k: os.environ.get(k, v) for k, v in {
    "TORCHRIG_TESTBED_STATE": "/var/lib/torchrig-testbed-bench",
    "TORCHRIG_TESTBED_BRIDGE": "trbb0", "TORCHRIG_TESTBED_SUBNET": "10.213.9"}.items()}
OUT = REPO / "bench" / "out"
INV = OUT / "bench-testbed.yml"


def invoke(*args, check=True, repo=REPO):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=repo, capture_output=True,
                       text=True, env={**os.environ, **ENV, "PYTHONPATH": str(repo)})
    dt = time.perf_counter() - t0
    if check and r.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r, dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave the bench testbed up (run_all.py)")
    ap.add_argument("--inventory", type=Path, help="provisioned hosts: the no-change reruns only")
    ap.add_argument("--compare", type=Path, help="another checkout, measured in turn with this one")
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    inv = str((a.inventory or INV).resolve())
    repos = {"this": REPO, **({"compare": a.compare.resolve()} if a.compare else {})}
    if not a.inventory:
        invoke("testbed.down", check=False)
        invoke("testbed.up", "--hosts", str(a.hosts), "--inventory", inv)
    result = {"hosts": a.hosts, "runs": a.runs, "machine": f"{os.cpu_count()} cores"}
    try:
        if not a.inventory:
            r, dt = invoke("provision", "-i", inv, "--yes", "--reboot", "--json")
            result["fresh_parallel_s"] = round(dt, 1)
            print(f"fresh provision of {a.hosts} hosts in parallel (with the driver reboot): {dt:.1f}s")
        for label, sel in (("1 host", "gpu1"), (f"{a.hosts} hosts", "all")):
            times = {k: [] for k in repos}
            for _ in range(a.runs):
                for name, repo in repos.items():
                    r, dt = invoke("provision", "-i", inv, "-H", sel, "--yes", "--json", repo=repo)
                    changed = sum(h["changed"] for h in json.loads(r.stdout))
                    assert changed == 0, f"a rerun changed {changed} step(s)"
                    times[name].append(dt)
            for name, ts in times.items():
                key = f"no_change_{sel}_s" + ("" if name == "this" else "_compare")
                result[key] = {"median": round(statistics.median(ts), 2),
                               "all": [round(t, 2) for t in ts]}
                print(f"{name}: no-change rerun, {label}: median {statistics.median(ts):.2f}s of "
                      f"{[round(t, 2) for t in ts]}")
    finally:
        if not a.keep and not a.inventory:
            invoke("testbed.down", check=False)
    (OUT / "provision.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
