"""Terminal tables (rich), printed at the edge: the tasks call these. (`torchrig report`, the
HTML page, is jobreport/.)"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.table import Table

from .datasets.plan import human
from .inventory import Host, Inventory
from .secrets import Redactor
from .terminal import markup
from .verify import evaluate

# Not a terminal (CI logs, pipes): wide enough that tables do not wrap every cell. Every string
# from a node, a job or the inventory goes in through terminal.markup(); no emoji codes either
# (':x:' in a job's label stays text).
console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 160)


# verify's version gate rows: where each version comes from
GATE_LABELS = {"cuda": "cuda toolkit", "nccl": "libnccl2", "torch_cuda": "torch's cuda",
               "torch_nccl": "torch's nccl"}


def styled(text: str, style: str) -> str:
    """Markup for `text` (sanitised: remote text may hold '[...]' or escapes) in `style`."""
    return f"[{style}]{markup(text)}[/]" if style else markup(text)


def hosts_table(inv: Inventory, hosts: list[Host], red: Redactor) -> None:
    t = Table(title=markup(f"{inv.path}  (known_hosts: {inv.known_hosts})"))
    for col in ("host", "connection", "address", "port", "user", "jump", "gpus", "groups", "vars"):
        t.add_column(col)
    for h in hosts:
        t.add_row(*map(markup, (
            h.name, h.connection, h.address, str(h.port or 22), h.user or "(ssh default)",
            h.jump or "", "" if h.gpus is None else str(h.gpus), ",".join(h.groups),
            ", ".join(f"{k}={v}" for k, v in red.data(h.settings.given()).items()))))
    console.print(t)


def exec_summary(res) -> None:
    """The per-host exit table of exec's Outcome."""
    t = Table(title="exec summary")
    for col in ("host", "status", "exit", "seconds", "error"):
        t.add_column(col)
    for r in res:
        code = r.value.code if r.ok else None
        ok = r.ok and code == 0
        t.add_row(markup(r.host), "[green]ok[/]" if ok else "[red]FAILED[/]",
                  "" if code is None else str(code), f"{r.seconds:.1f}", markup(r.error or ""))
    console.print(t)


def testbed_table(st: dict) -> None:
    if not st["up"]:
        console.print("testbed is down")
        return
    t = Table(title=f"testbed (TESTBED SIMULATION) serving {st['server']}"
                    f"{'' if st['serving'] else ' [red](server not running)[/]'}")
    for col in ("host", "address", "profile", "running", "ssh", "mounted"):
        t.add_column(col)
    yn = {True: "[green]yes[/]", False: "[red]no[/]"}
    for name, h in st["hosts"].items():
        t.add_row(markup(name), markup(h["ip"]), markup(h["profile"]), yn[h["running"]],
                  yn[h["ssh"]], yn[h["mounted"]])
    console.print(t)
    console.print(f"inventory: {markup(st['inventory'])}")


STATUS_STYLE = {"changed": "yellow", "ok": "green", "skipped": "cyan", "failed": "red",
                "planned": "yellow"}


def provision_plan(reports, diffs: bool = True) -> None:
    """The per-host plan: each step with what it would change, files as unified diffs."""
    for rep in reports:
        console.rule(f"[bold]{markup(rep.host)}[/] plan")
        for st in rep.steps:
            style = STATUS_STYLE.get(st.status, "")
            label = {"planned": "will change", "ok": "ok (no change)"}.get(st.status, st.status)
            console.print(f"[{style}]{st.name:16}[/] {label}"
                          + (f"  ({markup(st.error)})" if st.error else ""), soft_wrap=True)
            for ch in st.changes:
                console.print(f"    - {markup(ch)}", soft_wrap=True)
            if diffs:  # the node's files against ours: the node's side is the node's text
                for d in st.diffs:
                    console.print(markup(d.rstrip("\n"), newlines=True), highlight=False,
                                  soft_wrap=True)


def provision_table(reports) -> None:
    t = Table(title="provision")
    for col in ("host", "step", "status", "seconds", "detail"):
        t.add_column(col, overflow="fold")
    for rep in reports:
        for st in rep.steps:
            style = STATUS_STYLE.get(st.status, "")
            detail = st.error or (st.changes[0] + (f" (+{len(st.changes) - 1} more)"
                                                   if len(st.changes) > 1 else "")
                                  if st.changes else "")
            t.add_row(markup(rep.host), markup(st.name), styled(st.status, style),
                      f"{st.seconds:.1f}" if st.seconds else "", markup(detail))
        if rep.error and not rep.steps:
            t.add_row(markup(rep.host), "-", "[red]failed[/]", "", markup(rep.error))
    console.print(t)
    for rep in reports:
        n = {k: sum(1 for s in rep.steps if s.status == k) for k in STATUS_STYLE}
        extra = " (rebooted)" if rep.rebooted else ""
        console.print(f"{markup(rep.host)}: {n['changed']} changed, {n['ok']} ok, {n['skipped']} skipped, "
                      f"{n['failed']} failed in {rep.seconds:.1f}s{extra}")


