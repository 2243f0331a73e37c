"""GPU health's judgement: the raw health facts (facts/health_facts.py) in, one Check per
domain out (xid, memory, pcie-link, nvlink, clocks, dcgm-diag), each PASS / WARN / FAIL /
NOT RUN with the GPU, the reason and what to do. Pure.

FAIL is what a job must not land on (launch refuses it): a node-fault Xid, an uncorrectable
error now, a row remap or page retirement waiting for a reset, a failed remap, an NVLink the
topology promises that is down, a DCGM test that failed. WARN is worth a look but not a
refusal: an application Xid, errors in the GPU's history, PCIe replays, a slowdown."""

from __future__ import annotations

from datetime import datetime

from ..facts import dcgm_diag, nvlink, smi_xml, topo as topo_mod, xid
from .evaluate import FAIL, NOT_RUN, PASS, WARN, Check

RESET = "reset the GPU (nvidia-smi -r -i {i}) or reboot the node"
# the checks whose FAIL keeps a job off the node (launch's health gate): health's own and
# verify's uncorrectable-ECC-now row
GATE_CHECKS = ("xid", "memory", "pcie-link", "nvlink", "clocks", "dcgm-diag", "ecc")


def _worst(items: list[tuple[str, str]], name: str, fine: str) -> Check:
    """items: (status, text) findings of one domain -> one Check (the worst status first)."""
    if not items:
        return Check(name, PASS, fine)
    status = FAIL if any(s == FAIL for s, _ in items) else WARN
    items = sorted(items, key=lambda it: it[0] != FAIL)
    return Check(name, status, "; ".join(t for _, t in items))


def _not_run(name: str, r: dict | None, what: str) -> Check:
    r = r or {}
    err = (r.get("err") or r.get("out") or "").strip().splitlines()
    return Check(name, NOT_RUN, f"{what} did not run" + (f": {err[-1][:200]}" if err else ""))


def xid_check(facts: dict, buses: dict[str, int], since: datetime | None,
              as_root: bool = True) -> Check:
    """as_root=False (verify's probe runs as the login user): a kernel log the user may not
    read is a WARN pointing at `health` (run as root), not a NOT RUN failing verify."""
    text, source = xid.kernel_text(facts.get("kernel_journal") or {}, facts.get("kernel_dmesg") or {})
    if source is None:
        c = _not_run("xid", facts.get("kernel_dmesg"), "reading the kernel log (journalctl -k, dmesg)")
        if not as_root:
            return Check("xid", WARN, c.detail + ": the login user may not read it; "
                                                 "`torchrig health` reads it as root")
        c.detail += " (as root)"
        return c
    items, seen = [], set()
    for e in xid.parse(text, since):
        if (e.code, e.bus) in seen:  # one finding per Xid and GPU; the newest line wins below
            continue
        seen.add((e.code, e.bus))
        gpu = xid.gpu_index(e.bus, buses)
        where = f"GPU {gpu} ({e.bus})" if gpu is not None else f"PCI {e.bus}"
        info = e.info
        when = f" at {e.when.isoformat()}" if e.when else ""
        if info is None:
            items.append((FAIL, f"{where}: Xid {e.code}{when} ({e.text[:120]}): not in torchrig's "
                                "catalog: look it up in NVIDIA's Xid catalog before using the GPU"))
            continue
        name = f"{info.mnemonic}, " if info.mnemonic else ""
        action = f" [{info.action}]" if info.action else ""
        items.append((FAIL if info.node_fault else WARN,
                      f"{where}: Xid {e.code} ({name}{info.what}){when}{action}: {info.advice}"))
    return _worst(items, "xid", f"no Xid in the kernel log ({source}"
                                + (f", since {since.isoformat()})" if since else ", this boot)"))


def memory_check(gpus: list[smi_xml.GpuHealth]) -> Check:
    items = []
    for g in gpus:
        reset = RESET.format(i=g.index)
        if g.remap_failure:
            items.append((FAIL, f"GPU {g.index}: row remapping failed: the GPU has run out of "
                                "spare rows; drain the node and RMA the GPU"))
        if g.remap_pending:
            items.append((FAIL, f"GPU {g.index}: a row remap is pending: {reset} to activate it"))
        if g.retirement_pending:
            items.append((FAIL, f"GPU {g.index}: a page retirement is pending: {reset} to "
                                "activate it"))
        if g.uncorrectable_volatile:
            items.append((FAIL, f"GPU {g.index}: {g.uncorrectable_volatile} uncorrectable ECC "
                                f"error(s) since the driver loaded: {reset}; RMA if they recur"))
        elif g.uncorrectable_aggregate:
            items.append((WARN, f"GPU {g.index}: {g.uncorrectable_aggregate} uncorrectable ECC "
                                "error(s) in its lifetime (none now): watch it; RMA if they recur"))
        if g.retired_pages:
            items.append((WARN, f"GPU {g.index}: {g.retired_pages} page(s) retired for "
                                "double-bit errors"))
    return _worst(items, "memory", "no uncorrectable ECC error, no pending remap or retirement"
                  if any(g.ecc_enabled for g in gpus) else "no ECC on these GPUs: nothing to check")


