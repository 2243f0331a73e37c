"""A job, rendered per node: the torchrun command line, its env file and its systemd unit.
Pure: nothing here connects or runs anything."""

from __future__ import annotations

import os
import posixpath
import shlex
from dataclasses import dataclass, field

from .. import torchrun
from . import elastic
from ..changes import managed
from ..changes.model import FileChange
from ..errors import TorchrigError
from ..render import env_quote, systemd_path, systemd_quote
from ..secrets import MASK, is_secret, redact_text, url_credentials
from ..job import (DEFAULTS, HEALTH_WATCH_S, MEM_FILE, SAMPLER, STOP_GRACE_S, UTIL_FILE, WATCHER,
                   health_record, job_folder, stop_record, unit_name)
from ..facts.xid import app_xids
from ..datasets.manifest import dataset_path
from ..settings import ENV_NAME, JOBS_DIR, SYSTEMD_DIR

def check_env_key(key: str, where: str) -> str:
    if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
        raise TorchrigError(f"{where}: {key!r} is not a valid environment variable name "
                            "(letters, digits and '_', not starting with a digit)")
    return key


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not ENV_NAME.fullmatch(key):
            raise TorchrigError(f"--env {item!r}: expected KEY=VALUE with a valid variable name")
        env[key] = value
    return env


def redact_env(env: dict[str, str], secret_keys: set[str]) -> dict[str, str]:
    """For display: secret names masked whole, URL credentials in any other value masked."""
    return {k: (MASK if k in secret_keys or is_secret(k) else redact_text(v)) for k, v in env.items()}


@dataclass
class Node:
    host: str
    address: str
    node_rank: int
    venv: str
    user: str
    log_dir: str
    checkpoint_dir: str
    data_dir: str
    nproc: int
    interface: str | None
    env: dict[str, str] = field(default_factory=dict)
    metrics_dir: str | None = None   # node_exporter's textfile folder (None: no .prom file)
    gpu_metrics: bool = True         # False where dcgm-exporter exports the GPU series
    firewall: bool = False           # provision's job-port firewall: the job needs it loaded
    home: str | None = None          # the service user's home, the job's HOME (Settings.service_home)


@dataclass
class Job:
    name: str
    script: str                      # path relative to the release (or a module, see module)
    args: list[str]
    max_restarts: int
    rdzv_port: int
    nodes: list[Node]
    release: str                     # payload release directory on every node
    env: dict[str, str] = field(default_factory=dict)
    rdzv_timeout: int = 300          # how long nodes wait for each other (then the job ends)
    exit_barrier_timeout: int = 120  # how long a finished node waits for the others to finish
    secret_keys: set[str] = field(default_factory=set)
    module: bool = False             # script names a module: torchrun -m (the user's project)
    support: str = ""                # torchrig's files (sampler, progress) in the release
    paths: tuple[str, ...] = ()      # the project's package folders in the release (imports.py)
    python: str | None = None        # the job environment's python (None: the torch venv's)
    # marks the unit files this launch wrote: another launch of the same job at the same time
    # may overwrite them, and then this one must neither start nor remove what it finds
    launch_id: str = field(default_factory=lambda: os.urandom(8).hex())
    # the rendezvous run id: random per launch, so that nobody who reaches the store can guess
    # the keys its agents read (never the job name); it lives only in a 0600 root file and the
    # job's environment (torchrun reads PET_RDZV_ID), never in a unit file or a command line
    run_id: str = field(default_factory=lambda: os.urandom(16).hex())
    # payload/torchrig_torchrun.py's early window (TORCHRIG_EARLY_FAIL_S): a first attempt
    # whose workers all fail within it of their spawn is not restarted (0: torchrun's restarts)
    early_fail_s: int = DEFAULTS.early_fail_window
    data: str | None = None          # the dataset (`launch --data`): <data_dir>/<data> on each node
    # an elastic job (`--nodes MIN:MAX`): MIN, its nodes being MAX; None: every node, always
    min_nodes: int | None = None
    # Slurm: how many of the candidate nodes (job.nodes, prepared) it runs on, at most; Slurm
    # picks which. None: every node
    size: int | None = None

    @property
    def nnodes(self) -> int:
        return self.size or len(self.nodes)

    @property
    def nnodes_arg(self) -> int | str:
        """torchrun's --nnodes: N, or MIN:MAX for an elastic job."""
        return self.nnodes if self.min_nodes is None else f"{self.min_nodes}:{self.nnodes}"

    @property
    def rdzv_host(self) -> Node:
        return self.nodes[0]


