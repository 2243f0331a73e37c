"""torchrig's per-job health watcher: runs ON THE NODE as root (torchrig-health@JOB.service,
every few seconds while the job runs) from the payload release (root's). Standard library
only; `python3 -I` (nothing from the environment or the working directory).

Root because the kernel log is root's to read (a job user outside systemd-journal sees only
its own journal; dmesg may be restricted). It reads only what root's own commands print (the
kernel log, nvidia-smi) and writes one file, its record (--record, in root's jobs folder,
which no job can write), created fresh beside it and renamed over it, never through a link.

Each round compares the node with its state at the job's start (the first round of a launch
records it): an Xid logged since the start whose code is not one of --app-xids (the catalog in
torchrig/facts/xid.py renders that list: every other Xid is a node fault, the catalog's rule),
more uncorrectable ECC errors than at the start, or a row remap that became pending or failed
makes the node unhealthy. Then the record says why, and the job's unit is stopped on this node
(its part of the job ends rather than hanging in NCCL until a timeout). `status` reads the
record; the sampler (gpumon.py) exports it as torchrig_node_healthy.

The definitions of the kernel's Xid line and the commands that read the kernel log live here,
as this file is what the node runs; torchrig/facts/xid.py loads them.
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the release folder (root's): smi_xml.py beside us
import smi_xml  # noqa: E402

# both with ISO timestamps, so that a time is judged the same way everywhere
JOURNAL = ["journalctl", "-k", "-b", "-o", "short-iso", "--no-pager", "-q"]
DMESG = ["dmesg", "--time-format", "iso"]
XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})"
                      r"(?:\.[0-7])?[^)]*\):\s*(\d+),?\s*(.*)$")
# journalctl -o short-iso: 2026-12-03T14:45:00+0000 host kernel: ...;
# dmesg --time-format iso: 2026-12-03T14:45:00,123456+00:00 ...
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[,.]\d+)?([+-]\d\d:?\d\d|Z)?\s")
KEPT_UNSTAMPED = 200  # unstamped Xid lines remembered from the start (their digests)


def stamp(line):
    """The time a kernel log line is stamped with (aware datetime), or None."""
    m = STAMP.match(line)
    if not m:
        return None
    zone = (m.group(2) or "+0000").replace("Z", "+0000").replace(":", "")
    try:
        return datetime.strptime(m.group(1) + zone, "%Y-%m-%dT%H:%M:%S%z")
    except ValueError:
        return None


def kernel_text(journal, dmesg):
    """(text, source) of the kernel log from {"rc", "out", "lines"?} of JOURNAL's and DMESG's
    runs: the journal's when it has kernel lines, else dmesg's; source None when neither could
    be read. An empty journal is no proof: a user outside systemd-journal sees only their own
    journal (exit 0, nothing); a container's journal has no kernel lines. "lines": how many
    lines the command printed, where the probe kept only some of them (its "keep")."""
    if journal.get("rc") == 0 and (journal.get("out", "").strip() or journal.get("lines")):
        return journal["out"], "journalctl -k"
    if dmesg.get("rc") == 0:
        return dmesg.get("out", ""), "dmesg"
    return "", None


def _digest(line):
    return hashlib.sha256(line.strip().encode()).hexdigest()[:16]


def xid_lines(text):
    """[(code, bus, unix time or None, line)] of every Xid line of a kernel log."""
    out = []
    for line in text.replace("\r\n", "\n").split("\n"):
        m = XID_LINE.search(line)
        if m:
            when = stamp(line)
            out.append((int(m.group(2)), m.group(1).lower(),
                        when.timestamp() if when else None, line.strip()))
    return out


def new_xids(lines, since, unstamped_at_start):
    """The Xid lines logged since the job's start (`since`, unix time): stamped at or after
    it, or unstamped and not among the digests of the unstamped lines seen at the start."""
    return [x for x in lines
            if (x[2] >= since if x[2] is not None else _digest(x[3]) not in unstamped_at_start)]


def short_bus(pci_bus_id):
    """nvidia-smi's "00000000:3B:00.0" as the kernel's Xid line names it ("0000:3b:00")."""
    domain, _, rest = pci_bus_id.strip().lower().partition(":")
    return "%s:%s" % (domain[-4:], rest.rsplit(".", 1)[0])


def gpu_states(xml_text):
    """{GPU index (str): {"bus", "ecc_uncorrected", "remap_pending", "remap_failure"}} from
    `nvidia-smi -q -x` (smi_xml.parse), or {} when it printed nothing readable."""
    try:
        gpus = smi_xml.parse(xml_text) if xml_text.strip() else []
    except ValueError:
        return {}
    return {str(g.index): {"bus": short_bus(g.bus_id), "ecc_uncorrected": g.uncorrectable_volatile,
                           "remap_pending": bool(g.remap_pending),
                           "remap_failure": bool(g.remap_failure)} for g in gpus}


def findings(xids, app_xids, start_gpus, gpus):
    """What makes the node unhealthy, as records [{"kind": "xid"|"ecc"|"remap", ...}]: a
    node-fault Xid (each code and GPU once), uncorrectable ECC errors beyond the start's
    count, a row remap pending or failed that was not at the start. Pure."""
    by_bus = {g["bus"]: int(i) for i, g in gpus.items()}
    by_bus.update({g["bus"]: int(i) for i, g in start_gpus.items()})
    out, seen = [], set()
    for code, bus, when, _ in xids:
        if code in app_xids or (code, bus) in seen:
            continue
        seen.add((code, bus))
        out.append({"kind": "xid", "xid": code, "gpu": by_bus.get(bus), "bus": bus, "at": when})
    for i, now in sorted(gpus.items(), key=lambda kv: int(kv[0])):
        was = start_gpus.get(i, {})
        n, w = now.get("ecc_uncorrected"), was.get("ecc_uncorrected")
        if n is not None and n > (w or 0):
            out.append({"kind": "ecc", "gpu": int(i), "was": w or 0, "now": n})
        for what in ("pending", "failure"):
            if now.get("remap_" + what) and not was.get("remap_" + what):
                out.append({"kind": "remap", "gpu": int(i), "what": what})
    return out


def reason(f):
    """One finding in a few words (the record's reason; metrics' label sanitises it)."""
    gpu = "GPU %s" % f["gpu"] if f.get("gpu") is not None else "PCI %s" % f.get("bus")
    if f["kind"] == "xid":
        return "Xid %d on %s" % (f["xid"], gpu)
    if f["kind"] == "ecc":
        return "%d new uncorrectable ECC errors on %s" % (f["now"] - f["was"], gpu)
    return "row remap %s on %s" % (f["what"], gpu)


def judge(record, launch, since, xids, unstamped, gpus, app_xids, now):
    """The new record from the last one (None: none yet) and this round's reads. Pure.
    A record of another launch is replaced by this launch's start state; an unhealthy verdict
    stays (the node's part of the job has been stopped; the next launch starts afresh)."""
    if not record or record.get("launch") != launch:
        record = {"launch": launch, "since": since, "unstamped": sorted(unstamped)[:KEPT_UNSTAMPED],
                  "start_gpus": gpus, "healthy": True, "findings": [], "stopped_at": None}
    record = dict(record, checked_at=now)
    if not record["healthy"]:
        return record
    found = findings(new_xids(xids, record["since"], set(record["unstamped"])), app_xids,
                     record["start_gpus"], gpus)
    if found:
        record.update(healthy=False, findings=found, reason=reason(found[0]), unhealthy_at=now)
    return record


# --- effects ----------------------------------------------------------------------------------

def run(argv, timeout=30):
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return {"rc": 127, "out": ""}
    return {"rc": r.returncode, "out": r.stdout.decode(errors="replace")}


def job_start(unit):
    """The unix time the job's unit last became active (systemd's monotonic stamp, placed on
    the wall clock now), or now when systemd does not say."""
    r = run(["systemctl", "show", "-p", "ActiveEnterTimestampMonotonic", "--value", unit])
    mono = r["out"].strip()
    now = time.time()
    if r["rc"] != 0 or not mono.isdigit() or int(mono) == 0:
        return now
    return now - (time.clock_gettime(time.CLOCK_MONOTONIC) - int(mono) / 1e6)


def read_record(path):
    """The last record (root's own file; a link or anything else is no record), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return json.loads(os.read(fd, 1 << 20).decode())
    except ValueError:
        return None
    finally:
        os.close(fd)


def write_record(path, record):
    """`path` replaced whole: a new file beside it (O_EXCL: never an existing one, never
    through a link), 0644 (status and the sampler read it), renamed over it."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, ".%s.%d.tmp" % (name, os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", required=True)
    p.add_argument("--unit", required=True, help="the job's systemd unit (stopped on a fault)")
    p.add_argument("--launch", required=True, help="the launch's id (a new one starts afresh)")
    p.add_argument("--record", required=True, help="the verdict file, in root's jobs folder")
    p.add_argument("--app-xids", default="", help="comma-separated Xids that are the "
                   "application's (every other Xid is a node fault)")
    a = p.parse_args(argv)
    app_xids = {int(x) for x in a.app_xids.split(",") if x.strip().isdigit()}
    now = time.time()
    last = read_record(a.record)
    fresh = not last or last.get("launch") != a.launch
    text, source = kernel_text(run(JOURNAL), run(DMESG))
    xids = xid_lines(text)
    gpus = gpu_states(run(smi_xml.COMMAND)["out"])
    since = job_start(a.unit) if fresh else last["since"]
    # an unstamped line there at the start cannot be placed after it
    unstamped = {_digest(x[3]) for x in xids if x[2] is None} if fresh else set()
    record = judge(last, a.launch, since, xids, unstamped, gpus, app_xids, now)
    record["kernel_log"] = source
    newly = not record["healthy"] and record.get("stopped_at") is None
    if newly:
        record["stopped_at"] = now
    write_record(a.record, record)  # first: the job's last sample (ended unit) reads it
    if newly:
        print("healthwatch: %s: %s; stopping %s" % (a.job, record["reason"], a.unit), file=sys.stderr)
        # --no-block: this unit is not part of the job's, but the stop must not wait on ours
        run(["systemctl", "stop", "--no-block", a.unit])
    return 0


if __name__ == "__main__":
    sys.exit(main())
