"""`torchrig report`'s pure parts: the journal filter, the probe replies -> data, data -> figures
-> HTML, verify's kept busbw sweeps, and the sampler script's two history files."""

import calendar
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchrig.errors import TorchrigError
from torchrig.facts import job_state
from torchrig.jobreport import data, gather, html
from torchrig.verify import store

from _report_data import T0, gathered, jline

PAYLOAD = Path(__file__).resolve().parents[2] / "payload"

REPO = Path(__file__).resolve().parents[2]


def build():
    return data.build("j1", "torchrig-j1.service", gathered(), T0 + 100)


def test_journal_filter_keeps_agent_and_progress_lines_only():
    # journalctl's PCRE2 and Python's re agree on this pattern (lookahead, alternation)
    keep = re.compile(gather.journal_pattern())
    kept = ["I1130 18:35:24.416000 3103 api.py:1000] Rendezvous complete for workers",
            "Started torchrig-j1.service - torchrig job j1",
            "  Root Cause (first observed failure):",
            "[default0]:step=40 loss=2.7 tok/s=100", "[default0]:start rank=0 local_rank=0",
            "[default12]:done step=30 loss=1.9", "[default1]:resume step=10 epoch=0",
            "[default0]:ckpt step=10 path=/c write_s=0.1", "[default0]:signal SIGTERM received"]
    dropped = ["[default0]:Traceback (most recent call last):", "[default1]:stepping=3",
               "[default0]:starting up", "[default0]:  loss=3", "[default0]:"]
    assert [ln for ln in kept if keep.search(ln)] == kept
    assert [ln for ln in dropped if keep.search(ln)] == []
    req = gather.request("torchrig-j1.service", "/var/log/torchrig/j1/gpu_util.csv",
                         "/var/log/torchrig/j1/gpu_mem.csv", "/opt/torchrig/venv")
    argv = req["run"]["journal"]["argv"]
    assert argv[argv.index("--grep") + 1] == gather.journal_pattern()
    assert "--case-sensitive=true" in argv and req["read"]["mem"]["path"].endswith("gpu_mem.csv")


def test_journal_lines_sorted_cut_at_the_last_start_and_bytes_decoded():
    out = "\n".join([jline(T0 + 3, 5, "third"), jline(T0 + 2, 4, [104, 105, 255]),
                     jline(T0 + 2, 3, "Started torchrig-j1.service"), jline(T0 + 1, 2, "old run"),
                     "not json", jline(T0, 1, "Started torchrig-j1.service")])
    assert data.journal_lines(out) == [(T0 + 2, "Started torchrig-j1.service"),
                                       (T0 + 2, "hi\ufffd"), (T0 + 3, "third")]


def test_history_skips_what_a_job_could_have_written_badly():
    text = "10,50,60\nnan,1,2\n11,inf,3\n12,70\ngarbage\n13,1e400,5\n14,80,90\n"
    h = data.history(text, 1)
    assert h == {0: [(10.0, 50.0), (12.0, 70.0), (14.0, 80.0)],
                 1: [(10.0, 60.0), (11.0, 3.0), (13.0, 5.0), (14.0, 90.0)]}
    assert data.history("10,1000,32768,5,32768\n11,1,2,3\n", 2) == {
        0: [(10.0, 1000.0, 32768.0)], 1: [(10.0, 5.0, 32768.0)]}


def test_progress_rows_split_by_attempt_with_global_rank():
    rows = build().steps
    assert [(r["attempt"], r["step"]) for r in rows] == \
        [(0, 5), (0, 10), (0, 15), (0, 20), (1, 15), (1, 20), (1, 25), (1, 30), (1, 30)]
    assert {r["rank"] for r in rows} == {0}
    assert rows[0]["loss"] == 3.0 and rows[0]["tok/s"] == 1000.0 and rows[0]["t"] == T0 + 3
    assert rows[-1]["kind"] == "done" and rows[-1]["loss"] == 1.9


