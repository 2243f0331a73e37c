#!/usr/bin/env python3
"""gpu_check's summary and verdict: stdlib only, run by bench/gpu_check.sh with its python.

    gpu_check_verdict.py OUT WORK START_EPOCH_S BUDGET_S
    gpu_check_verdict.py best OUT WORK      (prints cand-best's flags; nothing: none won)

Reads what gpu_check.sh left: WORK/env.json, WORK/nvidia_smi.txt and, per run, WORK/NAME.rc
("RC WALL_S TIMEOUT_S", or "skipped LEFT_S NEED_S" when the budget skipped it), OUT/NAME.json
(train.py --out-json) and OUT/NAME.log. Writes OUT/gpu_check.json, prints a brief JSON on
stdout and one "FAIL NAME: why" line per problem on stderr, and exits 1 if there is any: a
check that cannot show a figure must not read as a pass.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time

# name -> kind: "train" runs must produce throughput figures, "find" the batch-size search.
RUNS = {"plain": "train", "eager": "train", "compiled": "train", "find_batch": "find"}
TRAIN_FIELDS = ("steps", "final_loss", "tokens_per_s_median", "samples_per_s_median",
                "step_time_s_median", "mfu_median", "peak_flops", "flops_per_token",
                "peak_mem_gib", "peak_mem_reserved_gib", "params", "batch_size", "global_batch",
                "seq_len", "precision", "compile", "ddp", "optimizer", "device_name", "backend",
                "world_size", "torch_version")
# An exception line ("RuntimeError: ...", "torch._inductor.exc.InductorError: ...", with
# torch's "[rank0]: " prefix or not), train.py's "error: ..." or a fatal interpreter error.
ERROR_RE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+(?:Error|Exception)|error|Fatal Python "
                      r"error)(?::.*|$))")


# A speed candidate (cand-NAME) counts as a win at this ratio to `compiled`'s tokens/s or more,
# and as correct while its final loss is within LOSS_TOLERANCE (relative) of compiled's: the
# same seed and data, so only rounding and kernel order tell them apart.
WIN_RATIO = 1.02
LOSS_TOLERANCE = 0.05


def first_error_line(log_text: str) -> str | None:
    for line in log_text.splitlines():
        m = ERROR_RE.match(line.strip())
        if m:
            return m.group(1)[:400]
    return None


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def run_problems(name: str, kind: str, info: dict, budget_s: int) -> list[str]:
    """Why this run does not count as a pass (empty: it does)."""
    status = info.get("status")
    if status == "missing":
        return [f"{name}: did not run"]
    if status == "skipped":
        return [f"{name}: skipped: {info['left_s']}s of the budget left, it needs "
                f"{info['need_s']}s; raise BUDGET_S (now {budget_s})"]
    if info["rc"] != 0:
        if info["rc"] in (124, 137):
            why = f"timed out after {info['timeout_s']}s"
        else:
            why = f"exit status {info['rc']}"
        err = info.get("first_error")
        return [f"{name}: {why}; " + (f"first error: {err}" if err else
                                       f"no error line in {name}.log")]
    if kind == "find":
        bs = info.get("batch_size")
        return [] if is_number(bs) and bs > 0 else [f"{name}: no batch_size=N > 0 in {name}.log"]
    if not info.get("metrics"):
        return [f"{name}: exited 0 but wrote no metrics ({name}.json)"]
    p = []
    tps = info.get("tokens_per_s_median")
    if not (is_number(tps) and tps > 0):
        p.append(f"{name}: tokens/s is {tps!r}, not > 0")
    if not is_number(info.get("final_loss")):
        p.append(f"{name}: final loss is {info.get('final_loss')!r}, not a finite number")
    if not is_number(info.get("mfu_median")):
        p.append(f"{name}: MFU is {info.get('mfu_median')!r}: no peak FLOPS known for "
                 f"{info.get('device_name')!r} (payload/model.py PEAK_FLOPS) or no step timed")
    if info.get("optimizer") != "adamw-fused":
        p.append(f"{name}: optimizer is {info.get('optimizer')!r}, not adamw-fused")
    bs = info.get("batch_size")
    if not (is_number(bs) and bs > 0):
        p.append(f"{name}: batch size is {bs!r}, not > 0")
    return p


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _json(text: str | None):
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def run_info(out: str, work: str, name: str) -> dict:
    rc_words = (_read(os.path.join(work, f"{name}.rc")) or "").split()
    info: dict = {}
    if not rc_words:
        info["status"] = "missing"
    elif rc_words[0] == "skipped":
        info.update(status="skipped", left_s=int(rc_words[1]), need_s=int(rc_words[2]))
    else:
        info.update(status="ran", rc=int(rc_words[0]), wall_s=int(rc_words[1]),
                    timeout_s=int(rc_words[2]))
    log_text = _read(os.path.join(out, f"{name}.log")) or ""
    info["first_error"] = first_error_line(log_text)
    info["step_lines"] = [ln for ln in log_text.splitlines() if re.match(r"^step=\d+ ", ln)][-10:]
    m = _json(_read(os.path.join(out, f"{name}.json")))
    info["metrics"] = bool(m)
    if m:
        info.update({k: m.get(k) for k in TRAIN_FIELDS})
        if m.get("losses"):
            info["first_logged_loss"] = m["losses"][0][1]
    bs = re.findall(r"^batch_size=(\d+)$", log_text, re.M)
    if bs:
        info["batch_size"] = int(bs[-1])
        info["probes"] = re.findall(r"^probe (batch_size=\d+.*)$", log_text, re.M)
    return info


def summarize(out: str, work: str, start: int, budget_s: int) -> dict:
    summary = {
        "ok": None,
        "problems": [],
        "env": _json(_read(os.path.join(work, "env.json"))),
        "nvidia_smi": (_read(os.path.join(work, "nvidia_smi.txt")) or "").strip() or None,
        "budget_s": budget_s,
    }
    for name, kind in RUNS.items():
        summary[name] = info = run_info(out, work, name)
        summary["problems"] += run_problems(name, kind, info, budget_s)
    summary["candidates"] = candidates(out, work, summary["compiled"], budget_s,
                                       summary["problems"])
    c, e = summary["compiled"], summary["eager"]
    if is_number(c.get("tokens_per_s_median")) and is_number(e.get("tokens_per_s_median")) \
            and e["tokens_per_s_median"] > 0:
        summary["compile_speedup"] = c["tokens_per_s_median"] / e["tokens_per_s_median"]
    summary["ok"] = not summary["problems"]
    summary["elapsed_s"] = int(time.time()) - start
    return summary


def candidate_names(work: str) -> list[str]:
    """The candidates gpu_check.sh ran or skipped, in the order it took them (cand-NAME.flags)."""
    files = [f for f in os.listdir(work) if f.startswith("cand-") and f.endswith(".flags")]
    files.sort(key=lambda f: os.stat(os.path.join(work, f)).st_mtime_ns)
    return [f[:-len(".flags")] for f in files]


def candidates(out: str, work: str, compiled: dict, budget_s: int, problems: list) -> dict:
    """Each candidate's figures, its ratio to compiled and whether its loss agrees; its
    problems are its "problems" and are added to `problems`."""
    result = {}
    base_tps, base_loss = compiled.get("tokens_per_s_median"), compiled.get("final_loss")
    for name in candidate_names(work):
        info = run_info(out, work, name)
        info["flags"] = (_read(os.path.join(work, f"{name}.flags")) or "").strip()
        found = run_problems(name, "train", info, budget_s)
        tps, loss = info.get("tokens_per_s_median"), info.get("final_loss")
        if not found and is_number(base_tps) and base_tps > 0:
            info["vs_compiled"] = tps / base_tps
        if not found and is_number(base_loss) and base_loss > 0:
            info["loss_vs_compiled"] = loss / base_loss
            if abs(loss - base_loss) > LOSS_TOLERANCE * base_loss:
                found.append(f"{name}: final loss {loss:.4f} strays from compiled's "
                             f"{base_loss:.4f} by more than {LOSS_TOLERANCE:.0%}")
        info["problems"] = found
        problems += found
        result[name] = info
    return result


def best_flags(out: str, work: str) -> str:
    """cand-best's flags: those of every candidate that ran correctly at WIN_RATIO x compiled's
    tokens/s or more, the fastest first; a later one that sets an option already set is left
    out (two --compile-mode values cannot be had together)."""
    compiled = run_info(out, work, "compiled")
    found = candidates(out, work, compiled, 0, [])
    winners = sorted((info["tokens_per_s_median"], info["flags"]) for info in found.values()
                     if not info["problems"] and "loss_vs_compiled" in info  # loss compared
                     and info.get("vs_compiled", 0) >= WIN_RATIO)
    chosen, options = [], set()
    for _, flags in reversed(winners):
        opts = {w for w in flags.split() if w.startswith("--")}
        if not opts & options:
            chosen.append(flags)
            options |= opts
    return " ".join(chosen)


def brief(summary: dict) -> dict:
    b = {k: summary.get(k) for k in ("ok", "elapsed_s", "compile_speedup")}
    for name, kind in RUNS.items():
        if kind == "train":
            b[name] = {x: summary[name].get(x) for x in (
                "rc", "tokens_per_s_median", "mfu_median", "final_loss", "batch_size",
                "precision", "optimizer", "peak_mem_gib", "peak_mem_reserved_gib")}
    b["find_batch_size"] = summary["find_batch"].get("batch_size")
    b["candidates"] = {name: {x: c.get(x) for x in (
        "flags", "rc", "tokens_per_s_median", "mfu_median", "vs_compiled", "final_loss",
        "peak_mem_gib", "peak_mem_reserved_gib", "first_error")}
        for name, c in summary.get("candidates", {}).items()}
    b["problems"] = summary["problems"]
    return b


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "best":
        print(best_flags(argv[1], argv[2]))
        return 0
    if len(argv) != 4:
        print("error: usage: gpu_check_verdict.py OUT WORK START_EPOCH_S BUDGET_S",
              file=sys.stderr)
        return 2
    out, work = argv[0], argv[1]
    summary = summarize(out, work, int(argv[2]), int(argv[3]))
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    print(json.dumps(brief(summary), indent=2))
    for p in summary["problems"]:
        print(f"FAIL {p}", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
