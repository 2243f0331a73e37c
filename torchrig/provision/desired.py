"""What provision installs: public defaults in one place, per-host overrides from inventory
vars, derived values (repo path, package versions, file contents) computed once."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import TorchrigError

# Pinned stack. A current datacenter driver branch, the CUDA it ships with, NCCL built for
# that CUDA, and torch's wheels for that CUDA.
DEFAULTS: dict[str, Any] = {
    "driver_version": "570.172.08",
    "driver_flavor": "auto",          # open | proprietary | auto (open where the GPUs support it)
    "cuda_version": "12.8",
    "cuda_package_version": "12.8.93-1",
    "nccl_version": "2.26.2-1+cuda12.8",
    "torch_version": "2.13.0",
    "cuda_repo_url": "https://developer.download.nvidia.com/compute/cuda/repos",
    "pip_index_url": "https://download.pytorch.org/whl/cu128",  # the wheel index for the CUDA above
    "pip_trusted_host": None,         # for a plain-HTTP mirror
    "prefix": "/opt/torchrig",
    "data_dir": "/srv/torchrig/data",
    "checkpoint_dir": "/srv/torchrig/checkpoints",
    "log_dir": "/var/log/torchrig",
    "service_user": "torchrig",
    "apt_lock_timeout": 600,
    "min_free_gb": 20,
    "nccl_tests": True,
    "nccl_tests_version": "v2.16.4",
    "nccl_tests_source": "https://github.com/NVIDIA/nccl-tests",  # git URL, or a tarball path on the operator
    "reboot_timeout": 600,
    "extra_pip_packages": [],
}

# Package names by distro, as data (NVIDIA's CUDA repo uses the same names on these).
DISTROS = {"ubuntu2204", "ubuntu2404", "debian12"}
DRIVER_PACKAGE = {"open": "nvidia-open", "proprietary": "cuda-drivers"}
# GPU generations without open-kernel-module support (before Turing), by PCI chip name.
PRE_TURING_CHIPS = ("GV1", "GP1", "GM1", "GM2", "GK1", "GK2")


class Settings(BaseModel):
    model_config = ConfigDict(extra="ignore")

    driver_version: str
    driver_flavor: str = Field(pattern="^(open|proprietary|auto)$")
    cuda_version: str = Field(pattern=r"^\d+\.\d+$")
    cuda_package_version: str
    nccl_version: str
    torch_version: str
    cuda_repo_url: str
    pip_index_url: str
    pip_trusted_host: str | None
    prefix: str = Field(pattern="^/")
    data_dir: str = Field(pattern="^/")
    checkpoint_dir: str = Field(pattern="^/")
    log_dir: str = Field(pattern="^/")
    service_user: str = Field(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    apt_lock_timeout: int = Field(ge=0)
    min_free_gb: float = Field(ge=0)
    nccl_tests: bool
    nccl_tests_version: str
    nccl_tests_source: str
    reboot_timeout: int = Field(ge=30)
    extra_pip_packages: list[str]

    @field_validator("prefix", "data_dir", "checkpoint_dir", "log_dir")
    @classmethod
    def _plain_path(cls, v: str) -> str:
        # These reach env and unit files line by line: a newline would add a line of its own.
        if any(ord(c) < 32 or ord(c) == 127 for c in v):
            raise ValueError("an absolute path without control characters (newline, tab, ...)")
        return v

    @model_validator(mode="after")
    def _root_paths_outside_data_dir(self) -> Settings:
        # data_dir is the service user's: a job can put a symlink anywhere in it, which root's
        # `install -d` (provision) or mkdir (push) would then follow
        data = posixpath.normpath(self.data_dir)
        for name in ("prefix", "log_dir", "checkpoint_dir"):
            p = posixpath.normpath(getattr(self, name))
            if p == data or p.startswith(data.rstrip("/") + "/") or data == "/":
                raise ValueError(f"{name} {getattr(self, name)!r} lies in data_dir {self.data_dir!r}, "
                                 "which the service user owns: root's folders must not; "
                                 "choose folders side by side")
        return self

    @property
    def driver_branch(self) -> str:
        return self.driver_version.split(".")[0]

    @property
    def driver_deb(self) -> str:
        return f"{self.driver_version}-1"

    @property
    def cuda_pkg(self) -> str:
        return "cuda-toolkit-" + self.cuda_version.replace(".", "-")

    @property
    def cuda_home(self) -> str:
        return f"/usr/local/cuda-{self.cuda_version}"

    @property
    def venv(self) -> str:
        return f"{self.prefix}/venv"

    @property
    def fabricmanager_pkg(self) -> str:
        return f"nvidia-fabricmanager-{self.driver_branch}"


def settings_for(host_name: str, host_vars: dict[str, Any], inventory_path: str) -> Settings:
    merged = {**DEFAULTS, **{k: v for k, v in host_vars.items() if k in DEFAULTS}}
    try:
        return Settings.model_validate(merged)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not field:  # a check across vars: its message names them
            raise TorchrigError(f"{inventory_path}: host {host_name!r}: {msg}") from None
        raise TorchrigError(f"{inventory_path}: host {host_name!r}: var {field!r}: {msg} "
                            f"(got {err.get('input')!r})") from None


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
