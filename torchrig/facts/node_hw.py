"""A node's CPU topology and memory as Slurm describes them (pure parsers of lscpu -J and
/proc/meminfo): what slurm.conf's NodeName line says, like `slurmd -C` would."""

from __future__ import annotations

import json

LSCPU_ARGV = ["lscpu", "-J"]
MEMINFO = "/proc/meminfo"


def parse_lscpu(text: str) -> dict[str, int] | None:
    """{"cpus", "sockets", "cores", "threads"} (cores per socket, threads per core), or None
    when the output is not lscpu's JSON or lacks a field."""
    try:
        fields: dict[str, str] = {}
        rows = list(json.loads(text)["lscpu"])
        while rows:  # util-linux >= 2.39 nests rows under "children" (Ubuntu 24.04)
            r = rows.pop()
            fields.setdefault(r["field"].rstrip(":"), r.get("data"))
            rows += r.get("children", [])
        return {"cpus": int(fields["CPU(s)"]), "sockets": int(fields["Socket(s)"]),
                "cores": int(fields["Core(s) per socket"]),
                "threads": int(fields["Thread(s) per core"])}
    except (ValueError, KeyError, TypeError):
        return None


def parse_mem_mib(meminfo: str) -> int | None:
    """MemTotal in MiB, rounded down (what slurmd -C reports as RealMemory)."""
    for line in meminfo.splitlines():
        parts = line.split()
        if parts[:1] == ["MemTotal:"] and len(parts) >= 2 and parts[1].isdigit():
            return int(parts[1]) // 1024
    return None
