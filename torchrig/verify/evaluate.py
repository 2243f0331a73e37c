"""verify's judgement: facts in, PASS/FAIL/WARN/NOT RUN out, each with the reason. Pure.

A check that could not run is NOT RUN, never PASS; the overall verdict is PASS only when
every check passed (WARN is advice, not failure)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from ..facts import busbw as busbw_math
from ..facts import nccl_tests, smi_query, topo as topo_mod
from . import thresholds

PASS, FAIL, WARN, NOT_RUN = "PASS", "FAIL", "WARN", "NOT RUN"
# torch_cuda/torch_nccl: what torch was built with and bundles (DDP uses torch's NCCL, not
# libnccl2: an H200 box had libnccl2 2.28.3 and torch's NCCL 2.28.9); known when verify imports
# torch, unknown (equal everywhere) in launch's fast gate
GATE_KEYS = ("driver", "cuda", "nccl", "python", "torch", "torch_cuda", "torch_nccl", "gpus")


@dataclass
class Check:
    name: str
    status: str
    detail: str = ""


@dataclass
class HostVerdict:
    host: str
    checks: list[Check] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    gpus: list[dict] = field(default_factory=list)
    topology: str | None = None
    advice: list[str] = field(default_factory=list)
    interface: str | None = None

    @property
    def status(self) -> str:
        return overall([c.status for c in self.checks])

    def as_dict(self) -> dict:
        return asdict(self) | {"status": self.status}


def overall(statuses: list[str]) -> str:
    if FAIL in statuses:
        return FAIL
    if NOT_RUN in statuses:
        return NOT_RUN
    return PASS


def host_verdict(host: str, facts: dict, expected_gpus: int | None, accelerator: str) -> HostVerdict:
    v = HostVerdict(host)
    failure, gpus = gpu_checks(v, facts, expected_gpus)
    _topology(v, facts, gpus, failure is not None)
    _stack(v, facts, gpus, accelerator, expected_gpus)
    _network(v, facts)
    return v


def gpu_checks(v: HostVerdict, facts: dict, expected_gpus: int | None):
    """The GPUs' own checks from `nvidia-smi --query-gpu` (driver, count, ECC now,
    persistence, PCIe width), added to v (verify's and health's tables share them); returns
    (nvidia-smi's failure or None, the GPUs)."""
    add = v.checks.append
    smi = facts.get("smi_query", {})
    failure = smi_query.detect_failure((smi.get("out", "") + smi.get("err", "")), smi.get("rc"))
    gpus: list[smi_query.Gpu] = []
    if failure:
        add(Check("driver", FAIL, f"{failure.message}: {failure.advice}"))
    else:
        try:
            gpus = smi_query.parse(smi.get("out", ""))
            add(Check("driver", PASS, f"nvidia-smi answers; driver {gpus[0].driver_version}"
                      if gpus else "nvidia-smi answers"))
        except ValueError as e:
            add(Check("driver", FAIL, f"cannot read nvidia-smi output: {e}"))
    v.gpus = [asdict(g) for g in gpus]

    if failure or not gpus and expected_gpus:
        add(Check("gpu-count", NOT_RUN if failure else FAIL,
                  "no GPU list (driver check failed)" if failure else "nvidia-smi listed no GPU"))
    elif expected_gpus is not None and len(gpus) != expected_gpus:
        add(Check("gpu-count", FAIL, f"{_gpus(len(gpus))} visible, inventory says {expected_gpus}"))
    else:
        add(Check("gpu-count", PASS, f"{len(gpus)} x {gpus[0].name}" if gpus else "0"))

    if gpus:
        ecc = [g for g in gpus if (g.ecc_errors_uncorrected_volatile or 0) > 0]
        add(Check("ecc", FAIL if ecc else PASS,
                  "uncorrected ECC errors on GPU " + ", ".join(str(g.index) for g in ecc)
                  + ": drain the host and reset or replace the GPU" if ecc else "no uncorrected errors"))
        off = [g for g in gpus if g.persistence_mode is False]
        add(Check("persistence", WARN if off else PASS,
                  f"persistence mode off on GPU {', '.join(str(g.index) for g in off)}: enable "
                  "nvidia-persistenced (provision does) to avoid slow CUDA start-up" if off else "on"))
        narrow = [g for g in gpus if g.pcie_width_current and g.pcie_width_max
                  and g.pcie_width_current < g.pcie_width_max]
        add(Check("pcie", WARN if narrow else PASS,
                  "PCIe link narrower than the slot: " + ", ".join(
                      f"GPU {g.index} x{g.pcie_width_current}/x{g.pcie_width_max}" for g in narrow)
                  + " (reseat the card or check risers)" if narrow else
                  f"gen{gpus[0].pcie_gen_max} x{gpus[0].pcie_width_max}"))
    return failure, gpus


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _topology(v: HostVerdict, facts: dict, gpus, driver_failed: bool) -> None:
    t = facts.get("topo", {})
    if driver_failed or t.get("rc") != 0:
        v.checks.append(Check("topology", NOT_RUN, "nvidia-smi topo -m did not run"
                              + ("" if driver_failed else f": {(t.get('err') or t.get('out', ''))[:200]}")))
        return
    try:
        tp = topo_mod.parse(t.get("out", ""))
    except ValueError as e:
        v.checks.append(Check("topology", FAIL, f"cannot parse nvidia-smi topo -m: {e}"))
        return
    v.topology = topo_mod.classify(tp)
    v.advice = topo_mod.advice(tp)
    if v.topology == "nvswitch" and facts.get("fabricmanager") != "active":
        v.checks.append(Check("topology", FAIL,
                              "NVSwitch system without a running nvidia-fabricmanager "
                              f"(state: {facts.get('fabricmanager') or 'unknown'}): CUDA init fails "
                              "with error 802. Run `sudo systemctl enable --now "
                              "nvidia-fabricmanager` (same version as the driver)"))
    else:
        v.checks.append(Check("topology", PASS, f"{_gpus(len(tp.gpus))}, {v.topology}"
                              + (f" (worst link {topo_mod.worst_link(tp)})" if len(tp.gpus) > 1 else "")))


def _stack(v: HostVerdict, facts: dict, gpus, accelerator: str, expected_gpus) -> None:
    pk = facts.get("packages", {})
    drv_pkg = pk.get("nvidia-open") or pk.get("cuda-drivers")
    v.versions = {
        "driver": gpus[0].driver_version if gpus else (drv_pkg.split("-")[0] if drv_pkg else None),
        "cuda": facts.get("cuda_toolkit"),
        "nccl": pk.get("libnccl2"),
        "python": facts.get("python"),
        "torch": facts.get("dists", {}).get("torch"),
        "gpus": len(gpus),
    }
    rt = facts.get("torch_runtime")
    if not facts.get("venv_exists") or not v.versions["torch"]:
        v.checks.append(Check("torch", FAIL, "no venv with torch at the provisioned prefix: "
                                             "run `torchrig provision`"))
        return
    if rt is None:
        v.checks.append(Check("torch", PASS, f"torch {v.versions['torch']} installed"))
        return
    if "error" in rt:
        v.checks.append(Check("torch", FAIL, f"`import torch` failed: {rt['error']}"))
        return
    v.versions["torch_cuda"] = rt.get("cuda")
    v.versions["torch_nccl"] = rt.get("nccl")
    if accelerator == "cpu":
        v.checks.append(Check("torch", PASS, f"torch {rt['torch']} (accelerator: cpu, gloo)"))
    elif not rt.get("cuda"):
        v.checks.append(Check("torch", FAIL, f"torch {rt['torch']} is a CPU build: install the "
                                             "CUDA wheel (provision's pip_index_url)"))
    elif expected_gpus is not None and rt.get("device_count") != expected_gpus:
        v.checks.append(Check("torch", FAIL, f"torch.cuda.device_count() = {rt.get('device_count')}, "
                                             f"expected {expected_gpus}"))
    else:
        v.checks.append(Check("torch", PASS, f"torch {rt['torch']}, CUDA {rt.get('cuda')}, "
                                             f"NCCL {rt.get('nccl')}, {rt.get('device_count')} devices"))


def _network(v: HostVerdict, facts: dict) -> None:
    net = facts.get("network")
    if not net:
        return
    if "reachable" not in net and "resolve_error" not in net:  # route only: no probe made
        v.interface = net.get("interface")
        return
    where = f"{net['address']}:{net['port']}"
    if "resolve_error" in net:
        v.checks.append(Check("network", FAIL, f"cannot resolve {net['address']}: {net['resolve_error']}"))
    elif not net.get("reachable"):
        v.checks.append(Check("network", FAIL, f"cannot reach the rendezvous {where}: "
                                               f"{net.get('connect_error')} (firewall?)"))
    else:
        v.interface = net.get("interface")
        v.checks.append(Check("network", PASS, f"reaches {where} via {v.interface} "
                                               f"(use NCCL_SOCKET_IFNAME={v.interface} "
                                               f"GLOO_SOCKET_IFNAME={v.interface})"))
    if "reverse_error" in net:
        ip = net.get("resolved") or net["address"]
        v.checks.append(Check("name-resolution", WARN,
                              f"{ip} has no name here ({net['reverse_error']}): every rank will log "
                              "'[c10d] The hostname of the client socket cannot be retrieved'; give "
                              "the nodes reverse DNS, or /etc/hosts lines on every node for each node "
                              f"both as '{ip} NAME' and '::ffff:{ip} NAME' (the hosts file does not "
                              "map IPv4-mapped addresses)"))


def shown(value) -> str:
    """A gate value as people read it: a version, or "unknown" where a host could not say."""
    return "unknown" if value is None else str(value)


def version_gate(verdicts: list[HostVerdict]) -> tuple[str, dict[str, dict[str, object]], list[str]]:
    """Driver, CUDA, NCCL, Python, torch and GPU count must agree on every host.
    Returns (status, {key: {host: value}}, reasons naming the odd ones out); NOT RUN with an
    empty table when no host answered (nothing to compare)."""
    if not verdicts:
        return NOT_RUN, {}, []
    table = {k: {v.host: v.versions.get(k) for v in verdicts} for k in GATE_KEYS}
    reasons = []
    for k, by_host in table.items():
        counts = Counter(map(shown, by_host.values()))
        if len(counts) > 1:
            common = counts.most_common(1)[0][0]
            odd = [f"{h} has {shown(val)}" for h, val in by_host.items() if shown(val) != common]
            reasons.append(f"{k} differs: most hosts have {common}; " + ", ".join(odd))
    return (FAIL if reasons else PASS), table, reasons


def busbw_check(name: str, samples: list[busbw_math.Sample], nranks: int | None, cls: str,
                gpu_name: str, gpu_count: int | None, overrides: dict | None, what: str) -> Check:
    """Judge one all-reduce sweep against the threshold of its link class and machine: at the
    large sizes the threshold is defined for, from valid halves only, with 2 or more ranks."""
    if not samples:
        return Check(name, NOT_RUN, "no measurements")
    if nranks is not None and nranks < 2:
        return Check(name, NOT_RUN, f"{nranks} rank(s): bus bandwidth is not defined below 2 "
                                    "ranks, so this run says nothing about the links")
    th = thresholds.lookup(cls, gpu_name, overrides, gpu_count)
    if th is None:
        return Check(name, NOT_RUN, f"no busbw threshold for link class {cls!r}")
    valid, invalid = busbw_math.screen(samples)
    flagged = ("; invalid, left out (a no-op, not a transfer): "
               + "; ".join(why for _, why in invalid[:3])
               + (f" and {len(invalid) - 3} more" if len(invalid) > 3 else "")) if invalid else ""
    got = busbw_math.at_large_size(valid, th.min_bytes)
    if got is None:
        return Check(name, NOT_RUN, f"no valid measurement at or above {th.min_bytes} B, the size "
                                    f"the {cls} threshold is defined for{flagged}")
    size, bw = got
    if nranks is None and bw == 0:  # 1 rank gives busbw 0 (factor 2(n-1)/n); unknown count
        return Check(name, NOT_RUN, f"busbw 0 and no rank count in the output (one rank?){flagged}")
    ranks = f"{nranks} ranks" if nranks is not None else "rank count unknown (no per-device lines)"
    # a half that moved nothing says the collective misbehaves even where the rest is fast
    status = (WARN if invalid else PASS) if bw >= th.minimum else FAIL
    return Check(name, status, f"{what}busbw {bw:.3f} GB/s at {size} B over {ranks} "
                               f"(min {th.minimum:g} for {cls}; {th.source}){flagged}")


def bandwidth_check(name: str, result: dict | None, cls: str, gpu_name: str,
                    overrides: dict | None, error: str | None = None,
                    gpu_count: int | None = None) -> Check:
    """The project's benchmark (allreduce_bench JSON) against the class's minimum busbw."""
    if error or result is None:
        return Check(name, NOT_RUN, error or "no result")
    if result.get("wrong_total"):
        return Check(name, FAIL, f"{result['wrong_total']} wrong values in the all-reduce results")
    n = result.get("world_size") or 0
    # recompute from raw numbers: the verdict never trusts the payload's own busbw
    samples = [busbw_math.Sample(r["bytes"], "in-place", r["time_us"],
                                 busbw_math.busbw("all_reduce", r["bytes"], r["time_us"] / 1e6, n)
                                 if n >= 1 and r["time_us"] > 0 else 0.0)
               for r in result.get("rows", [])]
    return busbw_check(name, samples, n, cls, gpu_name, gpu_count, overrides, "")


def nccl_tests_run_check(exit_code: int, stdout: str, stderr: str, cls: str, gpu_name: str,
                         gpu_count: int | None, overrides: dict | None) -> Check:
    """One all_reduce_perf run: a failure it printed FAILs it (whatever rows came before), and
    so does an NCCL WARN line with a non-zero exit or no table; a non-zero exit that names
    neither is NOT RUN; else its table is judged, and a warning it printed makes a PASS a WARN."""
    res = nccl_tests.parse(stdout + "\n" + stderr)
    warned = f"NCCL warned: {res.warnings[0][:300]}" if res.warnings else ""
    if not res.failures and res.warnings and (exit_code != 0 or not res.rows):
        return Check("nccl-tests", FAIL, f"all_reduce_perf: {warned}")
    if exit_code != 0 and not res.failures:
        return Check("nccl-tests", NOT_RUN, f"all_reduce_perf failed: {stderr.strip()[-300:]}")
    chk = nccl_tests_check(res, cls, gpu_name, gpu_count, overrides)
    if not warned:
        return chk
    return Check(chk.name, WARN if chk.status == PASS else chk.status, f"{chk.detail}; {warned}")


def nccl_tests_check(res: nccl_tests.Result, cls: str, gpu_name: str, gpu_count: int | None,
                     overrides: dict | None) -> Check:
    """nccl-tests' all_reduce_perf output: its own busbw (scaled with its real rank count)."""
    if res.failures:
        more = f" (and {len(res.failures) - 1} more failure line(s))" if len(res.failures) > 1 else ""
        return Check("nccl-tests", FAIL, f"all_reduce_perf: {res.failures[0][:300]}{more}")
    if res.any_wrong:
        return Check("nccl-tests", FAIL, "all_reduce_perf counted wrong values (#wrong > 0)")
    return busbw_check("nccl-tests", res.samples(), res.nranks, cls, gpu_name, gpu_count,
                       overrides, "all_reduce_perf ")