def torchrun_argv(job: Job, n: Node, endpoint: str | None = None,
                  is_host: bool | None = None) -> list[str]:
    """Node n's torchrun command line. endpoint/is_host: given where the rendezvous host is
    known only when the job runs (Slurm's allocation), else the job's first node."""
    first = job.rdzv_host
    rdzv = torchrun.rendezvous(job.nnodes_arg, endpoint or f"{first.address}:{job.rdzv_port}",
                               n is first if is_host is None else is_host, n.address,
                               join_timeout=job.rdzv_timeout,
                               conf_extra=None if job.min_nodes is None
                               else elastic.rdzv_conf())
    return torchrun.command(n.venv, rdzv, n.nproc, torchrun.BOUNDED_TORCHRUN,
                            python=job.python) + [
        "--max-restarts", str(job.max_restarts), "--log-dir", job_folder(n.log_dir, job.name),
        "--redirects", "3", "--tee", "3", *(["-m"] if job.module else []), job.script, *job.args]


def script_and_args(argv: list[str]) -> tuple[str, list[str]] | None:
    """(script, args) back from a torchrun_argv() command line (a unit's ExecStart): they
    follow its last torchrun option, `--tee 3`. None for another command line."""
    for i in range(len(argv) - 2):
        if argv[i] == "--tee" and argv[i + 1] == "3":
            if argv[i + 2] == "-m" and len(argv) > i + 3:   # a module: shown as `-m pkg.train`
                return f"-m {argv[i + 3]}", argv[i + 4:]
            return argv[i + 2], argv[i + 3:]
    return None


def node_env(job: Job, n: Node) -> dict[str, str]:
    env = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": n.env.get("OMP_NUM_THREADS", "1"),
        # A hung collective is bounded by the process group's timeout (train.py --init-timeout);
        # torch's watchdog then ends the process. TORCH_NCCL_ASYNC_ERROR_HANDLING is left at
        # torch's default (3: no ncclCommAbort first, which can itself hang on a broken network).
        "NCCL_DEBUG": "WARN",
        # gloo: connect rank pairs on first use instead of a full mesh at init, so a restarted
        # group whose nodes start their workers seconds apart does not fail to connect
        "TORCH_GLOO_LAZY_INIT": "1",
        # the agent logs its rendezvous results (global ranks), restarts and waits, which
        # `status` and `logs --failures` read from the unit's journal
        "LOGLEVEL": "INFO",
        "TORCHRIG_EXIT_BARRIER_TIMEOUT": str(job.exit_barrier_timeout),
        "TORCHRIG_EARLY_FAIL_S": str(job.early_fail_s),
        "TORCHRIG_JOB": job.name,
        "TORCHRIG_CKPT_DIR": job_folder(n.checkpoint_dir, job.name),
        "TORCHRIG_DATA_DIR": n.data_dir,
    }
    if job.min_nodes is not None:  # the wrapper picks the endpoint that answers (elastic.py)
        env[elastic.CANDIDATES_ENV] = elastic.candidates([m.address for m in job.nodes],
                                                             job.rdzv_port)
        env["TORCHRIG_RDZV_TURN_S"] = str(elastic.CANDIDATE_TURN_S)
        env["TORCHRIG_RDZV_LOST_EXIT"] = str(elastic.STORE_LOST)
        # torch shares one workers' store made at the first rendezvous; a node that joins
        # later then waits for an address that rank 0 never publishes again (a deadlock):
        # a store per round instead, made by that round's rank 0
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if job.data:  # checked on every node before the launch (datasets.run.check)
        env["TORCHRIG_DATA"] = dataset_path(n.data_dir, job.data)
    if job.support:
        # a user's project: its folder first (its own packages, from any script's folder), its
        # package folders (a src layout), then torchrig's support files (the bounded
        # torchrun, `import progress`)
        env["PYTHONPATH"] = ":".join([job.release, *(f"{job.release}/{p}" for p in job.paths),
                                      f"{job.release}/{job.support}"])
    if n.home:
        # a home the job can write (its caches: Hugging Face, torch.hub, Triton, CUDA's JIT)
        # whatever the node's passwd says (nodes provisioned before it had one); Inductor's
        # cache there too, kept between launches, never /tmp/torchinductor_<user>, a path
        # any local user could make first and fill with the compiled code the job then runs
        env["HOME"] = n.home
        env["TORCHINDUCTOR_CACHE_DIR"] = f"{n.home}/.cache/torchinductor"
    if n.interface:
        env["NCCL_SOCKET_IFNAME"] = n.interface
        env["GLOO_SOCKET_IFNAME"] = n.interface
    env.update(n.env)
    env.update(job.env)
    return env


