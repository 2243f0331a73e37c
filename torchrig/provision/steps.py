"""Provision's steps: each compares desired state (Settings) with the host's facts and returns
the changes it would make, [] when nothing must change. Pure: no SSH, no commands run here,
so an honest --dry-run and idempotency fall out of one code path."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..changes import managed
from ..changes.factview import Facts
from ..changes.model import AptInstall, Cmd, FileChange, b64
from ..errors import TorchrigError
from ..facts import netfilter, os_release, provision_facts, smi_query
from ..onhost import script
from ..quoting import sh
from ..settings import ETC_DIR
from . import firewall, slurm
from .desired import (DRIVER_PACKAGE, DRIVER_PIN_GLOBS, Credentialed, Settings,
                      driver_flavor, held_family, repo_source, split_credentials)

Change = Cmd | FileChange


def reads(*plain: str, **keyed) -> dict:
    """What a planner reads of the host: plain facts by name, and of keyed facts the keys,
    by the want key that asks for them (packages=[...], units=[...], files=[...], venv=path,
    node=True): facts/provision_facts.FACTS declares both. fact_request merges every
    planner's reads into the one probe request."""
    return {"facts": plain, **keyed}


def managed_files(*mfs: managed.ManagedFile, absent: tuple[str, ...] = ()) -> dict:
    """reads() of managed files (secret ones by hash only) and of paths that must not exist."""
    return {"files": [f.path() for f in mfs if not f.secret] + list(absent),
            "secret_files": [f.path() for f in mfs if f.secret]}


SOURCES_FILE = managed.CUDA_SOURCES.path()
AUTH_FILE = managed.CUDA_AUTH.path()
KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"
# Inside the step script's private temp folder (see apply.preamble), never a fixed /tmp path.
KEYRING_DEB = '"$TORCHRIG_TMP"/cuda-keyring.deb'
PIP_NETRC = '"$TORCHRIG_TMP"/pip-netrc'
PIP_REQUIREMENTS = '"$TORCHRIG_TMP"/requirements.txt'
NCCL_TARBALL = '"$TORCHRIG_TMP"/nccl-tests.tgz'


@dataclass
class Ctx:
    """Everything a planner reads: the host's facts (through accessors that refuse a fact
    the request did not ask for) and its desired settings, plus what earlier checks derived
    (distro, repo, whether the GPUs sit on an NVSwitch fabric)."""

    facts: Facts
    s: Settings
    host: str
    payload_requirements: list[str] = field(default_factory=list)
    address: str = ""   # the inventory's address of the host (its cluster address)
    cluster: slurm.Cluster | None = None   # the inventory's Slurm cluster, planned over all its hosts
    fleet: tuple[str, ...] = ()   # every inventory host's IP addresses (the firewall admits them)
    login: str | None = None      # the inventory's login user of the host
    ssh_port: int = 22

    # what the derived properties below read (distro, arch, GPUs on the PCI bus)
    READS = reads("os_release", "arch", "lspci")

    def __post_init__(self):
        if not isinstance(self.facts, Facts):  # the dict gather returned
            self.facts = Facts(self.facts, fact_request(self.s))

    @property
    def osr(self) -> os_release.OsRelease:
        return os_release.parse(self.facts["os_release"] or "")

    @property
    def distro(self) -> str | None:
        return os_release.supported(self.osr)

    @property
    def arch(self) -> str | None:
        return os_release.cuda_repo_arch(self.facts["arch"] or "")

    @property
    def repo(self) -> Credentialed:
        return repo_source(self.s, self.distro or "", self.arch or "")

    @property
    def nvidia_pci(self) -> list[str]:
        return [ln for ln in (self.facts["lspci"] or "").splitlines() if "[10de:" in ln]

    @property
    def gpu_lines(self) -> list[str]:
        return [ln for ln in self.nvidia_pci
                if "3D controller" in ln or "VGA compatible controller" in ln]

    @property
    def nvswitch(self) -> bool:
        return any("NVSwitch" in ln for ln in self.nvidia_pci)

    @property
    def driver_pkg(self) -> str:
        return DRIVER_PACKAGE[driver_flavor(self.s, self.facts["lspci"])]

    def pkg(self, name: str) -> str | None:
        return self.facts.pkg(name)

    def held(self, name: str) -> bool:
        return name in self.facts["held"]


def driver_state(facts) -> tuple[str, str]:
    """('ok', '') when the loaded driver answers; else a failure kind and what to do.
    `facts`: Facts, or a dict with the nvidia_smi fact."""
    smi = facts["nvidia_smi"] or {}
    if smi.get("rc") == 0:
        return "ok", ""
    f = smi_query.detect_failure(smi.get("output", ""), smi.get("rc"))
    return (f.kind, f.advice) if f else ("unknown", smi.get("output", ""))


# --- preflight: nothing is changed on a host that fails it ----------------------------------

PREFLIGHT_READS = reads("arch", "euid", "disk_free_gb", "lspci", "secure_boot",
                        packages=list(DRIVER_PACKAGE.values()))
# what the plan's walk and apply read besides the planners: whether the driver answers
# (driver_state, for needs_driver) and the boot id (to see a reboot happen)
WALK_READS = reads("nvidia_smi", "boot_id")


