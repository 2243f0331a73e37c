"""Issue 22 (5): `torchrig jobs` and `jobs --prune` on real systemd (gpu1/gpu4, the CPU payload):
the states a job can end in (succeeded, stopped, failed) and a running one, one row per job
across its nodes; the GPU sampler's timer ends with its job; prune removes an ended job's
files, leaves a running job alone, and removes a log folder without following a symlink the
job could have planted. Four launches (about 3-5 minutes on an idle 2-core machine)."""

import json
import secrets
import time

import pytest

from conftest import NODES, WORKER, invoke, launch, sh, sh_each, stop, wait_step, wait_unit_ended

pytestmark = pytest.mark.provisioned("gpu1", "gpu4")

HOSTS = NODES.split(",")
TAG = secrets.token_hex(2)  # job names of this run's own: a rerun on the same testbed starts clean
OK, STOPPED, FAILED, RUNNING = (f"jb-{w}-{TAG}" for w in ("ok", "stop", "fail", "run"))
LONG = "--max-steps 100000 --log-every 5 --ckpt-every 100000 --init-timeout 60"


def jobs(inv, *flags):
    r = invoke("jobs", "-i", str(inv), "-H", NODES, "--json", *flags, timeout=300)
    assert r.stdout.strip().startswith("{"), r.stdout + r.stderr
    doc = json.loads(r.stdout)
    return r, doc, {row["job"]: row for row in doc["jobs"]}


def ended_everywhere(inv, job):
    for h in HOSTS:
        wait_unit_ended(inv, h, f"torchrig-{job}.service", timeout=300)


def test_a_job_that_finished_reads_succeeded_and_its_sampler_timer_stopped(testbed):
    r = launch(testbed, OK, "--args", "--max-steps 3 --log-every 1")
    assert r.returncode == 0, r.stdout + r.stderr
    ended_everywhere(testbed, OK)
    for h in HOSTS:  # BindsTo=: the timer ended with the job's unit, it fires no more
        assert sh(testbed, h, f"systemctl is-active torchrig-gpumon@{OK}.timer",
                  check=False) == "inactive"
    seen_inactive = time.monotonic()
    r, doc, rows = jobs(testbed)
    assert r.returncode == 0, r.stderr
    row = rows[OK]
    assert row["state"] == "succeeded" and row["nodes"] == {h: "succeeded" for h in HOSTS}, row
    assert row["step"] == "3" and row["loss"], row
    assert row["workdir"].startswith("/opt/torchrig/payload/releases/"), row
    assert row["backend"] == "systemd" and row["running_s"] is None
    # systemd still has the ended unit's times (torchrig-ended@ keeps it loaded), after the
    # timer is gone: when it ended, when it started
    assert row["ended_at"] and row["started_at"] and row["started_at"] <= row["ended_at"], row
    for h in HOSTS:
        assert sh(testbed, h, f"systemctl is-active torchrig-ended@{OK}.service",
                  check=False) == "active"
    # more than one sampling interval since the timer was seen ended (the checks above
    # count towards it): still not started again
    time.sleep(max(0.0, seen_inactive + 35 - time.monotonic()))
    for h in HOSTS:
        assert sh(testbed, h, f"systemctl is-active torchrig-gpumon@{OK}.timer",
                  check=False) == "inactive"


def test_a_running_job_then_stopped_reads_stopped_not_finished(testbed):
    r = launch(testbed, STOPPED, "--args", LONG)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_step(testbed, STOPPED, 5)
    _, _, rows = jobs(testbed)
    row = rows[STOPPED]
    assert row["state"] == "running" and row["ended_at"] is None and row["running_s"] > 0, row
    assert int(row["step"]) >= 5 and row["started_at"], row
    # the table too: one row, its state and its running time
    t = invoke("jobs", "-i", str(testbed), "-H", NODES, timeout=300)
    assert t.returncode == 0 and STOPPED in t.stdout and "running for" in t.stdout, t.stdout
    assert stop(testbed, STOPPED).returncode == 0
    _, _, rows = jobs(testbed)
    row = rows[STOPPED]
    assert row["state"] == "stopped" and set(row["nodes"].values()) == {"stopped"}, row
    assert row["ended_at"] is not None, row
    for h in HOSTS:  # stop's record: root's, 0644
        assert sh(testbed, h, f"stat -c '%U %a' /etc/torchrig/jobs/{STOPPED}.stopped") == "root 644"
    # a second stop of the ended job changes nothing
    assert stop(testbed, STOPPED).returncode == 0
    assert jobs(testbed)[2][STOPPED]["state"] == "stopped"


