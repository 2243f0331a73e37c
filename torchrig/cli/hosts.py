"""init, hosts, exec: the inventory and ad-hoc commands."""

from __future__ import annotations

import json

from invoke import Exit

from .common import (HOST_HELP, INVENTORY_HELP, _fleet, _inventory, _inventory_path, _number,
                     _redactor, fleet_task, task, user_errors)


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
    from torchrig.inventory import write_example
    path = write_example(_inventory_path(c, inventory))
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

