"""verify --bandwidth's busbw sweeps, kept on the operator's side for `torchrig report`.

The nodes keep nothing of a benchmark run (it runs from a private temporary folder), so the
operator keeps the last sweep per host: STATE_DIR/bandwidth/<host>.json (folder 0700, files 0600,
written to a temporary name and renamed), with the host's address so a host of the same name in
another inventory is not mistaken for it. STATE_DIR is $TORCHRIG_STATE_DIR, else
$XDG_STATE_HOME/torchrig, else ~/.local/state/torchrig.

busbw is recomputed from each size's bytes and time (verify's own arithmetic), never taken from
the benchmark's output."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..facts import busbw as busbw_math
from ..localfiles import write_atomic


def state_dir() -> Path:
    if os.environ.get("TORCHRIG_STATE_DIR"):
        return Path(os.environ["TORCHRIG_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "torchrig"


def sweep(result: dict | None) -> list[list[float]]:
    """[[bytes, busbw GB/s], ...] of an allreduce_bench JSON result, by size."""
    n = (result or {}).get("world_size") or 0
    out = []
    for r in (result or {}).get("rows", []):
        try:
            nbytes, t = float(r["bytes"]), float(r["time_us"])
        except (KeyError, TypeError, ValueError):
            continue
        if n >= 1 and t > 0:
            out.append([nbytes, round(busbw_math.busbw("all_reduce", nbytes, t / 1e6, n), 6)])
    return sorted(out)


def records(bandwidth: list[dict], addresses: dict[str, str], now: float) -> dict[str, dict]:
    """verify's bandwidth entries -> {host: its record}: the in-node sweep ("node") and the
    across-nodes one it took part in ("cluster"). Pure."""
    out: dict[str, dict] = {}
    for b in bandwidth:
        if b.get("scope") not in ("node", "cluster") or not sweep(b.get("result")):
            continue
        entry = {"hosts": b["hosts"], "status": b["check"].status,
                 "world_size": b["result"].get("world_size"), "points": sweep(b["result"])}
        for h in b["hosts"]:
            rec = out.setdefault(h, {"host": h, "address": addresses.get(h), "time": now})
            rec[b["scope"]] = entry
    return out


def save(bandwidth: list[dict], addresses: dict[str, str], folder: Path | None = None) -> list[Path]:
    """Write each host's record (replacing its previous one); the paths written."""
    folder = (folder or state_dir()) / "bandwidth"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    written = []
    for host, rec in records(bandwidth, addresses, time.time()).items():
        write_atomic(folder / f"{host}.json", json.dumps(rec).encode(), 0o600)
        written.append(folder / f"{host}.json")
    return written


def load(hosts: list, folder: Path | None = None) -> dict[str, dict]:
    """{host name: record} for the hosts with a saved sweep taken at their current address."""
    folder = (folder or state_dir()) / "bandwidth"
    out = {}
    for h in hosts:
        try:
            rec = json.loads((folder / f"{h.name}.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("address") == h.address:
            out[h.name] = rec
    return out
