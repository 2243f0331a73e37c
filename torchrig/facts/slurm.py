"""Slurm's client commands as torchrig runs them (fixed output formats) and pure parsers of
what they print. Fixtures: tests/fixtures/slurm_* (Debian 12's Slurm 22.05 on the testbed)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# one line per node and partition: name|state|gres|reason. The state carries Slurm's suffixes
# (`idle*`: not responding, `idle~`: powered off, `drain`, `down*`), kept as printed.
SINFO = ["sinfo", "--Node", "--noheader", "--format", "%N|%T|%G|%E"]
# a job (also ended, within MinJobAge): id|state|nodes|reason|name|user|batch host
SQUEUE_FORMAT = "%i|%T|%N|%r|%j|%u|%B"


def squeue_argv(job_id: str) -> list[str]:
    return ["squeue", "--noheader", "--states", "all", "--jobs", job_id, "--format", SQUEUE_FORMAT]


def sacct_argv(job_id: str) -> list[str]:
    """After squeue forgot the job (MinJobAge): accounting, where the cluster keeps it."""
    return ["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id,
            "--format", "JobID,State,NodeList,Reason"]


# the states in which a job still holds (or will hold) its nodes
LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING",
        "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT",
        "STOPPED"}


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str        # as sinfo prints it: idle, mixed, alloc(ated), down*, idle~, drained ...
    gpus: int         # gpu GRES configured on the node (count, all types)
    reason: str

    @property
    def idle(self) -> bool:
        return self.state == "idle"


def gres_gpus(gres: str) -> int:
    """GPUs in a GRES string: `gpu:v100s:2`, `gpu:2`, `gpu:a100:4(S:0-1)`, several comma-separated
    (`gpu:a100:2,gpu:t4:1,shard:8`), `(null)` for none."""
    total = 0
    # commas also sit inside `(S:0,1)`: drop the socket part first
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_sinfo(text: str) -> dict[str, NodeState]:
    """SINFO's lines by node (a node listed in two partitions appears once)."""
    out = {}
    for ln in text.splitlines():
        f = ln.strip().split("|")
        if len(f) != 4 or not f[0]:
            continue
        out.setdefault(f[0], NodeState(f[0], f[1], gres_gpus(f[2]), f[3]))
    return out


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str        # PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, NODE_FAIL, TIMEOUT ...
    nodes: list[str]  # the allocation, in Slurm's order (SLURM_NODEID 0 first)
    reason: str

    @property
    def live(self) -> bool:
        return self.state in LIVE


def parse_squeue(text: str, job_id: str) -> JobState | None:
    for ln in text.splitlines():
        f = ln.strip().split("|")
        if len(f) == 7 and f[0] == job_id:
            return JobState(job_id, f[1], expand_hostlist(f[2]), f[3])
    return None


def parse_sacct(text: str, job_id: str) -> JobState | None:
    """sacct's allocation line; its state may read `CANCELLED by 999`."""
    for ln in text.splitlines():
        f = ln.strip().split("|")
        if len(f) == 4 and f[0] == job_id:
            nodes = [] if f[2] in ("", "None assigned") else expand_hostlist(f[2])
            return JobState(job_id, f[1].split(" ")[0], nodes, f[3])
    return None


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's hostlist syntax, as `scontrol show hostnames` expands it: `gpu[1-3,7],cpu01`
    -> gpu1 gpu2 gpu3 gpu7 cpu01 (zero padding kept: `n[08-10]` -> n08 n09 n10)."""
    out: list[str] = []
    for item in re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", spec):
        if not item:
            continue
        names = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            names = [n + text for n in names]
            if ranges:
                names = [n + x for n in names for x in _range_items(ranges)]
        out += names
    return out


def _range_items(ranges: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        a, _, b = part.partition("-")
        if not b:
            out.append(a)
            continue
        width = len(a) if a.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(a), int(b) + 1)]
    return out


def parse_sbatch(text: str) -> str | None:
    """`sbatch --parsable` prints `<job id>` or `<job id>;<cluster>`."""
    first = text.strip().splitlines()[:1]
    m = re.fullmatch(r"(\d+)(?:;\S+)?", first[0].strip()) if first else None
    return m.group(1) if m else None


def unmunge_ok(text: str) -> tuple[bool, str]:
    """(decoded, STATUS line's value) from `unmunge`'s report."""
    for ln in text.splitlines():
        key, _, value = ln.partition(":")
        if key.strip() == "STATUS":
            value = value.strip()
            return value.startswith("Success") or value == "0", value
    return False, text.strip().splitlines()[-1] if text.strip() else "no output"
