"""torchrig.facts.topo against real ``nvidia-smi topo -m`` captures and hand-made variants."""

from __future__ import annotations

import re

import pytest

from _fixtures import fixture
from torchrig.facts import topo



T01 = "topo_01_2x1080ti_consumer_phb.txt"
T02 = "topo_02_8xA100_nv12_17nics_nic_legend.txt"
T04 = "topo_04_4gpu_nv1_nv2_dualsocket_delos.txt"
T08 = "topo_08_h100x8_nv18_mlengineering.txt"
T13 = "topo_13_2xRTX2080Ti_pix_gpu_numa_id.txt"
T14 = "topo_14_1xH200_single_gpu_numa_id.txt"


def test_command():
    assert topo.COMMAND == ["nvidia-smi", "topo", "-m"]


# ------------------------------------------------------------------ real captures


def test_topo01_1080ti_phb():
    t = topo.parse(fixture(T01))
    assert t.gpus == ("GPU0", "GPU1")
    assert t.nics == ()
    assert t.link("GPU0", "GPU1") == "PHB" and t.link("GPU1", "GPU0") == "PHB"
    assert t.link("GPU0", "GPU0") == "X"
    assert t.cpu_affinity == {"GPU0": "0-11", "GPU1": "0-11"}
    assert t.numa_affinity == {"GPU0": None, "GPU1": None}  # printed N/A
    assert t.gpu_numa_id == {"GPU0": None, "GPU1": None}  # no such column
    assert t.nic_legend == {}
    assert topo.classify(t) == "cpu"
    assert topo.worst_link(t) == "PHB"
    adv = topo.advice(t)
    assert len(adv) == 1 and "(GPU0-GPU1)" in adv[0] and "PHB" in adv[0]


def test_topo02_8xA100_nv12_17_nics_and_legend():
    t = topo.parse(fixture(T02))
    assert t.gpus == tuple(f"GPU{i}" for i in range(8))
    assert t.nics == tuple(f"NIC{i}" for i in range(17))
    assert len(t.links) == 25 * 25  # every device row has a cell for every device column
    # spot checks read off the capture
    assert t.link("GPU0", "GPU7") == "NV12"
    assert t.link("GPU0", "NIC0") == "PXB"
    assert t.link("GPU0", "NIC4") == "SYS"
    assert t.link("GPU2", "NIC4") == "PXB"
    assert t.link("GPU7", "NIC15") == "PXB"
    assert t.link("GPU7", "NIC16") == "SYS"
    assert t.link("NIC0", "NIC1") == "PIX"
    assert t.link("NIC0", "NIC2") == "PXB"
    assert t.link("NIC15", "GPU7") == "PXB"
    assert t.link("NIC16", "NIC16") == "X"  # last cell, followed by trailing space
    assert set(t.cpu_affinity.values()) == {"0-103"}
    assert set(t.numa_affinity.values()) == {0}
    assert set(t.gpu_numa_id.values()) == {None}
    assert list(t.columns) == ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    assert t.nic_legend["NIC0"] == "mlx5_2"
    assert t.nic_legend["NIC15"] == "mlx5_17"
    assert t.nic_legend["NIC16"] == "mlx5_bond_0"
    assert len(t.nic_legend) == 17
    assert t.nic_device("NIC3") == "mlx5_5"
    assert topo.classify(t) == "nvswitch"
    assert topo.worst_link(t) == "NV12"
    adv = topo.advice(t)
    assert any(a.startswith("NVSwitch system: nvidia-fabricmanager must be running") for a in adv)
    assert not any("NUMA" in a for a in adv)  # single NUMA node


def test_topo04_nvlink_mesh_with_sys_pairs_tab_separated():
    text = fixture(T04)
    assert "\t" in text
    t = topo.parse(text)
    assert t.gpus == ("GPU0", "GPU1", "GPU2", "GPU3")
    assert t.nics == ()
    assert t.link("GPU0", "GPU1") == "NV2"
    assert t.link("GPU0", "GPU3") == "SYS"
    assert t.link("GPU1", "GPU2") == "SYS"
    assert t.link("GPU1", "GPU3") == "NV1"
    assert t.link("GPU3", "GPU2") == "NV2"
    assert t.cpu_affinity["GPU0"] == "0-19,40-59"
    assert t.cpu_affinity["GPU3"] == "20-39,60-79"
    assert t.numa_affinity == {"GPU0": 0, "GPU1": 0, "GPU2": 1, "GPU3": 1}
    assert topo.worst_link(t) == "SYS"
    # Decision: "nvlink", not "cpu". NCCL builds its all-reduce ring along the fastest
    # paths; here GPU0-GPU1-GPU3-GPU2-GPU0 is NV2, NV1, NV2, NV2, so no ring hop
    # touches SYS and busbw is bounded by the NV1 hop, i.e. NVLink speed. The SYS
    # pairs still matter for direct pair traffic, which advice() reports.
    assert topo.ring_bottleneck(t) == "NV1"
    assert topo.classify(t) == "nvlink"
    adv = topo.advice(t)
    assert any("(GPU0-GPU3, GPU1-GPU2)" in a and "(SYS)" in a for a in adv)
    assert any("2 NUMA nodes" in a for a in adv)
    assert not any("fabricmanager" in a for a in adv)


