"""torchrig: turn SSH-reachable bare-metal GPU servers into a PyTorch DDP fleet.

Thin Invoke layer: parse flags, load the inventory, call the library, print. Heavy modules
are imported inside tasks so `invoke --list` stays fast.
"""

from __future__ import annotations

import functools
import json
import sys

from invoke import Collection, Exit, task

INVENTORY_HELP = "inventory YAML file (default: torchrig.inventory in invoke.yaml, else inventory/hosts.yml)"
HOST_HELP = "host names or group names, comma-separated (default: every host)"


def user_errors(fn):
    """Turn a TorchrigError into its message and exit status 1, never a traceback. Anything
    else is a torchrig bug: one line too, with the traceback under `invoke --debug`. Every
    error line, a task's own included, goes through the redactor (URL credentials)."""
    @functools.wraps(fn)
    def wrapper(c, *args, **kwargs):
        import logging
        from torchrig.errors import TorchrigError
        try:
            return fn(c, *args, **kwargs)
        except TorchrigError as e:
            from torchrig.secrets import redact_text
            raise Exit(f"error: {redact_text(str(e))}", code=1) from None
        except Exit as e:
            from torchrig.secrets import redact_text
            if isinstance(e.message, str):
                raise Exit(redact_text(e.message), code=e.code) from None
            raise
        except Exception as e:  # noqa: BLE001
            if logging.getLogger().isEnabledFor(logging.DEBUG):  # invoke --debug
                raise
            from torchrig.secrets import redact_text
            raise Exit(redact_text(f"error: {fn.__name__.rstrip('_')}: unexpected "
                                   f"{type(e).__name__}: {e} (a torchrig bug; `invoke --debug "
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


def _inventory(c, path: str | None):
    from torchrig import inventory
    return inventory.load(path or c.config.torchrig.inventory)


def _redactor(inv):
    """The one redactor for everything a task prints: every host's secrets, by form and value."""
    from torchrig.secrets import Redactor
    return Redactor.for_hosts(inv.hosts)


@task(help={"inventory": INVENTORY_HELP, "host": HOST_HELP, "json": "print the hosts as JSON"})
@user_errors
def hosts(c, inventory=None, host=None, json_=False):
    """Show the selected inventory hosts with their resolved connection settings and vars."""
    from torchrig.report import hosts_table
    inv = _inventory(c, inventory)
    chosen = inv.select(host)
    red = _redactor(inv)
    if json_:
        print(json.dumps([red.data(h.model_dump()) for h in chosen], indent=2))
    else:
        hosts_table(inv, chosen, red)


@task(name="exec",
      help={"command": "the shell command line to run on every selected host",
            "inventory": INVENTORY_HELP, "host": HOST_HELP,
            "sudo": "run the command as root (root login, or passwordless sudo)",
            "timeout": "seconds before the command is stopped on a host (default: none)",
            "parallel": "at most this many hosts at once (default: torchrig.parallel)",
            "accept_new_host_keys": "record unknown host keys in the known_hosts file in use "
                                    "(like OpenSSH's accept-new); changed keys are always refused"})
@user_errors
def exec_(c, command, inventory=None, host=None, sudo=False, timeout=None, parallel=None,
          accept_new_host_keys=False):
    """Run an ad-hoc command on the selected hosts in parallel, output prefixed by host."""
    timeout = None if timeout is None else _number("timeout", timeout, 1)
    parallel = _parallel(c) if parallel is None else _number("parallel", parallel, 1)
    from torchrig.execute import run_on
    from torchrig.report import exec_summary
    inv = _inventory(c, inventory)
    chosen = inv.select(host)
    results = run_on(inv, chosen, command, sudo=sudo, accept_new=accept_new_host_keys,
                     timeout=timeout, parallel=parallel)
    bad = exec_summary(results)
    if bad:
        raise Exit(f"error: failed on {len(bad)} of {len(results)} host(s): " + "; ".join(bad),
                   code=1)


@task(help={"inventory": INVENTORY_HELP, "host": HOST_HELP,
            "dry_run": "print the per-host plan (files as diffs) and change nothing",
            "yes": "apply without asking (needed when there is no terminal to ask on)",
            "reboot": "reboot hosts whose new driver needs it, wait for SSH, and continue",
            "json": "print the results as JSON",
            "accept_new_host_keys": "record unknown host keys (OpenSSH accept-new)"})
@user_errors
def provision(c, inventory=None, host=None, dry_run=False, yes=False, reboot=False, json_=False,
              accept_new_host_keys=False):
    """Install the NVIDIA driver, CUDA, NCCL, a torch venv and nccl-tests; plan first, idempotent."""
    from torchrig.provision.apply import HostReport, apply_host, plan_host
    from torchrig.remote import fan_out
    inv = _inventory(c, inventory)
    chosen = inv.select(host)
    red = _redactor(inv)
    par = _parallel(c)
    _warm("torchrig.report")
    gathered = fan_out(chosen, lambda h: plan_host(inv, h, accept_new_host_keys), parallel=par)
    from torchrig import report
    planned = [r.value for r in gathered if r.ok and r.value.report.ok]
    failed = [HostReport(r.host, ok=False, error=r.error) for r in gathered if not r.ok]
    failed = red.data(failed + [r.value.report for r in gathered if r.ok and not r.value.report.ok])
    todo = [p for p in planned if any(s.status == "planned" for s in p.report.steps)]
    if dry_run or (todo and not yes):
        if json_ and dry_run:
            print(json.dumps([red.data(p.report).as_dict() for p in planned] +
                             [f.as_dict() for f in failed], indent=2))
        else:
            report.provision_plan(red.data([p.report for p in planned]) + failed)
        if dry_run:
            _exit_if_failed(failed, "provision (dry run)")
            return
        if not sys.stdin.isatty():
            raise Exit("error: provision would change the hosts above; rerun with --yes to "
                       "apply, or --dry-run to only look", code=1)
        if input(f"apply to {len(todo)} host(s)? [y/N] ").strip().lower() not in ("y", "yes"):
            raise Exit("nothing changed", code=1)
    from torchrig.execute import PrefixedLines  # whole lines: hosts' threads never interleave
    log = (lambda h, m: None) if json_ else \
        (lambda h, m: PrefixedLines(h, sys.stderr).write(red.text(m) + "\n"))
    applied = fan_out(planned, lambda p: apply_host(inv, p, reboot, accept_new_host_keys, log),
                      parallel=par, name=lambda p: p.host.name)
    reports = red.data([r.value if r.ok else HostReport(r.host, ok=False, error=r.error)
                        for r in applied]) + failed
    if json_:
        print(json.dumps([r.as_dict() for r in reports], indent=2))
    else:
        report.provision_table(reports)
    _exit_if_failed([r for r in reports if not r.ok], "provision")


@task(help={"inventory": INVENTORY_HELP, "host": HOST_HELP,
            "bandwidth": "also measure all-reduce busbw (torchrun in each node and across nodes; "
                         "nccl-tests where built) against the expected minimum",
            "json": "print the report as JSON",
            "accept_new_host_keys": "record unknown host keys (OpenSSH accept-new)"})
@user_errors
def verify(c, inventory=None, host=None, bandwidth=False, json_=False, accept_new_host_keys=False):
    """GPUs, topology, driver health, one version gate across nodes, network; PASS or FAIL."""
    from torchrig.verify.run import verify as run_verify
    inv = _inventory(c, inventory)
    _warm("torchrig.report")
    rep = run_verify(inv, inv.select(host), bandwidth=bandwidth, accept_new=accept_new_host_keys,
                     parallel=_parallel(c))
    rep.redact(red := _redactor(inv))
    from torchrig import report
    if json_:
        print(json.dumps(red.data(rep.as_dict()), indent=2, default=str))
    else:
        report.verify_report(rep)
    if rep.status != "PASS":
        bad = [f"{v.host}: " + "; ".join(f"{ch.name} {ch.status}" for ch in v.checks
                                         if ch.status in ("FAIL", "NOT RUN"))
               for v in rep.hosts if v.status != "PASS"]
        bad += [f"{h}: unreachable ({e})" for h, e in rep.unreachable.items()]
        bad += rep.gate[2]
        bad += [f"{b['scope']} bandwidth {b['check'].status}: {b['check'].detail}"
                for b in rep.bandwidth if b["check"].status != "PASS"]
        raise Exit("error: verify " + rep.status + ": " + "; ".join(bad), code=1)


def _nodes(inv, host, nodes):
    chosen = inv.select(host)
    if nodes is not None:
        n = _number("nodes", nodes, 1)
        if n > len(chosen):
            raise Exit(f"error: --nodes {nodes}: only {len(chosen)} host(s) selected "
                       f"({', '.join(h.name for h in chosen)})", code=1)
        chosen = chosen[:n]
    return chosen


def _latest_job(c, inv, hosts) -> str:
    """The newest job on the first selected host (the one whose env file was written last)."""
    from torchrig.remote import run_once
    r = run_once(hosts[0], inv, "ls -t /etc/torchrig/jobs/ 2>/dev/null | sed -n 's/\\.env$//p' | head -1")
    if not r.stdout.strip():
        raise Exit(f"error: no torchrig job found on {hosts[0].name}; pass --job NAME", code=1)
    return r.stdout.strip()


@task(iterable=["env"],
      help={"inventory": INVENTORY_HELP, "host": HOST_HELP,
            "nodes": "use the first N selected hosts (the first one hosts the rendezvous)",
            "nproc_per_node": "processes per node: a number, or 'gpu' = one per GPU "
                              "(2 on hosts with var accelerator: cpu)",
            "script": "the training script, a path inside payload/ (default train.py)",
            "args": "arguments for the script, quoted as in a shell",
            "job": "job name (default job-YYYYmmdd-HHMMSS); names the unit and log directory",
            "max_restarts": "torchrun restarts of the worker group after a failure (default 3)",
            "env": "KEY=VALUE for the job's environment (repeatable); secret-looking names "
                   "and the inventory's secret_env are redacted everywhere they are shown",
            "dry_run": "show per node the job's files as diffs against the node's; change nothing",
            "follow": "after starting, stream every rank's log lines until the job ends",
            "start_timeout": "seconds to wait for every node's workers (default 180)",
            "rdzv_timeout": "seconds nodes wait for each other at (re)start; after a node is lost "
                            "the survivors end after this (default 300)",
            "accept_new_host_keys": "record unknown host keys (OpenSSH accept-new)"})
@user_errors
def launch(c, inventory=None, host=None, nodes=None, nproc_per_node="gpu", script="train.py",
           args="", job=None, max_restarts=None, env=None, dry_run=False, follow=False,
           start_timeout=None, rdzv_timeout=None, accept_new_host_keys=False):
    """Run a torchrun DDP job under systemd on the nodes: everywhere or nowhere."""
    import time as _time
    from torchrig.launch.run import LaunchOptions, launch as run_launch
    numbers = {k: _number(k, v, m) for k, v, m in (
        ("max_restarts", 3 if max_restarts is None else max_restarts, 0),
        ("start_timeout", 180 if start_timeout is None else start_timeout, 1),
        ("rdzv_timeout", 300 if rdzv_timeout is None else rdzv_timeout, 1),
        ("torchrig.parallel", c.config.torchrig.parallel, 1))}
    if nodes is not None:
        _number("nodes", nodes, 1)
    inv = _inventory(c, inventory)
    chosen = _nodes(inv, host, nodes)
    o = LaunchOptions(job=job or _time.strftime("job-%Y%m%d-%H%M%S"), script=script, args=args,
                      env=list(env or []), nproc=str(nproc_per_node), dry_run=dry_run,
                      accept_new=accept_new_host_keys, max_restarts=numbers["max_restarts"],
                      start_timeout=numbers["start_timeout"], rdzv_timeout=numbers["rdzv_timeout"],
                      parallel=numbers["torchrig.parallel"])
    res = run_launch(inv, chosen, o, log=lambda m: print(m, file=sys.stderr))
    if dry_run:
        red = _redactor(inv)
        for hname, files in res.changes.items():  # diffs against the node's files
            for path, ch in files:
                print(f"--- {hname}:{path}\n" + (red.text(ch.diff()) if ch else "(unchanged)\n"),
                      end="")
        print("dry run: nothing changed")
        return
    j = res.job
    sel = ",".join(n.host for n in j.nodes)
    inv_flag = f" -i {inventory}" if inventory else ""
    print(f"job {j.name} started on {sel} ({j.nnodes} node(s) x {j.nodes[0].nproc} process(es)) "
          f"in {res.seconds:.1f}s")
    print(f"  follow:  invoke logs{inv_flag} -h {sel} --job {j.name} -f")
    print(f"  status:  invoke status{inv_flag} -h {sel} --job {j.name}")
    print(f"  stop:    invoke stop{inv_flag} -h {sel} --job {j.name}")
    if follow:
        logs(c, inventory=inventory, host=sel, job=j.name, follow=True)


@task(help={"inventory": INVENTORY_HELP, "host": HOST_HELP,
            "job": "job name (default: the newest job on the first host)",
            "json": "print the status as JSON",
            "watch": "refresh every N seconds until interrupted (0: once)",
            "accept_new_host_keys": "record unknown host keys (OpenSSH accept-new)"})
@user_errors
def status(c, inventory=None, host=None, job=None, json_=False, watch=None,
           accept_new_host_keys=False):
    """Per node: unit state, restarts, attempt, uptime, latest progress, GPU use; idle GPUs flagged."""
    import time as _time
    from torchrig import report
    from torchrig.launch.run import status as run_status
    watch = 0 if watch is None else _number("watch", watch, 0, float)
    par = _parallel(c)
    inv = _inventory(c, inventory)
    chosen = inv.select(host)
    job = job or _latest_job(c, inv, chosen)
    red = _redactor(inv)  # the inventory's secrets do not change between --watch rounds
    while True:
        res = red.data(run_status(inv, chosen, job, accept_new_host_keys, par))
        if json_:
            print(json.dumps({"job": job, "nodes": {r.host: (r.value if r.ok else {"error": r.error})
                                                     for r in res}}, indent=2))
        else:
            report.status_table(job, res)
        if not watch:
            break
        _time.sleep(watch)
    bad = [f"{r.host}: {r.error}" for r in res if not r.ok]
    failed = [r.host for r in res if r.ok and r.value["unit"].get("ActiveState") == "failed"]
    if bad or failed:
        raise Exit(f"error: job {job}: " + "; ".join(bad + [f"{h}: unit failed" for h in failed]),
                   code=1)


@task(help={"inventory": INVENTORY_HELP, "host": HOST_HELP,
            "job": "job name (default: the newest job on the first host)",
            "accept_new_host_keys": "record unknown host keys (OpenSSH accept-new)"})
@user_errors
def stop(c, inventory=None, host=None, job=None, accept_new_host_keys=False):
    """Stop a job on every node: all ranks gone within TimeoutStopSec; logs and checkpoints stay."""
    from torchrig.launch.run import stop as run_stop
    inv = _inventory(c, inventory)
    chosen = inv.select(host)
    job = job or _latest_job(c, inv, chosen)
    res = run_stop(inv, chosen, job, accept_new_host_keys,
                   _parallel(c))
    for r in res:
        print(f"{r.host}: {'stopped' if r.ok else 'FAILED: ' + r.error}")
    bad = [f"{r.host}: {r.error}" for r in res if not r.ok]
    if bad:
        raise Exit(f"error: stop of job {job} failed on " + "; ".join(bad), code=1)
    print(f"job {job} stopped on {len(res)} node(s); logs and checkpoints are kept")


@task(help={"inventory": INVENTORY_HELP, "host": HOST_HELP,
            "job": "job name (default: the newest job on the first host)",
            "follow": "keep streaming until the job ends (across torchrun restarts and SSH drops)",
            "rank": "only this global rank's lines",
            "since": "only files written since: seconds ago (e.g. 600), or a unix time",
            "grep": "only lines matching this regular expression",
            "failures": "show the first failing rank and its error (error.json / traceback)",
            "color": "colour the prefixes per rank (default: when stdout is a terminal)"})
@user_errors
def logs(c, inventory=None, host=None, job=None, follow=False, rank=None, since=None, grep=None,
         failures=False, color=None):
    """Every rank's stdout and stderr from every node, merged and prefixed [node/rank]."""
    import re as _re
    import time as _time
    from torchrig.errors import TorchrigError
    from torchrig.launch.plan import check_job_name, unit_name
    from torchrig.logs.stream import Options, failure_report, follow as run_follow
    from torchrig.provision.desired import settings_for
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
    inv = _inventory(c, inventory)
    chosen = inv.select(host)
    job = check_job_name(job or _latest_job(c, inv, chosen))
    o = Options(job, {h.name: f"{settings_for(h.name, h.vars, inv.path).log_dir}/{job}" for h in chosen},
                unit_name(job), follow=follow and not failures,
                rank=rank, grep=grep, since=when,
                color=sys.stdout.isatty() if color is None else color)
    red = _redactor(inv)
    if failures:
        res = run_follow(inv, chosen, o, printer=_NullPrinter())
        text = failure_report(res.errors)
        print(red.text(text) if text else f"job {job}: no rank wrote an error.json (no failure recorded)")
    else:
        res = run_follow(inv, chosen, o, printer=_redacting_printer(red, o.color))
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
    st = lab.up(n, profile, inventory, log=lambda m: print(m, file=sys.stderr))
    for name, h in st["hosts"].items():
        print(f"{name}  {h['ip']}  profile={h['profile']}")
    print(f"testbed up in {st['seconds']}s; inventory: {inventory} "
          f"(e.g. invoke exec --inventory {inventory} \"nvidia-smi -L || true\"); "
          "take it down with: invoke testbed.down")


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
    from torchrig.report import testbed_table
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
    import re as _re
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
    from torchrig.launch.plan import unit_name
    from torchrig.logs.stream import Options, Printer, follow as run_follow
    inv = _inv.load(inv_path)
    hosts = inv.select(None)[:2]
    seen = []

    class Tee(Printer):
        def line(self, item):
            super().line(item)
            if item.global_rank == 0:
                seen.append(item.text)

    from torchrig.provision.desired import settings_for
    log_dirs = {h.name: f"{settings_for(h.name, h.vars, inv.path).log_dir}/{job}" for h in hosts}
    run_follow(inv, hosts, Options(job, log_dirs,
                                   unit_name(job), follow=True), printer=Tee(sys.stdout, sys.stdout.isatty()))
    done = next((ln for ln in reversed(seen) if ln.startswith("done step=")), None)
    steps_seen = [ln for ln in seen if ln.startswith("step=")]
    rate = _re.findall(r"tok/s=(\d+)", " ".join(steps_seen[1:]))
    stage("summary")
    if not done:
        raise Exit(f"error: demo job {job} did not finish; see: invoke logs -i {inv_path} --job {job}",
                   code=1)
    fields = dict(kv.split("=", 1) for kv in done.split()[1:])
    first = _re.search(r"loss=([0-9.]+)", steps_seen[0]).group(1) if steps_seen else "?"
    print(f"job {job}: {fields['step']} steps, loss {first} -> {fields['loss']}, "
          f"median {sorted(map(int, rate))[len(rate) // 2] if rate else '?'} tokens/s (4 ranks, CPU), "
          f"checkpoint {fields['ckpt']} (on the rank-0 node)")
    print(f"demo done in {_time.monotonic() - t0:.0f}s. The testbed is still up: "
          f"invoke exec -i {inv_path} 'hostname'; take it down with: invoke testbed.down")


testbed = Collection("testbed", testbed_up, testbed_down, testbed_status)

ns = Collection(hosts, exec_, provision, verify, launch, logs, status, stop, demo, testbed)
ns.configure({
    "torchrig": {
        "inventory": "inventory/hosts.yml",  # override in invoke.yaml or INVOKE_TORCHRIG_INVENTORY
        # hosts at once; sshd's MaxStartups bounds one host. Text, so that a bad
        # INVOKE_TORCHRIG_PARALLEL reaches torchrig's check, not Invoke's int() (a traceback).
        "parallel": "16",
    },
})
