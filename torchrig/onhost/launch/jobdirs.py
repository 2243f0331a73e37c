"""Runs ON THE NODE as root (python3 -I -, inside launch's install script): the job's folders
<root>/<job> (log and checkpoint), owned by the service user.
argv[1]: JSON {"user": U, "dirs": [[ROOT, JOB], ...], "home": PATH or null}: PATH, the
       service user's home (its parent root's), made the same way, 0700
   or: JSON {"remove": [[ROOT, JOB], ...]}: `torchrig jobs --prune --with-logs/--with-checkpoints`
       removes ROOT/JOB (ROOT reached as below, nothing created): a symlink or file in JOB's
       place is unlinked, never followed; a folder goes with shutil.rmtree through descriptors
       (Python 3.11's dir_fd: every level opened O_NOFOLLOW and checked to be the folder that
       was listed, so a job that swaps a folder for a symlink meanwhile makes it fail, not
       delete elsewhere). Prints one line per ROOT/JOB: "removed", "absent" or why not.

The rule: root creates things only in folders that nobody else can change. Every folder on the
way to ROOT is walked one name at a time (openat) and must be root-owned and not writable by
others (ROOT itself not by its group either; above it a group may write, as syslog does on
Ubuntu's /var/log); a symlink on the way is followed only if root owns it (it then lies in such a folder, so
root made it). ROOT/JOB is created in ROOT's descriptor; one that exists must be a real folder
(lstat), never followed. Refusals: one `error:` line, exit 3, nothing created for the job."""
import json
import os
import pwd
import stat
import sys

FIX = ("run `torchrig provision` on this host (it makes the log and checkpoint roots root-owned) "
       "or set the path var to a folder that root alone can write")


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(3)


def check(fd, shown, writers=0o022):
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & writers:
        fail(f"{shown} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}: "
             f"root creates job folders only where root alone can write; {FIX}")


def safe_dir(path, create=True):
    """An O_DIRECTORY descriptor of `path`, every folder on the way checked; missing folders
    are created (root-owned, 0755) in checked ones (create=False: FileNotFoundError)."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    check(fd, "/", 0o002)
    todo, shown, links = [c for c in path.split("/") if c], "", 0
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        shown = shown + "/" + name
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            if not create:
                os.close(fd)
                raise
            os.mkdir(name, 0o755, dir_fd=fd)
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if st.st_uid != 0 or links > 40:
                fail(f"{shown} is a symlink owned by uid {st.st_uid} (or a loop): not followed; {FIX}")
            target = os.readlink(name, dir_fd=fd)
            if target.startswith("/"):
                os.close(fd)
                fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
            todo = [c for c in target.split("/") if c] + todo
            continue
        if not stat.S_ISDIR(st.st_mode):
            fail(f"{shown} exists and is not a folder; {FIX}")
        nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        os.close(fd)
        fd = nfd
        check(fd, shown, 0o022 if not todo else 0o002)
    return fd


def shutil_safe():
    import shutil
    return getattr(shutil.rmtree, "avoids_symlink_attacks", False) and sys.version_info >= (3, 11)


def job_dir(root, job, uid, gid, mode=0o750, instead="choose another --job"):
    fd = safe_dir(root)
    try:
        os.mkdir(job, mode, dir_fd=fd)
    except FileExistsError:
        pass
    st = os.stat(job, dir_fd=fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a folder"
        fail(f"{root}/{job} exists and is {kind}: torchrig does not follow or replace it; "
             f"remove it (as root) or {instead}")
    jfd = os.open(job, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    os.fchown(jfd, uid, gid)
    os.fchmod(jfd, mode)
    os.close(jfd)
    os.close(fd)


def remove_job_dir(root, job):
    """ROOT/JOB gone, without following anything the job could have planted."""
    import shutil
    try:
        fd = safe_dir(root, create=False)
    except FileNotFoundError:
        return "absent"
    try:
        try:
            st = os.stat(job, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return "absent"
        if not stat.S_ISDIR(st.st_mode):  # a symlink (or anything else) in the folder's place
            os.unlink(job, dir_fd=fd)
            return "removed (it was not a folder: unlinked, not followed)"
        shutil.rmtree(job, dir_fd=fd)
        return "removed"
    finally:
        os.close(fd)


a = json.loads(sys.argv[1])
if "remove" in a:
    if not shutil_safe():
        fail("this python's shutil.rmtree is not safe against symlinks here: nothing removed")
    for root, job in a["remove"]:
        try:
            print(f"{root}/{job}: {remove_job_dir(root, job)}")
        except OSError as e:
            print(f"{root}/{job}: not removed: {e}")
    sys.exit(0)
try:
    pw = pwd.getpwnam(a["user"])
except KeyError:
    fail(f"no service user {a['user']!r} on this host: run `torchrig provision` first")
for root, job in a["dirs"]:
    job_dir(root, job, pw.pw_uid, pw.pw_gid)
if a.get("home"):
    job_dir(os.path.dirname(a["home"]), os.path.basename(a["home"]), pw.pw_uid, pw.pw_gid,
            0o700, "set var prefix elsewhere")
