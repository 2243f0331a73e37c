"""Elastic jobs (`launch --nodes MIN:MAX`), the pure parts: the flag's value, torchrun's
rendezvous settings for a membership that changes, the bound on a node's loss, and what
`status` says about such a job. Nothing here connects or runs anything.

The rendezvous endpoint is not one node's alone: every node's unit gets the ordered list of
the job's nodes' endpoints (TORCHRIG_RDZV_CANDIDATES); payload/torchrig_torchrun.py joins the
first one that answers, or hosts the store itself when none answers within its turn
(CANDIDATE_TURN_S times its place in the list). When the node hosting the store is lost,
the survivors' torchrun exits with STORE_LOST, systemd restarts it (RestartForceExitStatus=)
and the next candidate takes over. docs/jobs.md states the limits.
"""

from __future__ import annotations

import re

from ..errors import TorchrigError

NODES_RE = re.compile(r"([0-9]{1,4})(?::([0-9]{1,4}))?")

# torchrun's exit status (payload/torchrig_torchrun.py) when its rendezvous store is gone:
# the unit restarts it (RestartForceExitStatus=) and it picks the next endpoint that answers
STORE_LOST = 75  # EX_TEMPFAIL
# the wrapper's list of the job's endpoints, in the order they take the store over
CANDIDATES_ENV = "TORCHRIG_RDZV_CANDIDATES"
# seconds a candidate waits per place in the list for an earlier one to answer before it
# hosts the store itself (room for the earlier node's torchrun to start its store)
CANDIDATE_TURN_S = 20
# torch c10d settings for a changing membership (--rdzv-conf): a store that stops answering
# is given up after READ_TIMEOUT_S (torch: 60); once MIN nodes joined, a rendezvous waits
# LAST_CALL_S for more (torch: 30)
READ_TIMEOUT_S = 20
LAST_CALL_S = 10
# torch's keep-alive: a node silent for 3 x 5 s is dropped from the rendezvous
HEARTBEAT_S = 15
RESTART_SEC = 5  # the unit's RestartSec=
ELASTIC_MAX_RESTARTS = 10  # --max-restarts' default for an elastic job: each loss uses one


def parse_nodes(value) -> tuple[int, int] | None:
    """`--nodes N` -> (N, N); `MIN:MAX` -> (MIN, MAX); None -> None. One error for the rest."""
    if value is None:
        return None
    m = NODES_RE.fullmatch(str(value).strip()) if not isinstance(value, bool) else None
    lo = int(m.group(1)) if m else 0
    hi = int(m.group(2)) if m and m.group(2) is not None else lo
    if not m or lo < 1 or hi < lo:
        raise TorchrigError(f"--nodes {value!r}: expected N or MIN:MAX, whole numbers with "
                            "1 <= MIN <= MAX (e.g. 2 or 2:3)")
    return lo, hi


def is_elastic(nodes: tuple[int, int] | None) -> bool:
    return nodes is not None and nodes[0] < nodes[1]


def rdzv_conf() -> dict[str, int]:
    """torch c10d's further --rdzv-conf entries of an elastic job (is_host, join_timeout
    aside)."""
    return {"last_call_timeout": LAST_CALL_S,
            "read_timeout": READ_TIMEOUT_S}


def candidates(addresses: list[str], port: int) -> str:
    """TORCHRIG_RDZV_CANDIDATES: the nodes' endpoints in launch order."""
    return ",".join(f"{a}:{port}" for a in addresses)


def loss_bound_s(nodes: int, start_s: int = 60) -> int:
    """Seconds from a node's loss until the survivors train again, at most (docs/jobs.md):
    the loss seen (a dead peer's socket, else the store's read timeout or the keep-alive),
    the unit's restart and the last candidate's turn when the store's node was the one lost,
    the rendezvous' last call, and `start_s` for the workers to start and load the checkpoint."""
    return (max(READ_TIMEOUT_S, HEARTBEAT_S) + RESTART_SEC + CANDIDATE_TURN_S * (nodes - 1)
            + LAST_CALL_S + start_s)


SPAN_RE = re.compile(r", elastic ([0-9]+):([0-9]+)\)$")


