"""Load and validate the YAML inventory into typed Host objects.

Validation is pydantic's (typed fields, unknown keys refused); this module only turns its
errors into one message that names the file, the host and the field.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from .errors import TorchrigError
from .settings import Settings, check_names, describe, settings_for

DEFAULT_INVENTORY = "inventory/hosts.yml"

# Host names end up in unit names, file names and log prefixes: keep them plain.
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
# YAML aliases are shared, not copied, when loaded, but everything after (validation, printing)
# walks them expanded: a few lines of nested aliases (billion laughs) expand past any memory.
MAX_NODES = 100_000
NO_JUMP = "none"  # OpenSSH's ProxyJump none: a host opts out of defaults.jump


class InventoryError(TorchrigError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Defaults(_Strict):
    """Connection settings every host inherits unless it sets its own."""

    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    identity_file: str | None = None
    jump: str | None = None


class GroupSpec(_Strict):
    description: str = ""
    vars: dict[str, Any] = Field(default_factory=dict)


# What may follow ipmitool's -H/-U or go into a URL: no spaces, quotes or control characters,
# and no leading '-' (it would read as an option).
BMC_WORD = r"^[A-Za-z0-9_.:@\[\]%+=/~-]{1,253}$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class Bmc(_Strict):
    """A host's baseboard management controller (`torchrig power`): reached from the
    operator's machine, never from the host. The password is a secret: inline (masked in every
    output) or, better, `password_env`, the name of an environment variable on the operator's
    machine, read only when a power task runs."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    address: str
    protocol: Literal["ipmi", "redfish"] = "ipmi"
    user: str
    password: str | None = Field(default=None, min_length=1)
    password_env: str | None = Field(default=None, pattern=ENV_NAME)
    port: int | None = Field(default=None, ge=1, le=65535)
    # ipmi only: the IPMI 2.0 cipher suite (ipmitool -C); unset: ipmitool's choice (it asks)
    cipher_suite: int | None = Field(default=None, ge=0, le=17)
    # redfish only: http is for a lab; tls_verify false (or a CA bundle's path) for a BMC's
    # self-signed certificate; system: the ComputerSystem id where the BMC has several
    scheme: Literal["https", "http"] | None = None
    tls_verify: bool | str | None = None
    system: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._:-]{1,128}$")

    @field_validator("address", "user")
    @classmethod
    def _plain_word(cls, v: str) -> str:
        if not re.fullmatch(BMC_WORD, v) or v.startswith("-"):
            raise ValueError(f"expected a host name, IP address or user name without spaces, "
                             f"quotes or control characters, not starting with '-'; got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Bmc:
        if (self.password is None) == (self.password_env is None):
            raise ValueError("give exactly one of password (in this file, masked in every "
                             "output) or password_env (the name of an environment variable "
                             "on this machine that holds it)")
        other = {"ipmi": ("scheme", "tls_verify", "system"), "redfish": ("cipher_suite",)}
        wrong = [f for f in other[self.protocol] if getattr(self, f) is not None]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} is not a setting of protocol {self.protocol}; "
                             "remove it, or set the protocol it belongs to")
        return self

    def secret(self) -> str | None:
        """The password, if known here (password_env unset on this machine: None)."""
        return self.password if self.password is not None else os.environ.get(self.password_env)


class HostSpec(_Strict):
    name: str = Field(pattern=NAME_RE)
    connection: Literal["ssh", "local"] = "ssh"
    address: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    user: str | None = None
    identity_file: str | None = None
    jump: str | None = None
    gpus: int | None = Field(default=None, ge=0)
    groups: list[str] = Field(default_factory=list)
    vars: dict[str, Any] = Field(default_factory=dict)
    bmc: Bmc | None = None

    @field_validator("address")
    @classmethod
    def _no_spaces(cls, v: str | None) -> str | None:
        if v is not None and (not v or re.search(r"\s", v)):
            raise ValueError("an address must be a non-empty host name or IP without spaces")
        return v


SLURM_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,39}$"


