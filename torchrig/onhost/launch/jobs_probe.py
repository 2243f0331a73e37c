"""Runs ON THE NODE, appended to the probe (facts/probe_host.py) by `torchrig jobs`: the node's
jobs are found here (its unit files torchrig-<job>.service), and the operator's request,
written once for a job whose name is a placeholder, is expanded per job found; then the probe
runs it. So one round trip per node reads every job, however many there are.

expand(template_b64) -> the probe request, base64. The template (JSON):
  unit_dir, unit_re     where job units are and the regex of their names (group 1: the job)
  placeholder           the text standing for a job's name in per_job
  common                request keys taken as they are (e.g. "host": true)
  per_job               {kind: {name: spec}}: becomes {kind: {"<job>/<name>": spec}} per job
  extra_jobs, extra_kinds  more jobs (a Slurm job's, no unit here), of per_job only those kinds
Uses base64, json, os and re as imported by the probe."""


def _sub(value, placeholder, job):
    if isinstance(value, str):
        return value.replace(placeholder, job)
    if isinstance(value, list):
        return [_sub(v, placeholder, job) for v in value]
    if isinstance(value, dict):
        return {k: _sub(v, placeholder, job) for k, v in value.items()}
    return value


def expand(template_b64):
    import base64
    import json
    import os
    import re
    t = json.loads(base64.b64decode(template_b64))
    rx = re.compile(t["unit_re"])
    try:
        names = os.listdir(t["unit_dir"])
    except OSError:
        names = []
    found = sorted({m.group(1) for m in map(rx.fullmatch, names) if m})
    req = dict(t.get("common", {}))
    todo = [(j, None) for j in found] + [(j, t.get("extra_kinds", [])) for j in t.get("extra_jobs", [])]
    for job, kinds in todo:
        for kind, items in t["per_job"].items():
            if kinds is not None and kind not in kinds:
                continue
            for name, spec in items.items():
                req.setdefault(kind, {})[f"{job}/{name}"] = _sub(spec, t["placeholder"], job)
    return base64.b64encode(json.dumps(req).encode()).decode()
