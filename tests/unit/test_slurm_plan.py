"""Slurm provision, pure parts: slurm.conf/gres.conf rendered from fact tables, the shared munge
key, what a config change restarts, and the inventory's `slurm:` section errors."""

import hashlib
import json

import pytest

from torchrig import inventory
from torchrig.changes import managed
from torchrig.changes.model import FileChange
from torchrig.provision import slurm, steps
from torchrig.settings import settings_for

LSCPU = json.dumps({"lscpu": [{"field": "CPU(s):", "data": "16"}, {"field": "Socket(s):", "data": "2"},
                              {"field": "Core(s) per socket:", "data": "4"},
                              {"field": "Thread(s) per core:", "data": "2"}]})
V100_SMI = {"rc": 0, "output": "0, Tesla V100S-PCIE-32GB, 570.172.08\n1, Tesla V100S-PCIE-32GB, 570.172.08"}
H100_SMI = {"rc": 0, "output": "\n".join(f"{i}, NVIDIA H100 80GB HBM3, 570.172.08" for i in range(8))}
SPEC = inventory.Slurm(controller="head", compute=("gpu1", "gpu2"), partition="gpu",
                       cluster_name="lab", cgroup=True, node_timeout=60)


def node(hostname, **over):
    n = {"hostname": hostname, "cpu": {"cpus": 16, "sockets": 2, "cores": 4, "threads": 2},
         "mem_mib": 257000, "dev-nvidia": [f"/dev/nvidia{i}" for i in range(8)],
         "libnvidia-ml": [], "slurm-gpu-nvml": []}
    return {**n, **over}


def raw(hostname, smi=V100_SMI, key=None, files=None, units=None, dirs=None, **node_over):
    return {"os_release": "", "arch": "x86_64", "euid": 0, "disk_free_gb": 100.0, "lspci": "",
            "secure_boot": False, "packages": {}, "held": [], "available": {}, "dpkg_audit": "",
            "dpkg_updates_pending": False, "dirs": dirs or {}, "paths": {}, "users": {},
            "units": units or {}, "nvidia_smi": smi, "venv": {"python": None, "dists": {}},
            "boot_id": "b", "node": node(hostname, **node_over),
            "firewall": {"loaded": False, "ephemeral": "32768 60999"},
            "files": {managed.MUNGE_KEY.path(): key and {"sha256": key, "mode": 0o400,
                                                         "owner": "munge", "group": "munge"},
                      **(files or {})}}


def ctx(host, facts, cluster=None):
    return steps.Ctx(facts, settings_for(host, {}, "inv.yml"), host, [], cluster=cluster)


def cluster_facts(**per_host):
    base = {"head": raw("head", smi={"rc": 127, "output": "nvidia-smi: not found"}),
            "gpu1": raw("gpu1.lab.example"),
            "gpu2": raw("gpu2", smi=H100_SMI, **{"libnvidia-ml": ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"],
                                                 "slurm-gpu-nvml": ["/usr/lib/x86_64-linux-gnu/slurm-wlm/gpu_nvml.so"]})}
    base.update(per_host)
    return {h: ctx(h, f).facts for h, f in base.items()}


def test_gpu_type_names_from_nvidia_smi():
    assert [slurm.gpu_type(n) for n in ("Tesla V100S-PCIE-32GB", "NVIDIA H100 80GB HBM3",
                                        "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090",
                                        "NVIDIA RTX A6000", "NVIDIA L4")] == \
        ["v100s", "h100", "a100", "4090", "a6000", "l4"]
    assert slurm.device_files([0, 1, 2]) == "/dev/nvidia[0-2]"
    assert slurm.device_files([0, 2]) == "/dev/nvidia[0,2]" and slurm.device_files([3]) == "/dev/nvidia3"


