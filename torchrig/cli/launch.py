"""launch and stop: a job started everywhere or nowhere, and stopped."""

from __future__ import annotations

from invoke import Exit

from torchrig.job import DEFAULTS  # launch's defaults, quoted in its help (a light module)

from .common import (_fleet, _job_keeps_running, _latest_job, _log, _number, _redactor, _say,
                     fleet_task)
from .logs import logs


@fleet_task(iterable=["env"],
      help={"nodes": "use the first N selected hosts (the first one hosts the rendezvous); "
                     "MIN:MAX: an elastic job on the first MAX, training on as long as MIN "
                     "are up and taken back by a node that returns (docs/jobs.md)",
            "nproc_per_node": "processes per node: a number, or 'gpu' = one per GPU "
                              "(2 on hosts with var accelerator: cpu)",
            "script": "the training script: a path inside --workdir, else inside torchrig's "
                      f"payload/ (default {DEFAULTS.script})",
            "workdir": "your project's folder: pushed to every node as a verified release "
                       "(its .gitignore and .torchrigignore honoured), the job's working "
                       "directory and on its PYTHONPATH (default: torchrig's payload/)",
            "module": "run a module of the project instead of a script (torchrun -m pkg.train)",
            "requirements": "the project's requirements file (default: its requirements.txt, "
                            "else pyproject.toml's dependencies), installed once per content "
                            "into a job environment on every node",
            "allow_torch_change": "let the requirements replace the provisioned torch (in the "
                                  "job environment only)",
            "args": "arguments for the script, quoted as in a shell",
            "job": "job name (default job-YYYYmmdd-HHMMSS); names the unit and log directory",
            "max_restarts": "torchrun restarts of the worker group after a failure "
                            f"(default {DEFAULTS.max_restarts})",
            "env": "KEY=VALUE for the job's environment (repeatable); secret-looking names "
                   "and the inventory's secret_env are redacted everywhere they are shown",
            "dry_run": "show per node the job's files as diffs against the node's; change nothing",
            "follow": "after starting, stream every rank's log lines until the job ends",
            "start_timeout": "seconds to wait for every node's workers "
                             f"(default {DEFAULTS.start_timeout})",
            "rdzv_timeout": "seconds nodes wait for each other at (re)start; after a node is lost "
                            f"the survivors end after this (default {DEFAULTS.rdzv_timeout})",
            "exit_barrier_timeout": "seconds a node whose workers finished waits for the other "
                                    "nodes to finish (torchrun's exit barrier; default "
                                    f"{DEFAULTS.exit_barrier_timeout})",
            "early_fail_window": "seconds from the workers' spawn in which a first attempt whose "
                                 "ranks all fail (a misspelt --args, a missing import) is not "
                                 "restarted and launch exits 1 at once with the failing rank's "
                                 "last stderr lines; a launch that succeeds returns this long "
                                 "(plus ~1s) after the spawn: its cost. 0: off, torchrun "
                                 f"restarts as before (default {DEFAULTS.early_fail_window})",
            "backend": "systemd (torchrig's units) or slurm (sbatch on the inventory's `slurm:` "
                       "cluster; Slurm picks --nodes N of the selected compute hosts); "
                       "default: the `backend` var",
            "partition": "slurm: the partition (default: the cluster's default one)",
            "time": "slurm: the job's time limit (e.g. 2:00:00); the payload gets SIGTERM "
                    "2 minutes before it, to checkpoint",
            "data": "a dataset pushed with `torchrig data.push`: checked on every node before "
                    "anything starts (same version, files as pushed), given to the job as "
                    "TORCHRIG_DATA (the payload's --data default)",
            "data_verify": "quick (sizes and the push's records; the default) or full (every "
                           "file re-hashed on every node)",
            "skip_unhealthy": "leave out a node whose GPU health is FAIL (`torchrig health`) "
                              "instead of refusing to start",
            "spec": "a job file (YAML; docs/jobs.md, jobs/example.yml) giving these flags' "
                    "values; a flag given on the command line wins (--env: per key)"})
