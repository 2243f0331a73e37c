"""The node's health watcher during a job (payload/healthwatch.py): what counts as new, the
decision, the record, its metric and the units launch renders for it. Pure parts only; the
testbed runs it for real (tests/integration/test_healthwatch.py)."""

import json
import os

from _fixtures import fixture

from torchrig.facts import xid
from torchrig.launch import plan
from torchrig.resources import payload_module

hw = payload_module("healthwatch")
metrics = payload_module("metrics")

START = 1_800_000_000.0  # the job's start (unix time)
GPUS = {"0": {"bus": "0000:3b:00", "ecc_uncorrected": 0, "remap_pending": False, "remap_failure": False},
        "1": {"bus": "0000:5e:00", "ecc_uncorrected": 2, "remap_pending": False, "remap_failure": False}}
APP = set(xid.app_xids())


def iso(t):
    from datetime import datetime, timezone
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S,000000+00:00")


def line(t, code, bus="0000:5e:00"):
    return f"{iso(t)} NVRM: Xid (PCI:{bus}): {code}, pid=0, text\n"


def judge(text, record=None, gpus=GPUS, launch="L1", since=START):
    lines = hw.xid_lines(text)
    unstamped = {hw._digest(x[3]) for x in lines if x[2] is None}
    return hw.judge(record, launch, since, lines, unstamped, gpus, APP, START + 100)


def test_the_application_xids_come_from_the_one_catalog():
    assert APP == {c for c, i in xid.CATALOG.items() if not i.node_fault}
    assert 79 not in APP and 13 in APP
    argv = plan.watcher_argv(plan_job())
    assert argv[argv.index("--app-xids") + 1] == ",".join(map(str, sorted(APP)))


def test_only_node_fault_xids_since_the_start_make_the_node_unhealthy():
    old = line(START - 60, 79)                     # before the job: not this job's fault
    assert judge(old)["healthy"] is True
    assert judge(old + line(START + 5, 13))["healthy"] is True  # the application's Xid
    r = judge(old + line(START + 5, 13) + line(START + 5, 79) + line(START + 6, 79))
    assert r["healthy"] is False and r["reason"] == "Xid 79 on GPU 1"
    assert [f["xid"] for f in r["findings"]] == [79]   # once per code and GPU
    assert judge(line(START + 5, 999))["reason"] == "Xid 999 on GPU 1"  # not in the catalog: a fault
    assert judge(line(START + 5, 79, "0000:99:00"))["reason"] == "Xid 79 on PCI 0000:99:00"


def test_unstamped_lines_count_when_they_were_not_there_at_the_start():
    text = fixture("xid_01_journal_xid79_fallen_off_bus_gist.txt")  # journal's short stamps
    first = judge(text)  # the first round of a launch: its start state
    assert first["healthy"] is True and len(first["unstamped"]) == 1
    again = hw.judge(first, "L1", START, hw.xid_lines(text), set(), GPUS, APP, START + 20)
    assert again["healthy"] is True
    later = text + "Sep 09 16:00:00 saturn kernel: NVRM: Xid (PCI:0000:10:00): 48, pid=0, DBE\n"
    r = hw.judge(first, "L1", START, hw.xid_lines(later), set(), GPUS, APP, START + 30)
    assert r["healthy"] is False and r["reason"] == "Xid 48 on PCI 0000:10:00"


def test_ecc_and_row_remaps_are_judged_against_the_start():
    first = judge("")
    worse = {"0": dict(GPUS["0"], remap_pending=True), "1": dict(GPUS["1"], ecc_uncorrected=5)}
    r = hw.judge(first, "L1", START, [], set(), worse, APP, START + 20)
    assert r["healthy"] is False
    assert [hw.reason(f) for f in r["findings"]] == [
        "row remap pending on GPU 0", "3 new uncorrectable ECC errors on GPU 1"]
    # what was already so at the start is not this job's news
    assert judge("", gpus=worse)["healthy"] is True


