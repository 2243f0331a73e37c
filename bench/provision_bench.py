"""Provision wall time on a testbed of its own: a fresh provision of N hosts in parallel, then
no-change reruns on 1 host and on all N (median of 5 each, whole CLI as a user runs it).

    sudo .venv/bin/python bench/provision_bench.py [--hosts 8] [--runs 5]

Writes bench/out/provision.json. Needs root (the testbed)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {"TORCHRIG_TESTBED_STATE": "/var/lib/torchrig-testbed-bench",
       "TORCHRIG_TESTBED_BRIDGE": "trbb0", "TORCHRIG_TESTBED_SUBNET": "10.213.9"}
OUT = REPO / "bench" / "out"
INV = OUT / "bench-testbed.yml"


def invoke(*args, check=True):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, **ENV})
    dt = time.perf_counter() - t0
    if check and r.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r, dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave the bench testbed up (run_all.py)")
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    invoke("testbed.down", check=False)
    invoke("testbed.up", "--hosts", str(a.hosts), "--inventory", str(INV))
    result = {"hosts": a.hosts, "runs": a.runs, "machine": f"{os.cpu_count()} cores"}
    try:
        r, dt = invoke("provision", "-i", str(INV), "--yes", "--reboot", "--json")
        result["fresh_parallel_s"] = round(dt, 1)
        print(f"fresh provision of {a.hosts} hosts in parallel (with the driver reboot): {dt:.1f}s")
        for label, sel in (("1 host", "gpu1"), (f"{a.hosts} hosts", "all")):
            times = []
            for _ in range(a.runs):
                r, dt = invoke("provision", "-i", str(INV), "-h", sel, "--yes", "--json")
                changed = sum(h["changed"] for h in json.loads(r.stdout))
                assert changed == 0, f"a rerun changed {changed} step(s)"
                times.append(dt)
            result[f"no_change_{sel}_s"] = {"median": round(statistics.median(times), 2),
                                            "all": [round(t, 2) for t in times]}
            print(f"no-change rerun, {label}: median {statistics.median(times):.2f}s of {times}")
    finally:
        if not a.keep:
            invoke("testbed.down", check=False)
    (OUT / "provision.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
