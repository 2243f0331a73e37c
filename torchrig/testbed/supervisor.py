"""Keeps one testbed host running: boots it with systemd-nspawn and boots it again when the
host reboots itself (`systemctl reboot` makes nspawn exit 133). SIGTERM halts the host cleanly
and ends the supervisor. Started detached by testbed.up:

    python -m torchrig.testbed.supervisor MACHINE ROOT NETNS_PATH
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

REBOOT_STATUS = 133  # systemd-nspawn's documented exit status when the container rebooted


def nspawn_argv(name: str, root: str, netns_path: str) -> list[str]:
    # --register=no/--keep-unit: the operator machine may have no systemd as PID 1.
    return ["systemd-nspawn", "--boot", f"--directory={root}", f"--machine={name}",
            "--register=no", "--keep-unit", f"--network-namespace-path={netns_path}",
            # a host's own firewall (provision's nftables table): nspawn grants CAP_NET_ADMIN
            # only with --private-network; the namespace is the host's own, as on a server
            "--capability=CAP_NET_ADMIN",
            "--console=read-only", "--quiet"]


CGROUP_FS = "/sys/fs/cgroup"


def cgroup_dirs(name: str) -> list[str]:
    """This host's own cgroup in each hierarchy that systemd uses: the unified one and, on a
    hybrid (v1) machine, name=systemd."""
    if os.path.exists(os.path.join(CGROUP_FS, "cgroup.controllers")):  # cgroup2 only
        roots = [CGROUP_FS]
    else:
        roots = [os.path.join(CGROUP_FS, h) for h in ("unified", "systemd")
                 if os.path.isdir(os.path.join(CGROUP_FS, h))]
    return [os.path.join(r, "torchrig-testbed", name) for r in roots]


def own_cgroup(name: str) -> None:
    """Move this process into the host's own cgroup before starting nspawn. Without a host
    systemd (--keep-unit), nspawn puts the container's tree at <its cgroup>/payload: started
    from one shared cgroup, every host's systemd would manage the same units' cgroups, and one
    host's reboot or `systemctl stop` would kill or break another's (status 219/CGROUP)."""
    for d in cgroup_dirs(name):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def main(name: str, root: str, netns_path: str) -> int:
    own_cgroup(name)
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
