"""`systemctl show` output (pure)."""

from __future__ import annotations


def show_argv(units: list[str], props: list[str]) -> list[str]:
    return ["systemctl", "show", "--property=" + ",".join(props), "--", *units]


def parse_show(text: str, units: list[str]) -> dict[str, dict[str, str]]:
    """{unit: {property: value}}: systemctl prints one block per unit, in argument order,
    separated by a blank line; a unit with no block gets {}."""
    blocks = [dict(ln.split("=", 1) for ln in b.splitlines() if "=" in ln)
              for b in text.strip("\n").split("\n\n")] if text.strip() else []
    return {u: (blocks[i] if i < len(blocks) else {}) for i, u in enumerate(units)}


def unit_state(props: dict[str, str]) -> dict[str, str]:
    """provision's view of a unit: {"enabled": UnitFileState or "not-found", "active": ...}."""
    found = props.get("LoadState", "not-found") not in ("not-found", "")
    return {"enabled": (props.get("UnitFileState") or "not-found") if found else "not-found",
            "active": props.get("ActiveState") or "unknown"}