def test_topo08_h100_nv18():
    t = topo.parse(fixture(T08))
    assert t.gpus == tuple(f"GPU{i}" for i in range(8))
    assert t.nics == () and t.nic_legend == {}
    assert t.link("GPU3", "GPU5") == "NV18"
    assert t.link("GPU7", "GPU7") == "X"
    assert all(t.link(a, b) == "NV18" for a in t.gpus for b in t.gpus if a != b)
    assert t.cpu_affinity["GPU0"] == "0-51,104-155"
    assert t.cpu_affinity["GPU4"] == "52-103,156-207"
    assert [t.numa_affinity[g] for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.classify(t) == "nvswitch"
    assert topo.classify(t, nvswitch_hint=False) == "nvlink"
    adv = topo.advice(t)
    assert adv[0].startswith("NVSwitch system: nvidia-fabricmanager must be running")
    assert any("NUMA" in a for a in adv)


def test_topo13_pix_gpu_numa_id():
    t = topo.parse(fixture(T13))
    assert t.gpus == ("GPU0", "GPU1")
    assert t.link("GPU0", "GPU1") == "PIX"
    assert t.cpu_affinity == {"GPU0": "24-47,72-95", "GPU1": "24-47,72-95"}
    assert t.numa_affinity == {"GPU0": 1, "GPU1": 1}
    assert t.gpu_numa_id == {"GPU0": None, "GPU1": None}
    assert t.columns["GPU NUMA ID"] == {"GPU0": "N/A", "GPU1": "N/A"}
    assert topo.classify(t) == "pcie-switch"
    assert any("ACS" in a for a in topo.advice(t))


# ------------------------------------------------------------- format variants


def _same(a: topo.Topo, b: topo.Topo) -> None:
    assert a.gpus == b.gpus and a.nics == b.nics and a.links == b.links
    assert a.cpu_affinity == b.cpu_affinity and a.numa_affinity == b.numa_affinity
    assert a.gpu_numa_id == b.gpu_numa_id and a.nic_legend == b.nic_legend


def _to_tabs(text: str) -> str:
    import re

    out = []
    for line in text.split("\n"):
        out.append(re.sub(r"(?<=\S) {2,}(?=\S)", "\t", line))
    return "\n".join(out)


def test_spaces_and_tabs_parse_the_same():
    text = fixture(T08)
    tabbed = _to_tabs(text)
    assert "\t" in tabbed
    _same(topo.parse(text), topo.parse(tabbed))
    text2 = fixture(T02)
    _same(topo.parse(text2), topo.parse(_to_tabs(text2)))


def test_crlf_and_trailing_whitespace():
    text = fixture(T13)
    mangled = "\r\n".join(line + "   \t " for line in text.split("\n"))
    _same(topo.parse(text), topo.parse(mangled))
    text2 = fixture(T02)
    _same(topo.parse(text2), topo.parse(text2.replace("\n", "\r\n")))


def test_ansi_escapes_and_lost_header_indent():
    text = fixture(T04)
    lines = text.split("\n")
    # nvidia-smi underlines the header on a terminal; a paste may lose its indent
    lines[0] = "\x1b[4m" + lines[0].lstrip("\t") + "\x1b[0m"
    _same(topo.parse(text), topo.parse("\n".join(lines)))


def test_prompt_and_prose_before_the_matrix():
    text = "$ nvidia-smi topo -m\n" + fixture(T01)
    assert topo.parse(text).gpus == ("GPU0", "GPU1")


def test_collapsed_single_space_header():
    text = (
        "GPU0 GPU1 CPU Affinity NUMA Affinity GPU NUMA ID\n"
        "GPU0 X NV4 0-31 0 N/A\n"
        "GPU1 NV4 X 0-31 0 N/A\n"
    )
    t = topo.parse(text)
    assert list(t.columns) == ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    assert t.cpu_affinity == {"GPU0": "0-31", "GPU1": "0-31"}
    assert t.numa_affinity == {"GPU0": 0, "GPU1": 0}
    assert topo.classify(t) == "nvlink"  # an NVLink-bridged pair


# Older drivers printed RDMA devices inline as columns and had no NIC legend
# (hand-made in that layout: tab-separated, " X " cells, NIC rows without affinity).
OLD_INLINE_MLX5 = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tmlx5_0\tmlx5_1\tCPU Affinity\n"
    "GPU0\t X \tNV1\tNV1\tNV2\tPIX\tSYS\t0-19,40-59\n"
    "GPU1\tNV1\t X \tNV2\tNV1\tPIX\tSYS\t0-19,40-59\n"
    "GPU2\tNV1\tNV2\t X \tNV2\tSYS\tPIX\t20-39,60-79\n"
    "GPU3\tNV2\tNV1\tNV2\t X \tSYS\tPIX\t20-39,60-79\n"
    "mlx5_0\tPIX\tPIX\tSYS\tSYS\t X \tSYS\t\n"
    "mlx5_1\tSYS\tSYS\tPIX\tPIX\tSYS\t X \t\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
)


