"""What provision installs beyond a host's Settings (torchrig/settings.py: the pinned versions,
folders and their defaults): package names by distro, the driver flavour, repository URLs."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

from ..settings import Settings

# Package names by distro, as data (NVIDIA's CUDA repo uses the same names on every
# distro of facts.os_release.DISTROS).
DRIVER_PACKAGE = {"open": "nvidia-open", "proprietary": "cuda-drivers"}
# `apt-mark hold` holds the named package only, and NVIDIA's metapackages depend on versioned
# packages with `>=`, so a held metapackage still lets `apt-get upgrade` move what it stands
# on. Every package of the driver carries the driver's own version: one apt preferences pin
# on that exact version, written before the install, makes apt install and keep exactly that
# build of each (NVIDIA's "version locking"). These globs name the driver's packages.
DRIVER_PIN_GLOBS = ("*nvidia*", "cuda-drivers*", "libcuda*", "libnvcuvid*", "libnvoptix*",
                    "libxnvctrl*")


def held_family(s: Settings) -> dict[str, tuple[str, ...]]:
    """The CUDA toolkit's and NCCL's packages (dpkg globs): their components each carry their
    own version, so provision holds every installed package these match, not just the one it
    names."""
    minor = s.cuda_version.replace(".", "-")
    return {"cuda": (f"*-{minor}", "cuda-toolkit-*config-common"), "nccl": ("libnccl*",)}


# GPU generations without open-kernel-module support (before Turing), by PCI chip name.
PRE_TURING_CHIPS = ("GV1", "GP1", "GM1", "GM2", "GK1", "GK2")


@dataclass(frozen=True)
class Credentialed:
    """A URL split into the URL without credentials (safe for a command line, a config file or
    a plan) and its credentials, percent-decoded (for a 0600 file or a process's environment)."""

    url: str
    host: str          # for a netrc/auth file `machine` line (no brackets, no port)
    login: str | None
    password: str | None


def split_credentials(url: str) -> Credentialed:
    parts = urlsplit(url)
    hostport = parts.netloc.rpartition("@")[2]  # keeps an IPv6 address's brackets and the port
    clean = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    dec = (lambda v: None if v is None else unquote(v))
    return Credentialed(clean, parts.hostname or "", dec(parts.username), dec(parts.password))


def repo_source(s: Settings, distro: str, arch: str) -> Credentialed:
    """The CUDA apt source: its credentials go to a 0600 apt auth file."""
    c = split_credentials(s.cuda_repo_url.rstrip("/"))
    return Credentialed(f"{c.url}/{distro}/{arch}/", c.host, c.login, c.password)


def driver_flavor(s: Settings, lspci: str | None) -> str:
    """Open kernel modules where every GPU supports them (Turing and newer)."""
    if s.driver_flavor != "auto":
        return s.driver_flavor
    names = [line for line in (lspci or "").splitlines() if "[10de:" in line]
    if any(chip in line for line in names for chip in PRE_TURING_CHIPS):
        return "proprietary"
    return "open"