def preflight(c: Ctx) -> list[str]:
    """Problems that stop provision before it touches the host."""
    problems = []
    if c.distro not in os_release.DISTROS:
        problems.append(f"unsupported OS {c.osr.pretty_name or c.osr.id or 'unknown'!r} "
                        "(supported: Ubuntu 22.04, Ubuntu 24.04, Debian 12)")
    if c.arch is None:
        problems.append(f"unsupported architecture {c.facts['arch']!r} (x86_64 or aarch64)")
    if c.facts["euid"] != 0:
        problems.append("cannot become root: give the login user passwordless sudo")
    free = c.facts["disk_free_gb"] or 0
    if free < c.s.min_free_gb:
        problems.append(f"only {free} GB free on / (need {c.s.min_free_gb} GB; var min_free_gb)")
    if c.facts["lspci"] is None:
        problems.append("lspci not found: install pciutils so the GPUs can be checked")
    elif not c.gpu_lines:
        problems.append("no NVIDIA GPU on the PCI bus (lspci -nn shows no [10de:] 3D/VGA device)")
    installed_ok = c.pkg(c.driver_pkg) == c.s.driver_deb
    if c.facts["secure_boot"] and not installed_ok:
        problems.append("Secure Boot is enabled: the NVIDIA kernel modules built by DKMS are "
                        "unsigned and will not load. Disable Secure Boot in the firmware, or "
                        "enroll a MOK key for DKMS signing (mokutil --import), then rerun")
    return problems


# --- steps ----------------------------------------------------------------------------------

# The distribution's packages a bare Ubuntu or Debian server lacks that torchrig and a job
# need, not pinned (the distribution's own): python3-venv for `python3 -m venv` (ensurepip),
# build-essential (gcc, g++, make, libc headers) for nccl-tests' build and for torch.compile
# (Inductor builds C++ for the CPU, Triton its launcher at a job's first compiled step), and
# python3-dev for the Python.h both include.
BASE_PACKAGES = ("python3-venv", "python3-dev", "build-essential")


def base_packages(c: Ctx) -> list[Change]:
    missing = [p for p in BASE_PACKAGES if c.pkg(p) is None]
    if not missing:
        return []
    return [AptInstall(f"install the distribution's {', '.join(missing)} (venvs, compilers "
                       "and Python's headers for nccl-tests and torch.compile)",
                       "apt_get install --no-install-recommends " + sh(*missing), tuple(missing))]


def apt_recover(c: Ctx) -> list[Change]:
    if c.facts["dpkg_audit"] or c.facts["dpkg_updates_pending"]:
        return [Cmd("finish an interrupted dpkg run (dpkg --configure -a)",
                    "dpkg_run --configure -a\napt_get -f install")]
    return []


def _pinned(c: Ctx) -> dict[str, str]:
    """Every apt package provision pins, with its version."""
    s = c.s
    pins = {c.driver_pkg: s.driver_deb, s.cuda_pkg: s.cuda_package_version,
            "libnccl2": s.nccl_version, "libnccl-dev": s.nccl_version}
    if c.nvswitch:
        pins[s.fabricmanager_pkg] = s.driver_deb
    if node_exporter_skip(c) is None:
        pins[NODE_EXPORTER] = s.node_exporter_version
    if s.dcgm:
        pins[DCGM_PKG] = s.dcgm_version
    return pins | _slurm_pins(c)


def _all_pins(s: Settings) -> dict[str, str]:
    """Every package _pinned may pin on some host (it depends on the GPUs, the distro and
    the host's Slurm roles), with its version: what cuda_repo reads."""
    pins = {p: s.driver_deb for p in (*DRIVER_PACKAGE.values(), s.fabricmanager_pkg)}
    pins.update({s.cuda_pkg: s.cuda_package_version, "libnccl2": s.nccl_version,
                 "libnccl-dev": s.nccl_version, NODE_EXPORTER: s.node_exporter_version,
                 DCGM_PKG: s.dcgm_version})
    return pins | _slurm_versions(s)


def cuda_repo(c: Ctx) -> list[Change]:
    r = c.repo
    out: list[Change] = []
    if c.pkg("cuda-keyring") is None:
        netrc = f"--netrc-file {sh(AUTH_FILE)} " if r.login else ""
        if r.login:
            out += _auth_file(c)
        out.append(Cmd(f"install the repository signing key (cuda-keyring from {r.url})",
                       f"curl -fsSL --retry 3 {netrc}-o {KEYRING_DEB} {sh(r.url + 'cuda-keyring_1.1-1_all.deb')}\n"
                       f"dpkg_run -i {KEYRING_DEB}"))
    elif r.login:
        out += _auth_file(c)
    out += managed.CUDA_SOURCES.change(c.facts, distro=c.distro, arch=c.arch, url=r.url,
                                       keyring=KEYRING)
    # cuda-keyring's own one-line source duplicates ours (apt then warns or refuses).
    out += managed.absent(c.facts, managed.keyring_list(c.distro, c.arch))
    missing = [f"{p}={v}" for p, v in _pinned(c).items()
               if c.pkg(p) != v and not c.facts.available(f"{p}={v}")]
    if out or missing:
        why = "source changed" if out else "pinned versions not in the package lists: " + ", ".join(missing)
        out.append(Cmd(f"apt-get update ({why})", "apt_get update"))
    # The driver's pin here, before any install: every apt-get that resolves the driver's
    # packages (its install, and aptshare.py's download for the fleet) takes this build of
    # every package the metapackage needs.
    return out + managed.DRIVER_PIN.change(c.facts, globs=" ".join(DRIVER_PIN_GLOBS),
                                           version=c.s.driver_version)


