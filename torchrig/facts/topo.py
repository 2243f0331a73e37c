"""``nvidia-smi topo -m``: the GPU/NIC link matrix, affinities, and what it means for DDP.

Pure: ``parse(text)`` turns captured output into a :class:`Topo`; ``classify``,
``worst_link`` and ``advice`` read a :class:`Topo`.

Formats handled (all seen in real captures, see tests/unit/test_facts_topo.py):

* current layout: ``GPU0 .. GPUn NIC0 .. NICm CPU Affinity NUMA Affinity GPU NUMA ID``
  followed by ``Legend:`` and ``NIC Legend:`` (``NIC0: mlx5_2``);
* older layout with the RDMA devices inline as columns (``mlx5_0``), no NIC legend;
* no NIC columns at all; no ``GPU NUMA ID``; no ``NUMA Affinity``;
* tab-separated (as nvidia-smi writes it) or space-separated (as pasted),
  trailing whitespace, CRLF line ends, ANSI escapes (underlined header on a tty),
  ``N/A`` cells, a first line whose leading indentation was lost when pasted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import combinations

from torchrig.facts._text import lines as _lines

COMMAND: list[str] = ["nvidia-smi", "topo", "-m"]


# Link vocabulary, from nvidia-smi's own legend. SOC is the pre-2017 name of SYS.
_NV_RE = re.compile(r"^NV(\d+)$")
_LINK_RE = re.compile(r"^(?:X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC|N/A)$")
_GPU_RE = re.compile(r"^GPU\d+$")
_NIC_RE = re.compile(r"^(?:NIC\d+|mlx\d+_\S+)$")
_KNOWN_HEADERS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_KNOWN_HEADER_RE = re.compile("|".join(re.escape(h) for h in _KNOWN_HEADERS) + r"|\S+")

# Most NVLinks one GPU has (H100/H200/B200: 18). If every GPU pair shows NV<k> and
# k * (n_gpus - 1) exceeds this, the links cannot be direct GPU-to-GPU cables:
# the GPUs must be meeting in NVSwitches.
MAX_NVLINKS_PER_GPU = 18

CLASSES = ("single", "nvswitch", "nvlink", "pcie-switch", "cpu", "unknown")


@dataclass(frozen=True)
class Topo:
    gpus: tuple[str, ...]
    nics: tuple[str, ...]
    # (row, col) -> "X" | "NV12" | "PIX" | "PXB" | "PHB" | "NODE" | "SYS" | "N/A" ...
    links: dict[tuple[str, str], str] = field(hash=False)
    cpu_affinity: dict[str, str | None] = field(hash=False)  # "0-23,48-71"; None for N/A
    numa_affinity: dict[str, int | None] = field(hash=False)  # None for N/A or absent
    gpu_numa_id: dict[str, int | None] = field(hash=False)  # None for N/A or absent
    nic_legend: dict[str, str] = field(hash=False)  # "NIC0" -> "mlx5_2"
    # Every non-link column as printed: columns["CPU Affinity"]["GPU0"] == "0-11"
    columns: dict[str, dict[str, str]] = field(hash=False, default_factory=dict)

    def link(self, a: str, b: str) -> str | None:
        return self.links.get((a, b))

    def nic_device(self, nic: str) -> str:
        """RDMA device name of a NIC column (``NIC0`` -> ``mlx5_2``; ``mlx5_0`` -> itself)."""
        return self.nic_legend.get(nic, nic)

    def gpu_pair_links(self) -> dict[tuple[str, str], str]:
        """One entry per unordered GPU pair (header order); the worse direction if asymmetric."""
        out: dict[tuple[str, str], str] = {}
        for a, b in combinations(self.gpus, 2):
            ab, ba = self.links.get((a, b)), self.links.get((b, a))
            cands = [x for x in (ab, ba) if x is not None]
            out[(a, b)] = min(cands, key=link_rank) if cands else "N/A"
        return out


def link_rank(link: str) -> int:
    """Higher is better: X > NV# (more links better) > PIX > PXB > PHB > NODE > SYS > unknown."""
    if link == "X":
        return 10_000
    m = _NV_RE.match(link)
    if m:
        return 1_000 + int(m.group(1))
    return {"PIX": 50, "PXB": 40, "PHB": 30, "NODE": 20, "SYS": 10, "SOC": 10}.get(link, 0)


