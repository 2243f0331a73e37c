"""Provision wall time on a testbed of its own: a fresh provision of N hosts in parallel, then
no-change reruns on 1 host and on all N (median of 5 each, whole CLI as a user runs it).

    sudo .venv/bin/python bench/provision_bench.py [--hosts 8] [--runs 5]
    sudo .venv/bin/python bench/provision_bench.py --inventory INV --hosts 8 --compare DIR
    sudo .venv/bin/python bench/provision_bench.py --hosts 8 --peer pyinfra

--peer pyinfra: pyinfra (its own venv, bench/out/peers-venv) checking the same state on the
same hosts (bench/peers/), in turn with this code, round by round: the ratio in one run.
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

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

REPO = Path(__file__).resolve().parents[1]
# the bench testbed's own, unless the environment names another one
ENV = {k: os.environ.get(k, v) for k, v in {
    "TORCHRIG_TESTBED_STATE": "/var/lib/torchrig-testbed-bench",
    "TORCHRIG_TESTBED_BRIDGE": "trbb0", "TORCHRIG_TESTBED_SUBNET": "10.213.9"}.items()}
OUT = REPO / "bench" / "out"
# as an install runs it: with its bytecode (a shell that sets PYTHONDONTWRITEBYTECODE would
# recompile every module on every run, ~60 ms here)
USER_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
INV = OUT / "bench-testbed.yml"


def invoke(*args, check=True, repo=REPO):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=repo, capture_output=True,
                       text=True, env={**USER_ENV, **ENV, "PYTHONPATH": str(repo)})
    dt = time.perf_counter() - t0
    if check and r.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r, dt


def pyinfra_run(exe, inv_py, limit) -> float:
    """One no-change pyinfra run; its wall time. Fails unless every operation was a no-op."""
    import pyinfra_peer
    t0 = time.perf_counter()
    r = subprocess.run(pyinfra_peer.argv(exe, inv_py, limit), capture_output=True, text=True)
    dt = time.perf_counter() - t0
    total = [ln.split() for ln in r.stderr.splitlines() if ln.strip().startswith("Grand total")]
    # "Grand total  OPS  SUCCESS  ERROR  NO-CHANGE": a no-change run is "- -" in the middle
    if r.returncode != 0 or not total or total[0][3:5] != ["-", "-"]:
        sys.exit(f"pyinfra did not report a no-change run:\n{r.stdout[-3000:]}\n{r.stderr[-1500:]}")
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave the bench testbed up (run_all.py)")
    ap.add_argument("--inventory", type=Path, help="provisioned hosts: the no-change reruns only")
    ap.add_argument("--compare", type=Path, help="another checkout, measured in turn with this one")
    ap.add_argument("--peer", choices=["pyinfra"], help="a peer tool, measured in turn with this")
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
        peer = None
        if a.peer:
            import pyinfra_peer
            peer = (pyinfra_peer.venv(OUT / "peers-venv"),
                    pyinfra_peer.prepare(inv, OUT / "pyinfra"))
        for label, sel in (("1 host", "gpu1"), (f"{a.hosts} hosts", "all")):
            names = [*repos, *([a.peer] if peer else [])]
            times = {k: [] for k in names}
            for _ in range(a.runs):
                for name in names:
                    if name == a.peer:
                        dt = pyinfra_run(*peer, None if sel == "all" else sel)
                    else:
                        r, dt = invoke("provision", "-i", inv, "-H", sel, "--yes", "--json",
                                       repo=repos[name])
                        changed = sum(h["changed"] for h in json.loads(r.stdout))
                        assert changed == 0, f"a rerun changed {changed} step(s)"
                    times[name].append(dt)
            for name, ts in times.items():
                key = f"no_change_{sel}_s" + ("" if name == "this" else f"_{name}")
                result[key] = {"median": round(statistics.median(ts), 2),
                               "all": [round(t, 2) for t in ts]}
                print(f"{name}: no-change rerun, {label}: median {statistics.median(ts):.2f}s of "
                      f"{[round(t, 2) for t in ts]}")
            if peer:
                ratio = statistics.median(times["this"]) / statistics.median(times[a.peer])
                result[f"no_change_{sel}_ratio_{a.peer}"] = round(ratio, 3)
                print(f"this / {a.peer}, {label}: {ratio:.2f}x")
    finally:
        if not a.keep and not a.inventory:
            invoke("testbed.down", check=False)
    (OUT / "provision.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
