"""launch and stop as one service each, whichever backend runs the job: the backend chosen
(--backend, else the hosts' `backend` var), the nodes the job runs on (--nodes: the first N
selected hosts, or Slurm's pick), then the one call into systemd's (run.py) or Slurm's
(slurm.py) side. Typed results; the tasks (cli/launch.py) parse flags and render."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import TorchrigError
from ..inventory import Host
from . import elastic

if TYPE_CHECKING:
    from ..session import Fleet, Outcome
    from . import run, slurm

BACKENDS = ("systemd", "slurm")


def first_nodes(hosts: list[Host], nodes: int | str | None) -> list[Host]:
    """`--nodes N` of a systemd job: the first N selected hosts (the first hosts the
    rendezvous); `MIN:MAX`: the first MAX; every selected host without it."""
    got = elastic.parse_nodes(nodes)
    if got is None:
        return hosts
    if got[1] > len(hosts):
        raise TorchrigError(f"--nodes {nodes}: only {len(hosts)} host(s) selected "
                            f"({', '.join(h.name for h in hosts)})")
    return hosts[:got[1]]


def _backend(fleet: Fleet, backend: str | None) -> str:
    chosen = backend or (fleet.hosts[0].settings.backend if fleet.hosts else "systemd")
    if chosen not in BACKENDS:
        raise TorchrigError(f"--backend {backend!r}: systemd or slurm")
    return chosen


def first_contact(fleet: Fleet, nodes: int | str | None, backend: str | None,
                  skip_unhealthy: bool) -> list[Host]:
    """The hosts a launch connects to first, before it has imported what it runs (the CLI
    opens their connections meanwhile: Fleet.preconnect): a systemd job's nodes, or every
    selected host when unhealthy ones may be left out; none for Slurm (the controller first,
    and the compute hosts Slurm picks)."""
    if _backend(fleet, backend) == "slurm":
        return []
    return fleet.hosts if skip_unhealthy else first_nodes(fleet.hosts, nodes)


def launch(fleet: Fleet, o: run.LaunchOptions, nodes: int | str | None = None,
           backend: str | None = None, partition: str | None = None,
           time_limit: str | None = None, log=print,
           skip_unhealthy: bool = False) -> run.Launched | slurm.SlurmLaunched:
    """Start the job on its backend. A systemd job narrows the fleet's selection to its nodes
    (what a Ctrl-C of a following task names; run.launch, whose first probe judges health
    too); Slurm picks its nodes among the selected compute hosts (SlurmLaunched.slurm.nodes).
    Unhealthy nodes are refused or left out first."""
    from . import health_gate, run, slurm  # here: first_contact() is imported before them
    chosen = _backend(fleet, backend)
    span = elastic.parse_nodes(nodes)
    if chosen == "slurm":
        nodes = None if span is None else span[1]
        if elastic.is_elastic(span):  # MAX nodes, kept with --no-kill (templates/slurm)
            o.min_nodes = span[0]
        if o.dry_run:
            raise TorchrigError("--dry-run with --backend slurm: not supported (nothing is "
                                "written on the nodes but the job's folders; the batch script "
                                "goes to sbatch)")
        slurm.check_slurm_options(partition, time_limit)  # a bad flag before a node is touched
        first, n = slurm.allocatable(fleet, fleet.hosts, nodes)
        run.check_batch(first[:n], o)  # so is a global batch that does not divide
        hosts = health_gate.gate_slurm(fleet, fleet.hosts, skip_unhealthy, log)
        return slurm.launch(fleet, hosts, o, nodes, partition, time_limit, log=log)
    if partition is not None or time_limit is not None:
        raise TorchrigError("--partition and --time are Slurm's: add --backend slurm")
    first = first_nodes(fleet.hosts, nodes)  # a wrong count is refused before a node is touched
    if elastic.is_elastic(span):
        o.min_nodes = span[0]
    run.check_batch(first, o)  # so is a global batch that does not divide
    if skip_unhealthy:  # every selected host probed; the first N healthy ones are the nodes
        return run.launch(fleet, fleet.hosts, o, log=log, skip_unhealthy=True,
                          pick=lambda healthy: first_nodes(healthy, nodes))
    fleet.hosts = first
    return run.launch(fleet, first, o, log=log)


@dataclass
class Stopped:
    """stop's result: a Slurm job's record after scancel, or per node what systemd did
    (Outcome: None where the job was not there)."""

    job: str
    slurm: slurm.SlurmJob | None = None
    nodes: Outcome | None = None


def stop(fleet: Fleet, job: str, log=print) -> Stopped:
    """Stop the job wherever it runs: through Slurm when the inventory's cluster knows it,
    else its units on the selected hosts."""
    from . import run, slurm
    sj = slurm.find(fleet, job) if getattr(fleet.inv, "slurm", None) is not None else None
    if sj is not None:  # its record, read once: stop acts on it
        return Stopped(job, slurm=slurm.stop(fleet, sj, log=log))
    return Stopped(job, nodes=run.stop(fleet, fleet.hosts, job))