def test_a_verdict_stays_until_the_next_launch_starts_afresh():
    bad = judge(line(START + 5, 79))
    bad["stopped_at"] = START + 100
    again = hw.judge(bad, "L1", START, [], set(), GPUS, APP, START + 200)
    assert again["healthy"] is False and again["stopped_at"] == START + 100
    fresh = hw.judge(bad, "L2", START + 300, hw.xid_lines(line(START + 5, 79)), set(), GPUS, APP,
                     START + 310)
    assert fresh["healthy"] is True and fresh["launch"] == "L2" and fresh["stopped_at"] is None


def test_gpu_states_from_nvidia_smi_xml():
    got = hw.gpu_states(fixture("smiqx_01_1xRTX4070_laptop_driver575_cut.xml"))
    assert list(got) == ["0"] and got["0"]["bus"].count(":") == 2
    assert hw.gpu_states("") == {} and hw.gpu_states("<nope") == {}


def test_the_record_is_written_fresh_never_through_a_link(tmp_path):
    rec = tmp_path / "j.health"
    hw.write_record(str(rec), {"healthy": True})
    assert hw.read_record(str(rec)) == {"healthy": True} and oct(rec.stat().st_mode)[-3:] == "644"
    target = tmp_path / "elsewhere"
    target.write_text("x")
    os.unlink(rec)
    os.symlink(target, rec)
    assert hw.read_record(str(rec)) is None                    # a link is no record
    hw.write_record(str(rec), {"healthy": False})             # replaces the link itself
    assert target.read_text() == "x" and not rec.is_symlink()


def test_the_node_healthy_metric_has_a_short_sanitised_reason():
    ok = metrics.health_samples("j", "gpu1", json.dumps({"healthy": True}))
    assert ok == [("torchrig_node_healthy", {"job": "j", "node": "gpu1", "reason": ""}, 1.0)]
    bad = json.dumps({"healthy": False, "reason": 'Xid 79 on GPU 0"}\n' + "x" * 80})
    [(_, labels, v)] = metrics.health_samples("j", "gpu1", bad)
    assert v == 0.0 and labels["reason"].startswith("xid_79_on_gpu_0_x") and len(labels["reason"]) == 40
    assert metrics.health_samples("j", "gpu1", None) == metrics.health_samples("j", "gpu1", "{") == []
    assert "torchrig_node_healthy{" in metrics.render(metrics.health_samples("j", "n", bad))


def plan_job():
    node = plan.Node("gpu1", "10.0.0.1", 0, "/v", "torchrig", "/var/log/torchrig", "/c", "/d", 1,
                     None, metrics_dir="/var/lib/torchrig/metrics")
    return plan.Job("exp1", "train.py", [], 3, 29400, [node], "/opt/rel", launch_id="feed")


def test_launch_renders_a_root_watcher_beside_the_sampler():
    j = plan_job()
    service, timer = plan.render_health(j)
    assert "User=" not in service and "healthwatch.py" in service and '"--launch" "feed"' in service
    assert "/etc/torchrig/jobs/exp1.health" in service
    assert "BindsTo=torchrig-exp1.service" in timer
    assert "torchrig-health@exp1.timer" in plan.render_unit(j, j.nodes[0])
    argv = plan.sampler_argv(j, j.nodes[0])  # the sampler exports the watcher's verdict
    assert argv[argv.index("--health-record") + 1] == "/etc/torchrig/jobs/exp1.health"


def test_status_shows_the_unhealthy_node_with_the_catalogs_words(capsys):
    from _fixtures import FIXTURES
    from torchrig import tables
    from torchrig.facts import job_state
    from torchrig.session import Result
    rec = judge(line(START + 5, 79, "0000:3b:00"))
    rec["stopped_at"] = 1_800_000_061.0  # 08:01:01 UTC
    h = job_state.node_health(json.dumps(rec))
    assert h["healthy"] is False and h["stopped_at"] == rec["stopped_at"]
    assert h["reason"] == ("Xid 79 on GPU 0: GPU has fallen off the bus; "
                           "node's part stopped at 08:01:01 UTC")
    assert job_state.node_health(None) is None and job_state.node_health("[1]") is None
    cap = json.loads((FIXTURES / "probe_02_status_reply_testbed_running_job.json").read_text())
    raw = cap["reply"]
    raw["read"]["health"] = {"text": json.dumps(rec)}
    d = job_state.state(cap["unit"], raw, 1800)
    assert d["health"] == h
    tables.status_table("j", [Result("gpu1", True, {**d, "low_util": None})])
    out = capsys.readouterr().out
    assert "unhealthy" in next(ln for ln in out.splitlines() if ln.startswith("│ gpu1"))
    assert "gpu1: unhealthy: Xid 79 on GPU 0: GPU has fallen off the bus" in out
    req = job_state.probe_request("u", "/l", "/l/u.csv", 10, health_file="/etc/torchrig/jobs/j.health")
    assert req["read"]["health"]["path"] == "/etc/torchrig/jobs/j.health"


