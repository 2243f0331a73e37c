"""provision's facts, each declared once (pyinfra's fact = command + pure parser, kept in
one probe round trip): its name, the part of the probe request it needs, its pure parser of
the probe's reply, and what a planner may read of it. The probe request (probe_request), the
facts dict (facts), the planners' view (changes/factview.py) and the fingerprint all derive
from FACTS; the planners name what they read (provision/steps.py, Step.reads), and that
builds the request (steps.fact_request).

A fact is
- plain (`facts["lspci"]`): always gathered (cheap, and the fingerprint describes the host
  by them), read only by a planner that names it;
- keyed (`facts.pkg("libnccl2")`, `facts.file(path)`): gathered for the keys the planners
  name in the want entries `asked_by` (a list; a str (one path); True (the whole fact)).

Adding a fact: one Fact(...) in FACTS (its parser in its domain module, tested on a capture
in tests/fixtures/), and its name or keys in the reads of the step that reads it."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import dpkg, netfilter, node_hw, os_release, python_env, systemd

UNIT_PROPS = ["LoadState", "UnitFileState", "ActiveState"]
EFI_SECURE_BOOT = "/sys/firmware/efi/efivars/SecureBoot-*"
DPKG_UPDATES = "/var/lib/dpkg/updates/[0-9]*"  # dpkg left half-done by an interrupted install
# What a Slurm node's gres.conf can use: GPU device files, and NVML with Slurm's NVML plugin.
NODE_GLOBS = {"dev-nvidia": "/dev/nvidia[0-9]*", "libnvidia-ml": "/usr/lib/*/libnvidia-ml.so.1",
              "slurm-gpu-nvml": "/usr/lib/*/slurm-wlm/gpu_nvml.so"}
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"]
NONE = {"rc": 0, "out": "", "err": ""}  # a command not requested (nothing asked of it)

Want = dict        # {"packages": [...], "files": [...], "venv": path, "node": True, ...}
Request = dict     # a part of the probe's request (probe_host.py's docstring)
Reply = dict       # the probe's reply


@dataclass(frozen=True)
class Fact:
    name: str                              # its key in the facts dict
    gather: Callable[[Want], Request]      # the probe request's part for it ({}: nothing)
    parse: Callable[[Reply, Want], Any]    # the probe's reply -> the fact (pure)
    asked_by: tuple[str, ...] = ()         # want keys naming what may be read; () = plain
    optional: bool = False                 # in the facts dict only when asked (the others: always)
    volatile: bool = False                 # moves by itself: left out of the fingerprint

    @property
    def plain(self) -> bool:
        return not self.asked_by

    def asked(self, want: Want) -> set:
        """What `want` asks of this fact (paths, names; True for a fact asked whole)."""
        out: set = set()
        for key in self.asked_by:
            v = want.get(key)
            out |= {v} if isinstance(v, (str, bool)) and v else set(v or ())
        return out


def _run(raw: Reply, name: str) -> dict:
    """A command's result (a reply without it is an error: its fact asked for it)."""
    return raw["run"][name]


def _run_if(raw: Reply, name: str) -> dict:
    """A command run only when its want asked for something (dpkg-query, apt-cache, units)."""
    return raw["run"].get(name, NONE)


def _text(raw: Reply, name: str) -> str:
    return (raw["read"][name] or {}).get("text", "")


def _always(**part) -> Callable[[Want], Request]:
    return lambda want: part


def secure_boot(mokutil: dict, efivars: dict) -> bool:
    """mokutil if present, else the EFI variable (last byte 1 = enabled); no EFI = off."""
    text = mokutil["out"] + mokutil["err"]
    if mokutil["rc"] == 0 or "SecureBoot" in text:
        return "enabled" in text.lower() and "disabled" not in text.lower()
    data = next(iter(efivars.values()), None) if efivars else None
    return bool(data) and data[-1] == "\x01"


def files_request(want: Want) -> dict:
    """The probe's stat request for want's "files" (content read back) and "secret_files"
    (a hash only: never sent back)."""
    stat = {p: True for p in want.get("files", [])}
    stat.update({p: False for p in want.get("secret_files", [])})
    return stat


