"""torchrig: turn SSH-reachable bare-metal GPU servers into a PyTorch DDP fleet.

Thin Invoke layer: parse flags, load the inventory, call the library, print. Heavy modules
are imported inside tasks so `torchrig --list` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys

import invoke
from invoke import Collection, Exit

from torchrig.job import DEFAULTS  # launch's defaults, quoted in its help (a light module)

# The inventory a task reads, first that applies: -i/--inventory, $TORCHRIG_INVENTORY, the config
# files' torchrig.inventory (torchrig.yaml for the torchrig command, invoke.yaml in a checkout),
# ./inventory/hosts.yml (inventory.DEFAULT_INVENTORY). See _inventory_path().
INVENTORY_ENV = "TORCHRIG_INVENTORY"
INVENTORY_HELP = ("inventory YAML file (default: $TORCHRIG_INVENTORY, else torchrig.inventory "
                  "from the config file, else inventory/hosts.yml)")
HOST_HELP = "host names or group names, comma-separated (default: every host)"
ACCEPT_HELP = ("record unknown host keys in the known_hosts file in use (like OpenSSH's "
               "accept-new); changed keys are always refused")
# the prologue every task on the fleet shares: see fleet_task() and _fleet()
FLEET_HELP = {"inventory": INVENTORY_HELP, "host": HOST_HELP, "accept_new_host_keys": ACCEPT_HELP}

# The one short-flag set: a letter means the same flag in every task that has the flag, and
# every other flag is long only. `-h` stays Invoke's help (`torchrig provision -h`), so the
# host gets -H; --json has no letter (-j is --job). Invoke's automatic letters (the first free
# letter of each name, in signature order) gave --json -j, -s or -o depending on the task.
SHORT_FLAGS = {"inventory": "i", "host": "H", "job": "j", "follow": "f", "dry_run": "n",
               "yes": "y"}


class _Task(invoke.Task):
    """A task whose short flags are SHORT_FLAGS, nothing else."""

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names)
        short = SHORT_FLAGS.get(name.rstrip("_"))
        if short:
            opts["names"].append(short)
        return opts


def task(**kwargs):
    """Invoke's @task (always called with keywords here) with torchrig's short flags."""
    return invoke.task(klass=_Task, auto_shortflags=False, **kwargs)


def user_errors(fn):
    """Turn a TorchrigError into its message and exit status 1, never a traceback. Anything
    else is a torchrig bug: one line too, with the traceback under `torchrig --debug`. Every
    error line, a task's own included, goes through the redactor (URL credentials) and the
    terminal sanitiser (it may quote a node's or a job's text)."""
    @functools.wraps(fn)
    def wrapper(c, *args, **kwargs):
        import logging
        from torchrig.errors import TorchrigError
        from torchrig.secrets import redact_text
        from torchrig.terminal import printable

        def line(text: str) -> str:
            return printable(redact_text(text), newlines=True)
        try:
            return fn(c, *args, **kwargs)
        except TorchrigError as e:
            raise Exit(line(f"error: {e}"), code=1) from None
        except KeyboardInterrupt:  # 128 + SIGINT, as a shell reports it; not a failure
            raise Exit("interrupted", code=130) from None
        except Exit as e:
            if isinstance(e.message, str):
                raise Exit(line(e.message), code=e.code) from None
            raise
        except Exception as e:  # noqa: BLE001
            if logging.getLogger().isEnabledFor(logging.DEBUG):  # torchrig --debug
                raise
            raise Exit(line(f"error: {fn.__name__.rstrip('_')}: unexpected "
                            f"{type(e).__name__}: {e} (a torchrig bug; `torchrig --debug "
                            "...` shows the traceback)"), code=1) from None
    return wrapper


def _number(flag: str, value, minimum: float = 0, kind=int):
    """A numeric flag's (or config setting's, 'torchrig.x') value, or one `error:` line naming
    it. Numeric flags are declared with default None so they arrive as text: Invoke's own
    int() of a bad value is a traceback."""
    import math
    try:
        v = kind(value)
        ok = math.isfinite(v) and v >= minimum
    except (TypeError, ValueError):
        ok = False
    if not ok:
        what = "a whole number" if kind is int else "a number"
        name = flag if "." in flag else "--" + flag.replace("_", "-")
        raise Exit(f"error: {name} {value!r}: expected {what} >= {minimum:g}", code=1)
    return v


def _parallel(c) -> int:
    return _number("torchrig.parallel", c.config.torchrig.parallel, 1)


def _warm(module: str) -> None:
    """Import `module` on a thread while the task waits on SSH: its import is CPU time that
    would otherwise come after the network wait (a later import of it just waits for this)."""
    import importlib
    import threading
    threading.Thread(target=importlib.import_module, args=(module,), daemon=True).start()


def _inventory_path(c, flag: str | None) -> str:
    """Which inventory file a task reads (the order is INVENTORY_HELP's)."""
    from torchrig.inventory import DEFAULT_INVENTORY
    return flag or os.environ.get(INVENTORY_ENV) or c.config.torchrig.inventory or DEFAULT_INVENTORY


def _inventory(c, path: str | None):
    from torchrig import inventory
    return inventory.load(_inventory_path(c, path))


def fleet_task(help: dict | None = None, **kwargs):
    """A task on the selected hosts: @task with the shared flags' help (FLEET_HELP) and
    user_errors. Its body declares inventory=None, host=None, accept_new_host_keys=False and
    opens its one session with _fleet()."""
    def deco(fn):
        return task(help={**FLEET_HELP, **(help or {})}, **kwargs)(user_errors(fn))
    return deco


def _fleet(c, inventory, host, accept_new_host_keys=False, parallel=None):
    """The task's one fleet session: the inventory, the selection, the host-key choice (made
    here and nowhere else) and the parallelism; one connection per host for the whole task."""
    from torchrig.session import Fleet
    par = _parallel(c) if parallel is None else _number("parallel", parallel, 1)
    inv = _inventory(c, inventory)
    return Fleet(inv, inv.select(host), accept_new=accept_new_host_keys, parallel=par)


def _say(text, file=None, flush: bool = False) -> None:
    """print() for every line that holds a node's or a job's text: through the one terminal
    sanitiser (torchrig/terminal.py)."""
    from torchrig.terminal import say
    say(text, file, flush=flush)


def _log(text) -> None:
    """The library's progress notes (they quote nodes: names, errors), on stderr."""
    _say(text, sys.stderr)


@contextlib.contextmanager
def _job_keeps_running(fleet, job: str):
    """Ctrl-C in a task that follows a job (logs -f, status --watch, launch --follow) ends the
    task, not the job: exit 130 (128 + SIGINT) saying so, and how to stop the job."""
    import shlex
    try:
        yield
    except KeyboardInterrupt:
        hosts = ",".join(h.name for h in fleet.hosts)
        raise Exit(f"interrupted: job {job} keeps running on {hosts}; stop it with: torchrig stop "
                   f"--inventory {shlex.quote(fleet.inv.path)} --host {hosts} --job {job}",
                   code=130) from None


def _redactor(inv):
    """The one redactor for everything a task prints: every host's secrets, by form and value."""
    from torchrig.secrets import Redactor
    return Redactor.for_hosts(inv.hosts)


@task(help={"inventory": INVENTORY_HELP, "host": HOST_HELP, "json": "print the hosts as JSON"})
@user_errors
def hosts(c, inventory=None, host=None, json_=False):
    """Show the selected inventory hosts with their resolved connection settings and vars."""
    from torchrig.tables import hosts_table
    inv = _inventory(c, inventory)
    chosen = inv.select(host)
    red = _redactor(inv)
    if json_:
        print(json.dumps([red.data(h.model_dump()) for h in chosen], indent=2))
    else:
        hosts_table(inv, chosen, red)


@task(help={"inventory": "where to write it (default: where tasks read the inventory, "
                         "see --inventory of any task)"})
@user_errors
def init(c, inventory=None):
    """Start an inventory: write the commented example (every field explained) to edit."""
    from pathlib import Path
    from torchrig.resources import EXAMPLE_INVENTORY
    path = Path(_inventory_path(c, inventory))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "x", encoding="utf-8") as f:  # "x": an existing inventory is never replaced
            f.write(EXAMPLE_INVENTORY.read_text(encoding="utf-8"))
    except FileExistsError:
        raise Exit(f"error: {path} exists: edit it, or pass --inventory NEW_PATH", code=1) from None
    except OSError as e:
        raise Exit(f"error: {path}: cannot write it ({e.strerror})", code=1) from None
    print(f"wrote {path}: set your hosts' addresses, users and GPUs in it, then check with: "
          "torchrig hosts; next: torchrig provision --dry-run")