def test_metrics_shows_the_unhealthy_node(capsys):
    from torchrig import tables
    from torchrig import metrics as service
    from torchrig.session import Result
    rec = json.dumps({"healthy": False, "reason": "Xid 79 on GPU 0"})
    samples = metrics.health_samples("j", "gpu2", rec) + metrics.job_samples(
        "j", "gpu2", 0, None, None, 0, "failed", START)
    [v] = service.views(samples, "j")
    assert v.unhealthy == "xid_79_on_gpu_0" and v.as_dict()["healthy"] == 0.0
    tables.metrics_table("m", [Result("gpu2", True, [v])])
    assert "unhealthy (xid_79_on_gpu_0)" in capsys.readouterr().out
    [ok] = service.views(metrics.health_samples("j", "gpu1", json.dumps({"healthy": True})))
    assert ok.unhealthy is None and ok.values["healthy"] == 1.0


def test_status_fails_on_an_unhealthy_node_naming_why():
    from torchrig.launch.status import node_problems
    bad = {"unit": {"ActiveState": "failed"}, "health": {"healthy": False, "reason": "Xid 79 on GPU 0: x"}}
    assert node_problems("gpu4", bad) == ["gpu4: unhealthy: Xid 79 on GPU 0: x"]
    assert node_problems("gpu1", {"unit": {"ActiveState": "failed"}, "health": None}) == ["gpu1: unit failed"]
    assert node_problems("gpu1", {"unit": {"ActiveState": "active"}, "health": {"healthy": True}}) == []


def test_the_watcher_records_then_stops_the_unit_once(tmp_path):
    """main() with stand-in commands first on PATH: the first fault writes the record and
    stops the job's unit; later rounds keep the verdict and stop nothing again."""
    import subprocess
    import sys
    import time as _time
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "calls"
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    fakes = {"journalctl": "exit 1",
             "dmesg": f"cat {kmsg}",
             "nvidia-smi": "exit 9",
             "systemctl": f'echo "$*" >> {calls}; [ "$2" = "-p" ] && echo 0; exit 0'}
    for name, body in fakes.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    rec = tmp_path / "j.health"
    argv = [sys.executable, "-I", str(hw.__file__), "--job", "j", "--unit", "torchrig-j.service",
            "--launch", "L1", "--record", str(rec), "--app-xids", "13"]
    env = {"PATH": f"{bin_}:/usr/bin:/bin"}

    def round_():
        subprocess.run(argv, env=env, check=True, capture_output=True)
        return json.loads(rec.read_text())
    assert round_()["healthy"] is True
    kmsg.write_text(line(_time.time() + 1, 13) + line(_time.time() + 1, 79))
    got = round_()
    assert got["healthy"] is False and got["reason"] == "Xid 79 on PCI 0000:5e:00"
    assert got["stopped_at"] and got["kernel_log"] == "dmesg"
    round_()
    stops = [c for c in calls.read_text().splitlines() if c.startswith("stop")]
    assert stops == ["stop --no-block torchrig-j.service"]


def test_status_says_when_the_watch_reads_no_kernel_log():
    from torchrig.facts import job_state
    blind = job_state.node_health(json.dumps({"healthy": True, "kernel_log": None}))
    assert blind["healthy"] is True and "could not read the kernel log" in blind["note"]
    assert job_state.node_health(json.dumps({"healthy": True, "kernel_log": "dmesg"}))["note"] is None
