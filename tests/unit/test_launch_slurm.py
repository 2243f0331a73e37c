"""The Slurm launcher's batch script: rendered from templates/slurm, run here by real bash
(a stand-in `systemd-cat` records the command line it was asked to run)."""

from __future__ import annotations

import os
import subprocess

import pytest

from torchrig.errors import TorchrigError
from torchrig.job import STOP_GRACE_S
from torchrig.launch import plan, slurm
from torchrig.verify import slurm_checks
from _fixtures import fixture
from torchrig.facts.slurm import parse_sinfo


def job(**kw):
    ns = [plan.Node(f"gpu{i + 1}", f"10.0.0.{i + 1}", i, "/opt/torchrig/venv", "torchrig",
                    "/var/log/torchrig", "/srv/ck", "/srv/data", 2, "eth0") for i in range(3)]
    base = dict(name="exp1", script="train.py", args=["--lr", "3e-4", "it's $HOME"],
                max_restarts=3, rdzv_port=29412, nodes=ns,
                release="/opt/torchrig/payload/releases/abc",
                env={"API_TOKEN": "s3cr3t'\nTORCHRIG_STEP\n$(touch /tmp/pwned)"})
    base.update(kw)
    return plan.Job(**base)


def step_of(script):
    """The batch script's `export TORCHRIG_STEP=...` (one quoted word over several lines)."""
    start = script.index("export TORCHRIG_STEP=")
    return script[start:script.index("\n# One torchrun per node", start)]


def run_step(tmp_path, j, node, nodeid, endpoint="10.0.0.2:29412"):
    """The batch script's TORCHRIG_STEP as srun's bash runs it on `node`: what it execs."""
    script = slurm.render_sbatch(j, "gpu", "1:00:00", 0, [])
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "systemd-cat").write_text('#!/bin/sh\nshift\nprintf "%s\\0" "$@" > "$OUT"\n'
                                      'env > "$OUT.env"\n')
    (bin_ / "systemd-cat").chmod(0o755)
    step = step_of(script)
    out = tmp_path / f"argv-{node}"
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "OUT": str(out), "SLURMD_NODENAME": node,
           "SLURM_NODEID": str(nodeid), "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0",
           "TORCHRIG_RDZV_ENDPOINT": endpoint, "HOME": str(tmp_path)}
    r = subprocess.run(["bash", "-c", step + '\neval "$TORCHRIG_STEP"'], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return out.read_text().split("\0")[:-1], out.with_name(out.name + ".env").read_text()


def test_batch_script_is_valid_bash_with_the_sbatch_options(tmp_path):
    script = slurm.render_sbatch(job(size=2), "gpu", "2:00:00", 4, ["gpu9"])
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    opts = [ln for ln in script.splitlines() if ln.startswith("#SBATCH ")]
    assert "#SBATCH --job-name=torchrig-exp1" in opts and "#SBATCH --nodes=2" in opts
    assert "#SBATCH --partition=gpu" in opts and "#SBATCH --time=2:00:00" in opts
    assert f"#SBATCH --signal=TERM@{STOP_GRACE_S}" in opts and "#SBATCH --gres=gpu:4" in opts
    assert "#SBATCH --exclude=gpu9" in opts and "#SBATCH --no-requeue" in opts
    assert "#SBATCH --output=/var/log/torchrig/exp1/.slurm-%j.out" in opts
    assert plan.launch_marker(job(launch_id="abc")) in slurm.render_sbatch(
        job(launch_id="abc", size=2), None, None, 0, [])
    plain = slurm.render_sbatch(job(size=2), None, None, 0, [])
    assert "--partition" not in plain and "--signal" not in plain and "--gres" not in plain


@pytest.mark.parametrize("node,nodeid,is_host", [("gpu2", 0, True), ("gpu3", 1, False)])
def test_each_node_runs_the_one_torchrun_argv_with_the_allocations_rendezvous(tmp_path, node, nodeid, is_host):
    j = job(size=2)
    argv, env = run_step(tmp_path, j, node, nodeid)
    n = next(x for x in j.nodes if x.host == node)
    # the same builder as the systemd units, the endpoint from the allocation's first node
    assert argv == plan.torchrun_argv(j, n, "10.0.0.2:29412", is_host)
    assert f"is_host={'true' if is_host else 'false'}" in " ".join(argv)
    assert f"--local-addr\0{n.address}" in "\0".join(argv)
    # the same env as the systemd units' env file, secrets and odd characters intact
    for k, v in plan.node_env(j, n).items():
        assert f"{k}={v}\n" in env
    # the launch's random rendezvous run id, in the environment only (never argv)
    assert f"PET_RDZV_ID={j.run_id}\n" in env and j.run_id not in "\0".join(argv)
    assert not (tmp_path / "pwned").exists() and not os.path.exists("/tmp/pwned")


def test_secrets_stay_out_of_srun_argv(tmp_path):
    script = slurm.render_sbatch(job(size=2), None, None, 0, [])
    srun = next(ln for ln in script.splitlines() if ln.startswith("exec srun"))
    assert "s3cr3t" not in srun and "TORCHRIG_STEP" in srun
    # the batch script itself holds it (sent to sbatch on stdin)
    assert "s3cr3t" in script


def test_unknown_node_refused(tmp_path):
    step = step_of(slurm.render_sbatch(job(size=2), None, None, 0, []))
    r = subprocess.run(["bash", "-c", step + '\neval "$TORCHRIG_STEP"'], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": "gpu9",
                                       "SLURM_NODEID": "0"})
    assert r.returncode == 1 and "no torchrun for node gpu9" in r.stderr


