"""torchrig's Prometheus metrics: the one definition of every series the per-job sampler
(gpumon.py) writes for node_exporter's textfile collector, and of the text format both ways.
Python standard library only: it is pushed with every payload release (the sampler runs from
there), and torchrig loads this same file on the operator's side (`invoke metrics`, the tests of
examples/monitoring/), so a name exists in one place.

Every series carries the labels `job` and `node`; GPU series add `gpu` (nvidia-smi's index),
job series `rank` (the rank whose progress lines they come from: rank 0 prints them).
"""

import json
import math
import re

GPU = ("job", "node", "gpu")
JOB = ("job", "node", "rank")
NODE = ("job", "node")

# name -> (type, help, labels, key: its short name in `invoke metrics` output and JSON)
METRICS = {
    "torchrig_gpu_utilization_percent": (
        "gauge", "GPU utilisation in percent (nvidia-smi utilization.gpu)", GPU, "util_percent"),
    "torchrig_gpu_memory_used_bytes": ("gauge", "GPU memory in use, bytes", GPU, "mem_used_bytes"),
    "torchrig_gpu_memory_total_bytes": ("gauge", "GPU memory in all, bytes", GPU, "mem_total_bytes"),
    "torchrig_gpu_temperature_celsius": (
        "gauge", "GPU core temperature, degrees Celsius", GPU, "temp_celsius"),
    "torchrig_gpu_power_watts": ("gauge", "GPU power draw, watts", GPU, "power_watts"),
    "torchrig_gpu_ecc_errors_corrected_total": (
        "counter", "corrected ECC errors since the driver loaded (volatile count)", GPU,
        "ecc_corrected"),
    "torchrig_gpu_ecc_errors_uncorrected_total": (
        "counter", "uncorrected ECC errors since the driver loaded (volatile count)", GPU,
        "ecc_uncorrected"),
    "torchrig_gpu_clock_throttle": (
        "gauge", "1 while this reason holds the GPU's clocks down (clocks_throttle_reasons.active)",
        GPU + ("reason",), "throttle"),
    "torchrig_job_step": ("gauge", "the last training step a progress line reported", JOB, "step"),
    "torchrig_job_loss": ("gauge", "the loss of that line", JOB, "loss"),
    "torchrig_job_tokens_per_second": ("gauge", "tokens per second, all ranks together", JOB, "tok/s"),
    "torchrig_job_samples_per_second": (
        "gauge", "samples per second, all ranks together", JOB, "samples/s"),
    "torchrig_job_mfu_ratio": (
        "gauge", "model FLOPs utilisation per GPU (0-1), where known", JOB, "mfu"),
    "torchrig_job_last_progress_age_seconds": (
        "gauge", "seconds since the last progress line", JOB, "last_progress_age_s"),
    "torchrig_job_restarts": (
        "gauge", "restarts of the job: torchrun worker-group restarts in the newest run plus "
        "systemd restarts of the agent", NODE, "restarts"),
    "torchrig_job_state": ("gauge", "1 for the job unit's systemd state on this node",
                           NODE + ("state",), "state"),
    "torchrig_node_healthy": (
        "gauge", "0 once the node's health watcher found a fault since the job's start (a "
        "node-fault Xid, new uncorrectable ECC errors, a row remap) and stopped the node's part "
        "of the job, else 1; reason: the fault, short", NODE + ("reason",), "healthy"),
    "torchrig_sample_timestamp_seconds": (
        "gauge", "unix time the sampler wrote this file", NODE, "sampled_at"),
}
STATES = ("active", "activating", "deactivating", "reloading", "inactive", "failed")
# the progress-line field behind each job series (payload/progress.py's step/done lines)
PROGRESS_FIELDS = {"torchrig_job_step": "step", "torchrig_job_loss": "loss",
                   "torchrig_job_tokens_per_second": "tok/s",
                   "torchrig_job_samples_per_second": "samples/s", "torchrig_job_mfu_ratio": "mfu"}
# nvidia-smi --query-gpu fields, in the order the sampler asks for them (one call)
GPU_FIELDS = ("index", "utilization.gpu", "memory.used", "memory.total", "temperature.gpu",
              "power.draw", "ecc.errors.corrected.volatile.total",
              "ecc.errors.uncorrected.volatile.total", "clocks_throttle_reasons.active")
MIB = 1 << 20
GPU_SERIES = {  # field -> (series, scale)
    "utilization.gpu": ("torchrig_gpu_utilization_percent", 1),
    "memory.used": ("torchrig_gpu_memory_used_bytes", MIB),
    "memory.total": ("torchrig_gpu_memory_total_bytes", MIB),
    "temperature.gpu": ("torchrig_gpu_temperature_celsius", 1),
    "power.draw": ("torchrig_gpu_power_watts", 1),
    "ecc.errors.corrected.volatile.total": ("torchrig_gpu_ecc_errors_corrected_total", 1),
    "ecc.errors.uncorrected.volatile.total": ("torchrig_gpu_ecc_errors_uncorrected_total", 1),
}
# NVML's clocks throttle reason bits (nvml.h nvmlClocksThrottleReason*)
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*\Z')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


def number(text):
    """A float from nvidia-smi's or a progress line's text ('41.2%' -> 0.412), or None for
    '[N/A]', 'n/a', '[Not Supported]' and anything else that is not a number."""
    text = str(text).strip()
    try:
        if text.endswith("%"):
            return round(float(text[:-1]) / 100, 12)
        if text.lower().startswith("0x"):
            return float(int(text, 16))
        return float(text)
    except ValueError:
        return None


