"""status: an ended job's end time and run length (from systemd's timestamps), and the
--watch trend (sparklines of tokens/s and GPU use)."""

import calendar
import io
from pathlib import Path

from rich.console import Console

from torchrig import tables, trend
from torchrig.facts import job_state, systemd
from torchrig.session import Result

# `systemctl show` of a job unit that ran 112.5 s and ended (failed) 30 s before the probe read
# the clocks (monotonic 13046.74, wall 1_800_000_000)
ENDED = """Result=exit-code
NRestarts=0
ExecMainStatus=1
LoadState=loaded
ActiveState=failed
SubState=failed
ActiveEnterTimestampMonotonic=12904244493
InactiveEnterTimestampMonotonic=13016744493
"""


def test_ended_job_has_end_time_and_run_length_not_an_uptime():
    props = systemd.parse_show(ENDED, ["u"])["u"]
    assert job_state.uptime(props, 13046.7444) is None  # was 142.5: counted from its start
    assert job_state.ended(props, 1_800_000_000.0, 13046.7444) == {
        "ended_at": 1_799_999_970.0, "ran_s": 112.5}
    inactive = {**props, "ActiveState": "inactive", "SubState": "dead"}
    assert job_state.ended(inactive, 1_800_000_000.0, 13046.7444)["ran_s"] == 112.5


def test_ended_from_a_captured_unit_matches_systemds_own_end_time():
    text = (Path(__file__).parents[1] / "fixtures/systemctl_show_04_job_unit_ended.txt").read_text()
    props = systemd.parse_show(text, ["u"])["u"]
    # the host's clocks read right after: `date` 23:39:33 UTC, /proc/uptime 30763.81
    now = calendar.timegm((2026, 11, 30, 23, 39, 33))
    got = job_state.ended(props, now + 0.5, 30763.81)
    assert got["ran_s"] == 10.6
    # systemd's realtime InactiveEnterTimestamp: Mon 2026-11-30 23:37:38 UTC
    assert abs(got["ended_at"] - calendar.timegm((2026, 11, 30, 23, 37, 38))) < 1.0
    assert job_state.uptime(props, 30763.81) is None


def test_running_or_never_started_units_have_no_end():
    running = {"ActiveState": "active", "ActiveEnterTimestampMonotonic": "13016744493",
               "InactiveEnterTimestampMonotonic": "12000000000"}  # an earlier run's end
    assert job_state.ended(running, 1e9, 13046.7444) == {}
    assert job_state.uptime(running, 13046.7444) == 30.0
    restarted = {**running, "ActiveState": "inactive", "InactiveEnterTimestampMonotonic": "0"}
    assert job_state.ended(restarted, 1e9, 13046.7444) == {}
    assert job_state.ended({"ActiveState": "inactive", "ActiveEnterTimestampMonotonic": "x",
                            "InactiveEnterTimestampMonotonic": "5"}, 1e9, 10) == {}


def test_durations_and_end_text():
    assert [trend.duration(s) for s in (0, 45, 112.4, 3600 + 240, 3 * 86400 + 7300, None, -1)] == [
        "0s", "45s", "1m52s", "1h04m", "3d02h", "", ""]
    assert trend.ended_text(1_799_999_970.0, 112.5, 1_800_000_270.0) == (
        "ran 1m52s, ended 2027-01-15 07:59:30 UTC (5m00s ago)")


def test_status_table_shows_when_an_ended_job_ended(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(tables, "console", Console(file=out, width=250, highlight=False))
    d = {"unit": {"ActiveState": "inactive", "SubState": "dead", "NRestarts": "0"},
         "attempt": 0, "uptime_s": None, "ended_at": 1_799_999_970.0, "ran_s": 112.5, "gpus": [],
         "low_util": None, "progress": "done step=30 loss=1.0"}
    tables.status_table("j", [Result("gpu1", True, d)], now=1_800_000_000.0)
    assert "ran 1m52s, ended 2027-01-15 07:59:30 UTC (30s ago)" in out.getvalue()


def test_sparkline_scales_to_the_largest_and_marks_unknown():
    assert trend.sparkline([0, 50, 100, None, 100]) == "▁▅█ █"
    assert trend.sparkline([0, 0]) == "▁▁"
    assert len(trend.sparkline(list(range(50)))) == trend.WIDTH


def test_watch_trend_shows_a_stall_as_a_drop():
    t = trend.Trend()
    gpus = [{"util": "90"}, {"util": "70"}]
    for i, (step, tok) in enumerate([(10, 1000), (20, 1100), (30, 1000), (40, 1050)]):
        t.add("gpu1", i * 10.0, f"step={step} loss=2.0 lr=1e-3 tok/s={tok}", gpus)
    for i in range(4, 8):  # no new step for 40 s (steps came every 10 s), GPUs idle
        t.add("gpu1", i * 10.0, "step=40 loss=2.0 lr=1e-3 tok/s=1050", [{"util": "0"}] * 2)
    n = t.as_dict()["gpu1"]
    assert n["tokens_per_s"] == [1000, 1100, 1000, 1050, 1050, 1050, 0.0, 0.0]
    assert n["gpu_util"] == [80.0] * 4 + [0.0] * 4
    line = t.line("gpu1")
    assert line.startswith("tok/s ") and "▁▁ 0" in line and "gpu ████▁▁▁▁ 0%" in line
    # a node without progress lines (not rank 0's): GPU use only; a job's junk is no number
    t.add("gpu4", 0.0, None, [{"util": "nan"}, {"util": "55"}])
    t.add("gpu4", 1.0, "step=x tok/s=inf", [])
    assert t.line("gpu4") == "gpu █  ?"
    assert t.line("gpu9") == ""


def test_watch_table_has_a_trend_column_per_node(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(tables, "console", Console(file=out, width=250, highlight=False))
    t = trend.Trend()
    d = {"unit": {"ActiveState": "active", "SubState": "running", "NRestarts": "0"},
         "attempt": 0, "uptime_s": 75, "gpus": [{"index": "0", "util": "50", "mem_used": "1"}],
         "low_util": None, "progress": "step=10 loss=2.0 tok/s=900"}
    t.add("gpu1", 0.0, d["progress"], d["gpus"])
    tables.status_table("j", [Result("gpu1", True, d), Result("gpu4", False, error="down")], t)
    text = out.getvalue()
    assert "trend" in text and "tok/s █ 900  gpu █ 50%" in text and "up 1m15s" in text
    out.truncate(0)
    tables.status_table("j", [Result("gpu1", True, d)])  # no --watch: no trend column
    assert "trend" not in out.getvalue()