class SlurmSpec(_Strict):
    """The inventory's `slurm:` section: which hosts form a Slurm cluster."""

    controller: str                      # the host running slurmctld (may also compute)
    compute: list[str] | str             # hosts or groups running slurmd
    partition: str = Field("gpu", pattern=SLURM_NAME)
    cluster_name: str = Field("torchrig", pattern=r"^[a-z0-9][a-z0-9_-]{0,39}$")
    # Slurm's cgroup plugins (proctrack/task/jobacct_gather cgroup, cgroup.conf constraining
    # devices and memory). false: proctrack/linuxproc, no constraints, for hosts without a
    # delegated cgroup tree (containers).
    cgroup: bool = True
    # slurm.conf's SlurmdTimeout: a compute node silent this long (s) is DOWN and its jobs
    # fail (NODE_FAIL); slurmctld pings every third of it
    node_timeout: int = Field(60, ge=10, le=3600)


class Slurm(BaseModel):
    """The resolved `slurm:` section: host names (inventory names are Slurm's NodeNames)."""

    model_config = ConfigDict(frozen=True)

    controller: str
    compute: tuple[str, ...]
    partition: str
    cluster_name: str
    cgroup: bool
    node_timeout: int

    @property
    def hosts(self) -> tuple[str, ...]:
        return (self.controller, *[h for h in self.compute if h != self.controller])


class InventorySpec(_Strict):
    known_hosts: str | None = None
    defaults: Defaults = Field(default_factory=Defaults)
    vars: dict[str, Any] = Field(default_factory=dict)
    groups: dict[str, GroupSpec] = Field(default_factory=dict)
    hosts: list[HostSpec] = Field(min_length=1)
    slurm: SlurmSpec | None = None


class Host(BaseModel):
    """A validated host with defaults applied; its vars (shared < group < host) are
    `settings`, typed: nothing reads the raw vars."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    connection: Literal["ssh", "local"]
    address: str
    port: int | None
    user: str | None
    identity_file: str | None
    jump: str | None
    gpus: int | None
    groups: tuple[str, ...]
    settings: Settings = Field(default_factory=Settings)
    bmc: Bmc | None = None

    @property
    def is_local(self) -> bool:
        return self.connection == "local"


class Inventory(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    known_hosts: str
    hosts: tuple[Host, ...]
    groups: dict[str, GroupSpec]
    slurm: Slurm | None = None

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise InventoryError(f"{self.path}: no host named {name!r}")

    def select(self, spec: str | None) -> list[Host]:
        """Hosts named by `spec`: comma list of host or group names; None/''/'all' = every host."""
        if spec is None or spec.strip() in ("", "all"):
            return list(self.hosts)
        chosen: list[Host] = []
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            if item in self.groups:
                matches = [h for h in self.hosts if item in h.groups]
            else:
                matches = [h for h in self.hosts if h.name == item]
            if not matches:
                raise InventoryError(
                    f"--host {item!r}: no such host or group in {self.path} "
                    f"(hosts: {', '.join(h.name for h in self.hosts)}; "
                    f"groups: {', '.join(self.groups) or 'none'})"
                )
            chosen.extend(h for h in matches if h not in chosen)
        return chosen


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (plain PyYAML keeps the last silently)
    and keys that are not plain values; merge keys (`<<: *base`) work as in PyYAML."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<`: its keys may be overridden by the mapping's own
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a mapping key must be a plain value, not a {type(key).__name__}",
                key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def _expanded_size(root: yaml.Node) -> int:
    """Nodes in the document with every alias expanded (memoised: linear in the file)."""
    size: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    busy: set[int] = set()
    while stack:
        node, done = stack.pop()
        if id(node) in size:
            continue
        kids = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if done:
            busy.discard(id(node))
            size[id(node)] = min(1 + sum(size[id(k)] for k in kids), MAX_NODES + 1)
            continue
        if id(node) in busy:
            raise yaml.composer.ComposerError(None, None, "an alias refers to itself",
                                              node.start_mark)
        busy.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
    return size[id(root)]


def _parse_yaml(text: str) -> Any:
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_NODES:
            raise InventoryError(f"its aliases expand to more than {MAX_NODES} values; "
                                 "refused (write the values out, or nest fewer aliases)")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _locate(raw: Any, loc: tuple) -> str:
    """'host 'gpu2': field 'gpus'' from pydantic's ('hosts', 1, 'gpus')."""
    if len(loc) >= 2 and loc[0] == "hosts" and isinstance(loc[1], int):
        entry = raw["hosts"][loc[1]] if isinstance(raw.get("hosts"), list) else None
        name = entry.get("name") if isinstance(entry, dict) else None
        who = f"host {name!r}" if isinstance(name, str) else f"hosts entry #{loc[1] + 1}"
        rest = ".".join(str(p) for p in loc[2:])
        return f"{who}: field {rest!r}" if rest else who
    if len(loc) >= 2 and loc[0] == "groups":
        rest = ".".join(str(p) for p in loc[2:])
        return f"group {loc[1]!r}" + (f": field {rest!r}" if rest else "")
    return "field " + repr(".".join(str(p) for p in loc))