def _escape(v):
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _unescape(v):
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), v)


def _value(v):
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if v != int(v) or abs(v) >= 1e15 else str(int(v))


def render(samples):
    """The text format for [(name, {label: value}, float)]: each family once, with its HELP
    and TYPE, in METRICS' order. ValueError for a name not defined above or missing labels."""
    by_name = {}
    for name, labels, value in samples:
        if name not in METRICS:
            raise ValueError("metric %r is not defined in payload/metrics.py" % (name,))
        want = METRICS[name][2]
        if set(labels) != set(want):
            raise ValueError("metric %s: labels %s, expected %s" % (name, sorted(labels), list(want)))
        by_name.setdefault(name, []).append((labels, value))
    out = []
    for name, (kind, help_, want, _) in METRICS.items():
        if name not in by_name:
            continue
        out.append("# HELP %s %s" % (name, help_.replace("\\", "\\\\").replace("\n", "\\n")))
        out.append("# TYPE %s %s" % (name, kind))
        for labels, value in by_name[name]:
            body = ",".join('%s="%s"' % (k, _escape(labels[k])) for k in want)
            out.append("%s{%s} %s" % (name, body, _value(value)))
    return "\n".join(out) + "\n" if out else ""


def parse(text, prefix="torchrig_"):
    """[(name, {label: value}, float)] of the samples in exposition text whose name starts with
    `prefix` (comments and other series skipped; a malformed line is skipped, not an error)."""
    out = []
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, body, value = m.groups()
        labels, pos = {}, 0
        body = body or ""
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if not lm:
                break
            labels[lm.group(1)] = _unescape(lm.group(2))
            pos = lm.end()
        v = number(value)
        if v is not None and pos >= len(body.rstrip()):
            out.append((name, labels, v))
    return out


def gpu_samples(csv_text, job, node):
    """The GPU series from `nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits`;
    fields a GPU does not support ([N/A]) are left out."""
    out = []
    for line in csv_text.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != len(GPU_FIELDS) or not cols[0].isdigit():
            continue
        row = dict(zip(GPU_FIELDS, cols))
        base = {"job": job, "node": node, "gpu": row["index"]}
        for field, (name, scale) in GPU_SERIES.items():
            v = number(row[field])
            if v is not None:
                out.append((name, base, v * scale))
        mask = number(row["clocks_throttle_reasons.active"])
        if mask is not None:
            for bit, reason in THROTTLE_REASONS.items():
                out.append(("torchrig_gpu_clock_throttle", dict(base, reason=reason),
                            1.0 if int(mask) & bit else 0.0))
    return out


def _rows(csv_text):
    return [[c.strip() for c in ln.split(",")] for ln in csv_text.splitlines()
            if len(ln.split(",")) == len(GPU_FIELDS) and ln.split(",")[0].strip().isdigit()]


def util_line(csv_text, now):
    """The `<unix time>,<util %>,...` line `invoke status` reads (gpu_util.csv), or None."""
    rows = _rows(csv_text)
    return "%d,%s" % (now, ",".join(r[1] for r in rows)) if rows else None


def mem_line(csv_text, now):
    """The `<unix time>,<used MiB>,<total MiB>,...` line (each GPU's pair), or None."""
    rows = _rows(csv_text)
    return "%d,%s" % (now, ",".join("%s,%s" % (r[2], r[3]) for r in rows)) if rows else None


def restarts(nrestarts, attempt):
    """A node's restarts of the job, THE definition (`invoke status`, `invoke report` and this
    series show this one number): torchrun's worker-group restarts in the newest run (its
    attempt number: a run starts at attempt 0) plus systemd's restarts of the agent (the unit's
    NRestarts). None when neither is known."""
    if nrestarts is None and attempt is None:
        return None
    return int(nrestarts or 0) + int(attempt or 0)


def job_samples(job, node, rank, fields, age, restarts, state, now):
    """The job series: from the last progress line's fields (None: no line yet), its age in
    seconds, the restarts and the unit's state."""
    base = {"job": job, "node": node}
    out = []
    if fields is not None:
        ranked = dict(base, rank=str(rank))
        for name, key in PROGRESS_FIELDS.items():
            v = number(fields.get(key, ""))
            if v is not None:
                out.append((name, ranked, v))
        if age is not None:
            out.append(("torchrig_job_last_progress_age_seconds", ranked, max(0.0, age)))
    if restarts is not None:
        out.append(("torchrig_job_restarts", base, float(restarts)))
    if state:
        for s in STATES + (() if state in STATES else (state,)):
            out.append(("torchrig_job_state", dict(base, state=s), 1.0 if s == state else 0.0))
    out.append(("torchrig_sample_timestamp_seconds", base, float(int(now))))
    return out


def health_samples(job, node, record_text):
    """torchrig_node_healthy from the health watcher's record (healthwatch.py's JSON; None or
    unreadable: no watcher round yet, no series). The reason label is kept short and to
    [a-z0-9_] (the record is root's, but a label is no place for free text)."""
    try:
        record = json.loads(record_text) if record_text else None
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("healthy"), bool):
        return []
    why = "" if record["healthy"] else re.sub(r"[^a-z0-9]+", "_", str(record.get("reason", "")).lower())
    return [("torchrig_node_healthy", {"job": job, "node": node, "reason": why.strip("_")[:40]},
             1.0 if record["healthy"] else 0.0)]


def prom_name(job):
    """The job's file in the textfile directory (node_exporter reads only *.prom)."""
    return "torchrig_%s.prom" % job
