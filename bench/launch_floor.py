"""`torchrig launch` against the plain-OpenSSH floor, in the same rounds (issue 26): what a
person with ssh and systemd-run alone needs to start the same torchrun on N nodes and see
every node's workers spawned.

    sudo .venv/bin/python bench/launch_floor.py INVENTORY HOSTS [--nodes 2,8] [--runs 5] [--compare DIR]

Per round and node count: `torchrig launch --script env_check.py --nproc-per-node 2
--early-fail-window 0` (payload already there: a first, uncounted launch pushes it; it
returns once every node's workers run), then `stop`; then the floor: one OpenSSH connection
per node, all at once, each running `systemd-run` of that launch's own torchrun command line
(read from its unit: same interpreter, arguments, environment files, working folder and
user, a new rendezvous id and log folder) and waiting there until torchrun made the workers'
rank folders (as launch does), then stopping it. Medians of --runs, the ratio in the same
rounds. --compare DIR: another checkout (e.g. `git archive` of the commit before a change)
whose launch runs in the same rounds too, its own job, just before this one's. Writes
bench/out/launch_floor.json."""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from provision_bench import USER_ENV  # noqa: E402
from torchrig import inventory  # noqa: E402
from torchrig.job import unit_name  # noqa: E402

NPROC = 2