def netrc(c: Credentialed, var: str) -> str:
    """A netrc entry (apt's auth.conf, curl --netrc-file and pip read this format, which
    splits on whitespace and has no quoting that all three share)."""
    if any(ch.isspace() for ch in (c.login or "") + (c.password or "")):
        raise TorchrigError(f"var {var!r}: credentials with whitespace cannot go into a netrc "
                            "file; use a token without spaces")
    return managed.CUDA_AUTH.render(host=c.host, login=c.login, password=c.password or "")


def _auth_file(c: Ctx) -> list[FileChange]:
    return managed.CUDA_AUTH.change(c.facts, netrc(c.repo, 'cuda_repo_url'))


# apt-get install's options for pinned packages (a held dependency may have to move)
APT_PINNED = "--no-install-recommends --allow-downgrades --allow-change-held-packages"


def _install(c: Ctx, pins: dict[str, str], what: str, family: tuple[str, ...] = ()) -> list[Change]:
    """apt-get install of the packages not at their pinned version, then hold them all, and
    every installed package matching `family` (dpkg globs: what the pinned metapackage stands
    on, which apt would otherwise upgrade under it)."""
    out: list[Change] = []
    todo = {p: v for p, v in pins.items() if c.pkg(p) != v}
    installed = c.facts.installed(family) if family else {}
    if todo:
        specs = [f"{p}={v}" for p, v in todo.items()]
        # held dependencies first released: apt never moves a held package to satisfy another
        unhold = [p for p in installed if c.held(p)]
        out.append(AptInstall(f"install {what}: {', '.join(specs)}",
                              ("apt-mark unhold " + sh(*unhold) + " >/dev/null\n" if unhold else "")
                              + f"apt_get install {APT_PINNED} " + sh(*specs), tuple(specs)))
    unheld = [p for p in pins if not c.held(p)] + [p for p in installed
                                                   if p not in pins and not c.held(p)]
    if todo and family:
        # what the install brought in is known only once it ran: the globs resolve there
        out.append(Cmd(f"hold {', '.join(pins)} and every installed package matching "
                       f"{' '.join(family)} (no upgrade behind provision's back)",
                       "apt-mark hold " + sh(*pins) + " $(" + dpkg_installed(family) + ")"))
    elif unheld:
        out.append(Cmd(f"hold {', '.join(unheld)} (no upgrade behind provision's back)",
                       "apt-mark hold " + sh(*unheld)))
    return out


def dpkg_installed(globs: tuple[str, ...]) -> str:
    """Shell: the names of the installed packages matching these dpkg globs, one a line."""
    return ("dpkg-query -W -f '${db:Status-Abbrev} ${Package}\\n' " + sh(*globs)
            + " 2>/dev/null | awk '$1 ~ /^.i/ {print $2}'")


def _unit_enabled(c: Ctx, unit: str) -> list[Change]:
    state = c.facts.unit(unit).get("enabled")
    if state == "enabled":
        return []
    return [Cmd(f"enable {unit}", "systemctl enable " + sh(unit))]


def driver(c: Ctx) -> list[Change]:
    s = c.s
    out: list[Change] = []
    bl = managed.NOUVEAU_BLACKLIST.change(c.facts)
    out += bl
    if bl:
        out.append(Cmd("rebuild the initramfs without nouveau",
                       "if command -v update-initramfs >/dev/null; then update-initramfs -u; fi"))
    pins = {c.driver_pkg: s.driver_deb}
    if c.nvswitch:
        pins[s.fabricmanager_pkg] = s.driver_deb
    out += _install(c, pins, f"NVIDIA driver {s.driver_version} ({c.driver_pkg})")
    out += managed.UNATTENDED_HOLD.change(c.facts)
    out += _unit_enabled(c, "nvidia-persistenced.service")
    if c.nvswitch:
        out += _unit_enabled(c, "nvidia-fabricmanager.service")
    return out


def driver_services(c: Ctx) -> list[Change]:
    """Needs the driver loaded: persistence daemon, and the fabric manager on NVSwitch boxes
    (without it CUDA init fails with error 802 while nvidia-smi looks fine)."""
    units = ["nvidia-persistenced.service"] + (["nvidia-fabricmanager.service"] if c.nvswitch else [])
    out: list[Change] = []
    for u in units:
        if c.facts.unit(u).get("active") != "active":
            out.append(Cmd(f"start {u}", "systemctl start " + sh(u)))
    return out


def cuda_toolkit(c: Ctx) -> list[Change]:
    s = c.s
    out = _install(c, {s.cuda_pkg: s.cuda_package_version}, f"CUDA toolkit {s.cuda_version}",
                   held_family(s)["cuda"])
    out += managed.CUDA_ENV.change(c.facts, cuda_version=s.cuda_version, cuda_home=s.cuda_home,
                                   venv=s.venv)
    return out