@fleet_task(name="exec",
            help={"command": "the shell command line to run on every selected host",
                  "sudo": "run the command as root (root login, or passwordless sudo)",
                  "timeout": "seconds before the command is stopped on a host (default: none)",
                  "parallel": "at most this many hosts at once (default: torchrig.parallel)"})
def exec_(c, command, inventory=None, host=None, sudo=False, timeout=None, parallel=None,
          accept_new_host_keys=False):
    """Run an ad-hoc command on the selected hosts in parallel, output prefixed by host."""
    if command in ("-h", "--help"):  # Invoke hands it to the positional `command`, not help
        raise Exit(f"error: exec: {command} would run as the command on every host; for exec's "
                   "help: torchrig --help exec", code=2)
    timeout = None if timeout is None else _number("timeout", timeout, 1)
    from torchrig.execute import run_on
    from torchrig.tables import exec_summary
    with _fleet(c, inventory, host, accept_new_host_keys, parallel) as fleet:
        res = run_on(fleet, fleet.hosts, command, sudo=sudo, timeout=timeout)
    exec_summary(res)
    if not res.ok:
        raise Exit(f"error: failed on {len(res.failures)} of {len(res)} host(s): "
                   + "; ".join(res.failures), code=1)


@fleet_task(help={"dry_run": "print the per-host plan (files as diffs) and change nothing",
                  "yes": "apply without asking (needed when there is no terminal to ask on)",
                  "reboot": "reboot hosts whose new driver needs it, wait for SSH, and continue",
                  "json": "print the results as JSON",
                  "save_plan": "with --dry-run: save the plan to this file (0600, no secrets) "
                               "to review and apply later with --plan",
                  "plan": "apply exactly the plan saved in this file (its hosts by default); "
                          "a host that changed since, or whose plan now differs, is refused"})
