"""`torchrig report`'s page in real headless chromium (Debian's package; `make deps` installs
it): it renders with no network, every plot draws one marker per data point, and nothing
reaches the console. The negative controls show the checks can fail."""

import json

import pytest

from torchrig.jobreport import data, html

import _browser
from _fixtures import FIXTURES

pytestmark = pytest.mark.skipif(_browser.BROWSER is None,
                                reason="chromium is not installed (`make deps` installs it)")


def _report():
    g = json.loads((FIXTURES / "report_01_probe_replies_testbed_killed_rank_2nodes.json").read_text())
    return data.build("t-rep", "torchrig-t-rep.service", g, 1796082300.0)


def test_report_renders_every_plot_with_its_data_and_no_console_message(tmp_path):
    page = tmp_path / "t-rep-report.html"
    page.write_text(html.page(_report(), html.plotly_js()))
    plots, console = _browser.rendered(page)
    assert console == []
    assert list(plots) == ["loss", "throughput", "gpu-util", "gpu-mem", "events", "busbw"]
    for pid, (want, drawn) in plots.items():
        assert want > 0 and drawn == want, (pid, want, drawn)


def test_checks_catch_a_page_that_fails_or_needs_the_network(tmp_path):
    page = tmp_path / "broken.html"
    # no plotly.js inlined, and a script from the network instead
    page.write_text(html.page(_report(), "").replace(
        "<script></script>", '<script src="https://cdn.example.invalid/plotly.min.js"></script>'))
    plots, console = _browser.rendered(page)
    # the network is closed to the browser: the script never loads, the page's own code fails
    assert any("Plotly is not defined" in ln for ln in console), console
    assert plots and all(drawn == 0 for _, drawn in plots.values())