def nccl(c: Ctx) -> list[Change]:
    s = c.s
    v = s.nccl_version
    return _install(c, {"libnccl2": v, "libnccl-dev": v}, f"NCCL {v}", held_family(s)["nccl"])


def python_venv(c: Ctx) -> list[Change]:
    s = c.s
    venv = c.facts.venv(s.venv)
    out: list[Change] = []
    if not venv.get("python"):
        out.append(Cmd(f"create the venv {s.venv}", sh("python3", "-m", "venv", s.venv)))
    dists = venv.get("dists", {})
    reqs = [f"torch=={s.torch_version}"] + c.payload_requirements + list(s.extra_pip_packages)
    missing = [r for r in reqs if not _satisfied(r, dists)]
    if any(ch in r for r in missing for ch in "\r\n\0"):
        raise TorchrigError("var 'extra_pip_packages': an entry holds a line break; "
                            "give one requirement per entry")
    if any(re.search(r"(^|\s|@)git\+[a-z]+://[^/\s]*@", r) for r in missing):
        raise TorchrigError("var 'extra_pip_packages': a git+ URL with credentials would "
                            "reach git's command line (pip runs `git clone URL`); use a wheel "
                            "URL or an index (pip_index_url) for private packages")
    if missing:
        out.append(_pip_install(s, missing, s.pip_index_url, "pip_index_url"))
    # TensorBoard only when asked, from its own index: the torch index need not carry it
    tb = f"tensorboard=={s.tensorboard_version}"
    if s.tensorboard and not _satisfied(tb, dists):
        out.append(_pip_install(s, [tb], s.tensorboard_index_url, "tensorboard_index_url"))
    return out


@dataclass(frozen=True)
class PipInstall(Cmd):
    """python-venv's pip install, with what it installs from where: provision/wheelshare.py
    may fetch these wheels once for the fleet and swap in `from_wheels`."""
    reqs: tuple[str, ...] = ()
    index_url: str | None = None
    var: str = ""


def _pip(s: Settings, pip: str, verb: list[str], reqs: list[str], index_url: str | None,
         var: str) -> str:
    """`pip` (shell text) `verb` (its arguments) over `reqs` from `index_url` (None: the
    node's pip configuration), as a root script snippet."""
    args = [verb[0], "--quiet", "--disable-pip-version-check", *verb[1:]]
    index = split_credentials(index_url) if index_url else None
    if index is not None:
        args += ["--index-url", index.url]
    if s.pip_trusted_host:
        args += ["--trusted-host", s.pip_trusted_host]
    pip = f"{pip} {sh(*args)} -r {PIP_REQUIREMENTS}"
    if index is not None and index.login is not None:
        # credentials from a 0600 netrc file, not the URL: pip passes its index URL on
        # to the pip it runs for build dependencies, in that process's command line
        pip = (f"(umask 077; printf %s {sh(b64(netrc(index, var)))} | base64 -d > {PIP_NETRC})\n"
               f"NETRC={PIP_NETRC} {pip}")
    return _requirements(reqs) + pip


def _requirements(lines: list[str]) -> str:
    # the requirements in a file, not argv: one may be a URL with credentials
    # (`pkg @ https://user:token@host/pkg.whl`)
    return (f"printf %s {sh(b64(''.join(r + chr(10) for r in lines)))} | base64 -d "
            f"> {PIP_REQUIREMENTS}\n")


def _pip_install(s: Settings, reqs: list[str], index_url: str | None, var: str) -> PipInstall:
    """pip install `reqs` into the venv from `index_url` (None: the node's pip configuration)."""
    return PipInstall(f"pip install {' '.join(reqs)} into {s.venv}",
                      _pip(s, sh(f"{s.venv}/bin/pip"), ["install"], reqs, index_url, var),
                      tuple(reqs), index_url, var)


WHEELS_TMP_VENV = '"$TORCHRIG_TMP"/pip'


def download_dir(s: Settings) -> str:
    """Where `pip download` and aptshare's `apt-get --download-only` write in root's cache
    (onhost/data/node.py's `adopt` takes the files from there into the cache's store)."""
    return f"{s.wheel_cache_dir}/.torchrig/download"


def pip_download(s: Settings, p: PipInstall) -> str:
    """The root script that downloads `p`'s wheels (binary only: no package's build runs) and
    their dependencies into root's wheel cache, with the index and credentials `p` uses. pip
    comes from a throwaway venv (the seed's base-packages step ran: wheelshare.Meet): the host's
    own venv is made by its python-venv step."""
    dest = download_dir(s)
    return (f"python3 -m venv {WHEELS_TMP_VENV}\n"
            f"rm -rf -- {sh(dest)} && mkdir -m 0700 -- {sh(dest)}\n"
            + _pip(s, f"{WHEELS_TMP_VENV}/bin/pip", ["download", "--only-binary=:all:", "--dest", dest],
                   list(p.reqs), p.index_url, p.var))