def test_a_job_whose_worker_died_reads_failed(testbed):
    r = launch(testbed, FAILED, "--max-restarts", "0", "--args", LONG)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_step(testbed, FAILED, 5)
    pid = sh(testbed, "gpu4", f"pgrep -f {WORKER} | tail -1")
    sh(testbed, "gpu4", f"kill -KILL {pid}")
    assert wait_unit_ended(testbed, "gpu4", f"torchrig-{FAILED}.service") == "failed"
    _, _, rows = jobs(testbed)
    assert rows[FAILED]["state"] == "failed", rows[FAILED]
    ended_everywhere(testbed, FAILED)  # gpu1's group gives up within its init timeout
    assert jobs(testbed)[2][FAILED]["state"] == "failed"


def test_prune_keeps_a_running_job_and_never_follows_a_planted_symlink(testbed):
    r = launch(testbed, RUNNING, "--args", LONG)
    assert r.returncode == 0, r.stdout + r.stderr
    # what a hostile job could plant: its log folder replaced by a symlink to a root folder,
    # and inside another job's folder a symlink to another root folder
    for h in HOSTS:
        sh(testbed, h, f"mkdir -p /etc/victim-{TAG}/in && echo keep > /etc/victim-{TAG}/file "
                       f"&& echo keep > /etc/victim-{TAG}/in/file && "
                       f"rm -rf /var/log/torchrig/{OK} && ln -s /etc/victim-{TAG} /var/log/torchrig/{OK} && "
                       f"chown -h torchrig: /var/log/torchrig/{OK} && "
                       f"ln -s /etc/victim-{TAG}/in /var/log/torchrig/{FAILED}/planted && "
                       f"chown -h torchrig: /var/log/torchrig/{FAILED}/planted")
    bad = invoke("jobs", "-i", str(testbed), "-H", NODES, "--with-logs")
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error:") \
        and "Traceback" not in bad.stderr, bad.stderr
    r, doc, rows = jobs(testbed, "--prune", "--with-logs")
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(doc["prune"]["planned"]) >= {OK, STOPPED, FAILED} and RUNNING not in doc["prune"]["planned"]
    assert "never pruned" in doc["prune"]["kept"][RUNNING]
    for h in HOSTS:
        assert set(doc["prune"]["nodes"][h]["pruned"]) >= {OK, STOPPED, FAILED}, doc["prune"]
        cmds = {"timers": "systemctl list-timers --all --no-pager",
                # the planted links were removed, never followed
                "victim": f"cat /etc/victim-{TAG}/file /etc/victim-{TAG}/in/file",
                # the running job: untouched, still running, files in place
                "running": f"systemctl is-active torchrig-{RUNNING}.service",
                "running files": f"ls /etc/torchrig/jobs/{RUNNING}.env /var/log/torchrig/{RUNNING} "
                                 ">/dev/null && echo ok"}
        for job in (OK, STOPPED, FAILED):
            cmds[job, "left"] = (f"ls /etc/systemd/system/torchrig-{job}.service "
                                 f"/etc/systemd/system/torchrig-gpumon@{job}.timer "
                                 f"/etc/systemd/system/torchrig-gpumon@{job}.service "
                                 f"/etc/systemd/system/torchrig-ended@{job}.service "
                                 f"/etc/torchrig/jobs/{job}.env /etc/torchrig/jobs/{job}.run "
                                 f"/etc/torchrig/jobs/{job}.stopped 2>/dev/null || true")
            cmds[job, "logs"] = f"test -e /var/log/torchrig/{job} && echo there || echo gone"
        got = sh_each(testbed, h, cmds)
        for job in (OK, STOPPED, FAILED):
            assert got[job, "left"] == "", (h, job, got[job, "left"])
            assert job not in got["timers"], (h, job, got["timers"])
            assert got[job, "logs"] == "gone", (h, job)
        assert got["victim"] == "keep\nkeep", (h, got["victim"])
        assert got["running"] == "active", (h, got["running"])
        assert got["running files"] == "ok", (h, got["running files"])
    rows = jobs(testbed)[2]
    assert RUNNING in rows and not {OK, STOPPED, FAILED} & set(rows)
    assert stop(testbed, RUNNING).returncode == 0
    # checkpoints were kept (not asked for): the stopped job's folder is still there
    assert sh(testbed, "gpu1", f"test -d /srv/torchrig/checkpoints/{STOPPED} && echo kept") == "kept"
    r, doc, _ = jobs(testbed, "--prune", "--with-checkpoints")
    assert r.returncode == 0 and RUNNING in doc["prune"]["planned"], r.stdout + r.stderr
    assert sh(testbed, "gpu1", f"test -d /srv/torchrig/checkpoints/{RUNNING} && echo kept || echo gone") == "gone"
    assert sh(testbed, "gpu1", f"test -d /var/log/torchrig/{RUNNING} && echo kept") == "kept"
