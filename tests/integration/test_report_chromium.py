"""`torchrig report` for a finished demo-like job on two testbed nodes, opened in real headless
chromium: every plot drawn with its data, no console message, no network; a screenshot.
Reuses what the session already has: test_launch's finished job t-basic and verify's kept
busbw sweep of gpu1 when those ran; otherwise it makes them (a 30-step job, verify --bandwidth
of gpu1 alone)."""

import re
import sys
from pathlib import Path

import pytest

from conftest import NODES, REPO, invoke, launch, logs, status

sys.path.insert(0, str(REPO / "tests" / "unit"))
import _browser  # noqa: E402
from test_launch import ssh_logins  # noqa: E402

pytestmark = [pytest.mark.provisioned("gpu1", "gpu4"),
              pytest.mark.skipif(_browser.BROWSER is None,
                                 reason="chromium is not installed (`make deps` installs it)")]


def _finished_job(inv) -> str:
    """t-basic when test_launch ran it to the end this session, else the same job anew."""
    _, st = status(inv, "t-basic")
    if st and all("error" not in n and n["unit"]["ActiveState"] == "inactive"
                  for n in st["nodes"].values()) \
            and any((n["progress"] or "").startswith("done ") for n in st["nodes"].values()):
        return "t-basic"
    r = launch(inv, "t-report", "--args", "--max-steps 30 --log-every 5 --ckpt-every 10")
    assert r.returncode == 0, r.stderr
    assert logs(inv, "t-report", "-f", timeout=300).returncode == 0  # returns when it ended
    return "t-report"


def test_report_of_a_finished_job_renders_in_chromium(testbed, tmp_path):
    from torchrig import inventory
    from torchrig.jobreport import html
    from torchrig.verify import store
    job = _finished_job(testbed)
    if "gpu1" not in store.load(inventory.load(testbed).select("gpu1")):
        r = invoke("verify", "-i", str(testbed), "-H", "gpu1", "--bandwidth", timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
    nodes = NODES.split(",")
    before = {h: ssh_logins(h) for h in nodes}
    r = invoke("report", "-i", str(testbed), "-H", NODES, "--job", job, "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    # one round trip per node, over the task's one connection
    assert {h: ssh_logins(h) - before[h] for h in nodes} == {h: 1 for h in nodes}
    page = tmp_path / f"{job}-report.html"
    assert str(page) in r.stdout and re.search(r"\(2 node\(s\), \d+ progress line", r.stdout)
    # nothing outside plotly.js (whose code holds links) loads from or links to the network
    text = page.read_text().replace(html.plotly_js(), "")
    assert not re.search(r"""(src|href)=["']?https?:""", text)
    plots, console = _browser.rendered(page)
    assert console == []
    # world: the world line rank 0 prints at every start (one size here: one step)
    assert set(plots) == {"loss", "throughput", "gpu-util", "gpu-mem", "events", "busbw",
                          "world"}, plots
    for pid, (want, drawn) in plots.items():
        assert want > 0 and drawn == want, (pid, want, drawn)
    assert plots["loss"][0] >= 6  # steps 5..30 and done
    png = tmp_path / "report.png"
    _browser.screenshot(page, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
