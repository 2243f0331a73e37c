"""Issue 25, elastic jobs (`launch --nodes MIN:MAX`): the flag's value, torchrun's elastic
rendezvous arguments and unit settings, the endpoint a node picks (payload/torchrig_torchrun.py)
and what `status` says about such a job."""

from __future__ import annotations

import importlib.util
import re

import pytest

from torchrig.errors import TorchrigError
from torchrig.launch import elastic, plan, service, spec
from torchrig.launch.run import LaunchOptions
from torchrig.resources import PAYLOAD

from test_launch_plan import job


def _wrapper():
    s = importlib.util.spec_from_file_location("torchrig_torchrun", PAYLOAD / "torchrig_torchrun.py")
    m = importlib.util.module_from_spec(s)
    s.loader.exec_module(m)
    return m


@pytest.mark.parametrize("value,expected", [
    (None, None), (2, (2, 2)), ("3", (3, 3)), ("2:3", (2, 3)), (" 1:4 ", (1, 4)), ("2:2", (2, 2))])
def test_nodes_is_n_or_min_max(value, expected):
    assert elastic.parse_nodes(value) == expected
    assert elastic.is_elastic(expected) == (expected is not None and expected[0] < expected[1])


@pytest.mark.parametrize("value", ["0", "3:2", "0:2", "2:", ":3", "a:b", "2:3:4", "-1", "", True])
def test_bad_nodes_is_one_error(value):
    with pytest.raises(TorchrigError, match=r"^--nodes .*: expected N or MIN:MAX, whole numbers "
                                            r"with 1 <= MIN <= MAX \(e\.g\. 2 or 2:3\)$"):
        elastic.parse_nodes(value)


def test_max_above_the_selected_hosts_is_refused_and_min_max_takes_the_first_max():
    from types import SimpleNamespace as NS
    hosts = [NS(name=f"gpu{i}") for i in range(1, 4)]
    assert [h.name for h in service.first_nodes(hosts, "2:3")] == ["gpu1", "gpu2", "gpu3"]
    assert [h.name for h in service.first_nodes(hosts, "1:2")] == ["gpu1", "gpu2"]
    with pytest.raises(TorchrigError, match=r"^--nodes 2:4: only 3 host\(s\) selected"):
        service.first_nodes(hosts, "2:4")


def test_job_file_takes_min_max_and_an_elastic_job_gets_more_restarts(tmp_path):
    f = tmp_path / "j.yml"
    f.write_text("nodes: '2:3'\n")
    opts = spec.merge(spec.load(f), {})
    assert opts["nodes"] == "2:3" and opts["max_restarts"] == elastic.ELASTIC_MAX_RESTARTS
    assert spec.merge(spec.load(f), {"max_restarts": 4})["max_restarts"] == 4
    assert spec.merge(None, {"nodes": "2"})["max_restarts"] == 3
    f.write_text("nodes: '3:2'\n")
    with pytest.raises(TorchrigError, match=r"j\.yml: key 'nodes': expected N or MIN:MAX"):
        spec.load(f)


def test_elastic_torchrun_arguments_and_unit():
    j = job(3, min_nodes=2)
    argv = plan.torchrun_argv(j, j.nodes[2])
    assert argv[argv.index("--nnodes") + 1] == "2:3"
    conf = argv[argv.index("--rdzv-conf") + 1]
    assert conf == (f"is_host=false,join_timeout=300,last_call_timeout={elastic.LAST_CALL_S},"
                    f"read_timeout={elastic.READ_TIMEOUT_S}")
    env = plan.node_env(j, j.nodes[2])
    assert env["TORCHRIG_RDZV_CANDIDATES"] == "10.0.0.1:29412,10.0.0.2:29412,10.0.0.3:29412"
    assert env["TORCHRIG_RDZV_LOST_EXIT"] == str(elastic.STORE_LOST)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a rejoin: a store per round
    unit = plan.render_unit(j, j.nodes[2])
    assert f"RestartForceExitStatus={elastic.STORE_LOST}" in unit
    assert "ConditionPathExists=!/etc/torchrig/jobs/exp1.stopped" in unit
    plain = job(3)
    assert "TORCHRIG_RDZV_CANDIDATES" not in plan.node_env(plain, plain.nodes[0])
    assert "RestartForceExitStatus" not in plan.render_unit(plain, plain.nodes[0])
    assert "ExecStopPost" not in plan.render_unit(plain, plain.nodes[0])
    a = plan.torchrun_argv(plain, plain.nodes[0])
    assert a[a.index("--nnodes") + 1] == "3"


