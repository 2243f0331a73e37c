"""Expected all-reduce busbw per link class and machine (torchrig/data/busbw_thresholds.yml),
with per-inventory overrides (var busbw_min_gbs: {class: GB/s})."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

DATA = Path(__file__).resolve().parents[1] / "data" / "busbw_thresholds.yml"


@dataclass(frozen=True)
class Threshold:
    cls: str
    minimum: float
    expected: float | None
    source: str
    min_bytes: int  # read the busbw at the largest measured size >= this


@lru_cache(maxsize=1)
def _data() -> dict:
    return yaml.safe_load(DATA.read_text())


def lookup(cls: str, gpu_name: str = "", overrides: dict | None = None,
           gpu_count: int | None = None) -> Threshold | None:
    """The machine row for this GPU model, GPU count and link class if there is one, else the
    class's default; an inventory override of the class wins over both."""
    data = _data()
    entry = data["classes"].get(cls)
    if entry is None and not (overrides and cls in overrides):
        return None
    min_bytes = int((entry or {}).get("min_bytes", data["measure"]["min_bytes"]))
    if overrides and cls in overrides:
        return Threshold(cls, float(overrides[cls]), None, "inventory var busbw_min_gbs", min_bytes)
    for row in data.get("machines", []):
        if (row["match"] in gpu_name and cls in row["classes"]
                and row.get("gpus") in (None, gpu_count)):
            entry = row
            break
    return Threshold(cls, float(entry["min"]), entry.get("expected"), entry.get("source", ""),
                     min_bytes)
