"""report and fetch: what a job leaves behind, brought to this machine."""

from __future__ import annotations

import json
import sys

from invoke import Exit

from .common import _fleet, _latest_job, _log, _number, _redactor, _say, fleet_task


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
    if rep.nodes and not rep.steps:
        from torchrig.progress import no_steps
        _say(f"note: job {job}: {no_steps(rep.started())}")
    if rep.unreadable:  # the page is written without them; the run did not do all it was asked
        raise Exit("error: report: could not read " + "; ".join(
            f"{h}: {why}" for h, why in rep.unreadable.items()), code=1)


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
    if step is not None and all_:
        raise Exit("error: --step and --all: choose one", code=1)
    step = None if step is None else _number("step", step, 0)
    bwlimit = 0 if bwlimit is None else _number("bwlimit", bwlimit, 1) * 1024
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        fleet.preconnect()  # the handshakes overlap fetch's imports
        from torchrig.fetch.run import FetchOptions, fetch as run_fetch
        o = FetchOptions(job="", to=Path(), step=step, all=all_, bwlimit=bwlimit)
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

