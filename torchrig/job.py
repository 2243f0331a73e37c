"""A job's identity and its layout on a node, in one place: the name and its check, the units
that run it, its rendezvous port, its files (env file, log folder, the sampler's files), the
unit states that count as running, torchrun's per-rank log layout, the stop's grace, and
launch's defaults. launch, status, logs, fetch, report and the tasks take them from here.
Pure: nothing here connects or runs anything."""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass

from .errors import TorchrigError

# fullmatch everywhere: `$` would also accept a trailing newline (`exp1\n`)
JOB_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,47}")


def check_job_name(job: str) -> str:
    if not isinstance(job, str) or not JOB_RE.fullmatch(job):
        raise TorchrigError(f"--job {job!r}: use 1-48 lowercase letters, digits, '-' or '_' "
                            "(it names a systemd unit and a log directory)")
    return job


def default_job_name() -> str:
    """launch's name for a job the operator does not name: job-YYYYmmdd-HHMMSS."""
    return time.strftime("job-%Y%m%d-%H%M%S")


def unit_name(job: str) -> str:
    return f"torchrig-{job}.service"


def gpumon_name(job: str, kind: str = "service") -> str:
    """The job's GPU sampler unit. '@' cannot occur in a job name, so no job's main unit
    (torchrig-<job>.service) can ever be another job's sampler (job `x` vs `x-gpumon`)."""
    return f"torchrig-gpumon@{job}.{kind}"


def job_of_unit(unit: str) -> str | None:
    """The job a `torchrig-<job>.service` unit runs; None for anything else (samplers, ...)."""
    if unit.startswith("torchrig-") and unit.endswith(".service"):
        job = unit[len("torchrig-"):-len(".service")]
        if JOB_RE.fullmatch(job):
            return job
    return None


def stop_record(jobs_dir: str, job: str) -> str:
    """What `torchrig stop` recorded in root's jobs folder (settings.JOBS_DIR) before it
    stopped a running job: JSON {"stopped_at": unix time, "was": its state, "by": "stop"}
    (onhost/launch/stop.sh writes it; a launch of the job removes it; jobs.py reads it)."""
    return f"{jobs_dir}/{job}.stopped"


def health_record(jobs_dir: str, job: str) -> str:
    """The node's health watcher's verdict on the job's node (payload/healthwatch.py writes it,
    root's 0644 JSON in root's jobs folder; status and the sampler read it; a launch of the
    job removes it)."""
    return f"{jobs_dir}/{job}.health"


HEALTH_WATCH_S = 10  # seconds between the health watcher's rounds on each node
WATCHER = "healthwatch.py"  # in the payload release (root's), beside smi_xml.py


# a unit in one of these states runs the job (stopping, deactivating, still writes its last
# checkpoint for up to the stop's grace)
RUNNING_STATES = ("active", "activating", "deactivating", "reloading")

RDZV_PORTS = 500  # each job's rendezvous port is one of rdzv_port .. rdzv_port + RDZV_PORTS - 1


def job_port(job: str, base: int) -> int:
    """A c10d port per job, so two jobs on the same nodes never share a rendezvous store."""
    return base + int(hashlib.sha256(job.encode()).hexdigest(), 16) % RDZV_PORTS


# The stop: torchrun gets SIGTERM and forwards it to the workers, which checkpoint and exit;
# torchrun kills what is left after TORCHRUN_GRACE. The whole stop is bounded by STOP_GRACE_S
# (the unit's TimeoutStopSec, Slurm's KillWait).
TORCHRUN_GRACE = 30          # torchrun: SIGTERM to workers, then SIGKILL after this long
FINAL_CHECKPOINT_S = 90      # room for one more step and a checkpoint write
STOP_GRACE_S = TORCHRUN_GRACE + FINAL_CHECKPOINT_S

# In the job's own folder under log_dir (settings): torchrun's per-rank logs and what the
# sampler writes. (Root's env files and the launch lock: settings.JOBS_DIR.)
UTIL_FILE = "gpu_util.csv"                           # the sampler's GPU use samples
MEM_FILE = "gpu_mem.csv"                             # its memory samples (torchrig report)
TENSORBOARD_DIR = "tensorboard"                      # rank 0's TensorBoard events
SAMPLER = "gpumon.py"  # in the payload release (root's), beside progress.py and metrics.py
# torchrun's per-rank layout in the log folder (--log-dir, --redirects 3 --tee 3), which
# logs/merge.py parses and the follower (onhost/logs/follow.py) walks:
#   <run>/attempt_<N>/<local rank>/{stdout.log,stderr.log,error.json}
# <run> is <rdzv_id>_<random>, a new one per torchrun start; attempt_<N+1> per group restart


def job_folder(base: str, job: str) -> str:
    """A job's own folder under a settings folder (log_dir, checkpoint_dir)."""
    return f"{base}/{job}"


@dataclass(frozen=True)
class LaunchDefaults:
    """What launch does when a flag is not given (the task's help quotes these)."""
    script: str = "train.py"
    nproc: str = "gpu"                 # one process per GPU (CPU_PROCS on a CPU host)
    max_restarts: int = 3
    start_timeout: int = 180           # seconds to wait for every node's workers
    rdzv_timeout: int = 300            # seconds nodes wait for each other at (re)start
    exit_barrier_timeout: int = 120    # seconds a finished node waits for the others
    # seconds from the workers' spawn: a first attempt whose workers all fail within it is a
    # start failure (a misspelt argument, a missing import): no torchrun restart, and launch
    # waits that long after the spawn to report it (0: neither; torchrun restarts as before)
    early_fail_window: int = 10


DEFAULTS = LaunchDefaults()
