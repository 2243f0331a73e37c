"""Keeps one testbed host running: boots it with systemd-nspawn and boots it again when the
host reboots itself (`systemctl reboot` makes nspawn exit 133). SIGTERM halts the host cleanly
and ends the supervisor. Started detached by testbed.up:

    python -m torchrig.testbed.supervisor MACHINE ROOT NETNS_PATH
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

REBOOT_STATUS = 133  # systemd-nspawn's documented exit status when the container rebooted


def nspawn_argv(name: str, root: str, netns_path: str) -> list[str]:
    # --register=no/--keep-unit: the operator machine may have no systemd as PID 1.
    return ["systemd-nspawn", "--boot", f"--directory={root}", f"--machine={name}",
            "--register=no", "--keep-unit", f"--network-namespace-path={netns_path}",
            "--console=read-only", "--quiet"]


def main(name: str, root: str, netns_path: str) -> int:
    stopping = False
    child: subprocess.Popen | None = None

    def on_term(signum, frame):
        nonlocal stopping
        stopping = True
        if child and child.poll() is None:
            child.send_signal(signal.SIGTERM)  # nspawn: clean poweroff of the container

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while True:
        print(f"[supervisor] booting {name}", flush=True)
        child = subprocess.Popen(nspawn_argv(name, root, netns_path), stdin=subprocess.DEVNULL)
        rc = child.wait()
        print(f"[supervisor] {name} exited with status {rc}", flush=True)
        if stopping or rc != REBOOT_STATUS:
            return 0 if stopping else rc
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