def test_old_inline_mlx5_columns():
    t = topo.parse(OLD_INLINE_MLX5)
    assert t.gpus == ("GPU0", "GPU1", "GPU2", "GPU3")
    assert t.nics == ("mlx5_0", "mlx5_1")
    assert t.nic_legend == {}
    assert t.nic_device("mlx5_1") == "mlx5_1"
    assert t.link("GPU0", "mlx5_0") == "PIX"
    assert t.link("mlx5_1", "GPU3") == "PIX"
    assert t.link("mlx5_1", "mlx5_1") == "X"
    assert t.cpu_affinity["GPU2"] == "20-39,60-79"
    assert t.numa_affinity == {g: None for g in t.gpus}  # no NUMA Affinity column
    assert topo.classify(t) == "nvlink"  # all pairs NV, but 2 links x 3 peers fits direct NVLink
    assert topo.worst_link(t) == "NV1"


def test_single_gpu():
    t = topo.parse("\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-7\t0\n")
    assert t.gpus == ("GPU0",)
    assert t.cpu_affinity == {"GPU0": "0-7"}
    assert topo.classify(t) == "single"
    assert topo.worst_link(t) is None
    assert topo.advice(t) == []


def test_no_matrix_raises():
    with pytest.raises(ValueError):
        topo.parse("Failed to initialize NVML: Driver/library version mismatch\n")


# ------------------------------------------------------------- classification


def _matrix(links: list[list[str]]) -> str:
    n = len(links)
    head = "\t" + "\t".join(f"GPU{i}" for i in range(n)) + "\tCPU Affinity\tNUMA Affinity\n"
    rows = "".join(
        f"GPU{i}\t" + "\t".join(" X " if i == j else links[i][j] for j in range(n)) + "\t0-7\t0\n"
        for i in range(n)
    )
    return head + rows


def _sym(n: int, default: str, **pairs: str) -> list[list[str]]:
    m = [[default] * n for _ in range(n)]
    for key, val in pairs.items():
        i, j = int(key[1]), int(key[2])
        m[i][j] = m[j][i] = val
    return m


def test_hgx_4gpu_direct_nvlink_is_nvlink_unless_hinted():
    # HGX A100 4-GPU: NV4 to each of 3 peers = 12 links = all of an A100's links, no switch
    t = topo.parse(_matrix(_sym(4, "NV4")))
    assert topo.classify(t) == "nvlink"
    assert topo.classify(t, nvswitch_hint=True) == "nvswitch"


def test_nvswitch_with_a_degraded_link():
    m = _sym(8, "NV18", p03="NV17")
    t = topo.parse(_matrix(m))
    assert topo.classify(t) == "nvswitch"
    assert topo.worst_link(t) == "NV17"
    assert any("NVLink counts differ" in a for a in topo.advice(t))


def test_two_nvlink_pairs_joined_through_cpu_is_cpu():
    # NVLink bridges on 0-1 and 2-3 only: any ring over 4 GPUs must cross SYS
    t = topo.parse(_matrix(_sym(4, "SYS", p01="NV4", p23="NV4")))
    assert topo.ring_bottleneck(t) == "SYS"
    assert topo.classify(t) == "cpu"
    adv = topo.advice(t)
    assert any(
        "communicate across the CPU interconnect (SYS): all-reduce will be slow; "
        "use gradient accumulation to reduce sync frequency" in a
        for a in adv
    )


