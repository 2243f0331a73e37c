"""A fresh fleet's wheels and .debs: the bytes each host pulls from the pip index and from the
apt repositories, and the wall time of a fresh provision of N hosts in parallel, this checkout
(each wheel and .deb fetched once, then node to node: provision/wheelshare.py, aptshare.py)
against another one (e.g. the commit before it), in turn, round by round, on the same testbed
of its own. Between runs every host is made fresh again (lab.reset_host). The bytes come from
the testbed server's request log (http.log): each wheel and .deb served, by client, at its size.

    git archive BEFORE --prefix=before/ | tar -x -C DIR
    sudo .venv/bin/python bench/wheels_bench.py --compare DIR/before [--hosts 8] [--runs 3]

Writes bench/out/wheels.json. Needs root (the testbed)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from provision_bench import ENV, OUT, REPO, invoke  # the bench testbed's env, the CLI run

INV = OUT / "wheels-testbed.yml"
STATE = Path(ENV["TORCHRIG_TESTBED_STATE"])


def reset(hosts: list[str]) -> None:
    code = ("import sys; from torchrig.testbed import lab\n"
            "for h in sys.argv[1:]: lab.reset_host(h, log=lambda *a: None)")
    subprocess.run([sys.executable, "-c", code, *hosts], cwd=REPO, check=True,
                   env={**os.environ, **ENV, "PYTHONPATH": str(REPO)})


def pulled(since: int) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of wheels the index served, and of .debs the apt repositories served, per client
    address since log offset `since`."""
    sys.path.insert(0, str(REPO))
    from torchrig.testbed import paths, pyindex
    with open(STATE / "http.log", "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    www = STATE / "www"
    wheels: dict[str, int] = {}
    for client, name in pyindex.wheels_served(text):
        wheels[client] = wheels.get(client, 0) + (www / pyindex.FILES / name).stat().st_size
    debs: dict[str, int] = {}
    for client, path in paths.debs_served(text):
        debs[client] = debs.get(client, 0) + (www / path).stat().st_size
    return wheels, debs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compare", type=Path, required=True, help="the checkout to measure against")
    ap.add_argument("--keep", action="store_true", help="leave the bench testbed up")
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    repos = {"this": REPO, "compare": a.compare.resolve()}
    names = [f"gpu{i}" for i in range(1, a.hosts + 1)]
    invoke("testbed.down", check=False)
    invoke("testbed.up", "--hosts", str(a.hosts), "--inventory", str(INV))
    runs = {k: [] for k in repos}
    try:
        for i in range(a.runs):
            for name, repo in repos.items():
                if i or name != "this":
                    reset(names)  # the first run of all finds them fresh
                log = STATE / "http.log"
                at = log.stat().st_size
                r, dt = invoke("provision", "-i", str(INV), "--yes", "--reboot", "--json", repo=repo)
                per, debs = pulled(at)
                runs[name].append({"seconds": round(dt, 1), "bytes_per_host": per,
                                   "deb_bytes_per_host": debs})
                print(f"{name}: fresh provision of {a.hosts} hosts: {dt:.1f}s; wheels pulled from "
                      f"the index: {sum(per.values()) / 2**20:.0f} MiB in all, by {len(per)} "
                      f"host(s): " + ", ".join(f"{c} {b / 2**20:.0f} MiB" for c, b in sorted(per.items()))
                      + f"; .debs from the apt repositories: {sum(debs.values()) / 2**20:.1f} MiB "
                      f"in all, by {len(debs)} host(s)", flush=True)
    finally:
        if not a.keep:
            invoke("testbed.down", check=False)
    result = {"hosts": a.hosts, "runs": a.runs, "machine": f"{os.cpu_count()} cores"}
    for name, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        total = [sum(r["bytes_per_host"].values()) for r in rs]
        result[name] = {"seconds_median": statistics.median(secs), "seconds": secs,
                        "index_bytes_median": statistics.median(total),
                        "index_bytes_per_host_max": max(max(r["bytes_per_host"].values(), default=0) for r in rs),
                        "hosts_pulling": [len(r["bytes_per_host"]) for r in rs],
                        "deb_bytes_median": statistics.median(sum(r["deb_bytes_per_host"].values()) for r in rs),
                        "hosts_pulling_debs": [len(r["deb_bytes_per_host"]) for r in rs], "runs": rs}
    t, c = result["this"], result["compare"]
    result["ratio_seconds"] = round(t["seconds_median"] / c["seconds_median"], 2)
    result["ratio_index_bytes"] = round(t["index_bytes_median"] / max(c["index_bytes_median"], 1), 3)
    result["ratio_deb_bytes"] = round(t["deb_bytes_median"] / max(c["deb_bytes_median"], 1), 3)
    print(f"this/compare: wall {result['ratio_seconds']}x, index bytes {result['ratio_index_bytes']}x, "
          f".deb bytes {result['ratio_deb_bytes']}x")
    (OUT / "wheels.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
