"""status, metrics, tensorboard: a running job looked at."""

from __future__ import annotations

import json

from invoke import Exit

from .common import _fleet, _job_keeps_running, _latest_job, _number, _redactor, _say, fleet_task


@fleet_task(help={"job": "job name (default: the newest job on the first host)",
                  "json": "print the status as JSON",
                  "watch": "refresh every N seconds until interrupted (0: once), with a "
                           "sparkline of tokens/s and GPU use per node over the samples"})
def status(c, inventory=None, host=None, job=None, json_=False, watch=None,
           accept_new_host_keys=False):
    """Per node: unit state, restarts, attempt, uptime (or when an ended job ended and how long
    it ran), latest progress, GPU use; idle GPUs flagged; --watch adds a trend per node."""
    watch = 0 if watch is None else _number("watch", watch, 0, float)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        job = job or _latest_job(fleet)
        with _job_keeps_running(fleet, job):
            _status(fleet, job, json_, watch)


def _status(fleet, job, json_, watch):
    """status' rounds (one, or one per --watch interval), rendered as each comes."""
    from torchrig import tables
    from torchrig.launch import status as service
    for rnd in service.watch(fleet, job, watch, _redactor(fleet.inv)):
        sj, diag, res, trend = rnd.slurm, rnd.diagnosis, rnd.nodes, rnd.trend
        if json_:
            print(json.dumps({"job": job, "nodes": res.as_dict(), **diag,
                              **({"elastic": rnd.elastic} if rnd.elastic else {}),
                              **({"slurm": sj.as_dict()} if sj else {}),
                              **({"trend": trend.as_dict()} if trend is not None else {})}, indent=2),
                  flush=True)  # each --watch round as it comes, also through a pipe
        else:
            if sj is not None:
                d = sj.as_dict()
                _say(f"slurm job {d['job_id']}: {d['state']} on {','.join(d['nodes'])}"
                     + (f" ({d['reason']})" if d["reason"] not in ("", "None") else ""))
            tables.status_table(job, res, trend)
            if rnd.elastic:  # (_say: the world line is the job's text)
                e = rnd.elastic
                _say(f"elastic job ({e['span']} nodes): {e['state']}"
                     + (f"; latest world line: {e['world']}" if e["world"] else ""))
            for r in res:
                if r.ok and r.value.get("journal_cut"):
                    print(f"warning: {r.host}: {r.value['journal_cut']}")
            for h, what in diag["waiting"].items():
                _say(f"{h}: {what}")
            for h in diag.get("lost_nodes", []):
                _say(f"{h}: lost (unreachable; Slurm: {sj.as_dict()['state']})")
            if diag["failure"]:
                f = diag["failure"]
                _say(f"first failure: rank {f['rank']} on {f['host']} (local rank "
                     f"{f['local_rank']}, pid {f['pid']}) {f['cause']}"
                     + (f": {f['error']}" if f["error"] else "")
                     + f" (its last lines: torchrig logs --failures --job {job})")
    if not res.ok:
        raise Exit(f"error: job {job}: " + "; ".join(res.failures), code=1)


@fleet_task(help={"job": "job name (default: the newest job on the first host)",
                  "port": "local port to open it on (default 6006; 0: any free port)"})
def tensorboard(c, inventory=None, host=None, job=None, port=None, accept_new_host_keys=False):
    """TensorBoard for a job: started on its rank-0 node (the first selected host) as the job's
    user, bound to 127.0.0.1 there, forwarded to 127.0.0.1:PORT here over the SSH connection;
    Ctrl-C stops both."""
    from torchrig.launch.tensorboard import serve
    port = _number("port", 6006 if port is None else port, 0)
    if port > 65535:
        raise Exit(f"error: --port {port}: expected a port number up to 65535", code=1)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        job = job or _latest_job(fleet)
        node = fleet.hosts[0]

        def ready(b):
            _say(f"TensorBoard for job {job} on {b.host} (as {b.user}, 127.0.0.1:{b.remote_port} "
                 f"there): {b.url}", flush=True)
            print("Ctrl-C stops it", flush=True)
        board = serve(fleet, node, job, port, ready)
    _say(f"{board.host}: TensorBoard {board.stopped}", flush=True)
    if board.ended_by_itself:
        raise Exit(f"error: TensorBoard for job {job} ended on {board.host} by itself "
                   f"(see: torchrig exec --host {board.host} --sudo 'journalctl -u {board.unit}')", code=1)


@fleet_task(help={"job": "only this job's series (default: every job's)",
                  "json": "print the series per node as JSON"})
def metrics(c, inventory=None, host=None, job=None, json_=False, accept_new_host_keys=False):
    """Every node's torchrig_* Prometheus series (GPU and job), fetched from its node_exporter
    on the node over SSH: no port needs to be open to this machine."""
    from torchrig import tables
    from torchrig.job import check_job_name
    from torchrig.metrics import collect
    if job is not None:
        check_job_name(job)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        res = _redactor(fleet.inv).data(collect(fleet, fleet.hosts, job))
    if json_:
        print(json.dumps({"job": job, "nodes": {r.host: ([v.as_dict() for v in r.value] if r.ok
                                                          else {"error": r.error}) for r in res}},
                         indent=2))
    else:
        tables.metrics_table(f"metrics of job {job}" if job else "metrics", res)
    if not res.ok:
        raise Exit(res.error_line(), code=1)

