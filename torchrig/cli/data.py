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
    _not_help("push", path)
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


@fleet_task(name="pull", help={**COMMON,
    "url": "an http:// or https:// URL of one file (user:password@ in it: basic auth)",
    "file": "the file's name in the dataset (default: the URL's last path part)",
    "auth_env": "the name of an `env` key of the inventory listed in `secret_env` whose value is "
                "sent as the Authorization header (a bare token: Bearer)",
    "bwlimit": "at most this many KiB/s per transfer between nodes (default: no limit)"})
def data_pull(c, url, name=None, file=None, auth_env=None, inventory=None, host=None,
              bwlimit=None, json_=False, accept_new_host_keys=False):
    """Download one file from a URL into every selected node's <data_dir>/NAME: the first node
    downloads it, the others copy it from the nodes that hold it; the URL and its credentials
    reach the node on stdin only and are masked in every output."""
    _not_help("pull", url)
    from torchrig.datasets import run
    from torchrig.datasets.view import live_progress
    limit = 0 if bwlimit is None else _number("bwlimit", bwlimit, 1) * 1024
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        red = _redactor(fleet.inv)
        auth = _authorization(fleet.hosts[0], auth_env) if auth_env else None
        with live_progress(sys.stderr) as progress:
            res = run.pull(fleet, url, name, file, auth, limit,
                           log=lambda t: _say(red.text(t), sys.stderr), progress=progress,
                           running_users=lambda: _running_users(fleet, name))
    _result(res, json_, red, "downloaded")


def _not_help(task: str, value: str) -> None:
    if value in ("-h", "--help"):  # Invoke hands it to the positional argument, not help
        raise Exit(f"error: data.{task}: for its help: torchrig --help data.{task}", code=2)


def _authorization(host, key: str) -> str:
    """The Authorization header from the inventory's env key `key`, which must be masked."""
    from torchrig.secrets import is_secret
    s = host.settings
    if key not in s.env:
        raise Exit(f"error: --auth-env {key}: no such key in {host.name}'s env var", code=1)
    if key not in s.secret_env and not is_secret(key):
        raise Exit(f"error: --auth-env {key}: list it in the inventory's secret_env first, so "
                   "its value is masked wherever torchrig shows it", code=1)
    value = str(s.env[key])
    return value if value.split(" ", 1)[0] in ("Bearer", "Basic", "token") else f"Bearer {value}"


data = Collection("data", data_push, data_ls, data_rm, data_pull)


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
    _result(res, json_, red, "sent from this machine")


def _result(res, json_, red, how):
    if json_:
        print(json.dumps(red.data(res.as_dict()), indent=2))
        return
    from torchrig.datasets.plan import human
    for f in res.fallbacks:
        _say(f"note: not from another node: {red.text(f)}", sys.stderr)
    for h, d in res.nodes.items():
        how = ("already there" if d.get("from") is None else f"from {d['from']}, {d['seconds']} s")
        _say(f"{h}: {how}; {'switched to' if d.get('switched') else 'holds'} {res.sha256[:16]}")
    _say(f"dataset {res.name}: {res.files} file(s), {human(res.bytes)} on {len(res.nodes)} node(s)"
         + (f"; {human(res.operator_bytes)} sent from this machine" if how.startswith("sent") else ""))


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
        from torchrig.tables import ls_table
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
