"""`torchrig metrics`: every node's torchrig_* series, fetched from its node_exporter ON the node
over the task's SSH session (no port open to the operator), and the scrape targets provision
prints. The metric definitions are payload/metrics.py's (the sampler's), loaded here as
torchrig/progress.py loads the progress protocol: one definition, no copy."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import TorchrigError
from .inventory import Host
from .onhost import script
from .progress import no_steps
from .quoting import sh
from .resources import payload_module
from .session import Fleet, Outcome

defs = payload_module("metrics")

METRICS = defs.METRICS
KEY = {name: spec[3] for name, spec in METRICS.items()}  # short names for the table and JSON

STALE_S = 90  # a sample older than this (3 sampler rounds) is flagged: its sampler stopped


def scrape_targets(hosts: list[Host]) -> list[tuple[str, str]]:
    """(host, host:port) of every host's node_exporter, for a Prometheus scrape config."""
    return [(h.name, h.settings.node_exporter_listen(h.address)) for h in hosts
            if h.settings.node_exporter]


@dataclass
class JobView:
    """One job on one node, from its series: what `torchrig metrics` prints per row (series
    by their short key: METRICS' fourth field)."""
    job: str
    node: str
    values: dict[str, float] = field(default_factory=dict)   # job series: step, loss, tok/s ...
    state: str | None = None
    rank: str | None = None                                  # whose progress lines
    sample_age_s: float | None = None  # by the node's own clock (node_exporter's node_time_seconds)
    gpus: dict[str, dict[str, float]] = field(default_factory=dict)  # gpu index -> series
    throttled: dict[str, list[str]] = field(default_factory=dict)    # gpu -> reasons now
    unhealthy: str | None = None  # torchrig_node_healthy 0: its reason label (the watcher's)

    def as_dict(self) -> dict:
        return {"job": self.job, "node": self.node, "state": self.state, "rank": self.rank,
                **self.values, "sample_age_s": self.sample_age_s, "gpus": self.gpus,
                "throttled": self.throttled, "unhealthy": self.unhealthy,
                **({"note": self.note} if self.note else {})}

    @property
    def note(self) -> str | None:
        """Why the step, loss and throughput series are missing: no step line was seen (a
        script of the user's own prints none); None when they are there."""
        return None if "step" in self.values else no_steps(None)

    @property
    def stale(self) -> bool:
        return self.sample_age_s is not None and self.sample_age_s > STALE_S


def views(samples: list, job: str | None = None, node_time: float | None = None) -> list[JobView]:
    """The samples grouped by (job, node); only job `job` when given. node_time: the node's
    clock when it answered (for each sample's age)."""
    out: dict[tuple[str, str], JobView] = {}
    for name, labels, value in samples:
        if name not in METRICS or (job and labels.get("job") != job):
            continue
        key = (labels.get("job", ""), labels.get("node", ""))
        v = out.setdefault(key, JobView(*key))
        if name == "torchrig_job_state":
            if value == 1:
                v.state = labels.get("state")
        elif name == "torchrig_node_healthy":
            v.values[KEY[name]] = value
            v.unhealthy = labels.get("reason") or "a fault" if value == 0 else None
        elif name == "torchrig_gpu_clock_throttle":
            if value == 1:
                v.throttled.setdefault(labels.get("gpu", ""), []).append(labels.get("reason", ""))
        elif "gpu" in labels:
            v.gpus.setdefault(labels["gpu"], {})[KEY[name]] = value
        else:
            v.values[KEY[name]] = value
            v.rank = labels.get("rank", v.rank)
            if name == "torchrig_sample_timestamp_seconds" and node_time is not None:
                v.sample_age_s = round(node_time - value, 1)
    return [out[k] for k in sorted(out)]


def collect(fleet: Fleet, hosts: list[Host], job: str | None = None) -> Outcome:
    """Per host: [JobView] of the torchrig_* series its node_exporter serves now."""
    def one(h: Host) -> list[JobView]:
        if not h.settings.node_exporter:
            raise TorchrigError("node_exporter is off on this host (var node_exporter: false)")
        url = f"http://{h.settings.node_exporter_listen(h.address)}/metrics"
        r = fleet.run(h, sh("python3", "-I", "-", url), timeout=60,
                      data=script("metrics/fetch.py"))
        if r.exited != 0:
            err = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
            raise TorchrigError(err[-1][len("error: "):] if err else
                                f"fetching {url} on the node failed (exit {r.exited}): "
                                f"{r.stderr.strip()[-300:]}")
        clock = defs.parse(r.stdout, prefix="node_time_seconds")
        return views(defs.parse(r.stdout), job, clock[0][2] if clock else None)
    what = f"metrics of job {job}" if job else "metrics"
    return Outcome(what, fleet.fan_out(one, hosts))