def apt_download(s: Settings, installs: list[list[str]]) -> str:
    """The root script that downloads the .debs each `apt-get install specs` of `installs`
    would (apt checks each against its signed index) into root's cache, not apt's own: nothing
    is installed and the host's apt cache is left alone; a .deb an earlier one brought is
    there already. Run where the host's apt is configured as its installs will find it (after
    cuda-repo: the sources, the driver's pin, apt-get update)."""
    dest = download_dir(s)
    return (f"rm -rf -- {sh(dest)} && mkdir -m 0700 -- {sh(dest)} && mkdir -- {sh(dest + '/partial')}\n"
            + "".join(f"apt_get install --download-only {APT_PINNED} "
                      f"-o Dir::Cache::Archives={sh(dest + '/')} " + sh(*specs) + "\n"
                      for specs in installs)
            # what adopt takes is the .debs alone
            + f"rm -rf -- {sh(dest + '/partial')} {sh(dest + '/lock')}\n")


APT_ARCHIVES = "/var/cache/apt/archives"   # where apt-get install looks for a .deb first


def apt_uris(specs: list[str]) -> str:
    """The root script that prints, from the host's own signed index, each .deb `apt-get
    install specs` would download: `'URI' FILE SIZE SHA256:HEX` lines (aptshare.parse_uris;
    without ForceHash apt 2.6 prints the MD5 sum)."""
    return (f"apt_get install --print-uris -qq -o Acquire::ForceHash=SHA256 {APT_PINNED} "
            + sh(*specs) + "\n")


def place_debs(folder: str, names: list[str], archives: str = APT_ARCHIVES) -> str:
    """The root script that puts these .debs of root's cache `folder` into apt's cache, as a
    hard link where both are on one filesystem, else a copy (apt takes a .deb of the right size
    found there without downloading it: aptshare matched each to the host's index first)."""
    return (f"cd -- {sh(folder)}\nfor f in {sh(*names)}; do\n"
            f"  ln -f -- \"$f\" {sh(archives)}/ 2>/dev/null || cp -f -- \"$f\" {sh(archives)}/\n"
            "done\n")


def from_wheels(s: Settings, p: PipInstall, folder: str, pins: list[str], source: str) -> Cmd:
    """`p` from the wheels in root's `folder`, each pinned with its sha256 (pins: `name==ver
    --hash=sha256:...` lines, pip refuses any other file); if that install fails, `p` itself
    from the index, as without a shared download."""
    pip = sh(f"{s.venv}/bin/pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-index", "--find-links", folder, "--require-hashes") + f" -r {PIP_REQUIREMENTS}"
    return Cmd(f"{p.summary} (wheels from {source}, sha256-checked)",
               _requirements(pins) + f"{pip} || {{\necho 'the shared wheels did not install: "
               f"installing from the index' >&2\n{p.script}\n}}")


def _satisfied(req: str, dists: dict[str, str]) -> bool:
    name, _, ver = req.partition("==")
    have = dists.get(name.strip().lower().replace("_", "-"))
    if have is None:
        return False
    return not ver or have.split("+")[0] == ver.strip().split("+")[0]


def nccl_tests_binary(s: Settings) -> str:
    return f"{s.prefix}/nccl-tests/build/all_reduce_perf"


def nccl_tests(c: Ctx) -> list[Change]:
    s = c.s
    binary = nccl_tests_binary(s)
    if c.facts.path_exists(binary):
        return []
    dest = sh(s.prefix + "/nccl-tests")
    build = (f"make -C {dest} -j\"$(nproc)\" MPI=0 "
             f"CUDA_HOME={sh(s.cuda_home)} NCCL_HOME=/usr")
    if is_tarball(s.nccl_tests_source):
        fetch = (f"rm -rf {dest} && mkdir -p {dest}\n"
                 f"tar -xzf {NCCL_TARBALL} --strip-components=1 -C {dest}")
        return [Cmd(f"build nccl-tests from {s.nccl_tests_source} (pushed from the operator)",
                    fetch + "\n" + build)]
    src = split_credentials(s.nccl_tests_source)
    git = ["git"]
    if src.login is not None:
        # git asks this helper (its command line names only variables); the clone's config
        # keeps the URL without credentials. The empty value first drops any configured helper
        # (one that stores credentials would write them to disk).
        git += ["-c", "credential.helper=", "-c", "credential.helper=" + GIT_CREDENTIALS]
    creds = (f"TORCHRIG_GIT_USER={sh(src.login)} TORCHRIG_GIT_PASSWORD={sh(src.password or '')} "
             if src.login is not None else "")  # in git's environment (root's), not its argv
    fetch = (f"rm -rf {dest}\n" + creds + "GIT_TERMINAL_PROMPT=0 "
             + sh(*git, "clone", "--quiet", "--depth", "1", "--branch", s.nccl_tests_version,
                  src.url) + f" {dest}")
    return [Cmd(f"build nccl-tests {s.nccl_tests_version} from {src.url}", fetch + "\n" + build)]


GIT_CREDENTIALS = ('!f() { test "$1" = get && printf "username=%s\\npassword=%s\\n" '
                   '"$TORCHRIG_GIT_USER" "$TORCHRIG_GIT_PASSWORD"; }; f')


def is_tarball(source: str) -> bool:
    return source.endswith((".tar.gz", ".tgz"))


