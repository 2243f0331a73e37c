"""Runs ON THE TARGET HOST as root before every apt-get/dpkg call: wait until nobody holds
the dpkg locks (unattended-upgrades often does for minutes after boot), naming the holder.
Exit 0 when free; 75 (EX_TEMPFAIL) with the holder's pid and command line after the timeout.

argv[1]: timeout in seconds.
"""
import os
import sys
import time

LOCKS = ["/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock", "/var/lib/apt/lists/lock",
         "/var/cache/apt/archives/lock"]


def holders():
    """(lock, pid, cmdline) for every lock file someone holds, from /proc/locks (no fuser)."""
    inodes = {}
    for path in LOCKS:
        try:
            s = os.stat(path)
            inodes[(os.major(s.st_dev), os.minor(s.st_dev), s.st_ino)] = path
        except OSError:
            pass
    found = []
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "->" in parts:  # a waiter, not a holder
                continue
            try:
                pid = int(parts[4])
                maj, mnr, ino = parts[5].split(":")
                key = (int(maj, 16), int(mnr, 16), int(ino))
            except (IndexError, ValueError):
                continue
            if key in inodes and pid != os.getpid():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        cmd = c.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    cmd = "?"
                found.append((inodes[key], pid, cmd))
    return found


def main(timeout):
    deadline = time.monotonic() + timeout
    told = False
    while True:
        h = holders()
        if not h:
            return 0
        lock, pid, cmd = h[0]
        if time.monotonic() >= deadline:
            print(f"dpkg lock {lock} still held after {timeout:.0f}s by pid {pid} ({cmd}); "
                  "wait for it to finish or stop it, then rerun provision", file=sys.stderr)
            return 75
        if not told:
            print(f"waiting for dpkg lock {lock} held by pid {pid} ({cmd}), up to {timeout:.0f}s",
                  file=sys.stderr)
            told = True
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1])))
