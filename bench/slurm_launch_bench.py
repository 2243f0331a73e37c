"""Time from `invoke launch` to every rank's first line, systemd backend next to Slurm's, on
testbed nodes provisioned with a Slurm cluster (inventory `slurm:`).

    sudo .venv/bin/python bench/slurm_launch_bench.py INVENTORY HOST1,HOST2 [--runs 5]

Each run: a fresh job name, `invoke launch --backend B --nodes 2 --nproc-per-node 2 --script
env_check.py` (it prints its `start rank=...` line and exits) timed from the command's start
until `logs` (torchrig.logs.stream.follow, attached as soon as launch returns) has delivered a
line from each of the 4 ranks. The first run of each backend pushes the payload and is not
counted. Writes bench/out/slurm_launch.json."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out"


def invoke(*args):
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True,
                       text=True, env=os.environ)
    if r.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


def first_lines(inv, hosts, job, backend, t0) -> float:
    """Seconds from t0 until a line of every rank arrived (logs as `invoke logs` runs it)."""
    from torchrig.launch import slurm
    from torchrig.launch.plan import unit_name
    from torchrig.logs.stream import Options, follow
    from torchrig.session import Fleet
    seen, at = set(), [None]

    class Sink:
        def line(self, item):
            seen.add(item.global_rank)
            if len(seen) == 4 and at[0] is None:
                at[0] = time.perf_counter() - t0

        def notice(self, text):
            pass

    with Fleet(inv, hosts) as fleet:
        sj = slurm.find(fleet, job) if backend == "slurm" else None
        nodes = slurm.hosts_of(fleet, sj) if sj else hosts
        o = Options(job, {h.name: h.settings.job_log_dir(job) for h in nodes}, unit_name(job),
                    follow=True, slurm_job=sj.job_id if sj else None)
        follow(fleet, nodes, o, printer=Sink())
    if at[0] is None:
        sys.exit(f"job {job}: lines from ranks {sorted(seen)} only")
    return at[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("hosts")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    from torchrig import inventory
    inv = inventory.load(a.inventory)
    hosts = inv.select(a.hosts)
    OUT.mkdir(exist_ok=True)
    res = {}
    for backend in ("systemd", "slurm"):
        times = []
        for i in range(a.runs + 1):
            job = f"bench-{backend}-{int(time.time())}-{i}"
            t0 = time.perf_counter()
            invoke("launch", "-i", a.inventory, "-H", a.hosts, "--job", job, "--backend", backend,
                   "--nodes", "2", "--nproc-per-node", "2", "--script", "env_check.py")
            dt = first_lines(inv, hosts, job, backend, t0)
            if i:
                times.append(dt)
            if backend == "systemd":
                invoke("stop", "-i", a.inventory, "-H", a.hosts, "--job", job)
        res[backend] = {"median_s": round(statistics.median(times), 2),
                        "all": [round(t, 2) for t in times]}
        print(f"{backend}: launch to every rank's first line (2 nodes x 2): median "
              f"{statistics.median(times):.2f}s of {res[backend]['all']}")
    res["command"] = " ".join(["bench/slurm_launch_bench.py", a.inventory, a.hosts, "--runs", str(a.runs)])
    (OUT / "slurm_launch.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
