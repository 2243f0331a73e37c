"""verify's effects: facts from every host in one round trip each, a short-lived listener on
the first node for the network check, and the all-reduce benchmarks under torchrun."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TorchrigError
from ..facts import nccl_tests, probe, verify_facts
from ..inventory import Host, Inventory
from ..provision.desired import settings_for
from ..remote import connect, fan_out, run_once, sh, with_env
from . import evaluate, thresholds
from .evaluate import Check, HostVerdict

BENCH = Path(__file__).resolve().parents[2] / "payload" / "allreduce_bench.py"
LISTENER = ("import socket,sys\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(64)\n"
            "while True:\n    c, _ = s.accept(); c.close()\n")


@dataclass
class HostOpts:
    venv: str
    prefix: str
    accelerator: str        # cuda | cpu (gloo): a CPU-only cluster, or the testbed
    rdzv_port: int
    busbw_min_gbs: dict
    address: str


def host_opts(inv: Inventory, h: Host) -> HostOpts:
    s = settings_for(h.name, h.vars, inv.path)
    acc = h.vars.get("accelerator", "cuda")
    if acc not in ("cuda", "cpu"):
        raise TorchrigError(f"{inv.path}: host {h.name!r}: var 'accelerator' must be cuda or cpu, "
                            f"got {acc!r}")
    port = h.vars.get("rdzv_port", 29400)
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise TorchrigError(f"{inv.path}: host {h.name!r}: var 'rdzv_port' must be a port number")
    return HostOpts(s.venv, s.prefix, acc, port, h.vars.get("busbw_min_gbs") or {}, h.address)


def gather(inv: Inventory, h: Host, opts: HostOpts, peer: dict | None, torch_runtime: bool,
           accept_new: bool = False) -> dict:
    """One probe round trip as the login user; the raw output is parsed here."""
    req = verify_facts.probe_request(opts.venv, torch_runtime, peer)
    r = run_once(h, inv, probe.COMMAND, accept_new=accept_new, timeout=180, data=probe.stdin(req))
    return verify_facts.facts(opts.venv, peer, probe.reply(r.exited, r.stdout, r.stderr))


@dataclass
class Report:
    hosts: list[HostVerdict] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    gate: tuple = ("PASS", {}, [])
    bandwidth: list[dict] = field(default_factory=list)  # {"scope", "hosts", "check", "result"}

    @property
    def status(self) -> str:
        st = [v.status for v in self.hosts] + [self.gate[0]]
        st += [b["check"].status for b in self.bandwidth]
        st += ["FAIL"] * len(self.unreachable)
        return evaluate.overall(st)

    def redact(self, red) -> None:
        """Mask secrets in every text that came from a host (tool output, error lines) before
        any of it is printed: verify's table and --json go through the one redactor too."""
        for v in self.hosts:
            for ch in v.checks:
                ch.detail = red.text(ch.detail)
            v.advice = [red.text(a) for a in v.advice]
        for b in self.bandwidth:
            b["check"].detail = red.text(b["check"].detail)
        self.unreachable = {h: red.text(e) for h, e in self.unreachable.items()}

    def as_dict(self) -> dict:
        return {"status": self.status, "hosts": [v.as_dict() for v in self.hosts],
                "unreachable": self.unreachable,
                "version_gate": {"status": self.gate[0], "table": self.gate[1], "reasons": self.gate[2]},
                "bandwidth": [{"scope": b["scope"], "hosts": b["hosts"], "status": b["check"].status,
                               "detail": b["check"].detail, "result": b.get("result")}
                              for b in self.bandwidth]}