def _available(raw: Reply, want: Want) -> dict:
    """Each pinned "pkg=ver" asked: in the package lists now. Installed at that version:
    available whatever apt says now (so not looked up)."""
    pk = dpkg.parse_query(_run_if(raw, "dpkg-query")["out"])
    shown = dpkg.parse_apt_cache_show(_run_if(raw, "apt-cache")["out"])
    return {spec: spec in shown for spec in want.get("available", [])
            if pk.get(spec.partition("=")[0]) != spec.partition("=")[2]}


def _venv_python(want: Want) -> str:
    return os.path.join(want["venv"], "bin", "python")


def _venv_gather(want: Want) -> Request:
    venv = want.get("venv")
    if not venv:
        return {}
    return {"exists": [_venv_python(want)],
            "read": {"pyvenv.cfg": {"path": os.path.join(venv, "pyvenv.cfg"), "limit": 65536}},
            "glob": {"dists": {"pattern": os.path.join(venv, python_env.DIST_INFO.format(name="*")),
                               "limit": python_env.METADATA_LIMIT}}}


def _venv(raw: Reply, want: Want) -> dict:
    pyver, dists = None, {}
    if want.get("venv") and raw["exists"][_venv_python(want)]:
        pyver = python_env.pyvenv_version(_text(raw, "pyvenv.cfg")) or "unknown"
        dists = python_env.dists(raw["glob"]["dists"].values())
    return {"python": pyver, "dists": dists}


def _node_gather(want: Want) -> Request:
    if not want.get("node"):
        return {}
    return {"run": {"lscpu": node_hw.LSCPU_ARGV},
            "read": {"meminfo": {"path": node_hw.MEMINFO, "limit": 65536, "follow": True}},
            "glob": {k: {"pattern": v, "limit": 0} for k, v in NODE_GLOBS.items()}}


def _node(raw: Reply, want: Want) -> dict:
    return {"hostname": raw["host"]["hostname"],
            "cpu": node_hw.parse_lscpu(_run(raw, "lscpu")["out"]),
            "mem_mib": node_hw.parse_mem_mib(_text(raw, "meminfo")),
            **{k: sorted(raw["glob"][k]) for k in NODE_GLOBS}}


def _units(raw: Reply, want: Want) -> dict:
    units = systemd.parse_show(_run_if(raw, "units")["out"], want.get("units", []))
    return {u: systemd.unit_state(p) for u, p in units.items()}


