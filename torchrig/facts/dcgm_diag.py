"""``dcgmi diag -r N -j``: DCGM's diagnostic, one result per test and GPU. Pure.

Two JSON shapes: DCGM 3.x puts everything under "DCGM GPU Diagnostic", 4.x under "DCGM
Diagnostic" (its changelog's breaking changes), both as test_categories -> tests -> results;
4.x adds a per-test "test_summary". A result's GPU is "gpu_id" (older) or "gpu_ids"; its
status Pass/Fail/Warn/Skip (any case). dcgmi may print a line before the JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass

STATUSES = {"pass": "PASS", "fail": "FAIL", "warn": "WARN", "warning": "WARN", "skip": "SKIP",
            "skipped": "SKIP", "not run": "SKIP", "notrun": "SKIP"}
TOPS = ("DCGM GPU Diagnostic", "DCGM Diagnostic")


@dataclass(frozen=True)
class TestResult:
    category: str
    name: str
    gpu: str | None
    status: str          # PASS | FAIL | WARN | SKIP
    info: str = ""       # the first warning / info text DCGM gave


def _status(s) -> str:
    return STATUSES.get(str(s).strip().lower(), str(s).strip().upper())


def _info(r: dict) -> str:
    for key in ("warnings", "info", "errors"):
        v = r.get(key)
        if isinstance(v, list) and v:
            v = v[0]
        if isinstance(v, dict):
            v = v.get("warning") or v.get("message") or v.get("msg") or ""
        if v:
            return str(v)
    return ""


def parse(text: str) -> list[TestResult]:
    start = text.find("{")
    try:
        doc = json.loads(text[start:]) if start >= 0 else None
    except ValueError as e:
        raise ValueError(f"not dcgmi's JSON ({e})") from None
    top = next((doc[k] for k in TOPS if isinstance(doc, dict) and k in doc), None)
    if not isinstance(top, dict):
        raise ValueError(f"no {' / '.join(repr(k) for k in TOPS)} object in dcgmi's JSON")
    out = []
    for cat in top.get("test_categories") or []:
        for t in cat.get("tests") or []:
            results = t.get("results") or []
            for r in results:
                gpu = r.get("gpu_id", r.get("gpu_ids", r.get("entity_id")))
                out.append(TestResult(cat.get("category", ""), t.get("name", ""),
                                      None if gpu is None else str(gpu), _status(r.get("status")),
                                      _info(r)))
            if not results and isinstance(t.get("test_summary"), dict):
                out.append(TestResult(cat.get("category", ""), t.get("name", ""), None,
                                      _status(t["test_summary"].get("status")),
                                      _info(t["test_summary"])))
    return out
