"""`torchrig health`'s effects: one probe round trip per host, as root (the kernel log is
root's to read), with GPU health's commands and nvidia-smi's GPU list and topology; judged by
evaluate.gpu_checks and health.checks into verify's report shape (same tables, same --json)."""

from __future__ import annotations

from datetime import datetime

from ..facts import health_facts, probe, smi_query, topo
from ..inventory import Host
from ..secrets import Redactor
from ..session import Fleet
from . import evaluate, health
from .evaluate import HostVerdict
from .run import VerifyReport


def request(diag: int | None = None) -> dict:
    return {"run": {**health_facts.probe_run(diag), "smi_query": smi_query.command(),
                    "topo": topo.COMMAND}, "host": True}


def verdict(h: Host, raw: dict, since: datetime | None) -> HostVerdict:
    """One host's health table from the probe's raw reply (pure)."""
    v = HostVerdict(h.name)
    evaluate.gpu_checks(v, {"smi_query": raw["run"]["smi_query"]}, h.gpus)
    v.checks += health.checks(health_facts.facts(raw["run"]), raw["run"]["topo"].get("out"),
                              since, as_root=True)
    return v


def gather(fleet: Fleet, h: Host, req: dict, diag: int | None) -> dict:
    r = fleet.run(h, probe.COMMAND, root=True, data=probe.stdin(req),
                  timeout=180 + (health_facts.DIAG_TIMEOUT[diag] if diag else 0))
    return probe.reply(r.exited, r.stdout, r.stderr, "reading GPU health")


def check(fleet: Fleet, hosts: list[Host], since: datetime | None = None,
          diag: int | None = None, red: Redactor | None = None) -> VerifyReport:
    """Every host's health, FAIL / WARN / PASS per check; an unreachable host as verify says."""
    req = request(diag)
    return report(hosts, fleet.fan_out(lambda h: gather(fleet, h, req, diag), hosts), since, red)


def report(hosts: list[Host], results, since: datetime | None = None,
           red: Redactor | None = None) -> VerifyReport:
    """The health report from each host's probe result (a session Result: ok with the raw
    reply of request()'s commands, or the host's error), redacted (pure)."""
    rep = VerifyReport()
    for h, r in zip(hosts, results):
        if r.ok:
            rep.hosts.append(verdict(h, r.value, since))
        else:
            rep.unreachable[h.name] = r.error
    rep.redact(red or Redactor())
    return rep