def service_user(c: Ctx) -> list[Change]:
    s = c.s
    out: list[Change] = []
    if not c.facts.user(s.service_user):
        out.append(Cmd(f"create the service user {s.service_user}",
                       sh("useradd", "--system", "--user-group", "--home-dir", s.service_home,
                          "--no-create-home", "--shell", "/usr/sbin/nologin", s.service_user)))
    for path, mode, owner in dirs(s):
        cur = c.facts.dir(path)
        if not cur or cur.get("mode") != mode or cur.get("owner") != owner or cur.get("group") != owner:
            out.append(Cmd(f"directory {path} ({mode:04o} {owner}:{owner})",
                           f"install -d -m {mode:04o} -o {sh(owner)} -g {sh(owner)} {sh(path)}"))
    return out


NODE_EXPORTER = "prometheus-node-exporter"   # Debian's and Ubuntu's package and unit
NODE_EXPORTER_UNIT = f"{NODE_EXPORTER}.service"
NODE_EXPORTER_PIN_DISTRO = "debian12"        # whose package version settings.py pins
def node_exporter(c: Ctx) -> list[Change]:
    """Debian's node_exporter, pinned and held, on the cluster address (var
    node_exporter_address; never every interface by default) with torchrig's textfile folder.
    The config goes first: dpkg keeps it (--force-confold), so the package's own start of the
    service already listens where it should, never on 0.0.0.0."""
    s = c.s
    listen = s.node_exporter_listen(c.address or c.host)
    cfg = managed.NODE_EXPORTER_ARGS.change(c.facts, listen=listen, textfile_dir=s.metrics_dir)
    out: list[Change] = list(cfg)
    installed = c.pkg(NODE_EXPORTER) is not None
    out += _install(c, {NODE_EXPORTER: s.node_exporter_version},
                    f"prometheus-node-exporter {s.node_exporter_version}")
    unit = c.facts.unit(NODE_EXPORTER_UNIT)
    if unit.get("enabled") != "enabled":
        out.append(Cmd(f"enable {NODE_EXPORTER_UNIT}", "systemctl enable " + sh(NODE_EXPORTER_UNIT)))
    if (cfg and installed) or unit.get("active") != "active":
        why = "its config changed" if cfg and installed else "not running"
        out.append(Cmd(f"restart {NODE_EXPORTER_UNIT} ({why}) and check it answers on {listen}",
                       "systemctl restart " + sh(NODE_EXPORTER_UNIT) + "\n"
                       + script("provision/node_exporter_check.sh",
                                url=f"http://{listen}/metrics", unit=NODE_EXPORTER_UNIT
                                ).rstrip("\n")))
    return out


def node_exporter_skip(c: Ctx) -> str | None:
    """Why the node-exporter step is skipped, or None. The default pin is Debian 12's package
    version: on another distribution the inventory names that distribution's own."""
    if not c.s.node_exporter:
        return "disabled (var node_exporter: false)"
    if c.distro != NODE_EXPORTER_PIN_DISTRO and "node_exporter_version" not in c.s.model_fields_set:
        return (f"var node_exporter_version: the default {c.s.node_exporter_version} is Debian "
                f"12's; set {c.distro}'s (`apt-cache policy {NODE_EXPORTER}` on the host), or "
                "node_exporter: false")
    return None


def dirs(s: Settings) -> list[tuple[str, int, str]]:
    """The log and checkpoint roots are root's: launch creates each job's folder in them as
    root, which is safe only where the job cannot rename or replace what it is given (a
    service-user root let a job swap its folder for a symlink and get anything chowned to it).
    The data folder stays the service user's: jobs write there and root creates nothing in it."""
    u = s.service_user
    out = [(s.prefix, 0o755, "root"), (ETC_DIR, 0o755, "root"),
           (s.data_dir, 0o750, u), (s.checkpoint_dir, 0o755, "root"), (s.log_dir, 0o755, "root")]
    if s.node_exporter:  # the jobs' samplers write here as the service user; node_exporter reads
        out.append((s.metrics_dir, 0o755, u))
    return out


# --- Slurm (inventory `slurm:`) ------------------------------------------------------------------

SLURM_UNITS = {"controller": "slurmctld.service", "compute": "slurmd.service"}
MUNGE_UNIT = "munge.service"


SLURM_DAEMONS = {"slurmctld": "controller", "slurmd": "compute"}   # package: the role it serves
# what the cluster's plan (provision/slurm.py) reads of every host of the cluster
SLURM_CLUSTER_READS = reads("nvidia_smi", node=True, **managed_files(managed.MUNGE_KEY))


def _slurm_versions(s: Settings) -> dict[str, str]:
    return {"munge": s.munge_version, "slurm-client": s.slurm_version,
            **{p: s.slurm_version for p in SLURM_DAEMONS}}


def _slurm_pins(c: Ctx) -> dict[str, str]:
    """munge and the Slurm client everywhere in the cluster, each daemon where it runs."""
    roles = c.cluster.roles(c.host) if c.cluster else set()
    if not roles:
        return {}
    return {p: v for p, v in _slurm_versions(c.s).items()
            if p not in SLURM_DAEMONS or SLURM_DAEMONS[p] in roles}


def _in_cluster(c: Ctx) -> str | None:
    if c.cluster is None:
        return "no slurm: cluster in the inventory"
    if not c.cluster.roles(c.host):
        return "not a host of the inventory's slurm: cluster"
    return None


def _cluster_ready(c: Ctx) -> str | None:
    return _in_cluster(c) or (f"Slurm waits: {c.cluster.blocked}" if c.cluster.blocked else None)