def provision(c, inventory=None, host=None, dry_run=False, yes=False, reboot=False, json_=False,
              save_plan=None, plan=None, accept_new_host_keys=False):
    """Install the NVIDIA driver, CUDA, NCCL, a torch venv and nccl-tests (and Slurm with the
    inventory's slurm: section); plan first, idempotent."""
    saved = None
    if plan and save_plan:
        raise Exit("error: --plan applies a saved plan and --save-plan makes one: pass only "
                   "one of them", code=1)
    if save_plan and not dry_run:
        raise Exit("error: --save-plan saves a plan without applying it: add --dry-run", code=1)
    if plan:
        from torchrig.provision.planfile import read
        saved = read(plan)
        host = host or ",".join(saved.hosts)  # the hosts the saved plan covers
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        _provision(fleet, dry_run, yes, reboot, json_, save_plan, saved)


def _provision(fleet, dry_run, yes, reboot, json_, save_plan=None, saved=None):
    """Render the provision service's plan, ask, apply, render its result."""
    from torchrig.provision import live, service
    red = _redactor(fleet.inv)
    _warm("torchrig.tables")
    fp = service.plan(fleet, red, saved)
    from torchrig import tables
    if save_plan:
        n = service.save(fp, save_plan)
        print(f"plan for {n} host(s) saved to {save_plan}; apply exactly it with: "
              f"torchrig provision --plan {save_plan}", file=sys.stderr)
    # a saved plan was reviewed when it was made: --plan applies it without asking again
    if dry_run or (fp.todo and not yes and saved is None):
        if json_ and dry_run:
            print(json.dumps(fp.as_dict(), indent=2))
        else:
            tables.provision_plan(fp.reports())
        if dry_run:
            _exit_if_failed(fp.failed, "provision (dry run)")
            return
        if not sys.stdin.isatty():
            raise Exit("error: provision would change the hosts above; rerun with --yes to "
                       "apply, or --dry-run to only look", code=1)
        if input(f"apply to {len(fp.todo)} host(s)? [y/N] ").strip().lower() not in ("y", "yes"):
            raise Exit("nothing changed", code=1)
    if saved is not None:  # exactly the saved plan or nothing: no host is applied alone
        _exit_if_failed(fp.failed, f"provision --plan {saved.path} (nothing applied on any host)")
    with live.for_stream(sys.stderr, red.text) as progress:
        res = service.apply(fleet, fp, reboot, progress)
    if json_:
        print(json.dumps(res.as_dict(), indent=2))
    else:
        tables.provision_table(res.reports)
        _scrape_targets([h for h in fleet.hosts if any(r.ok and r.host == h.name for r in res.reports)])
    _exit_if_failed(res.failed, "provision")


def _scrape_targets(hosts) -> None:
    from torchrig.metrics import scrape_targets
    targets = scrape_targets(hosts)
    if targets:
        print("Prometheus scrape targets (node_exporter; see examples/monitoring/): "
              + " ".join(t for _, t in targets))


@fleet_task(help={"bandwidth": "also measure all-reduce busbw (torchrun in each node and across "
                               "nodes; nccl-tests where built) against the expected minimum",
                  "json": "print the report as JSON"})
def verify(c, inventory=None, host=None, bandwidth=False, json_=False, accept_new_host_keys=False):
    """GPUs, topology, driver health, one version gate across nodes, network; PASS or FAIL."""
    from torchrig.verify.run import verify as run_verify
    _warm("torchrig.tables")
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        rep = run_verify(fleet, fleet.hosts, bandwidth=bandwidth)
    if bandwidth:  # the sweeps, for `torchrig report` (the nodes keep nothing of them)
        from torchrig.verify import store
        store.save(rep.bandwidth, {h.name: h.address for h in fleet.hosts})
    rep.redact(red := _redactor(fleet.inv))
    from torchrig import tables
    if json_:
        print(json.dumps(red.data(rep.as_dict()), indent=2, default=str))
    else:
        tables.verify_report(rep)
    if not rep.ok:
        raise Exit("error: verify " + rep.status + ": " + "; ".join(rep.failures), code=1)


