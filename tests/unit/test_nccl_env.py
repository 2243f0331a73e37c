"""The NCCL environment of verify's cross-node benchmark and of a launched job."""

from __future__ import annotations

from torchrig.inventory import Host
from torchrig.launch import plan
from torchrig.verify.evaluate import HostVerdict
from torchrig.verify.run import HostOpts, cross_node_cmd


def _host(name):
    return Host(name=name, connection="ssh", address=f"10.0.0.{name[-1]}", port=None, user=None,
                identity_file=None, jump=None, gpus=2, groups=())


def test_each_node_uses_its_own_interface():
    hosts = [_host("n1"), _host("n2"), _host("n3")]
    o = HostOpts(venv="/opt/v", prefix="/opt/p", accelerator="cuda", rdzv_port=29400,
                 busbw_min_gbs={}, address="")
    verdicts = {"n1": HostVerdict("n1", gpus=[{}, {}], interface="ens1f0"),
                "n2": HostVerdict("n2", gpus=[{}, {}], interface="enp65s0"),
                "n3": HostVerdict("n3", gpus=[{}, {}], interface=None)}
    cmds = {h.name: cross_node_cmd(h, hosts, o, verdicts[h.name], "10.0.0.1:29400", "r1")
            for h in hosts}
    assert "NCCL_SOCKET_IFNAME=ens1f0" in cmds["n1"] and "GLOO_SOCKET_IFNAME=ens1f0" in cmds["n1"]
    assert "NCCL_SOCKET_IFNAME=enp65s0" in cmds["n2"] and "ens1f0" not in cmds["n2"]
    assert "SOCKET_IFNAME" not in cmds["n3"]  # none found there: NCCL chooses
    assert "is_host=true" in cmds["n1"] and "is_host=false" in cmds["n2"]
    assert "--local-addr 10.0.0.2" in cmds["n2"] and "--nproc-per-node 2" in cmds["n2"]


def test_job_env_keeps_torchs_nccl_error_handling_and_each_nodes_interface():
    nodes = [plan.Node(f"gpu{i + 1}", f"10.0.0.{i + 1}", i, "/opt/torchrig/venv", "torchrig",
                       "/var/log/torchrig", "/srv/ck", "/srv/data", 2, iface)
             for i, iface in enumerate(("eth0", "ens1f0"))]
    job = plan.Job(name="exp1", script="train.py", args=[], max_restarts=0, rdzv_port=29412,
                   nodes=nodes, release="/opt/torchrig/payload/releases/abc")
    envs = [plan.node_env(job, n) for n in nodes]
    # torch's default (3) ends the process without ncclCommAbort, which can hang itself
    assert all("TORCH_NCCL_ASYNC_ERROR_HANDLING" not in e for e in envs)
    assert [e["NCCL_SOCKET_IFNAME"] for e in envs] == ["eth0", "ens1f0"]
