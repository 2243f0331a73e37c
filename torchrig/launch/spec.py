"""A job file (`launch --spec FILE`): launch's flags as YAML, the reproducible form of a launch.

load() reads and validates one: pydantic (strict types, unknown keys refused naming the
closest known key), every problem one message naming the file and the key. merge() lays the
command line's flags over it (a flag given wins; `--env` entries win over the file's `env`
keys of the same name) and fills launch's defaults (torchrig.job.DEFAULTS) last. Pure apart
from reading the file: nothing here touches a host. jobs/example.yml documents every key.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import TorchrigError
from ..inventory import _parse_yaml  # the inventory's loader: duplicate keys, alias bombs refused
from ..job import DEFAULTS, check_job_name, default_job_name
from ..settings import ENV_NAME, check_env_mapping, describe
from . import elastic

EXAMPLE = "jobs/example.yml"  # the commented reference of every key
MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# LaunchOptions' fields a merge gives (dry_run is the command line's alone), and the values
# the task passes to service.launch beside them
OPTION_KEYS = ("job", "script", "module", "args", "env", "nproc", "max_restarts",
               "start_timeout", "rdzv_timeout", "exit_barrier_timeout", "workdir",
               "requirements", "allow_torch_change", "secret_env", "early_fail_window", "data",
               "data_verify")
SERVICE_KEYS = ("nodes", "backend", "partition", "time")
# the task's flags a job file may set, by the task's parameter name (nproc_per_node: nproc)
FLAGS = ("job", "workdir", "script", "module", "args", "nodes", "nproc_per_node", "env",
         "secret_env", "requirements", "allow_torch_change", "max_restarts", "start_timeout",
         "rdzv_timeout", "exit_barrier_timeout", "backend", "partition", "time",
         "early_fail_window", "data", "data_verify")


def _plain(v: str, what: str) -> str:
    if not v or any(ord(c) < 32 or ord(c) == 127 for c in v):
        raise ValueError(f"expected {what} without control characters (newline, tab, ...), "
                         f"got {v!r}")
    return v


def _inside(v: str, what: str) -> str:
    """A relative path that stays inside its folder (no absolute path, no '..')."""
    _plain(v, what)
    p = Path(v)
    if p.is_absolute() or ".." in p.parts:
        raise ValueError(f"expected {what}: a relative path without '..', got {v!r}")
    return v


class JobSpec(BaseModel):
    """One job file. Every key is optional; a key left out is the flag's default (or the
    flag's value, when given). Field order is the order of jobs/example.yml."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    job: str | None = None
    workdir: str | None = None           # resolved against the file's folder by load()
    script: str | None = None
    module: str | None = None
    args: str | None = None              # a list in the file is joined with shlex.join
    nodes: int | str | None = None       # N, or MIN:MAX (an elastic job)
    nproc_per_node: int | str | None = None
    env: dict[str, str | int | float | bool] = Field(default_factory=dict)
    secret_env: list[str] = Field(default_factory=list)
    requirements: str | None = None
    allow_torch_change: bool = False
    max_restarts: int | None = Field(default=None, ge=0)
    start_timeout: int | None = Field(default=None, ge=1)
    rdzv_timeout: int | None = Field(default=None, ge=1)
    exit_barrier_timeout: int | None = Field(default=None, ge=1)
    early_fail_window: int | None = Field(default=None, ge=0)
    data: str | None = None
    data_verify: Literal["quick", "full"] | None = None
    backend: Literal["systemd", "slurm"] | None = None
    partition: str | None = None
    time: str | None = None

    @field_validator("job")
    @classmethod
    def _job(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                check_job_name(v)
            except TorchrigError as e:  # its message starts "--job 'x': "; the key is named here
                raise ValueError(str(e).removeprefix(f"--job {v!r}: ")) from None
        return v

    @field_validator("data")
    @classmethod
    def _data(cls, v: str | None) -> str | None:
        if v is not None:
            from ..datasets.manifest import NAME_RE
            if not NAME_RE.fullmatch(v):
                raise ValueError(f"expected a dataset name (`torchrig data.ls`), got {v!r}")
        return v

    @field_validator("nodes", mode="before")
    @classmethod
    def _nodes(cls, v: Any) -> Any:
        try:
            elastic.parse_nodes(v)
        except TorchrigError as e:
            raise ValueError(str(e).removeprefix(f"--nodes {v!r}: ")) from None
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        return None if v is None else _plain(v, "a folder")

    @field_validator("script")
    @classmethod
    def _script(cls, v: str | None) -> str | None:
        return None if v is None else _inside(v, "a file in workdir (or in payload/)")

    @field_validator("requirements")
    @classmethod
    def _requirements(cls, v: str | None) -> str | None:
        return None if v is None else _inside(v, "a file in workdir")

    @field_validator("module")
    @classmethod
    def _module(cls, v: str | None) -> str | None:
        if v is not None and not MODULE_RE.fullmatch(v):
            raise ValueError(f"expected a Python module name (e.g. train or mypkg.train), got {v!r}")
        return v

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, v: Any) -> Any:
        if isinstance(v, list) and all(isinstance(a, str) for a in v):
            return shlex.join(v)  # launch splits it back to the very same list
        if v is not None and not isinstance(v, str):
            raise ValueError(f"expected a string (quoted as in a shell) or a list of strings, "
                             f"got {v!r}")
        if isinstance(v, str):
            try:
                shlex.split(v)
            except ValueError as e:
                raise ValueError(f"{e} in {v!r}: quote it as in a shell, or give a list") from None
        return v

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _nproc(cls, v: Any) -> Any:
        if v is None or v == "gpu" or (type(v) is int and v >= 1):
            return v
        raise ValueError(f"expected a whole number >= 1, or 'gpu' (one process per GPU), got {v!r}")

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, env: Any) -> Any:
        return check_env_mapping(env)

    @field_validator("secret_env", mode="before")
    @classmethod
    def _secret_env(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) else v  # one name, not a set of its characters
        for k in (v if isinstance(v, list) else ()):
            if isinstance(k, str) and not ENV_NAME.fullmatch(k):
                raise ValueError(f"{k!r} is not a valid environment variable name")
        return v

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v: Any) -> Any:
        if type(v) is int:  # YAML 1.1 reads an unquoted 2:00:00 as 7200 (base 60)
            raise ValueError(f"expected a string: quote it (time: '2:00:00'); YAML reads an "
                             f"unquoted H:MM:SS as a number of seconds, got {v!r}")
        return v

    @field_validator("partition")
    @classmethod
    def _partition(cls, v: str | None) -> str | None:
        return None if v is None else _plain(v, "a partition name")

    @model_validator(mode="after")
    def _one_entry_point(self) -> "JobSpec":
        if self.script is not None and self.module is not None:
            raise ValueError("script and module are both given: choose one (script: a file "
                             "run as `python FILE`; module: run as `python -m NAME`)")
        return self


