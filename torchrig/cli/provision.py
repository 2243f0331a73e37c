"""provision: plan, ask, apply (the service is torchrig/provision/service.py)."""

from __future__ import annotations

import json
import sys

from invoke import Exit

from .common import _fleet, _redactor, _warm, fleet_task


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
        fleet.preconnect()  # the handshakes overlap the imports and the plan's preparation
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


def _exit_if_failed(reports, what: str) -> None:
    if reports:
        raise Exit(f"error: {what} failed on " + "; ".join(f"{r.host}: {r.error}" for r in reports),
                   code=1)

