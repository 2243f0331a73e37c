"""A job's state for `torchrig status`: its unit, torchrun's per-rank logs, GPU use and the
sampler's utilisation file, as probe reads, and the probe's raw reply back as status's dict
(pure). Everything under the log folder was written by the job: the probe reads it without
following links (probe_host.py), and every value here is parsed defensively."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone

from .. import progress as protocol
from ..job import RUNNING_STATES  # still runs (or stops) its job: an uptime, not an end
from ..resources import payload_module
from ..terminal import printable
from . import systemd, xid

_metrics = payload_module("metrics")  # the one definition of a node's restarts

UNIT_PROPS = ["ActiveState", "SubState", "Result", "NRestarts", "ActiveEnterTimestampMonotonic",
              "InactiveEnterTimestampMonotonic", "ExecMainStatus", "LoadState", "Description"]
GPU_QUERY = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total",
             "--format=csv,noheader,nounits"]


def _ranks_tree(logdir: str, tail: int, name: str = "stdout.log") -> dict:
    # <logdir>/<run>/attempt_<N>/<local rank>/stdout.log (torchrun's layout): the newest
    # attempt's rank folders, each with the tail of its stdout.log (or `name`)
    return {"root": logdir, "walk": [r"[^.].*", r"attempt_\d+"], "then": [r"\d+"],
            "read": {"name": name, "tail": tail, "first_line": name == "stdout.log", "mtime": True}}


HEALTH_LIMIT = 64 << 10  # the health watcher's record (a few hundred bytes; its start state)
LOG_TAIL = 64 << 10  # bytes of each rank's stdout.log status reads (its newest progress line)


def probe_request(unit: str, logdir: str, util_file: str, util_tail: int,
                  kept: dict | None = None, health_file: str | None = None) -> dict:
    """status' reads of a node. util_tail: bytes of the sampler's file (what the low-use
    check looks back over). kept: a `status --watch`'s tails from the last round (follow()):
    each file is read from where that round ended, not its whole tail again. health_file: the
    node's health watcher's record (job.health_record), read whole each round."""
    req = {"run": {"unit": systemd.show_argv([unit], UNIT_PROPS),
                   "gpus": {"argv": GPU_QUERY, "timeout": 30}},
           "tree": {"logs": _ranks_tree(logdir, LOG_TAIL)},
           "read": {"util": {"path": util_file, "limit": util_tail, "tail": True},
                    **({"health": {"path": health_file, "limit": HEALTH_LIMIT}}
                       if health_file else {})},
           "host": True}
    if kept is not None:
        req["tree"]["logs"]["since"] = {p: _since(k) for p, k in kept.get("files", {}).items()
                                        if _since(k)}
        req["read"]["util"]["since"] = _since(kept.get("util"))
    return req


def util_tail(window_s: int, gpus: int | None, sample_s: int) -> int:
    """Bytes of the sampler's file that hold what status reads of it (util_samples: two
    low-use windows): a line is `<unix time>,<util %>,...`, at most 4 bytes a GPU; twice that
    here, for at least 8 GPUs (the inventory's count may be missing or short)."""
    return (2 * window_s // sample_s + 2) * (16 + 8 * max(gpus or 0, 8))


def _since(kept: dict | None) -> list | None:
    return [kept["ino"], kept["end"]] if kept and "end" in kept else None


def _tail(kept: dict | None, got: dict | None, most: int) -> dict | None:
    """A file's tail as one read of its last `most` characters would give it, from the tail
    kept so far and the bytes a read added after it (probe_host.py read_at's `since`); a read
    that did not go on from where the kept one ended (a new file, a gap) replaces it."""
    if got is None:
        return None
    if kept and got.get("ino") == kept.get("ino") and got.get("start") == kept.get("end"):
        got = {**got, "text": (kept["text"] + got["text"])[-most:],
               **({"first_line": kept["first_line"]} if "first_line" in kept else {})}
    return got


def follow(kept: dict, raw: dict, util_tail: int) -> None:
    """A `status --watch` round's reply (probe_request with `kept`) made whole, in place: each
    file's text becomes its tail so far, as a full read would give it (state() reads it as
    it reads a single status); `kept` takes the tails for the next round."""
    logs = raw["tree"]["logs"]
    old = kept.get("files", {})
    logs["files"] = {p: _tail(old.get(p), got, LOG_TAIL) for p, got in logs["files"].items()}
    raw["read"]["util"] = _tail(kept.get("util"), raw["read"]["util"], util_tail)
    kept["files"] = {p: got for p, got in logs["files"].items() if got is not None}
    kept["util"] = raw["read"]["util"]


def start_request(unit: str, logdir: str, seen: str | None = None, wait: float = 0.0) -> dict:
    """What launch asks while a job starts: the unit's state, the newest attempt's rank
    folders (torchrun makes them once the rendezvous completed, as it spawns the workers) and
    the node's clock (how long ago that was). seen: the digest of the last answer (its
    "seen"): the node answers when that changed, or after `wait` seconds (the probe's
    "until"), so a node spawning slowly costs a round trip per change, not per poll (no
    digest: answered at once). Between the unit's looks (systemctl, every UNTIL_EVERY_S) the
    node looks at the rank folders alone every UNTIL_QUICK_S: a spawn is seen that soon (a look
    every UNTIL_EVERY_S cost launch a tenth of a second on average; a command started every
    UNTIL_QUICK_S slowed the start itself on small hosts). Nothing of the rank files is read
    (their names only): the answer changes with the job's state, not with its output."""
    tree = {**_ranks_tree(logdir, 0), "read": {"name": "stdout.log", "tail": 0}}
    return {"run": {"unit": systemd.show_argv([unit], START_PROPS)}, "tree": {"logs": tree},
            "host": True, "until": {"seconds": wait if seen else 0, "every": UNTIL_EVERY_S,
                                    "seen": seen, "quick": UNTIL_QUICK_S}}


UNTIL_EVERY_S = 0.2  # how often a node looks again while launch waits on it (systemctl show, reads)
UNTIL_QUICK_S = 0.05  # how often it looks at the rank folders alone meanwhile (no command)


START_PROPS = ["ActiveState", "Result", "ActiveEnterTimestampMonotonic"]


def start_state(unit: str, raw: dict) -> tuple[str, str, int, float | None]:
    """(ActiveState, Result, workers spawned, seconds since their spawn) from start_request's
    reply, counting only an attempt folder made since the unit's last start: an earlier
    launch of the same job left its runs' folders in the job's log folder (None, 0 workers:
    none yet)."""
    props = systemd.parse_show(raw["run"]["unit"]["out"], [unit])[unit]
    state, result = props.get("ActiveState", ""), props.get("Result", "")
    logs, clock = raw["tree"]["logs"], raw.get("host") or {}
    dirs = [m for _, m in logs["dirs"] if isinstance(m, (int, float))]
    enter = _seconds(props, "ActiveEnterTimestampMonotonic")
    now, mono = clock.get("time"), clock.get("monotonic")
    if not dirs or not all(isinstance(v, (int, float)) for v in (now, mono)):
        return state, result, 0 if not dirs else len(logs["files"]), None
    if enter is not None and max(dirs) < now - (mono - enter) - START_SLACK_S:
        return state, result, 0, None  # the newest attempt is an earlier launch's
    return state, result, len(logs["files"]), max(0.0, round(now - max(dirs), 2))


START_SLACK_S = 0.5  # a folder's time against the unit's start (two clocks of one node)


def started(unit: str, raw: dict) -> tuple[str, str, int]:
    """(ActiveState, Result, workers spawned) from start_request's reply."""
    props = systemd.parse_show(raw["run"]["unit"]["out"], [unit])[unit]
    return (props.get("ActiveState", ""), props.get("Result", ""),
            len(raw["tree"]["logs"]["files"]))


STDERR_TAIL = 8192  # bytes of each rank's stderr.log an early failure's report reads


def failure_request(logdir: str) -> dict:
    """What launch reads of a job whose first attempt failed at once: the tail of each rank's
    stderr.log in the newest attempt (the job's files: read without following a link)."""
    return {"tree": {"err": _ranks_tree(logdir, STDERR_TAIL, "stderr.log")}}


def failure_lines(raw: dict, lines: int) -> tuple[int, list[str]] | None:
    """(local rank, its last `lines` non-empty stderr lines) of the lowest local rank that
    wrote any, from failure_request's reply; None when none did. Raw text: the caller
    redacts and sanitises it."""
    found = []
    for path, got in raw["tree"]["err"]["files"].items():
        rank = path.split("/")[-2]
        text = (got or {}).get("text", "")
        kept = [ln for ln in text.splitlines() if ln.strip()]
        if kept and rank.isascii() and rank.isdigit():
            found.append((int(rank), kept[-lines:]))
    return min(found) if found else None


def _seconds(props: dict, name: str) -> float | None:
    """A *TimestampMonotonic property in seconds; None when unset (0) or unreadable."""
    try:
        v = int(props.get(name, "0")) / 1e6
    except ValueError:
        return None
    return v or None


def uptime(props: dict, monotonic_now: float) -> float | None:
    """Seconds since the unit last became active, while it still runs; None once it ended."""
    start = _seconds(props, "ActiveEnterTimestampMonotonic")
    if start is None or props.get("ActiveState") not in RUNNING_STATES:
        return None
    return round(monotonic_now - start, 1)


def ended(props: dict, now: float, monotonic_now: float) -> dict:
    """For a unit that ran and ended (inactive or failed): {"ended_at": unix time, "ran_s":
    seconds from its last start to its end}, from systemd's monotonic timestamps and the
    host's clocks (the wall time of the end is the host's now minus how long ago it was).
    {} for a unit that still runs or never ran."""
    start = _seconds(props, "ActiveEnterTimestampMonotonic")
    end = _seconds(props, "InactiveEnterTimestampMonotonic")
    if (props.get("ActiveState") in RUNNING_STATES or start is None or end is None
            or end < start):
        return {}
    return {"ended_at": round(now - (monotonic_now - end), 1), "ran_s": round(end - start, 1)}


def attempts(dirs: list) -> tuple[int | None, int]:
    """(newest attempt number, how many torchrun starts) from ["run/attempt_N", mtime] pairs."""
    if not dirs:
        return None, 0
    newest = max((m, rel) for rel, m in dirs)[1]
    return int(newest.rsplit("_", 1)[1]), len({rel.split("/")[0] for rel, _ in dirs})


def progress(files: dict) -> str | None:
    """The last progress line of rank 0's stdout.log in the newest attempt (else of the first
    rank that has one)."""
    found = None
    for path in sorted(files, key=lambda p: p.split("/")[-2]):
        got = files[path]
        if got is None:
            continue
        ranks = protocol.start_ranks(got.get("first_line", ""))
        steps = [ln for ln in got["text"].splitlines() if protocol.is_progress(ln)]
        rank = ranks[0] if ranks else None
        if steps and (rank == 0 or found is None):
            found = steps[-1]
    return found


def world_line(files: dict) -> str | None:
    """rank 0's latest world line (payload/progress.py: every (re)start prints one) in the
    newest attempt that has one on this node; None where rank 0 never ran here."""
    found = None
    for path in sorted(files, key=lambda p: p.split("/")[-2]):
        got = files[path]
        ranks = protocol.start_ranks(got.get("first_line", "")) if got else None
        if got and ranks and ranks[0] == 0:
            lines = [ln for ln in got["text"].splitlines() if protocol.parse_world(ln)]
            found = lines[-1] if lines else found
    return found


# characters of a script's last line a node's state keeps: status shows fewer (SHOWN_LINE in
# launch/status.py), cut after the redactor ran, so no secret is cut in two before it is masked
LAST_LINE_MAX = 4096


def _last_text_line(text: str) -> str | None:
    """The last line with something on it; of a line a progress bar redraws with carriage
    returns, the last drawing (what a terminal would show)."""
    for ln in reversed(text.splitlines()):
        for part in reversed(ln.split("\r")):
            if part.strip():
                return part.strip()
    return None


def last_line(files: dict) -> str | None:
    """The last line a script printed, for a job whose ranks print no progress lines (a user's
    own script): from rank 0's stdout.log (the rank whose start line says rank 0, else local
    rank 0), or, when that rank printed nothing, the newest (by file mtime) of any rank's;
    control characters shown as \\xNN (terminal.printable), at most LAST_LINE_MAX characters.
    None when no rank printed a line."""
    found = []  # (is rank 0, is local rank 0, mtime, line)
    for path in sorted(files, key=lambda p: p.split("/")[-2]):
        got = files[path]
        line = _last_text_line(got.get("text", "")) if got else None
        if line is None:
            continue
        ranks = protocol.start_ranks(got.get("first_line", ""))
        mtime = got.get("mtime")
        found.append((ranks is not None and ranks[0] == 0, path.split("/")[-2] == "0",
                      mtime if isinstance(mtime, (int, float)) else 0.0, line))
    if not found:
        return None
    line = max(found, key=lambda f: f[:3])[3]  # rank 0, else local rank 0, else the newest
    line = printable(line[:LAST_LINE_MAX + 1])
    return line if len(line) <= LAST_LINE_MAX else line[:LAST_LINE_MAX - 1] + "…"


def gpus(r: dict) -> list[dict]:
    if r["rc"] != 0:
        return []
    return [dict(zip(("index", "util", "mem_used", "mem_total"), (x.strip() for x in ln.split(","))))
            for ln in r["out"].splitlines() if ln.count(",") == 3]


def util_samples(text: str, now: float, window_s: int) -> list:
    """[(age s, [util %, ...])] of the sampler's "time,util,util..." lines within two windows.
    The job can write this file: nan, inf and 1e400 are skipped, not a traceback."""
    samples = []
    for ln in text.splitlines():
        try:
            t, _, utils = ln.strip().partition(",")
            t, utils = float(t), [float(u) for u in utils.split(",") if u.strip()]
        except ValueError:
            continue
        if all(map(math.isfinite, [t, *utils])):
            samples.append((t, utils))
    return [(round(now - t), u) for t, u in samples if now - t <= window_s * 2]


def restarts(props: dict, attempt: int | None) -> int | None:
    """A node's restarts of the job from its unit's properties (NRestarts) and torchrun's
    attempt in the newest run: payload/metrics.py's definition, which status, report and the
    metrics series all show."""
    n = props.get("NRestarts")
    return _metrics.restarts(int(n) if isinstance(n, str) and n.isascii() and n.isdigit()
                             else None, attempt)


def _shown_progress(files: dict) -> dict:
    """{"progress": the last progress line, "last_line": None}, or for a script that prints
    none (yet), {"progress": None, "last_line": the last line it printed}."""
    p = progress(files)
    return {"progress": p, "last_line": None if p is not None else last_line(files)}


def _finding_text(f: dict) -> str:
    """One finding of the node's health watcher in words, with the catalog's meaning."""
    gpu = f"GPU {f['gpu']}" if isinstance(f.get("gpu"), int) else f"PCI {f.get('bus')}"
    if f.get("kind") == "xid" and isinstance(f.get("xid"), int):
        info = xid.CATALOG.get(f["xid"])
        return f"Xid {f['xid']} on {gpu}: " + (info.what if info else "not in torchrig's catalog")
    if f.get("kind") == "ecc":
        return f"{f.get('now', 0) - f.get('was', 0)} new uncorrectable ECC errors on {gpu}"
    return f"row remap {f.get('what')} on {gpu}"


def node_health(text: str | None) -> dict | None:
    """The health watcher's record (payload/healthwatch.py's JSON, root's) as status shows it:
    {"healthy", "reason" (words, the catalog's), "stopped_at" (unix time or None), "checked_at"};
    None before its first round (or an older launch without it)."""
    try:
        rec = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("healthy"), bool):
        return None
    found = [f for f in rec.get("findings") or [] if isinstance(f, dict)]
    reason = "; ".join(_finding_text(f) for f in found[:3]) or None
    stopped = rec.get("stopped_at")
    if reason and isinstance(stopped, (int, float)):
        hms = datetime.fromtimestamp(stopped, timezone.utc).strftime("%H:%M:%S UTC")
        reason += f"; node's part stopped at {hms}"
    blind = "kernel_log" in rec and rec["kernel_log"] is None  # its last round read no log
    return {"healthy": rec["healthy"], "reason": printable(reason) if reason else None,
            "stopped_at": stopped if isinstance(stopped, (int, float)) else None,
            "checked_at": rec.get("checked_at"),
            "note": "the health watch could not read the kernel log (journalctl -k, dmesg): "
                    "Xids are not watched here" if blind else None}


def state(unit: str, raw: dict, window_s: int) -> dict:
    props = systemd.parse_show(raw["run"]["unit"]["out"], [unit])[unit]
    logs = raw["tree"]["logs"]
    attempt, starts = attempts(logs["dirs"])
    util = (raw["read"]["util"] or {}).get("text", "")
    clock = raw["host"]
    return {"unit": props, "uptime_s": uptime(props, clock["monotonic"]),
            "ended_at": None, "ran_s": None, **ended(props, clock["time"], clock["monotonic"]),
            "attempt": attempt, "torchrun_starts": starts, **_shown_progress(logs["files"]),
            "world": world_line(logs["files"]),
            "restarts": restarts(props, attempt),
            "gpus": gpus(raw["run"]["gpus"]),
            "util_samples": util_samples(util, raw["host"]["time"], window_s),
            "health": node_health((raw["read"].get("health") or {}).get("text"))}


