"""One SSH round trip through torchrig's own connection (connections.ssh_socket: Nagle's
algorithm off, every read acknowledged at once) against the same connection over paramiko's
default socket (it sets no option) and over one with Nagle off alone, in alternating rounds on
the same host.

    .venv/bin/python bench/roundtrip_bench.py INVENTORY HOST [--runs 9] [--commands 5]

Each round, for each socket: a new connection (the handshake: TCP, key exchange, host key
check, authentication), the first `true` on it, then --commands runs of `true` as the login
user and as root (the median of those is the round's figure), each as torchrig runs a command
(run_input: a channel, stdin, the read loop), and the connection closed. Prints and writes
bench/out/roundtrip.json: the medians over --runs rounds, in ms.
"""

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
sys.path.insert(0, str(REPO))

from torchrig import connections  # noqa: E402
from torchrig.inventory import load  # noqa: E402

TORCHRIG = connections.ssh_socket


def paramiko_socket(host: str, port: int) -> socket.socket:
    """The socket paramiko's own connect makes: no option set."""
    return socket.create_connection((host, port), timeout=connections.CONNECT_TIMEOUT)


def nodelay_socket(host: str, port: int) -> socket.socket:
    """Nagle's algorithm off, ACKs as the kernel delays them (torchrig before ssh_socket's
    ACKs at once)."""
    sock = paramiko_socket(host, port)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


SOCKETS = {"paramiko": paramiko_socket, "nodelay": nodelay_socket, "torchrig": TORCHRIG}


def ms(f) -> float:
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1000


def run(cxn, root: bool):
    """`true` as torchrig runs its commands (stdin fed, output read: the one read loop)."""
    if cxn.run_input("true", "", timeout=30, root=root).exited != 0:
        sys.exit("`true` failed on the host")


def one_round(host, inv, make_socket, commands: int) -> dict[str, float]:
    connections.ssh_socket = make_socket
    try:
        cxn = connections.connect(host, inv)
        row = {"handshake": ms(cxn.open)}
    finally:
        connections.ssh_socket = TORCHRIG
    try:
        row["first"] = ms(lambda: run(cxn, False))
        row["true"] = statistics.median(ms(lambda: run(cxn, False)) for _ in range(commands))
        row["true_root"] = statistics.median(ms(lambda: run(cxn, True)) for _ in range(commands))
    finally:
        cxn.close()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inventory")
    ap.add_argument("host")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--commands", type=int, default=5, help="`true`s per round and user")
    a = ap.parse_args()
    inv = load(a.inventory)
    host = next((h for h in inv.hosts if h.name == a.host), None)
    if host is None or host.is_local:
        sys.exit(f"{a.host}: not an SSH host of {a.inventory}")
    rows = {label: [] for label in SOCKETS}
    one_round(host, inv, TORCHRIG, 1)  # warm: imports, the host's sshd and sudo caches
    for _ in range(a.runs):
        for label, make in SOCKETS.items():  # in turn: all see the same machine load
            rows[label].append(one_round(host, inv, make, a.commands))
    result = {label: {k: round(statistics.median(r[k] for r in rs), 1) for k in rs[0]}
              for label, rs in rows.items()}
    result.update(host=a.host, runs=a.runs, commands=a.commands, unit="ms")
    OUT.mkdir(exist_ok=True)
    (OUT / "roundtrip.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'ms':12}" + "".join(f"{label:>10}" for label in SOCKETS))
    for k in rows["torchrig"][0]:
        print(f"{k:12}" + "".join(f"{result[label][k]:>10.1f}" for label in SOCKETS))

if __name__ == "__main__":
    main()
