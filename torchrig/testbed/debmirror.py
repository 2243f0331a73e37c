"""Real Debian packages for the testbed hosts, served the way an air-gapped site mirror would.

The hosts have no route out. Software the product installs from the distribution (Slurm,
munge, ...) is downloaded once on the operator machine (Debian 12, like the hosts) with its
dependency closure, minus what the base image already has, then indexed and signed with the
testbed key as a flat repository at <testbed server>/debian/. Every host gets an apt source
for it at boot (testbed-side, like a site mirror); provision then just apt-installs by name
and version. These are the REAL Debian packages, unmodified (only the index is the testbed's).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

from ..errors import TorchrigError
from .aptrepo import _run, publish, signing_key
from .paths import CACHE, base_url

# The one list: Debian package names the product installs from the distribution.
PACKAGES = [
    "munge",                                   # Slurm's authentication, every host
    "slurmctld", "slurmd", "slurm-client",     # controller, compute daemons, s* commands
    "prometheus-node-exporter",                # provision's metrics exporter (var node_exporter)
    "nftables",                                # provision's job-port firewall (var firewall)
    "python3-venv", "python3-dev", "build-essential",  # provision's base packages
]
URL_PATH = "debian"           # served at <base_url>/debian/ (flat: Suites ./)
SOURCE_FILE = "etc/apt/sources.list.d/torchrig-testbed-debian.sources"
KEYRING_FILE = "etc/apt/keyrings/torchrig-testbed-debian.gpg"
# apt-cache depends prints these relations; only the ones apt needs to install count.
_NO_OPTIONAL = ["--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks",
                "--no-replaces", "--no-enhances"]


def closure_names(depends_output: str) -> list[str]:
    """Package names from `apt-cache depends --recurse` output: the unindented lines, less
    virtual packages (<name>; their providers are listed as packages of their own)."""
    return sorted({line.strip() for line in depends_output.splitlines()
                   if line and not line[0].isspace() and not line.startswith("<")})


def base_installed(base: Path) -> dict[str, str]:
    """{package: version} installed in the base image (read from its dpkg database)."""
    r = _run(["dpkg-query", f"--admindir={base / 'var/lib/dpkg'}", "-W",
              "-f", "${Package} ${db:Status-Abbrev} ${Version}\n"], text=True)
    return {f[0]: f[2] for f in (line.split() for line in r.stdout.splitlines())
            if len(f) > 2 and f[1].startswith("ii")}


def candidates(policy_output: str) -> dict[str, str]:
    """{package: the version apt would install} from `apt-cache policy NAME...` output."""
    out, name = {}, None
    for line in policy_output.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            name = line[:-1].split(":")[0]
        elif name and line.strip().startswith("Candidate:"):
            out[name] = line.split(":", 1)[1].strip()
    return out


def needed(packages: list[str], base: Path) -> list[str]:
    """The dependency closure of `packages` on this (operator) machine's apt, less what the
    base has at the version apt would fetch. A base package at another version stays in: a
    package of the closure may need exactly the newer one (python3.11-dev needs its
    python3.11), which the hosts' apt then takes from the mirror, as a server's would."""
    deps = _run(["apt-cache", "depends", "--recurse", *_NO_OPTIONAL, *packages], text=True)
    names = closure_names(deps.stdout)
    have = base_installed(base)
    want = candidates(_run(["apt-cache", "policy", *names], text=True).stdout)
    return sorted(n for n in names if n not in have or have[n] != want.get(n))


def mirror_path(base: Path) -> Path:
    key = json.dumps({"packages": sorted(PACKAGES), "base": base.name}, sort_keys=True)
    return CACHE / f"debian-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_mirror(base: Path, log=print) -> Path:
    """The signed flat repository of PACKAGES and their closure (cached, keyed by the list and
    the base image); downloads with this machine's apt the first time (~10 s)."""
    repo = mirror_path(base)
    if (repo / "InRelease").exists():
        return repo
    for tool in ("apt-get", "apt-cache", "apt-ftparchive", "gpg"):
        if not shutil.which(tool):
            raise TorchrigError(f"{tool} is not installed; the testbed's Debian mirror needs "
                                "a Debian operator machine with apt (run `make deps` as root)")
    names = needed(PACKAGES, base)
    log(f"testbed Debian mirror: downloading {len(names)} packages ({', '.join(PACKAGES)} "
        "and their dependencies) with this machine's apt")
    tmp = repo.with_name(repo.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    r = subprocess.run(["apt-get", "download", *names], cwd=tmp, capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TorchrigError("apt-get download failed for the testbed's Debian mirror (does this "
                            "machine's apt reach a Debian 12 mirror? try `apt-get update`):\n"
                            + r.stderr.strip()[-1500:])
    home, _ = signing_key()
    publish(tmp, home, "torchrig testbed mirror of Debian packages")
    (tmp / "packages.json").write_text(json.dumps({"requested": PACKAGES, "closure": names},
                                                  indent=1) + "\n")
    shutil.rmtree(repo, ignore_errors=True)
    tmp.rename(repo)
    # Old mirrors are not removed here: another testbed on this machine may be serving one.
    return repo


def source_stanza() -> str:
    """The hosts' apt source for the mirror (deb822, flat repository)."""
    return ("# torchrig TESTBED: this host's site mirror of Debian packages (real packages,\n"
            "# downloaded on the operator machine, index signed with the testbed key).\n"
            f"Types: deb\nURIs: {base_url()}/{URL_PATH}/\nSuites: ./\n"
            f"Signed-By: /{KEYRING_FILE}\n")


def configure_host(root: Path) -> None:
    """Give a host root its apt source and keyring for the mirror."""
    _, keyring = signing_key()
    (root / KEYRING_FILE).parent.mkdir(parents=True, exist_ok=True)
    (root / KEYRING_FILE).write_bytes(keyring)
    (root / KEYRING_FILE).chmod(0o644)
    (root / SOURCE_FILE).write_text(source_stanza())
