"""verify's effects: facts from every host in one round trip each, a short-lived listener on
the first node for the network check, and the all-reduce benchmarks under torchrun."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from .. import torchrun
from ..errors import TorchrigError
from ..facts import health_facts, nccl_tests, probe, verify_facts
from ..inventory import Host, Inventory
from ..onhost import script
from ..quoting import sh, with_env
from ..resources import PAYLOAD
from ..session import CannotConnect, Fleet
from ..settings import procs_per_node
from . import evaluate, health
from .evaluate import HostVerdict

BENCH = PAYLOAD / "allreduce_bench.py"


@dataclass
class HostOpts:
    venv: str
    prefix: str
    accelerator: str        # cuda | cpu (gloo): a CPU-only cluster, or the testbed
    rdzv_port: int
    busbw_min_gbs: dict
    address: str


def host_opts(inv: Inventory, h: Host) -> HostOpts:
    s = h.settings
    return HostOpts(s.venv, s.prefix, s.accelerator, s.rdzv_port, s.busbw_min_gbs, h.address)


def gather(fleet: Fleet, h: Host, opts: HostOpts, peer: dict | None, torch_runtime: bool,
           also: dict | None = None, diag: int | None = None, root: bool = False) -> tuple[dict, dict]:
    """One probe round trip (as the login user, or root); the raw output is parsed here.
    `also`: more of a probe request (probe.merge) for the same round trip (launch's: GPU
    health, the node's jobs, the release), the raw reply back with the facts. verify proper
    (torch_runtime) gathers GPU health's facts too, and DCGM's diag if asked."""
    req = verify_facts.probe_request(opts.venv, torch_runtime, peer, health=torch_runtime,
                                     diag=diag)
    r = fleet.run(h, probe.COMMAND, timeout=180 + (health_facts.DIAG_TIMEOUT[diag] if diag else 0),
                  data=probe.stdin(probe.merge(req, also or {})), root=root)
    raw = probe.reply(r.exited, r.stdout, r.stderr)
    return verify_facts.facts(opts.venv, peer, raw), raw if also else {}


@dataclass
class VerifyReport:
    hosts: list[HostVerdict] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    gate: tuple = ("PASS", {}, [])
    bandwidth: list[dict] = field(default_factory=list)  # {"scope", "hosts", "check", "result"}
    also: dict[str, dict] = field(default_factory=dict)  # host -> its raw reply (verify(also=...))
    slurm: list = field(default_factory=list)  # Checks of the inventory's Slurm cluster

    @property
    def status(self) -> str:
        st = [v.status for v in self.hosts] + [self.gate[0]]
        st += [b["check"].status for b in self.bandwidth] + [c.status for c in self.slurm]
        st += ["FAIL"] * len(self.unreachable)
        return evaluate.overall(st)

    @property
    def ok(self) -> bool:
        return self.status == "PASS"

    @property
    def failures(self) -> list[str]:
        """One line per thing that is not PASS: a host's checks, an unreachable host, the
        version gate, a bandwidth check."""
        bad = [f"{v.host}: " + "; ".join(f"{ch.name} {ch.status}" for ch in v.checks
                                         if ch.status in ("FAIL", "NOT RUN"))
               for v in self.hosts if v.status != "PASS"]
        bad += [f"{h}: {e}" for h, e in self.unreachable.items()]  # e says what failed
        bad += self.gate[2]
        bad += [f"{b['scope']} bandwidth {b['check'].status}: {b['check'].detail}"
                for b in self.bandwidth if b["check"].status != "PASS"]
        bad += [f"{c.name}: {c.detail}" for c in self.slurm if c.status != "PASS"]
        return bad

    def redact(self, red) -> None:
        """Mask secrets in every text that came from a host (tool output, error lines) before
        any of it is printed: verify's table and --json go through the one redactor too."""
        for v in self.hosts:
            for ch in v.checks:
                ch.detail = red.text(ch.detail)
            v.advice = [red.text(a) for a in v.advice]
        for b in self.bandwidth:
            b["check"].detail = red.text(b["check"].detail)
        for c in self.slurm:
            c.detail = red.text(c.detail)
        self.unreachable = {h: red.text(e) for h, e in self.unreachable.items()}

    def as_dict(self) -> dict:
        return {"status": self.status, "hosts": [v.as_dict() for v in self.hosts],
                "unreachable": self.unreachable,
                "version_gate": {"status": self.gate[0], "table": self.gate[1], "reasons": self.gate[2]},
                "bandwidth": [{"scope": b["scope"], "hosts": b["hosts"], "status": b["check"].status,
                               "detail": b["check"].detail, "result": b.get("result")}
                              for b in self.bandwidth],
                "slurm": [{"check": c.name, "status": c.status, "detail": c.detail}
                          for c in self.slurm]}


def verify(fleet: Fleet, hosts: list[Host], *, bandwidth: bool = False, full: bool = True,
           also: dict | None = None, diag: int | None = None, root: bool = False) -> VerifyReport:
    """full=False is launch's fast gate: versions from package metadata, no torch import, no
    health. also: more of a probe request for the same round trip; each host's raw reply in
    VerifyReport.also. root: the probe as root (launch's, whose GPU health reads the kernel
    log). diag: `dcgmi diag -r N` on every host (full only)."""
    inv = fleet.inv
    opts = {h.name: host_opts(inv, h) for h in hosts}
    first = hosts[0]
    peer = ({"address": first.address, "port": opts[first.name].rdzv_port, "probe": full}
            if len(hosts) > 1 else None)
    listener = _listen(fleet, first, opts[first.name].rdzv_port) if peer and full else None
    try:
        results = fleet.fan_out(lambda h: gather(
            fleet, h, opts[h.name], peer if h is not first else None, full, also,
            diag if full else None, root), hosts)
    finally:
        if listener:
            _stop_unit(fleet, first, listener)
    rep = VerifyReport()
    for h, r in zip(hosts, results):
        if not r.ok:
            rep.unreachable[h.name] = r.error
            continue
        facts, rep.also[h.name] = r.value
        v = evaluate.host_verdict(h.name, facts, h.gpus, opts[h.name].accelerator)
        if "health" in facts:
            v.checks += health.checks(facts["health"], facts["topo"].get("out"),
                                      as_root=facts.get("euid") == 0)
        rep.hosts.append(v)
    rep.gate = evaluate.version_gate(rep.hosts)
    if full and getattr(inv, "slurm", None) is not None:
        from .slurm_checks import cluster_checks
        rep.slurm = cluster_checks(fleet, hosts, {v.host: len(v.gpus) for v in rep.hosts})
    if bandwidth and not rep.unreachable:
        _bandwidth(fleet, hosts, opts, rep)
    return rep


def _listen(fleet: Fleet, h: Host, port: int) -> str | None:
    """A throwaway TCP listener on the rendezvous port of the first node (if the port is
    free): the other nodes prove they can reach it before a job depends on it."""
    unit = f"torchrig-verify-listen-{secrets.token_hex(4)}"
    try:
        fleet.conn(h)
    except CannotConnect:
        return None  # the host's own probe reports it, beside the others'
    r = fleet.run(h, sh("systemd-run", f"--unit={unit}", "--collect",
                        "--property=RuntimeMaxSec=120", "python3", "-c",
                        script("verify/port_listener.py"), str(port))
                  + " && sleep 0.5", root=True)
    return unit if r.exited == 0 else None


def _stop_unit(fleet: Fleet, h: Host, unit: str) -> None:
    try:
        fleet.run(h, sh("systemctl", "stop", unit), root=True)
    except CannotConnect:  # the host dropped meanwhile: its row in the report says so
        pass


def _nproc(v: HostVerdict | None, o: HostOpts) -> int:
    return procs_per_node(o.accelerator, max(1, len(v.gpus) if v else 1))


def _bench_cmd(o: HostOpts, nproc: int, rdzv: list[str], env: dict[str, str]) -> str:
    """The benchmark script arrives on stdin into a private folder (mktemp -d: the login
    user's, 0700, a fresh name; removed when the command ends), never a fixed /tmp path
    that another local user could plant a symlink or their own code in."""
    sizes = ["--min-bytes", "1048576", "--max-bytes", "16777216", "--iters", "5"] \
        if o.accelerator == "cpu" else ["--min-bytes", "8388608", "--max-bytes", "1073741824"]
    run = sh(*torchrun.command(o.venv, rdzv, nproc)) + ' "$TORCHRIG_BENCH" ' + sh(*sizes, "--json", "-")
    # cd: `python -m` puts the working directory first on sys.path
    return ("d=$(mktemp -d) && trap 'rm -rf -- \"$d\"' EXIT && cd \"$d\" && "
            'export TORCHRIG_BENCH="$d/allreduce_bench.py" && cat > "$TORCHRIG_BENCH" && '
            + with_env(run, {"OMP_NUM_THREADS": "1", **env}))


def _run_bench(fleet: Fleet, h: Host, cmd: str, timeout: int = 300) -> dict:
    r = fleet.run(h, cmd, timeout=timeout, data=BENCH.read_text())
    m = re.search(r"^ALLREDUCE_JSON (.+)$", r.stdout, re.M)
    if r.exited != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise TorchrigError(f"all-reduce benchmark failed (exit {r.exited}): {' | '.join(tail)}")
    return json.loads(m.group(1)) if m else {}


def _bandwidth(fleet: Fleet, hosts: list[Host], opts: dict[str, HostOpts], rep: VerifyReport) -> None:
    by_name = {v.host: v for v in rep.hosts}
    # within each node
    intra = fleet.fan_out(lambda h: _run_bench(
        fleet, h, _bench_cmd(opts[h.name], _nproc(by_name.get(h.name), opts[h.name]),
                             list(torchrun.STANDALONE), {})),
        hosts)
    for h, r in zip(hosts, intra):
        v, o = by_name.get(h.name), opts[h.name]
        cls = "cpu-gloo" if o.accelerator == "cpu" else (v.topology if v and v.topology else "unknown")
        gpu = v.gpus[0]["name"] if v and v.gpus else ""
        chk = evaluate.bandwidth_check("bandwidth (in node)", r.value if r.ok else None, cls, gpu,
                                       o.busbw_min_gbs, None if r.ok else r.error,
                                       len(v.gpus) if v else None)
        rep.bandwidth.append({"scope": "node", "hosts": [h.name], "check": chk,
                              "result": r.value if r.ok else None})
        _nccl_tests(fleet, h, o, v, rep)
    if len(hosts) < 2:
        return
    # across nodes: c10d rendezvous on the first node, every node on the interface verify found
    first = hosts[0]
    rid = secrets.token_hex(16)  # unguessable, as launch's (torchrun.RUN_ID_ENV)
    endpoint = f"{first.address}:{opts[first.name].rdzv_port}"

    cross = fleet.fan_out(lambda h: _run_bench(
        fleet, h, cross_node_cmd(h, hosts, opts[h.name], by_name.get(h.name), endpoint, rid)),
        hosts)
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
    env[torchrun.RUN_ID_ENV] = rid
    rdzv = torchrun.rendezvous(len(hosts), endpoint, h is hosts[0], h.address)
    return _bench_cmd(o, _nproc(v, o), rdzv, env)


def _nccl_tests(fleet: Fleet, h: Host, o: HostOpts, v: HostVerdict | None, rep: VerifyReport) -> None:
    """nccl-tests' all_reduce_perf too, where provision built it."""
    binary = f"{o.prefix}/nccl-tests/build/all_reduce_perf"
    if fleet.run(h, sh("test", "-x", binary)).exited != 0:
        return
    n = len(v.gpus) if v and v.gpus else 1
    r = fleet.run(h, sh(*nccl_tests.command(min_bytes="8M", max_bytes="1G", gpus=n,
                                            binary_dir=f"{o.prefix}/nccl-tests/build")),
                  timeout=600)
    chk = evaluate.nccl_tests_run_check(r.exited, r.stdout, r.stderr,
                                        v.topology if v and v.topology else "unknown",
                                        v.gpus[0]["name"] if v and v.gpus else "",
                                        len(v.gpus) if v else None, o.busbw_min_gbs)
    rep.bandwidth.append({"scope": "node-nccl-tests", "hosts": [h.name], "check": chk})
