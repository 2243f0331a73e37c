"""The host's firewall facts provision reads: whether torchrig's nftables table is loaded
(the command) and the kernel's ephemeral port range (the file, and its pure parser); the
table's and its unit's names (provision writes them, launch reloads the table)."""

from __future__ import annotations

TABLE = ("inet", "torchrig")
# not torchrig-<name>.service: launch reads those as jobs (busy GPUs), and a job named
# "firewall" would be this unit
UNIT = "torchrig.firewall.service"
EPHEMERAL_PATH = "/proc/sys/net/ipv4/ip_local_port_range"
EPHEMERAL_DEFAULT = (32768, 60999)   # Linux's default, when the host's cannot be read


def loaded_argv() -> list[str]:
    """Exits 0 when torchrig's table is loaded now."""
    return ["nft", "list", "table", *TABLE]


def parse_ephemeral(text: str) -> tuple[int, int]:
    """'32768\\t60999\\n' -> (32768, 60999); Linux's default for anything else."""
    parts = text.split()
    if len(parts) == 2 and all(p.isdigit() for p in parts) and 0 < int(parts[0]) <= int(parts[1]) < 65536:
        return int(parts[0]), int(parts[1])
    return EPHEMERAL_DEFAULT
