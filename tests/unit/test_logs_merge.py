"""merge.py: record parsing, offsets across reconnects, global ranks learned per file,
prefixes, filters and the first failure."""

from __future__ import annotations

import json

import pytest

from torchrig.logs.merge import (ErrorReport, Heartbeat, Line, LineFilter, PathInfo, Skipped,
                                 Tracker, Truncated, filter_lines, first_failure,
                                 parse_error_json, parse_path, prefix)

R = "job-1_abc123"


def rec(kind, rel, off, text=None):
    return "\t".join([kind, rel, str(off)] + ([] if text is None else [text])) + "\n"


def out(a=0, l=0, run=R):
    return f"{run}/attempt_{a}/{l}/stdout.log"


def err(a=0, l=0, run=R):
    return f"{run}/attempt_{a}/{l}/stderr.log"


def start_line(g, l):
    return f"start rank={g} local_rank={l} host=gpu2 device=cuda:{l} (NVIDIA H100) world_size=16 backend=nccl pid=1"


def test_parse_path():
    assert parse_path("job-1_abc/attempt_12/3/stderr.log") == PathInfo("job-1_abc", 12, 3, "stderr")
    assert parse_path(f"{R}/attempt_0/0/error.json") == PathInfo(R, 0, 0, "error")
    assert parse_path(out()).stream == "stdout"
    for bad in ["x/attempt_0/0/other.log", "x/attempt_a/0/stdout.log", "x/att_0/0/stdout.log",
                "x/attempt_0/zero/stdout.log", "attempt_0/0/stdout.log", "/attempt_0/0/stdout.log",
                "a/x/attempt_0/0/stdout.log"]:
        with pytest.raises(ValueError):
            parse_path(bad)


def test_global_rank_learned_per_file_and_prefixes():
    t = Tracker()
    # rank with local rank 1: a stderr warning before its start line is unknown -> l1
    (w,) = t.feed("gpu2", rec("L", err(l=1), 20, "UserWarning: something"))
    assert w.global_rank is None and prefix(w) == "[gpu2/l1!]"
    (s,) = t.feed("gpu2", rec("L", out(l=1), 90, start_line(9, 1)))
    assert s == Line("gpu2", R, 0, 1, 9, "stdout", start_line(9, 1))
    assert prefix(s) == "[gpu2/r9]"
    (e,) = t.feed("gpu2", rec("L", err(l=1), 40, "more"))
    assert prefix(e) == "[gpu2/r9!]"
    # local rank 0 is a different file: still unknown
    (x,) = t.feed("gpu2", rec("L", out(l=0), 5, "step=1"))
    assert prefix(x) == "[gpu2/l0]"
    # attempt 1 (restart): the same local rank may get another global rank
    (a,) = t.feed("gpu2", rec("L", out(a=1, l=1), 90, start_line(3, 1)))
    (b,) = t.feed("gpu2", rec("L", err(a=1, l=1), 4, "boom"))
    assert (prefix(a), prefix(b)) == ("[gpu2/r3 a1]", "[gpu2/r3 a1!]")
    # a new run folder (torchrun restarted by systemd): learned again, attempt 0 again
    (c,) = t.feed("gpu2", rec("L", out(l=1, run="job-1_zzz"), 1, "no start line yet"))
    assert prefix(c) == "[gpu2/l1]"
    # the same relpaths on another node are another rank
    (o,) = t.feed("gpu5", rec("L", err(l=1), 20, "x"))
    assert prefix(o) == "[gpu5/l1!]"
    assert t.global_rank("gpu2", R, 0, 1) == 9 and t.global_rank("gpu2", R, 1, 1) == 3


def test_start_line_must_match_the_file_local_rank_and_start_the_line():
    t = Tracker()
    t.feed("n", rec("L", out(l=2), 50, start_line(7, 3)))           # local_rank mismatch
    t.feed("n", rec("L", out(l=2), 90, "echo: " + start_line(7, 2)))  # not at the start
    assert t.global_rank("n", R, 0, 2) is None
    t.feed("n", rec("L", out(l=2), 140, "[default2]:" + start_line(7, 2)))
    assert t.global_rank("n", R, 0, 2) == 7
    # learned once: a later start-like line does not change it
    t.feed("n", rec("L", out(l=2), 190, start_line(8, 2)))
    assert t.global_rank("n", R, 0, 2) == 7