def test_pcie_switch_vs_host_bridge():
    assert topo.classify(topo.parse(_matrix(_sym(4, "PXB", p01="PIX", p23="PIX")))) == "pcie-switch"
    t = topo.parse(_matrix(_sym(4, "PHB", p01="PIX", p23="PIX")))
    assert topo.classify(t) == "cpu"
    assert topo.worst_link(t) == "PHB"
    t = topo.parse(_matrix(_sym(4, "NODE", p01="PXB", p23="PXB")))
    assert topo.classify(t) == "cpu"
    assert any("NODE" in a for a in topo.advice(t))


def test_nvlink_and_pcie_mix_is_bounded_by_pcie():
    # NVLink bridges on two pairs, the rest under one PCIe switch: the ring crosses PIX
    t = topo.parse(_matrix(_sym(4, "PIX", p01="NV4", p23="NV4")))
    assert topo.ring_bottleneck(t) == "PIX"
    assert topo.classify(t) == "pcie-switch"


def test_ring_needs_a_cycle_not_a_path():
    # 5 GPUs with NVLink along a path 0-1-2-3-4 only: no NVLink ring; 4-0 closes it via PXB
    m = _sym(5, "PXB", p01="NV2", p12="NV2", p23="NV2", p34="NV2")
    t = topo.parse(_matrix(m))
    assert topo.ring_bottleneck(t) == "PXB"
    m = _sym(5, "PXB", p01="NV2", p12="NV2", p23="NV2", p34="NV2", p04="NV1")
    t = topo.parse(_matrix(m))
    assert topo.ring_bottleneck(t) == "NV1"
    assert topo.classify(t) == "nvlink"


def test_legacy_soc_and_unknown_links():
    t = topo.parse(_matrix(_sym(2, "SOC")))
    assert topo.classify(t) == "cpu"
    assert any("VM or container" in a for a in topo.advice(t))  # SYS, yet one NUMA node
    t = topo.parse(_matrix(_sym(2, "SOC")).replace("\t0-7\t0\n", "\t0-7\t1\n", 1))
    assert any("(SYS)" in a for a in topo.advice(t))
    t = topo.parse(_matrix(_sym(2, "N/A")))
    assert topo.classify(t) == "unknown"


def test_parse_cpu_list():
    assert topo.parse_cpu_list("0-3,8-9") == frozenset({0, 1, 2, 3, 8, 9})
    assert topo.parse_cpu_list("5") == frozenset({5})
    assert topo.parse_cpu_list("N/A") == frozenset()


def test_link_rank_order():
    order = ["NV18", "NV2", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS", "N/A"]
    ranks = [topo.link_rank(x) for x in order]
    assert ranks == sorted(ranks, reverse=True) and len(set(ranks)) == len(ranks)


# ------------------------------------------------------------- advice from what the matrix shows


def _profile_topo(name):
    from torchrig.testbed import gpu_profiles
    return topo.parse(gpu_profiles.load(name)["topo"])


def test_no_numa_column_falls_back_to_cpu_affinity_sockets():
    """DGX-1 (older driver): inline mlx5 columns, CPU Affinity only. The old code read only
    the NUMA column and gave no pinning advice."""
    t = _profile_topo("v100-dgx1-8")
    assert t.nics == ("mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3")
    assert all(v is None for v in t.numa_affinity.values())
    assert topo.classify(t) == "nvlink"
    groups, source = topo.cpu_groups(t)
    assert source == "CPU Affinity" and groups == [("GPU0", "GPU1", "GPU2", "GPU3"),
                                                   ("GPU4", "GPU5", "GPU6", "GPU7")]
    adv = [a for a in topo.advice(t) if "CPU sockets" in a]
    assert adv and "GPU4, GPU5, GPU6, GPU7 on CPUs 20-39,60-79" in adv[0]
    # overlapping CPU sets say nothing about sockets
    assert topo.cpu_groups(topo.parse(_matrix(_sym(2, "SYS")).replace(
        "\tCPU Affinity\tNUMA Affinity", "\tCPU Affinity").replace("\t0-7\t0\n", "\t0-7\n"))) \
        == ([("GPU0", "GPU1")], "CPU Affinity")


def test_all_sys_on_one_numa_node_is_a_vm_hiding_pcie():
    """Every pair SYS, every GPU on NUMA 0: a hypervisor's flat PCIe view, not two sockets."""
    from torchrig.testbed import gpu_profiles
    text = gpu_profiles.load("pcie-nic-8")["topo"]
    vm = re.sub(r"56-111,168-223  1", "0-55,112-167    0", text)
    adv = topo.advice(topo.parse(vm))
    assert any("VM or container" in a and "peer-to-peer" in a for a in adv)
    assert not any("NUMA nodes" in a for a in adv)
    # the same matrix on two real sockets: SYS advice and pinning, no VM claim
    adv = topo.advice(topo.parse(text))
    assert not any("VM or container" in a for a in adv)
    assert any(a.startswith("all GPU pairs communicate across") for a in adv)
    assert any("2 NUMA nodes" in a for a in adv)


def test_nic_legend_of_the_pcie_box():
    t = _profile_topo("pcie-nic-8")
    assert t.nics == ("NIC0", "NIC1") and t.nic_device("NIC1") == "mlx5_1"
    assert topo.classify(t) == "cpu"


def test_topo14_single_h200_with_underline_escapes():
    """Captured on an H200 VM: one GPU, and the header underlined with ANSI escapes even
    though stdout was a pipe."""
    t = topo.parse(fixture(T14))
    assert t.gpus == ("GPU0",) and t.nics == ()
    assert t.link("GPU0", "GPU0") == "X"
    assert t.cpu_affinity == {"GPU0": "0-15"} and t.numa_affinity == {"GPU0": 0}
    assert t.gpu_numa_id == {"GPU0": None}
    assert topo.classify(t) == "single"


# ------------------------------------------------- mangled matrices are refused, not misread

def _mangle_row(text: str, label: str, old: str, new: str) -> str:
    lines = text.split("\n")
    i = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [label])
    assert old in lines[i]
    lines[i] = lines[i].replace(old, new, 1)
    return "\n".join(lines)


