"""A user's own script that prints no torchrig progress lines (examples/plain_project): status
shows the last line it printed (job_state.last_line: rank choice, carriage returns, bounded,
sanitised, redacted before it is cut), metrics and report say that no step lines were seen,
and logs --failures diagnoses it as any job (fixture: a captured torchrun run of the example
raising on rank 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from _fixtures import fixture

from torchrig import tables
from torchrig.facts import job_state, probe
from torchrig.launch import status
from torchrig.progress import DOC, no_steps
from torchrig.secrets import Redactor
from torchrig.session import Result

REPO = Path(__file__).resolve().parents[2]
UNIT = "torchrig-nosuchjob.service"
RUN = "plain-j_1a2b3c"


def f(text, first="", mtime=0.0):
    return {"first_line": first, "text": text, "mtime": mtime}


# ------------------------------------------------------------------ which line, which rank

def test_rank_zero_by_its_start_line_else_local_rank_zero_else_the_newest():
    files = {f"{RUN}/attempt_0/0/stdout.log": f("a0\nlast of local 0\n", "start rank=2 local_rank=0\n", 5),
             f"{RUN}/attempt_0/1/stdout.log": f("b\nglobal rank 0 here\n\n", "start rank=0 local_rank=1\n", 1)}
    assert job_state.last_line(files) == "global rank 0 here"  # trailing blank lines skipped
    files = {f"{RUN}/attempt_0/1/stdout.log": f("newer\n", mtime=9),
             f"{RUN}/attempt_0/0/stdout.log": f("epoch 3 done, loss 0.123\n", mtime=1)}
    assert job_state.last_line(files) == "epoch 3 done, loss 0.123"
    # rank 0 printed nothing (empty, unreadable: None): the newest line of any rank
    files = {f"{RUN}/attempt_0/0/stdout.log": f("  \n"), f"{RUN}/attempt_0/1/stdout.log": None,
             f"{RUN}/attempt_0/2/stdout.log": f("older\n", mtime=3),
             f"{RUN}/attempt_0/3/stdout.log": f("newest\n", mtime=7)}
    assert job_state.last_line(files) == "newest"
    assert job_state.last_line({}) is None
    assert job_state.last_line({f"{RUN}/attempt_0/0/stdout.log": f("\n\n")}) is None


def test_a_progress_bar_shows_its_last_drawing_and_the_line_is_bounded_and_sanitised():
    bar = "epoch 1:  10%|#         | 1/10\repoch 1:  50%|#####     | 5/10\r\n"
    assert job_state.last_line({"r/attempt_0/0/stdout.log": f(bar)}) == \
        "epoch 1:  50%|#####     | 5/10"
    hostile = "ok \x1b]8;;http://x\x07link\x1b[2J \u202eevil\n"
    got = job_state.last_line({"r/attempt_0/0/stdout.log": f(hostile)})
    assert "\x1b" not in got and "\x07" not in got and "\u202e" not in got
    assert got.startswith("ok \\x1b]8;;http://x\\x07link")
    long = "x" * 100000 + "\n"
    got = job_state.last_line({"r/attempt_0/0/stdout.log": f(long)})
    assert len(got) == job_state.LAST_LINE_MAX and got.endswith("…")
    # control characters grow when shown: still at most the bound
    got = job_state.last_line({"r/attempt_0/0/stdout.log": f("\x01" * 5000 + "\n")})
    assert len(got) == job_state.LAST_LINE_MAX


def test_the_last_line_is_shown_only_when_no_progress_line_was_seen():
    plain = {f"{RUN}/attempt_0/0/stdout.log": f("epoch 2 done, loss 0.5\n")}
    assert job_state._shown_progress(plain) == {"progress": None,
                                                "last_line": "epoch 2 done, loss 0.5"}
    steps = {f"{RUN}/attempt_0/0/stdout.log": f("step=3 loss=0.9\nsome noise\n",
                                                "start rank=0 local_rank=0\n")}
    assert job_state._shown_progress(steps) == {"progress": "step=3 loss=0.9", "last_line": None}


# ------------------------------------------------------------------ the real read on the node

def _status(logdir: Path) -> dict:
    req = job_state.probe_request(UNIT, str(logdir), str(logdir / "gpu_util.csv"), 1 << 16)
    r = subprocess.run([sys.executable, "-I", "-"], input=probe.stdin(req),
                       capture_output=True, text=True, timeout=60)
    return job_state.state(UNIT, probe.reply(r.returncode, r.stdout, r.stderr), 600)


def test_status_reads_the_last_line_through_the_probe_and_follows_no_symlink(tmp_path):
    """The same probe round trip status always made (the ranks' stdout.log tails, now with
    their mtime): a plain script's last line comes back; a stdout.log the job made a symlink
    to another file is not read (O_NOFOLLOW), so the other rank's line is shown."""
    attempt = tmp_path / "job" / RUN / "attempt_0"
    for r in ("0", "1"):
        (attempt / r).mkdir(parents=True)
    secret = tmp_path / "root-only"
    secret.write_text("root's secret line\n")
    (attempt / "0" / "stdout.log").symlink_to(secret)
    (attempt / "1" / "stdout.log").write_text("plain script: 2 ranks\nepoch 1 done, loss 0.731\n")
    d = _status(tmp_path / "job")
    assert d["progress"] is None and d["last_line"] == "epoch 1 done, loss 0.731"
    (attempt / "0" / "stdout.log").unlink()
    (attempt / "0" / "stdout.log").write_text("epoch 2 done, loss 0.5\n")
    old = time.time() - 100
    os.utime(attempt / "0" / "stdout.log", (old, old))  # older, but local rank 0: chosen
    assert _status(tmp_path / "job")["last_line"] == "epoch 2 done, loss 0.5"


