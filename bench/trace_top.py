#!/usr/bin/env python3
"""Where a profiled step's GPU time goes: the GPU kernels of a torch.profiler chrome trace
(train.py --profile-steps A:B), summed by name. Stdlib only (gpu_check.sh runs it).

    trace_top.py TRACE.json STEPS [--top 25]

Prints the GPU's busy time per step against the kernels' wall span (what is left is the GPU
idle: launch gaps, host syncs), then the top kernels by time per step, each with its share of
the busy time and a family (gemm, attention, cross-entropy, optimizer, triton: Inductor's
fused kernels, other) summed at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

# The first pattern that matches a kernel's name names its family.
FAMILIES = (
    ("attention", re.compile(r"flash|fmha|sdpa|cudnn.*attn|attention", re.I)),
    ("gemm", re.compile(r"gemm|sm90_xmma|cutlass|cublas|nvjet|wgmma", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("cross-entropy", re.compile(r"log_softmax|softmax|nll_loss|cross_entropy", re.I)),
    ("triton", re.compile(r"^triton_", re.I)),
)


def family(name: str) -> str:
    return next((f for f, pat in FAMILIES if pat.search(name)), "other")


def kernels(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of each GPU kernel event."""
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]


def summarize(trace: dict, steps: int, top: int = 25) -> dict:
    ks = kernels(trace)
    if not ks:
        return {"kernels": 0}
    by_name: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for name, _, dur in ks:
        by_name[name] += dur
        count[name] += 1
    busy = sum(by_name.values())
    span = max(t + d for _, t, d in ks) - min(t for _, t, _ in ks)
    fams: dict[str, float] = defaultdict(float)
    for name, t in by_name.items():
        fams[family(name)] += t
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "kernels": len(ks),
        "busy_ms_per_step": busy / 1e3 / steps,
        "span_ms_per_step": span / 1e3 / steps,
        "top": [{"name": n, "ms_per_step": t / 1e3 / steps, "share": t / busy,
                 "calls_per_step": count[n] / steps, "family": family(n)} for n, t in rows],
        "families": {f: {"ms_per_step": t / 1e3 / steps, "share": t / busy}
                     for f, t in sorted(fams.items(), key=lambda kv: -kv[1])},
    }


def render(s: dict) -> str:
    if not s["kernels"]:
        return "no GPU kernels in the trace"
    out = [f"GPU busy {s['busy_ms_per_step']:.1f} ms of a {s['span_ms_per_step']:.1f} ms span "
           f"per step ({s['kernels']} kernels)",
           f"{'ms/step':>8} {'share':>6} {'calls':>6}  family        kernel"]
    for r in s["top"]:
        out.append(f"{r['ms_per_step']:8.2f} {r['share']:6.1%} {r['calls_per_step']:6.0f}  "
                   f"{r['family']:<13} {r['name'][:110]}")
    out.append("families: " + ", ".join(f"{f} {v['ms_per_step']:.1f} ms ({v['share']:.0%})"
                                        for f, v in s["families"].items()))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("steps", type=int)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    try:
        with open(a.trace) as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        print(f"error: cannot read the trace {a.trace}: {e}", file=sys.stderr)
        return 1
    print(render(summarize(trace, a.steps, a.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
