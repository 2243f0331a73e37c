"""pyinfra as the peer of a no-change provision (bench/provision_bench.py --peer): its own
venv (pinned, from the machine's configured package sources), a pyinfra inventory of the
same testbed hosts over the same SSH key and known_hosts, and per host the state torchrig's
provision manages there, captured once from the host (untimed) so pyinfra checks exactly
that: bench/peers/pyinfra_deploy.py."""

from __future__ import annotations

import base64
import json
import shlex
import subprocess
import sys
from pathlib import Path

PYINFRA = "pyinfra==3.10.0"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from torchrig import inventory  # noqa: E402
from torchrig.changes import managed  # noqa: E402
from torchrig.provision import steps  # noqa: E402
from torchrig.provision.apply import payload_requirements  # noqa: E402

# what the state capture runs on each host (as root): held packages with their versions,
# every file provision manages that is there (body, mode, owner), the units it enables
CAPTURE = r"""
import grp, json, os, pwd, stat, subprocess, sys, base64
paths, units, venv = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
held = subprocess.run(["apt-mark", "showhold"], capture_output=True, text=True).stdout.split()
q = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version}\n", *held],
                   capture_output=True, text=True).stdout
files = []
for p in paths:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        continue
    files.append({"path": p, "body": base64.b64encode(open(p, "rb").read()).decode(),
                  "mode": "%o" % stat.S_IMODE(st.st_mode), "owner": pwd.getpwuid(st.st_uid).pw_name,
                  "group": grp.getgrgid(st.st_gid).gr_name})
active = [u for u in units if subprocess.run(["systemctl", "is-active", "--quiet", u]).returncode == 0]
freeze = subprocess.run([venv + "/bin/pip", "freeze"], capture_output=True, text=True).stdout
print(json.dumps({"packages": dict(l.split(" ", 1) for l in q.splitlines()), "files": files,
                  "units": active, "pip": freeze.split()}))
"""
UNITS = ("nvidia-persistenced.service", "nvidia-fabricmanager.service",
         steps.NODE_EXPORTER_UNIT, "torchrig.firewall.service")


def venv(root: Path) -> Path:
    """root/bin/pyinfra, installed on first use."""
    exe = root / "bin" / "pyinfra"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        subprocess.run([str(root / "bin" / "pip"), "install", "-q", PYINFRA], check=True)
    return exe


def _ssh(h, known_hosts: str) -> list[str]:
    return ["ssh", "-i", h.identity_file, "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", "BatchMode=yes", "-p", str(h.port or 22), f"{h.user}@{h.address}"]


def _versions(freeze: list[str], names: list[str]) -> list[str]:
    """name==version as the venv has it (torch's local version, +cpu, included: pyinfra
    compares the string with `pip freeze`)."""
    have = dict(line.split("==", 1) for line in freeze if "==" in line)
    return [f"{n}=={have[n]}" for n in names]


def prepare(inv_path: str, work: Path) -> Path:
    """work/inventory.py: a pyinfra inventory of every host of torchrig's inventory, each
    with the state captured from it. Returns its path."""
    inv = inventory.load(inv_path)
    paths = [mf.path() for mf in managed.PROVISION_FILES]
    files_dir = work / "files"
    files_dir.mkdir(parents=True, exist_ok=True)
    hosts = []
    for h in inv.hosts:
        s = h.settings
        remote = "sudo python3 -c " + shlex.quote(CAPTURE) + " " + shlex.quote(json.dumps(paths)) \
            + " " + shlex.quote(json.dumps(list(UNITS))) + " " + shlex.quote(s.venv)
        got = json.loads(subprocess.run(_ssh(h, inv.known_hosts) + [remote], check=True,
                                        capture_output=True, text=True).stdout)
        for f in got["files"]:
            src = files_dir / h.name / f["path"].lstrip("/")
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_bytes(base64.b64decode(f.pop("body")))
            f["src"] = str(src)
        state = {"packages": got["packages"], "files": got["files"],
                 "absent": list(managed.PROVISION_ABSENT), "units": got["units"],
                 "user": s.service_user, "home": s.prefix, "venv": s.venv,
                 "dirs": [{"path": p, "mode": f"{m:o}", "owner": o} for p, m, o in steps.dirs(s)],
                 "torch": _versions(got["pip"], ["torch"])[0].split("==")[1],
                 "pip": _versions(got["pip"], payload_requirements())}
        hosts.append((h.name, {"ssh_hostname": h.address, "ssh_port": h.port or 22, "ssh_user": h.user,
                               "ssh_key": h.identity_file, "ssh_known_hosts_file": inv.known_hosts,
                               "ssh_strict_host_key_checking": "yes", "_sudo": True,
                               "state": state}))
    out = work / "inventory.py"
    out.write_text("hosts = " + repr(hosts) + "\n")
    return out


def argv(exe: Path, inv_py: Path, limit: str | None) -> list[str]:
    """A no-change run, all hosts in parallel (or those of `limit`), no prompt."""
    return [str(exe), "-y", *(["--limit", limit] if limit else []), str(inv_py),
            str(HERE / "pyinfra_deploy.py")]
