"""Jobs through Slurm on the session's Slurm cluster (conftest's slurm_cluster: controller
gpu3, compute gpu1 and gpu4): `launch --backend slurm`, then the same logs/status/stop as the
systemd launcher, and verify's cluster checks. About 4 minutes on an idle 2-core machine."""

import json
import re
import time

import pytest

from conftest import WORKER, invoke, launch, logs, sh, status, stop, wait_slurm_idle, wait_step, wait_until

pytestmark = pytest.mark.provisioned("gpu1", "gpu3", "gpu4")


def slurm_launch(c, job, *args, timeout=400):
    return launch(c.inv, job, "--backend", "slurm", "--nodes", "2", "--nproc-per-node", "2",
                  *args, hosts=",".join(c.compute), timeout=timeout)


def slurm_state(c, job) -> str:
    return c.run(f"squeue -h -t all -n torchrig-{job} -o %T", sudo=False, check=False).strip()


def test_verify_checks_the_slurm_cluster(slurm_cluster):
    c = slurm_cluster
    r = invoke("verify", "-i", str(c.inv), "-H", ",".join(c.compute), "--json", timeout=400)
    checks = {ch["check"]: ch for ch in json.loads(r.stdout)["slurm"]}
    assert set(checks) == {"slurm node gpu1", "slurm node gpu4", "munge", "slurm srun"}, checks
    assert all(ch["status"] == "PASS" for ch in checks.values()), checks
    assert checks["slurm srun"]["detail"] == "ran on gpu1, gpu4"
    assert "4 credential(s) decoded" in checks["munge"]["detail"]


def test_stop_checkpoints_and_cancels_then_relaunch_resumes_and_completes(slurm_cluster):
    c = slurm_cluster
    r = slurm_launch(c, "sl-ddp", "--args", "--max-steps 100000 --log-every 5 --ckpt-every 100000")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = re.search(r"started as slurm job (\d+) on gpu1,gpu4 \(2 node\(s\) x 2", r.stdout).group(1)
    wait_step(c.inv, "sl-ddp", 5, hosts=",".join(c.compute))
    r, st = status(c.inv, "sl-ddp", hosts="gpu1")  # the job's own nodes, whatever is selected
    assert r.returncode == 0 and st["slurm"] == {"job_id": job_id, "state": "RUNNING",
                                                 "nodes": ["gpu1", "gpu4"], "reason": "None"}, r.stdout
    assert sorted(st["nodes"]) == ["gpu1", "gpu4"]
    r = stop(c.inv, "sl-ddp", hosts="gpu1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"slurm job {job_id}) CANCELLED on gpu1,gpu4: no process of it left" in r.stdout
    assert slurm_state(c, "sl-ddp") == "CANCELLED"
    for h in c.compute:
        assert sh(c.inv, h, f"pgrep -f {WORKER} || true") == ""
    out = logs(c.inv, "sl-ddp", hosts="gpu1").stdout
    stopped = int(re.search(r"^\[gpu\d/r0\] signal SIGTERM received: stopping after step (\d+)",
                            out, re.M).group(1))
    assert re.search(rf"^\[gpu\d/r0\] ckpt step={stopped} ", out, re.M), out[-2000:]
    first_loss = float(re.search(r"^\[gpu\d/r0\] step=\d+ loss=([\d.]+)", out, re.M).group(1))

    # the same job again: resumes from that checkpoint and runs to the end
    r = slurm_launch(c, "sl-ddp", "--args", f"--max-steps {stopped + 30} --log-every 10")
    assert r.returncode == 0, r.stdout + r.stderr
    job2 = re.search(r"slurm job (\d+)", r.stdout).group(1)
    out = logs(c.inv, "sl-ddp", "-f", hosts="gpu1", timeout=300).stdout
    assert re.search(rf"^\[gpu\d/r0\] resume step={stopped} ", out, re.M), out[-2000:]
    assert re.search(rf"^\[gpu\d/r0\] done step={stopped + 30} ", out, re.M), out[-2000:]
    # every rank of the second run, prefixed with its node and global rank
    # (which node gets ranks 0-1 is the c10d rendezvous' choice)
    seen = set(re.findall(r"^\[(gpu[14])/r(\d)\] start rank=", out, re.M))
    assert {r for _, r in seen} == {"0", "1", "2", "3"} and {h for h, _ in seen} == {"gpu1", "gpu4"}, out[-3000:]
    last_loss = float(re.findall(r"^\[gpu\d/r0\] done step=\d+ loss=([\d.]+)", out, re.M)[-1])
    assert last_loss < first_loss
    r, st = status(c.inv, "sl-ddp")
    assert st["slurm"]["job_id"] == job2 and st["slurm"]["state"] == "COMPLETED", r.stdout