# root's own files below are read with follow: /etc/os-release is usually a symlink, and
# systemd-nspawn's boot_id is a deleted file bind-mounted in place (0 links): the hardened
# reader would refuse both
FACTS: tuple[Fact, ...] = (
    Fact("os_release", _always(read={"os-release": {"path": os_release.PATH, "follow": True}}),
         lambda raw, want: _text(raw, "os-release")),
    Fact("arch", _always(host=True), lambda raw, want: raw["host"]["arch"]),
    Fact("kernel", _always(host=True), lambda raw, want: raw["host"]["kernel"]),
    Fact("euid", _always(host=True), lambda raw, want: raw["host"]["euid"]),
    Fact("boot_id", _always(read={"boot-id": {"path": "/proc/sys/kernel/random/boot_id",
                                              "limit": 4096, "follow": True}}),
         lambda raw, want: _text(raw, "boot-id").strip()),
    # free space moves with every log line; preflight checks it again when applying
    Fact("disk_free_gb", _always(host=True), lambda raw, want: raw["host"]["disk_free_gb"],
         volatile=True),
    Fact("lspci", _always(run={"lspci": ["lspci", "-nn"]}),   # None: no lspci on the host
         lambda raw, want: _run(raw, "lspci")["out"] if _run(raw, "lspci")["rc"] == 0 else None),
    Fact("secure_boot", _always(run={"mokutil": ["mokutil", "--sb-state"]},
                                glob={"efi-secure-boot": {"pattern": EFI_SECURE_BOOT}}),
         lambda raw, want: secure_boot(_run(raw, "mokutil"), raw["glob"]["efi-secure-boot"])),
    Fact("packages", lambda want: ({"run": {"dpkg-query": dpkg.query_argv(want["packages"])}}
                                   if want.get("packages") else {}),
         lambda raw, want: dpkg.parse_query(_run_if(raw, "dpkg-query")["out"]), ("packages",)),
    Fact("held", _always(run={"holds": ["apt-mark", "showhold"]}),
         lambda raw, want: dpkg.parse_holds(_run(raw, "holds")["out"])),
    # one apt-cache call for every pinned version
    Fact("available", lambda want: ({"run": {"apt-cache": ["apt-cache", "show", "--no-all-versions",
                                                          *want["available"]]}}
                                    if want.get("available") else {}),
         _available, ("available",)),
    Fact("dpkg_audit", _always(run={"audit": ["dpkg", "--audit"]}),
         lambda raw, want: _run(raw, "audit")["out"].strip()),
    Fact("dpkg_updates_pending", _always(glob={"dpkg-updates": {"pattern": DPKG_UPDATES, "limit": 0}}),
         lambda raw, want: bool(raw["glob"]["dpkg-updates"])),
    Fact("files", lambda want: {"stat": files_request(want)} if files_request(want) else {},
         lambda raw, want: {p: raw["stat"][p]
                            for p in [*want.get("files", []), *want.get("secret_files", [])]},
         ("files", "secret_files")),
    Fact("dirs", lambda want: {"stat": {p: False for p in want["dirs"]}} if want.get("dirs") else {},
         lambda raw, want: {p: raw["stat"][p] for p in want.get("dirs", [])}, ("dirs",)),
    Fact("paths", lambda want: {"exists": list(want["paths"])} if want.get("paths") else {},
         lambda raw, want: {p: raw["exists"][p] for p in want.get("paths", [])}, ("paths",)),
    Fact("users", lambda want: {"users": list(want.get("users", []))},
         lambda raw, want: raw["users"], ("users",)),
    # torchrig's nftables table loaded now, and the kernel's ephemeral port range
    Fact("firewall", _always(run={"firewall": netfilter.loaded_argv()},
                             read={"port-range": {"path": netfilter.EPHEMERAL_PATH, "limit": 4096,
                                                  "follow": True}}),
         lambda raw, want: {"loaded": _run(raw, "firewall")["rc"] == 0,
                            "ephemeral": _text(raw, "port-range")}),
    Fact("nvidia_smi", _always(run={"nvidia-smi": NVIDIA_SMI}),
         lambda raw, want: {"rc": _run(raw, "nvidia-smi")["rc"],
                            "output": (_run(raw, "nvidia-smi")["out"]
                                       + _run(raw, "nvidia-smi")["err"]).strip()[-2000:]}),
    Fact("units", lambda want: ({"run": {"units": systemd.show_argv(want["units"], UNIT_PROPS)}}
                                if want.get("units") else {}),
         _units, ("units",)),
    # CPU topology, memory and GPU access, for slurm.conf/gres.conf
    # node and venv: asked by a flag / one path, read whole (Facts.node(), Facts.venv(path))
    Fact("node", _node_gather, _node, ("node",), optional=True),
    Fact("venv", _venv_gather, _venv, ("venv",)),
)


# Derived from FACTS when called (nothing else to keep in step with it).
def plain() -> frozenset[str]:
    return frozenset(f.name for f in FACTS if f.plain)


def volatile() -> frozenset[str]:
    return frozenset(f.name for f in FACTS if f.volatile)


def want_keys() -> dict[str, str]:
    """want key -> the fact it asks of (what a planner's reads may name besides plain facts)."""
    return {k: f.name for f in FACTS for k in f.asked_by}


def probe_request(want: Want) -> Request:
    """The one probe request for these wants: every declared fact's part, merged."""
    req: Request = {"run": {}, "read": {}, "glob": {}, "stat": {}, "exists": [], "users": [],
                    "host": True}
    for f in FACTS:
        for key, part in f.gather(want).items():
            if isinstance(part, dict):
                req[key].update(part)
            elif isinstance(part, list):
                req[key] += [x for x in part if x not in req[key]]
    return req


def facts(want: Want, raw: Reply) -> dict:
    """The facts dict the planners read (changes/factview.Facts) from the probe's reply."""
    return {f.name: f.parse(raw, want) for f in FACTS if not f.optional or f.asked(want)}