def _nodes(chosen, nodes):
    if nodes is not None:
        n = _number("nodes", nodes, 1)
        if n > len(chosen):
            raise Exit(f"error: --nodes {nodes}: only {len(chosen)} host(s) selected "
                       f"({', '.join(h.name for h in chosen)})", code=1)
        chosen = chosen[:n]
    return chosen


def _latest_job(fleet) -> str:
    from torchrig.launch.status import latest_job
    return latest_job(fleet)


@fleet_task(iterable=["env"],
      help={"nodes": "use the first N selected hosts (the first one hosts the rendezvous)",
            "nproc_per_node": "processes per node: a number, or 'gpu' = one per GPU "
                              "(2 on hosts with var accelerator: cpu)",
            "script": f"the training script, a path inside payload/ (default {DEFAULTS.script})",
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
            "backend": "systemd (torchrig's units) or slurm (sbatch on the inventory's `slurm:` "
                       "cluster; Slurm picks --nodes N of the selected compute hosts); "
                       "default: the `backend` var",
            "partition": "slurm: the partition (default: the cluster's default one)",
            "time": "slurm: the job's time limit (e.g. 2:00:00); the payload gets SIGTERM "
                    "2 minutes before it, to checkpoint"})
def launch(c, inventory=None, host=None, nodes=None, nproc_per_node=DEFAULTS.nproc,
           script=DEFAULTS.script,
           args="", job=None, max_restarts=None, env=None, dry_run=False, follow=False,
           start_timeout=None, rdzv_timeout=None, exit_barrier_timeout=None,
           backend=None, partition=None, time=None, accept_new_host_keys=False):
    """Run a torchrun DDP job under systemd (or Slurm) on the nodes: everywhere or nowhere."""
    from torchrig.job import default_job_name
    from torchrig.launch.run import LaunchOptions, launch as run_launch
    numbers = {k: _number(k, getattr(DEFAULTS, k) if v is None else v, m) for k, v, m in (
        ("max_restarts", max_restarts, 0), ("start_timeout", start_timeout, 1),
        ("rdzv_timeout", rdzv_timeout, 1), ("exit_barrier_timeout", exit_barrier_timeout, 1))}
    if nodes is not None:
        _number("nodes", nodes, 1)
    o = LaunchOptions(job=job or default_job_name(), script=script, args=args,
                      env=list(env or []), nproc=str(nproc_per_node), dry_run=dry_run,
                      max_restarts=numbers["max_restarts"],
                      start_timeout=numbers["start_timeout"], rdzv_timeout=numbers["rdzv_timeout"],
                      exit_barrier_timeout=numbers["exit_barrier_timeout"])
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        chosen = backend or (fleet.hosts[0].settings.backend if fleet.hosts else "systemd")
        if chosen not in ("systemd", "slurm"):
            raise Exit(f"error: --backend {backend!r}: systemd or slurm", code=1)
        if chosen == "slurm":
            return _launch_slurm(c, fleet, o, nodes, partition, time, inventory, follow,
                                 accept_new_host_keys)
        if partition is not None or time is not None:
            raise Exit("error: --partition and --time are Slurm's: add --backend slurm", code=1)
        fleet.hosts = _nodes(fleet.hosts, nodes)
        res = run_launch(fleet, fleet.hosts, o, log=_log)
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


def _launch_slurm(c, fleet, o, nodes, partition, time_limit, inventory, follow,
                  accept_new_host_keys):
    from torchrig.errors import TorchrigError
    from torchrig.launch import slurm
    if o.dry_run:
        raise TorchrigError("--dry-run with --backend slurm: not supported (nothing is written "
                            "on the nodes but the job's folders; the batch script goes to sbatch)")
    res = slurm.launch(fleet, fleet.hosts, o, None if nodes is None else int(nodes), partition,
                       time_limit, log=_log)
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
    print(f"  follow:  torchrig logs{inv_flag} --job {j.name} -f")
    print(f"  status:  torchrig status{inv_flag} --job {j.name}")
    print(f"  stop:    torchrig stop{inv_flag} --job {j.name}")
    if follow and res.started:
        logs(c, inventory=inventory, job=j.name, follow=True,
             accept_new_host_keys=accept_new_host_keys)


@fleet_task(help={"job": "job name (default: the newest job on the first host)",
                  "json": "print the status as JSON",
                  "watch": "refresh every N seconds until interrupted (0: once), with a "
                           "sparkline of tokens/s and GPU use per node over the samples"})