@pytest.mark.parametrize("partition,time_limit", [("gpu;rm", None), ("-x", None), (None, "1h"),
                                                  (None, "1:00:00\n"), (None, "")])
def test_bad_partition_or_time_refused(partition, time_limit):
    with pytest.raises(TorchrigError, match="--partition|--time"):
        slurm.check_slurm_options(partition, time_limit)


@pytest.mark.parametrize("t", ["60", "1:00:00", "2-00:00:00", "UNLIMITED", "2-12"])
def test_good_time_limits(t):
    slurm.check_slurm_options("gpu", t)


def test_verify_node_checks_from_real_sinfo():
    idle = parse_sinfo(fixture("slurm_sinfo_02_testbed_2nodes_idle_22.05.txt"))
    assert [c.status for c in slurm_checks.node_checks(idle, ["gpu1", "gpu2"], {"gpu1": 2, "gpu2": 2})] == ["PASS", "PASS"]
    bad = slurm_checks.node_checks(idle, ["gpu1", "gpu3"], {"gpu1": 4})
    assert bad[0].status == "FAIL" and "GRES gpu:2 but verify found 4" in bad[0].detail
    assert bad[1].status == "FAIL" and "not registered" in bad[1].detail
    down = parse_sinfo(fixture("slurm_sinfo_03_testbed_node_powered_off_22.05.txt"))
    c = slurm_checks.node_checks(down, ["gpu2"], {"gpu2": 2})[0]
    assert c.status == "FAIL" and "down*" in c.detail and "Not responding" in c.detail


def test_verify_munge_and_srun_verdicts():
    ok = slurm_checks.munge_check({("gpu3", "gpu1"): (True, "Success (0)"),
                                   ("gpu1", "gpu3"): (True, "Success (0)")})
    assert ok.status == "PASS"
    bad = slurm_checks.munge_check({("gpu3", "gpu1"): (True, "Success (0)"),
                                    ("gpu1", "gpu3"): (False, "Invalid credential (6)")})
    assert bad.status == "FAIL" and "gpu1 -> gpu3: Invalid credential" in bad.detail
    assert slurm_checks.srun_check(0, "gpu1\ngpu2\n", "", ["gpu1", "gpu2"]).status == "PASS"
    f = slurm_checks.srun_check(1, "", "srun: error: Unable to allocate resources: timeout\n",
                                ["gpu1", "gpu2"])
    assert f.status == "FAIL" and "Unable to allocate" in f.detail


def test_verify_with_the_slurm_controller_unreachable_fails_the_cluster_check_not_the_report():
    """A dead controller ended verify with one error line and no table for any host."""
    from types import SimpleNamespace

    from torchrig.session import CannotConnect
    why = "unreachable: SSH to root@10.0.0.1:22 failed: connection refused (...)"

    class DeadController:  # the session's surface cluster_checks uses; every run fails to connect
        inv = SimpleNamespace(slurm=SimpleNamespace(controller="gpu1", compute=["gpu2", "gpu3"]),
                              host=lambda name: SimpleNamespace(name=name))

        def run(self, h, *a, **k):
            raise CannotConnect(h.name, why)

    checks = slurm_checks.cluster_checks(DeadController(), [SimpleNamespace(name="gpu2")], {"gpu2": 2})
    assert [(c.name, c.status, c.detail) for c in checks] == [("slurm", "FAIL", f"controller gpu1: {why}")]


def test_torchrun_waits_for_the_allocations_node_count_not_every_candidate(tmp_path):
    """--nodes 2 of 3 prepared compute hosts: each torchrun expects 2 nodes (it waited for a
    third that Slurm never started, until the rendezvous timeout)."""
    argv, _ = run_step(tmp_path, job(size=2), "gpu2", 0)
    assert argv[argv.index("--nnodes") + 1] == "2"


def test_an_elastic_job_keeps_its_allocation_and_meets_at_its_first_node(tmp_path):
    j = job(size=3, min_nodes=2)
    script = slurm.render_sbatch(j, None, None, 0, [])
    opts = [ln for ln in script.splitlines() if ln.startswith("#SBATCH ")]
    assert "#SBATCH --nodes=3" in opts and "#SBATCH --no-kill" in opts
    srun = next(ln for ln in script.splitlines() if ln.startswith("exec srun"))
    assert "--no-kill" in srun and "--kill-on-bad-exit" not in srun
    plain = slurm.render_sbatch(job(size=3), None, None, 0, [])
    assert "#SBATCH --nodes=3" in plain and "--no-kill" not in plain
    # each node's torchrun meets at the allocation's first node (the wrapper's list of
    # endpoints, TORCHRIG_RDZV_CANDIDATES, is the systemd units' alone)
    argv, step_env = run_step(tmp_path, j, "gpu3", 1)
    assert "TORCHRIG_RDZV_CANDIDATES" not in step_env
    assert argv == plan.torchrun_argv(j, j.nodes[2], "10.0.0.2:29412", False)
    assert argv[argv.index("--nnodes") + 1] == "2:3"
