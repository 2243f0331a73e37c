"""Expected all-reduce busbw per link class (torchrig/data/busbw_thresholds.yml), with
per-inventory overrides (var busbw_min_gbs: {class: GB/s})."""

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


@lru_cache(maxsize=1)
def _table() -> dict:
    return yaml.safe_load(DATA.read_text())["classes"]


def lookup(cls: str, gpu_name: str = "", overrides: dict | None = None) -> Threshold | None:
    if overrides and cls in overrides:
        return Threshold(cls, float(overrides[cls]), None, "inventory var busbw_min_gbs")
    entry = _table().get(cls)
    if entry is None:
        return None
    for m in entry.get("by_gpu", []):
        if m["match"] in gpu_name:
            entry = m
            break
    else:
        entry = entry.get("default", entry)
    return Threshold(cls, float(entry["min"]), entry.get("expected"), entry.get("source", ""))