def description(lo: int, hi: int) -> str:
    """What the unit's Description= adds for an elastic job (status reads it back: span_of)."""
    return f", elastic {lo}:{hi}"


def span_of(unit_description: str) -> tuple[int, int] | None:
    m = SPAN_RE.search(unit_description or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


# a node's state as status has it (ActiveState; a Slurm job's state, lower case, stands in)
UP_STATES = ("active", "activating", "reloading", "running", "completing")
FAILED_STATES = ("failed", "node_fail", "timeout", "out_of_memory")


def summary(nodes: list, world_of=None, span: tuple[int, int] | None = None) -> dict | None:
    """status' line about an elastic job from its nodes' states (Outcome results: .ok and
    .value, job_state.state's dict): {"span", "state", "world"}; None for another job.
    world_of: the world line's parser (progress.parse_world). span: (MIN, MAX) where no unit
    holds it (a Slurm job's record); else the units' Description."""
    got = [r.value for r in nodes if r.ok and isinstance(r.value, dict)]
    span = span or next((s for s in (span_of(d["unit"].get("Description", "")) for d in got)
                         if s), None)
    if span is None:
        return None
    up = sum(1 for d in got if d["unit"].get("ActiveState") in UP_STATES)
    failed = any(d["unit"].get("ActiveState") in FAILED_STATES for d in got)
    worlds = [(w["step"], line, w) for line, w in
              ((d.get("world"), world_of(d["world"]) if d.get("world") and world_of else None)
               for d in got) if w]
    world = max(worlds, key=lambda x: x[0]) if worlds else None
    return {"span": f"{span[0]}:{span[1]}",
            "state": describe(span[0], span[1], up, len(got), world and world[2]["nodes"],
                              failed),
            "world": world and world[1]}


def describe(lo: int, hi: int, up: int, reachable: int, world_nodes: int | None,
             failed: bool) -> str:
    """What an elastic job does, for `status`. up: its nodes whose unit runs; reachable: its
    nodes that answered; world_nodes: the nodes of its latest world line (None: none yet);
    failed: a node's unit ended failed."""
    if up == 0:
        if failed and reachable < lo:
            return f"below MIN: ended ({reachable} of {hi} nodes reachable, min {lo})"
        return "ended: failed" if failed else "ended"
    if up < lo:
        return (f"below MIN: {up} of {hi} nodes up (min {lo}); waiting for a node to rejoin "
                "until the rendezvous timeout, then it ends")
    if world_nodes is None or world_nodes == up:
        return f"running on {up} of {hi} nodes (min {lo})"
    if world_nodes > up:  # a node went away since the last world line
        return (f"lost a node: {up} of {hi} nodes up (min {lo}), re-forming from "
                f"{world_nodes}")
    return (f"waiting for a node to rejoin: {up} of {hi} nodes up (min {lo}), "
            f"training on {world_nodes}")


def flag_value(args: list[str], name: str) -> str | None:
    """The last value of `--name V` / `--name=V` in a script's arguments (None: not given)."""
    got = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            got = args[i + 1]
        elif a.startswith(name + "="):
            got = a.split("=", 1)[1]
    return got


def check_global_batch(args: list[str], world_sizes: list[int]) -> None:
    """The example payload's --global-batch must divide at every world size the job may run
    at (an elastic job's MIN..MAX nodes): refused before anything starts, with the payload's
    own words (payload/global_batch.py). Arguments the payload would refuse are left to it."""
    g, b = flag_value(args, "--global-batch"), flag_value(args, "--batch-size")
    if g is None or not g.isdigit() or (b is not None and not b.isdigit()):
        return
    from ..resources import payload_module
    gb = payload_module("global_batch")
    micro = int(b) if b is not None else gb.DEFAULT_MICRO_BATCH  # the payload's own default
    for w in world_sizes:
        try:
            gb.grad_accum_for(int(g), micro, w)
        except gb.BatchError as e:
            raise TorchrigError(f"nothing started: at a world size of {w} ranks (of "
                                f"{', '.join(map(str, world_sizes))}): {e}") from None
