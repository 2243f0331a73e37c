"""Every benchmark whose figures are in docs/benchmarks.md, on one bench testbed (`make bench`,
root).

1. provision: fresh provision of 8 hosts, no-change reruns on 1 and 8 hosts against pyinfra
   (median of 5); launch of 2 and 8 nodes against the plain-OpenSSH floor
2. launch overhead and log delivery on two of those hosts
3. the fleet session: launch (2 nodes) and status (8 hosts), wall time and SSH connections
4. status --watch on a job with a big journal and logs: round 1 against later rounds
Results: bench/out/*.json."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from provision_bench import ENV, INV  # noqa: E402


def run(*argv):
    print("+", " ".join(argv), flush=True)
    subprocess.run([sys.executable, *argv], cwd=REPO, check=True, env={**os.environ, **ENV})


try:
    run("bench/provision_bench.py", "--hosts", "8", "--runs", "5", "--keep", "--peer", "pyinfra")
    run("bench/launch_floor.py", str(INV), ",".join(f"gpu{i}" for i in range(1, 9)), "--runs", "5")
    run("bench/launch_logs_bench.py", str(INV), "gpu1,gpu2", "--runs", "5")
    run("bench/session_bench.py", str(INV), ",".join(f"gpu{i}" for i in range(1, 9)), "--runs", "5")
    run("bench/fetch_bench.py", str(INV), "gpu1", "--runs", "3")
    run("bench/watch_bench.py", str(INV), "gpu1", "--rounds", "20")
finally:
    subprocess.run([sys.executable, "-m", "invoke", "testbed.down"], cwd=REPO,
                   env={**os.environ, **ENV})
