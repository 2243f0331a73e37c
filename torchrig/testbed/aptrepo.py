"""A stand-in for NVIDIA's CUDA apt repository, served to the testbed hosts.

Packages carry NVIDIA's real package names and versions so provision runs its real apt
commands against them, but every one is a TESTBED STAND-IN (says so in its description):
the "driver" (a metapackage on library and kernel-module packages, as NVIDIA builds it)
installs a stand-in nvidia-smi answering from the host's GPU profile, and a
boot-time unit that "loads the kernel module" (records the driver version in /run), so a
driver upgrade without a reboot gives the real "Driver/library version mismatch".
The repository is flat (like NVIDIA's .../repos/debian12/x86_64/) and signed with a
testbed-only key.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TorchrigError
from ..settings import DEFAULTS
from .paths import CACHE

STANDINS = Path(__file__).parent / "standins"
REPO_PATH = "cuda/repos/debian12/x86_64"   # NVIDIA's layout: <base>/<distro><ver>/<arch>/
KEYRING_NAME = "cuda-archive-keyring.gpg"

# The versions the product pins (torchrig/settings.py), so a default provision finds them here;
# plus an older build of the same driver branch (an upgrade path) and a newer one (what an
# operator's `apt-get upgrade` would move to, were the driver not pinned).
OLDER_DRIVER = "570.133.20"
NEWER_DRIVER = "570.195.03"
DRIVER_VERSIONS = (OLDER_DRIVER, DEFAULTS.driver_version, NEWER_DRIVER)
CUDA_VERSION = DEFAULTS.cuda_version
CUDA_FULL = DEFAULTS.cuda_package_version.rsplit("-", 1)[0]   # 12.8.93-1 -> 12.8.93
NCCL_DEB = DEFAULTS.nccl_version                               # 2.26.2-1+cuda12.8
NCCL_VERSION = NCCL_DEB.split("-", 1)[0]                       # 2.26.2
NEWER_NCCL_DEB = "2.27.3-1+cuda" + CUDA_VERSION                  # published beside the pinned one
STANDIN = "TESTBED STAND-IN, not NVIDIA software:"

MODULE_UNIT = """[Unit]
Description=torchrig testbed stand-in: load the NVIDIA kernel module (records its version)
DefaultDependencies=no
Before=sysinit.target nvidia-persistenced.service nvidia-fabricmanager.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'mkdir -p /run/nvidia-standin && cp /usr/share/nvidia-standin/kernel-module-version /run/nvidia-standin/module-version'

[Install]
WantedBy=sysinit.target
"""

def _standin_unit(description: str, start: str, stop: str) -> str:
    """A stand-in service: a oneshot that records it runs (a file under /run/nvidia-standin)."""
    return f"""[Unit]
Description={description}
After=nvidia-standin-module.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c '{start}'
ExecStop={stop}

[Install]
WantedBy=multi-user.target
"""


DCGM_UNIT = _standin_unit("NVIDIA DCGM host engine (torchrig testbed stand-in)",
                          "mkdir -p /run/nvidia-standin && touch /run/nvidia-standin/dcgm",
                          "/bin/rm -f /run/nvidia-standin/dcgm")
PERSISTENCED_UNIT = _standin_unit(
    "NVIDIA Persistence Daemon (torchrig testbed stand-in)",
    "test -f /run/nvidia-standin/module-version && touch /run/nvidia-standin/persistence",
    "/bin/rm -f /run/nvidia-standin/persistence")

FABRICMANAGER_UNIT = """[Unit]
Description=NVIDIA fabric manager service (torchrig testbed stand-in)
After=nvidia-standin-module.service

[Service]
Type=simple
ExecStart=/usr/bin/nv-fabricmanager

