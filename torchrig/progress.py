"""The progress-line protocol on the operator's side. Its one definition is payload/progress.py
(stdlib only, pushed with every release for the jobs' scripts); this loads that same file, so
torchrig holds no copy of the format. Node-side readers (status) send raw text back; it is parsed here."""

from __future__ import annotations

from .resources import payload_module

protocol = payload_module("progress")

# where a user's script learns to print step lines (docs/payload.md's section)
DOC = "docs/payload.md#progress-lines-from-your-own-script"


def no_steps(started: bool | None = False) -> str:
    """What status, metrics and report say of a job with no step line. started: whether the
    ranks printed torchrig's start lines (True: a torchrig script, its first step not yet;
    None: not known)."""
    if started is False:
        return ("no step lines were seen (the script does not print torchrig progress lines; "
                f"see {DOC})")
    return ("no step lines were seen yet (a script that does not print torchrig progress "
            f"lines has none; see {DOC})")

Line = protocol.Line
format_line = protocol.format_line
parse = protocol.parse
start_ranks = protocol.start_ranks
is_progress = protocol.is_progress
parse_world = protocol.parse_world


def run_summary(lines) -> dict | None:
    """From rank 0's lines of a finished run: {"steps", "first_loss", "last_loss", "ckpt",
    "median_tok_s"} (None for what is missing), or None when no done line was seen."""
    parsed = [p for p in map(parse, lines) if p is not None]
    done = next((p.fields for p in reversed(parsed) if p.kind == "done"), None)
    if done is None:
        return None
    steps = [p.fields for p in parsed if p.kind == "step"]
    rates = []
    for f in steps[1:]:  # the first interval holds start-up costs
        try:
            rates.append(float(f["tok/s"]))
        except (KeyError, ValueError):
            pass
    rates.sort()
    return {"steps": done.get("step"), "first_loss": steps[0].get("loss") if steps else None,
            "last_loss": done.get("loss"), "ckpt": done.get("ckpt"),
            "median_tok_s": rates[len(rates) // 2] if rates else None}

