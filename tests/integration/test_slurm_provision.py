"""Slurm on the testbed: real slurmctld, slurmd and munge (Debian's packages, served by the
testbed's mirror) set up by provision from the inventory's `slurm:` section."""

import base64
import re
import shlex

import pytest
import yaml

from conftest import provision, sh, steps_of, wait_slurm_idle

pytestmark = pytest.mark.provisioned("gpu1", "gpu3", "gpu4")


def test_provision_sets_up_slurm_and_a_second_run_changes_nothing(slurm_cluster):
    """One `provision --yes --reboot` (the fixture's) makes the cluster, though every compute
    node's driver loaded only after its reboot: what waited for the drivers ran then."""
    c = slurm_cluster
    _, data = c.first
    for h in c.compute:
        rep, st = steps_of(data, h)
        assert rep["rebooted"] is True and rep["ok"], rep
        assert st["slurm-config"]["status"] == "changed"
        assert "restart slurmd.service (its config changed)" in st["slurm-config"]["changes"]
    _, st = steps_of(data, c.controller)
    assert "restart slurmctld.service (its config changed)" in st["slurm-config"]["changes"]
    # both compute nodes idle, each with the GPUs of its profile (two V100S, File=/dev/nvidia[0-1])
    rows = dict(ln.split(None, 1) for ln in wait_slurm_idle(c).splitlines())
    assert rows == {h: "idle gpu:v100s:2" for h in c.compute}, rows
    conf = c.run("cat /etc/slurm/slurm.conf")
    assert "ProctrackType=proctrack/linuxproc" in conf and f"PartitionName={c.partition} Nodes=gpu1,gpu4" in conf
    # the same slurm.conf everywhere (slurmd refuses a differing one)
    assert {sh(c.inv, h, "sha256sum /etc/slurm/slurm.conf").split()[0] for h in c.compute} == \
        {c.run("sha256sum /etc/slurm/slurm.conf").split()[0]}
    # Debian's own packages, from the testbed's site mirror of them (the hosts have no route out)
    assert re.search(r"\*\*\* 22\.05\.8-4\+deb12u3 \d+\n\s+\d+ http://[\d.]+:8080/debian/?\s",
                     sh(c.inv, "gpu1", "apt-cache policy slurmd", sudo=False))
    assert sh(c.inv, "gpu1", "apt-mark showhold | grep -E '^(munge|slurmd|slurm-client)$' | sort").split() == \
        ["munge", "slurm-client", "slurmd"]
    r, again = provision(c.inv, c.hosts, "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(rep["host"], rep["changed"]) for rep in again] == [(h, 0) for h in c.hosts.split(",")]


def test_munge_key_is_shared_and_never_shown_in_argv_or_a_readable_file(slurm_cluster):
    c = slurm_cluster
    key = c.run("cat /etc/munge/munge.key")
    assert len(key) >= 128
    forms = [key, base64.b64encode(key.encode()).decode()]
    for h in c.hosts.split(","):
        assert sh(c.inv, h, "stat -c '%a %U %G' /etc/munge/munge.key") == "400 munge munge"
        assert sh(c.inv, h, "sha256sum < /etc/munge/munge.key") == c.run("sha256sum < /etc/munge/munge.key")
        # any world-readable file holding it (patterns read from the key file: not in argv)
        # (where a host's own writes go; the venv and /usr hold only packages' files)
        leaked = sh(c.inv, h, "find /etc /var /tmp /run /root /home /srv /opt -xdev -path /opt/torchrig/venv "
                              "-prune -o -type f -perm -o=r -size -4M -print0 "
                              "| xargs -0 grep -lF -f /etc/munge/munge.key || true")
        assert leaked == "", leaked
    # one key: a credential made on a compute node decodes on the controller
    cred = sh(c.inv, "gpu1", "munge -n", sudo=False).strip()
    assert "STATUS:          Success (0)" in c.run(f"printf %s {shlex.quote(cred)} | unmunge", sudo=False)
    # the sampler was running while the key went out (it saw provision's root scripts run)
    assert any(re.search(r"\bbash -s\b", a) for a in c.argv), "the argv sampler saw no root script"
    assert not [a[:200] for a in c.argv if any(f in a for f in forms)]
    out = c.first[0].stdout + c.first[0].stderr
    assert not any(f in out for f in forms)


def test_a_partition_change_reconfigures_without_restarting_a_daemon(slurm_cluster, tmp_path):
    c = slurm_cluster
    pids = {h: sh(c.inv, h, f"systemctl show -p MainPID --value {u}")
            for h, u in [(c.controller, "slurmctld"), *[(h, "slurmd") for h in c.compute]]}
    doc = yaml.safe_load(c.inv.read_text())
    doc["slurm"] = {**doc["slurm"], "partition": "renamed"}
    renamed = tmp_path / "renamed.yml"
    renamed.write_text(yaml.safe_dump(doc))
    try:
        r, data = provision(renamed, c.hosts, "--yes")
        assert r.returncode == 0, r.stdout + r.stderr
        _, st = steps_of(data, c.controller)
        assert st["slurm-config"]["changes"] == ["write /etc/slurm/slurm.conf (mode 0644, root:root)",
                                                 "scontrol reconfigure (partitions changed)"]
        for h in c.compute:
            assert steps_of(data, h)[1]["slurm-config"]["changes"] == [
                "write /etc/slurm/slurm.conf (mode 0644, root:root)"]
        assert c.run("sinfo -h -o %R").split() == ["renamed"]
        assert {h: sh(c.inv, h, f"systemctl show -p MainPID --value {u}")
                for h, u in [(c.controller, "slurmctld"), *[(h, "slurmd") for h in c.compute]]} == pids
    finally:  # the session's cluster as the other tests expect it
        r, _ = provision(c.inv, c.hosts, "--yes")
        assert r.returncode == 0, r.stdout + r.stderr
    assert c.run("sinfo -h -o %R").split() == [c.partition]
    wait_slurm_idle(c)