[Install]
WantedBy=multi-user.target
"""

# Like the real daemon: refuses to run unless the loaded driver is exactly its own version.
FABRICMANAGER = """#!/bin/sh
# torchrig TESTBED STAND-IN for nv-fabricmanager, not NVIDIA software.
mine=$(cat /usr/share/nvidia-standin/fabricmanager-version)
loaded=$(cat /run/nvidia-standin/module-version 2>/dev/null)
if [ -z "$loaded" ]; then echo "nv-fabricmanager: NVIDIA driver is not loaded" >&2; exit 1; fi
if [ "$loaded" != "$mine" ]; then
  echo "nv-fabricmanager: fabric manager version $mine does not match driver version $loaded" >&2
  exit 1
fi
if ! grep -q '"nvswitch": *true' /etc/torchrig-testbed/gpu-profile.json 2>/dev/null; then
  echo "nv-fabricmanager: no NVSwitch devices found" >&2; exit 1
fi
echo "nv-fabricmanager $mine: fabric initialised"
exec sleep infinity
"""

NVCC = """#!/bin/sh
# torchrig TESTBED STAND-IN for nvcc, not NVIDIA software.
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Cuda compilation tools, release {cuda}, V{full}"
"""

NCCL_H = """/* torchrig TESTBED STAND-IN for nccl.h: version macros only. */
#define NCCL_MAJOR {major}
#define NCCL_MINOR {minor}
#define NCCL_PATCH {patch}
#define NCCL_SUFFIX ""
"""


@dataclass
class Deb:
    name: str
    version: str
    summary: str
    files: dict[str, tuple[str | bytes, int]] = field(default_factory=dict)  # path: (data, mode)
    links: dict[str, str] = field(default_factory=dict)                      # path: target
    depends: str = ""
    conflicts: str = ""
    postinst: str = ""


def packages(keyring: bytes) -> list[Deb]:
    """The stand-in package set, as data. Structured like NVIDIA's repository: each driver
    metapackage depends on the versioned library and kernel-module packages with `>=`, so
    without a pin apt picks the newest build of the branch for them."""
    smi = (STANDINS / "nvidia-smi").read_text()
    debs: list[Deb] = []
    for v in DRIVER_VERSIONS:
        branch = v.split(".")[0]
        debs.append(Deb(
            "libnvidia-ml1", f"{v}-1", "NVIDIA Management Library (NVML) and nvidia-smi",
            files={
                "/usr/bin/nvidia-smi": (smi, 0o755),
                "/usr/share/nvidia-standin/driver-version": (v + "\n", 0o644),
                "/usr/share/nvidia-standin/cuda-version": (CUDA_VERSION + "\n", 0o644),
                "/lib/systemd/system/nvidia-persistenced.service": (PERSISTENCED_UNIT, 0o644),
            }))
        # open kernel modules (Turing and newer) or proprietary ones (e.g. V100): same stand-in
        for meta, kmod, other, summary in (
                ("nvidia-open", "nvidia-kernel-open-dkms", "nvidia-kernel-dkms",
                 "NVIDIA driver metapackage (open kernel modules)"),
                ("cuda-drivers", "nvidia-kernel-dkms", "nvidia-kernel-open-dkms",
                 "NVIDIA driver metapackage (proprietary modules)")):
            debs.append(Deb(meta, f"{v}-1", summary,
                            conflicts="nvidia-open" if meta == "cuda-drivers" else "cuda-drivers",
                            depends=f"libnvidia-ml1 (>= {v}), {kmod} (>= {v})"))
            debs.append(_kernel_module_deb(kmod, other, v))
        debs.append(Deb(
            f"nvidia-fabricmanager-{branch}", f"{v}-1", "NVIDIA fabric manager (NVSwitch)",
            files={
                "/usr/bin/nv-fabricmanager": (FABRICMANAGER, 0o755),
                "/usr/share/nvidia-standin/fabricmanager-version": (v + "\n", 0o644),
                "/lib/systemd/system/nvidia-fabricmanager.service": (FABRICMANAGER_UNIT, 0o644),
            }))
    debs.append(Deb(
        "datacenter-gpu-manager", DEFAULTS.dcgm_version, "NVIDIA DCGM (testbed stand-in dcgmi)",
        files={"/usr/bin/dcgmi": ((STANDINS / "dcgmi").read_text(), 0o755),
               "/lib/systemd/system/nvidia-dcgm.service": (DCGM_UNIT, 0o644)}))
    return debs + _cuda_nccl_keyring(keyring)


def _kernel_module_deb(name: str, other: str, v: str) -> Deb:
    return Deb(
            name, f"{v}-1", "NVIDIA kernel module", conflicts=other,
            files={
                "/usr/share/nvidia-standin/kernel-module-version": (v + "\n", 0o644),
                "/lib/systemd/system/nvidia-standin-module.service": (MODULE_UNIT, 0o644),
            },
            # Enabled for the next boot, not started: like a DKMS install, the new module
            # is only in use after a reboot.
            postinst="#!/bin/sh\nset -e\nsystemctl enable nvidia-standin-module.service "
                     ">/dev/null 2>&1 || true\n")


def _cuda_nccl_keyring(keyring: bytes) -> list[Deb]:
    debs: list[Deb] = []
    cuda_dir = f"/usr/local/cuda-{CUDA_VERSION}"
    minor = CUDA_VERSION.replace('.', '-')
    # like NVIDIA's: the toolkit metapackage depends on its components with `>=`
    debs.append(Deb(
        f"cuda-nvcc-{minor}", f"{CUDA_FULL}-1", "CUDA nvcc",
        files={f"{cuda_dir}/bin/nvcc": (NVCC.format(cuda=CUDA_VERSION, full=CUDA_FULL), 0o755)}))
    debs.append(Deb(
        f"cuda-toolkit-{minor}", f"{CUDA_FULL}-1", "CUDA toolkit",
        depends=f"cuda-nvcc-{minor} (>= {CUDA_FULL})",
        files={
            f"{cuda_dir}/version.json":
                (json.dumps({"cuda": {"name": "CUDA SDK", "version": CUDA_FULL}}), 0o644),
        },
        links={"/usr/local/cuda": f"cuda-{CUDA_VERSION}"}))
    for deb in (NCCL_DEB, NEWER_NCCL_DEB):
        debs += _nccl_debs(deb)
    debs.append(Deb(
        "cuda-keyring", "1.1-1", "GPG keyring for the CUDA repository",
        files={f"/usr/share/keyrings/{KEYRING_NAME}": (keyring, 0o644)}))
    return debs


def _nccl_debs(deb: str) -> list[Deb]:
    version = deb.split("-", 1)[0]
    major, minor, patch = version.split(".")
    lib = "/usr/lib/x86_64-linux-gnu"
    return [Deb("libnccl2", deb, "NVIDIA Collective Communication Library (NCCL) runtime",
                files={f"{lib}/libnccl.so.{version}": ("stand-in\n", 0o644)},
                links={f"{lib}/libnccl.so.2": f"libnccl.so.{version}"}),
            Deb("libnccl-dev", deb, "NCCL development files",
                files={"/usr/include/nccl.h":
                       (NCCL_H.format(major=major, minor=minor, patch=patch), 0o644)},
                links={f"{lib}/libnccl.so": f"libnccl.so.{version}"},
                depends=f"libnccl2 (= {deb})")]


def _control(d: Deb) -> str:
    lines = [f"Package: {d.name}", f"Version: {d.version}", "Architecture: "
             + ("all" if d.name == "cuda-keyring" else "amd64"),
             "Maintainer: torchrig testbed <testbed@torchrig.invalid>",
             f"Description: {STANDIN} {d.summary}",
             " Built by torchrig's testbed so provision can be tested without NVIDIA hardware."]
    if d.depends:
        lines.insert(3, f"Depends: {d.depends}")
    if d.conflicts:
        lines.insert(3, f"Conflicts: {d.conflicts}")
    return "\n".join(lines) + "\n"


def _build_deb(d: Deb, out: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "DEBIAN").mkdir()
        (root / "DEBIAN/control").write_text(_control(d))
        if d.postinst:
            (root / "DEBIAN/postinst").write_text(d.postinst)
            (root / "DEBIAN/postinst").chmod(0o755)
        for path, (data, mode) in d.files.items():
            p = root / path.lstrip("/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data if isinstance(data, bytes) else data.encode())
            p.chmod(mode)
        for path, target in d.links.items():
            p = root / path.lstrip("/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.symlink_to(target)
        arch = "all" if d.name == "cuda-keyring" else "amd64"
        deb = out / f"{d.name}_{d.version.replace(':', '%3a')}_{arch}.deb"
        _run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)])
    return deb


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, **kw)
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace") if isinstance(r.stderr, bytes) else r.stderr
        raise TorchrigError(f"{argv[0]} failed: {err.strip()[-800:]}")
    return r


def _gpg(home: Path, *args: str) -> subprocess.CompletedProcess:
    return _run(["gpg", "--homedir", str(home), "--batch", "--yes", *args])


def signing_key() -> tuple[Path, bytes]:
    """The testbed's own repository signing key (made once, kept in the cache)."""
    home = CACHE / "gnupg"
    if not (home / "pubring.kbx").exists() or not _gpg(home, "--list-secret-keys").stdout:
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True, mode=0o700)
        _gpg(home, "--passphrase", "", "--quick-gen-key",
             "torchrig testbed repository (TESTBED ONLY) <testbed@torchrig.invalid>",
             "ed25519", "sign", "never")
    return home, _gpg(home, "--export").stdout


