"""nccl-tests output (``all_reduce_perf`` and friends).

Pure: ``command(...)`` builds an argv, ``parse(text)`` reads the output.

Layouts handled:

* current (>= 2.10-ish): ``size count type redop root`` then, for out-of-place
  and in-place, ``time algbw busbw #wrong``; ``#wrong`` may be ``N/A`` (in-place
  of sendrecv/alltoall, or with ``-c 0``);
* older: no ``root`` column and an ``error`` column holding a max error float
  (``1e-06``) instead of ``#wrong``;
* device lines with or without ``Group``, bus ids as ``[0000:0f:00]`` or ``[0x07]``;
* NCCL INFO lines interleaved with the table (ignored, except NCCL's init line, which
  gives the rank count when no device lines are printed);
* failure lines: nccl-tests' ``Test NCCL failure``/``Test CUDA failure``/``Test failure``
  (older: ``NCCL failure``), kept in ``failures``, and NCCL's own ``NCCL WARN`` lines, kept in
  ``warnings``;
* a capture cut short: device lines missing (the highest ``Rank N`` still says N+1 ranks),
  the head missing (the collective is named again in ``# Collective test concluded:``);
* lines prefixed by ``mpirun --tag-output`` (``[1,0]<stdout>:``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchrig.facts._text import finite, lines as _lines
from torchrig.facts.busbw import Sample, canonical_op


def command(
    op: str = "all_reduce",
    *,
    min_bytes: str = "8",
    max_bytes: str = "8G",
    factor: int = 2,
    gpus: int = 1,
    iters: int | None = None,
    check: int | None = None,
    binary_dir: str | None = None,
) -> list[str]:
    """argv for ``<op>_perf -b MIN -e MAX -f FACTOR -g GPUS [-n ITERS] [-c CHECK]``."""
    name = f"{canonical_op(op)}_perf"
    exe = f"{binary_dir.rstrip('/')}/{name}" if binary_dir else name
    argv = [exe, "-b", str(min_bytes), "-e", str(max_bytes), "-f", str(factor), "-g", str(gpus)]
    if iters is not None:
        argv += ["-n", str(iters)]
    if check is not None:
        argv += ["-c", str(check)]
    return argv


@dataclass(frozen=True)
class Params:
    n_threads: int | None
    n_gpus: int | None
    min_bytes: int | None
    max_bytes: int | None
    step: int | None
    step_kind: str | None  # "factor" or "bytes"
    warmup_iters: int | None
    iters: int | None
    agg_iters: int | None
    validation: int | None
    graph: int | None


@dataclass(frozen=True)
class Device:
    rank: int
    group: int | None  # absent in old output
    pid: int
    host: str
    device: int
    bus_id: str  # "0000:0f:00" or "0x07", as printed
    name: str


@dataclass(frozen=True)
class Half:
    """One of the out-of-place / in-place halves of a row."""

    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int | None  # #wrong; None if "N/A" or the old layout
    error: float | None  # old layout's max error; None in the current layout
    time_text: str  # as printed, to know its precision


@dataclass(frozen=True)
class Row:
    size: int  # bytes
    count: int  # elements
    type: str
    redop: str
    root: int | None  # None in the old layout
    out_of_place: Half
    in_place: Half


@dataclass(frozen=True)
class Result:
    params: Params | None
    devices: tuple[Device, ...]
    rows: tuple[Row, ...]
    avg_busbw_gbs: float | None
    out_of_bounds: int | None  # "# Out of bounds values : 0 OK" -> 0
    out_of_bounds_ok: bool | None
    collective: str | None  # from "# Collective test starting: all_reduce_perf" when present
    nccl_nranks: int | None = None  # from NCCL's own init line (NCCL_DEBUG=INFO), when printed
    failures: tuple[str, ...] = ()  # "Test NCCL failure ...", "NCCL failure ...", as printed
    warnings: tuple[str, ...] = ()  # "... NCCL WARN ...", as printed

    @property
    def nranks(self) -> int | None:
        """Ranks in the communicator, from what the output shows: one device line per rank
        (the highest rank + 1 when lines are missing), else the rank count NCCL logged at
        init; else None (unknown). Never nThread x nGpus: that is one process's share, and
        under mpirun there are as many processes as slots."""
        if self.devices:
            return max(len(self.devices), max(d.rank for d in self.devices) + 1)
        return self.nccl_nranks

    def samples(self) -> list[Sample]:
        """Every (size, half) cell, for busbw.screen / busbw.at_large_size."""
        return [Sample(r.size, name, h.time_us, h.busbw_gbs) for r in self.rows
                for name, h in (("out-of-place", r.out_of_place), ("in-place", r.in_place))]

    @property
    def any_wrong(self) -> bool:
        return any((h.wrong or 0) > 0 for r in self.rows for h in (r.out_of_place, r.in_place))


def _int(pattern: str, line: str) -> int | None:
    m = re.search(pattern, line)
    return int(m.group(1)) if m else None


def _parse_params(line: str) -> Params:
    step = re.search(r"step:\s*(\d+)\((\w+)\)", line)
    return Params(
        n_threads=_int(r"nThread\s+(\d+)", line),
        n_gpus=_int(r"nGpus\s+(\d+)", line),
        min_bytes=_int(r"minBytes\s+(\d+)", line),
        max_bytes=_int(r"maxBytes\s+(\d+)", line),
        step=int(step.group(1)) if step else None,
        step_kind=step.group(2) if step else None,
        warmup_iters=_int(r"warmup iters:\s*(\d+)", line),
        iters=_int(r"(?<!warmup )(?<!agg )iters:\s*(\d+)", line),
        agg_iters=_int(r"agg iters:\s*(\d+)", line),
        validation=_int(r"validation:\s*(\d+)", line),
        graph=_int(r"graph:\s*(\d+)", line),
    )


_DEVICE = re.compile(
    r"^#\s*Rank\s+(\d+)\s+(?:Group\s+(\d+)\s+)?Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\d+)\s+\[([^\]]*)\]\s*(.*?)\s*$"
)
# mpirun --tag-output (Open MPI) prefixes each line with "[jobid,rank]<stdout>:"
_MPI_TAG = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:")
# NCCL's init line: "... NCCL INFO comm 0x55d0 rank 0 nranks 16 cudaDev 0 busId 18000 - Init
# COMPLETE" (older), "... NCCL INFO comm 0x55d0 rank 0 nRanks 16 nNodes 2 localRanks 8 ..." (2.19+)
_NCCL_NRANKS = re.compile(r"NCCL INFO\b.*\bcomm 0x[0-9a-fA-F]+ rank \d+ n[Rr]anks (\d+)")
# nccl-tests' own failure lines ("host: Test NCCL failure common.cu:1005 '...'", " .. host pid
# 3288: Test failure common.cu:891", before 2.x "NCCL failure all_reduce.cu:95 '...'") and
# NCCL's warnings ("host:pid:tid [0] include/socket.h:385 NCCL WARN Net : Connection closed")
_FAILURE = re.compile(r"\b(?:Test (?:CUDA |NCCL )?failure|NCCL failure)\b")
# A warning is not a failure by itself: a healthy run with NCCL_DEBUG=WARN prints e.g.
# "NCCL WARN Failed to open libibverbs.so[.1]" on a box without InfiniBand (nccl-tests#82).
_WARNING = re.compile(r"\bNCCL WARN\b")
_NUM = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")


def _wrong(tok: str) -> int | None:
    return int(tok) if re.fullmatch(r"\d+", tok) else None


def _half(toks: list[str], old: bool) -> Half:
    time_s, alg, bus, last = toks
    return Half(
        time_us=finite(time_s),  # inf/nan: ValueError, the row is not a measurement
        algbw_gbs=finite(alg),
        busbw_gbs=finite(bus),
        wrong=None if old else _wrong(last),
        error=(finite(last) if _NUM.match(last) else None) if old else None,
        time_text=time_s,
    )


def _parse_row(toks: list[str], layout: str | None) -> Row | None:
    if not toks or not re.fullmatch(r"\d+", toks[0]):
        return None
    if len(toks) == 13 and layout != "old":
        old = False
        size, count, dtype, redop, root = toks[:5]
        rest = toks[5:]
    elif len(toks) == 12 and layout != "new":
        old = True
        size, count, dtype, redop = toks[:4]
        root = None
        rest = toks[4:]
    else:
        return None
    if not re.fullmatch(r"\d+", count):
        return None
    try:
        return Row(
            size=int(size),
            count=int(count),
            type=dtype,
            redop=redop,
            root=int(root) if root is not None else None,
            out_of_place=_half(rest[:4], old),
            in_place=_half(rest[4:], old),
        )
    except ValueError:
        return None


def parse(text: str) -> Result:
    params = None
    devices: list[Device] = []
    rows: list[Row] = []
    avg = None
    oob = None
    oob_ok = None
    collective = None
    layout: str | None = None  # "new" (root + #wrong) / "old" (no root, error) from the header
    nccl_nranks: int | None = None
    failures: list[str] = []
    warnings: list[str] = []
    for line in _lines(text):
        s = _MPI_TAG.sub("", line.strip(), count=1).strip()
        if not s:
            continue
        if _FAILURE.search(s):
            failures.append(s)
            continue
        if _WARNING.search(s):
            warnings.append(s)
            continue
        if m := _NCCL_NRANKS.search(s):
            nccl_nranks = max(nccl_nranks or 0, int(m.group(1)))
            continue
        if s.startswith("#"):
            if "nThread" in s and params is None:
                params = _parse_params(s)
            elif m := _DEVICE.match(s):
                dev = Device(
                    rank=int(m.group(1)),
                    group=int(m.group(2)) if m.group(2) is not None else None,
                    pid=int(m.group(3)),
                    host=m.group(4),
                    device=int(m.group(5)),
                    bus_id=m.group(6),
                    name=m.group(7),
                )
                if all(d.rank != dev.rank for d in devices):
                    devices.append(dev)
            elif re.search(r"\bsize\b.*\bcount\b.*\btype\b", s):
                layout = "new" if re.search(r"\broot\b", s) else "old"
            elif m := re.search(r"Avg bus bandwidth\s*:\s*([0-9.eE+-]+)", s):
                try:
                    avg = finite(m.group(1))
                except ValueError:  # '1e999', '1.2.3': no average
                    avg = None
            elif m := re.search(r"Out of bounds values\s*:\s*(\d+)\s*(\w+)?", s):
                oob = int(m.group(1))
                oob_ok = (m.group(2) == "OK") if m.group(2) else None
            elif m := re.search(r"Collective test (?:starting|concluded):\s*(\S+)", s):
                collective = collective or m.group(1)
            continue
        row = _parse_row(s.split(), layout)
        if row is not None:
            rows.append(row)
    return Result(
        params=params,
        devices=tuple(devices),
        rows=tuple(rows),
        avg_busbw_gbs=avg,
        out_of_bounds=oob,
        out_of_bounds_ok=oob_ok,
        collective=collective,
        nccl_nranks=nccl_nranks,
        failures=tuple(failures),
        warnings=tuple(warnings),
    )
