"""Xid events from the kernel log: the commands that read it, NVIDIA's catalog as data, and a
pure parser of the driver's `NVRM: Xid (PCI:0000:3b:00): 79, pid=..., ...` lines.

The kernel log is read the real way: `journalctl -k -b` (the journal's kernel messages of this
boot), else `dmesg` where the journal has none (no persistent journal, a container)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

from ..resources import payload_module
from ._text import normalize

# the Xid line and the commands that read the kernel log: one definition, in the node's health
# watcher (payload/healthwatch.py, stdlib only), loaded here
_watch = payload_module("healthwatch")
JOURNAL = _watch.JOURNAL
DMESG = _watch.DMESG
# what every Xid line holds (XID_LINE's "NVRM: Xid", loosely): the probe keeps only the kernel
# log's lines with it, the newest, instead of shipping a log that can outgrow its cap whole
KEEP = "Xid"
kernel_text = _watch.kernel_text
short_bus = _watch.short_bus

SOURCE = ("NVIDIA, \"Analyzing Xid Errors with the Xid Catalog\" "
          "(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) and \"GPU Memory "
          "Error Management\" (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt), read 2026-12-03")


@dataclass(frozen=True)
class XidInfo:
    mnemonic: str | None  # the catalog's, where its row was read (None: not read)
    what: str
    node_fault: bool      # the GPU or the node is at fault (else usually the application)
    action: str | None    # the catalog's immediate action (RESTART_APP, RESET_GPU, ...), where read
    advice: str           # what the operator does, in words
    checked: str          # where the meaning was read: "catalog", "memory-error docs",
                          # "DESIGN.md facts" (the project's checked notes)


_RESET = "reset the GPU (nvidia-smi -r -i N, or reboot the node)"
# Kept to the entries whose meaning could be checked: the catalog's rows 8, 11 and 13 were read
# whole (mnemonic and immediate action); the memory-error page describes 48, 63, 64, 94 and 95;
# the rest are DESIGN.md's checked facts. Mnemonics and actions not read are None, not guessed.
# Any other Xid is shown by number and counted as a node fault (FAIL) until someone looks.
CATALOG: dict[int, XidInfo] = {
    8: XidInfo("ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", False,
               "RESTART_APP", "restart the application; contact support if it recurs", "catalog"),
    11: XidInfo("ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "invalid or corrupted push buffer stream",
                False, "RESTART_APP", "restart the application; check the application / CUDA",
                "catalog"),
    13: XidInfo("ROBUST_CHANNEL_GR_EXCEPTION", "graphics engine exception", False, "RESTART_APP",
                "usually the application (an out-of-range access): restart it and check its code",
                "catalog"),
    31: XidInfo(None, "GPU memory page fault", False, None,
                "usually the application (an illegal address): restart it and check its code",
                "DESIGN.md facts"),
    43: XidInfo(None, "GPU stopped processing", False, None,
                "usually the application: restart it", "DESIGN.md facts"),
    48: XidInfo(None, "double-bit (uncorrectable) ECC error", True, None,
                _RESET + "; RMA the GPU if it recurs", "memory-error docs"),
    63: XidInfo(None, "page retired / row remapped: takes effect on reset", True,
                None, _RESET + " at a convenient time to activate the remap",
                "memory-error docs"),
    64: XidInfo(None, "page retirement / row remapping failed", True,
                None, _RESET + "; if it recurs after the reset, RMA the GPU",
                "memory-error docs"),
    74: XidInfo(None, "NVLink error", True, None,
                _RESET + "; if the link stays down, reseat or RMA", "DESIGN.md facts"),
    79: XidInfo(None, "GPU has fallen off the bus", True, None,
                "reboot or power-cycle the node; reseat the GPU and its power if it recurs, "
                "then RMA", "DESIGN.md facts"),
    92: XidInfo(None, "high single-bit ECC error rate", True, None,
                _RESET + "; watch the ECC counters", "DESIGN.md facts"),
    94: XidInfo(None, "contained uncorrectable ECC error", True, None,
                "restart the application that hit it; " + _RESET + " when convenient",
                "memory-error docs"),
    95: XidInfo(None, "uncontained uncorrectable ECC error", True, None,
                _RESET + " before the next job", "memory-error docs"),
}


def app_xids() -> list[int]:
    """The Xids the catalog calls the application's: the node's health watcher is given these,
    so every other Xid (a node fault, or one not in the catalog) ends the node's part of a job."""
    return sorted(code for code, info in CATALOG.items() if not info.node_fault)


@dataclass(frozen=True)
class XidEvent:
    code: int
    bus: str            # as the kernel prints it: "0000:3b:00" (domain:bus:device), lower case
    when: datetime | None
    text: str           # the rest of the line after the code
    line: str

    @property
    def info(self) -> XidInfo | None:
        return CATALOG.get(self.code)


_XID = _watch.XID_LINE
_when = _watch.stamp


def parse(text: str, since: datetime | None = None) -> list[XidEvent]:
    """Every Xid line of a kernel log (journalctl's or dmesg's, any timestamp style), oldest
    first; with `since`, only those stamped at or after it (an unstamped line is kept: it cannot
    be placed, and a fault is better shown than hidden)."""
    out = []
    for line in normalize(text).split("\n"):
        m = _XID.search(line)
        if not m:
            continue
        when = _when(line)
        if since is not None and when is not None and when < since:
            continue
        out.append(XidEvent(int(m.group(2)), m.group(1).lower(), when, m.group(3).strip(),
                            line.strip()))
    return out


def gpu_index(bus: str, gpus: dict[str, int]) -> int | None:
    """The GPU index of an Xid's bus, given {pci.bus_id: index} from nvidia-smi."""
    return {short_bus(b): i for b, i in gpus.items()}.get(bus.lower())


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """`--since`: an ISO time ("2026-12-03T14:00", "2026-12-03 14:00:00+01:00"; UTC when it has
    no zone) or an age ("30m", "2h", "1d"). ValueError names the forms."""
    now = now or datetime.now(timezone.utc)
    m = re.fullmatch(r"\s*(\d+)\s*([smhd])\s*", text)
    if m:
        from datetime import timedelta
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return now - timedelta(**{unit: int(m.group(1))})
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: give an ISO time (2026-12-03T14:00, UTC unless it "
                         "has a zone) or an age (30m, 2h, 1d)") from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
