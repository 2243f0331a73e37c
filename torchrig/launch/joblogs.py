"""`torchrig logs` as one service: a job's rank lines from its nodes (followed, filtered), or
its first failure, whichever backend runs it (a Slurm job is read on the nodes Slurm gave it,
its state from squeue). The lines go to the caller's printer as they come; the result says
which nodes were lost and, for --failures, the report. In launch/ because it reads a job's
Slurm record (status.py); the streaming and the diagnosis themselves are logs/."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..job import check_job_name, unit_name
from ..logs import diagnose
from ..logs.stream import FollowOptions, Printer, failure_report, follow as run_follow
from ..secrets import Redactor
from ..session import Fleet
from .status import journal_ident, lost_nodes, slurm_record


@dataclass
class JobLogs:
    """What `logs` found: the nodes it stopped following and why; with --failures, the
    failure report (redacted), None when no rank failed."""

    job: str
    lost: dict[str, str] = field(default_factory=dict)
    failures: str | None = None


class _Quiet:
    """--failures reads the ranks' files for their error.json only: no line is printed."""

    def line(self, item) -> None:
        pass

    def notice(self, text: str) -> None:
        pass


def job_logs(fleet: Fleet, job: str, printer: Printer, follow: bool = False,
             rank: int | None = None, grep: str | None = None, since: float | None = None,
             color: bool = False, failures: bool = False,
             red: Redactor | None = None) -> JobLogs:
    """Every rank's lines of `job` to `printer` (until the job ends with `follow`); with
    `failures`, nothing printed: the first failed rank, why, and its last lines. A Slurm job
    narrows the fleet's selection to its nodes."""
    job = check_job_name(job)
    sj = slurm_record(fleet, job)
    hosts = fleet.hosts
    o = FollowOptions(job, {h.name: h.settings.job_log_dir(job) for h in hosts}, unit_name(job),
                      follow=follow and not failures, rank=rank, grep=grep, since=since,
                      color=color, slurm_job=sj.job_id if sj else None)
    if not failures:
        return JobLogs(job, run_follow(fleet, hosts, o, printer=printer).lost)
    res = run_follow(fleet, hosts, o, printer=_Quiet())
    # torchrun's agent saw every exit (a signal leaves no error.json); error.json alone when
    # no journal could be read
    journals = diagnose.fetch(fleet, hosts, unit_name(job), ident=journal_ident(job, sj))
    found = diagnose.failures(journals, unit_name(job), res.errors)
    text = diagnose.report(found) or failure_report(res.errors)
    ended = diagnose.below_min(journals, [h.name for h in hosts])
    if ended:
        text = ended + ("\n" + text if text else "")
    lost = lost_nodes(fleet, journals, sj)
    if lost:  # a powered-off node leaves no agent line: say which it was
        text = (f"slurm job {sj.job_id} {sj.as_dict()['state']}: node(s) "
                f"{', '.join(lost)} lost (unreachable)" + ("\n" + text if text else ""))
    return JobLogs(job, res.lost, (red or Redactor()).text(text) if text else None)
