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
    """Turn a TorchrigError into its message and exit status 1, never a traceback."""
    @functools.wraps(fn)
    def wrapper(c, *args, **kwargs):
        from torchrig.errors import TorchrigError
        try:
            return fn(c, *args, **kwargs)
        except TorchrigError as e:
            raise Exit(f"error: {e}", code=1) from None
    return wrapper


def _inventory(c, path: str | None):
    from torchrig import inventory
    return inventory.load(path or c.config.torchrig.inventory)


@task(help={"inventory": INVENTORY_HELP, "host": HOST_HELP, "json": "print the hosts as JSON"})
@user_errors
def hosts(c, inventory=None, host=None, json_=False):
    """Show the selected inventory hosts with their resolved connection settings and vars."""
    from torchrig.report import hosts_table
    from torchrig.secrets import redact
    inv = _inventory(c, inventory)
    chosen = inv.select(host)
    if json_:
        print(json.dumps([redact(h.model_dump()) for h in chosen], indent=2))
    else:
        hosts_table(inv, chosen)


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
    from torchrig.execute import run_on
    from torchrig.report import exec_summary
    inv = _inventory(c, inventory)
    chosen = inv.select(host)
    results = run_on(inv, chosen, command, sudo=sudo, accept_new=accept_new_host_keys,
                     timeout=int(timeout) if timeout else None,
                     parallel=int(parallel or c.config.torchrig.parallel))
    bad = exec_summary(results)
    if bad:
        raise Exit(f"error: failed on {len(bad)} of {len(results)} host(s): " + "; ".join(bad),
                   code=1)


@task(help={"hosts": "number of simulated servers, named gpu1..gpuN (default 2)",
            "profile": "GPU profile for all hosts, and/or per host: "
                       "'h100-nvswitch-8' or 'v100s-nvlink-2,gpu2=pcie-sys-4'",
            "inventory": "where to write the testbed's inventory (default inventory/testbed.yml)"})
@user_errors
def up(c, hosts=2, profile=None, inventory="inventory/testbed.yml"):
    """Start a local TESTBED of simulated GPU servers (root; systemd-nspawn containers)."""
    from torchrig.testbed import lab
    st = lab.up(int(hosts), profile, inventory, log=lambda m: print(m, file=sys.stderr))
    for name, h in st["hosts"].items():
        print(f"{name}  {h['ip']}  profile={h['profile']}")
    print(f"testbed up in {st['seconds']}s; inventory: {inventory} "
          f"(e.g. invoke exec --inventory {inventory} \"nvidia-smi -L || true\"); "
          "take it down with: invoke testbed.down")


@task
@user_errors
def down(c):
    """Stop the testbed: hosts halted, mounts, interfaces and its server removed."""
    from torchrig.testbed import lab
    names = lab.down()
    left = lab.leftovers()
    if left:
        raise Exit("error: testbed.down left behind: " + "; ".join(left), code=1)
    print(f"testbed down ({len(names)} host(s) removed; base image cache kept)")


@task(help={"json": "print the status as JSON"})
@user_errors
def status(c, json_=False):
    """Show the testbed's hosts: running, addressable, SSH answering."""
    from torchrig.testbed import lab
    from torchrig.report import testbed_table
    st = lab.status()
    if json_:
        print(json.dumps(st, indent=2))
    else:
        testbed_table(st)


@task(help={"hosts": "number of testbed hosts (default 2)"})
@user_errors
def demo(c, hosts=2):
    """Bring up a local testbed and show it working (the README's first command)."""
    up(c, hosts=hosts)
    exec_(c, "systemctl is-system-running; nvidia-smi -L || echo 'no driver yet: provision installs it'",
          inventory="inventory/testbed.yml")
    print("\ndemo: the testbed is up and answers over verified SSH. provision, verify and "
          "launch are not built yet, so the demo stops here. Take it down with: invoke testbed.down")


testbed = Collection("testbed", up, down, status)

ns = Collection(hosts, exec_, demo, testbed)
ns.configure({
    "torchrig": {
        "inventory": "inventory/hosts.yml",  # override in invoke.yaml or INVOKE_TORCHRIG_INVENTORY
        "parallel": 16,                      # hosts at once; sshd's MaxStartups bounds one host
    },
})
