"""Every per-host setting torchrig reads, typed, with its default, in one model; and the fixed
paths torchrig uses on a host.

The inventory's `vars` (shared < group < host) are validated into one `Settings` per host when
the inventory loads (`host.settings`); nothing else reads the raw vars. The vars table in
docs/inventory.md is generated from this model (`python -m torchrig.settings --write` rewrites
it; a unit test compares).
"""

from __future__ import annotations

import difflib
import posixpath
import re
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from .errors import TorchrigError
from .job import MEM_FILE, RDZV_PORTS, TENSORBOARD_DIR, UTIL_FILE, job_folder

# Fixed paths on a host (root's; no inventory var moves them).
ETC_DIR = "/etc/torchrig"                            # made by provision
JOBS_DIR = f"{ETC_DIR}/jobs"                         # env files (0600) and the launch lock
SYSTEMD_DIR = "/etc/systemd/system"
CPU_PROCS = 2  # processes per node where accelerator is cpu: two gloo ranks make a real all-reduce
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # full match: a trailing newline is not a name
FORMS = {  # settings that must match a form: (full-match pattern, what it is)
    "cuda_version": (r"\d+\.\d+", "major.minor (e.g. '12.8')"),
    "service_user": (r"[a-z_][a-z0-9_-]{0,31}", "a Linux user name (lowercase letters, digits, '_', '-')"),
    "tensorboard_version": (r"[0-9][0-9A-Za-z.+!_-]{0,40}", "a version (e.g. '2.21.0')"),
    # node_exporter's ARGS line splits on spaces and takes no quotes
    "metrics_dir": (r"/[A-Za-z0-9._/-]*", "an absolute path of letters, digits, '.', '_', '-', '/'"),
}


def check_env_mapping(env: Any) -> Any:
    """An `env` mapping's keys are variable names and its values strings or numbers (the
    inventory's var and a job file's key; a pydantic validator's check, ValueError)."""
    for k, v in (env.items() if isinstance(env, dict) else ()):
        if not isinstance(k, str) or not ENV_NAME.fullmatch(k):
            raise ValueError(f"{k!r} is not a valid environment variable name "
                             "(letters, digits, '_'; not starting with a digit)")
        if not isinstance(v, (str, int, float, bool)):
            raise ValueError(f"{k!r}: expected a string or number, got {v!r}")
    return env


def procs_per_node(accelerator: str, gpus: int) -> int:
    """Processes per node when none is asked for: one per GPU, or CPU_PROCS on a CPU host."""
    return CPU_PROCS if accelerator == "cpu" else gpus


def _var(default: Any, used_by: str, doc: str, shown: str | None = None, **limits: Any) -> Any:
    """A setting: its default, who reads it and what it means (docs/inventory.md's vars table)."""
    extra = {"used_by": used_by, **({"shown": shown} if shown else {})}
    return Field(default, description=doc, json_schema_extra=extra, **limits)