def _resolve_path(value: str | None, base: Path) -> str | None:
    if value is None:
        return None
    p = Path(os.path.expanduser(value))
    return str(p if p.is_absolute() else (base / p))


def load(path: str | os.PathLike) -> Inventory:
    """Read, validate and resolve an inventory file. Raises InventoryError with one message."""
    path = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InventoryError(
            f"{path}: cannot read the inventory ({e.strerror}); pass --inventory PATH, set "
            "TORCHRIG_INVENTORY, or start one with: torchrig init"
        ) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise InventoryError(f"{path}: line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}); "
                             "save the inventory as UTF-8") from None
    try:
        raw = _parse_yaml(text)
    except InventoryError as e:
        raise InventoryError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise InventoryError(f"{path}:{where}: not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise InventoryError(f"{path}: expected a mapping with a 'hosts:' list at the top")
    try:
        spec = InventorySpec.model_validate(raw)
    except ValidationError as e:
        errs = e.errors()
        lines = [f"{path}: {_locate(raw, err['loc'])} {describe(err)}" for err in errs[:10]]
        if len(errs) > 10:
            lines.append(f"{path}: ... and {len(errs) - 10} more problems")
        raise InventoryError("\n".join(lines)) from None
    return _resolve(spec, Path(path).resolve().parent, path)


def write_example(path: str | os.PathLike) -> Path:
    """`torchrig init`: the commented example inventory (every field explained) written at
    `path` to edit; an existing file there is never replaced."""
    from .resources import EXAMPLE_INVENTORY
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "x", encoding="utf-8") as f:  # "x": an existing inventory is never replaced
            f.write(EXAMPLE_INVENTORY.read_text(encoding="utf-8"))
    except FileExistsError:
        raise TorchrigError(f"{path} exists: edit it, or pass --inventory NEW_PATH") from None
    except OSError as e:
        raise TorchrigError(f"{path}: cannot write it ({e.strerror})") from None
    return path


def _settings(name: str, merged: dict[str, Any], path: str) -> Settings:
    try:
        return settings_for(name, merged, path)  # types, ranges, paths, names: one message
    except TorchrigError as e:
        raise InventoryError(str(e)) from None


def _check_var_names(found: dict[str, Any], where: str, path: str) -> None:
    try:
        check_names(found, f"{path}: {where}")
    except TorchrigError as e:
        raise InventoryError(str(e)) from None


def _check_jumps(hosts: list[Host], inherited: set[str], path: str) -> None:
    """A jump through an inventory host that leads back to itself would recurse forever."""
    by_name = {h.name: h for h in hosts}
    for h in hosts:
        chain = [h.name]
        while by_name.get(chain[-1]) and by_name[chain[-1]].jump in by_name:
            nxt = by_name[chain[-1]].jump
            if nxt == h.name:
                if chain == [h.name]:
                    src = " (from defaults.jump)" if h.name in inherited else ""
                    raise InventoryError(f"{path}: host {h.name!r}: jump {nxt!r}{src} is the host "
                                         f"itself; set `jump: {NO_JUMP}` on it to reach it directly")
                raise InventoryError(f"{path}: host {h.name!r}: jump hosts form a cycle: "
                                     f"{' -> '.join(chain + [nxt])}; set `jump: {NO_JUMP}` on one "
                                     "of them to reach it directly")
            if nxt in chain:
                break  # a cycle not through h: reported when its own hosts are checked
            chain.append(nxt)


