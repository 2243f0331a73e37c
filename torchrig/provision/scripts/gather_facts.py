"""Runs ON THE TARGET HOST as root (python3 -c, one round trip): every fact provision needs,
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


def run(*argv, timeout=60):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout, r.stderr
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]}: timed out"


def read(path, limit=1 << 20):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


out["os_release"] = (read("/etc/os-release") or b"").decode(errors="replace")
out["arch"] = os.uname().machine
out["kernel"] = os.uname().release
out["euid"] = os.geteuid()
out["boot_id"] = (read("/proc/sys/kernel/random/boot_id") or b"").decode().strip()
st = os.statvfs("/")
out["disk_free_gb"] = round(st.f_bavail * st.f_frsize / 1e9, 1)
rc, o, _ = run("lspci", "-nn")
out["lspci"] = o if rc == 0 else None

# Secure Boot: mokutil if present, else the EFI variable (last byte 1 = enabled); no EFI = off.
rc, o, e = run("mokutil", "--sb-state")
if rc == 0 or "SecureBoot" in o + e:
    out["secure_boot"] = "enabled" in (o + e).lower() and "disabled" not in (o + e).lower()
else:
    sb = glob.glob("/sys/firmware/efi/efivars/SecureBoot-*")
    data = read(sb[0]) if sb else None
    out["secure_boot"] = bool(data and data[-1] == 1)

# Packages: version and state ("ii" = installed) of each, and which are held.
pk = {}
if want.get("packages"):
    rc, o, _ = run("dpkg-query", "-W", "-f=${Package}\t${Version}\t${db:Status-Abbrev}\n",
                   *want["packages"])
    for line in o.splitlines():
        parts = line.split("\t")
        # Status-Abbrev: desired (i=install, h=hold) then state (i=installed)
        if len(parts) == 3 and parts[2][1:2] == "i":
            pk[parts[0]] = parts[1]
out["packages"] = pk
rc, o, _ = run("apt-mark", "showhold")
out["held"] = sorted(o.split())
out["available"] = {}
for spec in want.get("available", []):
    name, _, ver = spec.partition("=")
    if pk.get(name) == ver:  # installed at that version: no need to ask apt
        continue
    rc, o, _ = run("apt-cache", "show", "--no-all-versions", f"{name}={ver}")
    out["available"][spec] = rc == 0 and bool(o.strip())

# dpkg left half-done by an interrupted install; who holds the dpkg lock right now.
rc, o, _ = run("dpkg", "--audit")
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
for u in want.get("units", []):
    _, en, _ = run("systemctl", "is-enabled", u)
    _, ac, _ = run("systemctl", "is-active", u)
    units[u] = {"enabled": en.strip() or "not-found", "active": ac.strip() or "unknown"}
out["units"] = units

rc, o, e = run("nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader")
out["nvidia_smi"] = {"rc": rc, "output": (o + e).strip()[-2000:]}

# The venv: Python version and installed distributions from their dist-info (no imports).
venv = want.get("venv")
pyver, dists = None, {}
if venv and os.path.exists(os.path.join(venv, "bin", "python")):
    cfg = (read(os.path.join(venv, "pyvenv.cfg")) or b"").decode()
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
