"""`data.push` of one dataset to 2 and to 8 testbed nodes, against the tools an operator would
otherwise use, each run from this machine to every node at once (one process per node):

- push cold: the dataset, its store and any partial upload removed on the nodes first (as
  root, `invoke exec --sudo`); the whole CLI (`invoke data.push PATH --name NAME --json`):
  manifest (hashing here), each byte once to one node over SSH, then node to node, verified,
  switched;
- push warm: the same push right after (nothing to send);
- scp: `scp -r PATH user@node:/srv/bench-scp/`, one per node in parallel, the folder
  removed first;
- rsync: `rsync -a PATH user@node:/srv/bench-rsync/` the same way; rsync warm: again right
  after (nothing to send).

scp and rsync use the inventory's address, user, port and identity_file, and its known_hosts
(StrictHostKeyChecking=yes). rsync is installed on the nodes if they lack it (the testbed's
package mirror has no rsync: the .debs of this machine's Debian, `apt-get download rsync
libpopt0`, copied there and installed with dpkg).

Bytes sent by this machine are counted where they arrive, independently of torchrig: an
nftables counter on each node of every packet to tcp port 22 (IP packets: SSH's and TCP's
overhead included), read with nsenter in the node container's network namespace (no SSH, so
reading it counts nothing) before and after each run; the figure is the sum over the nodes.
data.push's node-to-node copies go to other ports and are not in it.

The dataset (made once with os.urandom, kept in bench/out/data-src-SIZE/): `full` is
1 GiB = big.bin (512 MiB) + mid/m0..m7.bin (8 x 32 MiB) + small/s000..s511.bin (512 x 512 KiB);
`small` (to try the script) is 68 MiB = 32 MiB + 4 x 8 MiB + 64 x 64 KiB.

    sudo .venv/bin/python bench/data_bench.py INVENTORY HOSTS [--nodes 2,8] [--runs 3] \
        [--size full|small] [--state /var/lib/torchrig-testbed]

HOSTS: testbed hosts that provision set up (comma-separated; --nodes N takes the first N).
Medians of --runs rounds per node count; within a round every method runs once, their order
rotated from round to round. At the end the dataset is removed from the nodes (data.rm).
Writes bench/out/data.json (--size small: data-small.json)."""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
sys.path.insert(0, str(REPO))

from project_bench import invoke  # noqa: E402  (bench/ is the script's folder: on sys.path)
from torchrig.inventory import load  # noqa: E402

NAME = "benchdata"
KIB, MIB = 1 << 10, 1 << 20
LAYOUTS = {  # (relative path, size)
    "full": [("big.bin", 512 * MIB)] + [(f"mid/m{i}.bin", 32 * MIB) for i in range(8)]
            + [(f"small/s{i:03d}.bin", 512 * KIB) for i in range(512)],
    "small": [("big.bin", 32 * MIB)] + [(f"mid/m{i}.bin", 8 * MIB) for i in range(4)]
             + [(f"small/s{i:03d}.bin", 64 * KIB) for i in range(64)],
}
COUNT = r"""nft list table inet tcount >/dev/null 2>&1 || { nft add table inet tcount &&
nft add chain inet tcount in '{ type filter hook input priority -5; }' &&
nft add rule inet tcount in tcp dport 22 counter; }"""
SCRATCH = {"scp": "/srv/bench-scp", "rsync": "/srv/bench-rsync"}


def dataset(size: str) -> Path:
    root = OUT / f"data-src-{size}"
    layout = LAYOUTS[size]
    if all((root / p).is_file() and (root / p).stat().st_size == n for p, n in layout):
        return root
    for p, n in layout:
        f = root / p
        f.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "wb") as fh:
            for off in range(0, n, 16 * MIB):
                fh.write(os.urandom(min(16 * MIB, n - off)))
    return root


# ---- the counter, in the node container's network namespace ---------------------------------

def container_pid(state: str, name: str) -> int:
    """The node's init: the child of the systemd-nspawn process that boots its root."""
    want = f"--directory={state}/hosts/{name}/root".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"systemd-nspawn") and want in argv:
            kids = (d / "task" / d.name / "children").read_text().split()
            if len(kids) == 1:
                return int(kids[0])
    sys.exit(f"no running container for {name} under {state}")


def in_node(pid: int, script: str) -> str:
    r = subprocess.run(["nsenter", "-t", str(pid), "-m", "-n", "sh", "-c", script],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"nsenter {pid}: {script!r} failed: {r.stderr}")
    return r.stdout