def test_slurm_conf_and_gres_conf_rendered_from_every_nodes_facts():
    cl = slurm.plan_cluster(SPEC, cluster_facts(), new_key=lambda: "k" * 64)
    assert cl.blocked is None and cl.munge_key == "k" * 64  # no host has a key yet
    conf = cl.files[managed.SLURM_CONF.template]
    assert "SlurmctldHost=head\n" in conf and "ClusterName=lab\n" in conf
    assert "SlurmdTimeout=60\n" in conf
    assert ("NodeName=gpu1 NodeHostname=gpu1 CPUs=16 Sockets=2 CoresPerSocket=4 ThreadsPerCore=2 "
            "RealMemory=257000 Gres=gpu:v100s:2 State=UNKNOWN\n") in conf
    assert "NodeName=gpu2 NodeHostname=gpu2 " in conf and "Gres=gpu:h100:8 " in conf
    assert "NodeName=head" not in conf  # the controller is not a compute host here
    assert "PartitionName=gpu Nodes=gpu1,gpu2 Default=YES MaxTime=INFINITE State=UP DefMemPerCPU=16062\n" in conf
    assert "ProctrackType=proctrack/cgroup\n" in conf and "GresTypes=gpu\n" in conf
    gres = cl.files[managed.GRES_CONF.template]
    assert "NodeName=gpu1 Name=gpu Type=v100s File=/dev/nvidia[0-1]\n" in gres
    assert "NodeName=gpu2 AutoDetect=nvml Name=gpu Type=h100 Count=8\n" in gres
    assert "ConstrainDevices=yes" in cl.files[managed.CGROUP_CONF.template]


def test_cgroup_false_uses_linuxproc_and_no_cgroup_conf_and_node_timeout_is_slurmds():
    cl = slurm.plan_cluster(SPEC.model_copy(update={"cgroup": False, "node_timeout": 30}),
                            cluster_facts(), new_key=lambda: "k" * 64)
    conf = cl.files[managed.SLURM_CONF.template]
    assert "SlurmdTimeout=30\n" in conf
    assert "ProctrackType=proctrack/linuxproc\n" in conf and "TaskPlugin=task/none\n" in conf
    assert "cgroup" not in "".join(ln for ln in conf.splitlines() if not ln.startswith("#"))
    assert managed.CGROUP_CONF.template not in cl.files


def test_gpus_without_device_files_or_nvml_block_the_configs():
    """slurmd registers no GPU from a Count-only gres.conf line (seen on 22.05): wait instead."""
    cl = slurm.plan_cluster(SPEC, cluster_facts(gpu1=raw("gpu1", **{"dev-nvidia": []})), new_key=lambda: "k" * 64)
    assert cl.blocked.startswith("gpu1: its GPU device files (/dev/nvidia0..) are missing")
    assert cl.files == {} and cl.munge_key


def test_a_compute_node_without_a_driver_blocks_the_configs_not_the_key():
    cl = slurm.plan_cluster(SPEC, cluster_facts(gpu2=raw("gpu2", smi={"rc": 9, "output": "NVIDIA-SMI has failed"})),
                            new_key=lambda: "k" * 64)
    assert cl.blocked.startswith("gpu2: nvidia-smi does not answer") and cl.munge_key
    c = ctx("gpu1", cluster_facts()["gpu1"].raw, cl)
    assert steps.slurm_config(c) == [] and steps.munge(c)
    missing = slurm.plan_cluster(SPEC, {k: v for k, v in cluster_facts().items() if k != "gpu2"})
    assert "gpu2" in missing.missing and steps.munge(ctx("gpu1", cluster_facts()["gpu1"].raw, missing)) == []


def test_munge_key_kept_when_every_host_shares_one_else_one_new_key_for_all():
    same = cluster_facts(**{h: raw(h, key="aa") for h in ("head", "gpu1", "gpu2")})
    assert slurm.plan_cluster(SPEC, same, new_key=lambda: pytest.fail("no new key")).munge_key is None
    differ = cluster_facts(head=raw("head", smi={"rc": 127}, key="aa"))
    cl = slurm.plan_cluster(SPEC, differ, new_key=lambda: "s3cr3t" * 20)
    changes = steps.munge(ctx("head", differ["head"].raw, cl))
    key = next(ch for ch in changes if isinstance(ch, FileChange))
    assert (key.path, key.mode, key.owner, key.group, key.secret) == ("/etc/munge/munge.key", 0o400,
                                                                     "munge", "munge", True)
    shown = "".join(ch.describe() for ch in changes) + key.diff()
    assert "s3cr3t" not in shown and "restart munge.service (new cluster key)" in shown
    # the key travels base64 inside the root script (stdin), through printf, a shell builtin
    assert "s3cr3t" not in key.script and "printf %s" in key.script