def slurm_packages(c: Ctx) -> list[Change]:
    if _in_cluster(c):
        return []
    return _install(c, _slurm_pins(c), f"Slurm {c.s.slurm_version} and munge {c.s.munge_version}")


def _restart(unit: str, why: str) -> Cmd:
    return Cmd(f"restart {unit} ({why})", f"systemctl enable --quiet {sh(unit)}\n"
                                         f"systemctl restart {sh(unit)}")


def munge(c: Ctx) -> list[Change]:
    """The cluster's one key (new: written to every host, munged restarted), munged running."""
    if _in_cluster(c) or c.cluster.missing:
        return []
    key = c.cluster.munge_key
    out: list[Change] = managed.MUNGE_KEY.change(c.facts, key=key) if key else []
    u = c.facts.unit(MUNGE_UNIT)
    if out:
        out.append(_restart(MUNGE_UNIT, "new cluster key"))
    elif u.get("active") != "active" or u.get("enabled") != "enabled":
        out.append(_restart(MUNGE_UNIT, "not running"))
    return out


def slurm_config(c: Ctx) -> list[Change]:
    """Slurm's state and log folders, its configs, and each daemon restarted only when its
    config changed in a way `scontrol reconfigure` does not apply (partitions alone)."""
    if _cluster_ready(c):
        return []
    cl, roles = c.cluster, c.cluster.roles(c.host)
    out: list[Change] = []
    for path, mode in ((slurm.LOG_DIR, 0o755), *([(slurm.STATE_DIR, 0o700)] if "controller" in roles else [])):
        cur = c.facts.dir(path)
        if not cur or cur.get("mode") != mode or cur.get("owner") != "slurm" or cur.get("group") != "slurm":
            out.append(Cmd(f"directory {path} ({mode:04o} slurm:slurm)",
                           f"install -d -m {mode:04o} -o slurm -g slurm {sh(path)}"))
    conf = managed.SLURM_CONF
    conf_change = conf.change(c.facts, cl.files[conf.template])
    others: list[FileChange] = []
    for f in (managed.GRES_CONF, managed.CGROUP_CONF):
        body = cl.files.get(f.template)
        others += f.change(c.facts, body) if body is not None else managed.absent(c.facts, f.path())
    out += conf_change + others
    old = (c.facts.file(conf.path()) or {}).get("content")
    restart = bool(others) or (bool(conf_change) and not slurm.reconfigure_only(old, cl.files[conf.template]))
    for role in sorted(roles):
        unit = SLURM_UNITS[role]
        u = c.facts.unit(unit)
        if restart:
            out.append(_restart(unit, "its config changed"))
        elif u.get("active") != "active" or u.get("enabled") != "enabled":
            out.append(_restart(unit, "not running"))
        elif conf_change and role == "controller":
            out.append(Cmd("scontrol reconfigure (partitions changed)", "scontrol reconfigure"))
    return out


@dataclass(frozen=True)
class Upload:
    """A file on the operator's machine a step's script needs on the host: it travels inside
    the root script (stdin) into the script's private folder, at `dest`."""
    local: str
    dest: str
    var: str      # the var that names it, for the error when it cannot be read


@dataclass(frozen=True)
class Step:
    name: str
    plan: Callable[[Ctx], list[Change]]
    needs_driver: bool = False     # runs only once the driver is loaded (else: reboot first)
    reprobes_driver: bool = False  # once this step changed something, ask nvidia-smi again
    upload: Callable[[Settings], Upload | None] = lambda s: None
    enabled: Callable[[Ctx], str | None] = lambda c: None  # a reason to skip, or None
    reads: Callable[[Settings], dict] = lambda s: {}       # what `plan` reads: see reads()


DCGM_PKG = "datacenter-gpu-manager"  # NVIDIA's DCGM 3.x package in the CUDA repository
DCGM_UNIT = "nvidia-dcgm.service"    # its host engine (nv-hostengine), which dcgmi talks to


def dcgm(c: Ctx) -> list[Change]:
    """var dcgm: DCGM pinned and held, its host engine enabled and running."""
    out = _install(c, {DCGM_PKG: c.s.dcgm_version}, f"NVIDIA DCGM {c.s.dcgm_version}")
    unit = c.facts.unit(DCGM_UNIT)
    if out or unit.get("enabled") != "enabled" or unit.get("active") != "active":
        out.append(Cmd(f"enable and start {DCGM_UNIT}", "systemctl enable --now " + sh(DCGM_UNIT)))
    return out


def nccl_tests_upload(s: Settings) -> Upload | None:
    if is_tarball(s.nccl_tests_source):
        return Upload(s.nccl_tests_source, NCCL_TARBALL, "nccl_tests_source")
    return None


DRIVER_UNITS = ["nvidia-persistenced.service", "nvidia-fabricmanager.service"]


def _installs(s: Settings, *pkgs: str, family: str | None = None) -> dict:
    """reads() of _install: the pinned packages (and `family`'s globs) and the holds."""
    return reads("held", packages=[*pkgs, *(held_family(s)[family] if family else ())])