def _resolve(spec: InventorySpec, base: Path, path: str) -> Inventory:
    seen: set[str] = set()
    hosts: list[Host] = []
    inherited: set[str] = set()
    _check_var_names(spec.vars, "field 'vars'", path)
    for g, gs in spec.groups.items():
        _check_var_names(gs.vars, f"group {g!r}", path)
    for h in spec.hosts:
        if h.name in seen:
            raise InventoryError(f"{path}: host {h.name!r}: field 'name' is a duplicate; "
                                 "host names must be unique")
        seen.add(h.name)
        for g in h.groups:
            if g not in spec.groups:
                raise InventoryError(
                    f"{path}: host {h.name!r}: field 'groups' names unknown group {g!r}; "
                    f"declare it under 'groups:' (known: {', '.join(spec.groups) or 'none'})"
                )
        _check_var_names(h.vars, f"host {h.name!r}", path)
        merged: dict[str, Any] = dict(spec.vars)
        for g in h.groups:
            merged.update(spec.groups[g].vars)
        merged.update(h.vars)
        d = spec.defaults
        jump = h.jump if h.jump is not None else d.jump
        if h.jump is None and d.jump is not None:
            inherited.add(h.name)
        hosts.append(Host(
            name=h.name,
            connection=h.connection,
            address=h.address or ("localhost" if h.connection == "local" else h.name),
            port=h.port if h.port is not None else d.port,
            user=h.user or d.user,
            identity_file=_resolve_path(h.identity_file or d.identity_file, base),
            jump=None if jump == NO_JUMP else jump,
            gpus=h.gpus,
            groups=tuple(h.groups),
            settings=_settings(h.name, merged, path),
            bmc=h.bmc,
        ))
    clash = sorted(set(spec.groups) & seen)
    if clash:
        raise InventoryError(f"{path}: group {clash[0]!r} has the same name as a host; "
                             "rename one so --host is unambiguous")
    _check_jumps(hosts, inherited, path)
    known = _resolve_path(spec.known_hosts, base) or os.path.expanduser("~/.ssh/known_hosts")
    slurm = _slurm(spec.slurm, hosts, spec.groups, path) if spec.slurm else None
    return Inventory(path=path, known_hosts=known, hosts=tuple(hosts), groups=spec.groups,
                     slurm=slurm)


def _slurm(spec: SlurmSpec, hosts: list[Host], groups: dict[str, GroupSpec], path: str) -> Slurm:
    """Resolve `slurm:` to host names; one message naming the field and what to do."""
    names = [h.name for h in hosts]
    where = f"{path}: slurm"
    if spec.controller not in names:
        raise InventoryError(f"{where}.controller: {spec.controller!r} is not a host of the "
                             f"inventory (hosts: {', '.join(names)}); name the host that runs "
                             "slurmctld")
    items = [spec.compute] if isinstance(spec.compute, str) else spec.compute
    compute: list[str] = []
    for item in items:
        if item in groups:
            found = [h.name for h in hosts if item in h.groups]
        elif item in names:
            found = [item]
        else:
            raise InventoryError(f"{where}.compute: {item!r} is neither a host nor a group "
                                 f"(hosts: {', '.join(names)}; groups: {', '.join(groups) or 'none'})")
        compute += [n for n in found if n not in compute]
    if not compute:
        raise InventoryError(f"{where}.compute: no hosts (the group(s) {', '.join(items) or '[]'} "
                             "have none); name the hosts that run slurmd")
    slurm = Slurm(controller=spec.controller, compute=tuple(compute), partition=spec.partition,
                  cluster_name=spec.cluster_name, cgroup=spec.cgroup,
                  node_timeout=spec.node_timeout)
    by_name = {h.name: h for h in hosts}
    for var in ("slurm_version", "munge_version"):
        versions = {by_name[n].settings.model_dump()[var] for n in slurm.hosts}
        if len(versions) > 1:
            raise InventoryError(f"{where}: var {var!r} differs between the cluster's hosts "
                                 f"({', '.join(sorted(versions))}); slurmctld and every slurmd "
                                 "must run the same version: set it once for all of them")
    return slurm


def resolve(address: str, where: str) -> list[str]:
    """The IP addresses of an inventory address (a literal is itself; a name resolved here,
    on the operator's machine, once per provision)."""
    try:
        return [str(ipaddress.ip_address(address))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as e:
        raise TorchrigError(f"{where}: address {address!r} does not resolve on this machine "
                            f"({e}); the firewall admits the inventory's hosts by IP: write "
                            "IP addresses in the inventory, or set var firewall: false and "
                            "manage the host firewall yourself") from None
    return sorted({info[4][0].split("%")[0] for info in infos})
