"""provision's facts: what the planners ask for (steps.fact_request) as probe commands and
reads, and the probe's raw reply back as the facts dict the planners read (pure)."""

from __future__ import annotations

import os

from . import dpkg, netfilter, node_hw, os_release, python_env, systemd

UNIT_PROPS = ["LoadState", "UnitFileState", "ActiveState"]
EFI_SECURE_BOOT = "/sys/firmware/efi/efivars/SecureBoot-*"
DPKG_UPDATES = "/var/lib/dpkg/updates/[0-9]*"  # dpkg left half-done by an interrupted install
# What a Slurm node's gres.conf can use: GPU device files, and NVML with Slurm's NVML plugin.
NODE_GLOBS = {"dev-nvidia": "/dev/nvidia[0-9]*", "libnvidia-ml": "/usr/lib/*/libnvidia-ml.so.1",
              "slurm-gpu-nvml": "/usr/lib/*/slurm-wlm/gpu_nvml.so"}


def files_request(want: dict) -> dict:
    """The probe's stat request for want's "files" (content read back) and "secret_files"
    (a hash only: never sent back)."""
    stat = {p: True for p in want.get("files", [])}
    stat.update({p: False for p in want.get("secret_files", [])})
    return stat


def probe_request(want: dict) -> dict:
    """want: {"packages", "available" ["pkg=ver"], "files", "secret_files", "dirs", "units",
    "users", "venv", "paths"} (each optional)."""
    run = {"lspci": ["lspci", "-nn"], "mokutil": ["mokutil", "--sb-state"],
           "holds": ["apt-mark", "showhold"], "audit": ["dpkg", "--audit"],
           "nvidia-smi": ["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"],
           "firewall": netfilter.loaded_argv()}
    if want.get("packages"):
        run["dpkg-query"] = dpkg.query_argv(want["packages"])
    if want.get("available"):  # one apt-cache call for every pinned version
        run["apt-cache"] = ["apt-cache", "show", "--no-all-versions", *want["available"]]
    if want.get("units"):
        run["units"] = systemd.show_argv(want["units"], UNIT_PROPS)
    glob = {"efi-secure-boot": {"pattern": EFI_SECURE_BOOT}, "dpkg-updates": {"pattern": DPKG_UPDATES, "limit": 0}}
    # root's own files: /etc/os-release is usually a symlink, and systemd-nspawn's boot_id is
    # a deleted file bind-mounted in place (0 links): the hardened reader would refuse both
    read = {"os-release": {"path": os_release.PATH, "follow": True},
            "boot-id": {"path": "/proc/sys/kernel/random/boot_id", "limit": 4096, "follow": True},
            "port-range": {"path": netfilter.EPHEMERAL_PATH, "limit": 4096, "follow": True}}
    if want.get("node"):  # CPU topology, memory and GPU access, for slurm.conf/gres.conf
        run["lscpu"] = node_hw.LSCPU_ARGV
        read["meminfo"] = {"path": node_hw.MEMINFO, "limit": 65536, "follow": True}
        glob.update({k: {"pattern": v, "limit": 0} for k, v in NODE_GLOBS.items()})
    exists = list(want.get("paths", []))
    venv = want.get("venv")
    if venv:
        exists.append(os.path.join(venv, "bin", "python"))
        read["pyvenv.cfg"] = {"path": os.path.join(venv, "pyvenv.cfg"), "limit": 65536}
        glob["dists"] = {"pattern": os.path.join(venv, python_env.DIST_INFO.format(name="*")),
                         "limit": python_env.METADATA_LIMIT}
    stat = files_request(want)
    stat.update({p: False for p in want.get("dirs", [])})
    return {"run": run, "read": read, "glob": glob, "stat": stat, "exists": exists,
            "users": list(want.get("users", [])), "host": True}


def secure_boot(mokutil: dict, efivars: dict) -> bool:
    """mokutil if present, else the EFI variable (last byte 1 = enabled); no EFI = off."""
    text = mokutil["out"] + mokutil["err"]
    if mokutil["rc"] == 0 or "SecureBoot" in text:
        return "enabled" in text.lower() and "disabled" not in text.lower()
    data = next(iter(efivars.values()), None) if efivars else None
    return bool(data) and data[-1] == "\x01"


def facts(want: dict, raw: dict) -> dict:
    """The facts dict (same keys and shapes as before the probe) from the probe's reply."""
    run, read, host = raw["run"], raw["read"], raw["host"]
    none = {"rc": 0, "out": "", "err": ""}
    pk = dpkg.parse_query(run.get("dpkg-query", none)["out"])
    shown = dpkg.parse_apt_cache_show(run.get("apt-cache", none)["out"])
    out = {
        "os_release": (read["os-release"] or {}).get("text", ""),
        "arch": host["arch"], "kernel": host["kernel"], "euid": host["euid"],
        "boot_id": (read["boot-id"] or {}).get("text", "").strip(),
        "disk_free_gb": host["disk_free_gb"],
        "lspci": run["lspci"]["out"] if run["lspci"]["rc"] == 0 else None,
        "secure_boot": secure_boot(run["mokutil"], raw["glob"]["efi-secure-boot"]),
        "packages": pk,
        "held": dpkg.parse_holds(run["holds"]["out"]),
        # installed at that version: available whatever apt says now
        "available": {spec: spec in shown for spec in want.get("available", [])
                      if pk.get(spec.partition("=")[0]) != spec.partition("=")[2]},
        "dpkg_audit": run["audit"]["out"].strip(),
        "dpkg_updates_pending": bool(raw["glob"]["dpkg-updates"]),
        "files": {p: raw["stat"][p] for p in [*want.get("files", []), *want.get("secret_files", [])]},
        "dirs": {p: raw["stat"][p] for p in want.get("dirs", [])},
        "paths": {p: raw["exists"][p] for p in want.get("paths", [])},
        "users": raw["users"],
        # torchrig's nftables table loaded now, and the kernel's ephemeral port range
        "firewall": {"loaded": run["firewall"]["rc"] == 0,
                     "ephemeral": (read["port-range"] or {}).get("text", "")},
        "nvidia_smi": {"rc": run["nvidia-smi"]["rc"],
                       "output": (run["nvidia-smi"]["out"] + run["nvidia-smi"]["err"]).strip()[-2000:]},
    }
    units = systemd.parse_show(run.get("units", none)["out"], want.get("units", []))
    out["units"] = {u: systemd.unit_state(p) for u, p in units.items()}
    if want.get("node"):
        out["node"] = {"hostname": host["hostname"],
                       "cpu": node_hw.parse_lscpu(run["lscpu"]["out"]),
                       "mem_mib": node_hw.parse_mem_mib((read["meminfo"] or {}).get("text", "")),
                       **{k: sorted(raw["glob"][k]) for k in NODE_GLOBS}}
    venv, pyver, dists = want.get("venv"), None, {}
    if venv and raw["exists"][os.path.join(venv, "bin", "python")]:
        pyver = python_env.pyvenv_version((read["pyvenv.cfg"] or {}).get("text", "")) or "unknown"
        dists = python_env.dists(raw["glob"]["dists"].values())
    out["venv"] = {"python": pyver, "dists": dists}
    return out