class Settings(BaseModel):
    """One host's settings: inventory vars over these defaults. Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Pinned stack: a current datacenter driver branch, the CUDA it ships with, NCCL built for
    # that CUDA, and torch's wheels for that CUDA. The testbed's stand-ins take these too.
    driver_version: str = _var("570.172.08", "provision", "NVIDIA driver version")
    driver_flavor: Literal["open", "proprietary", "auto"] = _var(
        "auto", "provision", "kernel modules: `open`, `proprietary`, or `auto` "
        "(open unless a GPU is older than Turing)")
    cuda_version: str = _var("12.8", "provision", "CUDA toolkit (major.minor)")
    cuda_package_version: str = _var("12.8.93-1", "provision", "its package version")
    nccl_version: str = _var("2.26.2-1+cuda12.8", "provision", "libnccl2/libnccl-dev package version")
    torch_version: str = _var("2.13.0", "provision", "torch in the venv")
    # Slurm as the distribution packages it (controller and daemons must match: pinned, held).
    slurm_version: str = _var("22.05.8-4+deb12u3", "provision",
                              "slurmctld/slurmd/slurm-client package version (inventory `slurm:`)")
    munge_version: str = _var("0.5.15-2+deb12u1", "provision", "munge package version")
    cuda_repo_url: str = _var("https://developer.download.nvidia.com/compute/cuda/repos",
                              "provision", "CUDA apt repository (credentials in the URL go to a "
                              "0600 apt auth file, never shown)", shown="NVIDIA's CUDA repos")
    pip_index_url: str = _var("https://download.pytorch.org/whl/cu128", "provision",
                              "wheel index for torch",
                              shown="the one for that CUDA")
    pip_trusted_host: str | None = _var(None, "provision", "a plain-HTTP mirror pip may trust")
    prefix: str = _var("/opt/torchrig", "provision, launch, verify",
                       "root's folder: venv, payload releases, nccl-tests, the jobs' home")
    data_dir: str = _var("/srv/torchrig/data", "provision, launch",
                         "the service user's data folder (TORCHRIG_DATA_DIR)")
    checkpoint_dir: str = _var("/srv/torchrig/checkpoints", "provision, launch",
                               "a job's checkpoints go to its folder under it")
    log_dir: str = _var("/var/log/torchrig", "provision, launch, logs, status",
                        "a job's rank logs go to its folder under it")
    service_user: str = _var("torchrig", "provision, launch", "the user jobs run as")
    apt_lock_timeout: int = _var(600, "provision", "seconds to wait for another apt", ge=0)
    min_free_gb: float = _var(20, "provision", "free disk (GB) required before installing", ge=0)
    reboot_timeout: int = _var(600, "provision", "seconds to wait for a host to come back", ge=30)
    dcgm: bool = _var(False, "provision, verify", "install NVIDIA's DCGM (datacenter-gpu-manager "
                      "from the CUDA repository) and run its host engine, for `verify --diag N` "
                      "and `health --diag N`")
    # NVIDIA's packages carry epoch 1 ("datacenter-gpu-manager=1:3.3.x" in public Dockerfiles);
    # 3.3.9 is the 3.x release NVIDIA's gpu-operator moved to (its PR #1122). DCGM 4 is split
    # into datacenter-gpu-manager-4-* packages per CUDA major: a different name, not a version.
    dcgm_version: str = _var("1:3.3.9", "provision", "datacenter-gpu-manager package version "
                             "(var dcgm)")
    nccl_tests: bool = _var(True, "provision, verify", "build nccl-tests (verify runs all_reduce_perf)")
    nccl_tests_version: str = _var("v2.16.4", "provision", "nccl-tests git tag")
    nccl_tests_source: str = _var("https://github.com/NVIDIA/nccl-tests", "provision",
                                  "git URL, or a `.tar.gz` path on the operator", shown="the git URL")
    extra_pip_packages: list[str] = _var([], "provision", "more requirements for the venv")
    pip_wheels_dir: str | None = _var(
        None, "provision", "a folder on the operator's machine with the wheels to install "
        "instead of asking pip_index_url (`pip download --only-binary=:all: -d DIR` for the "
        "hosts' platform, one version per project): it goes to one host, then node to node "
        "(hosts without internet)")
    wheel_cache_dir: str = _var("/var/lib/torchrig/wheels", "provision",
                                "root's cache (0700): when several hosts of a provision "
                                "need the same wheels or .debs, one downloads them and the others "
                                "get them from it over the cluster network (see docs/how-it-works.md)")
    workdir_max_mb: int = _var(500, "launch", "the most a `launch --workdir` project may send "
                               "(MiB, after its ignore files)", ge=1)
    deps_index_url: str | None = _var(
        None, "launch", "package index for a project's requirements (credentials go to a 0600 "
        "netrc, never a command line; none: the node's own pip configuration)")
    deps_timeout: int = _var(1800, "launch", "seconds a node may take to build a project's "
                             "job environment", ge=30)
    accelerator: Literal["cuda", "cpu"] = _var(
        "cuda", "verify, launch", f"`cpu`: gloo and CPU torch, {CPU_PROCS} processes per node "
        "(a CPU-only cluster, or the testbed)")
    backend: Literal["systemd", "slurm"] = _var(
        "systemd", "launch", "what runs a job: `systemd` (torchrig's own units) or `slurm` "
        "(sbatch on the inventory's `slurm:` cluster); `launch --backend` overrides it")
    rdzv_port: int = _var(29400, "verify, launch",
                          f"c10d rendezvous port; each job gets its own above it (+0..{RDZV_PORTS - 1})",
                          ge=1, le=65000)
    busbw_min_gbs: dict[str, float] = _var(
        {}, "verify", "busbw floors (GB/s) by topology class, over the shipped ones",
        shown="from `torchrig/data/busbw_thresholds.yml`")
    env: dict[str, str | int | float | bool] = _var({}, "launch", "the job's environment")
    secret_env: list[str] = _var([], "launch, every output",
                                 "names in `env` whose values are always masked")
    firewall: bool = _var(True, "provision",
                          "torchrig's nftables table: only the inventory's hosts reach the job "
                          "ports, only root, the service user and the login user open the "
                          "rendezvous ports (false: you manage the host firewall; see "
                          "docs/security.md)")
    node_exporter: bool = _var(True, "provision, launch, metrics",
                               "install prometheus-node-exporter; jobs export metrics through it")
    node_exporter_version: str = _var("1.5.0-1+b6", "provision",
                                      "its package version: Debian 12's (on Ubuntu set yours, else "
                                      "provision skips it and says so)")
    node_exporter_address: str | None = _var(
        None, "provision, metrics", "address it listens on (default: the host's inventory "
        "address, the cluster network; never 0.0.0.0 unless set)")
    node_exporter_port: int = _var(9100, "provision, metrics", "its port", ge=1, le=65535)
    metrics_dir: str = _var("/var/lib/torchrig/metrics", "provision, launch",
                            "its textfile folder, the service user's: jobs' samplers write "
                            "`torchrig_<job>.prom` there")
    gpu_metrics: bool = _var(True, "launch", "export GPU series; false where NVIDIA's "
                             "dcgm-exporter already does")
    low_util_percent: float = _var(20, "status", "GPU use below this % ...", ge=0, le=100)
    low_util_minutes: int = _var(30, "status", "... for this long is flagged", ge=1)
    tensorboard: bool = _var(False, "provision, launch, tensorboard",
                             "install TensorBoard in the venv; train.py jobs then log to "
                             "`<log_dir>/<job>/tensorboard` (see `torchrig tensorboard`)")
    tensorboard_version: str = _var("2.21.0", "provision", "its version")
    tensorboard_index_url: str | None = _var(
        None, "provision", "wheel index for TensorBoard and its dependencies (the torch index "
        "may not carry them; none: the node's own pip configuration)")

    @field_validator("prefix", "data_dir", "checkpoint_dir", "log_dir", "metrics_dir",
                     "wheel_cache_dir")
    @classmethod
    def _plain_path(cls, v: str) -> str:
        # These reach env and unit files line by line: a newline would add a line of its own.
        if not v.startswith("/") or any(ord(c) < 32 or ord(c) == 127 for c in v):
            raise ValueError("expected an absolute path without control characters "
                             f"(newline, tab, ...), got {v!r}")
        return v

    @field_validator(*FORMS)
    @classmethod
    def _form(cls, v: str, info: ValidationInfo) -> str:
        pattern, what = FORMS[info.field_name]
        if not re.fullmatch(pattern, v):
            raise ValueError(f"expected {what}, got {v!r}")
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env_names(cls, env: Any) -> Any:
        return check_env_mapping(env)

    @field_validator("secret_env", mode="before")
    @classmethod
    def _one_name(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # one name, not a set of its characters

    @field_validator("node_exporter_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9._:-]+|\[[0-9A-Fa-f:.]+\]", v):
            raise ValueError(f"expected an IP address or host name, got {v!r}")
        return v

    @model_validator(mode="after")
    def _root_paths_outside_data_dir(self) -> Settings:
        # data_dir and metrics_dir are the service user's: a job can put a symlink anywhere
        # in them, which root's `install -d` (provision) or mkdir (push) would then follow
        for user_var in ("data_dir", "metrics_dir"):
            data = posixpath.normpath(getattr(self, user_var))
            for name in ("prefix", "log_dir", "checkpoint_dir", "wheel_cache_dir"):
                p = posixpath.normpath(getattr(self, name))
                if p == data or p.startswith(data.rstrip("/") + "/") or data == "/":
                    raise ValueError(f"{name} {getattr(self, name)!r} lies in {user_var} "
                                     f"{getattr(self, user_var)!r}, which the service user owns: "
                                     "root's folders must not; choose folders side by side")
        return self

    # derived values
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
    def service_home(self) -> str:
        """The service user's home: its jobs' HOME (caches: Hugging Face, torch.hub, Triton,
        Inductor, CUDA's JIT), the service user's own. Inside root's prefix, so that nobody
        else can put anything in its place; launch makes it (onhost/launch/jobdirs.py)."""
        return f"{self.prefix}/home"

    @property
    def fabricmanager_pkg(self) -> str:
        return f"nvidia-fabricmanager-{self.driver_branch}"

    @property
    def job_env(self) -> dict[str, str]:
        """`env` as the strings a job's environment holds."""
        return {k: str(v) for k, v in self.env.items()}

    def node_exporter_listen(self, address: str) -> str:
        """host:port node_exporter binds (and `torchrig metrics` fetches on the node)."""
        host = self.node_exporter_address or address
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6
        return f"{host}:{self.node_exporter_port}"

    def job_log_dir(self, job: str) -> str:
        return job_folder(self.log_dir, job)

    def tensorboard_dir(self, job: str) -> str:
        """Where a job's TensorBoard events go (train.py --tensorboard) and are read from."""
        return f"{self.job_log_dir(job)}/{TENSORBOARD_DIR}"

    def util_file(self, job: str) -> str:
        return f"{self.job_log_dir(job)}/{UTIL_FILE}"

    def mem_file(self, job: str) -> str:
        return f"{self.job_log_dir(job)}/{MEM_FILE}"

    def given(self) -> dict[str, Any]:
        """The settings the inventory set (the rest are defaults)."""
        return self.model_dump(include=self.model_fields_set)


KNOWN = sorted(Settings.model_fields)
DEFAULTS = Settings()  # the product's defaults; the testbed's stand-ins take their versions here


def check_names(found: dict[str, Any], where: str) -> None:
    """Unknown keys are refused: a misspelt var would silently get its default."""
    for k in found:
        if k not in Settings.model_fields:
            close = difflib.get_close_matches(str(k), KNOWN, n=1)
            hint = (f"did you mean {close[0]!r}?" if close
                    else "the vars table in docs/inventory.md lists the known ones")
            raise TorchrigError(f"{where}: var {k!r} is not a var torchrig reads; {hint}")


def settings_for(host_name: str, host_vars: dict[str, Any], inventory_path: str) -> Settings:
    """A host's merged vars as Settings, or one message naming the file, host and var."""
    where = f"{inventory_path}: host {host_name!r}"
    check_names(host_vars, where)
    try:
        return Settings.model_validate(host_vars)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"][:1])  # env's own checks name the key
        what = describe(err)
        if not field:  # a check across vars: its message names them
            raise TorchrigError(f"{where}: {what}") from None
        raise TorchrigError(f"{where}: var {field!r}: {what}") from None


def describe(err: dict[str, Any]) -> str:
    """One pydantic error, for a person: what was expected and what was given."""
    kind, inp, ctx = err["type"], err.get("input"), err.get("ctx", {})
    if kind == "missing":
        return "is required but missing"
    if kind == "extra_forbidden":
        return "is not a known key (check its spelling against inventory/example.yml)"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, ")
    expected = {
        "int_type": "an integer", "string_type": "a string", "dict_type": "a mapping",
        "list_type": "a list", "bool_type": "true or false", "float_type": "a number",
        "model_type": "a mapping", "too_short": "at least one entry",
        "literal_error": ctx.get("expected", "one of the allowed values"),
        "string_pattern_mismatch": "a plain name (letters, digits, '.', '_', '-')",
        "greater_than_equal": f">= {_num(ctx.get('ge'))}", "less_than_equal": f"<= {_num(ctx.get('le'))}",
    }.get(kind)
    return f"expected {expected}, got {inp!r}" if expected else f"{err['msg']} (got {inp!r})"


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)  # 100.0 -> 100


