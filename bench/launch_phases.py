"""Where a launch's time goes, on the nodes' own clocks, against the plain-OpenSSH floor in the
same rounds (bench/launch_floor.py's floor): for each, the time from the operator's start to
the node's unit starting torchrun ("before"), from there to its last worker's rank folder
("spawn"), and from the last spawn to the command's return ("after"); for launch also when its
GPU-sample and health-check units ran (start after the job's unit, and how long).

    sudo .venv/bin/python bench/launch_phases.py INVENTORY HOSTS [--runs 5]

The testbed's hosts share this machine's kernel, so their clocks and this process's are one
clock. Medians over --runs (each round: a launch, its stop, the floor), one line per node
count. Writes bench/out/launch_phases.json."""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from launch_floor import NPROC, OUT, floor, floor_log_dir, invoke, log_dir, ssh, unit_of  # noqa: E402
from torchrig import inventory  # noqa: E402
from torchrig.job import unit_name  # noqa: E402

SIDE_UNITS = ("gpumon", "health")


def when(stamp: str) -> float | None:
    """systemd's `--timestamp=us+utc` form ('Mon 2026-12-07 16:40:01.123456 UTC'), as epoch."""
    stamp = stamp.strip()
    if not stamp or stamp == "n/a":
        return None
    return datetime.strptime(stamp.replace(" UTC", "+0000"), "%a %Y-%m-%d %H:%M:%S.%f%z").timestamp()


def node_times(inv, h, unit: str, logdir: str, job: str | None) -> dict:
    """The unit's start, its rank folders' times, and (for a launch) its side units' runs."""
    props = "-p ExecMainStartTimestamp -p ExecMainExitTimestamp --timestamp=us+utc"
    side = [f"torchrig-{s}@{job}.service" for s in SIDE_UNITS] if job else []
    script = (f"systemctl show {props} {unit}; echo ranks; "
              f"find {logdir} -mindepth 3 -maxdepth 3 -type d -printf '%C@\\n'; "
              + "".join(f"echo {s}; systemctl show {props} {s}; " for s in side))
    cmd = "sudo sh -c " + shlex.quote(script)
    out = subprocess.run(ssh(inv, h) + [cmd], capture_output=True, text=True, check=True).stdout
    res, part = {"ranks": []}, "unit"
    for line in out.splitlines():
        key, eq, val = line.partition("=")
        if line == "ranks" or line in side:
            part = "ranks" if line == "ranks" else line.split("@")[0].removeprefix("torchrig-")
        elif part == "ranks":
            res["ranks"].append(float(line))
        elif part == "unit" and key == "ExecMainStartTimestamp":
            res["start"] = when(val)
        elif part in SIDE_UNITS and eq:
            res.setdefault(part, {})[key] = when(val)
    return res


def phases(t0: float, t1: float, nodes: list[dict]) -> dict:
    last = max(max(n["ranks"]) for n in nodes)
    res = {"before": max(n["start"] for n in nodes) - t0,
           "spawn": max(max(n["ranks"]) - n["start"] for n in nodes),
           "after": t1 - last}
    for s in SIDE_UNITS:  # each run against its own node's start
        ran = [(n[s], n["start"]) for n in nodes if n.get(s, {}).get("ExecMainStartTimestamp")]
        if ran:
            res[f"{s}_at"] = min(r["ExecMainStartTimestamp"] - start for r, start in ran)
            res[f"{s}_took"] = max((r["ExecMainExitTimestamp"] or t1) - r["ExecMainStartTimestamp"]
                                   for r, _ in ran)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("hosts", help="comma-separated")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    inv_path = str(Path(a.inventory).resolve())
    inv = inventory.load(inv_path)
    hosts = [{h.name: h for h in inv.hosts}[x] for x in a.hosts.split(",")]
    sel = ",".join(h.name for h in hosts)
    rows = {"launch": [], "floor": []}
    for i in range(a.runs + 1):  # round 0 pushes the payload: not counted
        job = f"bench-phases-{int(time.time())}-{i}"
        t0 = time.time()
        invoke("launch", "-i", inv_path, "-H", sel, "--job", job, "--script", "env_check.py",
               "--nproc-per-node", str(NPROC), "--early-fail-window", "0")
        t1 = time.time()
        units = {h.name: unit_of(inv, h, job) for h in hosts}
        got = [node_times(inv, h, unit_name(job), log_dir(units[h.name]), job) for h in hosts]
        invoke("stop", "-i", inv_path, "-H", sel, "--job", job)
        tag = f"{job}-openssh"
        f0 = time.time()
        fdt, fgot = floor(inv, hosts, units, tag, read=lambda h: node_times(
            inv, h, tag + ".service", floor_log_dir(tag), None))
        lp, fp = phases(t0, t1, got), phases(f0, f0 + fdt, fgot)
        print(f"round {i}: launch " + " ".join(f"{k} {v:.2f}" for k, v in lp.items())
              + " | floor " + " ".join(f"{k} {v:.2f}" for k, v in fp.items()), flush=True)
        if i:
            rows["launch"].append(lp)
            rows["floor"].append(fp)
    med = {w: {k: round(statistics.median(r[k] for r in rs if k in r), 3)
               for k in rs[0]} for w, rs in rows.items()}
    print(f"{len(hosts)} nodes, medians of {a.runs}: {json.dumps(med)}")
    (OUT / "launch_phases.json").write_text(json.dumps({"medians": med, **rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
