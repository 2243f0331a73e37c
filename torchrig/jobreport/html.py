"""`torchrig report`'s page: data.JobReport -> Plotly figures (plain dicts) -> one self-contained
HTML file. Pure, except that the page inlines plotly.js from the `report` extra (plotly's
Python package ships it), so the file opens with no network.

Every figure is a scatter with markers, one marker per data point: the browser test counts
them (`data-points` on each plot's div) after the page's scripts ran.

Text a job or a node controls (event texts, failure causes, script arguments, versions) goes
through terminal.html(): plotly renders <b>, <a>, <br> in hover text as HTML."""

from __future__ import annotations

import json
import time

from ..errors import TorchrigError
from ..progress import no_steps
from ..terminal import html as safe
from .data import JobReport

EXTRA = "report"
KIND_STYLE = {"start": ("circle", "#2ca02c"), "restart": ("diamond", "#ff7f0e"),
              "failure": ("x", "#d62728"), "end": ("square", "#7f7f7f")}


def plotly_js() -> str:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise TorchrigError(f"torchrig report needs plotly, torchrig's '{EXTRA}' extra: "
                            f"pip install 'torchrig[{EXTRA}]' (make venv installs it)") from None
    return get_plotlyjs()


def _when(t: float) -> str:
    """A plotly date (UTC, millisecond precision)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _scatter(name: str, x: list, y: list, **kw) -> dict:
    return {"type": "scatter", "mode": "lines+markers", "name": name, "x": x, "y": y, **kw}


def _time_range(rep: JobReport) -> list[str] | None:
    """The job's span (up to now while it runs), padded, at least a minute wide: plotly's own
    range around a single event (a running job's start) is a few milliseconds."""
    span = rep.span()
    if span is None:
        return None
    lo, hi = span
    pad = max((hi - lo) * 0.05, (60 - (hi - lo)) / 2, 1.0)
    return [_when(lo - pad), _when(hi + pad)]


def _layout(title: str, xaxis: dict, yaxis: dict, **kw) -> dict:
    # the legend above the plot: below it, it would cover a date axis' second tick line
    return {"title": {"text": title}, "xaxis": xaxis, "yaxis": yaxis, "height": 360,
            "margin": {"l": 60, "r": 20, "t": 80, "b": 60},
            "legend": {"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"}, **kw}


def _event_lines(rep: JobReport) -> list[dict]:
    """Restarts and failures as vertical lines on the time plots."""
    return [{"type": "line", "xref": "x", "yref": "paper", "x0": _when(e.t), "x1": _when(e.t),
             "y0": 0, "y1": 1, "line": {"color": KIND_STYLE[e.kind][1], "dash": "dot", "width": 1}}
            for e in rep.events if e.kind in ("restart", "failure")]


def figures(rep: JobReport) -> list[dict]:
    """[{"id", "title", "data", "layout"}]: only figures that have data (busbw only when verify
    --bandwidth was run for the job's nodes)."""
    figs = []
    steps_x = {"title": {"text": "step"}}
    for key, title, unit in (("loss", "Loss", "loss"), ("tok/s", "Throughput", "tokens/s")):
        traces = []
        for a in sorted({r["attempt"] for r in rep.steps}):
            rows = [r for r in rep.steps if r["attempt"] == a and key in r]
            if rows:
                traces.append(_scatter("first run" if a == 0 else f"after restart {a}",
                                       [r["step"] for r in rows], [r[key] for r in rows]))
        if traces:
            figs.append({"id": "loss" if key == "loss" else "throughput", "title": f"{title} over steps",
                         "data": traces,
                         "layout": _layout(f"{title} over steps", steps_x, {"title": {"text": unit}})})
    time_x = {"title": {"text": "time (UTC)"}, "type": "date"}
    for fid, title, unit, pick in (
            ("gpu-util", "GPU utilisation", "%", lambda n: {g: [(s[0], s[1]) for s in v]
                                                             for g, v in n.gpu_util.items()}),
            ("gpu-mem", "GPU memory used", "MiB", lambda n: {g: [(s[0], s[1]) for s in v]
                                                             for g, v in n.gpu_mem.items()})):
        traces = [_scatter(f"{n.host} GPU{g}", [_when(t) for t, _ in v], [y for _, y in v])
                  for n in rep.nodes for g, v in sorted(pick(n).items()) if v]
        if traces:
            yaxis = {"title": {"text": unit}, "rangemode": "tozero"}
            if fid == "gpu-util":
                yaxis["range"] = [0, 105]
            figs.append({"id": fid, "title": f"{title} per GPU", "data": traces,
                         "layout": _layout(f"{title} per GPU, every node", time_x, yaxis,
                                           shapes=_event_lines(rep))})
    if rep.world:
        w = rep.world
        figs.append({"id": "world", "title": "World size over time", "data": [_scatter(
            "world size", [_when(r["t"]) for r in w], [r["world_size"] for r in w],
            line={"shape": "hv"}, hoverinfo="x+y+text",
            text=[f"from step {r['step']}: {r['nodes']} node(s), global batch "
                  f"{r['global_batch']} = {r['micro_batch']} x {r['world_size']} x "
                  f"{r['grad_accum']}" for r in w])],
            "layout": _layout("World size over time (a point at every (re)start)", time_x,
                              {"title": {"text": "ranks"}, "rangemode": "tozero"},
                              shapes=_event_lines(rep))})
    if rep.events:
        traces = []
        for kind, (symbol, color) in KIND_STYLE.items():
            evs = [e for e in rep.events if e.kind == kind]
            if evs:
                traces.append({"type": "scatter", "mode": "markers", "name": kind,
                               "x": [_when(e.t) for e in evs], "y": [e.host for e in evs],
                               "text": [safe(e.text) for e in evs], "hoverinfo": "x+y+text",
                               "marker": {"symbol": symbol, "color": color, "size": 12}})
        rng = _time_range(rep)
        figs.append({"id": "events", "title": "Starts, restarts, failures and ends",
                     "data": traces,
                     "layout": _layout("Starts, restarts, failures and ends",
                                       {**time_x, **({"range": rng} if rng else {})},
                                       {"title": {"text": "node"}, "type": "category"},
                                       height=200 + 40 * len({e.host for e in rep.events}))})
    traces = []
    for host, rec in sorted(rep.bandwidth.items()):
        if rec.get("node"):
            pts = rec["node"]["points"]
            traces.append(_scatter(f"{host} (in node, {rec['node'].get('world_size')} ranks)",
                                   [p[0] for p in pts], [p[1] for p in pts]))
    cluster = next((r["cluster"] for r in rep.bandwidth.values() if r.get("cluster")), None)
    if cluster:
        traces.append(_scatter("across " + ",".join(cluster["hosts"]),
                               [p[0] for p in cluster["points"]], [p[1] for p in cluster["points"]]))
    if traces:
        figs.append({"id": "busbw", "title": "All-reduce busbw against message size",
                     "data": traces,
                     "layout": _layout("All-reduce busbw against message size (verify --bandwidth)",
                                       {"title": {"text": "message size (bytes)"}, "type": "log"},
                                       {"title": {"text": "busbw (GB/s)"}, "rangemode": "tozero"})})
    return figs


def world_sizes(rep: JobReport) -> str:
    """The world lines in words: each (re)start's world size and step, and the global batch
    (the same throughout, unless the job was relaunched with another)."""
    sizes = " -> ".join(f"{r['world_size']} (step {r['step']})" for r in rep.world)
    batches = " / ".join(dict.fromkeys(str(r["global_batch"]) for r in rep.world))
    return f"{sizes}; global batch {batches}"


def points(fig: dict) -> int:
    return sum(len(t["x"]) for t in fig["data"])


def _json(v) -> str:
    """JSON safe inside a <script> element (no '</script>' or '<!--' can come out of data)."""
    return (json.dumps(v, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))


def _fmt(v, spec: str) -> str:
    return "?" if v is None else format(v, spec)


def page(rep: JobReport, js: str) -> str:
    """The whole HTML page; `js`: plotly.js's source (plotly_js())."""
    e = safe
    s = rep.summary()
    run = rep.command()
    figs = figures(rep)
    restarts = ", ".join(f"{n.host} {n.restarts if n.restarts is not None else '?'}"
                         for n in rep.nodes)
    rows = [("job", rep.job),
            ("script", "?" if run["script"] is None else " ".join([run["script"], *run["args"]])),
            ("nodes", ", ".join(f"{n.host} ({n.state})" for n in rep.nodes)),
            ("world size", f"{run['world_size'] or '?'} rank(s), backend {run['backend'] or '?'}"),
            *([("world sizes", world_sizes(rep))] if rep.world else []),
            ("versions", f"torch {run['torch']}; driver {run['driver']}"),
            ("steps", _fmt(s["steps"], ".0f")),
            ("loss", f"{_fmt(s['first_loss'], '.4f')} -> {_fmt(s['last_loss'], '.4f')}"),
            ("median tokens/s", _fmt(s["median_tok_s"], ",.0f")),
            ("restarts / failures", f"{s['restarts']} / {s['failures']} (restarts per node: "
                                    f"{restarts})"),
            ("running for" if s["running"] else "ran",
             "?" if s["seconds"] is None else f"{s['seconds']:.0f} s"),
            ("report made", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rep.generated)))]
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>torchrig report: {e(rep.job)}</title>",
           "<style>body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1100px}"
           "table{border-collapse:collapse}td,th{padding:2px 10px;text-align:left;"
           "border-bottom:1px solid #ddd}.plot{margin:1em 0}.note{color:#a00}</style>",
           f"<script>{js}</script></head><body>",
           f"<h1>torchrig job {e(rep.job)}</h1>", "<table>"]
    out += [f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows]
    out.append("</table>")
    for f in rep.failures[:1]:
        out.append(f'<p class="note">first failure: rank {f.global_rank} on {e(f.host)} '
                   f"(local rank {f.local_rank}, pid {f.pid}) {e(f.cause)}"
                   + (f": {e(f.error)}" if f.error else "") + "</p>")
    for host, why in {**rep.missing, **rep.unreadable}.items():
        out.append(f'<p class="note">{e(host)}: not in this report ({e(why)})</p>')
    for host, why in rep.cut.items():
        out.append(f'<p class="note">{e(host)}: {e(why)}</p>')
    if rep.nodes and not rep.steps:  # a script of the user's own: say why loss charts lack
        out.append(f'<p class="note" id="no-steps">{e(no_steps(rep.started()))}</p>')
    if not figs:
        out.append("<p>No data yet: no progress line, GPU sample or event was found.</p>")
    for f in figs:
        out.append(f'<div class="plot" id="{e(f["id"])}" data-points="{points(f)}"></div>')
    config = {"displaylogo": False, "responsive": True}
    out.append("<script>")
    out += [f"Plotly.newPlot({_json(f['id'])}, {_json(f['data'])}, {_json(f['layout'])}, "
            f"{_json(config)});" for f in figs]
    out.append("</script></body></html>")
    return "\n".join(out) + "\n"