def test_build_events_failures_and_missing_nodes():
    rep = build()
    assert [n.host for n in rep.nodes] == ["gpu1", "gpu2"]
    assert rep.missing == {"gpu3": "no such job on this host"}
    assert rep.unreadable == {"gpu4": "SSH connection lost"}
    kinds = [(e.kind, e.host) for e in rep.events]
    assert kinds.count(("start", "gpu1")) == 1 and kinds.count(("end", "gpu1")) == 1
    fail = [e for e in rep.events if e.kind == "failure"]
    assert len(fail) == 1 and fail[0].t == T0 + 8 and "killed by SIGKILL" in fail[0].text
    assert "rank 1 (local 1, pid 1201)" in fail[0].text
    restart = [e for e in rep.events if e.kind == "restart"]
    assert len(restart) == 1 and restart[0].t == T0 + 9 and "2/3 attempts left" in restart[0].text
    assert rep.failures[0].host == "gpu1" and rep.failures[0].global_rank == 1
    assert rep.nodes[0].gpu_util[1][-1] == (T0 + 15, 63.0)
    assert rep.nodes[0].gpu_mem[1][0] == (T0, 2000.0, 32768.0)
    assert rep.nodes[1].gpu_mem == {}  # no memory file (an older sampler): no memory series
    assert set(rep.bandwidth) == {"gpu1"}
    s = rep.summary()
    assert s == {"steps": 30.0, "first_loss": 3.0, "last_loss": 1.9, "median_tok_s": 903.0,
                 "restarts": 1, "failures": 1, "running": False, "seconds": 16.0}


def test_figures_each_have_data_and_busbw_only_with_a_sweep():
    rep = build()
    figs = {f["id"]: f for f in html.figures(rep)}
    assert list(figs) == ["loss", "throughput", "gpu-util", "gpu-mem", "events", "busbw"]
    assert [t["name"] for t in figs["loss"]["data"]] == ["first run", "after restart 1"]
    assert html.points(figs["loss"]) == 9
    assert html.points(figs["gpu-util"]) == 4 * 2 + 1 + 3 * 2  # gpu1 GPU1 has the inf line's 3
    assert [t["name"] for t in figs["gpu-mem"]["data"]] == ["gpu1 GPU0", "gpu1 GPU1"]
    assert len(figs["gpu-util"]["layout"]["shapes"]) == 2  # the failure and the restart
    assert [t["name"] for t in figs["busbw"]["data"]] == ["gpu1 (in node, 2 ranks)", "across gpu1,gpu2"]
    assert figs["busbw"]["layout"]["xaxis"]["type"] == "log"
    rep.bandwidth = {}
    assert "busbw" not in {f["id"] for f in html.figures(rep)}


def test_figures_are_valid_plotly():
    go = pytest.importorskip("plotly.graph_objects")
    for f in html.figures(build()):
        go.Figure({"data": f["data"], "layout": f["layout"]})  # raises on a bad property


def test_page_is_self_contained_and_escapes_what_nodes_wrote():
    rep = build()
    rep.events[0].text = "</script><script>alert(1)</script>"
    rep.missing["gpu9"] = "<b>bold</b> & more"
    page = html.page(rep, "/*PLOTLYJS*/")
    assert page.count("<script>") == 2 and page.count("</script>") == 2
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; more" in page
    assert "\\u0026lt;/script\\u0026gt;" in page  # HTML-escaped for plotly, then JSON
    assert not re.search(r"""(src|href)=["']?https?:""", page)
    ids = re.findall(r'<div class="plot" id="([^"]+)" data-points="(\d+)"', page)
    assert [i for i, _ in ids] == ["loss", "throughput", "gpu-util", "gpu-mem", "events", "busbw"]
    assert all(int(n) > 0 for _, n in ids)
    assert "first failure: rank 1 on gpu1" in page and "3.0000 -&gt; 1.9000" in page


def test_missing_plotly_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "plotly.offline", None)
    with pytest.raises(TorchrigError, match=r"'report' extra: pip install 'torchrig\[report\]'"):
        html.plotly_js()


class _Check:
    def __init__(self, status):
        self.status = status


