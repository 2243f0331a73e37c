"""Prometheus metrics on the testbed: provision's node_exporter (Debian's package, from the
testbed's mirror of real Debian packages) serves the job sampler's torchrig_* series for a
running job, with the values of the job's own progress lines; `torchrig metrics` shows them over
SSH. One job, sampled on demand (the sampler's unit, as its timer starts it), then stopped."""

import json
import re

import pytest

from conftest import NODES, invoke, ip_of, launch, logs, sh, stop, wait_step

from torchrig import progress
from torchrig.metrics import defs

pytestmark = pytest.mark.provisioned("gpu1", "gpu4")
JOB = "t-metrics"


def exporter_text(inv, host) -> str:
    """node_exporter's page, fetched on the host itself from its cluster address."""
    url = f"http://{ip_of(inv, host)}:9100/metrics"
    return sh(inv, host, f"python3 -c 'import urllib.request as u, sys; "
                         f"sys.stdout.write(u.urlopen(\"{url}\", timeout=10).read().decode())'")


def rank0_steps(inv) -> dict[int, dict]:
    r = logs(inv, JOB, "--rank", "0", "--grep", "^step=")
    lines = [progress.parse(ln) for ln in r.stdout.splitlines()]
    return {int(p.fields["step"]): p.fields for p in lines if p is not None and p.kind == "step"}