def _converged(host, cl, **over):
    roles = cl.roles(host)
    units = {u: {"active": "active", "enabled": "enabled"} for u in
             ["munge.service", *[steps.SLURM_UNITS[r] for r in roles]]}
    by_template = {f.template: f for f in managed.SLURM_FILES}
    files = {by_template[t].path(): {"sha256": hashlib.sha256(body.encode()).hexdigest(), "mode": 0o644,
                                     "owner": "root", "group": "root", "content": body}
             for t, body in cl.files.items()}
    dirs = {slurm.LOG_DIR: {"mode": 0o755, "owner": "slurm", "group": "slurm"},
            slurm.STATE_DIR: {"mode": 0o700, "owner": "slurm", "group": "slurm"}}
    return raw(host, key="aa", files=files, units=units, dirs=dirs, **over)


def test_converged_cluster_host_plans_nothing_and_a_partition_change_only_reconfigures():
    facts = cluster_facts(**{h: raw(h, key="aa") for h in ("head", "gpu1", "gpu2")})
    cl = slurm.plan_cluster(SPEC, facts)
    for h in ("head", "gpu1"):
        assert steps.slurm_config(ctx(h, _converged(h, cl), cl)) == []
        assert steps.munge(ctx(h, _converged(h, cl), cl)) == []
    renamed = slurm.plan_cluster(SPEC.model_copy(update={"partition": "a100"}), facts)
    head = [ch.describe() for ch in steps.slurm_config(ctx("head", _converged("head", cl), renamed))]
    assert head == ["write /etc/slurm/slurm.conf (mode 0644, root:root)",
                    "scontrol reconfigure (partitions changed)"]
    node = [ch.describe() for ch in steps.slurm_config(ctx("gpu1", _converged("gpu1", cl), renamed))]
    assert node == ["write /etc/slurm/slurm.conf (mode 0644, root:root)"]  # slurmctld pushes it
    more_mem = cluster_facts(**{h: raw(h, key="aa") for h in ("head", "gpu1")},
                             gpu2=raw("gpu2", smi=H100_SMI, key="aa", mem_mib=515000))
    grown = slurm.plan_cluster(SPEC, more_mem)
    node = [ch.describe() for ch in steps.slurm_config(ctx("gpu1", _converged("gpu1", cl), grown))]
    assert node[-1] == "restart slurmd.service (its config changed)"


def test_fresh_cluster_host_installs_pinned_daemons_by_role():
    cl = slurm.plan_cluster(SPEC, cluster_facts(), new_key=lambda: "k" * 64)
    head = [ch.describe() for ch in steps.slurm_packages(ctx("head", raw("head"), cl))]
    assert head[0] == ("install Slurm 22.05.8-4+deb12u3 and munge 0.5.15-2+deb12u1: munge=0.5.15-2+deb12u1, "
                       "slurm-client=22.05.8-4+deb12u3, slurmctld=22.05.8-4+deb12u3")
    assert head[1].startswith("hold munge, slurm-client, slurmctld ")
    assert "slurmd=22.05.8-4+deb12u3" in steps.slurm_packages(ctx("gpu1", raw("gpu1"), cl))[0].describe()
    plan = [ch.describe() for ch in steps.slurm_config(ctx("head", raw("head"), cl))]
    assert "directory /var/lib/slurm/slurmctld (0700 slurm:slurm)" in plan
    assert plan[-1] == "restart slurmctld.service (its config changed)"
    assert steps.slurm_packages(ctx("other", raw("other"), cl)) == []  # not in the cluster
    assert steps._in_cluster(ctx("other", raw("other"), cl)) == "not a host of the inventory's slurm: cluster"
    assert steps._in_cluster(ctx("other", raw("other"))) == "no slurm: cluster in the inventory"


SLURM_INV = """
hosts:
  - {name: head, groups: [ctl]}
  - {name: gpu1, groups: [train]}
  - {name: gpu2, groups: [train]}
groups: {train: {}, ctl: {}, empty: {}}
slurm:
"""