def nvlink_count(link: str) -> int | None:
    m = _NV_RE.match(link)
    return int(m.group(1)) if m else None


def parse_cpu_list(spec: str) -> frozenset[int]:
    """``"0-23,48-71"`` -> the CPU numbers. Empty set for ``N/A``/empty."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part or part == "N/A":
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(part))
    return frozenset(cpus)


def _is_header(tokens: list[str]) -> bool:
    return len(tokens) >= 2 and bool(_GPU_RE.match(tokens[0])) and not _LINK_RE.match(tokens[1])


def _split_header_rest(rest: str) -> list[str]:
    names: list[str] = []
    for chunk in re.split(r"\t+| {2,}", rest.strip()):
        chunk = chunk.strip()
        if not chunk:
            continue
        if chunk in _KNOWN_HEADERS or not any(h in chunk for h in _KNOWN_HEADERS):
            names.append(chunk)  # known name, or an unknown (maybe multi-word) header kept whole
        else:
            names.extend(_KNOWN_HEADER_RE.findall(chunk))  # whitespace collapsed by a paste
    return names


def _opt_int(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if re.fullmatch(r"-?\d+", value) else None


def _check_row(toks: list[str], devices: list[str], extra_names: list[str]) -> None:
    """A row holds one link per device column (X on its own column), then either every other
    column the header names (a GPU row) or none (a NIC row). Anything else is a mangled
    matrix, e.g. a separator lost in a paste ("NV12SYS", "0-231"): reading it would shift
    every cell after the loss into the wrong column, so it is refused."""
    label, cells, rest = toks[0], toks[1 : 1 + len(devices)], toks[1 + len(devices) :]
    where = f"row {label} of nvidia-smi topo -m"
    bad = [c for c in cells if not _LINK_RE.match(c)]
    if len(cells) < len(devices) or bad:
        raise ValueError(f"{where} has {len(toks) - 1} cells where the header names {len(devices)} "
                         f"device columns{' and ' + str(len(extra_names)) + ' more' if extra_names else ''}"
                         f"{f' (not a link: {bad[0][:20]!r})' if bad else ''}: the output looks "
                         "mangled (a lost separator?); capture it again with `nvidia-smi topo -m`")
    if cells[devices.index(label)] != "X":
        raise ValueError(f"{where} does not have X on its own column: the cells are shifted "
                         "(a lost separator?); capture it again with `nvidia-smi topo -m`")
    if rest and len(rest) != len(extra_names):
        raise ValueError(f"{where} has {len(rest)} cells after the links where the header names "
                         f"{len(extra_names)} ({', '.join(extra_names)}): the output looks mangled "
                         "(a lost separator?); capture it again with `nvidia-smi topo -m`")


def parse(text: str) -> Topo:
    """Parse ``nvidia-smi topo -m`` output. Raises ValueError if no matrix is found."""
    all_lines = _lines(text)
    header_idx = None
    for i, line in enumerate(all_lines):
        if _is_header(line.split()):
            header_idx = i
            break
    if header_idx is None:
        raise ValueError("no 'nvidia-smi topo -m' matrix header (GPU0 ...) found")

    # Candidate matrix lines: consecutive non-blank lines after the header.
    body: list[list[str]] = []
    for line in all_lines[header_idx + 1 :]:
        stripped = line.strip()
        if not stripped:
            if body:
                break
            continue
        if stripped.startswith("Legend"):
            break
        body.append(line.split())
    row_labels = {toks[0] for toks in body}

    header_line = all_lines[header_idx]
    header_tokens = header_line.split()
    devices: list[str] = []
    for tok in header_tokens:
        if _GPU_RE.match(tok) or _NIC_RE.match(tok) or tok in row_labels:
            devices.append(tok)
        else:
            break
    # The rest of the header line, after the last device column, names the other columns.
    rest = header_line.strip()
    for dev in devices:
        rest = rest[rest.index(dev) + len(dev) :]
    extra_names = _split_header_rest(rest)

    device_set = set(devices)
    links: dict[tuple[str, str], str] = {}
    columns: dict[str, dict[str, str]] = {name: {} for name in extra_names}
    seen: set[str] = set()
    for toks in body:
        label = toks[0]
        if label not in device_set or label in seen:
            # "GPU1NV2 ..." (the label's separator lost) would otherwise drop GPU1's row unseen
            raise ValueError(f"row {label[:20]!r} of nvidia-smi topo -m names no device column "
                             "once: the output looks mangled (a lost separator?); capture it "
                             "again with `nvidia-smi topo -m`")
        seen.add(label)
        _check_row(toks, devices, extra_names)
        cells = toks[1 : 1 + len(devices)]
        for col, cell in zip(devices, cells):
            links[(label, col)] = cell
        for name, value in zip(extra_names, toks[1 + len(devices) :]):
            columns[name][label] = value

    if missing := [d for d in devices if d not in seen]:
        raise ValueError(f"nvidia-smi topo -m has no row for {', '.join(missing)} of its header: "
                         "the output looks mangled; capture it again with `nvidia-smi topo -m`")
    gpus = tuple(d for d in devices if _GPU_RE.match(d))
    nics = tuple(d for d in devices if not _GPU_RE.match(d))

    nic_legend: dict[str, str] = {}
    in_legend = False
    for line in all_lines[header_idx + 1 :]:
        if line.strip().startswith("NIC Legend"):
            in_legend = True
            continue
        if in_legend:
            m = re.match(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$", line)
            if m:
                nic_legend[m.group(1)] = m.group(2)

    cpu_col = columns.get("CPU Affinity", {})
    numa_col = columns.get("NUMA Affinity", {})
    gnuma_col = columns.get("GPU NUMA ID", {})
    cpu_affinity = {
        g: (None if cpu_col.get(g) in (None, "N/A") else cpu_col[g]) for g in gpus
    }
    return Topo(
        gpus=gpus,
        nics=nics,
        links=links,
        cpu_affinity=cpu_affinity,
        numa_affinity={g: _opt_int(numa_col.get(g)) for g in gpus},
        gpu_numa_id={g: _opt_int(gnuma_col.get(g)) for g in gpus},
        nic_legend=nic_legend,
        columns=columns,
    )


# --------------------------------------------------------------------------- classification


def worst_link(topo: Topo) -> str | None:
    """The worst link between any two GPUs (None with fewer than two GPUs)."""
    pairs = topo.gpu_pair_links()
    if not pairs:
        return None
    return min(pairs.values(), key=link_rank)


def _has_ring(n: int, adj: list[set[int]]) -> bool:
    """Is there a cycle through all n nodes (a ring NCCL could build)? n >= 2."""
    if n == 2:
        return 1 in adj[0]
    if all(len(a) == n - 1 for a in adj):
        return True
    if n > 12:  # bitmask DP too slow in pure Python; be conservative
        return False
    full = (1 << n) - 1
    # reach[mask] = set of end nodes v such that a path 0 -> ... -> v visits exactly mask
    reach: dict[int, int] = {1: 1}
    for mask in range(1, full + 1):
        if not (mask & 1) or mask not in reach:
            continue
        ends = reach[mask]
        for v in range(n):
            if not (ends >> v) & 1:
                continue
            for w in adj[v]:
                if not (mask >> w) & 1:
                    nm = mask | (1 << w)
                    reach[nm] = reach.get(nm, 0) | (1 << w)
    ends = reach.get(full, 0)
    return any((ends >> v) & 1 and 0 in adj[v] for v in range(1, n))


def ring_bottleneck(topo: Topo) -> str | None:
    """The weakest link on the best ring through all GPUs.

    NCCL's ring all-reduce runs at the speed of the slowest hop of its ring and it
    picks rings along the fastest paths, so this (not the worst pair) is what limits
    intra-node all-reduce busbw. None with fewer than two GPUs.
    """
    gpus = topo.gpus
    n = len(gpus)
    if n < 2:
        return None
    pairs = topo.gpu_pair_links()
    idx = {g: i for i, g in enumerate(gpus)}
    for rank in sorted({link_rank(l) for l in pairs.values()}, reverse=True):
        adj: list[set[int]] = [set() for _ in range(n)]
        for (a, b), l in pairs.items():
            if link_rank(l) >= rank:
                adj[idx[a]].add(idx[b])
                adj[idx[b]].add(idx[a])
        if _has_ring(n, adj):
            return min((l for l in pairs.values() if link_rank(l) == rank), key=link_rank)
    return min(pairs.values(), key=link_rank)


def _is_switched(topo: Topo) -> bool:
    """All pairs NV# and more NVLinks per GPU than a GPU has: an NVSwitch fabric."""
    pairs = topo.gpu_pair_links()
    counts = [nvlink_count(l) for l in pairs.values()]
    if not counts or any(c is None for c in counts):
        return False
    n = len(topo.gpus)
    return n >= 3 and min(c for c in counts if c is not None) * (n - 1) > MAX_NVLINKS_PER_GPU