def test_node_exporter_serves_the_running_jobs_progress_and_gpus(testbed):
    addr = ip_of(testbed, "gpu1")
    # bound to the cluster address only (not every interface), and its textfile folder is ours
    listening = sh(testbed, "gpu1", "ss -ltnH 'sport = :9100'")
    assert f"{addr}:9100" in listening and "0.0.0.0:9100" not in listening and "*:9100" not in listening

    r = launch(testbed, JOB, "--args", "--max-steps 100000 --log-every 5")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        wait_step(testbed, JOB, 10)
        sh(testbed, "gpu1", f"systemctl start torchrig-gpumon@{JOB}.service")  # one sample now
        text = exporter_text(testbed, "gpu1")
        assert re.search(r"^node_textfile_scrape_error 0$", text, re.M), text[-2000:]
        got = {(n, lab.get("gpu"), lab.get("state")): (lab, v) for n, lab, v in defs.parse(text)
               if lab.get("job") == JOB}
        lab, step = got[("torchrig_job_step", None, None)]
        assert lab == {"job": JOB, "node": "gpu1", "rank": "0"}
        line = rank0_steps(testbed)[int(step)]  # the values of the progress line with that step
        assert got[("torchrig_job_loss", None, None)][1] == float(line["loss"])
        assert got[("torchrig_job_tokens_per_second", None, None)][1] == float(line["tok/s"])
        assert got[("torchrig_job_samples_per_second", None, None)][1] == float(line["samples/s"])
        assert ("torchrig_job_mfu_ratio", None, None) not in got  # mfu=n/a on CPU
        assert got[("torchrig_job_state", None, "active")][1] == 1
        assert 0 <= got[("torchrig_job_last_progress_age_seconds", None, None)][1] < 120
        assert {g for (n, g, _) in got if n == "torchrig_gpu_memory_total_bytes"} == {"0", "1"}

        # the same series through the CLI, over SSH, for both nodes
        r = invoke("metrics", "-i", str(testbed), "-H", NODES, "--job", JOB, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        nodes = json.loads(r.stdout)["nodes"]
        (v1,), (v4,) = nodes["gpu1"], nodes["gpu4"]
        assert v1["state"] == v4["state"] == "active" and v1["rank"] == "0"
        assert 0 <= v1["sample_age_s"] < 90  # by the node's clock (node_exporter's node_time_seconds)
        assert v1["step"] >= step and float(rank0_steps(testbed)[int(v1["step"])]["loss"]) == v1["loss"]
        assert sorted(v4["gpus"]) == ["0", "1"] and "step" not in v4  # rank 0 runs on gpu1
        r = invoke("metrics", "-i", str(testbed), "-H", NODES, "--job", JOB)
        assert r.returncode == 0 and JOB in r.stdout and "active" in r.stdout, r.stdout + r.stderr
    finally:
        stop(testbed, JOB)
    # the stop takes a last sample: node_exporter serves the stopped state, and no GPU series
    after = [(n, lab) for n, lab, v in defs.parse(exporter_text(testbed, "gpu1"))
             if lab.get("job") == JOB and (v == 1 or n.startswith("torchrig_gpu_"))]
    states = [lab["state"] for n, lab in after if n == "torchrig_job_state"]
    assert states in (["inactive"], ["failed"]) and not any(n.startswith("torchrig_gpu_") for n, _ in after)


def test_provision_again_leaves_node_exporter_alone_and_prints_the_scrape_targets(testbed):
    """Converged: the node-exporter step changes nothing (no restart on every run), and the end
    of provision names the targets for a Prometheus scrape config."""
    r = invoke("provision", "-i", str(testbed), "-H", NODES, "--yes", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"node-exporter +. ok", r.stdout), r.stdout
    targets = r.stdout.split("Prometheus scrape targets")[1].split(":", 1)[1].split()
    assert targets == [f"{ip_of(testbed, h)}:9100" for h in NODES.split(",")]


# what a job's user can write into node_exporter's textfile folder (the service user's), and a
# command's output: escape sequences and rich markup that must reach the operator as text
HOSTILE = "\x1b]8;;http://evil\x07click\x1b]8;;\x07\x1b[2J\x9b31m[/x] [link=http://evil]y[/link]"
SHOWN = "\\x1b]8;;http://evil\\x07click\\x1b]8;;\\x07\\x1b[2J\\x9b31m[/x] [link=http://evil]y[/link]"


def columns(table: str) -> list[str]:
    """Each column of a rich table's body as one text, spaces dropped: rich folds a long cell
    over several lines, beside the other columns' pieces."""
    rows = [ln.split("│")[1:-1] for ln in table.splitlines() if ln.count("│") > 2]
    return ["".join(r[i] for r in rows if i < len(r)).replace(" ", "")
            for i in range(max(map(len, rows), default=0))]


def test_a_jobs_labels_and_a_nodes_output_reach_the_terminal_as_text(testbed):
    """A .prom file the service user wrote with escapes and markup in its labels: `metrics`
    prints every row (the markup raised MarkupError and printed none) and no escape reaches
    the terminal; `exec` shows a command's escapes as text too."""
    import base64
    import time
    fine = defs.job_samples("t-fine", "gpu1", 0, {"step": "7"}, 1.0, 0, "active", time.time())
    bad = defs.job_samples("t-bad" + HOSTILE, "gpu1", 0, {"step": "9"}, 1.0, 0, "active" + HOSTILE,
                           time.time())
    bad.append(("torchrig_gpu_clock_throttle", {"job": "t-bad" + HOSTILE, "node": "gpu1",
                                                "gpu": "0", "reason": HOSTILE}, 1.0))
    b64 = base64.b64encode(defs.render(fine + bad).encode()).decode()
    folder = "/var/lib/torchrig/metrics"
    sh(testbed, "gpu1", f"cd {folder} && runuser -u torchrig -- sh -c 'umask 022; echo {b64} | "
                        f"base64 -d > .t-hostile.tmp && mv .t-hostile.tmp torchrig_t-hostile.prom'")
    try:
        assert "t-bad" in exporter_text(testbed, "gpu1")  # node_exporter serves the labels
        r = invoke("metrics", "--inventory", str(testbed), "--host", "gpu1")
        assert r.returncode == 0, r.stdout + r.stderr
        for bad_char in ("\x1b", "\x07", "\x9b"):
            assert bad_char not in r.stdout + r.stderr
        cols = columns(r.stdout)
        assert "t-fine" in r.stdout and any("t-bad\\x1b]8;;http://evil" in c for c in cols), cols
        assert any("[/x][link=http://evil]y[/link]" in c for c in cols), cols
    finally:
        sh(testbed, "gpu1", f"rm -f {folder}/torchrig_t-hostile.prom")
    cmd = "printf '\\033]8;;http://evil\\007click\\033]8;;\\007\\033[2J\\233[/x] [link=http://evil]y[/link]\\n'"
    r = invoke("exec", "--inventory", str(testbed), "--host", "gpu1", cmd)
    assert r.returncode == 0 and "\x1b" not in r.stdout and "\x07" not in r.stdout, r.stdout
    assert "\\x1b]8;;http://evil\\x07click\\x1b]8;;\\x07\\x1b[2J" in r.stdout, r.stdout
