"""The job services the tasks call once: launch/stop (launch/service.py: which backend, which
nodes), logs (launch/joblogs.py: the lines, or the first failure) and status' rounds
(launch/status.py watch), with their backends replaced: what each decides before any node
is touched, and what it hands back."""

import types

import pytest

from torchrig.errors import TorchrigError
from torchrig.launch import joblogs, run, service, slurm
from torchrig.logs.stream import FollowOutcome
from torchrig.session import Result
from torchrig.secrets import Redactor
from torchrig.session import Outcome


def _host(name, backend="systemd"):
    s = types.SimpleNamespace(backend=backend, job_log_dir=lambda job: f"/var/log/torchrig/{job}")
    return types.SimpleNamespace(name=name, settings=s)


def _fleet(*names, backend="systemd", slurm_section=None):
    return types.SimpleNamespace(hosts=[_host(n, backend) for n in names],
                                 inv=types.SimpleNamespace(slurm=slurm_section))


@pytest.fixture
def calls(monkeypatch):
    """Every backend call the services make, by name, with the hosts it was given."""
    seen = []
    from torchrig.launch import health_gate
    monkeypatch.setattr(health_gate, "gate", lambda fleet, hosts, skip, log: hosts)
    monkeypatch.setattr(health_gate, "gate_slurm", lambda fleet, hosts, skip, log: hosts)
    monkeypatch.setattr(run, "launch", lambda fleet, hosts, o, log: seen.append(
        ("systemd", [h.name for h in hosts])) or "systemd-launched")
    monkeypatch.setattr(slurm, "launch", lambda fleet, hosts, o, n, p, t, log: seen.append(
        ("slurm", [h.name for h in hosts], n, p, t)) or "slurm-launched")
    return seen


def test_nodes_are_the_first_n_selected_hosts_and_the_fleet_narrows_to_them(calls):
    fleet = _fleet("gpu1", "gpu2", "gpu3")
    assert service.launch(fleet, run.LaunchOptions(job="j"), nodes=2) == "systemd-launched"
    assert calls == [("systemd", ["gpu1", "gpu2"])]
    assert [h.name for h in fleet.hosts] == ["gpu1", "gpu2"]


def test_more_nodes_than_selected_is_one_error_before_any_node_is_touched(calls):
    with pytest.raises(TorchrigError, match=r"^--nodes 3: only 2 host\(s\) selected \(gpu1, gpu2\)$"):
        service.launch(_fleet("gpu1", "gpu2"), run.LaunchOptions(job="j"), nodes=3)
    assert calls == []


def test_the_hosts_connected_first_are_the_nodes_launch_probes_first():
    """What the CLI opens while it imports the launch code: a systemd job's nodes (every
    selected host when unhealthy ones may be left out), none for Slurm (its controller comes
    first, and Slurm picks the compute hosts)."""
    names = lambda hosts: [h.name for h in hosts]  # noqa: E731
    fleet = _fleet("gpu1", "gpu2", "gpu3")
    assert names(service.first_contact(fleet, 2, None, False)) == ["gpu1", "gpu2"]
    assert names(service.first_contact(fleet, "1:2", None, False)) == ["gpu1", "gpu2"]
    assert names(service.first_contact(fleet, None, None, False)) == ["gpu1", "gpu2", "gpu3"]
    assert names(service.first_contact(fleet, 2, None, True)) == ["gpu1", "gpu2", "gpu3"]
    assert service.first_contact(fleet, 2, "slurm", False) == []
    assert service.first_contact(_fleet("gpu1", backend="slurm"), 1, None, False) == []
    with pytest.raises(TorchrigError, match=r"^--nodes 4: only 3 host"):
        service.first_contact(fleet, 4, None, False)
    with pytest.raises(TorchrigError, match="systemd or slurm"):
        service.first_contact(fleet, 2, "k8s", False)


SLURM = types.SimpleNamespace(controller="ctl", compute=["gpu1", "gpu2"])


def test_the_backend_var_picks_slurm_which_picks_its_own_nodes(calls):
    fleet = _fleet("gpu1", "gpu2", backend="slurm", slurm_section=SLURM)
    got = service.launch(fleet, run.LaunchOptions(job="j"), nodes=1, partition="p",
                         time_limit="1:00")
    assert got == "slurm-launched"
    assert calls == [("slurm", ["gpu1", "gpu2"], 1, "p", "1:00")]


def test_an_elastic_slurm_job_asks_for_max_nodes_and_keeps_min(calls, monkeypatch):
    monkeypatch.setattr(run, "node_procs", lambda h, nproc: 2)
    o = run.LaunchOptions(job="j")
    service.launch(_fleet("gpu1", "gpu2", backend="slurm", slurm_section=SLURM), o, nodes="1:2")
    assert calls == [("slurm", ["gpu1", "gpu2"], 2, None, None)] and o.min_nodes == 1
    # a global batch that does not divide at 1 node x 2 or 2 x 2 ranks: before any host
    o = run.LaunchOptions(job="j", args="--global-batch 12 --batch-size 4")
    with pytest.raises(TorchrigError, match=r"^nothing started: at a world size of 2 ranks \(of 2, 4\)"):
        service.launch(_fleet("gpu1", "gpu2", backend="slurm", slurm_section=SLURM), o,
                       nodes="1:2")
    assert len(calls) == 1