def test_store_keeps_each_hosts_sweep_with_its_address(tmp_path):
    result = {"world_size": 2, "rows": [{"bytes": 16777216, "time_us": 40000.0},
                                        {"bytes": 1048576, "time_us": 4000.0},
                                        {"bytes": 2048, "time_us": 0}]}
    bw = [{"scope": "node", "hosts": ["gpu1"], "check": _Check("PASS"), "result": result},
          {"scope": "node", "hosts": ["gpu2"], "check": _Check("NOT RUN"), "result": None},
          {"scope": "node-nccl-tests", "hosts": ["gpu1"], "check": _Check("PASS")},
          {"scope": "cluster", "hosts": ["gpu1", "gpu2"], "check": _Check("PASS"),
           "result": {**result, "world_size": 4}}]
    written = store.save(bw, {"gpu1": "10.0.0.1", "gpu2": "10.0.0.2"}, tmp_path)
    assert sorted(p.name for p in written) == ["gpu1.json", "gpu2.json"]
    for p in written:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    rec = json.loads((tmp_path / "bandwidth" / "gpu1.json").read_text())
    # busbw = bytes / time x 2(n-1)/n, recomputed; sorted by size; a zero time left out
    assert rec["node"]["points"] == [[1048576.0, 0.262144], [16777216.0, 0.41943]]
    assert rec["cluster"]["points"][1] == [16777216.0, round(16777216 / 0.04 / 1e9 * 1.5, 6)]
    assert "node" not in json.loads((tmp_path / "bandwidth" / "gpu2.json").read_text())

    class H:
        def __init__(self, name, address):
            self.name, self.address = name, address
    got = store.load([H("gpu1", "10.0.0.1"), H("gpu2", "192.168.0.9"), H("gpu3", "x")], tmp_path)
    assert list(got) == ["gpu1"]  # gpu2's record is of another machine; gpu3 has none


def test_store_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHRIG_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert store.state_dir() == tmp_path / "torchrig"
    monkeypatch.setenv("TORCHRIG_STATE_DIR", str(tmp_path / "s"))
    assert store.state_dir() == tmp_path / "s"


def test_sampler_writes_status_line_and_memory_history(tmp_path):
    """The sampler (payload/gpumon.py, with launch's argv) with a stand-in nvidia-smi: status's
    file keeps its format, the report's file gets used and total MiB per GPU, from one call."""
    (tmp_path / "bin").mkdir()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/calls"\n'
                   'printf "0, 45, 1234, 32768, 41, 120.5, 0, 0, 0x0\\n1, 7, 10, 32768, 39, 80.0, 0, 0, 0x0\\n"\n')
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    (tmp_path / "logs").mkdir()
    for _ in range(2):
        subprocess.run(["python3", "-I", str(PAYLOAD / "gpumon.py"), "--job", "j", "--node", "n",
                        "--unit", "torchrig-j.service", "--logdir", str(tmp_path / "logs"),
                        "--util-file", str(tmp_path / "u.csv"),
                        "--mem-file", str(tmp_path / "m.csv")], env=env, check=True)
    assert len((tmp_path / "bin" / "calls").read_text().splitlines()) == 2
    util = (tmp_path / "u.csv").read_text()
    t = float(util.split(",")[0])
    assert [u for _, u in job_state.util_samples(util, t, 600)] == [[45.0, 7.0], [45.0, 7.0]]
    mem = data.history((tmp_path / "m.csv").read_text(), 2)
    assert {g: [(used, total) for _, used, total in v] for g, v in mem.items()} == \
        {0: [(1234.0, 32768.0)] * 2, 1: [(10.0, 32768.0)] * 2}
    assert mem[0][0][0] == t  # both lines of a sample carry its one time