VERDICT_STYLE = {"PASS": "green", "FAIL": "red", "WARN": "yellow", "NOT RUN": "magenta"}


def _v(status: str) -> str:
    return styled(status, VERDICT_STYLE.get(status, ""))


def verify_report(rep) -> None:
    for v in rep.hosts:
        t = Table(title=markup(f"{v.host}: {v.status}" + (f"  ({v.topology})" if v.topology else "")))
        for col in ("check", "status", "detail"):
            t.add_column(col, overflow="fold")
        for c in v.checks:
            t.add_row(markup(c.name), _v(c.status), markup(c.detail))
        console.print(t)
        for a in v.advice:
            console.print(f"  advice: {markup(a)}", soft_wrap=True)
    for host, err in rep.unreachable.items():
        console.print(f"{markup(host)}: {_v('FAIL')} {markup(err)}", soft_wrap=True)
    status, table, reasons = rep.gate
    if table:
        hosts = [v.host for v in rep.hosts]
        t = Table(title=f"version gate: {markup(status)}")
        t.add_column("")
        for h in hosts:
            t.add_column(markup(h))
        for key, by_host in table.items():
            shown = {h: evaluate.shown(val) for h, val in by_host.items()}
            common = max(set(shown.values()), key=list(shown.values()).count)
            t.add_row(markup(GATE_LABELS.get(key, key)),
                      *[styled(shown[h], "" if shown[h] == common else "red") for h in hosts])
        console.print(t)
        for r in reasons:
            console.print(f"  {markup(r)}", soft_wrap=True)
    if rep.bandwidth:
        t = Table(title="all-reduce bandwidth")
        for col in ("scope", "hosts", "status", "detail"):
            t.add_column(col, overflow="fold")
        for b in rep.bandwidth:
            t.add_row(markup(b["scope"]), markup(",".join(b["hosts"])), _v(b["check"].status),
                      markup(b["check"].detail))
        console.print(t)
    if rep.slurm:
        t = Table(title="slurm cluster")
        for col in ("check", "status", "detail"):
            t.add_column(col, overflow="fold")
        for c in rep.slurm:
            t.add_row(markup(c.name), _v(c.status), markup(c.detail))
        console.print(t)
    console.print(f"verify: {_v(rep.status)}")


def progress_cell(d: dict) -> str:
    """status' progress column: the last progress line; for a script that prints none, the
    last line it printed (job_state.last_line), marked as such; else nothing."""
    if d.get("progress"):
        return markup(d["progress"])
    if d.get("last_line"):
        return "[dim]no step lines; last line:[/] " + markup(d["last_line"])
    return ""


def status_table(job: str, results, trend=None, now: float | None = None) -> None:
    """The per-node table; with `trend` (status --watch) a sparkline column per node. The
    restarts column is payload/metrics.py's restarts() (the job_state dict's "restarts"), the
    number `metrics` and `report` show."""
    from . import trend as trends
    now = time.time() if now is None else now
    t = Table(title=f"job {markup(job)}")
    cols = ["node", "state", "restarts", "attempt", "time", "progress", "GPUs (util%/mem MiB)"]
    for col in cols + (["trend"] if trend is not None else []):
        t.add_column(col, overflow="fold")
    for r in results:
        if not r.ok:
            t.add_row(markup(r.host), "[red]unreachable[/]", "", "", "", markup(r.error or ""), "",
                      *([""] if trend is not None else []))
            continue
        d = r.value
        u = d["unit"]
        state = f"{u.get('ActiveState')}/{u.get('SubState')}"
        style = {"active": "green", "failed": "red"}.get(u.get("ActiveState"), "")
        gpus = " ".join(f"{g['index']}:{g['util']}%/{g['mem_used']}" for g in d["gpus"])
        if d.get("ended_at") is not None:  # an ended job: when, and how long it ran
            when = trends.ended_text(d["ended_at"], d.get("ran_s"), now)
        else:
            when = f"up {trends.duration(d['uptime_s'])}" if d.get("uptime_s") else ""
        restarts = d.get("restarts")
        if (d.get("health") or {}).get("healthy") is False:  # its health watcher found a fault
            state, style = f"{state} unhealthy", "red"
        t.add_row(markup(r.host), styled(state, style), "" if restarts is None else str(restarts),
                  "" if d["attempt"] is None else str(d["attempt"]), markup(when),
                  progress_cell(d), markup(gpus),  # the job and the node wrote them
                  *([markup(trend.line(r.host))] if trend is not None else []))
    console.print(t)
    for r in results:
        if r.ok and (r.value.get("health") or {}).get("healthy") is False:
            console.print(f"[red]{markup(r.host)}: unhealthy: "
                          f"{markup(r.value['health']['reason'] or 'a fault')}[/]", soft_wrap=True)
        if r.ok and (r.value.get("health") or {}).get("note"):
            console.print(f"[yellow]{markup(r.host)}: {markup(r.value['health']['note'])}[/]",
                          soft_wrap=True)
        if r.ok and r.value.get("low_util"):
            console.print(f"[yellow]{markup(r.host)}: {markup(r.value['low_util'])}[/]",
                          soft_wrap=True)


