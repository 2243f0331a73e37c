"""The cached Debian 12 base image every testbed host boots from (read-only overlay lower).

Built once with debootstrap from the mirror in the operator machine's own apt sources;
rebuilt only when RECIPE changes (its hash names the folder).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

from ..errors import TorchrigError
from .paths import CACHE

SUITE = "bookworm"
# What a minimal cloud image has: python3 without its venv module's pip (python3-venv) and no
# compiler, as on a fresh Ubuntu or Debian server; provision installs those (base_packages)
# from the testbed's Debian mirror (debmirror.py).
PACKAGES = [
    "systemd", "systemd-sysv", "dbus", "openssh-server", "sudo", "iproute2", "procps",
    "python3", "pciutils", "kmod", "ca-certificates", "gpg", "curl", "less",
]
RECIPE = {"suite": SUITE, "variant": "minbase", "include": PACKAGES, "post": 3}

SUDOERS = "admin ALL=(ALL) NOPASSWD:ALL\n"
SOURCES_NOTE = ("# torchrig testbed host: no Debian mirror is reachable from here.\n"
                "# Packages come from the repositories provision configures.\n")


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]


def base_path() -> Path:
    return CACHE / f"base-{recipe_hash()}"


def debian_mirror() -> str:
    """The first Debian mirror serving SUITE in this machine's apt sources (deb822 or list)."""
    files = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for f in files:
        for stanza in f.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.+)$", stanza, re.M))
            suites = fields.get("Suites", "").split()
            if SUITE in suites and "deb" in fields.get("Types", "").split():
                return fields["URIs"].split()[0]
    lists = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]
    for f in lists:
        if f.exists():
            for m in re.finditer(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", f.read_text(), re.M):
                if m.group(2) == SUITE:
                    return m.group(1)
    raise TorchrigError(f"no apt source for Debian {SUITE} found in /etc/apt: the testbed's "
                        "base image is built with debootstrap from that mirror")


def ensure_base(log=print) -> Path:
    """Return the cached base image, building it first if its recipe is new (~1-2 min)."""
    final = base_path()
    if (final / ".torchrig-complete").exists():
        return final
    for tool in ("debootstrap", "systemd-nspawn"):
        if not shutil.which(tool):
            raise TorchrigError(f"{tool} is not installed; run `make deps` (apt-get install "
                                "debootstrap systemd-container) as root")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"building the testbed base image {final} with debootstrap (once; ~1-2 min)")
    cmd = ["debootstrap", f"--variant={RECIPE['variant']}", "--include=" + ",".join(PACKAGES),
           SUITE, str(tmp), debian_mirror()]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TorchrigError("debootstrap failed:\n" + (r.stdout + r.stderr)[-2000:])
    _post(tmp)
    tmp.rename(final)
    (final / ".torchrig-complete").write_text(json.dumps(RECIPE) + "\n")
    used = in_use()
    for old in CACHE.glob("base-*"):
        if old != final and old.is_dir() and str(old) not in used:
            shutil.rmtree(old, ignore_errors=True)
    return final


def in_use(mounts: str | None = None) -> set[str]:
    """The base images an overlay mount stands on (another testbed on this machine, made
    before the recipe changed: removing its base would pull its hosts' files from under them)."""
    if mounts is None:
        mounts = Path("/proc/mounts").read_text()
    out = set()
    for line in mounts.splitlines():
        f = line.split()
        if len(f) >= 4 and f[2] == "overlay":
            for opt in f[3].split(","):
                if opt.startswith("lowerdir="):
                    out.update(opt.removeprefix("lowerdir=").split(":"))
    return out


def _post(root: Path) -> None:
    """Make it a cloud-image-like host: an `admin` sudoer, no shared identity."""
    subprocess.run(["chroot", str(root), "useradd", "-m", "-s", "/bin/bash", "admin"], check=True)
    sudoers = root / "etc/sudoers.d/90-admin"
    sudoers.write_text(SUDOERS)
    sudoers.chmod(0o440)
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()  # each host gets its own keys at first boot of its overlay
    (root / "etc/machine-id").write_text("")  # systemd makes a fresh one per host
    (root / "etc/apt/sources.list").write_text(SOURCES_NOTE)
    shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True)