def test_report_task_refuses_a_bad_job_name(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("hosts:\n  - name: gpu1\n    address: 127.0.0.1\n")
    r = subprocess.run([sys.executable, "-m", "invoke", "report", "-i", str(inv), "--job", "Bad name"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("error: --job 'Bad name'"), r.stderr
    assert "Traceback" not in r.stderr


def test_real_capture_from_the_testbed():
    """A killed rank on the testbed (fixture report_01): what the report reads from real
    journalctl, sampler and verify output."""
    from _fixtures import FIXTURES
    g = json.loads((FIXTURES / "report_01_probe_replies_testbed_killed_rank_2nodes.json").read_text())
    rep = data.build("t-rep", "torchrig-t-rep.service", g, T0)
    assert [n.host for n in rep.nodes] == ["gpu1", "gpu2"] and not rep.missing and not rep.unreadable
    steps = [(r["attempt"], int(r["step"])) for r in rep.steps]
    assert steps[:2] == [(0, 5), (0, 10)] and steps[-1] == (1, 129)
    assert [s for a, s in steps if a == 0] == list(range(5, 125, 5))
    kinds = sorted((e.kind, e.host) for e in rep.events)
    assert kinds == sorted([(k, h) for k in ("start", "restart", "failure", "end") for h in ("gpu1", "gpu2")])
    first = rep.failures[0]
    assert (first.host, first.global_rank, first.cause) == ("gpu2", 2, "killed by SIGKILL")
    assert [e.text for e in rep.events if e.kind == "failure"][0].endswith("killed by SIGKILL")
    assert all(len(v) == 3 for n in rep.nodes for v in [*n.gpu_util.values(), *n.gpu_mem.values()])
    assert {f["id"]: html.points(f) for f in html.figures(rep)} == {
        "loss": 27, "throughput": 26, "gpu-util": 12, "gpu-mem": 12, "events": 8, "busbw": 15}


def test_report_of_a_job_no_host_has_writes_nothing(tmp_path):
    """The whole path on a `connection: local` host (the probe runs for real here): no host
    has the job, so one error line and no file."""
    inv = tmp_path / "inv.yml"
    inv.write_text("hosts:\n  - name: here\n    connection: local\n")
    r = subprocess.run([sys.executable, "-m", "invoke", "report", "-i", str(inv), "--job", "j1",
                        "--out", str(tmp_path / "out")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    # as root: no such unit here; as another user: sudo refuses (either way, one line)
    assert r.returncode == 1 and r.stderr.startswith(
        "error: job j1: no selected host could be read with it (here: ") and \
        r.stderr.endswith("); nothing written\n") and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "out").exists()


# ---- a running job, what was run, restarts as status counts them ------------------------------

EXEC_START = ("ExecStart={ path=/opt/torchrig/venv/bin/python ; argv[]=/opt/torchrig/venv/bin/python "
              "-m torchrig_torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --log-dir "
              "/var/log/torchrig/j1 --redirects 3 --tee 3 train.py --max-steps 100 --lr 0.01 ; "
              "ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; "
              "status=0/0 }\n")


def _running(restart_lines: int = 0, nrestarts: int = 0) -> dict:
    from _report_data import glog, reply
    msgs = [(T0 + 1, "Started torchrig-j1.service - torchrig job j1"),
            (T0 + 2, "[default0]:start rank=0 local_rank=0 host=gpu1 world_size=4 backend=gloo")]
    msgs += [(T0 + 5 + i, glog(T0 + 5 + i, "W", "[default] Worker group FAILED. 2/3 attempts left; "
                                                "will restart worker group"))
             for i in range(restart_lines)]
    ok = lambda out: {"rc": 0, "out": out, "err": ""}  # noqa: E731
    return reply(msgs, state="active", props=f"NRestarts={nrestarts}\n" + EXEC_START,
                 torch=ok("2.13.0\n"), driver=ok("550.54.15\n550.54.15\n"))


def test_a_running_job_spans_until_now_and_its_axis_is_not_milliseconds_wide():
    """Only a start event so far: the report said "ran ?" and plotly drew the events axis
    around that one point, 2 ms wide."""
    rep = data.build("j1", "torchrig-j1.service", {"nodes": [("gpu1", _running())]}, T0 + 600)
    s = rep.summary()
    assert s["running"] and s["seconds"] == 599.0
    events = next(f for f in html.figures(rep) if f["id"] == "events")
    lo, hi = (calendar.timegm(time.strptime(x[:19], "%Y-%m-%d %H:%M:%S"))
              for x in events["layout"]["xaxis"]["range"])
    assert lo <= T0 + 1 and hi >= T0 + 600 and hi - lo >= 599
    page = html.page(rep, "")
    assert "<th>running for</th><td>599 s</td>" in page and "<th>ran</th>" not in page


def test_the_page_states_what_was_run():
    rep = data.build("j1", "torchrig-j1.service",
                     {"nodes": [("gpu1", _running()), ("gpu2", _running())]}, T0 + 60)
    assert rep.command() == {"script": "train.py", "args": ["--max-steps", "100", "--lr", "0.01"],
                             "nodes": ["gpu1", "gpu2"], "world_size": "4", "backend": "gloo",
                             "torch": "2.13.0", "driver": "550.54.15"}
    page = html.page(rep, "")
    assert "<th>script</th><td>train.py --max-steps 100 --lr 0.01</td>" in page
    assert "4 rank(s), backend gloo" in page and "torch 2.13.0; driver 550.54.15" in page


def test_restarts_are_counted_as_status_counts_them():
    """One definition (payload/metrics.py restarts(), through job_state.restarts()): torchrun's
    restarts in the newest run plus systemd's of the agent, per node; the job's is the most of
    any node, not the sum of every node's agent saying the same restart."""
    from torchrig.facts.job_state import restarts
    from torchrig.metrics import defs
    assert restarts({"NRestarts": "1"}, 2) == defs.restarts(1, 2) == 3
    assert restarts({}, None) is None and restarts({"NRestarts": "x"}, 1) == 1
    rep = data.build("j1", "torchrig-j1.service",
                     {"nodes": [("gpu1", _running(1, nrestarts=1)), ("gpu2", _running(1))]}, T0 + 60)
    assert [n.restarts for n in rep.nodes] == [restarts({"NRestarts": "1"}, 1), 1] == [2, 1]
    assert rep.summary()["restarts"] == 2
    assert "restarts per node: gpu1 2, gpu2 1" in html.page(rep, "")


def test_a_journal_the_node_cut_is_said_on_the_page_and_its_request_is_capped():
    g = gathered()
    host, reply = g["nodes"][0]
    reply["run"]["journal"]["cut"] = {"lines": 7, "max_line": 16384, "max_bytes": 1 << 26}
    rep = data.build("j1", "torchrig-j1.service", g, T0 + 100)
    assert rep.cut == {host: "the journal was cut on the node: 7 line(s) longer than 16384 "
                             "bytes cut"}
    assert rep.steps  # what was not cut is still read
    assert f"{host}: the journal was cut on the node: 7 line(s)" in html.page(rep, "")
    req = gather.request("torchrig-j1.service", "/u", "/m", "/v")["run"]["journal"]
    assert (req["max_line"], req["max_bytes"]) == (gather.JOURNAL_MAX_LINE, gather.JOURNAL_MAX_BYTES)


def _elastic() -> dict:
    """An elastic job: 4 ranks on gpu1+gpu2, gpu1 lost at step 5 (2 ranks on gpu2), back at
    step 9. Rank 0 prints the world lines on whichever node it runs."""
    from _report_data import reply
    t = T0
    w = "world step={} world_size={} nodes={} global_batch=16 micro_batch=2 grad_accum={}"
    gpu1 = [(t + 1, "Started torchrig-j1.service - torchrig job j1"),
            (t + 2, "[default0]:" + w.format(0, 4, 2, 2)),
            (t + 3, "[default0]:step=5 loss=2.5 epoch=0"),
            (t + 30, "[default0]:" + w.format(9, 4, 2, 2) + " from=2"),
            (t + 31, "[default0]:world step=x world_size=4"),  # not a whole world line: left out
            (t + 32, "[default0]:done step=12 loss=1.5 ckpt=/c/ckpt_00000012.pt")]
    gpu2 = [(t + 1, "Started torchrig-j1.service - torchrig job j1"),
            (t + 10, "[default0]:" + w.format(5, 2, 1, 4) + " from=4")]
    return {"nodes": [("gpu1", reply(gpu1)), ("gpu2", reply(gpu2))], "bandwidth": {}}


def test_world_size_over_time():
    rep = data.build("j1", "torchrig-j1.service", _elastic(), T0 + 100)
    assert [(r["t"] - T0, r["step"], r["world_size"], r.get("from")) for r in rep.world] == \
        [(2, 0, 4, None), (10, 5, 2, 4), (30, 9, 4, 2)]
    assert rep.world[1]["grad_accum"] == 4 and rep.world[1]["global_batch"] == 16
    fig = next(f for f in html.figures(rep) if f["id"] == "world")
    assert fig["data"][0]["y"] == [4, 2, 4] and fig["data"][0]["line"] == {"shape": "hv"}
    assert fig["layout"]["xaxis"]["type"] == "date"
    assert "from step 5: 1 node(s), global batch 16 = 2 x 2 x 4" in fig["data"][0]["text"]
    page = html.page(rep, "/*PLOTLYJS*/")
    assert "4 (step 0) -&gt; 2 (step 5) -&gt; 4 (step 9); global batch 16" in page
    assert re.search(r'<div class="plot" id="world" data-points="3">', page)
    assert "world" not in {f["id"] for f in html.figures(build())}  # no world lines: no figure
    go = pytest.importorskip("plotly.graph_objects")
    go.Figure({"data": fig["data"], "layout": fig["layout"]})  # raises on a bad property