@pytest.mark.parametrize("kw,want", [
    ({"backend": "pbs"}, r"--backend 'pbs': systemd or slurm"),
    ({"partition": "gpu"}, r"--partition and --time are Slurm's: add --backend slurm"),
    ({"time_limit": "1:00"}, r"--partition and --time are Slurm's: add --backend slurm"),
    ({"backend": "slurm", "dry_run": True}, r"--dry-run with --backend slurm: not supported")])
def test_flags_the_backend_cannot_honour_are_refused(calls, kw, want):
    o = run.LaunchOptions(job="j", dry_run=kw.pop("dry_run", False))
    with pytest.raises(TorchrigError, match=want):
        service.launch(_fleet("gpu1"), o, **kw)
    assert calls == []


def test_stop_goes_through_slurm_only_when_its_cluster_knows_the_job(monkeypatch):
    sj = object()
    monkeypatch.setattr(slurm, "find", lambda fleet, job: sj if job == "sj" else None)
    monkeypatch.setattr(slurm, "stop", lambda fleet, found, log: found)
    out = Outcome("stop of job j", [Result("gpu1", True, "inactive")])
    monkeypatch.setattr(run, "stop", lambda fleet, hosts, job: out)
    cluster = _fleet("gpu1", slurm_section=object())
    assert service.stop(cluster, "sj") == service.Stopped("sj", slurm=sj)
    assert service.stop(cluster, "j") == service.Stopped("j", nodes=out)
    assert service.stop(_fleet("gpu1"), "sj") == service.Stopped("sj", nodes=out)  # no cluster


def test_logs_hands_the_lines_to_the_printer_and_says_which_nodes_were_lost(monkeypatch):
    monkeypatch.setattr(joblogs, "slurm_record", lambda fleet, job: None)
    got = {}

    def follow(fleet, hosts, o, printer):
        got.update(o=o, printer=printer)
        return FollowOutcome(lost={"gpu2": "unreachable"})
    monkeypatch.setattr(joblogs, "run_follow", follow)
    printer = object()
    res = joblogs.job_logs(_fleet("gpu1", "gpu2"), "j", printer, follow=True, rank=3)
    assert res == joblogs.JobLogs("j", {"gpu2": "unreachable"}, None)
    assert got["printer"] is printer
    o = got["o"]
    assert (o.follow, o.rank, o.unit, o.slurm_job) == (True, 3, "torchrig-j.service", None)
    assert o.log_dir == {"gpu1": "/var/log/torchrig/j", "gpu2": "/var/log/torchrig/j"}


def test_logs_failures_prints_no_line_and_returns_the_report_redacted(monkeypatch):
    monkeypatch.setattr(joblogs, "slurm_record", lambda fleet, job: None)
    followed = []

    def follow(fleet, hosts, o, printer):
        followed.append(o.follow)
        printer.line("a rank's line")  # the quiet printer: nothing reaches the terminal
        return FollowOutcome()
    monkeypatch.setattr(joblogs, "run_follow", follow)
    monkeypatch.setattr(joblogs.diagnose, "fetch", lambda fleet, hosts, unit, ident: [])
    monkeypatch.setattr(joblogs.diagnose, "failures", lambda journals, unit, errors: ["f"])
    monkeypatch.setattr(joblogs.diagnose, "report",
                        lambda found: "rank 1 failed: https://u:hunter2@example.com/x")
    res = joblogs.job_logs(_fleet("gpu1"), "j", printer=None, follow=True, failures=True,
                           red=Redactor())
    assert followed == [False]  # --failures reads what is there, never follows
    assert "hunter2" not in res.failures and res.failures.startswith("rank 1 failed")
    monkeypatch.setattr(joblogs.diagnose, "report", lambda found: None)
    assert joblogs.job_logs(_fleet("gpu1"), "j", printer=None, failures=True).failures is None


def test_status_watch_rounds_share_the_trend_and_the_journal_cursor(monkeypatch):
    """status --watch: each round a look redacted, its samples added to one trend, the journals
    carried to the next round; a sleep between rounds, none after a single look."""
    from torchrig.launch import status

    kept, slept = [], []

    def look(fleet, job, watched):
        kept.append(watched)
        if watched is not None:
            watched.nodes[f"round{len(kept)}"] = {}
        res = status.JobStatus(f"job {job}", [Result("gpu1", True, {
            "gpus": [], "progress": f"step={len(kept)} https://u:hunter2@example.com"})])
        return status.StatusRound(job, res, {"waiting": {"gpu1": "waits for https://u:hunter2@x"}})
    monkeypatch.setattr(status, "look", look)
    rounds = status.watch(_fleet("gpu1"), "j", 5, Redactor(), sleep=slept.append)
    first, second = next(rounds), next(rounds)
    assert slept == [5] and kept[0] is kept[1] and set(kept[0].nodes) == {"round1", "round2"}
    assert first.trend is second.trend and "gpu1" in first.trend.nodes
    assert "hunter2" not in str(second.nodes.as_dict()) + str(second.diagnosis)
    once = list(status.watch(_fleet("gpu1"), "j", 0, sleep=slept.append))
    assert len(once) == 1 and once[0].trend is None and kept[-1] is None and slept == [5]
