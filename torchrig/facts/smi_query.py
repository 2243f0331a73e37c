"""``nvidia-smi --query-gpu=... --format=csv``: typed per-GPU facts, and NVML failure outputs.

Pure: ``command()`` gives the argv, ``parse(text)`` reads its output,
``parse_csv`` reads any ``--format=csv`` output (with or without header/units),
``detect_failure(text, exit_code)`` recognises the well-known ways nvidia-smi
fails instead of printing data.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from typing import Any

from torchrig.facts._text import finite, normalize

QUERY_FIELDS: list[str] = [
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "driver_version",
    "memory.total",
    "persistence_mode",
    "ecc.mode.current",
    "ecc.errors.uncorrected.volatile.total",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
    "utilization.gpu",
    "memory.used",
    "compute_cap",
]


def command(fields: list[str] | None = None) -> list[str]:
    """argv for a header-less, unit-less CSV query of ``fields`` (default QUERY_FIELDS)."""
    return [
        "nvidia-smi",
        "--query-gpu=" + ",".join(fields or QUERY_FIELDS),
        "--format=csv,noheader,nounits",
    ]


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    pci_bus_id: str  # as printed: "00000000:18:00.0"
    driver_version: str
    memory_total_mib: int | None
    persistence_mode: bool | None
    ecc_mode: bool | None  # None: no ECC on this GPU ([N/A])
    ecc_errors_uncorrected_volatile: int | None
    pcie_gen_current: int | None
    pcie_gen_max: int | None
    pcie_width_current: int | None
    pcie_width_max: int | None
    utilization_gpu_pct: int | None
    memory_used_mib: int | None
    compute_cap: str | None  # "9.0"

    @property
    def compute_cap_tuple(self) -> tuple[int, int] | None:
        if not self.compute_cap:
            return None
        major, _, minor = self.compute_cap.partition(".")
        return int(major), int(minor or 0)


class QueryError(ValueError):
    """The output is not the expected CSV; ``failure`` is set when it is a known NVML failure."""

    def __init__(self, message: str, failure: "Failure | None" = None):
        super().__init__(message)
        self.failure = failure


# ----------------------------------------------------------------------------- value typing

_MISSING = re.compile(r"^\[.*\]$|^N/A$|^$")  # [N/A], [Not Supported], [Unknown Error], N/A
_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?$")
_BOOL = {"Enabled": True, "Disabled": False, "Yes": True, "No": False}
_UNIT_VALUE = re.compile(r"^([+-]?\d+(?:\.\d+)?)\s*(MiB|GiB|KiB|B|%|W|MHz|GHz|C|s|ms|us|V|mW)$")


def _missing(value: str) -> bool:
    return bool(_MISSING.match(value.strip()))


def _int(value: str) -> int | None:
    value = value.strip()
    if _missing(value):
        return None
    m = _UNIT_VALUE.match(value)
    if m:
        value = m.group(1)
    if _INT.match(value):
        return int(value)
    if _FLOAT.match(value):
        return int(finite(value))
    raise ValueError(f"not an integer: {value!r}")


def _bool(value: str) -> bool | None:
    value = value.strip()
    if _missing(value):
        return None
    if value in _BOOL:
        return _BOOL[value]
    raise ValueError(f"not Enabled/Disabled: {value!r}")


def _str(value: str) -> str | None:
    value = value.strip()
    return None if _missing(value) else value


# Fields nvidia-smi prints as text even when they look like numbers: a driver "470.10" is not
# the number 470.1, a compute_cap "8.0" not 8, a serial keeps its leading zeros.
STRING_FIELDS = frozenset({
    "name", "gpu_name", "uuid", "gpu_uuid", "serial", "gpu_serial", "vbios_version",
    "driver_version", "pci.bus_id", "gpu_bus_id", "pci.domain", "pci.bus", "pci.device",
    "pci.device_id", "pci.sub_device_id", "compute_cap", "timestamp", "pstate", "compute_mode",
    "inforom.img", "inforom.oem", "inforom.ecc", "inforom.pwr", "gpu_part_number", "board_id",
})


def convert(value: str, unit: str | None = None, field: str | None = None) -> Any:
    """Type one CSV cell: None for N/A-like; the text itself for a STRING_FIELDS field; else
    strip a unit and give an int/float/bool if it looks like one."""
    value = value.strip()
    if _missing(value):
        return None
    if field in STRING_FIELDS:
        return value
    m = _UNIT_VALUE.match(value)
    if m and (unit is None or m.group(2) == unit):
        value = m.group(1)
    if _INT.match(value):
        return int(value)
    if _FLOAT.match(value):
        try:
            return finite(value)
        except ValueError:
            return None  # 1e999, nan: no reading
    if value in _BOOL:
        return _BOOL[value]
    return value


# ------------------------------------------------------------------------------ CSV parsing

_HEADER_UNIT = re.compile(r"^(.*?)\s*\[([^\]]*)\]\s*$")
# A header cell: a field name as --query-gpu takes it, with an optional " [unit]".
_HEADER_CELL = re.compile(r"^[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*(?:\s*\[[^\]]*\])?$")


def _rows(text: str) -> list[list[str]]:
    body = [ln for ln in normalize(text).split("\n") if ln.strip()]
    return [[c.strip() for c in row] for row in csv.reader(body, skipinitialspace=True)]


def _is_header(row: list[str]) -> bool:
    return bool(row) and all(_HEADER_CELL.match(c) for c in row)


def _names(row: list[str]) -> list[str]:
    return [_HEADER_UNIT.sub(r"\1", h) for h in row]


def header_name(field: str) -> str:
    """The name nvidia-smi's CSV header prints for a --query-gpu field: some are printed under
    their newer name (driver 580 on an H200: clocks.sm -> clocks.current.sm,
    clocks_throttle_reasons.* -> clocks_event_reasons.*; tests/fixtures/querygpu_02)."""
    if field.startswith("clocks_throttle_reasons."):
        return "clocks_event_reasons." + field.split(".", 1)[1]
    return _CURRENT_CLOCKS.get(field, field)


# --help-query-gpu's short forms of the current clocks (the max.* short forms print as asked)
_CURRENT_CLOCKS = {"clocks.sm": "clocks.current.sm", "clocks.gr": "clocks.current.graphics",
                   "clocks.mem": "clocks.current.memory", "clocks.video": "clocks.current.video"}


def parse_csv(text: str, fields: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse ``--format=csv`` output into dicts of typed values.

    With ``fields=None`` the first line must be the header (``memory.total [MiB]``): names
    lose their ``[unit]`` and values lose that unit (``"23028 MiB"`` -> 23028); header-less
    output is refused (its columns cannot be named). With ``fields`` given the text may be
    header-less (``noheader``); a header line is skipped if it names ``fields`` and refused
    if it names others. Values of STRING_FIELDS stay text. Raises QueryError on a row of the
    wrong width, on text that is not this CSV, or on a known nvidia-smi failure.
    """
    failure = detect_failure(text, 0)
    if failure is not None:
        raise QueryError(f"nvidia-smi failed: {failure.kind}: {failure.message}", failure)
    rows = _rows(text)
    units: list[str | None]
    if fields is None:
        if not rows:
            return []
        if not _is_header(rows[0]):
            raise QueryError(f"no CSV header line (first line: {', '.join(rows[0])[:120]!r}): "
                             "this is noheader output or not --query-gpu CSV; pass the field "
                             "list of the --query-gpu=... that produced it")
        names, units = [], []
        for h in rows[0]:
            m = _HEADER_UNIT.match(h)
            names.append(m.group(1) if m else h)
            units.append(m.group(2) if m else None)
        rows = rows[1:]
    else:
        names, units = list(fields), [None] * len(fields)
        if rows and _is_header(rows[0]):
            if [header_name(n) for n in _names(rows[0])] != [header_name(n) for n in names]:
                raise QueryError(f"the CSV header names {', '.join(_names(rows[0]))}, "
                                 f"not the fields asked for ({', '.join(names)})")
            rows = rows[1:]
    out: list[dict[str, Any]] = []
    for row in rows:
        if len(row) != len(names):
            raise QueryError(f"not the expected --query-gpu CSV: {len(names)} columns "
                             f"({', '.join(names)}) expected, got {len(row)}: {row!r}"[:300])
        out.append({n: convert(v, u, n) for n, v, u in zip(names, row, units)})
    return out