def status(c, inventory=None, host=None, job=None, json_=False, watch=None,
           accept_new_host_keys=False):
    """Per node: unit state, restarts, attempt, uptime (or when an ended job ended and how long
    it ran), latest progress, GPU use; idle GPUs flagged; --watch adds a trend per node."""
    watch = 0 if watch is None else _number("watch", watch, 0, float)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        job = job or _latest_job(fleet)
        with _job_keeps_running(fleet, job):
            _status(fleet, job, json_, watch)


def _status(fleet, job, json_, watch):
    import time as _time
    from torchrig import tables
    from torchrig.launch.status import look
    from torchrig.trend import Trend
    red = _redactor(fleet.inv)  # the inventory's secrets do not change between --watch rounds
    trend = Trend() if watch else None  # the watch's samples: a sparkline per node
    journals = {} if watch else None  # each round reads the journal after the last one's cursor
    while True:
        rnd = look(fleet, job, journals)
        sj, diag, res = rnd.slurm, red.data(rnd.diagnosis), red.data(rnd.nodes)
        if trend is not None:
            for r in res:
                if r.ok:
                    trend.add(r.host, _time.monotonic(), r.value.get("progress"), r.value["gpus"])
        if json_:
            print(json.dumps({"job": job, "nodes": res.as_dict(), **diag,
                              **({"slurm": sj.as_dict()} if sj else {}),
                              **({"trend": trend.as_dict()} if trend is not None else {})}, indent=2),
                  flush=True)  # each --watch round as it comes, also through a pipe
        else:
            if sj is not None:
                d = sj.as_dict()
                _say(f"slurm job {d['job_id']}: {d['state']} on {','.join(d['nodes'])}"
                     + (f" ({d['reason']})" if d["reason"] not in ("", "None") else ""))
            tables.status_table(job, res, trend)
            for r in res:
                if r.ok and r.value.get("journal_cut"):
                    print(f"warning: {r.host}: {r.value['journal_cut']}")
            for h, what in diag["waiting"].items():
                _say(f"{h}: {what}")
            for h in diag.get("lost_nodes", []):
                _say(f"{h}: lost (unreachable; Slurm: {sj.as_dict()['state']})")
            if diag["failure"]:
                f = diag["failure"]
                _say(f"first failure: rank {f['rank']} on {f['host']} (local rank "
                     f"{f['local_rank']}, pid {f['pid']}) {f['cause']}"
                     + (f": {f['error']}" if f["error"] else "")
                     + f" (its last lines: torchrig logs --failures --job {job})")
        if not watch:
            break
        _time.sleep(watch)
    if not res.ok:
        raise Exit(f"error: job {job}: " + "; ".join(res.failures), code=1)


@fleet_task(help={"job": "job name (default: the newest job on the first host)",
                  "port": "local port to open it on (default 6006; 0: any free port)"})
def tensorboard(c, inventory=None, host=None, job=None, port=None, accept_new_host_keys=False):
    """TensorBoard for a job: started on its rank-0 node (the first selected host) as the job's
    user, bound to 127.0.0.1 there, forwarded to 127.0.0.1:PORT here over the SSH connection;
    Ctrl-C stops both."""
    from torchrig.launch.tensorboard import serve
    port = _number("port", 6006 if port is None else port, 0)
    if port > 65535:
        raise Exit(f"error: --port {port}: expected a port number up to 65535", code=1)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        job = job or _latest_job(fleet)
        node = fleet.hosts[0]

        def ready(b):
            _say(f"TensorBoard for job {job} on {b.host} (as {b.user}, 127.0.0.1:{b.remote_port} "
                 f"there): {b.url}", flush=True)
            print("Ctrl-C stops it", flush=True)
        board = serve(fleet, node, job, port, ready)
    _say(f"{board.host}: TensorBoard {board.stopped}", flush=True)
    if board.ended_by_itself:
        raise Exit(f"error: TensorBoard for job {job} ended on {board.host} by itself "
                   f"(see: torchrig exec --host {board.host} --sudo 'journalctl -u {board.unit}')", code=1)


@fleet_task(name="report",
            help={"job": "job name (default: the newest job on the first host)",
                  "out": "folder to write <job>-report.html in (default: the current folder)"})
def job_report(c, inventory=None, host=None, job=None, out=".", accept_new_host_keys=False):
    """A job's self-contained HTML report: loss, tokens/s, GPU use, restarts, failures, busbw.
    Needs the 'report' extra (plotly)."""
    from torchrig import jobreport
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        job = job or _latest_job(fleet)
        path, rep = jobreport.make(fleet, job, out, _redactor(fleet.inv))
    for h, why in rep.missing.items():
        _say(f"{h}: left out ({why})", sys.stderr)
    for h, what in rep.cut.items():  # the probe's caps on a job's output
        _say(f"warning: {h}: {what}", sys.stderr)
    s = rep.summary()
    _say(f"report of job {job} ({len(rep.nodes)} node(s), {len(rep.steps)} progress line(s), "
         f"{s['restarts']} restart(s), {s['failures']} failure(s)): {path}")
    if rep.unreadable:  # the page is written without them; the run did not do all it was asked
        raise Exit("error: report: could not read " + "; ".join(
            f"{h}: {why}" for h, why in rep.unreadable.items()), code=1)