class Counters:
    def __init__(self, state: str, hosts):
        self.pids = {}
        for h in hosts:
            pid = container_pid(state, h.name)
            addrs = in_node(pid, "ip -o -4 addr show")
            if f" {h.address}/" not in addrs:
                sys.exit(f"container of {h.name} has no address {h.address}:\n{addrs}")
            in_node(pid, COUNT)
            self.pids[h.name] = pid

    def read(self, names) -> int:
        total = 0
        for n in names:
            out = in_node(self.pids[n], "nft list table inet tcount")
            total += sum(int(w) for w in _after(out.split(), "bytes"))
        return total


def _after(words, key):
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == key]


# ---- the methods --------------------------------------------------------------------------------

def ssh_opts(h, known_hosts: str) -> list[str]:
    return ["-i", h.identity_file, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={known_hosts}"]


def parallel(argvs) -> float:
    t0 = time.perf_counter()
    ps = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for a in argvs]
    errs = [(a, p.communicate()) for a, p in zip(argvs, ps)]
    dt = time.perf_counter() - t0
    for (a, (_, err)), p in zip(errs, ps):
        if p.returncode != 0:
            sys.exit(f"{shlex.join(a)} failed ({p.returncode}): {err.decode()[-2000:]}")
    return dt


def scp(hosts, src: Path, kh: str) -> float:
    return parallel([["scp", "-r", "-q", *ssh_opts(h, kh), "-P", str(h.port or 22), str(src),
                      f"{h.user}@{h.address}:{SCRATCH['scp']}/"] for h in hosts])


def rsync(hosts, src: Path, kh: str) -> float:
    return parallel([["rsync", "-a", "-e", shlex.join(["ssh", *ssh_opts(h, kh), "-p", str(h.port or 22)]),
                      str(src), f"{h.user}@{h.address}:{SCRATCH['rsync']}/"] for h in hosts])