@pytest.mark.parametrize("section,error", [
    ("  controller: nohost\n  compute: train\n",
     "slurm.controller: 'nohost' is not a host of the inventory (hosts: head, gpu1, gpu2)"),
    ("  controller: head\n  compute: [gpu1, gpx]\n",
     "slurm.compute: 'gpx' is neither a host nor a group"),
    ("  controller: head\n  compute: empty\n", "slurm.compute: no hosts"),
    ("  controller: head\n  compute: train\n  partition: 'a b'\n", "field 'slurm.partition'"),
    ("  controller: head\n  compute: train\n  nodes: 3\n", "field 'slurm.nodes' is not a known key"),
    ("  controller: head\n  compute: train\n  node_timeout: 5\n", "field 'slurm.node_timeout'"),
])
def test_slurm_section_errors_name_the_field(tmp_path, section, error):
    p = tmp_path / "inv.yml"
    p.write_text(SLURM_INV + section)
    with pytest.raises(inventory.InventoryError, match="^" + str(p) + ".*") as e:
        inventory.load(p)
    assert error in str(e.value)


def test_slurm_section_resolves_groups_and_versions_must_match(tmp_path):
    p = tmp_path / "inv.yml"
    p.write_text(SLURM_INV + "  controller: head\n  compute: [train, head]\n")
    s = inventory.load(p).slurm
    assert s.compute == ("gpu1", "gpu2", "head") and s.hosts == ("head", "gpu1", "gpu2")
    assert s.partition == "gpu" and s.cgroup is True and s.node_timeout == 60
    p.write_text(SLURM_INV.replace("{name: gpu2, groups: [train]}",
                                   "{name: gpu2, groups: [train], vars: {slurm_version: '23.02.1-1'}}")
                 + "  controller: head\n  compute: train\n")
    with pytest.raises(inventory.InventoryError, match="var 'slurm_version' differs between the cluster's hosts"):
        inventory.load(p)


def test_example_inventory_documents_a_valid_slurm_section(tmp_path):
    text = open("inventory/example.yml").read()
    block = text[text.index("# slurm:"):]
    uncommented = "\n".join(ln[2:] for ln in block.splitlines() if ln.startswith("# "))
    p = tmp_path / "inv.yml"
    p.write_text(text[:text.index("# slurm:")] + uncommented + "\n")
    s = inventory.load(p).slurm
    assert s.controller == "gpu1" and s.compute == ("gpu1", "gpu2") and s.partition == "gpu"


def test_lscpu_json_flat_and_nested_and_meminfo():
    from torchrig.facts import node_hw
    # util-linux 2.38 (Debian 12): flat rows, as captured
    flat = json.dumps({"lscpu": [{"field": "Architecture:", "data": "x86_64"},
                                 {"field": "CPU(s):", "data": "2"}, {"field": "Thread(s) per core:", "data": "1"},
                                 {"field": "Core(s) per socket:", "data": "2"}, {"field": "Socket(s):", "data": "1"}]})
    assert node_hw.parse_lscpu(flat) == {"cpus": 2, "sockets": 1, "cores": 2, "threads": 1}
    # util-linux 2.39 (Ubuntu 24.04): the topology rows are children of "Model name:"
    nested = json.dumps({"lscpu": [{"field": "CPU(s):", "data": "64"}, {"field": "Vendor ID:", "data": "AuthenticAMD",
        "children": [{"field": "Model name:", "data": "AMD EPYC 7543", "children": [
            {"field": "Thread(s) per core:", "data": "2"}, {"field": "Core(s) per socket:", "data": "16"},
            {"field": "Socket(s):", "data": "2"}]}]}]})
    assert node_hw.parse_lscpu(nested) == {"cpus": 64, "sockets": 2, "cores": 16, "threads": 2}
    assert node_hw.parse_lscpu("lscpu: command not found") is None
    # MiB rounded down, as slurmd -C computes RealMemory
    assert node_hw.parse_mem_mib("MemTotal:       24683524 kB\nMemFree: 1 kB\n") == 24105
    assert node_hw.parse_mem_mib("") is None