@pytest.mark.parametrize("label,old,new", [
    ("GPU3", " X      NV18", " XNV18"),                                            # two links merged
    ("GPU5", "NV18    NV18    NV18    NV18", "NV18    NV18NV18    NV18"),           # a link lost
    ("GPU4", "52-103,156-207  1", "52-103,156-2071"),                             # affinity + NUMA merged
])
def test_a_row_whose_cells_do_not_match_the_header_is_refused(label, old, new):
    """A separator lost in a paste shifts every later cell of that row: the old parser read
    them into the wrong columns (a CPU list as a link, NUMA node missing) without a word."""
    mangled = _mangle_row(fixture(T08), label, old, new)
    with pytest.raises(ValueError, match=rf"row {label} of nvidia-smi topo -m .*mangled|"
                                         rf"row {label} of nvidia-smi topo -m .*shifted"):
        topo.parse(mangled)


def test_a_nic_row_with_a_lost_separator_is_refused_too():
    mangled = _mangle_row(fixture(T02), "NIC0", "PXB     PXB     SYS", "PXB     PXBSYS")
    with pytest.raises(ValueError, match="row NIC0"):
        topo.parse(mangled)


def test_a_row_whose_label_lost_its_separator_is_refused_not_dropped():
    """"GPU1\tNV2\t X" pasted as "GPU1NV2\t X": the row was skipped unseen and the box read as
    nvlink with GPU1 on no NUMA node."""
    text = fixture(T04)
    line = next(ln for ln in text.splitlines() if ln.startswith("GPU1"))
    mangled = text.replace(line, re.sub(r"^GPU1\s+", "GPU1", line), 1)
    assert mangled != text
    with pytest.raises(ValueError, match="row 'GPU1NV"):
        topo.parse(mangled)
    dropped = text.replace(line + "\n", "", 1)  # a row lost whole
    with pytest.raises(ValueError, match="no row for GPU1"):
        topo.parse(dropped)


def test_every_real_capture_and_testbed_profile_still_parses():
    """The row check refuses none of the real layouts (NIC rows without affinity cells,
    inline mlx5 columns, N/A cells, tabs)."""
    from torchrig.testbed import gpu_profiles
    for name in (T01, T02, T04, T08, T13, T14):
        topo.parse(fixture(name))
    topo.parse(OLD_INLINE_MLX5)
    for name in gpu_profiles.names():
        topo.parse(gpu_profiles.load(name)["topo"])


def test_all_sys_in_a_vm_still_says_all_reduce_will_be_slow():
    """Every pair SYS on one NUMA node: the VM note alone left out that all-reduce crosses
    the CPU (the advice a two-socket box with the same links gets)."""
    from torchrig.testbed import gpu_profiles
    text = gpu_profiles.load("pcie-nic-8")["topo"]
    vm = re.sub(r"56-111,168-223  1", "0-55,112-167    0", text)
    adv = topo.advice(topo.parse(vm))
    assert any("VM or container" in a for a in adv)
    assert any(a.startswith("all GPU pairs communicate across the CPU interconnect (SYS): "
                            "all-reduce will be slow") for a in adv), adv