def promised_nvlinks(topo: Topo) -> dict[int, int]:
    """{GPU index: NVLinks the matrix promises it}: behind NVSwitches every pair shows all of
    a GPU's links (NV18), so the most of any pair; else the sum over its peers (NV2 + NV1 ...).
    GPUs with no NVLink peer are left out."""
    pairs = topo.gpu_pair_links()
    switched = _is_switched(topo)
    out: dict[int, int] = {}
    for (a, b), link in pairs.items():
        n = nvlink_count(link)
        if not n:
            continue
        for g in (a, b):
            i = int(g[3:]) if g[3:].isdigit() else None
            if i is not None:
                out[i] = max(out.get(i, 0), n) if switched else out.get(i, 0) + n
    return out


def classify(topo: Topo, nvswitch_hint: bool | None = None) -> str:
    """One of ``CLASSES``: single, nvswitch, nvlink, pcie-switch, cpu, unknown.

    * ``single``: fewer than two GPUs.
    * ``nvswitch``: every GPU pair is NV# and the per-pair count times the peer
      count exceeds the NVLinks one GPU has (NV18 on 8x H100, NV12 on 8x A100), so
      the links must go through NVSwitches. ``nvswitch_hint`` (e.g. NVSwitch devices
      seen in lspci) overrides: True -> nvswitch whenever every pair is NV#; False ->
      never nvswitch. A 4-GPU board with direct NVLink all-to-all (HGX A100 4-GPU:
      NV4 x 3 peers = 12 links) is ``nvlink``, not nvswitch.
    * otherwise by the weakest hop of the best ring (see ``ring_bottleneck``):
      NV# -> ``nvlink``; PIX/PXB -> ``pcie-switch``; PHB/NODE/SYS -> ``cpu``;
      N/A or unknown -> ``unknown``. So a host whose NVLinks form a ring over all
      GPUs is ``nvlink`` even if some non-adjacent pairs are SYS (topo_04), while
      two NVLink-bridged pairs joined only through the CPU are ``cpu``.
    """
    if len(topo.gpus) < 2:
        return "single"
    pairs = topo.gpu_pair_links()
    all_nv = all(nvlink_count(l) is not None for l in pairs.values())
    if all_nv and nvswitch_hint is not False:
        if nvswitch_hint is True or _is_switched(topo):
            return "nvswitch"
    bottleneck = ring_bottleneck(topo) or "N/A"
    if nvlink_count(bottleneck) is not None:
        return "nvlink"
    if bottleneck in ("PIX", "PXB"):
        return "pcie-switch"
    if bottleneck in ("PHB", "NODE", "SYS", "SOC"):
        return "cpu"
    return "unknown"