@fleet_task(help={"job": "job name (default: the newest job on the first host)"})
def stop(c, inventory=None, host=None, job=None, accept_new_host_keys=False):
    """Stop a job on every node: all ranks gone within TimeoutStopSec; logs and checkpoints stay."""
    from torchrig.launch.run import stop as run_stop
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        job = job or _latest_job(fleet)
        if getattr(fleet.inv, "slurm", None) is not None:
            from torchrig.launch import slurm
            if slurm.find(fleet, job) is not None:
                sj = slurm.stop(fleet, job)
                _say(f"job {job} (slurm job {sj.job_id}) {sj.as_dict()['state']} on "
                     f"{','.join(sj.nodes) or 'no node'}: no process of it left; "
                     "logs and checkpoints are kept")
                return
        res = run_stop(fleet, fleet.hosts, job)
    for r in res:
        _say(f"{r.host}: " + ("not there" if r.ok and r.value is None else
                              "stopped" if r.ok else "FAILED: " + r.error))
    if not res.ok:
        raise Exit(res.error_line(), code=1)
    had = sum(1 for r in res if r.value is not None)
    print(f"job {job} stopped on {had} node(s); logs and checkpoints are kept")


@fleet_task(help={"job": "only this job's series (default: every job's)",
                  "json": "print the series per node as JSON"})
def metrics(c, inventory=None, host=None, job=None, json_=False, accept_new_host_keys=False):
    """Every node's torchrig_* Prometheus series (GPU and job), fetched from its node_exporter
    on the node over SSH: no port needs to be open to this machine."""
    from torchrig import tables
    from torchrig.job import check_job_name
    from torchrig.metrics import collect
    if job is not None:
        check_job_name(job)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        res = _redactor(fleet.inv).data(collect(fleet, fleet.hosts, job))
    if json_:
        print(json.dumps({"job": job, "nodes": {r.host: ([v.as_dict() for v in r.value] if r.ok
                                                          else {"error": r.error}) for r in res}},
                         indent=2))
    else:
        tables.metrics_table(f"metrics of job {job}" if job else "metrics", res)
    if not res.ok:
        raise Exit(res.error_line(), code=1)


@fleet_task(help={
            "job": "job name (default: the newest job on the first host)",
            "follow": "keep streaming until the job ends (across torchrun restarts and SSH drops)",
            "rank": "only this global rank's lines",
            "since": "only files written since: seconds ago (e.g. 600), or a unix time",
            "grep": "only lines matching this regular expression",
            "failures": "show the first failed rank, why (signal, OOM kill, exit code, error.json) "
                        "and its last lines",
            "color": "colour the prefixes per rank: always, never or auto (also yes/no, "
                     "true/false, 1/0); auto, the default: when stdout is a terminal and "
                     "NO_COLOR is not set"})
def logs(c, inventory=None, host=None, job=None, follow=False, rank=None, since=None, grep=None,
         failures=False, color=None, accept_new_host_keys=False):
    """Every rank's stdout and stderr from every node, merged and prefixed [node/rank]."""
    import re as _re
    import time as _time
    from torchrig.errors import TorchrigError
    rank = None if rank is None else _number("rank", rank, 0)
    if grep:
        try:
            _re.compile(grep)
        except _re.error as e:
            raise TorchrigError(f"--grep {grep!r}: not a regular expression ({e})")
    when = None
    if since:
        v = _number("since", since, 0, float)  # seconds ago, or a unix time
        when = v if v > 1e9 else _time.time() - v
    color = _color(color)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        job = job or _latest_job(fleet)
        with _job_keeps_running(fleet, job) if follow else contextlib.nullcontext():
            _logs(fleet, job, follow, rank, grep, when, failures, color)


def _color(value) -> bool:
    """--color's value as a yes or no; auto colours a terminal unless NO_COLOR is set to
    anything but "" (no-color.org): a flag given says what the user wants, NO_COLOR does not
    override it."""
    import os
    v = "auto" if value is None else str(value).strip().lower()
    if v in ("always", "yes", "true", "1", "on"):
        return True
    if v in ("never", "no", "false", "0", "off"):
        return False
    if v == "auto":
        return sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    raise Exit(f"error: --color {value!r}: expected always, never or auto (or yes/no, "
               "true/false, 1/0)", code=1)