# ------------------------------------------------------------------ redaction, cut, rendering

def test_status_redacts_the_line_before_cutting_it(monkeypatch):
    """A secret the 200-character cut would split is masked whole first (the cut runs on the
    redacted text): none of it reaches the table or --json."""
    secret = "hunter2-" + "s" * 40
    line = "x" * 180 + " token " + secret + " tail " + "y" * 100
    rnd = status.StatusRound("j", status.JobStatus("job j", [Result("gpu1", True, {
        "last_line": line, "progress": None, "gpus": []})]), {"failure": None, "waiting": {}})
    monkeypatch.setattr(status, "look", lambda *a, **k: rnd)
    got = next(status.watch(object(), "j", 0, Redactor([secret])))
    shown = got.nodes.results[0].value["last_line"]
    assert len(shown) == status.SHOWN_LINE and shown.endswith("…")
    assert "hunter2" not in shown and "sss" not in shown and "token *** tail" in shown


def _row(capsys, d):
    base = {"unit": {"ActiveState": "active", "SubState": "running"}, "attempt": 1,
            "uptime_s": 12, "restarts": 1, "gpus": [], "progress": None, "last_line": None}
    tables.status_table("j", [Result("gpu1", True, {**base, **d})])
    return capsys.readouterr().out


def test_status_table_with_and_without_steps(capsys):
    out = _row(capsys, {"last_line": "epoch 1 done, loss 0.123 [bold]x[/]"})
    assert "no step lines; last line:" in out and "epoch 1 done, loss 0.123" in out
    assert "[bold]" in out  # the job's text is not rich markup
    assert "active/running" in out
    out = _row(capsys, {"progress": "step=40 loss=2.5", "last_line": None})
    assert "step=40 loss=2.5" in out and "last line" not in out
    out = _row(capsys, {})  # nothing printed yet: nothing claimed
    assert "last line" not in out and "step=" not in out


# ------------------------------------------------------------------ metrics and report

def test_metrics_say_no_step_lines_were_seen(capsys):
    from torchrig import metrics as ops
    M = ops.defs
    text = M.render(M.job_samples("plain", "gpu1", 0, None, None, 2, "active", 1e9)
                    + M.job_samples("steps", "gpu1", 0, {"step": "4", "loss": "1.0"}, 1.0, 0,
                                    "active", 1e9))
    plain, steps = ops.views(M.parse(text))
    assert plain.note == no_steps(None) and DOC in plain.note and steps.note is None
    d = plain.as_dict()
    assert d["restarts"] == 2 and d["state"] == "active" and d["note"].startswith(
        "no step lines were seen")
    assert "note" not in steps.as_dict()
    tables.metrics_table("metrics", [Result("gpu1", True, [plain, steps])])
    out = capsys.readouterr().out
    assert out.count("no step lines were seen") == 1 and "gpu1 plain:" in out


def _plain_node():
    from _report_data import T0, glog, reply
    t = T0
    msgs = [(t + 1, "Started torchrig-j1.service - torchrig job j1"),
            (t + 2, "[default0]:epoch 1 done, loss 0.731"),
            (t + 8, glog(t + 8, "E", "failed (exitcode: 1) local_rank: 1 (pid: 1201) of binary: python")),
            (t + 9, "torchrig-j1.service: Main process exited, code=exited, status=1/FAILURE"),
            (t + 9, "torchrig-j1.service: Failed with result 'exit-code'.")]
    util = "\n".join(f"{int(t + 5 * i)},{50 + i}" for i in range(3))
    return reply(msgs, util, "", state="failed")


def test_report_of_a_plain_script_shows_gpus_restarts_failures_and_says_no_steps():
    from torchrig.jobreport import data, html
    from _report_data import T0
    rep = data.build("j1", "torchrig-j1.service", {"nodes": [("gpu1", _plain_node())]}, T0 + 100)
    assert rep.steps == [] and not rep.started()
    figs = [f["id"] for f in html.figures(rep)]
    assert figs == ["gpu-util", "events"]  # no empty loss or throughput chart
    assert rep.summary()["failures"] == 1 and rep.failures[0].global_rank == 1
    page = html.page(rep, "/*PLOTLYJS*/")
    assert "no step lines were seen (the script does not print torchrig progress lines; see " \
           f"{DOC})" in page
    assert "first failure: rank 1 on gpu1" in page
    # a torchrig script before its first step: "yet", not "does not print"
    assert no_steps(True).startswith("no step lines were seen yet (a script that")


# ------------------------------------------------------------------ logs --failures, unchanged

def test_failures_of_a_plain_script_that_raises_are_diagnosed_as_any_job():
    """torchrun's output of examples/plain_project/train.py --fail-at 3 (captured, see
    fixtures/INDEX.md): no start line, no error.json (no @record), yet the failed rank, its
    cause and its last lines (the traceback) come from torchrun's agent and the --tee lines."""
    from torchrig.logs import diagnose
    name = "torchrun_19_stdout_plain_script_raises_rank1_standalone.txt"
    nj = diagnose.node_from("gpu1", 0, {"journal": fixture(name), "year": 2026,
                                        "utc_offset": "+0000", "kernel": ""})
    found = diagnose.failures([nj], UNIT)
    assert [(x.global_rank, x.local_rank, x.cause) for x in found] == [(1, 1, "exited with code 1")]
    text = diagnose.report(found)
    assert text.startswith("first failure: [gpu1/r1] (local rank 1")
    assert "RuntimeError: plain script: failing at epoch 3 on purpose (--fail-at)" in text