def _num(v: float | None, fmt: str = "{:g}") -> str:
    return "" if v is None else fmt.format(v)


def metrics_table(title: str, results) -> None:
    """`torchrig metrics`: one row per job and node from the torchrig_* series."""
    t = Table(title=title)
    for col in ("node", "job", "state", "step", "loss", "tok/s", "samples/s", "MFU", "restarts",
                "last progress", "GPUs (util% / mem GiB / °C / W)"):
        t.add_column(col, overflow="fold")
    for r in results:
        if not r.ok:
            t.add_row(markup(r.host), "", "[red]unreachable[/]", markup(r.error or ""), *[""] * 7)
            continue
        if not r.value:
            t.add_row(markup(r.host), "", "[dim]no torchrig series[/]", *[""] * 8)
        for v in r.value:  # every label (job, node, gpu, state, reason) is the .prom writer's
            x = v.values.get
            gpus = " ".join(
                markup(f"{i}:{_num(g.get('util_percent'), '{:.0f}')}%/"
                       f"{_num((g.get('mem_used_bytes') or 0) / 2**30, '{:.1f}')}/"
                       f"{_num(g.get('temp_celsius'), '{:.0f}')}/"
                       f"{_num(g.get('power_watts'), '{:.0f}')}")
                + (f" {styled(','.join(v.throttled[i]), 'yellow')}" if v.throttled.get(i) else "")
                for i, g in sorted(v.gpus.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))
            mfu = x("mfu")
            age = x("last_progress_age_s")
            style = {"active": "green", "failed": "red"}.get(v.state or "", "")
            if v.unhealthy:  # its health watcher stopped the node's part
                style = "red"
            state = styled((v.state or "") + (f" unhealthy ({v.unhealthy})" if v.unhealthy else ""),
                           style) + (
                f" [yellow](sampled {v.sample_age_s:.0f}s ago)[/]" if v.stale else "")
            t.add_row(markup(v.node), markup(v.job), state,
                      _num(x("step"), "{:.0f}"), _num(x("loss"), "{:.4g}"),
                      _num(x("tok/s"), "{:.0f}"),
                      _num(x("samples/s"), "{:.1f}"),
                      "" if mfu is None else f"{mfu * 100:.1f}%",
                      _num(x("restarts"), "{:.0f}"),
                      "" if age is None else f"{age:.0f}s ago", gpus)
    console.print(t)
    for r in results:  # the series a script without progress lines cannot have, said once
        for v in (r.value if r.ok else []):
            if v.note:
                console.print(f"{markup(v.node)} {markup(v.job)}: {markup(v.note)}",
                              soft_wrap=True)


def jobs_table(rows: list[dict], now: float | None = None) -> None:
    """`torchrig jobs`: one row per job (jobs.JobRow.as_dict(), redacted). Names, nodes, the
    progress line and the release path went through terminal.markup(): a job wrote some."""
    from . import trend as trends
    now = time.time() if now is None else now
    t = Table(title="jobs")
    for col in ("job", "state", "nodes", "started", "ended / running for", "restarts", "step",
                "loss", "workdir (release)"):
        t.add_column(col, overflow="fold")
    style = {"running": "green", "restarting": "yellow", "failed": "red", "stopped": "",
             "succeeded": "cyan"}
    for d in rows:
        if d["ended_at"] is not None:
            when = "ended " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(d["ended_at"])) \
                + f" ({trends.duration(now - d['ended_at'])} ago)"
        elif d["running_s"] is not None:
            when = f"running for {trends.duration(d['running_s'])}"
        else:
            when = ""
        started = "" if d["started_at"] is None else \
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(d["started_at"]))
        nodes = ", ".join(f"{h}:{s}" if s != d["state"] else h for h, s in d["nodes"].items())
        name = d["job"] + (f" (slurm {d['slurm_id']})" if d.get("slurm_id") else "")
        t.add_row(markup(name), styled(d["state"], style.get(d["state"], "")), markup(nodes),
                  markup(started), markup(when),
                  "" if d["restarts"] is None else str(d["restarts"]),
                  markup(d["step"] or ""), markup(d["loss"] or ""), markup(d["workdir"] or ""))
    console.print(t)


def ls_table(rows: list[dict]) -> None:
    t = Table("dataset", "node", "version", "files", "size", "check")
    for r in rows:
        for i, (host, c) in enumerate(r["nodes"].items()):
            check = ("unreachable: " + c["error"] if c["error"] else "not there" if not c["sha256"]
                     else "; ".join(c["problems"]) or "ok")
            t.add_row(markup(r["name"]) if i == 0 else "", markup(host),
                      (c["sha256"] or "-")[:16], str(c["files"]), human(c["bytes"]), markup(check))
        t.add_row("", "", "", "", "", "every node agrees" if r["agree"] else
                  "[red]nodes differ[/red]", end_section=True)
    if not rows:
        console.print("no datasets on the selected hosts")
        return
    console.print(t)
