"""logs: every rank's lines, followed, or the first failure."""

from __future__ import annotations

import contextlib
import sys

from invoke import Exit

from .common import _fleet, _job_keeps_running, _latest_job, _number, _redactor, _say, fleet_task


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
    from torchrig.launch.joblogs import job_logs
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
        red = _redactor(fleet.inv)
        with _job_keeps_running(fleet, job) if follow else contextlib.nullcontext():
            res = job_logs(fleet, job, _redacting_printer(red, color), follow=follow, rank=rank,
                           grep=grep, since=when, color=color, failures=failures, red=red)
    if failures:
        _say(res.failures or f"job {res.job}: no failed rank (no error.json, no failed worker "
                             "in torchrun's log)")
    if res.lost:
        raise Exit("error: lost " + "; ".join(f"{h}: {w}" for h, w in res.lost.items()), code=1)


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