def parse(text: str) -> list[Gpu]:
    """Parse the output of ``command()`` (QUERY_FIELDS, noheader, nounits)."""
    failure = detect_failure(text, 0)
    if failure is not None:
        raise QueryError(f"nvidia-smi failed: {failure.kind}: {failure.message}", failure)
    gpus = []
    rows = _rows(text)
    if rows and _is_header(rows[0]) and _names(rows[0]) == QUERY_FIELDS:
        rows = rows[1:]  # run without noheader
    for row in rows:
        if len(row) != len(QUERY_FIELDS):
            raise QueryError(f"expected {len(QUERY_FIELDS)} columns, got {len(row)}: {row!r}")
        v = dict(zip(QUERY_FIELDS, row))
        try:
            gpus.append(
                Gpu(
                    index=int(v["index"]),
                    name=v["name"],
                    uuid=v["uuid"],
                    pci_bus_id=v["pci.bus_id"],
                    driver_version=v["driver_version"],
                    memory_total_mib=_int(v["memory.total"]),
                    persistence_mode=_bool(v["persistence_mode"]),
                    ecc_mode=_bool(v["ecc.mode.current"]),
                    ecc_errors_uncorrected_volatile=_int(v["ecc.errors.uncorrected.volatile.total"]),
                    pcie_gen_current=_int(v["pcie.link.gen.current"]),
                    pcie_gen_max=_int(v["pcie.link.gen.max"]),
                    pcie_width_current=_int(v["pcie.link.width.current"]),
                    pcie_width_max=_int(v["pcie.link.width.max"]),
                    utilization_gpu_pct=_int(v["utilization.gpu"]),
                    memory_used_mib=_int(v["memory.used"]),
                    compute_cap=_str(v["compute_cap"]),
                )
            )
        except ValueError as e:
            raise QueryError(f"bad value in row {row!r}: {e}") from e
    return gpus


