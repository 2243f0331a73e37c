"""data's pure parts: who sends to whom, what `data ls` says of the nodes' copies, and which
running jobs keep a dataset from changing.

Fan-out: the operator sends each byte once, to one node (the seed); then every node that holds
the whole dataset serves one node that does not, round after round (1, 2, 4, ... sources),
over the cluster network. Nodes that already hold it are sources from the first round. A node
that cannot be reached from its source gets its bytes from the operator instead."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

OPERATOR = ""  # the source name of a transfer from the operator's machine
SAFE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")  # data.pull's file name


def rounds(holders: list[str], needy: list[str]) -> list[list[tuple[str, str]]]:
    """[(source, destination), ...] per round. With no holder, the first needy node is
    seeded by the operator (round 0: [(OPERATOR, it)]). Each round, every holder serves at
    most one destination; a served node is a holder from the next round on."""
    have, todo, out = list(holders), list(needy), []
    if not have and todo:
        seed = todo.pop(0)
        out.append([(OPERATOR, seed)])
        have.append(seed)
    while todo:
        pairs = [(src, todo.pop(0)) for src in list(have) if todo]
        out.append(pairs)
        have.extend(dst for _, dst in pairs)
    return out


@dataclass
class NodeCopy:
    """One node's copy of a dataset, as its `ls` reported it (None: not there)."""
    host: str
    sha256: str | None = None
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    error: str | None = None


def agreement(copies: list[NodeCopy]) -> list[str]:
    """Why the nodes' copies are not one dataset (empty: every node holds the same verified
    bytes): a node without it, a node whose files changed, a node with another version."""
    why = []
    for c in copies:
        if c.error:
            why.append(f"{c.host}: {c.error}")
        elif c.sha256 is None:
            why.append(f"{c.host}: not there")
        for p in c.problems:
            why.append(f"{c.host}: {p}")
    versions = {c.sha256 for c in copies if c.sha256}
    if len(versions) > 1:
        by = {}
        for c in copies:
            if c.sha256:
                by.setdefault(c.sha256, []).append(c.host)
        why.append("different versions: " + "; ".join(
            f"{', '.join(hosts)} {sha[:16]}" for sha, hosts in sorted(by.items())))
    return why


def users(rows, name: str) -> list[str]:
    """The running jobs (jobs.JobRow) whose launch used dataset `name`."""
    return sorted(r.job for r in rows if r.running and r.data == name)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