def test_offsets_dedup_and_truncation():
    t = Tracker()
    assert t.feed("n", rec("L", out(), 10, "a")) != []
    assert t.feed("n", rec("L", out(), 20, "b")) != []
    assert t.offsets_for("n") == {out(): [20, None]} and t.offsets_for("other") == {}
    # a replay after reconnect: at or before the known offset -> dropped
    assert t.feed("n", rec("L", out(), 10, "a")) == []
    assert t.feed("n", rec("L", out(), 20, "b")) == []
    assert [l.text for l in t.feed("n", rec("L", out(), 25, "c"))] == ["c"]
    # offsets_for is a copy
    t.offsets_for("n")[out()] = 0
    assert t.offsets_for("n") == {out(): [25, None]}
    # truncation: back to 0, and the rank is learned again
    t.feed("n", rec("L", out(l=1), 90, start_line(4, 1)))
    assert t.feed("n", rec("T", out(l=1), 0)) == [Truncated("n", out(l=1), lines=1)]
    assert t.feed("n", rec("T", out(l=1), 0)) == [Truncated("n", out(l=1), lines=0)]
    assert t.offsets_for("n")[out(l=1)] == [0, None] and t.global_rank("n", R, 0, 1) is None
    (l,) = t.feed("n", rec("L", out(l=1), 5, "new"))
    assert l.text == "new" and l.global_rank is None


def test_feed_heartbeats_tabs_and_malformed():
    t = Tracker()
    assert t.feed("n", "H\t1700000000.5\n") == [Heartbeat("n", 1700000000.5)]
    (l,) = t.feed("n", rec("L", out(), 9, "a\tb\tc"))
    assert l.text == "a\tb\tc"
    (empty,) = t.feed("n", rec("L", out(), 10, ""))
    assert empty.text == ""
    for bad in ["garbage", "L\tnot/a/path\t3\tx", "L\t" + out() + "\tNaN\tx", "Q\tx", "H\tsoon"]:
        assert t.feed("n", bad) == []
    assert len(t.malformed) == 5
    assert t.feed("n", "") == [] and t.feed("n", "\n") == []


def err_doc(msg, ts, tb="Traceback (most recent call last):\n  File \"train.py\", line 1\n"):
    return {"message": {"message": msg, "extraInfo": {"py_callstack": tb, "timestamp": ts}}}


def test_error_report_and_first_failure():
    t = Tracker()
    t.feed("gpu1", rec("L", out(l=0), 90, start_line(0, 0)))
    t.feed("gpu2", rec("L", out(l=1), 90, start_line(9, 1)))
    reps = []
    for node, l, ts, msg in [("gpu1", 0, "1700000050", "RuntimeError: NCCL timeout"),
                             ("gpu2", 1, "1700000007", "RuntimeError: CUDA out of memory"),
                             ("gpu2", 0, "1700000030", "ValueError: later")]:
        rel = f"{R}/attempt_0/{l}/error.json"
        reps += t.feed(node, rec("E", rel, 300, json.dumps(err_doc(msg, ts))))
    assert all(isinstance(r, ErrorReport) for r in reps) and len(reps) == 3
    # once: the same record again (reconnect) is dropped
    assert t.feed("gpu2", rec("E", f"{R}/attempt_0/1/error.json", 300, "{}")) == []
    f = first_failure(reps)
    assert (f.node, f.run, f.attempt, f.local_rank, f.global_rank) == ("gpu2", R, 0, 1, 9)
    assert f.message == "RuntimeError: CUDA out of memory"
    assert f.traceback.startswith("Traceback") and f.timestamp == 1700000007.0
    assert prefix(f) == "[gpu2/r9]"
    # order of arrival does not matter
    assert first_failure(reversed(reps)) is f
    assert first_failure([]) is None


def test_first_failure_without_timestamps_and_late_rank():
    t = Tracker()
    no_ts = t.feed("a", rec("E", f"{R}/attempt_0/0/error.json", 10, json.dumps({"message": "x"})))[0]
    late = t.feed("b", rec("E", f"{R}/attempt_2/3/error.json", 10,
                           json.dumps(err_doc("RuntimeError: y", 1700000100))))[0]
    assert late.global_rank is None
    assert first_failure([no_ts, late]) is late
    # the rank's start line arrives after its error.json: filled in from the tracker
    t.feed("b", rec("L", out(a=2, l=3), 90, start_line(11, 3)))
    f = first_failure([no_ts, late], t)
    assert f.global_rank == 11 and f.attempt == 2 and f.message == "RuntimeError: y"