# ------------------------------------------------------------------------- failure outputs

FAILURE_KINDS = (
    "not-installed",
    "driver-library-mismatch",
    "no-driver",
    "no-devices",
    "fallen-off-bus",
    "nvml-unknown",
    "invalid-field",
    "nvml-error",
    "unknown",
)


@dataclass(frozen=True)
class Failure:
    kind: str  # one of FAILURE_KINDS
    message: str  # the line(s) of output that identified it
    advice: str
    bus_id: str | None = None  # fallen-off-bus: the lost GPU, when printed


_ADVICE = {
    "not-installed": (
        "nvidia-smi is not installed (or not on PATH): install the NVIDIA driver "
        "packages (nvidia-driver-<branch> / cuda-drivers), then reboot"
    ),
    "driver-library-mismatch": (
        "the loaded NVIDIA kernel module and the user-space driver libraries differ, "
        "usually after a driver upgrade without a reboot: reboot the host, then hold the "
        "driver packages (apt-mark hold) so unattended upgrades cannot do it again"
    ),
    "no-driver": (
        "nvidia-smi cannot talk to the kernel driver: install the driver if it is missing, "
        "load the module (modprobe nvidia; check dmesg), or reboot after installing; with "
        "Secure Boot on, an unsigned DKMS module is refused: enrol the MOK key or disable "
        "Secure Boot"
    ),
    "no-devices": (
        "the driver is loaded but sees no GPU: check lspci for NVIDIA devices, that they "
        "are not bound to vfio-pci, and (in a container) that the GPUs were passed in"
    ),
    "fallen-off-bus": (
        "a GPU has fallen off the PCIe bus (Xid 79): check dmesg for Xid errors, power and "
        "cooling; reboot (or power-cycle) to recover it; if it recurs, reseat or RMA the GPU"
    ),
    "nvml-unknown": (
        "NVML failed with 'Unknown Error': in a container this usually means the device "
        "cgroup lost access to /dev/nvidia* (e.g. after 'systemctl daemon-reload' with "
        "cgroup v2): restart the container; on the host check /dev/nvidia* permissions "
        "and dmesg, then reboot"
    ),
    "invalid-field": (
        "this driver's nvidia-smi does not know a queried field (compute_cap needs a "
        "newer driver): upgrade the driver or query without that field"
    ),
    "nvml-error": "NVML failed to initialise: check dmesg and the driver installation",
    "unknown": "nvidia-smi failed: run it by hand on the host and read its output",
}