@pytest.mark.parametrize("result,code,status,disabled", [
    ("success", "exited", "0", True), ("exit-code", "exited", "1", False),
    ("success", "killed", "15", False), ("signal", "killed", "9", False)])
def test_an_elastic_unit_that_ended_on_its_own_is_disabled(tmp_path, result, code, status, disabled):
    """The unit's ExecStopPost, run by sh as systemd would (its $$ made $): torchrun's exit 0
    disables the unit (nothing to rejoin at boot); a failure or a signal leaves it enabled."""
    import subprocess
    j = job(3, min_nodes=2)
    line = next(ln for ln in plan.render_unit(j, j.nodes[0]).splitlines()
                if ln.startswith("ExecStopPost=+"))
    argv = line.removeprefix("ExecStopPost=+").replace("$$", "$")
    assert argv.startswith("/bin/sh -c '") and argv.endswith("'")
    b = tmp_path / "bin"
    b.mkdir()
    (b / "systemctl").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/called\n')
    (b / "systemctl").chmod(0o755)
    r = subprocess.run(["sh", "-c", argv[len("/bin/sh -c '"):-1]], capture_output=True, text=True,
                       env={"PATH": f"{b}:/usr/bin:/bin", "SERVICE_RESULT": result,
                            "EXIT_CODE": code, "EXIT_STATUS": status})
    assert r.returncode == 0, r.stderr
    called = tmp_path / "called"
    assert (called.read_text().split() if called.exists() else None) == (
        ["disable", "--no-reload", "torchrig-exp1.service"] if disabled else None)