# The vars table of the inventory reference, generated from the model.
TABLE_FILE = "docs/inventory.md"
TABLE_BEGIN = "<!-- vars table: generated from torchrig/settings.py by `python -m torchrig.settings` -->"
TABLE_END = "<!-- end of vars table -->"


def _shown(name: str) -> str:
    field = Settings.model_fields[name]
    extra = field.json_schema_extra or {}
    if "shown" in extra:
        return str(extra["shown"])
    v = field.default
    if v is None or v == [] or v == {}:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    return f"`{v}`"


def vars_table() -> str:
    rows = ["| var | default | used by | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra or {}
        rows.append(f"| `{name}` | {_shown(name)} | {extra['used_by']} | {field.description} |")
    return "\n".join(rows)


def doc_with_table(doc: str) -> str:
    """The page's text (TABLE_FILE) with the generated table between its markers."""
    head, sep, rest = doc.partition(TABLE_BEGIN)
    _, sep2, tail = rest.partition(TABLE_END)
    if not (sep and sep2):
        raise TorchrigError(f"the vars table markers are missing ({TABLE_BEGIN})")
    return f"{head}{TABLE_BEGIN}\n{vars_table()}\n{TABLE_END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """`python -m torchrig.settings`: print the vars table; only --write changes a file."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m torchrig.settings",
                                 description="Print the vars table of the inventory reference "
                                             f"({TABLE_FILE}), generated from the settings model.")
    ap.add_argument("--write", metavar="FILE", nargs="?", const=TABLE_FILE,
                    help=f"put the table between the markers in this file (default {TABLE_FILE}, "
                         "relative to the current folder: run it in a checkout's top folder)")
    a = ap.parse_args(argv)
    if a.write is None:
        print(vars_table())
        return 0
    path = Path(a.write)
    try:
        path.write_text(doc_with_table(path.read_text()))
    except (OSError, TorchrigError) as e:
        print(f"error: {path}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1
    print(f"{path}: vars table written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