# Ordered: first match wins. (Device-handle errors contain "Unknown Error" too.)
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    (
        "not-installed",
        re.compile(
            r"nvidia-smi: (?:command )?not found|command not found: nvidia-smi|"
            r"nvidia-smi: No such file or directory|\"nvidia-smi\": executable file not found",
            re.I,
        ),
    ),
    ("driver-library-mismatch", re.compile(r"Driver/library version mismatch", re.I)),
    ("no-driver", re.compile(r"couldn't communicate with the NVIDIA driver|couldn't find libnvidia-ml", re.I)),
    ("fallen-off-bus", re.compile(r"Unable to determine the device handle|fallen off the bus|GPU is lost", re.I)),
    ("no-devices", re.compile(r"No devices were found", re.I)),
    ("nvml-unknown", re.compile(r"Failed to initialize NVML: Unknown Error", re.I)),
    ("invalid-field", re.compile(r"is not a valid field to query", re.I)),
    ("nvml-error", re.compile(r"Failed to initialize NVML", re.I)),
]

# nvidia-smi exits with the NVML return code: 9 DRIVER_NOT_LOADED, 15 GPU_IS_LOST,
# 18 LIB_RM_VERSION_MISMATCH; 127 is the shell's "command not found".
_EXIT_CODES = {127: "not-installed", 9: "no-driver", 15: "fallen-off-bus", 18: "driver-library-mismatch"}

_BUS_ID = re.compile(r"([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])")


def detect_failure(text: str, exit_code: int | None) -> Failure | None:
    """Recognise nvidia-smi printing an NVML failure instead of data. None when it looks fine.

    The text is searched whatever the exit code (a lost GPU is reported next to the
    other GPUs' data); an unrecognised non-zero exit gives kind ``unknown``.
    """
    norm = normalize(text)
    for kind, pat in _PATTERNS:
        m = pat.search(norm)
        if m:
            line = next((ln.strip() for ln in norm.split("\n") if pat.search(ln)), m.group(0))
            bus = None
            if kind == "fallen-off-bus":
                b = _BUS_ID.search(line)
                bus = b.group(1) if b else None
            if kind == "driver-library-mismatch":
                lib = re.search(r"NVML library version:\s*(\S+)", norm)
                if lib:
                    line = f"{line} (NVML library version: {lib.group(1)})"
            return Failure(kind, line, _ADVICE[kind], bus)
    if exit_code in _EXIT_CODES:
        kind = _EXIT_CODES[exit_code]
        return Failure(kind, norm.strip() or f"exit status {exit_code}", _ADVICE[kind])
    if exit_code not in (None, 0):
        first = next((ln.strip() for ln in norm.split("\n") if ln.strip()), f"exit status {exit_code}")
        return Failure("unknown", first, _ADVICE["unknown"])
    return None