def test_a_node_joins_the_first_other_candidate_that_answers():
    w = _wrapper()
    c = ["a:1", "b:1", "c:1"]
    assert w.pick_endpoint(c, "c:1", 20, probe=lambda e: e == "b:1") == ("b:1", False)
    # the first node hosts at once when nobody answers; a later one only after its turn
    assert w.pick_endpoint(c, "a:1", 20, probe=lambda e: False) == ("a:1", True)
    t = [0.0]
    got = w.pick_endpoint(c, "c:1", 20, probe=lambda e: False, clock=lambda: t[0],
                          sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert got == ("c:1", True) and t[0] == 40
    # the first node back from a loss joins the survivors' store, not a store of its own
    assert w.pick_endpoint(c, "a:1", 20, probe=lambda e: e == "c:1") == ("c:1", False)


def test_the_wrapper_rewrites_only_the_endpoint_and_is_host():
    w = _wrapper()
    argv = ["x", "--nnodes", "2:3", "--rdzv-endpoint", "a:1", "--rdzv-conf",
            "is_host=true,join_timeout=300,read_timeout=20", "--local-addr", "b", "train.py"]
    got = w.with_endpoint(argv, "c:1", False)
    assert got == ["x", "--nnodes", "2:3", "--rdzv-endpoint", "c:1", "--rdzv-conf",
                   "is_host=false,join_timeout=300,read_timeout=20", "--local-addr", "b",
                   "train.py"]
    assert w.arg_of(argv, "--local-addr") == "b"


@pytest.mark.parametrize("args,expected", [
    ((2, 3, 3, 3, 3, False), "running on 3 of 3 nodes (min 2)"),
    ((2, 3, 2, 2, 2, False), "running on 2 of 3 nodes (min 2)"),
    ((2, 3, 2, 2, 3, False), "lost a node: 2 of 3 nodes up (min 2), re-forming from 3"),
    ((2, 3, 3, 3, 2, False), "waiting for a node to rejoin: 3 of 3 nodes up (min 2), training on 2"),
    ((2, 3, 1, 1, 2, False), "below MIN: 1 of 3 nodes up (min 2); waiting for a node to rejoin "
                             "until the rendezvous timeout, then it ends"),
    ((2, 3, 0, 1, 2, True), "below MIN: ended (1 of 3 nodes reachable, min 2)"),
    ((2, 3, 0, 3, 3, True), "ended: failed"),
    ((2, 3, 0, 3, 3, False), "ended"),
])
def test_status_wording(args, expected):
    assert elastic.describe(*args) == expected


def test_the_stated_bound_adds_up():
    assert elastic.loss_bound_s(3) == 20 + 5 + 40 + 10 + 60


def test_a_global_batch_that_does_not_divide_at_some_world_size_is_refused():
    elastic.check_global_batch(["--global-batch", "96"], [4, 6])  # 8 x 4 x 3 and 8 x 6 x 2
    with pytest.raises(TorchrigError, match=r"^nothing started: at a world size of 6 ranks "
                                            r"\(of 4, 6\): --global-batch 32 is not a multiple"):
        elastic.check_global_batch(["--preset", "tiny", "--global-batch=32"], [4, 6])
    with pytest.raises(TorchrigError, match=r"world size of 6 .*--batch-size 2 x world size 6"):
        elastic.check_global_batch(["--global-batch", "16", "--batch-size", "2"], [4, 6])
    elastic.check_global_batch(["--global-batch", "x"], [4, 6])  # the payload's own refusal
    elastic.check_global_batch([], [4, 6])


def test_the_payload_micro_batch_default_is_the_payloads():
    import re
    text = (PAYLOAD / "config.py").read_text()  # its default is global_batch.py's constant
    assert re.search(r"batch_size: int = _batch\(DEFAULT_MICRO_BATCH,", text)
    # which launch's check reads: 8 per micro-step and rank by default
    elastic.check_global_batch(["--global-batch", "32"], [4])
    with pytest.raises(TorchrigError, match=r"--batch-size 8 x world size 4"):
        elastic.check_global_batch(["--global-batch", "16"], [4])


def test_launch_checks_the_batch_at_every_world_size_from_the_inventory():
    from types import SimpleNamespace as NS
    from torchrig.launch.run import check_batch
    hosts = [NS(name=f"gpu{i}", gpus=2, settings=NS(accelerator="cuda")) for i in range(3)]
    o = LaunchOptions(job="j", args="--global-batch 32", min_nodes=2)
    with pytest.raises(TorchrigError, match=r"world size of 6 ranks \(of 4, 6\)"):
        check_batch(hosts, o)
    check_batch(hosts, LaunchOptions(job="j", args="--global-batch 96", min_nodes=2))
    check_batch(hosts[:2], LaunchOptions(job="j", args="--global-batch 32"))  # 4 ranks only
    check_batch(hosts, LaunchOptions(job="j", args="--global-batch 32", min_nodes=2,
                                     module="pkg.train"))  # not the payload: its own business


def test_status_reads_the_span_from_the_unit_and_the_newest_world_line_of_rank_0():
    from types import SimpleNamespace as NS
    from torchrig import progress
    from torchrig.facts import job_state
    j = job(3, min_nodes=2)
    desc = re.search(r"^Description=(.*)$", plan.render_unit(j, j.nodes[0]), re.M).group(1)
    assert elastic.span_of(desc) == (2, 3)
    assert elastic.span_of(re.search(r"^Description=(.*)$", plan.render_unit(job(3), job(3).nodes[0]),
                                     re.M).group(1)) is None
    w3 = "world step=40 world_size=6 nodes=3 global_batch=96 micro_batch=8 grad_accum=2"
    w2 = "world step=50 world_size=4 nodes=2 global_batch=96 micro_batch=8 grad_accum=3 from=6"
    files = {"/l/r_1/attempt_1/0/stdout.log": {"first_line": "start rank=0 local_rank=0",
                                               "text": f"start rank=0 local_rank=0\n{w3}\nstep=41 loss=1\n{w2}\nstep=51 loss=1\n"},
             "/l/r_1/attempt_1/1/stdout.log": {"first_line": "start rank=1 local_rank=1",
                                               "text": "start rank=1 local_rank=1\n"}}
    assert job_state.world_line(files) == w2
    assert job_state.world_line({"/l/x/attempt_0/0/stdout.log": {
        "first_line": "start rank=2 local_rank=0", "text": w3}}) is None  # not rank 0

    def node(state, world=None):
        return NS(ok=True, value={"unit": {"ActiveState": state, "Description": desc},
                                  "world": world})
    down = NS(ok=False, value=None)
    got = elastic.summary([node("active", w2), node("active"), down], progress.parse_world)
    assert got == {"span": "2:3", "state": "running on 2 of 3 nodes (min 2)", "world": w2}
    got = elastic.summary([node("active", w3), node("active", w2), node("active")],
                          progress.parse_world)
    assert got["state"] == "waiting for a node to rejoin: 3 of 3 nodes up (min 2), training on 2"
    got = elastic.summary([node("failed", w2), down, down], progress.parse_world)
    assert got["state"] == "below MIN: ended (1 of 3 nodes reachable, min 2)"
    plain = NS(ok=True, value={"unit": {"ActiveState": "active", "Description": "torchrig job x"}})
    assert elastic.summary([plain], progress.parse_world) is None


def test_status_of_an_elastic_slurm_job_takes_the_span_from_its_record():
    """A Slurm job has no unit: status stands Slurm's state (lower case) in, and the span
    comes from the job's record on the controller (slurm.SlurmJob.span)."""
    from types import SimpleNamespace as NS
    from torchrig import progress
    from torchrig.launch import slurm
    w1 = "world step=50 world_size=2 nodes=1 global_batch=96 micro_batch=8 grad_accum=6 from=4"

    def node(state, world=None):
        return NS(ok=True, value={"unit": {"ActiveState": state, "SubState": "slurm"},
                                  "world": world})
    sj = slurm.SlurmJob("j", "7", None, {"job_id": "7", "span": [1, 2]})
    assert sj.span == (1, 2)
    assert slurm.SlurmJob("j", "7", None, {"span": ["1", 2]}).span is None
    assert slurm.SlurmJob("j", "7", None, {}).span is None
    got = elastic.summary([node("running", w1)], progress.parse_world, sj.span)
    assert got == {"span": "1:2", "state": "running on 1 of 2 nodes (min 1)", "world": w1}
    assert elastic.summary([node("running", w1)], progress.parse_world, None) is None
    got = elastic.summary([node("node_fail", w1)], progress.parse_world, (2, 3))
    assert got["state"] == "below MIN: ended (1 of 3 nodes reachable, min 2)"


def test_logs_failures_says_a_job_ended_below_min_and_names_the_lost_nodes():
    from types import SimpleNamespace as NS
    from torchrig.logs import diagnose
    gave_up = NS(host="gpu1", log=NS(rdzv_timed_out=True, min_nodes=2, nnodes=3))
    assert diagnose.below_min([gave_up], ["gpu1", "gpu4", "gpu5"]) == (
        "job ended below MIN: fewer nodes than its minimum (--nodes MIN) were left within the "
        "rendezvous timeout; gpu1 gave up; lost (unreachable): gpu4, gpu5")
    assert diagnose.below_min([NS(host="gpu1", log=NS(rdzv_timed_out=False, min_nodes=2,
                                                       nnodes=3))], ["gpu1"]) is None
    # a plain job's agent that gave up at a rendezvous waited for a peer, not for a minimum
    plain = NS(host="gpu1", log=NS(rdzv_timed_out=True, min_nodes=2, nnodes=2))
    assert diagnose.below_min([plain], ["gpu1", "gpu4"]) is None


def test_the_launch_config_gives_min_and_max_nodes():
    from torchrig.logs import agent
    from pathlib import Path
    text = (Path(__file__).parents[1] / "fixtures" /
            "torchrun_08_journal_info_rejoining_node1of2.txt").read_text()
    log = agent.parse(text)
    assert (log.min_nodes, log.nnodes) == (2, 2)
