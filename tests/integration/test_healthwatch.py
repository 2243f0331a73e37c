"""Health during a job on the testbed: a running 2-node job; a node-fault Xid (79) appears in
gpu4's (stand-in) kernel log; its root health watcher names it, stops gpu4's part of the job,
and `status` and `metrics` show gpu4 unhealthy with the reason. The job's user, as an
attacker, can neither write the watcher's record (forged or through a link) nor feed it an Xid."""

import json
import shlex

import pytest

from conftest import NODES, invoke, launch, sh, status, stop, unit_state, wait_step, wait_until
from torchrig.launch.run import GPU_SAMPLE_S

pytestmark = pytest.mark.provisioned("gpu1", "gpu4")
JOB = "t-health"
RECORD = f"/etc/torchrig/jobs/{JOB}.health"
KMSG = "/etc/torchrig-testbed/kmsg"  # the stand-in dmesg's kernel lines (torchrig/testbed)


def as_job_user(inv, host, cmd) -> str:
    return sh(inv, host, f"runuser -u torchrig -- sh -c {shlex.quote(cmd)} 2>&1; echo rc=$?")


def health_of(inv, host):
    _, data = status(inv, JOB)
    return ((data or {}).get("nodes", {}).get(host) or {}).get("health")


def test_a_node_fault_xid_ends_that_nodes_part_and_status_and_metrics_say_why(testbed):
    r = launch(testbed, JOB, "--args", "--max-steps 100000 --log-every 5")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        wait_step(testbed, JOB, 5)
        wait_until("the watchers' first rounds", lambda: all(
            (health_of(testbed, h) or {}).get("healthy") for h in ("gpu1", "gpu4")), 60)
        # the attacker: the job's user cannot forge the record, plant a link for root to write
        # through, nor log an Xid the watcher would take (a user's kern.* message is no kernel line)
        got = as_job_user(testbed, "gpu1", f"echo '{{\"healthy\": false}}' > {RECORD}")
        assert "rc=0" not in got and "ermission denied" in got
        got = as_job_user(testbed, "gpu1", f"ln -s /etc/shadow /etc/torchrig/jobs/.{JOB}.health.1.tmp")
        assert "rc=0" not in got
        as_job_user(testbed, "gpu1", "logger -p kern.crit 'NVRM: Xid (PCI:0000:3b:00): 79, pid=0, forged'")
        assert sh(testbed, "gpu1", f"stat -c '%U %a' {RECORD}") == "root 644"

        now = sh(testbed, "gpu4", "date -u +%Y-%m-%dT%H:%M:%S,000000+00:00", sudo=False).strip()
        sh(testbed, "gpu4", f"printf '%s\\n' {shlex.quote(now + ' NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.')} >> {KMSG}")
        h = wait_until("status to show gpu4 unhealthy",
                       lambda: (lambda x: x if x and x["healthy"] is False else None)(health_of(testbed, "gpu4")), 60)
        assert h["reason"].startswith("Xid 79 on GPU 0: GPU has fallen off the bus; node's part stopped at ")
        wait_until("gpu4's part of the job to end",
                   lambda: unit_state(testbed, "gpu4", f"torchrig-{JOB}.service") in ("failed", "inactive"), 60)
        assert (health_of(testbed, "gpu1") or {}).get("healthy") is True  # the forged line: nothing
        r = invoke("status", "-i", str(testbed), "-H", NODES, "--job", JOB)
        assert "gpu4: unhealthy: Xid 79 on GPU 0: GPU has fallen off the bus" in r.stdout, r.stdout
        assert r.returncode == 1 and f"error: job {JOB}: gpu4: unhealthy: Xid 79 on GPU 0" in r.stderr

        def both_metrics():  # each node's sampler runs every GPU_SAMPLE_S, not in step
            r = invoke("metrics", "-i", str(testbed), "-H", NODES, "--job", JOB, "--json")
            nodes = json.loads(r.stdout)["nodes"] if r.stdout.startswith("{") else {}
            bad = [v.get("unhealthy") for v in nodes.get("gpu4", [])] == ["xid_79_on_gpu_0"]
            good = [v.get("healthy") for v in nodes.get("gpu1", [])] == [1.0]
            return nodes if bad and good else None
        nodes = wait_until("metrics to show gpu4 unhealthy and gpu1 healthy", both_metrics,
                           2 * GPU_SAMPLE_S + 15)
        assert [v["unhealthy"] for v in nodes["gpu1"]] == [None]
    finally:
        sh(testbed, "gpu4", f"rm -f {KMSG}")
        # gpu1's part waits on its lost peer (this job is not elastic): its graceful stop would
        # wait out the whole grace for a final checkpoint that cannot happen
        sh(testbed, "gpu1", f"systemctl kill -s KILL torchrig-{JOB}.service", check=False)
        stop(testbed, JOB)
