"""jobs: every job on the selected hosts, one row each; --prune removes ended jobs' files."""

from __future__ import annotations

import json

from invoke import Exit

from .common import _fleet, _number, _redactor, _say, fleet_task


@fleet_task(help={"json": "print the jobs (and with --prune what was removed) as JSON",
                  "prune": "remove ended jobs' units, env and run-id files, samplers and stop "
                           "records (a running job is never touched); logs and checkpoints stay",
                  "older_than": "with --prune: only jobs that ended at least DAYS ago",
                  "with_logs": "with --prune: also remove the jobs' log folders",
                  "with_checkpoints": "with --prune: also remove the jobs' checkpoint folders"})
def jobs(c, inventory=None, host=None, json_=False, prune=False, older_than=None,
         with_logs=False, with_checkpoints=False, accept_new_host_keys=False):
    """Every job on the selected hosts (systemd units, and the inventory's Slurm cluster's
    torchrig jobs), one row each: state, nodes, start, end or running time, restarts, last
    step/loss, release; --prune removes ended jobs' files."""
    from torchrig import tables
    from torchrig.launch import jobs as service
    if not prune and (older_than is not None or with_logs or with_checkpoints):
        raise Exit("error: --older-than, --with-logs and --with-checkpoints go with --prune",
                   code=1)
    days = None if older_than is None else _number("older_than", older_than, 0, float)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        red = _redactor(fleet.inv)
        listing = service.list_jobs(fleet, fleet.hosts)
        pruned = None
        if prune:
            pruned = service.prune(fleet, fleet.hosts, listing, days, with_logs,
                                   with_checkpoints)
    rows = red.data([r.as_dict() for r in listing.rows])
    failures = listing.failures + (pruned.failures if pruned else [])
    if json_:
        doc = {"jobs": rows, "errors": failures}
        if pruned is not None:
            doc["prune"] = red.data({"planned": [r.job for r in pruned.plan.prune],
                                     "kept": dict(pruned.plan.kept), "nodes": pruned.nodes})
        print(json.dumps(doc, indent=2))
    else:
        tables.jobs_table(rows)
        if pruned is not None:
            _prune_lines(pruned, red)
        for f in failures:
            _say(f"error: {red.text(f)}")
    if failures:
        raise Exit(code=1)


def _prune_lines(pruned, red) -> None:
    for job, why in pruned.plan.kept:
        _say(f"kept {job}: {why}")
    for h, got in pruned.nodes.items():
        for job in got["pruned"]:
            _say(f"{h}: pruned {job}")
        for job, why in got["kept"].items():
            _say(f"{h}: kept {job}: {why}")
        for note in got["notes"]:
            _say(f"{h}: {red.text(note)}")
    if not pruned.plan.prune:
        _say("nothing to prune")