def ensure_rsync(inv_path, hosts, kh):
    sel = ",".join(h.name for h in hosts)
    r, _ = invoke("exec", "-i", inv_path, "-H", sel, "command -v rsync || echo MISSING")
    if "MISSING" not in r.stdout:
        return
    debs = OUT / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    if not list(debs.glob("rsync_*.deb")) or not list(debs.glob("libpopt0_*.deb")):
        subprocess.run(["apt-get", "download", "rsync", "libpopt0"], cwd=debs, check=True)
    files = [str(p) for p in sorted(debs.glob("*.deb"))]
    parallel([["scp", "-q", *ssh_opts(h, kh), "-P", str(h.port or 22), *files,
               f"{h.user}@{h.address}:/tmp/"] for h in hosts])
    invoke("exec", "-i", inv_path, "-H", sel, "--sudo",
           "dpkg -i " + " ".join("/tmp/" + Path(f).name for f in files) + " >/dev/null && rsync --version | head -1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("hosts", help="comma-separated; --nodes N takes the first N")
    ap.add_argument("--nodes", default="2,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", choices=sorted(LAYOUTS), default="full")
    ap.add_argument("--state", default="/var/lib/torchrig-testbed", help="the testbed's state folder")
    a = ap.parse_args()
    inv = load(a.inventory)
    names = a.hosts.split(",")
    counts = [int(n) for n in a.nodes.split(",")]
    hosts = [inv.host(n) for n in names[:max(counts)]]
    kh = inv.known_hosts
    src = dataset(a.size)
    size = sum(n for _, n in LAYOUTS[a.size])
    print(f"dataset {src}: {len(LAYOUTS[a.size])} files, {size} bytes", flush=True)
    counters = Counters(a.state, hosts)
    ensure_rsync(a.inventory, hosts, kh)
    data_dir = hosts[0].settings.data_dir

    results = {"dataset": {"path": str(src.relative_to(REPO)), "size": a.size, "bytes": size,
                           "files": len(LAYOUTS[a.size])},
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": a.runs}
    for n in counts:
        sel_hosts = hosts[:n]
        sel = ",".join(h.name for h in sel_hosts)
        rows = {k: {"s": [], "bytes": []} for k in ("push_cold", "push_warm", "scp", "rsync", "rsync_warm")}
        loads, push_json = [], []

        def measured(key, fn):
            b0 = counters.read([h.name for h in sel_hosts])
            dt, extra = fn()
            b = counters.read([h.name for h in sel_hosts]) - b0
            if b < 0:
                sys.exit(f"{key}: a node's counter went back (its nftables ruleset reloaded?)")
            rows[key]["s"].append(dt)
            rows[key]["bytes"].append(b)
            print(f"  {n} nodes {key}: {dt:.2f} s, {b} bytes to port 22" + (f" {extra}" if extra else ""),
                  flush=True)

        def push(key):
            def fn():
                r, dt = invoke("data.push", str(src), "--name", NAME, "-i", a.inventory, "-H", sel, "--json")
                res = json.loads(r.stdout)
                froms = {k: v["from"] for k, v in res["nodes"].items()}
                push_json.append({"key": key, "operator_bytes": res["operator_bytes"], "from": froms,
                                  "fallbacks": res["fallbacks"]})
                if key == "push_warm" and res["operator_bytes"] != 0:
                    sys.exit(f"warm push sent {res['operator_bytes']} bytes: {r.stdout}")
                return dt, f"(torchrig says {res['operator_bytes']} bytes from here; from: {froms})"
            return fn

        def tool(key, f):
            return lambda: (f(sel_hosts, src, kh), "")

        def do_push():
            invoke("exec", "-i", a.inventory, "-H", sel, "--sudo",
                   f"rm -rf {data_dir}/.torchrig {data_dir}/{NAME}")
            measured("push_cold", push("push_cold"))
            measured("push_warm", push("push_warm"))

        def do_scp():
            fresh(a.inventory, sel_hosts, "scp")
            measured("scp", tool("scp", scp))

        def do_rsync():
            fresh(a.inventory, sel_hosts, "rsync")
            measured("rsync", tool("rsync", rsync))
            measured("rsync_warm", tool("rsync_warm", rsync))

        units = [do_push, do_scp, do_rsync]
        for i in range(a.runs):
            order = units[i % 3:] + units[:i % 3]
            print(f"{n} nodes, round {i + 1}: {', '.join(u.__name__[3:] for u in order)}; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            loads.append(os.getloadavg()[0])
            for u in order:
                u()
            loads.append(os.getloadavg()[0])
            cleanup(a.inventory, sel_hosts)  # 2 x 1 GiB per node less on the shared disk
        med = {k: {"median_s": round(statistics.median(v["s"]), 2),
                   "median_bytes": int(statistics.median(v["bytes"])),
                   "all_s": [round(x, 2) for x in v["s"]], "all_bytes": v["bytes"]}
               for k, v in rows.items()}
        results[f"{n}_nodes"] = {
            **med,
            "push_cold_over_scp": {"time": round(med["push_cold"]["median_s"] / med["scp"]["median_s"], 2),
                                   "bytes": round(med["push_cold"]["median_bytes"] / med["scp"]["median_bytes"], 3)},
            "push_cold_over_rsync": {"time": round(med["push_cold"]["median_s"] / med["rsync"]["median_s"], 2),
                                     "bytes": round(med["push_cold"]["median_bytes"] / med["rsync"]["median_bytes"], 3)},
            "push_cold_bytes_over_dataset": round(med["push_cold"]["median_bytes"] / size, 3),
            "load_average_1min": {"min": round(min(loads), 2), "max": round(max(loads), 2)},
            "push_results": push_json,
        }
        r = results[f"{n}_nodes"]
        print(f"{n} nodes: " + ", ".join(f"{k} {v['median_s']} s / {v['median_bytes']} B"
                                         for k, v in med.items()), flush=True)
        print(f"{n} nodes: data.push / parallel scp: time {r['push_cold_over_scp']['time']}, "
              f"bytes {r['push_cold_over_scp']['bytes']}; / rsync: time "
              f"{r['push_cold_over_rsync']['time']}, bytes {r['push_cold_over_rsync']['bytes']}", flush=True)
    # the dataset's 1 GiB per node off the shared disk again
    invoke("data.rm", "--name", NAME, "-i", a.inventory, "-H", ",".join(h.name for h in hosts))
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / ("data.json" if a.size == "full" else f"data-{a.size}.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("wrote", out)


def fresh(inv_path, hosts, tool_name):
    d = SCRATCH[tool_name]
    invoke("exec", "-i", inv_path, "-H", ",".join(h.name for h in hosts), "--sudo",
           f"rm -rf {d} && install -d -o {hosts[0].user} {d}")


def cleanup(inv_path, hosts):
    invoke("exec", "-i", inv_path, "-H", ",".join(h.name for h in hosts), "--sudo",
           "rm -rf " + " ".join(SCRATCH.values()))


if __name__ == "__main__":
    main()