def pcie_check(gpus: list[smi_xml.GpuHealth]) -> Check:
    """Replays (the width is the `pcie` check's, from --query-gpu)."""
    items = []
    for g in gpus:
        if g.pcie_replays:
            items.append((WARN, f"GPU {g.index}: {g.pcie_replays} PCIe replays: a marginal link; "
                                "reseat the card if they keep growing"))
    g0 = gpus[0] if gpus else None
    # the generation drops at idle to save power: shown, not judged
    return _worst(items, "pcie-link", f"gen{g0.pcie_gen}/{g0.pcie_gen_max} x{g0.pcie_width}, no "
                  "replays" if g0 else "no GPU")


def clocks_check(gpus: list[smi_xml.GpuHealth]) -> Check:
    items = [(WARN, f"GPU {g.index}: {', '.join(smi_xml.SLOWDOWNS[s] for s in g.slowdowns)} "
                    "active: check cooling, power supply and the BMC's event log")
             for g in gpus if g.slowdowns]
    return _worst(items, "clocks", "no hardware, thermal or power-brake slowdown")


def nvlink_check(facts: dict, topo_out: str | None) -> Check:
    st = facts.get("nvlink_status") or {}
    if st.get("rc") != 0:
        return _not_run("nvlink", st, "nvidia-smi nvlink -s")
    links = nvlink.parse_status(st.get("out", ""))
    er = facts.get("nvlink_errors") or {}
    if er.get("rc") == 0:
        nvlink.parse_errors(er.get("out", ""), links)
    promised = {}
    if topo_out:
        try:
            promised = topo_mod.promised_nvlinks(topo_mod.parse(topo_out))
        except ValueError:
            promised = {}
    items = []
    for gpu, want in sorted(promised.items()):
        got = links.get(gpu, nvlink.Links())
        if len(got.up) < want:
            down = f" (down: {', '.join(map(str, got.down))})" if got.down else ""
            items.append((FAIL, f"GPU {gpu}: {len(got.up)} of the {want} NVLinks the topology "
                                f"promises are up{down}: reset the GPU; if the link stays "
                                "down, reseat (bridge/board) or RMA"))
    for gpu, got in sorted(links.items()):
        bad = {ln: {k: n for k, n in c.items() if n} for ln, c in got.errors.items()}
        bad = {ln: c for ln, c in bad.items() if c}
        if bad:
            what = ", ".join(f"link {ln} " + "/".join(f"{k.lower()} {n}" for k, n in c.items())
                             for ln, c in sorted(bad.items()))
            items.append((WARN, f"GPU {gpu}: NVLink errors: {what}: watch them; reset the GPU "
                                "if they grow"))
    total = sum(len(x.up) for x in links.values())
    return _worst(items, "nvlink", f"{total} links up, no errors" if total else "no NVLink")


def diag_check(facts: dict) -> Check | None:
    r = facts.get("dcgm_diag")
    if r is None:
        return None
    try:
        results = dcgm_diag.parse(r.get("out", ""))
    except ValueError as e:
        return _not_run("dcgm-diag", r, f"dcgmi diag ({e})")
    items = [(FAIL if t.status == "FAIL" else WARN,
              f"{t.name}" + (f" GPU {t.gpu}" if t.gpu is not None else "") + f": {t.status}"
              + (f" ({t.info[:200]})" if t.info else "")
              + (": RMA or reseat the GPU per the test's advice" if t.status == "FAIL" else ""))
             for t in results if t.status in ("FAIL", "WARN")]
    ran = sum(1 for t in results if t.status == "PASS")
    return _worst(items, "dcgm-diag", f"{ran} test result(s) passed")


def checks(facts: dict, topo_out: str | None, since: datetime | None = None,
           as_root: bool = True) -> list[Check]:
    """Every health Check of one host from its raw health facts and `nvidia-smi topo -m`'s
    output (the NVLinks it promises); as_root: whether the probe ran as root (xid_check)."""
    r = facts.get("health_xml") or {}
    out: list[Check] = []
    gpus: list[smi_xml.GpuHealth] = []
    if r.get("rc") != 0:
        out.append(_not_run("memory", r, "nvidia-smi -q -x"))
    else:
        try:
            gpus = smi_xml.parse(r.get("out", ""))
        except ValueError as e:
            out.append(Check("memory", NOT_RUN, str(e)))
    buses = {g.bus_id: g.index for g in gpus}
    out.insert(0, xid_check(facts, buses, since, as_root))
    if gpus:
        out += [memory_check(gpus), pcie_check(gpus), clocks_check(gpus)]
    out.append(nvlink_check(facts, topo_out))
    d = diag_check(facts)
    return out + ([d] if d else [])
