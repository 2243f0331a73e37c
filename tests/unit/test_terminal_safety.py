"""Text a job, a node or a file on a node controls reaches the operator's terminal through one
sanitiser (torchrig/terminal.py) on every output path: escape sequences are shown, not obeyed,
and rich markup in it is text, never a tag (a stray `[/x]` raised MarkupError and printed no
row; `[link=...]` planted a hyperlink). Each test feeds the same hostile strings through one
path, as the task prints it, and reads what reached stdout/stderr."""

import io
import types

import pytest
from invoke import Context, Exit

from torchrig.cli import common, job_outputs as cli_job_outputs
from torchrig.cli import launch as cli_launch, status as cli_status
from torchrig import tables, terminal
from torchrig.errors import TorchrigError
from torchrig.terminal import PrefixedLines
from torchrig.jobreport import data, html
from torchrig.metrics import defs as M, views
from torchrig.session import Result

OSC8 = "\x1b]8;;http://evil\x07click\x1b]8;;\x07"   # a terminal hyperlink
CLEAR = "\x1b[2J"                                    # erase the screen
CSI = "\x9b31m"                                      # a C1 CSI on its own
BIDI = "\u202etxt.exe"                               # right-to-left override
MARKUP = "[/x] [link=http://evil]x[/link] [bold red]"  # rich markup
HOSTILE = OSC8 + CLEAR + CSI + BIDI + MARKUP


def clean(out: str) -> None:
    """Nothing a terminal would obey, and the markup shown as the job wrote it."""
    for bad in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert bad not in out, (bad, out)
    assert "\\x1b]8;;http://evil\\x07" in out and "\\x1b[2J" in out and "\\x9b31m" in out, out
    assert "\\u202etxt.exe" in out and MARKUP in out, out


def unfolded(out: str) -> str:
    """A table's output with rich's folding of long cells undone (cells fold at the width)."""
    return "".join(ln.strip(" │|┃") for ln in out.splitlines())


# ---- the sanitiser ---------------------------------------------------------------------------

def test_printable_markup_and_html_forms():
    assert terminal.printable("a\tb\nc\x1b[2J\x9b\x7f\u2028") == "a\tb\\x0ac\\x1b[2J\\x9b\\x7f\\u2028"
    assert terminal.printable("a\nb", newlines=True) == "a\nb"
    assert terminal.markup("[/x]\x1b") == "\\[/x]\\x1b"
    assert terminal.html('<a href="x">&</a>\x1b') == "&lt;a href=&quot;x&quot;&gt;&amp;&lt;/a&gt;\\x1b"
    assert terminal.printable(3) == "3"


# ---- metrics: .prom labels, written by the job's user ----------------------------------------

def test_metrics_table_shows_hostile_labels_as_text_and_every_row(capsys):
    bad = M.render(M.job_samples(HOSTILE, "gpu1", 0, {"step": "7", "loss": "1.5"}, 3.0, 1,
                                 "active", 1e9)
                   + [("torchrig_gpu_utilization_percent", {"job": HOSTILE, "node": "gpu1",
                                                             "gpu": "0" + CLEAR}, 50.0),
                      ("torchrig_gpu_clock_throttle", {"job": HOSTILE, "node": "gpu1", "gpu": "0",
                                                       "reason": "[/x]" + OSC8}, 1.0)])
    good = M.render(M.job_samples("exp2", "gpu1", 0, {"step": "9"}, 3.0, 0, "active", 1e9))
    rows = views(M.parse(bad), node_time=1e9) + views(M.parse(good), node_time=1e9)
    tables.metrics_table("metrics", [Result("gpu1", True, rows),
                                     Result("gpu2", False, error="refused " + HOSTILE)])
    out = capsys.readouterr().out
    flat = unfolded(out)
    assert "exp2" in out and "[/x]" in flat  # every row printed, the other job's too
    for bad_char in ("\x1b", "\x07", "\x9b"):
        assert bad_char not in out
    assert "\\x1b[2J" in flat and "\\x1b]8;;http://evil\\x07" in flat


# ---- status ----------------------------------------------------------------------------------