def publish(flat: Path, home: Path, label: str) -> None:
    """Index the .debs in `flat` as a flat apt repository and sign it with the testbed key."""
    packages_txt = _run(["apt-ftparchive", "packages", "."], cwd=flat, text=True).stdout
    (flat / "Packages").write_text(packages_txt)
    _run(["gzip", "-kf9n", "Packages"], cwd=flat)
    release = _run(["apt-ftparchive", "-o", "APT::FTPArchive::Release::Origin=torchrig-testbed",
                    "-o", f"APT::FTPArchive::Release::Label={label}",
                    "release", "."], cwd=flat, text=True).stdout
    (flat / "Release").write_text(release)
    _gpg(home, "--clearsign", "-o", str(flat / "InRelease"), str(flat / "Release"))
    _gpg(home, "-abs", "-o", str(flat / "Release.gpg"), str(flat / "Release"))


def ensure_repo() -> Path:
    """Build (or reuse from the cache) the signed flat repository; returns its directory."""
    for tool in ("dpkg-deb", "apt-ftparchive", "gpg"):
        if not shutil.which(tool):
            raise TorchrigError(f"{tool} is not installed; run `make deps` as root")
    home, keyring = signing_key()
    debs = packages(keyring)
    recipe = hashlib.sha256(repr([(d.name, d.version, _control(d), sorted(d.files.items()),
                                   d.links, d.postinst, d.conflicts) for d in debs]).encode()).hexdigest()[:12]
    repo = CACHE / f"apt-{recipe}"
    if (repo / "InRelease").exists():
        return repo
    tmp = repo.with_name(repo.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for d in debs:
        _build_deb(d, tmp)
    publish(tmp, home, "TESTBED STAND-IN for NVIDIA CUDA")
    (tmp / KEYRING_NAME).write_bytes(keyring)
    shutil.rmtree(repo, ignore_errors=True)
    tmp.rename(repo)
    # Other recipes' repos stay: another testbed on this machine (another checkout) may be
    # serving one, and removing it broke that testbed's provision mid-run (seen: curl 404).
    return repo
