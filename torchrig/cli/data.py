"""data.push, data.ls, data.rm: datasets in every node's data folder, the same bytes
everywhere. A collection like testbed's (Invoke has no optional positional argument, so one
`data ACTION [PATH]` task could not take `data ls`)."""

from __future__ import annotations

import json
import sys

from invoke import Collection, Exit

from .common import _fleet, _number, _redactor, _say, fleet_task

COMMON = {"name": "the dataset's name: <data_dir>/NAME on every node", "json": "print the result as JSON"}


@fleet_task(name="push", help={**COMMON,
    "path": "the file or folder to send",
    "name": "the dataset's name: <data_dir>/NAME on every node (default: PATH's name)",
    "bwlimit": "at most this many KiB/s per transfer (default: no limit)"})
def data_push(c, path, name=None, inventory=None, host=None, bwlimit=None, json_=False,
              accept_new_host_keys=False):
    """Send a file or folder to every selected node's <data_dir>/NAME: each byte once from
    here, then node to node; resumed after a cut, verified, switched in only when complete."""
    return _push(c, path, name, inventory, host, bwlimit, json_, accept_new_host_keys)


@fleet_task(name="ls", help={**COMMON, "name": "only this dataset",
            "full": "re-hash every file on every node (default: sizes and the push's records)"})
def data_ls(c, name=None, inventory=None, host=None, full=False, json_=False,
            accept_new_host_keys=False):
    """Each dataset on each node (version, files, size, check) and whether every node agrees;
    exit 1 when they differ."""
    return _ls(c, name, inventory, host, full, json_, accept_new_host_keys)


@fleet_task(name="rm", help=COMMON)
def data_rm(c, name=None, inventory=None, host=None, json_=False, accept_new_host_keys=False):
    """Remove a dataset from every selected node (refused while a running job uses it)."""
    return _rm(c, name, inventory, host, json_, accept_new_host_keys)


data = Collection("data", data_push, data_ls, data_rm)


def _running_users(fleet, name):
    from torchrig.datasets import plan
    from torchrig.launch import jobs
    listing = jobs.list_jobs(fleet, fleet.hosts)
    if listing.failures:
        raise Exit("error: cannot tell which jobs use dataset " + name + ": " +
                   "; ".join(listing.failures), code=1)
    return plan.users(listing.rows, name)


def _push(c, path, name, inventory, host, bwlimit, json_, accept_new_host_keys):
    from pathlib import Path

    from torchrig.datasets import run
    from torchrig.datasets.view import live_progress
    limit = 0 if bwlimit is None else _number("bwlimit", bwlimit, 1) * 1024
    name = name or Path(path).resolve().name
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        red = _redactor(fleet.inv)
        with live_progress(sys.stderr) as progress:
            res = run.push(fleet, Path(path), name, limit, log=lambda t: _say(red.text(t), sys.stderr),
                           progress=progress, running_users=lambda: _running_users(fleet, name))
    if json_:
        print(json.dumps(res.as_dict(), indent=2))
        return
    from torchrig.datasets.plan import human
    for f in res.fallbacks:
        _say(f"note: sent from this machine to {red.text(f)}", sys.stderr)
    for h, d in res.nodes.items():
        how = ("already there" if d.get("from") is None else f"from {d['from']}, {d['seconds']} s")
        _say(f"{h}: {how}; {'switched to' if d.get('switched') else 'holds'} {res.sha256[:16]}")
    _say(f"dataset {res.name}: {res.files} file(s), {human(res.bytes)} on {len(res.nodes)} node(s); "
         f"{human(res.operator_bytes)} sent from this machine")


def _ls(c, name, inventory, host, full, json_, accept_new_host_keys):
    from torchrig.datasets import run
    from torchrig.datasets.view import ls_rows
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        red = _redactor(fleet.inv)
        found = run.listing(fleet, name, full)
    rows = ls_rows(found, name)
    if json_:
        print(json.dumps(red.data(rows), indent=2))
    else:
        from torchrig.datasets.view import ls_table
        ls_table(rows)
    unreachable = [f"{h}: {v}" for h, v in found.items() if isinstance(v, str)]
    bad = [r["name"] for r in rows if not r["agree"]]
    if unreachable or bad:
        raise Exit("error: data ls: " + "; ".join(
            unreachable + [f"dataset {n} differs between nodes (see above)" for n in bad]), code=1)


def _rm(c, name, inventory, host, json_, accept_new_host_keys):
    from torchrig.datasets import run
    from torchrig.datasets.manifest import check_name
    check_name(name)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        users = _running_users(fleet, name)
        if users:
            raise Exit(f"error: data rm: dataset {name} is used by running job(s) "
                       f"{', '.join(users)}; stop them first", code=1)
        res = run.remove(fleet, name)
    if json_:
        print(json.dumps(res, indent=2))
    failed = [f"{h}: {v}" for h, v in res.items() if isinstance(v, str)]
    if not json_:
        for h, v in res.items():
            if not isinstance(v, str):
                _say(f"{h}: {'removed' if v['removed'] else 'not there'}")
    if failed:
        raise Exit("error: data rm: " + "; ".join(failed), code=1)