def verify(inv: Inventory, hosts: list[Host], *, bandwidth: bool = False, full: bool = True,
           accept_new: bool = False, parallel: int = 16) -> Report:
    """full=False is launch's fast gate: versions from package metadata, no torch import."""
    opts = {h.name: host_opts(inv, h) for h in hosts}
    first = hosts[0]
    peer = ({"address": first.address, "port": opts[first.name].rdzv_port, "probe": full}
            if len(hosts) > 1 else None)
    listener = _listen(inv, first, opts[first.name].rdzv_port, accept_new) if peer and full else None
    try:
        results = fan_out(hosts, lambda h: gather(
            inv, h, opts[h.name], peer if h is not first else None, full, accept_new),
            parallel=parallel)
    finally:
        if listener:
            _stop_unit(inv, first, listener, accept_new)
    rep = Report()
    for h, r in zip(hosts, results):
        if not r.ok:
            rep.unreachable[h.name] = r.error
            continue
        rep.hosts.append(evaluate.host_verdict(h.name, r.value, h.gpus, opts[h.name].accelerator))
    rep.gate = evaluate.version_gate(rep.hosts)
    if bandwidth and not rep.unreachable:
        _bandwidth(inv, hosts, opts, rep, accept_new, parallel)
    return rep


def _listen(inv, h: Host, port: int, accept_new: bool) -> str | None:
    """A throwaway TCP listener on the rendezvous port of the first node (if the port is
    free): the other nodes prove they can reach it before a job depends on it."""
    unit = f"torchrig-verify-listen-{secrets.token_hex(4)}"
    r = run_once(h, inv, sh("systemd-run", f"--unit={unit}", "--collect",
                            "--property=RuntimeMaxSec=120", "python3", "-c", LISTENER, str(port))
                 + " && sleep 0.5", root=True, accept_new=accept_new)
    return unit if r.exited == 0 else None


def _stop_unit(inv, h: Host, unit: str, accept_new: bool) -> None:
    run_once(h, inv, sh("systemctl", "stop", unit), root=True, accept_new=accept_new)


def _nproc(v: HostVerdict | None, o: HostOpts) -> int:
    if o.accelerator == "cpu":
        return 2  # two gloo ranks: enough for a real all-reduce on a CPU host
    return max(1, len(v.gpus) if v else 1)


def _bench_cmd(o: HostOpts, nproc: int, rdzv: list[str], env: dict[str, str]) -> str:
    """The benchmark script arrives on stdin into a private folder (mktemp -d: the login
    user's, 0700, a fresh name; removed when the command ends), never a fixed /tmp path
    that another local user could plant a symlink or their own code in."""
    sizes = ["--min-bytes", "1048576", "--max-bytes", "16777216", "--iters", "5"] \
        if o.accelerator == "cpu" else ["--min-bytes", "8388608", "--max-bytes", "1073741824"]
    run = (sh(f"{o.venv}/bin/python", "-m", "torch.distributed.run", *rdzv,
              "--nproc-per-node", str(nproc)) + ' "$TORCHRIG_BENCH" ' + sh(*sizes, "--json", "-"))
    # cd: `python -m` puts the working directory first on sys.path
    return ("d=$(mktemp -d) && trap 'rm -rf -- \"$d\"' EXIT && cd \"$d\" && "
            'export TORCHRIG_BENCH="$d/allreduce_bench.py" && cat > "$TORCHRIG_BENCH" && '
            + with_env(run, {"OMP_NUM_THREADS": "1", **env}))


def _run_bench(inv, h: Host, cmd: str, accept_new: bool, timeout: int = 300) -> dict:
    r = run_once(h, inv, cmd, accept_new=accept_new, timeout=timeout, data=BENCH.read_text())
    m = re.search(r"^ALLREDUCE_JSON (.+)$", r.stdout, re.M)
    if r.exited != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise TorchrigError(f"all-reduce benchmark failed (exit {r.exited}): {' | '.join(tail)}")
    return json.loads(m.group(1)) if m else {}


