"""``nvidia-smi -q -x``: per GPU, the health fields (ECC, retired pages, remapped rows, PCIe
link and replays, active clock slowdowns). Pure: ``parse(text)``.

XML rather than ``-q``'s text: its element names are stable where the text labels moved
between drivers. Older drivers say ``clocks_throttle_reasons``/``clocks_throttle_reason_*``,
newer ``clocks_event_reasons``/``clocks_event_reason_*`` (both read); ECC counts are
``sram_*``/``dram_*`` since Ampere and ``single_bit``/``double_bit`` totals before it. The
parser is the standard library's; the text comes from root's own nvidia-smi, and ElementTree
resolves no external entity (the DOCTYPE names a DTD that is never fetched).

Standard library only: it is pushed with every payload release, where the per-job health
watcher (healthwatch.py, root's) reads the GPUs with it; torchrig/facts/smi_xml.py loads this
same file on the operator's side (`health`, `verify`), so the XML is read in one place."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

COMMAND = ["nvidia-smi", "-q", "-x"]

# the slowdowns worth a finding: the hardware's own and the thermal ones (an idle GPU, an
# application clock setting or the software power cap are normal)
SLOWDOWNS = {"hw_slowdown": "hardware slowdown", "hw_thermal_slowdown": "hardware thermal slowdown",
             "hw_power_brake_slowdown": "hardware power brake", "sw_thermal_slowdown": "software thermal slowdown"}


@dataclass
class GpuHealth:
    index: int
    bus_id: str                              # "00000000:3B:00.0"
    name: str
    ecc_enabled: bool | None = None
    uncorrectable_volatile: int | None = None
    uncorrectable_aggregate: int | None = None
    retired_pages: int | None = None         # double-bit retirements
    retirement_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    remapped_uncorrectable: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_replays: int | None = None
    slowdowns: list[str] = field(default_factory=list)   # SLOWDOWNS keys active now


def _text(el, path: str) -> str | None:
    got = el.find(path)
    if got is None or got.text is None:
        return None
    t = got.text.strip()
    return None if t in ("", "N/A") or t.startswith("[") or "deprecated" in t else t


def _int(el, path: str) -> int | None:
    t = _text(el, path)
    if t is None:
        return None
    t = t.split()[0].rstrip("x")  # "16x", "0 us"
    return int(t) if t.isdigit() else None


def _yes(el, path: str) -> bool | None:
    t = _text(el, path)
    return None if t is None else t.lower() in ("yes", "enabled", "active")


def _sum(values: list[int | None]) -> int | None:
    got = [v for v in values if v is not None]
    return sum(got) if got else None


def _uncorrectable(el, scope: str) -> int | None:
    e = el.find(f"ecc_errors/{scope}")
    if e is None:
        return None
    if e.find("dram_uncorrectable") is not None or e.find("sram_uncorrectable") is not None:
        return _sum([_int(e, n) for n in ("dram_uncorrectable", "sram_uncorrectable",
                                          "sram_uncorrectable_parity", "sram_uncorrectable_secded")])
    return _int(e, "double_bit/total")  # before Ampere


def _slowdowns(el) -> list[str]:
    for group, prefix in (("clocks_event_reasons", "clocks_event_reason_"),
                          ("clocks_throttle_reasons", "clocks_throttle_reason_")):
        g = el.find(group)
        if g is not None:
            return [k for k in SLOWDOWNS if _text(g, prefix + k) == "Active"]
    return []


def parse(text: str) -> list[GpuHealth]:
    """The GPUs of one ``nvidia-smi -q -x``, in its order (the index is the position, as
    nvidia-smi numbers them). ValueError when the text is not that XML."""
    try:
        root = ET.fromstring(text.strip())
    except ET.ParseError as e:
        raise ValueError(f"nvidia-smi -q -x printed no readable XML ({e})") from None
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"nvidia-smi -q -x: <{root.tag}> instead of <nvidia_smi_log>")
    out = []
    for i, g in enumerate(root.findall("gpu")):
        link = "pci/pci_gpu_link_info"
        out.append(GpuHealth(
            index=i, bus_id=_text(g, "pci/pci_bus_id") or g.get("id", ""),
            name=_text(g, "product_name") or "",
            ecc_enabled=_yes(g, "ecc_mode/current_ecc"),
            uncorrectable_volatile=_uncorrectable(g, "volatile"),
            uncorrectable_aggregate=_uncorrectable(g, "aggregate"),
            retired_pages=_int(g, "retired_pages/double_bit_retirement/retired_count"),
            retirement_pending=_yes(g, "retired_pages/pending_retirement"),
            remap_pending=_yes(g, "remapped_rows/remapped_row_pending"),
            remap_failure=_yes(g, "remapped_rows/remapped_row_failure"),
            remapped_uncorrectable=_int(g, "remapped_rows/remapped_row_unc"),
            pcie_gen=_int(g, f"{link}/pcie_gen/current_link_gen"),
            pcie_gen_max=_int(g, f"{link}/pcie_gen/max_link_gen"),
            pcie_width=_int(g, f"{link}/link_widths/current_link_width"),
            pcie_width_max=_int(g, f"{link}/link_widths/max_link_width"),
            pcie_replays=_int(g, "pci/replay_counter"),
            slowdowns=_slowdowns(g)))
    return out