def invoke(*args, repo=REPO) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=repo, capture_output=True,
                       text=True, env={**USER_ENV, "PYTHONPATH": str(repo)})  # its own torchrig
    if r.returncode != 0:
        sys.exit(f"invoke {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


def ssh(inv, h) -> list[str]:
    return ["ssh", "-i", h.identity_file, "-o", f"UserKnownHostsFile={inv.known_hosts}",
            "-o", "BatchMode=yes", "-p", str(h.port or 22), f"{h.user}@{h.address}"]


def unit_of(inv, h, job: str) -> dict:
    """The launch's unit on `h`: ExecStart's argv, WorkingDirectory, User, EnvironmentFiles."""
    text = subprocess.run(ssh(inv, h) + ["sudo systemctl cat " + unit_name(job)], check=True,
                          capture_output=True, text=True).stdout
    u = {"env": []}
    for line in text.splitlines():
        key, _, val = line.partition("=")
        if key == "ExecStart":
            u["argv"] = shlex.split(val)
        elif key in ("WorkingDirectory", "User"):
            u[key] = val
        elif key == "EnvironmentFile" and not val.endswith(".run"):  # the run id: a new one
            u["env"].append(val)
    return u


def log_dir(u: dict) -> str:
    """The unit's torchrun --log-dir."""
    return u["argv"][u["argv"].index("--log-dir") + 1]


def floor_log_dir(tag: str) -> str:
    return f"/var/log/torchrig/{tag}"


def floor_command(u: dict, tag: str, keep: bool = False) -> str:
    """systemd-run of the unit's torchrun under a new name, rendezvous id and log folder; wait
    until its workers' rank folders exist. keep: the unit stays loaded once torchrun exited
    (its timestamps are read afterwards: bench/launch_phases.py); the caller stops it."""
    argv = list(u["argv"])
    logdir = floor_log_dir(tag)
    argv[argv.index("--log-dir") + 1] = logdir
    props = [f"-p EnvironmentFile={shlex.quote(e)}" for e in u["env"]]
    # one sudo for the whole wait, as launch's node-side wait is one process: a sudo per look
    # (PAM, a journal line) made the floor's own polling the heaviest load on 8 busy nodes
    wait = (f"until [ \"$(find {logdir} -mindepth 3 -maxdepth 3 -type d | wc -l)\" -ge {NPROC} ]; "
            "do sleep 0.05; done")
    return (f"sudo install -d -o {u['User']} -g {u['User']} -m 750 {logdir} && "
            f"sudo systemd-run --quiet {'--remain-after-exit ' if keep else ''}--unit={tag} --uid={u['User']} --gid={u['User']} "
            f"--working-directory={shlex.quote(u['WorkingDirectory'])} {' '.join(props)} "
            f"--setenv=PET_RDZV_ID={tag} -- {shlex.join(argv)} && "
            f"sudo sh -c {shlex.quote(wait)}")


def floor(inv, hosts, units: dict, tag: str, read=None) -> tuple[float, list]:
    """The floor's seconds, and read(h) of each node's floor taken before it is stopped (its
    unit then stays loaded after torchrun exited: floor_command's keep; [] without read)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(hosts)) as pool:
        rs = list(pool.map(lambda h: subprocess.run(
            ssh(inv, h) + [floor_command(units[h.name], tag, keep=read is not None)],
            capture_output=True, text=True, timeout=300), hosts))
    dt = time.perf_counter() - t0
    for h, r in zip(hosts, rs):
        if r.returncode != 0:
            sys.exit(f"floor on {h.name} failed: {r.stderr[-1500:]}")
    got = [read(h) for h in hosts] if read else []
    with ThreadPoolExecutor(len(hosts)) as pool:
        list(pool.map(lambda h: subprocess.run(
            ssh(inv, h) + [f"sudo systemctl stop {tag}; sudo rm -rf {floor_log_dir(tag)}"],
            capture_output=True), hosts))
    return dt, got


def timed(inv, inv_path: str, hosts, job: str, repo: Path, keep_units=False):
    """One launch (from checkout `repo`) and its stop: (seconds, its units read first or None)."""
    sel = ",".join(h.name for h in hosts)
    dt = invoke("launch", "-i", inv_path, "-H", sel, "--job", job, "--script", "env_check.py",
                "--nproc-per-node", str(NPROC), "--early-fail-window", "0", repo=repo)
    units = {h.name: unit_of(inv, h, job) for h in hosts} if keep_units else None
    invoke("stop", "-i", inv_path, "-H", sel, "--job", job, repo=repo)
    return dt, units


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("hosts", help="comma-separated, at least the largest --nodes")
    ap.add_argument("--nodes", default="2,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--compare", type=Path, help="another checkout, its launch in the same rounds")
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    inv_path = str(Path(a.inventory).resolve())
    inv = inventory.load(inv_path)
    by_name = {h.name: h for h in inv.hosts}
    names = a.hosts.split(",")
    res = {"runs": a.runs, **({"compare": str(a.compare)} if a.compare else {})}
    for n in (int(x) for x in a.nodes.split(",")):
        sel = names[:n]
        hosts = [by_name[x] for x in sel]
        times = {"launch": [], "floor": [], **({"compare": []} if a.compare else {})}
        for i in range(a.runs + 1):  # round 0 pushes the payload: not counted
            job = f"bench-floor-{n}-{int(time.time())}-{i}"
            # --compare's launch before this one's in odd rounds, after it in even ones
            other = a.compare.resolve() if a.compare else None
            cdt = timed(inv, inv_path, hosts, job + "-c", other)[0] if other and i % 2 else None
            dt, units = timed(inv, inv_path, hosts, job, REPO, keep_units=True)
            if other and cdt is None:
                cdt = timed(inv, inv_path, hosts, job + "-c", other)[0]
            if a.compare and i:
                times["compare"].append(cdt)
            fdt = floor(inv, hosts, units, f"{job}-openssh")[0]
            if i:
                times["launch"].append(dt)
                times["floor"].append(fdt)
            print(f"{n} nodes, round {i}: launch {dt:.2f}s, OpenSSH floor {fdt:.2f}s"
                  + (f", --compare's launch {cdt:.2f}s" if a.compare else ""), flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        res[f"{n}_nodes"] = {"launch_median_s": round(med["launch"], 2),
                             "floor_median_s": round(med["floor"], 2),
                             "ratio": round(med["launch"] / med["floor"], 2),
                             "launch_all_s": [round(t, 2) for t in times["launch"]],
                             "floor_all_s": [round(t, 2) for t in times["floor"]]}
        if a.compare:
            res[f"{n}_nodes"].update(compare_median_s=round(med["compare"], 2),
                                     compare_ratio=round(med["compare"] / med["floor"], 2),
                                     compare_all_s=[round(t, 2) for t in times["compare"]])
        print(f"{n} nodes: launch {med['launch']:.2f}s, floor {med['floor']:.2f}s, "
              f"ratio {med['launch'] / med['floor']:.2f}x"
              + (f"; --compare's launch {med['compare']:.2f}s, ratio "
                 f"{med['compare'] / med['floor']:.2f}x" if a.compare else ""), flush=True)
    (OUT / "launch_floor.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