def render_env(job: Job, n: Node, redact: bool = False) -> str:
    env = node_env(job, n)
    for key in env:  # inventory `env:` keys too: one line per key in the env file
        check_env_key(key, f"{n.host}: env")
    if redact:
        env = redact_env(env, job.secret_keys)
    return managed.JOB_ENV.render(job=job.name, host=n.host,
                                  env=[(k, env_quote(v)) for k, v in env.items()])


def render_run_id(job: Job) -> str:
    return managed.JOB_RUN_ID.render(job=job.name, env=[(torchrun.RUN_ID_ENV, job.run_id)])


def launch_marker(job: Job) -> str:
    """A whole line of the unit file naming the launch that wrote it."""
    return f"# torchrig launch {job.launch_id}"


DATA_LINE = "# torchrig data "  # the unit file's line naming the job's dataset (jobs.py reads it)


def data_line(job: Job) -> str:
    return f"{DATA_LINE}{job.data}" if job.data else ""


def render_unit(job: Job, n: Node) -> str:
    return managed.JOB_UNIT.render(marker=launch_marker(job), data=data_line(job),
                                   firewall=n.firewall, elastic=job.min_nodes is not None,
                                   elastic_span="" if job.min_nodes is None
                                   else elastic.description(job.min_nodes, job.nnodes),
                                   store_lost=elastic.STORE_LOST,
                                   restart_sec=elastic.RESTART_SEC,
                                   stop_record=stop_record(JOBS_DIR, job.name),
                                   unit=unit_name(job.name),
                  job=job.name, host=n.host, node_rank=n.node_rank, nnodes=job.nnodes,
                  user=n.user, workdir=systemd_path(job.release), env_file=env_path(job.name),
                  run_id_file=managed.JOB_RUN_ID.path(job.name),
                  exec_start=" ".join(systemd_quote(a) for a in torchrun_argv(job, n)),
                  stop_timeout=STOP_GRACE_S,
                  max_restarts=job.max_restarts, start_limit_interval=600)


def util_file(n: Node, job: str, name: str = UTIL_FILE) -> str:
    return f"{job_folder(n.log_dir, job)}/{name}"


def sampler_argv(job: Job, n: Node) -> list[str]:
    """The job's sampler (payload/gpumon.py) with the system python: stdlib only, so it runs
    whatever the venv holds, and `-I` keeps the job's environment and folders out of it."""
    sampler = "/".join(p for p in (job.release, job.support, SAMPLER) if p)
    argv = ["/usr/bin/python3", "-I", sampler, "--job", job.name,
            "--node", n.host, "--unit", unit_name(job.name),
            "--logdir", job_folder(n.log_dir, job.name), "--util-file", util_file(n, job.name),
            "--mem-file", util_file(n, job.name, MEM_FILE)]
    if n.metrics_dir:
        argv += ["--textfile-dir", n.metrics_dir, "--health-record", health_record(JOBS_DIR, job.name)]
    if not n.gpu_metrics:
        argv.append("--no-gpu")
    return argv


def job_paths(job: str) -> list[str]:
    """Every file launch writes for the job on a node (what a failed or stopped launch removes)."""
    return [f.path(job) for f in managed.LAUNCH_FILES]


