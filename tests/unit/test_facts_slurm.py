"""torchrig.facts.slurm against real sinfo/squeue/unmunge output (Slurm 22.05 on the testbed)."""

from __future__ import annotations

import pytest

from _fixtures import fixture
from torchrig.facts import slurm


def test_sinfo_idle_nodes_with_their_gpu_gres():
    nodes = slurm.parse_sinfo(fixture("slurm_sinfo_02_testbed_2nodes_idle_22.05.txt"))
    assert sorted(nodes) == ["gpu1", "gpu2"]
    assert all(n.idle and n.gpus == 2 and n.reason == "none" for n in nodes.values())


def test_sinfo_mixed_is_not_idle():
    nodes = slurm.parse_sinfo(fixture("slurm_sinfo_01_testbed_2nodes_mixed_22.05.txt"))
    assert [n.state for n in nodes.values()] == ["mixed", "mixed"]
    assert not any(n.idle for n in nodes.values())


def test_sinfo_down_and_suffixes_kept():
    nodes = slurm.parse_sinfo("gpu1|down*|gpu:a100:4(S:0-1)|Not responding\n"
                              "gpu2|idle~|(null)|none\nbroken line\n")
    assert nodes["gpu1"].state == "down*" and nodes["gpu1"].gpus == 4
    assert nodes["gpu1"].reason == "Not responding"
    assert nodes["gpu2"].gpus == 0 and not nodes["gpu2"].idle
    assert len(nodes) == 2


@pytest.mark.parametrize("gres,n", [("gpu:v100s:2", 2), ("gpu:2", 2), ("(null)", 0),
                                    ("gpu:a100:2,gpu:t4:1,shard:8", 3),
                                    ("gpu:h100:8(S:0,1)", 8), ("mps:100", 0)])
def test_gres_gpus(gres, n):
    assert slurm.gres_gpus(gres) == n


def test_squeue_cancelled_and_running_jobs():
    text = fixture("slurm_squeue_01_testbed_cancelled_running_22.05.txt")
    done = slurm.parse_squeue(text, "1")
    assert (done.state, done.nodes, done.live) == ("CANCELLED", ["gpu1", "gpu2"], False)
    run = slurm.parse_squeue(text, "2")
    assert run.live and run.nodes == ["gpu1", "gpu2"]
    assert slurm.parse_squeue(text, "3") is None


def test_squeue_pending_job_has_no_nodes():
    j = slurm.parse_squeue("7|PENDING||Resources|torchrig-x|torchrig|n/a\n", "7")
    assert j.nodes == [] and j.live and j.reason == "Resources"


def test_sacct_state_without_by_uid():
    j = slurm.parse_sacct("12|CANCELLED by 999|gpu[1-2]|None\n12.batch|CANCELLED|gpu1|\n", "12")
    assert (j.state, j.nodes) == ("CANCELLED", ["gpu1", "gpu2"])
    assert slurm.parse_sacct("Slurm accounting storage is disabled\n", "12") is None


@pytest.mark.parametrize("spec,names", [
    ("gpu[1-2]", ["gpu1", "gpu2"]), ("gpu1", ["gpu1"]), ("", []),
    ("gpu[1-3,7],cpu01", ["gpu1", "gpu2", "gpu3", "gpu7", "cpu01"]),
    ("n[08-10]", ["n08", "n09", "n10"]), ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
])
def test_expand_hostlist_like_scontrol_show_hostnames(spec, names):
    assert slurm.expand_hostlist(spec) == names


def test_sbatch_parsable():
    assert slurm.parse_sbatch("42\n") == "42"
    assert slurm.parse_sbatch("42;tb\n") == "42"
    assert slurm.parse_sbatch("sbatch: error: Batch job submission failed\n") is None
    assert slurm.parse_sbatch("") is None


def test_unmunge_success_and_failure():
    assert slurm.unmunge_ok(fixture("slurm_unmunge_01_testbed_success.txt")) == (True, "Success (0)")
    ok, why = slurm.unmunge_ok(fixture("slurm_unmunge_02_garbage.txt").split("\n\n")[-1])
    assert not ok and "armor" in why
    assert slurm.unmunge_ok("STATUS:          Invalid credential (6)\n") == (False, "Invalid credential (6)")
