"""The tasks' shared prologue, declared once: the short flags, @task and @fleet_task, the one
error path (user_errors), numeric flags, which inventory a task reads, the fleet session, and
the print helpers every line quoting a node goes through. Light imports only: every task
module imports this, and `torchrig --list` imports every task module."""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import invoke
from invoke import Exit


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


def _latest_job(fleet) -> str:
    from torchrig.launch.status import latest_job
    return latest_job(fleet)