def _fmt_pairs(pairs: list[tuple[str, str]]) -> str:
    return ", ".join(f"{a}-{b}" for a, b in pairs)


def cpu_groups(topo: Topo) -> tuple[list[tuple[str, ...]], str] | None:
    """The GPUs grouped by the NUMA node / CPU socket they hang off, and what that came from.

    NUMA Affinity when it is printed; else the CPU Affinity column (older drivers print no
    NUMA column), when the GPUs' CPU sets are either identical or disjoint: two disjoint sets
    are two sockets. None when neither column tells (N/A, absent, or overlapping sets).
    """
    numa = topo.numa_affinity
    if topo.gpus and all(numa.get(g) is not None for g in topo.gpus):
        keys: dict = {g: numa[g] for g in topo.gpus}
        source = "NUMA Affinity"
    else:
        sets = {g: parse_cpu_list(topo.cpu_affinity.get(g) or "") for g in topo.gpus}
        distinct = set(sets.values())
        if not topo.gpus or frozenset() in distinct or any(
                a != b and a & b for a in distinct for b in distinct):
            return None
        keys, source = sets, "CPU Affinity"
    groups: dict = {}
    for g in topo.gpus:
        groups.setdefault(keys[g], []).append(g)
    return [tuple(v) for v in groups.values()], source