def _logs(fleet, job, follow, rank, grep, when, failures, color):
    from torchrig.job import check_job_name, unit_name
    from torchrig.launch.status import journal_ident, lost_nodes, slurm_record
    from torchrig.logs.stream import FollowOptions, failure_report, follow as run_follow
    job = check_job_name(job or _latest_job(fleet))
    sj = slurm_record(fleet, job)
    inv, chosen = fleet.inv, fleet.hosts
    o = FollowOptions(job, {h.name: h.settings.job_log_dir(job) for h in chosen},
                unit_name(job), follow=follow and not failures,
                rank=rank, grep=grep, since=when,
                color=color,
                slurm_job=sj.job_id if sj else None)
    red = _redactor(inv)
    if failures:
        from torchrig.logs import diagnose
        res = run_follow(fleet, chosen, o, printer=_NullPrinter())
        # torchrun's agent saw every exit (a signal leaves no error.json); error.json alone
        # when no journal could be read
        journals = diagnose.fetch(fleet, chosen, unit_name(job), ident=journal_ident(job, sj))
        found = diagnose.failures(journals, unit_name(job), res.errors)
        text = diagnose.report(found) or failure_report(res.errors)
        lost = lost_nodes(fleet, journals, sj)
        if lost:  # a powered-off node leaves no agent line: say which it was
            text = (f"slurm job {sj.job_id} {sj.as_dict()['state']}: node(s) "
                    f"{', '.join(lost)} lost (unreachable)" + ("\n" + text if text else ""))
        _say(red.text(text) if text else f"job {job}: no failed rank (no error.json, no failed "
                                          "worker in torchrun's log)")
    else:
        res = run_follow(fleet, chosen, o, printer=_redacting_printer(red, o.color))
    if res.lost:
        raise Exit("error: lost " + "; ".join(f"{h}: {w}" for h, w in res.lost.items()), code=1)


def _redacting_printer(red, color: bool):
    """The ranks' lines as logs prints them, through the redactor: a job that prints a secret
    the inventory holds (or a URL with credentials) shows *** on the operator's terminal."""
    from torchrig.logs.stream import Printer

    class Redacting(Printer):
        def line(self, item):
            super().line(red.data(item))

        def notice(self, text):
            super().notice(red.text(text))

    return Redacting(sys.stdout, color)


class _NullPrinter:
    def line(self, item):
        pass

    def notice(self, text):
        pass


@fleet_task(name="fetch", help={
            "job": "job name (default: the newest job on the first host)",
            "step": "this step's checkpoint (default: the newest one that loads)",
            "to": "folder to write into (default: checkpoints/JOB)",
            "all": "the job's whole checkpoint folder",
            "bwlimit": "at most this many KiB/s (default: no limit)",
            "json": "print what was fetched as JSON"})
def fetch(c, inventory=None, host=None, job=None, step=None, to=None, all_=False, bwlimit=None,
          json_=False, accept_new_host_keys=False):
    """Copy a job's newest loadable checkpoint (or --step N, or --all) from the node that holds
    it: load-checked on the node, resumed after drops, SHA-256 verified, MANIFEST.json beside it."""
    from pathlib import Path
    from torchrig.fetch.run import FetchOptions, fetch as run_fetch
    if step is not None and all_:
        raise Exit("error: --step and --all: choose one", code=1)
    o = FetchOptions(job="", to=Path(), step=None if step is None else _number("step", step, 0),
                     all=all_,
                     bwlimit=0 if bwlimit is None else _number("bwlimit", bwlimit, 1) * 1024)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        o.job = job or _latest_job(fleet)
        o.to = Path(to or f"checkpoints/{o.job}")
        res = run_fetch(fleet, o, log=_log)
    if json_:
        print(json.dumps(res.as_dict(), indent=2))
        return
    for f in res.files:
        how = ("already there, unchanged: nothing transferred" if f.already else
               f"{f.transferred} bytes transferred" +
               (f", resumed at byte {', '.join(map(str, f.resumed_at))}" if f.resumed_at else ""))
        _say(f"{res.host}:{res.node_dir}/{f.name} -> {res.to}/{f.name} ({f.size} bytes, "
             f"sha256 {f.sha256[:16]}...; {how})")
    _say(f"job {res.job}: {len(res.files)} file(s) in {res.to} (see {res.to}/MANIFEST.json)")


def _exit_if_failed(reports, what: str) -> None:
    if reports:
        raise Exit(f"error: {what} failed on " + "; ".join(f"{r.host}: {r.error}" for r in reports),
                   code=1)


@task(name="up", help={"hosts": "number of simulated servers, named gpu1..gpuN (default 2)",
            "profile": "GPU profile for all hosts, and/or per host: "
                       "'h100-nvswitch-8' or 'v100s-nvlink-2,gpu2=pcie-sys-4'",
            "inventory": "where to write the testbed's inventory (default inventory/testbed.yml)"})
