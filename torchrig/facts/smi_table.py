"""The default ``nvidia-smi`` table: versions, per-GPU summary, process list.

Pure: ``parse(text)`` reads the boxed table. Prefer ``smi_query`` for facts a
program decides on; this parser exists for output people paste and for the
one-line versions in the banner (NVIDIA-SMI / Driver / CUDA).

Layouts handled: the wide one (drivers >= ~535, 89 columns, name and persistence
in a 41-column cell), the older narrow one (79 columns, names truncated with
``...``), with or without the ``MIG M.`` third line per GPU, processes with or
without the GI/CI columns, and an empty process list with or without the
"No running processes found" line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchrig.facts._text import finite, lines as _lines

COMMAND: list[str] = ["nvidia-smi"]


def command() -> list[str]:
    return list(COMMAND)


@dataclass(frozen=True)
class TableGpu:
    index: int
    name: str
    name_truncated: bool  # narrow layout cuts long names: "Tesla V100-SXM2..."
    persistence_mode: bool | None
    bus_id: str  # as printed: "00000000:B4:00.0"
    display_active: bool | None
    ecc_uncorrected: int | None  # None for N/A (no ECC) or Off
    fan_pct: int | None
    temperature_c: int | None
    perf_state: str | None  # "P0"
    power_usage_w: float | None
    power_cap_w: float | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    utilization_gpu_pct: int | None
    compute_mode: str | None  # "Default", "E. Process", ...
    mig_mode: str | None  # "Disabled", "Enabled"; None for N/A or absent


@dataclass(frozen=True)
class Process:
    gpu: int
    gi: str | None  # MIG GPU instance id ("N/A" -> None); None in the old layout
    ci: str | None
    pid: int
    type: str  # C, G, C+G, M, M+C ...
    name: str
    memory_mib: int | None


@dataclass(frozen=True)
class SmiTable:
    smi_version: str | None
    driver_version: str | None
    cuda_version: str | None  # None when printed as N/A
    timestamp: str | None  # first line, when present
    gpus: tuple[TableGpu, ...]
    processes: tuple[Process, ...]


_BANNER = re.compile(
    r"NVIDIA-SMI\s+(?P<smi>\S+)\s+Driver Version:\s*(?P<drv>\S+)(?:\s+CUDA Version:\s*(?P<cuda>\S+))?"
)
_BUS = re.compile(r"([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s+(On|Off)?")
_NAME_CELL = re.compile(r"^\s*(\d+)\s+(.*?)\s+(On|Off)\s*$")
_NAME_CELL_NOPM = re.compile(r"^\s*(\d+)\s+(.*?)\s*$")
_MEM = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB")
_TIMESTAMP = re.compile(r"^\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4}$")
_PROC = re.compile(
    r"^\s*(?P<gpu>\d+)\s+(?:(?P<gi>\S+)\s+(?P<ci>\S+)\s+)?(?P<pid>\d+)\s+(?P<type>[A-Z][A-Z+]*)\s+"
    r"(?P<name>.+?)\s+(?P<mem>\d+\s*MiB|N/A)\s*$"
)


def _cells(line: str) -> list[str]:
    """``| a | b | c |`` -> ["a", "b", "c"] (raw, unstripped)."""
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|"):
        s = s[:-1]
    return s.split("|")


def _opt_int(s: str | None) -> int | None:
    if s is None:
        return None
    m = re.match(r"^\s*(\d+)", s)
    return int(m.group(1)) if m else None


def _opt_float(s: str | None) -> float | None:
    if s is None:
        return None
    m = re.match(r"^\s*(\d+(?:\.\d+)?)", s)
    try:
        return finite(m.group(1)) if m else None
    except ValueError:  # hundreds of digits overflow to inf
        return None


def _onoff(s: str | None) -> bool | None:
    return {"On": True, "Off": False}.get((s or "").strip())


def _parse_gpu(block: list[list[str]]) -> TableGpu | None:
    first = block[0]
    if len(first) < 3:
        return None
    m = _NAME_CELL.match(first[0])
    pm = None
    if m:
        index, name, pm = int(m.group(1)), m.group(2).strip(), m.group(3)
    else:
        m = _NAME_CELL_NOPM.match(first[0])
        if not m:
            return None
        index, name = int(m.group(1)), m.group(2).strip()
    bus = _BUS.search(first[1])
    if not bus:
        return None
    ecc_raw = first[2].strip()

    fan = temp = perf = pw_use = pw_cap = None
    mem_used = mem_total = util = None
    compute = mig = None
    if len(block) > 1 and len(block[1]) >= 3:
        c0, c1, c2 = block[1][0], block[1][1], block[1][2]
        toks = c0.split()
        # "29%   31C    P8             20W /  250W" / "N/A   38C    P0    38W / 300W"
        if toks:
            fan = _opt_int(toks[0]) if toks[0].endswith("%") else None
        t = re.search(r"\b(\d+)C\b", c0)
        temp = int(t.group(1)) if t else None
        p = re.search(r"\b(P\d+)\b", c0)
        perf = p.group(1) if p else None
        pw = re.search(r"(N/A|\d+(?:\.\d+)?W)\s*/\s*(N/A|\d+(?:\.\d+)?W)", c0)
        if pw:
            pw_use, pw_cap = _opt_float(pw.group(1)), _opt_float(pw.group(2))
        mm = _MEM.search(c1)
        if mm:
            mem_used, mem_total = int(mm.group(1)), int(mm.group(2))
        u = re.match(r"^\s*(N/A|\d+\s*%)\s+(.*?)\s*$", c2)
        if u:
            util = _opt_int(u.group(1))
            compute = u.group(2) or None
    if len(block) > 2 and len(block[2]) >= 3:
        mig_raw = block[2][2].strip()
        mig = None if mig_raw in ("", "N/A") else mig_raw
    return TableGpu(
        index=index,
        name=name,
        name_truncated=name.endswith("..."),
        persistence_mode=_onoff(pm),
        bus_id=bus.group(1),
        display_active=_onoff(bus.group(2)),
        ecc_uncorrected=_opt_int(ecc_raw) if re.fullmatch(r"\d+", ecc_raw) else None,
        fan_pct=fan,
        temperature_c=temp,
        perf_state=perf,
        power_usage_w=pw_use,
        power_cap_w=pw_cap,
        memory_used_mib=mem_used,
        memory_total_mib=mem_total,
        utilization_gpu_pct=util,
        compute_mode=compute,
        mig_mode=mig,
    )


def parse(text: str) -> SmiTable:
    """Parse the default ``nvidia-smi`` output. Raises ValueError without the banner line."""
    lines = _lines(text)
    banner = None
    timestamp = None
    for ln in lines:
        if timestamp is None and _TIMESTAMP.match(ln.strip()):
            timestamp = ln.strip()
        banner = _BANNER.search(ln)
        if banner:
            break
    if banner is None:
        raise ValueError("no 'NVIDIA-SMI ... Driver Version:' banner found")
    cuda = banner.group("cuda")

    # GPU section: from the first "|===" line to the end of the first box.
    gpus: list[TableGpu] = []
    processes: list[Process] = []
    section = "pre"
    block: list[list[str]] = []

    def flush() -> None:
        if block:
            g = _parse_gpu(block)
            if g is not None:
                gpus.append(g)
            block.clear()

    for ln in lines:
        s = ln.strip()
        if section == "pre":
            if s.startswith("|==="):
                section = "gpus"
            continue
        if section == "gpus":
            if s.startswith("+-") or s.startswith("|-"):
                flush()
                continue
            if not s or not s.startswith("|"):
                flush()
                section = "between"
                continue
            cells = _cells(s)
            # A new GPU starts with a line whose first cell begins with its index.
            if block and re.match(r"^\s*\d+\s+\S", cells[0]):
                flush()
            block.append(cells)
            continue
        if section == "between":
            if "Processes:" in s:
                section = "proc-head"
            continue
        if section == "proc-head":
            if s.startswith("|==="):
                section = "procs"
            continue
        if section == "procs":
            if s.startswith("+-") or not s.startswith("|"):
                break
            body = s.strip("|")
            m = _PROC.match(body)
            if m:
                gi, ci = m.group("gi"), m.group("ci")
                processes.append(
                    Process(
                        gpu=int(m.group("gpu")),
                        gi=None if gi in (None, "N/A") else gi,
                        ci=None if ci in (None, "N/A") else ci,
                        pid=int(m.group("pid")),
                        type=m.group("type"),
                        name=m.group("name").strip(),
                        memory_mib=_opt_int(m.group("mem")),
                    )
                )
    flush()
    return SmiTable(
        smi_version=banner.group("smi"),
        driver_version=banner.group("drv"),
        cuda_version=None if cuda in (None, "N/A") else cuda,
        timestamp=timestamp,
        gpus=tuple(gpus),
        processes=tuple(processes),
    )