def job_units(job: str) -> list[str]:
    """The names of the job's systemd units on a node (its files in the systemd folder)."""
    return [posixpath.basename(p) for p in job_paths(job) if posixpath.dirname(p) == SYSTEMD_DIR]


def gpumon_paths(job: str) -> list[str]:
    return [managed.GPUMON_SERVICE.path(job), managed.GPUMON_TIMER.path(job)]


def render_gpumon(job: Job, n: Node, interval: int) -> dict[str, str]:
    service, timer = gpumon_paths(job.name)
    exec_start = " ".join(systemd_quote(a) for a in sampler_argv(job, n))
    return {service: managed.GPUMON_SERVICE.render(job=job.name, main=unit_name(job.name),
                                                   user=n.user, exec_start=exec_start),
            timer: managed.GPUMON_TIMER.render(job=job.name, main=unit_name(job.name),
                                               interval=interval)}


def watcher_argv(job: Job) -> list[str]:
    """The node's health watcher (payload/healthwatch.py), root's, with the system python
    (-I: nothing from the environment). The Xids it leaves to the application come from the
    one catalog (facts/xid.py)."""
    watcher = "/".join(p for p in (job.release, job.support, WATCHER) if p)
    return ["/usr/bin/python3", "-I", watcher, "--job", job.name, "--unit", unit_name(job.name),
            "--launch", job.launch_id, "--record", health_record(JOBS_DIR, job.name),
            "--app-xids", ",".join(str(x) for x in app_xids())]


def render_health(job: Job, interval: int = HEALTH_WATCH_S) -> tuple[str, str]:
    """The health watcher's service and timer (bodies)."""
    return (managed.HEALTH_SERVICE.render(job=job.name, exec_start=" ".join(
                systemd_quote(a) for a in watcher_argv(job))),
            managed.HEALTH_TIMER.render(job=job.name, main=unit_name(job.name), interval=interval))


def render_ended(job: Job, n: Node) -> str:
    """The unit started once the job ended: the sampler's last sample, then it stays active."""
    return managed.JOB_ENDED.render(job=job.name, main=unit_name(job.name), user=n.user,
                                    exec_start=" ".join(systemd_quote(a)
                                                        for a in sampler_argv(job, n)))


def env_path(job: str) -> str:
    return managed.JOB_ENV.path(job)


def unit_path(job: str) -> str:
    return managed.JOB_UNIT.path(job)


def job_changes(job: Job, n: Node, interval: int, facts=None) -> list[tuple[str, FileChange | None]]:
    """The node's files for this job through the change engine: (path, its write), the
    write None where the node's file (facts: what a gather of managed.launch_request read
    back) already matches. Without facts every file is written (install: the node lock is
    held only then, so what an earlier read saw may be stale)."""
    service, timer = render_gpumon(job, n, interval).values()
    files = [(managed.JOB_ENV, render_env(job, n), render_env(job, n, redact=True)),
             (managed.JOB_RUN_ID, render_run_id(job), None),
             (managed.JOB_UNIT, render_unit(job, n), None),
             (managed.GPUMON_SERVICE, service, None), (managed.GPUMON_TIMER, timer, None),
             (managed.JOB_ENDED, render_ended(job, n), None),
             *zip((managed.HEALTH_SERVICE, managed.HEALTH_TIMER), render_health(job), (None, None))]
    out = []
    for mf, body, shown in files:
        ch = mf.change(facts, content=body, job=job.name, shown=shown)
        out.append((mf.path(job.name), ch[0] if ch else None))
    return out


def split_args(args: str) -> list[str]:
    try:
        out = shlex.split(args)
    except ValueError as e:
        raise TorchrigError(f"--args {args!r}: {e} (quote it as you would in a shell)") from None
    if url_credentials(args):
        # the arguments go into torchrun's argv (every local user's `ps`) and the 0644 unit
        raise TorchrigError(f"--args {redact_text(args)!r}: holds a URL with credentials; "
                            "pass them in the job's environment instead (--env KEY=VALUE, "
                            "or the inventory's env and secret_env): its file is root's, 0600")
    return out