@user_errors
def testbed_up(c, hosts=None, profile=None, inventory="inventory/testbed.yml"):
    """Start a local TESTBED of simulated GPU servers (root; systemd-nspawn containers)."""
    from torchrig.testbed import lab
    n = _number("hosts", 2 if hosts is None else hosts, 1)
    st = lab.up(n, profile, inventory, log=_log)
    for name, h in st["hosts"].items():
        print(f"{name}  {h['ip']}  profile={h['profile']}")
    print(f"testbed up in {st['seconds']}s; inventory: {inventory} "
          f"(e.g. torchrig exec --inventory {inventory} \"nvidia-smi -L || true\"); "
          "take it down with: torchrig testbed.down")


@task(name="down")
@user_errors
def testbed_down(c):
    """Stop the testbed: hosts halted, mounts, interfaces and its server removed."""
    from torchrig.testbed import lab
    names = lab.down()
    left = lab.leftovers()
    if left:
        raise Exit("error: testbed.down left behind: " + "; ".join(left), code=1)
    print(f"testbed down ({len(names)} host(s) removed; base image cache kept)")


@task(name="status", help={"json": "print the status as JSON"})
@user_errors
def testbed_status(c, json_=False):
    """Show the testbed's hosts: running, addressable, SSH answering."""
    from torchrig.testbed import lab
    from torchrig.tables import testbed_table
    st = lab.status()
    if json_:
        print(json.dumps(st, indent=2))
    else:
        testbed_table(st)


@task(help={"steps": "training steps for the demo job (default 60)"})
@user_errors
def demo(c, steps=None):
    """The whole path on a local testbed: 2 hosts up, provision, verify, a 2-node x 2-process
    DDP job (gloo on CPU) followed to the end, and a summary. Leaves the testbed up."""
    import time as _time
    steps = _number("steps", 60 if steps is None else steps, 1)
    t0 = _time.monotonic()
    inv_path = "inventory/testbed.yml"

    def stage(msg):
        print(f"\n=== {msg} ({_time.monotonic() - t0:.0f}s) ===", flush=True)

    stage("testbed: 2 simulated GPU servers (systemd-nspawn)")
    testbed_up(c, hosts=2)
    stage("provision: driver, CUDA, NCCL (testbed stand-ins), venv with torch")
    provision(c, inventory=inv_path, yes=True, reboot=True)
    stage("verify: GPUs, topology, versions, network, all-reduce bandwidth")
    verify(c, inventory=inv_path, bandwidth=True)
    stage("launch: 2 nodes x 2 processes, c10d rendezvous, gloo")
    job = _time.strftime("demo-%Y%m%d-%H%M%S")
    launch(c, inventory=inv_path, nodes=2, job=job, nproc_per_node="2",
           args=f"--max-steps {steps} --log-every 10 --ckpt-every 20")
    stage("logs: every rank, followed until the job ends")
    from torchrig import inventory as _inv
    from torchrig.job import unit_name
    from torchrig.logs.stream import FollowOptions, Printer, follow as run_follow
    inv = _inv.load(inv_path)
    hosts = inv.select(None)[:2]
    seen = []

    class Tee(Printer):
        def line(self, item):
            super().line(item)
            if item.global_rank == 0:
                seen.append(item.text)

    log_dirs = {h.name: h.settings.job_log_dir(job) for h in hosts}
    from torchrig.session import Fleet
    with Fleet(inv, hosts) as fleet:
        run_follow(fleet, hosts, FollowOptions(job, log_dirs, unit_name(job), follow=True),
                   printer=Tee(sys.stdout, _color(None)))
    from torchrig.progress import run_summary
    s = run_summary(seen)
    stage("summary")
    if s is None:
        raise Exit(f"error: demo job {job} did not finish; see: torchrig logs -i {inv_path} --job {job}",
                   code=1)
    rate = "?" if s["median_tok_s"] is None else f"{s['median_tok_s']:.0f}"
    print(f"job {job}: {s['steps']} steps, loss {s['first_loss'] or '?'} -> {s['last_loss']}, "
          f"median {rate} tokens/s (4 ranks, CPU), checkpoint {s['ckpt']} (on the rank-0 node)")
    print(f"a report with plots: torchrig report -i {inv_path} --job {job}")
    print(f"demo done in {_time.monotonic() - t0:.0f}s. The testbed is still up: "
          f"torchrig exec -i {inv_path} 'hostname'; take it down with: torchrig testbed.down")


testbed = Collection("testbed", testbed_up, testbed_down, testbed_status)

ns = Collection(init, hosts, exec_, provision, verify, launch, logs, status, job_report, stop,
                metrics, tensorboard, fetch, demo, testbed)
ns.configure({
    "torchrig": {
        "inventory": None,  # a config file's torchrig.inventory (see _inventory_path)
        # hosts at once; sshd's MaxStartups bounds one host. Text, so that a bad
        # INVOKE_TORCHRIG_PARALLEL reaches torchrig's check, not Invoke's int() (a traceback).
        "parallel": "16",
    },
})