def test_status_table_and_its_lines(capsys):
    d = {"unit": {"ActiveState": "active", "SubState": "running" + CLEAR, "NRestarts": "0"},
         "attempt": 0, "restarts": 0, "uptime_s": 5, "low_util": "low " + HOSTILE,
         "gpus": [{"index": "0" + OSC8, "util": "[/x]", "mem_used": "1"}],
         "progress": "step=3 " + HOSTILE}
    tables.status_table("j", [Result("gpu1", True, d), Result("gpu2", False, error=HOSTILE)])
    out = capsys.readouterr().out
    for bad in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert bad not in out
    assert MARKUP in unfolded(out)


def test_status_diagnosis_lines_and_error_line(monkeypatch, capsys):
    """status' lines under the table (a node's wait, the first failure's error, Slurm's state)
    quote the journal; its error line quotes the nodes."""
    from torchrig.launch import status

    res = status.JobStatus("job j", [Result("gpu1", True, {"unit": {}, "gpus": []}),
                                     Result("gpu2", False, error=HOSTILE)])
    monkeypatch.setattr(status, "look", lambda fleet, job, journals: status.StatusRound(job, res, {
        "waiting": {"gpu1": "waits for " + HOSTILE},
        "failure": {"rank": 1, "host": "gpu1", "local_rank": 1, "pid": 9, "cause": "exit 1",
                    "error": HOSTILE}}))
    monkeypatch.setattr(tables, "status_table", lambda *a, **k: None)
    fleet = types.SimpleNamespace(inv=types.SimpleNamespace(hosts=[]), hosts=[])
    with pytest.raises(Exit) as e:
        cli_status._status(fleet, "j", False, 0)
    out = capsys.readouterr().out
    assert out.count("\\x1b[2J") == 2
    clean(out)
    with pytest.raises(Exit) as wrapped:  # the error line as user_errors passes it on
        common.user_errors(lambda c: (_ for _ in ()).throw(e.value))(Context())
    clean(wrapped.value.message)


# ---- error lines: a failed launch quotes the unit's journal ---------------------------------

def test_launch_error_line_quoting_the_journal_is_sanitised(monkeypatch):
    from torchrig.launch import run as launch_run

    def failed(*a, **k):
        raise TorchrigError(f"job j did not start on every node: gpu1: unit failed (exit-code): "
                            f"{HOSTILE} | Traceback")
    from torchrig.launch import health_gate
    monkeypatch.setattr(launch_run, "launch", failed)
    monkeypatch.setattr(health_gate, "gate", lambda fleet, hosts, *a, **k: hosts)
    monkeypatch.setattr(cli_launch, "_fleet", lambda *a, **k: _NoFleet())
    with pytest.raises(Exit) as e:
        cli_launch.launch(Context(), job="j")
    assert e.value.message.startswith("error: job j did not start")
    clean(e.value.message)


def test_every_error_line_is_sanitised_whatever_raised_it():
    for exc in (TorchrigError(HOSTILE), Exit("error: " + HOSTILE, code=1), ValueError(HOSTILE)):
        def task(c, exc=exc):
            raise exc
        with pytest.raises(Exit) as e:
            common.user_errors(task)(Context())
        clean(e.value.message)


class _NoFleet:
    """The fleet session a task opens, for tasks whose library call the test replaces."""
    inv = types.SimpleNamespace(hosts=[])
    hosts = [types.SimpleNamespace(name="gpu1", settings=types.SimpleNamespace(backend="systemd"))]

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def preconnect(self, hosts=None):
        pass


# ---- fetch: the node's file names, torch's error text ---------------------------------------

def test_fetch_prints_file_names_and_load_errors_sanitised(monkeypatch, capsys, tmp_path):
    from torchrig.fetch import run as fetch_run

    def fake(fleet, o, log):
        log(f"gpu1: refused ckpt_{HOSTILE}.pt: torch.load failed: {HOSTILE}")
        f = types.SimpleNamespace(name=f"ckpt_{HOSTILE}.pt", size=3, sha256="0" * 64,
                                  already=False, transferred=3, resumed_at=[])
        return types.SimpleNamespace(host="gpu1", node_dir="/ckpt/j", to=tmp_path, job="j",
                                     files=[f])
    monkeypatch.setattr(fetch_run, "fetch", fake)
    monkeypatch.setattr(cli_job_outputs, "_fleet", lambda *a, **k: _NoFleet())
    cli_job_outputs.fetch(Context(), job="j", to=str(tmp_path))
    got = capsys.readouterr()
    clean(got.out)
    clean(got.err)