STEPS = [
    Step("apt-recover", apt_recover, reads=lambda s: reads("dpkg_audit", "dpkg_updates_pending")),
    Step("cuda-repo", cuda_repo, reads=lambda s: {
        "packages": ["cuda-keyring", *_all_pins(s)],
        "available": [f"{p}={v}" for p, v in _all_pins(s).items()],
        **managed_files(managed.CUDA_SOURCES, managed.CUDA_AUTH, managed.DRIVER_PIN,
                        absent=managed.PROVISION_ABSENT)}),
    Step("base-packages", base_packages, reads=lambda s: reads(packages=list(BASE_PACKAGES))),
    Step("driver", driver, reprobes_driver=True, reads=lambda s: {
        **_installs(s, *DRIVER_PACKAGE.values(), s.fabricmanager_pkg), "units": DRIVER_UNITS,
        **managed_files(managed.NOUVEAU_BLACKLIST, managed.UNATTENDED_HOLD)}),
    Step("driver-services", driver_services, needs_driver=True,
         reads=lambda s: reads(units=DRIVER_UNITS)),
    Step("cuda-toolkit", cuda_toolkit,
         reads=lambda s: {**_installs(s, s.cuda_pkg, family="cuda"), **managed_files(managed.CUDA_ENV)}),
    Step("nccl", nccl, reads=lambda s: _installs(s, "libnccl2", "libnccl-dev", family="nccl")),
    Step("dcgm", dcgm, needs_driver=True,
         enabled=lambda c: None if c.s.dcgm else "disabled (var dcgm: false)",
         reads=lambda s: {**_installs(s, DCGM_PKG), "units": [DCGM_UNIT]}),
    Step("python-venv", python_venv, reads=lambda s: reads(venv=s.venv)),
    Step("nccl-tests", nccl_tests, needs_driver=True, upload=nccl_tests_upload,
         enabled=lambda c: None if c.s.nccl_tests else "disabled (var nccl_tests: false)",
         reads=lambda s: reads(paths=[nccl_tests_binary(s)])),
    Step("service-user", service_user,
         reads=lambda s: reads(users=[s.service_user], dirs=[d for d, _, _ in dirs(s)])),
    Step("node-exporter", node_exporter,  # after service-user: its textfile folder is that user's
         enabled=lambda c: node_exporter_skip(c), reads=lambda s: {
             **_installs(s, NODE_EXPORTER), "units": [NODE_EXPORTER_UNIT],
             **managed_files(managed.NODE_EXPORTER_ARGS)}),
    Step("slurm-packages", slurm_packages, enabled=_in_cluster,
         reads=lambda s: _installs(s, *_slurm_versions(s))),
    # after service-user and slurm-packages: the rules name their users
    Step("firewall", firewall.plan, reads=lambda s: {
        **reads("firewall", packages=[firewall.PACKAGE], units=[netfilter.UNIT]),
        **managed_files(managed.FIREWALL_RULES, managed.FIREWALL_UNIT)}),
    Step("munge", munge, enabled=lambda c: _in_cluster(c) or (
        f"Slurm waits: {c.cluster.missing}" if c.cluster.missing else None),
        reads=lambda s: {"units": [MUNGE_UNIT], **managed_files(managed.MUNGE_KEY)}),
    Step("slurm-config", slurm_config, enabled=_cluster_ready, reads=lambda s: {
        "dirs": [slurm.LOG_DIR, slurm.STATE_DIR], "units": list(SLURM_UNITS.values()),
        **managed_files(managed.SLURM_CONF, managed.GRES_CONF, managed.CGROUP_CONF)}),
]


class UndeclaredFact(TorchrigError):
    pass


def readers(s: Settings) -> list[tuple[str, dict]]:
    """(who, what it reads) for everything that reads provision's facts."""
    return [("Ctx", Ctx.READS), ("preflight", PREFLIGHT_READS), ("the plan's walk", WALK_READS),
            ("the Slurm cluster's plan", SLURM_CLUSTER_READS),
            *((f"step {st.name}", st.reads(s)) for st in STEPS)]


def fact_request(s: Settings) -> dict:
    """What the probe must report for these settings (one round trip): the union of what
    every planner reads. The planners read facts through Ctx.facts, which refuses anything
    not asked for here."""
    return merge_reads(readers(s))


def merge_reads(parts: list[tuple[str, dict]]) -> dict:
    """One want from (who, reads) pairs; a name or want key that facts/provision_facts.FACTS
    does not declare is an error naming who reads it."""
    want: dict = {"facts": set()}
    for who, r in parts:
        for key, v in r.items():
            if key == "facts":
                unknown = [n for n in v if n not in provision_facts.plain()]
                if unknown:
                    raise UndeclaredFact(f"{who} reads fact(s) {', '.join(map(repr, unknown))}, "
                                         "which facts/provision_facts.FACTS does not declare "
                                         "as plain facts")
            elif key not in provision_facts.want_keys():
                raise UndeclaredFact(f"{who} reads {key!r}, which no fact in "
                                     "facts/provision_facts.FACTS is asked by")
            if isinstance(v, (str, bool)):
                if want.setdefault(key, v) != v:
                    raise UndeclaredFact(f"{who} reads {key} {v!r}, another planner "
                                         f"{want[key]!r}: one per request")
            else:
                want.setdefault(key, set()).update(v)
    return {k: v if isinstance(v, (str, bool)) else sorted(v) for k, v in want.items()}
