"""Round trips per node, counted (tests/unit/_fake_connector.py, a test double of the
Connector): `status` is one probe per node, and so is every `--watch` round, whose reply
stays the same size while the job's journal, logs and GPU-use file grow; `launch` of 2 nodes
with nothing to push is a fixed number per node. A change that adds a round trip, or makes a
round re-read what an earlier one read, fails here without any timing."""

import os
import subprocess
import sys
import time

from _fake_connector import fake_fleet, per_host, probe_request

from torchrig import inventory
from torchrig.launch import run, service, status

JOURNAL_STAND_IN = '''import sys
lines = open(sys.argv[0] + ".txt").read().splitlines()
args = sys.argv[1:]
if "-k" in args:
    sys.exit(0)
if "--after-cursor" in args:
    new = lines[int(args[args.index("--after-cursor") + 1]):]
else:
    new = lines[-int(args[args.index("-n") + 1]):]
print("\\n".join(new + ["-- cursor: %d" % len(lines)]))
'''


def _inv(tmp_path):
    p = tmp_path / "inv.yml"
    p.write_text(f"vars: {{log_dir: {tmp_path / 'logs'}, accelerator: cpu}}\nhosts:\n"
                 "  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n")
    return inventory.load(p)


class Job:
    """A job's files on "the node" (this machine; both hosts read them): a journal behind a
    stand-in journalctl, two ranks' stdout.log and the GPU-use file, each big already."""

    def __init__(self, tmp_path):
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        (self.bin / "journalctl").write_text(f"#!{sys.executable}\n" + JOURNAL_STAND_IN)
        (self.bin / "systemctl").write_text("#!/bin/sh\nprintf 'ActiveState=active\\nLoadState=loaded\\n'\n")
        for f in self.bin.iterdir():
            f.chmod(0o755)
        self.journal = self.bin / "journalctl.txt"
        self.journal.write_text("Started torchrig-j1.service\n" + "".join(
            f"agent: line {i} {'z' * 60}\n" for i in range(50000)))
        d = tmp_path / "logs" / "j1"
        self.ranks = [d / "r_1" / "attempt_0" / str(r) / "stdout.log" for r in (0, 1)]
        for r, f in enumerate(self.ranks):
            f.parent.mkdir(parents=True)
            f.write_text(f"start rank={r}\n" + "".join(f"step={s} loss=2.0 {'p' * 60}\n"
                                                       for s in range(20000)))
        self.util = d / "gpu_util.csv"
        now = int(time.time())
        self.util.write_text("".join(f"{t},97,98\n" for t in range(now - 30 * 86400, now, 30)))
        self.step = 20000

    def grow(self, _seconds=None):
        """What the job writes between two rounds: the same amount each time."""
        with self.journal.open("a") as f:
            f.writelines(f"agent: more {self.step} {'y' * 60}\n" for _ in range(100))
        for f in self.ranks:
            with f.open("a") as fh:
                fh.writelines(f"step={self.step + i} loss=1.5\n" for i in range(1, 11))
        self.step += 10
        with self.util.open("a") as fh:
            fh.write(f"{int(time.time())},50,60\n")

    def answer(self, host, command, data):
        """The probe run for real, as the node runs it, with the stand-ins on PATH."""
        assert probe_request(data) is not None, command
        r = subprocess.run([sys.executable, "-I", "-"], input=data, capture_output=True,
                           text=True, timeout=60,
                           env={**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}"})
        return r.returncode, r.stdout, r.stderr


def test_status_is_one_round_trip_per_node(tmp_path, monkeypatch):
    job = Job(tmp_path)
    fleet, calls = fake_fleet(monkeypatch, _inv(tmp_path), job.answer)
    with fleet:
        (rnd,) = list(status.watch(fleet, "j1", 0))
    assert rnd.nodes.ok, rnd.nodes.failures
    assert per_host(calls) == {"a": 1, "b": 1}


def test_each_watch_round_is_one_round_trip_per_node_and_reads_only_what_is_new(tmp_path, monkeypatch):
    """The journal (50,000 lines and growing), the ranks' logs (1.4 MB each) and a 30-day
    GPU-use file: the first round reads their tails, each later round only what the job
    wrote since (a cursor, file offsets), so round 6 returns what round 2 did, a small part of
    round 1; what status shows is still the newest (progress, journal, samples)."""
    job = Job(tmp_path)
    fleet, calls = fake_fleet(monkeypatch, _inv(tmp_path), job.answer)
    rounds = []
    with fleet:
        for i, rnd in enumerate(status.watch(fleet, "j1", 1, sleep=job.grow)):
            assert rnd.nodes.ok, rnd.nodes.failures
            rounds.append((per_host(calls), sum(len(out) for *_, out in calls), rnd,
                           [probe_request(data) for _, _, data, _ in calls]))
            calls.clear()
            if i == 5:
                break
    assert [r[0] for r in rounds] == [{"a": 1, "b": 1}] * 6
    sizes = [r[1] for r in rounds]
    assert sizes[0] > 100_000 and max(sizes[1:]) < sizes[0] / 10, sizes
    assert max(sizes[1:]) - min(sizes[1:]) < 2_000, sizes  # flat while the files grow
    print("reply bytes per round, 2 nodes:", sizes)
    last = rounds[-1][2]
    node = last.nodes.results[0].value
    assert node["progress"] == f"step={job.step} loss=1.5"
    assert node["util_samples"][-1][1] == [50.0, 60.0] and len(node["util_samples"]) > 100
    req = rounds[-1][3][0]  # the last round asked for what came after the round before
    assert req["journal"]["after_cursor"] == str(50001 + 100 * 4)
    assert req["read"]["util"]["since"][1] == (job.util.stat().st_size
                                                 - len(job.util.read_text().splitlines(True)[-1]))
    assert sorted(req["tree"]["logs"]["since"]) == ["r_1/attempt_0/0/stdout.log",
                                                    "r_1/attempt_0/1/stdout.log"]

def _gate_reply(req):
    run_ = {k: {"rc": 0, "out": "", "err": ""} for k in req["run"]}
    glob = {n: {g["pattern"].replace("*", "2.5.1"): "Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1\n"}
            for n, g in req["glob"].items()}
    return {"run": run_, "host": {"hostname": "n", "time": time.time(), "monotonic": 100.0},
            "exists": {p: True for p in req["exists"]}, "read": {n: None for n in req["read"]},
            "glob": glob, "stat": {}, "users": {}, "tree": {},
            **({"connect": {"resolved": req["connect"]["address"],
                            "route": {"rc": 0, "out": '[{"dev": "eth0"}]', "err": ""}}}
               if "connect" in req else {})}


def _started_reply(req):
    now, mono = time.time(), 1000.0
    unit = f"ActiveState=active\nResult=success\nActiveEnterTimestampMonotonic={int((mono - 5) * 1e6)}\n"
    return {"run": {"unit": {"rc": 0, "out": unit, "err": ""}}, "host": {"time": now, "monotonic": mono},
            "tree": {"logs": {"dirs": [["r_1/attempt_0", now - 2]],
                              "files": {"r_1/attempt_0/0/stdout.log": {"text": ""}}}}}


def _kind(command, data):
    """What one launch call was, from what it sent."""
    req = probe_request(data)
    if req is not None:
        return "probe" if "smi_query" in req.get("run", {}) else (
            "poll" if "logs" in req.get("tree", {}) else f"probe {sorted(req)}")
    if "systemctl start" in data:
        return "start"
    if "NeedDaemonReload" in data:
        return "install" + ("+switch" if 'mv -T "$base/.current.new"' in data else "")
    return command[:40]


def _launch_two(tmp_path, monkeypatch, answer) -> list:
    """A 2-node launch through fake connections answered by `answer`: the calls made."""
    fleet, calls = fake_fleet(monkeypatch, _inv(tmp_path), answer)
    with fleet:
        got = service.launch(fleet, run.LaunchOptions(job="j1", nproc="1", early_fail_window=0),
                             nodes=2, log=lambda *a, **k: None)
    assert got.started
    return calls


def _look(data):
    """The start check a start script runs after `systemctl start` (its probe's request)."""
    return probe_request(data, "TORCHRIG_PROBE\n")


def test_launch_of_two_nodes_with_nothing_to_push_is_three_round_trips_per_node(tmp_path, monkeypatch):
    """Per node: one root probe asking everything known up front (GPU health, the version
    gate, the jobs running there, the release: there already), the job's files with the
    release made current, and the start (once every node has its files) with, in the same
    round trip, the check that the workers run."""
    import json

    def answer(host, command, data):
        req = probe_request(data)
        if req and "smi_query" in req.get("run", {}):
            assert {"health_xml", "busy"} <= set(req["run"]) and any(
                p.endswith("/.complete") for p in req["exists"]), sorted(req["run"])
            return 0, json.dumps(_gate_reply(req)), ""
        if req and "logs" in req.get("tree", {}):
            return 0, json.dumps(_started_reply(req)), ""
        if _look(data):
            return 0, json.dumps(_started_reply(_look(data))), ""
        return 0, "", ""
    calls = _launch_two(tmp_path, monkeypatch, answer)
    assert per_host(calls) == {"a": 3, "b": 3}
    assert [_kind(c, d) for h, c, d, _ in calls if h == "a"] == [
        "probe", "install+switch", "start"]
    look = _look(calls[-1][2])
    assert look["until"]["seen"] is None and look["until"]["seconds"] == 0  # answered at once


def test_launch_waits_on_a_slowly_spawning_node_in_one_round_trip_not_a_poll_each_250_ms(
        tmp_path, monkeypatch):
    """A node whose workers spawn 2.5 s after the start (a slow rendezvous): the start's own
    look answers at once (nothing yet); the next check carries that answer's digest and
    launch's wait, and the node answers when its state changes. The fake node here does what
    the probe's "until" does: it holds an unchanged answer until the spawn, at most the wait
    asked for. Polling every 250 ms, as before, took 10 or more checks."""
    import json
    spawn_at = {}

    def reply(host, req, look):
        until = req["until"]
        at = spawn_at.setdefault(host, time.monotonic() + 2.5)
        if until["seen"] == "nothing yet":  # the node waits
            time.sleep(max(0.0, min(until["seconds"], at - time.monotonic())))
        if time.monotonic() < at:
            r = _started_reply(req)
            r["tree"]["logs"] = {"dirs": [], "files": {}}
            return 0, json.dumps({**r, "seen": "nothing yet"}), ""
        return 0, json.dumps({**_started_reply(req), "seen": "spawned"}), ""

    def answer(host, command, data):
        req = probe_request(data)
        if req and "smi_query" in req.get("run", {}):
            return 0, json.dumps(_gate_reply(req)), ""
        if req and "logs" in req.get("tree", {}):
            return reply(host, req, False)
        if _look(data):
            return reply(host, _look(data), True)
        return 0, "", ""
    t0 = time.monotonic()
    calls = _launch_two(tmp_path, monkeypatch, answer)
    looks = [_look(d)["until"] for h, c, d, _ in calls if h == "a" and _look(d)]
    polls = [probe_request(d)["until"] for h, c, d, _ in calls
             if h == "a" and _kind(c, d) == "poll"]
    assert len(looks) == 1 and looks[0]["seconds"] == 0
    assert len(polls) == 1 and polls[0]["seen"] == "nothing yet", polls
    assert polls[0]["seconds"] == run.WAIT_S
    assert time.monotonic() - t0 >= 2.5
