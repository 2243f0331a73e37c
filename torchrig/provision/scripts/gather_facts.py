"""Runs ON THE TARGET HOST as root (python3 -I -, one round trip): every fact provision needs,
as one JSON document on stdout. Standard library only; never imports torch.

argv[1]: JSON {"packages": [...], "files": [...], "secret_files": [...], "dirs": [...],
               "units": [...], "users": [...], "venv": PATH, "pip_pkgs": [...],
               "available": ["pkg=ver", ...], "paths": [...]}
"""
import glob
import grp
import hashlib
import json
import os
import pwd
import re
import subprocess
import sys

want = json.loads(sys.argv[1])
out = {}


class Cmd:
    """A command started now and collected later: every command of the gather runs at once,
    so the round trip costs the slowest one (nvidia-smi, apt-cache), not their sum."""

    def __init__(self, *argv):
        self.argv, self.done = argv, None
        try:
            self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, universal_newlines=True,
                                      errors="replace")  # output need not be UTF-8
        except OSError:
            self.p, self.done = None, (127, "", "%s: command not found" % argv[0])

    def result(self, timeout=60):
        """(exit status, stdout, stderr)"""
        if self.done is None:
            try:
                o, e = self.p.communicate(timeout=timeout)
                self.done = (self.p.returncode, o, e)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.communicate()
                self.done = (124, "", "%s: timed out" % self.argv[0])
        return self.done


def read(path, limit=1 << 20):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


UNITS = want.get("units", [])
AVAILABLE = want.get("available", [])
cmd = {
    "lspci": Cmd("lspci", "-nn"),
    "mokutil": Cmd("mokutil", "--sb-state"),
    "dpkg-query": Cmd("dpkg-query", "-W", "-f=${Package}\t${Version}\t${db:Status-Abbrev}\n",
                      *want["packages"]) if want.get("packages") else None,
    "holds": Cmd("apt-mark", "showhold"),
    # one apt-cache call for every pinned version (those it lacks are reported on stderr)
    "apt-cache": Cmd("apt-cache", "show", "--no-all-versions", *AVAILABLE) if AVAILABLE else None,
    "audit": Cmd("dpkg", "--audit"),
    "units": Cmd("systemctl", "show", "--property=LoadState,UnitFileState,ActiveState",
                 "--", *UNITS) if UNITS else None,
    "nvidia-smi": Cmd("nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"),
}

out["os_release"] = (read("/etc/os-release") or b"").decode(errors="replace")
out["arch"] = os.uname().machine
out["kernel"] = os.uname().release
out["euid"] = os.geteuid()
out["boot_id"] = (read("/proc/sys/kernel/random/boot_id") or b"").decode(errors="replace").strip()
st = os.statvfs("/")
out["disk_free_gb"] = round(st.f_bavail * st.f_frsize / 1e9, 1)
rc, o, _ = cmd["lspci"].result()
out["lspci"] = o if rc == 0 else None

# Secure Boot: mokutil if present, else the EFI variable (last byte 1 = enabled); no EFI = off.
rc, o, e = cmd["mokutil"].result()
if rc == 0 or "SecureBoot" in o + e:
    out["secure_boot"] = "enabled" in (o + e).lower() and "disabled" not in (o + e).lower()
else:
    sb = glob.glob("/sys/firmware/efi/efivars/SecureBoot-*")
    data = read(sb[0]) if sb else None
    out["secure_boot"] = bool(data and data[-1] == 1)

# Packages: version and state ("ii" = installed) of each, and which are held.
pk = {}
if want.get("packages"):
    rc, o, _ = cmd["dpkg-query"].result()
    for line in o.splitlines():
        parts = line.split("\t")
        # Status-Abbrev: desired (i=install, h=hold) then state (i=installed)
        if len(parts) == 3 and parts[2][1:2] == "i":
            pk[parts[0]] = parts[1]
