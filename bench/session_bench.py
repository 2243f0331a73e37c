"""The fleet session's figures: `invoke launch` overhead (2 nodes) and `invoke status` of 8
hosts, on testbed hosts that provision already set up (whole CLI, as a user runs it), with
the SSH connections each command opened (counted in the hosts' sshd journals).

    sudo .venv/bin/python bench/session_bench.py INVENTORY HOSTS [--runs 5] [--compare DIR]

launch: `invoke launch --script env_check.py --nproc-per-node 2` on the first two HOSTS
(payload already pushed: a first run is not counted). status: a job of env_check.py on every
one of HOSTS, then `invoke status --job` of all of them. Medians of --runs.
--compare DIR: a checkout of other code (e.g. `git archive` of the commit before a change),
run in turn with this one, round by round, so both see the same machine load (the machine
is shared: a figure from another hour is not comparable). Writes bench/out/session.json.
Uses the testbed of TORCHRIG_TESTBED_* to read the hosts' journals."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
sys.path.insert(0, str(REPO))


def invoke(repo: Path, *args):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=repo, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{repo}: invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r, dt


def ssh_logins(hosts) -> int:
    """sshd's 'Accepted' lines so far, over the hosts' journals."""
    from torchrig.testbed.machines import root_of
    n = 0
    for h in hosts:
        out = subprocess.run(["journalctl", "-D", f"{root_of(h)}/var/log/journal", "-t", "sshd",
                              "-o", "cat", "--no-pager"], capture_output=True, text=True).stdout
        n += out.count("Accepted ")
    return n


def timed(repo, hosts, *args):
    before = ssh_logins(hosts)
    r, dt = invoke(repo, *args)
    return r, dt, ssh_logins(hosts) - before


def summary(rows):
    times = [t for t, _ in rows]
    return {"median_s": round(statistics.median(times), 2), "all_s": [round(t, 2) for t in times],
            "ssh_connections": sorted({n for _, n in rows})}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("hosts", help="comma-separated; the first two run the launch figure")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--compare", type=Path, help="another checkout, measured in turn with this one")
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    inv = str(Path(a.inventory).resolve())
    hosts = a.hosts.split(",")
    two = hosts[:2]
    repos = {"this": REPO, **({"compare": a.compare.resolve()} if a.compare else {})}
    launch = {k: [] for k in repos}
    status = {k: [] for k in repos}
    for i in range(a.runs + 1):  # the first round may push the payload: not counted
        for label, repo in repos.items():
            job = f"bench-launch-{int(time.time())}-{i}-{label}"
            _, dt, n = timed(repo, two, "launch", "-i", inv, "-H", ",".join(two), "--job", job,
                             "--script", "env_check.py", "--nproc-per-node", "2")
            if i:
                launch[label].append((dt, n))
            invoke(repo, "stop", "-i", inv, "-H", ",".join(two), "--job", job)
    job = f"bench-status-{int(time.time())}"
    invoke(REPO, "launch", "-i", inv, "-H", a.hosts, "--job", job, "--script", "env_check.py",
           "--nproc-per-node", "1")
    for _ in range(a.runs):
        for label, repo in repos.items():
            r, dt, n = timed(repo, hosts, "status", "-i", inv, "-H", a.hosts, "--job", job, "--json")
            assert len(json.loads(r.stdout)["nodes"]) == len(hosts), r.stdout
            status[label].append((dt, n))
    invoke(REPO, "stop", "-i", inv, "-H", a.hosts, "--job", job)
    res = {"hosts": len(hosts), "runs": a.runs, "load_avg_end": os.getloadavg()[0],
           **{label: {"launch_2_nodes": summary(launch[label]),
                      f"status_{len(hosts)}_hosts": summary(status[label])} for label in repos}}
    print(json.dumps(res, indent=2))
    (OUT / "session.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