@pytest.mark.parametrize("doc, expect", [
    (err_doc("RuntimeError: a", "1700000000", "TB"), ("RuntimeError: a", "TB", 1700000000.0)),
    ({"message": "plain", "extraInfo": {"timestamp": 17, "py_callstack": "T"}}, ("plain", "T", 17.0)),
    ({"message": {"message": "m", "extra_info": {"timestamp": "2023-11-14T22:13:20Z"}}},
     ("m", "", 1700000000.0)),
    ({"message": {"message": "m", "extraInfo": {"timestamp": "soon"}}}, ("m", "", None)),
    ({"torchrig_unparsed": '{"message": tru\n'}, ('{"message": tru', "", None)),
    ({}, ("", "", None)),
    ([1, 2], ("[1, 2]", "", None)),
])
def test_parse_error_json_variants(doc, expect):
    assert parse_error_json(doc) == expect


def test_filters():
    t = Tracker()
    evs = []
    evs += t.feed("g1", rec("L", out(l=0), 90, start_line(0, 0)))
    evs += t.feed("g1", rec("L", out(l=0), 100, "step=10 loss=2.0"))
    evs += t.feed("g1", rec("L", err(l=1), 100, "NCCL WARN on local 1, global unknown"))
    evs += t.feed("g2", rec("L", out(l=0), 90, start_line(8, 0)))
    evs += t.feed("g2", rec("L", out(l=0), 100, "step=10 loss=2.1"))
    evs += [Heartbeat("g2", 1.0)]
    assert [l.text for l in filter_lines(evs, rank=8)] == [start_line(8, 0), "step=10 loss=2.1"]
    assert [l.node for l in filter_lines(evs, pattern=r"loss=2\.\d")] == ["g1", "g2"]
    assert [l.text for l in filter_lines(evs, pattern="NCCL", rank=1)] == []  # rank unknown
    assert len(filter_lines(evs, stream="stderr")) == 1
    assert len(filter_lines(evs, node="g1")) == 3 and len(filter_lines(evs)) == 5
    assert LineFilter(rank=0)(evs[0]) and not LineFilter(rank=0)(evs[3])



@pytest.mark.parametrize("ts", ["1e20", 1e20, "nan", float("nan"), "inf", -5])
def test_error_json_timestamp_out_of_range_is_unknown(ts):
    """time.localtime(1e20) raises and nan sorts nowhere: such a timestamp aborted `logs
    --failures` and launch --follow's failure report. It now reads as missing."""
    from torchrig.logs.stream import failure_report
    doc = {"message": {"message": "boom", "extraInfo": {"py_callstack": "tb", "timestamp": ts}}}
    message, tb, when = parse_error_json(doc)
    assert when is None
    err = ErrorReport(node="gpu1", run="r_x", attempt=0, local_rank=0, global_rank=0,
                      message=message, traceback=tb, timestamp=when, relpath="r_x/attempt_0/0/error.json")
    assert "first failure" in failure_report([err])


def test_identity_travels_with_the_offset_and_refusals_become_events():
    t = Tracker()
    assert t.feed("n", f"I\t{out()}\t123:40:abcdef0123456789\n") == []
    t.feed("n", rec("L", out(), 40, start_line(2, 0)))
    assert t.offsets_for("n") == {out(): [40, "123:40:abcdef0123456789"]}
    # replaced: offset and identity start over, the next I record is the new file's
    t.feed("n", rec("T", out(), 0))
    assert t.offsets_for("n") == {out(): [0, None]}
    t.feed("n", f"I\t{out()}\t124:9:0000000000000000\n")
    assert t.offsets_for("n")[out()] == [0, "124:9:0000000000000000"]
    assert t.feed("n", f"W\t{R}/attempt_0/1/stdout.log\ta FIFO, not read\n") == [
        Skipped("n", f"{R}/attempt_0/1/stdout.log", "a FIFO, not read")]
    assert t.feed("n", "I\tnot/a/path\tx\n") == [] and t.malformed[-1] == ("n", "I\tnot/a/path\tx")
    with pytest.raises(ValueError):
        parse_path(f"{R}/attempt_0/\u00b2/stdout.log")  # isdigit(), but not a rank
