"""`fetch --all` of one large file from a testbed node against `scp` of the same file, in the
same run:

- fetch: the whole CLI (`invoke fetch -i INV -H HOST --job benchfetch --all --to DIR --json`)
  into a fresh folder: list, the transfer (the node hashing what it sends, its SHA-256 after
  the last byte; the operator hashing what it receives), the manifest;
- fetch warm: the same fetch again into that folder (the file already there: the node's hash,
  nothing sent);
- scp: `scp user@node:FILE DIR/` of the same file with the inventory's address, user, port,
  identity_file and known_hosts;
- with --paramiko, also fetch with its bytes over paramiko (TORCHRIG_BULK_SSH=paramiko), the
  carrier before OpenSSH's `ssh` took them;
- with --baseline CHECKOUT, also the same fetch (cold) run from another checkout of torchrig
  (e.g. `git archive COMMIT | tar -x -C DIR`), so a change is measured against the code
  before it in the same rounds.

fetch's own run must carry its bytes over `ssh` (the bench stops if fetch says it fell back).

--rate RATE (tc's units, e.g. 1gbit) makes the wire the limit, as between a laptop and a
cluster: the node's own interface sends at most RATE while the bench runs (a `tbf` qdisc on
its eth0, inside the node's network namespace; removed at the end). Without it the testbed's
veth is as fast as the CPU, and on a small machine both ends' encryption and hashing share
its cores.

The file (random bytes, --mib MiB, default 256) is written once as checkpoint
`ckpt_00000010.pt` of job `benchfetch` in the node's checkpoint folder, owned by the job's
user and world-readable (scp logs in as the inventory's user); it is removed at the end.

    .venv/bin/python bench/fetch_bench.py INVENTORY HOST [--runs 3] [--mib 256] [--paramiko]
        [--baseline CHECKOUT] [--rate 1gbit]

Medians of --runs rounds; within a round each method runs once, fetch and scp alternating
which goes first. Writes bench/out/fetch.json."""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
sys.path.insert(0, str(REPO))

from data_bench import ssh_opts  # noqa: E402  (bench/ is the script's folder: on sys.path)
from project_bench import invoke  # noqa: E402
from torchrig.inventory import load  # noqa: E402
from torchrig.job import job_folder  # noqa: E402

JOB, NAME = "benchfetch", "ckpt_00000010.pt"


def on_node(inv_path: str, host: str, cmd: str) -> None:
    invoke("exec", "-i", inv_path, "-H", host, "--sudo", cmd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inventory")
    ap.add_argument("host")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--paramiko", action="store_true", help="also fetch over paramiko")
    ap.add_argument("--baseline", help="also fetch with the torchrig checkout in this folder")
    ap.add_argument("--rate", help="the node sends at most this (tc units, e.g. 1gbit)")
    a = ap.parse_args()
    if a.rate and not re.fullmatch(r"[0-9]+(\.[0-9]+)?[kmg]?(bit|bps)", a.rate):
        sys.exit(f"--rate {a.rate!r}: a tc rate such as 1gbit or 500mbit")
    inv = load(a.inventory)
    h = next(x for x in inv.hosts if x.name == a.host)
    folder = job_folder(h.settings.checkpoint_dir, JOB)
    path = f"{folder}/{NAME}"
    user = h.settings.service_user
    on_node(a.inventory, a.host,
            f"mkdir -p {folder} && head -c {a.mib << 20} /dev/urandom > {path} && "
            f"chown -R {user}: {folder} && chmod 755 {folder} && chmod 644 {path}"
            + (f" && tc qdisc replace dev eth0 root tbf rate {a.rate} burst 512kb latency 20ms"
               if a.rate else ""))
    work = Path(tempfile.mkdtemp(prefix="fetch-bench-"))
    times = {"fetch": [], "fetch_warm": [], "scp": [], **({"fetch_paramiko": []} if a.paramiko else {}),
             **({"fetch_baseline": []} if a.baseline else {})}
    loadavg = [os.getloadavg()[0]]
    try:
        for r in range(a.runs):
            def do_fetch():
                to = work / f"fetch{r}"
                args = ("fetch", "-i", a.inventory, "-H", a.host, "--job", JOB, "--all",
                        "--to", str(to), "--json")
                ran, dt = invoke(*args)
                if "carried over paramiko" in ran.stderr:
                    sys.exit(f"fetch did not use ssh: {ran.stderr[-1000:]}")
                times["fetch"].append(dt)
                _, dt = invoke(*args)
                times["fetch_warm"].append(dt)
                shutil.rmtree(to)

            def do_paramiko():
                to = work / f"paramiko{r}"
                os.environ["TORCHRIG_BULK_SSH"] = "paramiko"
                try:
                    _, dt = invoke("fetch", "-i", a.inventory, "-H", a.host, "--job", JOB,
                                   "--all", "--to", str(to), "--json")
                finally:
                    del os.environ["TORCHRIG_BULK_SSH"]
                times["fetch_paramiko"].append(dt)
                shutil.rmtree(to)

            def do_baseline():
                to = work / f"baseline{r}"
                base = Path(a.baseline).resolve()
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "invoke", "fetch", "-i",
                                str(Path(a.inventory).resolve()), "-H", a.host, "--job", JOB,
                                "--all", "--to", str(to), "--json"], cwd=base, check=True,
                               capture_output=True, env={**os.environ, "PYTHONPATH": str(base)})
                times["fetch_baseline"].append(time.perf_counter() - t0)
                shutil.rmtree(to)

            def do_scp():
                to = work / f"scp{r}"
                to.mkdir()
                t0 = time.perf_counter()
                subprocess.run(["scp", "-q", *ssh_opts(h, inv.known_hosts), "-P",
                                str(h.port or 22), f"{h.user}@{h.address}:{path}", f"{to}/"],
                               check=True)
                times["scp"].append(time.perf_counter() - t0)
                shutil.rmtree(to)

            order = ([do_fetch, do_scp] + ([do_paramiko] if a.paramiko else []) +
                     ([do_baseline] if a.baseline else []))
            for f in (order if r % 2 == 0 else order[::-1]):
                f()
            loadavg.append(os.getloadavg()[0])
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        on_node(a.inventory, a.host, f"rm -rf {folder}"
                + ("; tc qdisc del dev eth0 root" if a.rate else ""))
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    res = {"host": a.host, "mib": a.mib, "runs": a.runs, "rate": a.rate, "median_s": med,
           "all_s": {k: [round(x, 2) for x in v] for k, v in times.items()},
           "fetch_over_scp": round(med["fetch"] / med["scp"], 2),
           "load_avg_1min": [round(x, 1) for x in loadavg],
           "date": time.strftime("%Y-%m-%d", time.gmtime())}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fetch.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"medians of {a.runs}: fetch --all {med['fetch']} s, again (nothing sent) "
          f"{med['fetch_warm']} s, scp {med['scp']} s; fetch / scp {res['fetch_over_scp']}" +
          (f"; over paramiko {med['fetch_paramiko']} s" if a.paramiko else "") +
          (f"; baseline {med['fetch_baseline']} s ({round(med['fetch_baseline'] / med['scp'], 2)}"
           " x scp)" if a.baseline else "") +
          f"; load average {min(loadavg):.1f}-{max(loadavg):.1f}")


if __name__ == "__main__":
    main()