KEYS = tuple(JobSpec.model_fields)


def _where(loc: tuple) -> str:
    """"key 'secret_env', entry 2" from pydantic's ('secret_env', 1)."""
    if not loc:
        return ""
    out = f"key {str(loc[0])!r}"
    for p in loc[1:]:
        out += f", entry {p + 1}" if isinstance(p, int) else f".{p}"
    return out + ": "


def load(path: str | os.PathLike) -> JobSpec:
    """Read and validate a job file; its relative workdir resolved against the file's folder.
    Raises TorchrigError with one line naming the file (and the key, and what to do)."""
    path = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TorchrigError(f"{path}: cannot read the job file ({e.strerror}); "
                            "check --spec PATH") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise TorchrigError(f"{path}: line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}); "
                            "save the job file as UTF-8") from None
    try:
        raw = _parse_yaml(text)
    except TorchrigError as e:
        raise TorchrigError(f"{path}: {e}") from None
    except Exception as e:  # yaml.YAMLError; yaml itself is imported by the inventory
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise TorchrigError(f"{path}:{where} not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        got = "an empty file" if raw is None else f"a {type(raw).__name__}"
        raise TorchrigError(f"{path}: expected a mapping of job keys (job: ..., script: ...; "
                            f"see {EXAMPLE}), got {got}")
    for k in raw:
        if k not in JobSpec.model_fields:
            close = difflib.get_close_matches(str(k), KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"{EXAMPLE} lists every key"
            raise TorchrigError(f"{path}: key {str(k)!r} is not a job file key; {hint}")
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise TorchrigError(f"{path}: {_where(err['loc'])}{describe(err)}") from None
    if spec.workdir is not None:
        wd = Path(os.path.expanduser(spec.workdir))
        if not wd.is_absolute():
            wd = Path(path).resolve().parent / wd
        spec = spec.model_copy(update={"workdir": os.path.normpath(wd)})
    return spec


def _env_key(item: str) -> str:
    return item.partition("=")[0]


def merge(spec: JobSpec | None, given: dict[str, Any], source: str = "the job file") -> dict:
    """LaunchOptions' values (OPTION_KEYS, but dry_run) and service.launch's (SERVICE_KEYS):
    each flag given (not None; a list flag not empty; a switch on) over the file's value,
    then DEFAULTS. `given`: the task's flags by parameter name (FLAGS); numbers already
    numbers. `--env K=V` entries win over the file's env key K; --script and --module each
    replace both of the file's (they are one choice)."""
    s = spec or JobSpec()

    def pick(name: str, default: Any = None) -> Any:
        v = given.get(name)
        if v is None:
            v = getattr(s, name)
        return default if v is None else v

    if given.get("script") is not None and given.get("module") is not None:
        raise TorchrigError("--script and --module: choose one")
    if given.get("script") is not None or given.get("module") is not None:
        script, module = given.get("script"), given.get("module")
    else:
        script, module = s.script, s.module
    flag_env = {_env_key(e): str(e) for e in given.get("env") or []}  # the last one per key
    env = ([flag_env.get(k, f"{k}={v}") for k, v in s.env.items()]  # the file's order
           + [e for k, e in flag_env.items() if k not in s.env])
    names = {_env_key(e) for e in env}
    for name in s.secret_env:
        if name not in names:
            raise TorchrigError(f"{source}: key 'secret_env': {name!r} is not a key of env (the "
                                "file's or --env's): a misspelt name would leave a secret "
                                "shown; fix the name, set it in env, or pass --env NAME=VALUE")
    return {
        "job": pick("job") or default_job_name(),
        "script": script or DEFAULTS.script,  # a str in LaunchOptions: unused with a module
        "module": module,
        "args": pick("args", ""),
        "env": env,
        "nproc": str(pick("nproc_per_node", DEFAULTS.nproc)),
        # an elastic job's node loss uses one of torchrun's restarts (a node joining, none)
        "max_restarts": pick("max_restarts", elastic.ELASTIC_MAX_RESTARTS
                             if elastic.is_elastic(elastic.parse_nodes(pick("nodes")))
                             else DEFAULTS.max_restarts),
        "start_timeout": pick("start_timeout", DEFAULTS.start_timeout),
        "rdzv_timeout": pick("rdzv_timeout", DEFAULTS.rdzv_timeout),
        "exit_barrier_timeout": pick("exit_barrier_timeout", DEFAULTS.exit_barrier_timeout),
        "early_fail_window": pick("early_fail_window", DEFAULTS.early_fail_window),
        "workdir": pick("workdir"),
        "requirements": pick("requirements"),
        "allow_torch_change": bool(given.get("allow_torch_change")) or s.allow_torch_change,
        "secret_env": list(dict.fromkeys([*s.secret_env, *(given.get("secret_env") or [])])),
        "data": pick("data"),
        "data_verify": pick("data_verify", "quick"),
        "nodes": pick("nodes"),
        "backend": pick("backend"),
        "partition": pick("partition"),
        "time": pick("time"),
    }