def test_jobs_lists_a_slurm_job_running_then_stopped(slurm_cluster):
    """`torchrig jobs` (issue 22): a Slurm job's row from the controller's record and Slurm's
    state, with rank 0's last step from its nodes' logs."""
    c = slurm_cluster
    r = slurm_launch(c, "sl-jobs", "--args", "--max-steps 100000 --log-every 5 --ckpt-every 100000")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = re.search(r"slurm job (\d+)", r.stdout).group(1)
    wait_step(c.inv, "sl-jobs", 5, hosts=",".join(c.compute))

    def row():
        r = invoke("jobs", "-i", str(c.inv), "-H", ",".join(c.compute), "--json", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return next(j for j in json.loads(r.stdout)["jobs"] if j["job"] == "sl-jobs")
    got = row()
    assert (got["backend"], got["state"], got["slurm_id"]) == ("slurm", "running", job_id), got
    assert sorted(got["nodes"]) == ["gpu1", "gpu4"] and int(got["step"]) >= 5, got
    assert stop(c.inv, "sl-jobs", hosts="gpu1").returncode == 0
    got = row()
    assert got["state"] == "stopped" and set(got["nodes"].values()) == {"CANCELLED"}, got


def test_compute_node_powered_off_fails_the_job_in_bounded_time_and_is_named(slurm_cluster):
    from torchrig.testbed import machines
    from conftest import ip_of
    c = slurm_cluster
    r = slurm_launch(c, "sl-power", "--max-restarts", "1", "--rdzv-timeout", "30",
                     "--args", "--max-steps 100000 --log-every 5 --init-timeout 60")
    assert r.returncode == 0, r.stdout + r.stderr
    wait_step(c.inv, "sl-power", 5, hosts=",".join(c.compute))
    machines.power_off("gpu4")
    t0 = time.monotonic()
    try:
        # slurmctld: the node stops answering (SlurmdTimeout: the cluster's node_timeout, 30 s),
        # the job fails (no requeue)
        state = wait_until("the Slurm job to end", lambda: (
            s if (s := slurm_state(c, "sl-power")) not in ("RUNNING", "COMPLETING", "") else None),
            timeout=300, interval=3)
        took = time.monotonic() - t0
        assert state == "NODE_FAIL", state
        r, st = status(c.inv, "sl-power")
        assert r.returncode == 1 and st["slurm"]["state"] == "NODE_FAIL"
        assert st["lost_nodes"] == ["gpu4"] and "error" in st["nodes"]["gpu4"]
        r = logs(c.inv, "sl-power", "--failures")
        assert "node(s) gpu4 lost" in r.stdout, r.stdout + r.stderr
        print(f"the Slurm job ended {took:.0f}s after the power-off")
        # the survivor's ranks are gone too (slurmd ends the failed job's steps)
        wait_until("no rank left on gpu1", lambda: sh(c.inv, "gpu1", f"pgrep -f {WORKER} || true") == "",
                   timeout=60)
    finally:
        machines.stop("gpu4")
        machines.start("gpu4")
        machines.wait_ssh(ip_of(c.inv, "gpu4"), timeout=120)
        wait_slurm_idle(c, timeout=180)


def test_an_elastic_job_keeps_its_allocation_when_a_node_is_lost_and_trains_on(slurm_cluster):
    """`--nodes 1:2` through Slurm (issue 25): gpu4 (not the batch script's node) powered off;
    the survivors meet again without it and train on from the last checkpoint with the global
    batch unchanged, and Slurm keeps the job (--no-kill) after it marked gpu4 down, where a
    plain job ends NODE_FAIL (the test above)."""
    from torchrig import progress
    from torchrig.testbed import machines
    from conftest import ip_of
    c = slurm_cluster
    job = "sl-elastic"
    r = launch(c.inv, job, "--backend", "slurm", "--nodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-timeout", "40", "--args", "--max-steps 1000000 --log-every 5 "
               "--ckpt-every 10 --global-batch 32 --init-timeout 60", hosts=",".join(c.compute))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "elastic (1:2 nodes): Slurm keeps the job when a node is lost (--no-kill)" in r.stdout

    def world(nodes, after=-1):
        """rank 0's newest world line on `nodes` nodes past step `after` (a loaded machine may
        start gpu4's torchrun after the first world formed on gpu1 alone: then it joins)."""
        r = logs(c.inv, job, "--rank", "0", "--grep", "^world ", hosts=",".join(c.compute))
        got = [w for w in (progress.parse_world(ln.split("] ", 1)[-1].strip())
                           for ln in r.stdout.splitlines())
               if w and w["nodes"] == nodes and w["step"] > after]
        return got and got[-1]
    try:
        try:
            first = wait_until("the world line on 2 nodes", lambda: world(2), 240, interval=3)
        except AssertionError as e:
            seen = logs(c.inv, job, "--rank", "0", "--grep", "^world ", hosts=",".join(c.compute))
            raise AssertionError(f"{e}\nlaunch: {r.stdout}\nworld lines: {seen.stdout[-1500:]}"
                                 f"\nslurm: {slurm_state(c, job)}\n" + c.run(
                                     "squeue -h -t all -o '%i %T %D %N'", check=False) + logs(
                c.inv, job, "--failures", hosts=",".join(c.compute)).stdout[-3000:]) from None
        assert (first["world_size"], first["global_batch"], first["grad_accum"]) == (4, 32, 1)
        before = wait_step(c.inv, job, first["step"] + 12, hosts=",".join(c.compute))
        machines.power_off("gpu4")
        w = wait_until("the world line on 1 node", lambda: world(1, first["step"]), 180, interval=3)
        assert (w["world_size"], w["global_batch"], w["grad_accum"], w["from"]) == (2, 32, 2, 4)
        assert before // 10 * 10 - 10 <= w["step"] <= before + 10  # from the last checkpoint
        wait_until("slurmctld to mark gpu4 down", lambda: "down" in c.run(
            "sinfo -h -n gpu4 -o %T", sudo=False, check=False), 150, interval=3)
        assert slurm_state(c, job) == "RUNNING"
        wait_step(c.inv, job, w["step"] + 10, hosts="gpu1")  # and it trains on
        assert slurm_state(c, job) == "RUNNING"
        r, st = status(c.inv, job, hosts="gpu1")
        assert st["elastic"]["state"] == "running on 1 of 2 nodes (min 1)", r.stdout
        r = stop(c.inv, job, hosts="gpu1")
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        if slurm_state(c, job) in ("RUNNING", "PENDING", "COMPLETING"):
            c.run(f"scancel -n torchrig-{job}", check=False)
        machines.stop("gpu4")
        machines.start("gpu4")
        machines.wait_ssh(ip_of(c.inv, "gpu4"), timeout=120)
        wait_slurm_idle(c, timeout=180)


def test_an_unhealthy_node_is_drained_with_the_reason_and_health_resume_resumes_it(slurm_cluster):
    """gpu4's GPU 0 failed a row remap: launch refuses and drains it; `health --resume`
    refuses while it is unhealthy, resumes it once fixed."""
    c = slurm_cluster
    sh(c.inv, "gpu4", """printf %s '{"0": {"remap_failure": true}}' > /etc/torchrig-testbed/health.json""")
    try:
        r = slurm_launch(c, "t-sl-unhealthy", "--script", "env_check.py")
        assert r.returncode == 1 and "unhealthy node(s): gpu4: memory: GPU 0: row remapping failed" in r.stderr
        assert "drained Slurm node gpu4" in r.stderr
        reason = c.run("sinfo -h -R -o '%n|%E'", check=False)
        assert "gpu4|torchrig health: memory: GPU 0: row remapping failed" in reason, reason
        r = invoke("health", "-i", str(c.inv), "--resume", "gpu4")
        assert r.returncode == 1 and "--resume gpu4: its health is still FAIL" in r.stderr
    finally:
        sh(c.inv, "gpu4", "rm -f /etc/torchrig-testbed/health.json")
    r = invoke("health", "-i", str(c.inv), "--resume", "gpu4")
    assert r.returncode == 0 and "resumed Slurm node gpu4" in r.stderr, r.stderr
    wait_slurm_idle(c)