out["packages"] = pk
rc, o, _ = cmd["holds"].result()
out["held"] = sorted(o.split())
shown = set()
if cmd["apt-cache"]:
    rc, o, _ = cmd["apt-cache"].result()
    for para in o.split("\n\n"):
        n = re.search(r"^Package: (\S+)$", para, re.M)
        v = re.search(r"^Version: (\S+)$", para, re.M)
        if n and v:
            shown.add(n.group(1) + "=" + v.group(1))
# installed at that version: available whatever apt says now
out["available"] = {spec: spec in shown for spec in AVAILABLE
                    if pk.get(spec.partition("=")[0]) != spec.partition("=")[2]}

# dpkg left half-done by an interrupted install; who holds the dpkg lock right now.
rc, o, _ = cmd["audit"].result()
out["dpkg_audit"] = o.strip()
out["dpkg_updates_pending"] = bool(glob.glob("/var/lib/dpkg/updates/[0-9]*"))


def stat(path, content):
    try:
        s = os.stat(path)
    except OSError:
        return None
    d = {"mode": s.st_mode & 0o7777, "is_dir": os.path.isdir(path),
         "owner": pwd.getpwuid(s.st_uid).pw_name if s.st_uid in [u.pw_uid for u in pwd.getpwall()] else str(s.st_uid),
         "group": grp.getgrgid(s.st_gid).gr_name if s.st_gid in [g.gr_gid for g in grp.getgrall()] else str(s.st_gid)}
    if not d["is_dir"]:
        data = read(path) or b""
        d["sha256"] = hashlib.sha256(data).hexdigest()
        if content:
            d["content"] = data.decode(errors="replace")
    return d


out["files"] = {p: stat(p, True) for p in want.get("files", [])}
out["files"].update({p: stat(p, False) for p in want.get("secret_files", [])})  # hash only
out["dirs"] = {p: stat(p, False) for p in want.get("dirs", [])}
out["paths"] = {p: os.path.exists(p) for p in want.get("paths", [])}
users = {}
for u in want.get("users", []):
    try:
        users[u] = {"uid": pwd.getpwnam(u).pw_uid, "shell": pwd.getpwnam(u).pw_shell}
    except KeyError:
        users[u] = None
out["users"] = users

units = {}
if cmd["units"]:
    # one block per unit, in argument order, blank-line separated
    _, o, _ = cmd["units"].result()
    blocks = [dict(ln.split("=", 1) for ln in b.splitlines() if "=" in ln) for b in o.split("\n\n")]
    for u, b in zip(UNITS, blocks + [{}] * len(UNITS)):
        found = b.get("LoadState", "not-found") not in ("not-found", "")
        units[u] = {"enabled": (b.get("UnitFileState") or "not-found") if found else "not-found",
                    "active": b.get("ActiveState") or "unknown"}
out["units"] = units

rc, o, e = cmd["nvidia-smi"].result()
out["nvidia_smi"] = {"rc": rc, "output": (o + e).strip()[-2000:]}

# The venv: Python version and installed distributions from their dist-info (no imports).
venv = want.get("venv")
pyver, dists = None, {}
if venv and os.path.exists(os.path.join(venv, "bin", "python")):
    cfg = (read(os.path.join(venv, "pyvenv.cfg")) or b"").decode(errors="replace")
    m = re.search(r"^version(?:_info)?\s*=\s*(\S+)", cfg, re.M)
    pyver = m.group(1) if m else "unknown"
    for meta in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "*.dist-info", "METADATA")):
        text = (read(meta, 4096) or b"").decode(errors="replace")
        n = re.search(r"^Name: (.+)$", text, re.M)
        v = re.search(r"^Version: (.+)$", text, re.M)
        if n and v:
            dists[re.sub(r"[-_.]+", "-", n.group(1).strip()).lower()] = v.group(1).strip()
out["venv"] = {"python": pyver, "dists": dists}

print(json.dumps(out))