def _bandwidth(inv, hosts: list[Host], opts: dict[str, HostOpts], rep: Report,
               accept_new: bool, parallel: int) -> None:
    by_name = {v.host: v for v in rep.hosts}
    # within each node
    intra = fan_out(hosts, lambda h: _run_bench(
        inv, h, _bench_cmd(opts[h.name], _nproc(by_name.get(h.name), opts[h.name]), ["--standalone"], {}),
        accept_new), parallel=parallel)
    for h, r in zip(hosts, intra):
        v, o = by_name.get(h.name), opts[h.name]
        cls = "cpu-gloo" if o.accelerator == "cpu" else (v.topology if v and v.topology else "unknown")
        gpu = v.gpus[0]["name"] if v and v.gpus else ""
        chk = evaluate.bandwidth_check("bandwidth (in node)", r.value if r.ok else None, cls, gpu,
                                       o.busbw_min_gbs, None if r.ok else r.error)
        rep.bandwidth.append({"scope": "node", "hosts": [h.name], "check": chk,
                              "result": r.value if r.ok else None})
        _nccl_tests(inv, h, o, v, rep, accept_new)
    if len(hosts) < 2:
        return
    # across nodes: c10d rendezvous on the first node, every node on the interface verify found
    first = hosts[0]
    rid = f"torchrig-verify-{secrets.token_hex(4)}"
    endpoint = f"{first.address}:{opts[first.name].rdzv_port}"

    cross = fan_out(hosts, lambda h: _run_bench(
        inv, h, cross_node_cmd(h, hosts, opts[h.name], by_name.get(h.name), endpoint, rid),
        accept_new), parallel=parallel)
    errors = [f"{r.host}: {r.error}" for r in cross if not r.ok]
    result = next((r.value for r in cross if r.ok and r.value), None)
    o0 = opts[first.name]
    cls = "cpu-gloo" if o0.accelerator == "cpu" else "inter-node"
    gpu = by_name[first.name].gpus[0]["name"] if by_name.get(first.name) and by_name[first.name].gpus else ""
    chk = evaluate.bandwidth_check("bandwidth (across nodes)", result, cls, gpu, o0.busbw_min_gbs,
                                   "; ".join(errors) or None)
    rep.bandwidth.append({"scope": "cluster", "hosts": [h.name for h in hosts], "check": chk,
                          "result": result})


def cross_node_cmd(h: Host, hosts: list[Host], o: HostOpts, v: HostVerdict | None,
                   endpoint: str, rid: str) -> str:
    """Node h's torchrun for the cross-node benchmark. NCCL and gloo use the interface verify
    found on h itself (NIC names differ between nodes on many clusters), as launch does."""
    iface = v.interface if v else None
    env = {k: iface for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")} if iface else {}
    rdzv = ["--nnodes", str(len(hosts)), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", rid, "--rdzv-conf", f"is_host={'true' if h is hosts[0] else 'false'}",
            "--local-addr", h.address]  # what the peers dial (inventory address)
    return _bench_cmd(o, _nproc(v, o), rdzv, env)


def _nccl_tests(inv, h: Host, o: HostOpts, v: HostVerdict | None, rep: Report, accept_new) -> None:
    """nccl-tests' all_reduce_perf too, where provision built it."""
    binary = f"{o.prefix}/nccl-tests/build/all_reduce_perf"
    cxn = connect(h, inv, accept_new=accept_new)
    try:
        if cxn.run(sh("test", "-x", binary), hide=True, warn=True).exited != 0:
            return
        n = len(v.gpus) if v and v.gpus else 1
        r = cxn.run(sh(*nccl_tests.command(min_bytes="8M", max_bytes="1G", gpus=n,
                                           binary_dir=f"{o.prefix}/nccl-tests/build")),
                    hide=True, warn=True, timeout=600)
    finally:
        cxn.close()
    if r.exited != 0:
        chk = Check("nccl-tests", evaluate.NOT_RUN, f"all_reduce_perf failed: {r.stderr.strip()[-300:]}")
        rep.bandwidth.append({"scope": "node-nccl-tests", "hosts": [h.name], "check": chk})
        return
    res = nccl_tests.parse(r.stdout)
    th_cls = v.topology if v and v.topology else "unknown"
    th = thresholds.lookup(th_cls, v.gpus[0]["name"] if v and v.gpus else "", o.busbw_min_gbs)
    best = res.max_busbw_gbs
    if th is None or best is None:
        chk = Check("nccl-tests", evaluate.NOT_RUN, "no threshold or no rows")
    else:
        chk = Check("nccl-tests", evaluate.PASS if best >= th.minimum else evaluate.FAIL,
                    f"all_reduce_perf busbw {best:.1f} GB/s (avg {res.avg_busbw_gbs}); min {th.minimum:g}")
    rep.bandwidth.append({"scope": "node-nccl-tests", "hosts": [h.name], "check": chk})