# ---- verify and provision: what hosts report ------------------------------------------------

def test_verify_report_tables_and_lines(capsys):
    from torchrig.verify import evaluate
    c = evaluate.Check("gpus", "FAIL", "GPU name " + HOSTILE)
    host = types.SimpleNamespace(host="gpu1", status="FAIL", topology="topo " + CLEAR, checks=[c],
                                 advice=["advice " + HOSTILE])
    rep = types.SimpleNamespace(hosts=[host], unreachable={"gpu2": "ssh: " + HOSTILE},
                                gate=("FAIL", {"torch_cuda": {"gpu1": "12.1" + HOSTILE}},
                                      ["differs: " + HOSTILE]),
                                bandwidth=[{"scope": "node", "hosts": ["gpu1"], "check": c}],
                                slurm=[c], status="FAIL")
    tables.verify_report(rep)
    out = capsys.readouterr().out
    for bad in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert bad not in out
    assert "advice: advice \\x1b]8;;http://evil" in out and MARKUP in out


def test_provision_plan_table_and_live_lines(capsys):
    from torchrig.provision import live
    step = types.SimpleNamespace(name="driver", status="failed", error="apt: " + HOSTILE,
                                 changes=["install " + HOSTILE], diffs=[f"-{HOSTILE}\n+new\n"],
                                 seconds=1.0)
    rep = types.SimpleNamespace(host="gpu1", steps=[step], error=None, rebooted=False, seconds=1.0)
    tables.provision_plan([rep])
    tables.provision_table([rep])
    out = capsys.readouterr().out
    for bad in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert bad not in out
    assert "install \\x1b]8;;http://evil" in out and MARKUP in out
    lines = io.StringIO()
    live.LineProgress(lines).note("gpu1", "dpkg said " + HOSTILE)
    clean(lines.getvalue())


# ---- exec: the command's output -------------------------------------------------------------

def test_exec_output_lines_and_summary(capsys):
    out = io.StringIO()
    sink = PrefixedLines("gpu1", out)
    sink.write(f"one {HOSTILE}\nsecond\r\n")
    sink.close()
    clean(out.getvalue())
    assert out.getvalue().splitlines()[1] == "gpu1 | second"
    tables.exec_summary([Result("gpu2", False, error="ssh: " + HOSTILE)])
    got = capsys.readouterr().out
    assert "\x1b" not in got and "\x07" not in got and "[/x]" in unfolded(got)


# ---- logs, tensorboard, stop, report's notes: the task's own print lines --------------------

def test_task_print_lines_go_through_the_sanitiser(capsys):
    common._say(f"gpu1: TensorBoard {HOSTILE}")
    common._log(f"gpu1: left out ({HOSTILE})")
    got = capsys.readouterr()
    clean(got.out)
    clean(got.err)


def test_logs_printer_and_failure_report():
    from torchrig.logs.merge import Line
    from torchrig.logs.stream import Printer
    out, err = io.StringIO(), io.StringIO()
    p = Printer(out, color=False, err=err)
    p.line(Line("gpu1", "r", 0, 0, 0, "stdout", HOSTILE))
    p.notice("gpu1: " + HOSTILE)
    clean(out.getvalue())
    clean(err.getvalue())


# ---- the HTML report: plotly renders tags in hover text -------------------------------------

def test_report_page_escapes_job_text_for_html_and_plotly():
    rep = data.JobReport("j", 1e9, nodes=[data.Node("gpu1", "failed", script="train.py",
                                                 args=["--note", "<b>x</b>"],
                                                 versions={"torch": "2.13<br>"})],
                      events=[data.Event(1e9 - 10, "gpu1", "start", "unit started"),
                              data.Event(1e9 - 5, "gpu1", "end",
                                         '<a href="http://evil">exit</a>' + CLEAR)])
    figs = html.figures(rep)
    texts = [t for f in figs if f["id"] == "events" for tr in f["data"] for t in tr["text"]]
    assert '&lt;a href=&quot;http://evil&quot;&gt;exit&lt;/a&gt;\\x1b[2J' in texts
    assert not any("<" in t for t in texts)
    page = html.page(rep, "")
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page and "2.13&lt;br&gt;" in page
    assert "\x1b" not in page