def launch(c, inventory=None, host=None, nodes=None, nproc_per_node=None, script=None,
           args=None, job=None, max_restarts=None, env=None, dry_run=False, follow=False,
           start_timeout=None, rdzv_timeout=None, exit_barrier_timeout=None,
           backend=None, partition=None, time=None, workdir=None, module=None,
           requirements=None, allow_torch_change=False, spec=None, accept_new_host_keys=False,
           early_fail_window=None, data=None, data_verify=None, skip_unhealthy=False):
    """Run a torchrun DDP job under systemd (or Slurm) on the nodes: everywhere or nowhere."""
    from torchrig.launch import service, spec as job_spec
    given = {k: v for k, v in locals().items() if k in job_spec.FLAGS}  # None: not given
    given.update({k: _number(k, given[k], m) for k, m in (
        ("max_restarts", 0), ("start_timeout", 1), ("rdzv_timeout", 1),
        ("exit_barrier_timeout", 1), ("early_fail_window", 0)) if given[k] is not None})
    loaded = None if spec is None else job_spec.load(spec)
    opts = job_spec.merge(loaded, given, str(spec))  # the flags given over the file
    where = [opts.pop(k) for k in job_spec.SERVICE_KEYS]  # nodes, backend, partition, time
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        # the nodes' handshakes overlap the import of what launch runs (a third of a second)
        fleet.preconnect(service.first_contact(fleet, where[0], where[1], skip_unhealthy))
        from torchrig.launch.run import LaunchOptions
        from torchrig.launch.slurm import SlurmLaunched
        o = LaunchOptions(dry_run=dry_run, **opts)
        res = service.launch(fleet, o, *where, log=_log, skip_unhealthy=skip_unhealthy)
    if isinstance(res, SlurmLaunched):
        return _slurm_started(c, res, inventory, follow, accept_new_host_keys)
    if dry_run:
        red = _redactor(fleet.inv)
        for hname, files in res.changes.items():  # diffs against the node's files
            for path, ch in files:
                _say((f"--- {hname}:{path}\n"
                      + (red.text(ch.diff()) if ch else "(unchanged)")).rstrip("\n"))
        print("dry run: nothing changed")
        return
    j = res.job
    sel = ",".join(n.host for n in j.nodes)
    inv_flag = f" -i {inventory}" if inventory else ""
    print(f"job {j.name} started on {sel} ({j.nnodes} node(s) x {j.nodes[0].nproc} process(es)) "
          f"in {res.seconds:.1f}s")
    print(f"  follow:  torchrig logs{inv_flag} --host {sel} --job {j.name} -f")
    print(f"  status:  torchrig status{inv_flag} --host {sel} --job {j.name}")
    print(f"  stop:    torchrig stop{inv_flag} --host {sel} --job {j.name}")
    if follow:  # from here on, a Ctrl-C leaves the started job running: say so
        with _job_keeps_running(fleet, j.name):
            logs(c, inventory=inventory, host=sel, job=j.name, follow=True,
                 accept_new_host_keys=accept_new_host_keys)


def _slurm_started(c, res, inventory, follow, accept_new_host_keys):
    """A Slurm job's launch, rendered: started (or still queued), and how to follow it."""
    j, sj = res.job, res.slurm
    sel = ",".join(sj.nodes) or ",".join(n.host for n in j.nodes)
    inv_flag = f" -i {inventory}" if inventory else ""
    if res.started:
        _say(f"job {j.name} started as slurm job {sj.job_id} on {sel} "
             f"({len(sj.nodes)} node(s) x {j.nodes[0].nproc} process(es)) in {res.seconds:.1f}s")
    else:
        st = sj.state
        _say(f"job {j.name} queued as slurm job {sj.job_id} "
             f"({st.state if st else '?'}: {st.reason if st else '?'})")
    if j.min_nodes is not None:
        print(f"  elastic ({j.min_nodes}:{j.nnodes} nodes): Slurm keeps the job when a node is "
              f"lost (--no-kill); it goes on with the others while {j.min_nodes} or more remain. "
              "Slurm adds no node to a running job: a node that comes back does not rejoin")
    print(f"  follow:  torchrig logs{inv_flag} --job {j.name} -f")
    print(f"  status:  torchrig status{inv_flag} --job {j.name}")
    print(f"  stop:    torchrig stop{inv_flag} --job {j.name}")
    if follow and res.started:
        logs(c, inventory=inventory, job=j.name, follow=True,
             accept_new_host_keys=accept_new_host_keys)


@fleet_task(help={"job": "job name (default: the newest job on the first host)"})
def stop(c, inventory=None, host=None, job=None, accept_new_host_keys=False):
    """Stop a job on every node: all ranks gone within TimeoutStopSec; logs and checkpoints stay."""
    from torchrig.launch import service
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        job = job or _latest_job(fleet)
        stopped = service.stop(fleet, job)
    if stopped.slurm is not None:
        sj = stopped.slurm
        _say(f"job {job} (slurm job {sj.job_id}) {sj.as_dict()['state']} on "
             f"{','.join(sj.nodes) or 'no node'}: no process of it left; "
             "logs and checkpoints are kept")
        return
    res = stopped.nodes
    for r in res:
        _say(f"{r.host}: " + ("not there" if r.ok and r.value is None else
                              "stopped" if r.ok else "FAILED: " + r.error))
    if not res.ok:
        raise Exit(res.error_line(), code=1)
    had = sum(1 for r in res if r.value is not None)
    print(f"job {job} stopped on {had} node(s); logs and checkpoints are kept")