def advice(topo: Topo, nvswitch_hint: bool | None = None) -> list[str]:
    """Human advice lines about what the topology means for DDP all-reduce."""
    out: list[str] = []
    cls = classify(topo, nvswitch_hint)
    if cls == "single":
        return out
    pairs = topo.gpu_pair_links()
    if cls == "nvswitch":
        out.append(
            "NVSwitch system: nvidia-fabricmanager must be running (same version as the "
            "driver) or CUDA/NCCL will fail to initialise or fall back to slow paths"
        )
        counts = {nvlink_count(l) for l in pairs.values()}
        if len(counts) > 1:
            out.append(
                f"NVLink counts differ between GPU pairs ({', '.join(sorted({l for l in pairs.values()}))}): "
                "some NVLinks are down; check 'nvidia-smi nvlink -s' and the Xid log"
            )

    by_kind: dict[str, list[tuple[str, str]]] = {}
    for p, l in pairs.items():
        by_kind.setdefault("SYS" if l == "SOC" else l, []).append(p)
    sys_pairs = by_kind.get("SYS", [])
    slow_host = by_kind.get("PHB", []) + by_kind.get("NODE", [])
    groups, source = cpu_groups(topo) or ([], None)
    if sys_pairs and len(sys_pairs) == len(pairs) and len(groups) == 1:
        out.append(
            "every GPU pair is SYS (across CPU sockets), yet all GPUs report the same "
            f"{'NUMA node' if source == 'NUMA Affinity' else 'CPU affinity'}: this is "
            "usually a VM or container that hides the PCIe layout, and peer-to-peer between "
            "the GPUs is likely unavailable (NCCL then copies through host memory); check "
            "`nvidia-smi topo -p2p r` and ask for the GPUs to be passed through with their "
            "PCIe topology"
        )
    if sys_pairs:  # VM or not, the GPUs' traffic crosses the CPU as far as NCCL can tell
        which = ("all GPU pairs" if len(sys_pairs) == len(pairs)
                 else f"GPU pairs ({_fmt_pairs(sys_pairs)})")
        if cls == "cpu":
            out.append(
                f"{which} communicate across the CPU interconnect "
                "(SYS): all-reduce will be slow; use gradient accumulation to reduce sync frequency"
            )
        else:
            out.append(
                f"GPU pairs ({_fmt_pairs(sys_pairs)}) communicate across the CPU interconnect "
                "(SYS); NCCL's ring can avoid them, but direct traffic between these pairs "
                "(e.g. pipeline stages) will be slow"
            )
    if slow_host:
        kinds = "/".join(k for k in ("PHB", "NODE") if by_kind.get(k))
        out.append(
            f"GPU pairs ({_fmt_pairs(slow_host)}) communicate through the CPU's PCIe host "
            f"bridge ({kinds}): all-reduce will be slower than over NVLink or a PCIe switch; "
            "consider gradient accumulation to reduce sync frequency"
        )
    if cls == "pcie-switch":
        out.append(
            "GPUs meet in a PCIe switch (PIX/PXB): if NCCL hangs or is slow, check that PCIe "
            "ACS is disabled and the IOMMU is off or in passthrough mode; consumer GPUs may "
            "have peer-to-peer disabled and go through host memory"
        )
    if len(groups) > 1:
        where = (f"{len(groups)} NUMA nodes" if source == "NUMA Affinity" else
                 f"{len(groups)} CPU sockets (disjoint CPU Affinity sets; this driver prints "
                 "no NUMA Affinity)")
        out.append(
            f"GPUs sit on {where}: "
            + "; ".join(f"{', '.join(gs)} on CPUs {topo.cpu_affinity.get(gs[0]) or '?'}"
                        for gs in groups)
            + ". Pin each rank's threads and data-loader workers to its GPU's CPUs "
            "(e.g. numactl --cpunodebind=N --membind=N)"
        )
    return out
