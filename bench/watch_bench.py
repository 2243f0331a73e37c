"""`status --watch` on a job with a big journal and big logs: the bytes and time of its first
round against its later ones, and its round trips per node per round.

    sudo .venv/bin/python bench/watch_bench.py INVENTORY HOST [--rounds 50] [--compare DIR]

On HOST (a testbed host; no provisioning needed, the probe needs python3) a unit named as a
job's writes a journal of --journal-lines lines first (no rate limit), a 30-day GPU-use file
and two ranks' stdout.log of 20 MB, then keeps writing: a journal line and a progress line per
rank every 0.1 s, a GPU-use sample a second. The watch's rounds run through the library
(launch/status.py watch, one second apart), with the fleet's run() counted: round trips and
the bytes sent and received per round. --compare DIR: a checkout of other code (`git archive`
of the commit before a change), watched in turn with this one on the same job. Writes
bench/out/watch.json."""

import argparse
import json
import os
import secrets
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
sys.path.insert(0, str(REPO))

JOB = """import os, sys, time
d, n = sys.argv[1], int(sys.argv[2])
for r in (0, 1):
    os.makedirs("%s/run_1/attempt_0/%d" % (d, r), exist_ok=True)
now = int(time.time())
with open(d + "/gpu_util.csv", "w") as f:
    f.writelines("%d,97,98\\n" % t for t in range(now - 30 * 86400, now, 30))
logs = [open("%s/run_1/attempt_0/%d/stdout.log" % (d, r), "a") for r in (0, 1)]
for r, f in enumerate(logs):
    f.write("start rank=%d\\n" % r)
    f.writelines("step=%d loss=2.0 tok/s=1000 %s\\n" % (s, "p" * 80) for s in range(200000))
    f.flush()
for i in range(n):
    sys.stdout.write(("agent: heartbeat " if i % 10 == 0 else "[default%d]:rank line " % (i % 2))
                     + "%d %s\\n" % (i, "z" * 80))
sys.stdout.flush()
open(d + "/prefilled", "w").close()
s = 200000
while True:
    s += 1
    print("[default0]:tick %d" % s, flush=True)
    for f in logs:
        f.write("step=%d loss=2.0 tok/s=1000\\n" % s)
        f.flush()
    if s % 10 == 0:
        with open(d + "/gpu_util.csv", "a") as u:
            u.write("%d,97,98\\n" % time.time())
    time.sleep(0.1)
"""

# run in a child with the code under test first on sys.path (this checkout or --compare's)
WATCH = """import json, sys, time
from torchrig import inventory
from torchrig.launch import status
from torchrig.session import Fleet
inv_path, host, job, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
inv = inventory.load(inv_path)
rows = []
with Fleet(inv, [h for h in inv.hosts if h.name == host]) as fleet:
    real, seen = fleet.run, []
    def run(h, cmd, **kw):
        r = real(h, cmd, **kw)
        seen.append(len(r.stdout) + len(r.stderr) + len(kw.get("data") or ""))
        return r
    fleet.run = run
    t0 = [time.perf_counter()]

    def nap(s):  # the watch's sleep between rounds is not the round's time
        time.sleep(s)
        t0[0] = time.perf_counter()
    for i, rnd in enumerate(status.watch(fleet, job, 1.0, sleep=nap)):
        assert rnd.nodes.ok, rnd.nodes.failures
        rows.append({"round_trips": len(seen), "bytes": sum(seen),
                     "s": round(time.perf_counter() - t0[0], 3),
                     "progress": rnd.nodes.results[0].value["progress"]})
        seen.clear()
        if i + 1 == rounds:
            break
print(json.dumps(rows))
"""


def on_host(inv, host, cmd):
    r = subprocess.run([sys.executable, "-m", "invoke", "exec", "-i", inv, "-H", host, "--sudo",
                        cmd], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{cmd[:60]!r} on {host} failed:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
    return r.stdout


def watch(repo: Path, inv: str, host: str, job: str, rounds: int) -> list[dict]:
    r = subprocess.run([sys.executable, "-c", WATCH, inv, host, job, str(rounds)], cwd=repo,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    if r.returncode != 0:
        sys.exit(f"{repo}: the watch failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def summary(rows: list[dict]) -> dict:
    later = rows[len(rows) // 2:]
    return {"round_trips_per_round": sorted({r["round_trips"] for r in rows}),
            "round_1": {"bytes": rows[0]["bytes"], "s": rows[0]["s"]},
            f"rounds_{len(rows) - len(later) + 1}_{len(rows)}_median": {
                "bytes": statistics.median(r["bytes"] for r in later),
                "s": statistics.median(r["s"] for r in later)},
            f"round_{len(rows)}": {"bytes": rows[-1]["bytes"], "s": rows[-1]["s"]},
            "last_progress": rows[-1]["progress"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("host")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--journal-lines", type=int, default=200000)
    ap.add_argument("--compare", type=Path, help="another checkout, watched in turn with this one")
    a = ap.parse_args()
    from torchrig import inventory
    inv = str(Path(a.inventory).resolve())
    h = next(h for h in inventory.load(inv).hosts if h.name == a.host)
    job = f"bench-watch-{secrets.token_hex(3)}"
    unit, logdir = f"torchrig-{job}.service", h.settings.job_log_dir(job)
    on_host(inv, a.host, f"mkdir -p {shlex.quote(logdir)} && systemd-run --unit {unit} "
                         "-p LogRateLimitIntervalSec=0 -p RuntimeMaxSec=3600 -- python3 -u -c "
                         f"{shlex.quote(JOB)} {shlex.quote(logdir)} {a.journal_lines}")
    repos = {"this": REPO, **({"compare": a.compare.resolve()} if a.compare else {})}
    try:
        deadline = time.monotonic() + 600
        while "yes" not in on_host(inv, a.host, f"test -e {shlex.quote(logdir)}/prefilled && echo yes || true"):
            if time.monotonic() > deadline:
                sys.exit(f"{unit}: its journal was not written within 600 s")
            time.sleep(2)
        sizes = on_host(inv, a.host, f"journalctl -u {unit} -o cat --no-pager | wc -lc; "
                                     f"du -sh {shlex.quote(logdir)}")
        res = {"host": a.host, "rounds": a.rounds, "job": sizes.split("\n", 1)[0],
               **{label: summary(watch(repo, inv, a.host, job, a.rounds))
                  for label, repo in repos.items()},
               "load_avg_end": os.getloadavg()[0]}
    finally:
        on_host(inv, a.host, f"systemctl stop {unit}; rm -rf -- {shlex.quote(logdir)}")
    print(json.dumps(res, indent=2))
    OUT.mkdir(exist_ok=True)
    (OUT / "watch.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
