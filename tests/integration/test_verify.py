"""verify on real provisioned testbed hosts (gpu1: 2x V100S NVLink, gpu2: 8x H100 NVSwitch,
gpu3: 4 GPUs across two sockets, gpu4: a second V100S pair)."""

import json
import re
import shlex

import pytest

from conftest import invoke, ip_of, provision, sh, steps_of, write_inventory

# gpu4 and gpu5 are not verified here, but provisioning them with the others (one parallel run)
# saves the launch and elastic tests a provision and reboot cycle of their own in a full run
pytestmark = pytest.mark.provisioned("gpu1", "gpu2", "gpu3", "gpu4", "gpu5")


def verify(inv, hosts, *flags, timeout=600):
    r = invoke("verify", "-i", str(inv), "-H", hosts, "--json", *flags, timeout=timeout)
    return r, json.loads(r.stdout) if r.stdout.strip().startswith("{") else None


def host(data, name):
    return next(h for h in data["hosts"] if h["host"] == name)


def checks(h):
    return {c["name"]: c for c in h["checks"]}


def test_classification_and_advice_per_profile(testbed):
    r, data = verify(testbed, "gpu1,gpu2,gpu3")
    assert data is not None, r.stderr
    assert (host(data, "gpu1")["topology"], host(data, "gpu2")["topology"],
            host(data, "gpu3")["topology"]) == ("nvlink", "nvswitch", "cpu")
    assert any("accumulation" in a for a in host(data, "gpu3")["advice"])
    assert any("fabricmanager" in a for a in host(data, "gpu2")["advice"])
    assert checks(host(data, "gpu2"))["gpu-count"]["detail"] == "8 x NVIDIA H100 80GB HBM3"
    # the GPU counts differ across these boxes: the version gate says so and fails
    assert data["version_gate"]["status"] == "FAIL"
    assert data["version_gate"]["table"]["gpus"] == {"gpu1": 2, "gpu2": 8, "gpu3": 4}
    assert r.returncode == 1
    # the network check from the other nodes to gpu1's rendezvous port, with the interface
    net = checks(host(data, "gpu2"))["network"]
    assert net["status"] == "PASS" and "NCCL_SOCKET_IFNAME=eth0" in net["detail"]


def test_each_box_passes_alone(testbed):
    for h in ("gpu1", "gpu2", "gpu3"):
        r, data = verify(testbed, h)
        assert r.returncode == 0 and data["status"] == "PASS", (h, r.stdout, r.stderr)


def test_version_gate_names_the_odd_torch(testbed):
    meta = "/opt/torchrig/venv/lib/python3.11/site-packages/torch-2.13.0+cpu.dist-info/METADATA"
    # a torch that differs on one host (as after a manual pip install there)
    sh(testbed, "gpu3", f"sed -i 's/^Version: 2.13.0+cpu$/Version: 2.12.1+cpu/' {meta}")
    try:
        r, data = verify(testbed, "gpu1,gpu2,gpu3")
        assert r.returncode == 1
        assert "torch differs: most hosts have 2.13.0+cpu; gpu3 has 2.12.1+cpu" in \
            data["version_gate"]["reasons"]
        assert data["version_gate"]["table"]["torch"] == \
            {"gpu1": "2.13.0+cpu", "gpu2": "2.13.0+cpu", "gpu3": "2.12.1+cpu"}
        assert "gpu3 has 2.12.1+cpu" in r.stderr
    finally:
        sh(testbed, "gpu3", f"sed -i 's/^Version: 2.12.1+cpu$/Version: 2.13.0+cpu/' {meta}")


def test_driver_library_mismatch_reported(testbed):
    sh(testbed, "gpu1", "echo driver-library-mismatch > /etc/torchrig-testbed/fault")
    try:
        r, data = verify(testbed, "gpu1")
        assert r.returncode == 1
        drv = checks(host(data, "gpu1"))["driver"]
        assert drv["status"] == "FAIL" and "Driver/library version mismatch" in drv["detail"]
        assert "reboot" in drv["detail"].lower()
        assert checks(host(data, "gpu1"))["topology"]["status"] == "NOT RUN"
        assert "driver FAIL" in r.stderr
    finally:
        sh(testbed, "gpu1", "rm -f /etc/torchrig-testbed/fault")


def test_nvswitch_without_fabric_manager_fails(testbed):
    sh(testbed, "gpu2", "systemctl stop nvidia-fabricmanager")
    try:
        r, data = verify(testbed, "gpu2")
        assert r.returncode == 1
        topo = checks(host(data, "gpu2"))["topology"]
        assert topo["status"] == "FAIL" and "nvidia-fabricmanager" in topo["detail"]
        assert "error 802" in topo["detail"]
    finally:
        sh(testbed, "gpu2", "systemctl start nvidia-fabricmanager")


def test_bandwidth_across_two_nodes(testbed):
    r, data = verify(testbed, "gpu1,gpu2", "--bandwidth", timeout=900)
    bw = {b["scope"] + ":" + ",".join(b["hosts"]): b for b in data["bandwidth"]}
    cluster = bw["cluster:gpu1,gpu2"]
    assert cluster["status"] == "PASS", cluster
    res = cluster["result"]
    assert res["world_size"] == 4 and res["nnodes"] == 2 and res["wrong_total"] == 0
    assert sorted(set(res["hosts"])) == ["gpu1", "gpu2"]
    assert all(row["busbw_gbs"] > 0 for row in res["rows"])
    assert re.search(r"busbw [0-9.]+ GB/s .* over 4 ranks \(min 0.05 for cpu-gloo", cluster["detail"])
    assert bw["node:gpu1"]["status"] == "PASS" and bw["node:gpu2"]["status"] == "PASS"
    # 2 vs 8 GPUs: the gate fails (and so does verify), yet every measurement was still made
    assert data["version_gate"]["status"] == "FAIL" and r.returncode == 1


# (profile, GPUs, class, advice that must be there) for boxes real clusters have
MORE_BOXES = [
    ("v100-dgx1-8", 8, "nvlink", "2 CPU sockets (disjoint CPU Affinity sets"),
    ("pcie-nic-8", 8, "cpu", "2 NUMA nodes"),
    ("single-1", 1, "single", None),
    ("a100-nv12-8", 8, "nvswitch", "fabricmanager"),
]


def test_more_real_boxes_get_their_class_and_advice(testbed, tmp_path):
    """gpu4 (provisioned above) is given each profile in turn; verify reads it as a real host
    of that kind: the link class, the advice, and the GPU count with its plural."""
    import yaml
    from conftest import write_inventory
    from torchrig.testbed import lab, machines
    doc = yaml.safe_load(testbed.read_text())
    original = lab.status()["hosts"]["gpu4"]["profile"]  # the testbed's record, not an inventory var
    try:
        for profile, n, cls, advice in MORE_BOXES:
            machines.install_profile("gpu4", profile)
            for h in doc["hosts"]:
                if h["name"] == "gpu4":
                    h["gpus"] = n
            r, data = verify(write_inventory(tmp_path, doc, f"{profile}.yml"), "gpu4")
            assert data is not None, (profile, r.stdout, r.stderr)
            h = host(data, "gpu4")
            assert h["topology"] == cls, (profile, h)
            assert checks(h)["gpu-count"]["status"] == "PASS", (profile, h)
            if advice:
                assert any(advice in a for a in h["advice"]), (profile, h["advice"])
            else:
                assert h["advice"] == [], (profile, h["advice"])
            if profile == "single-1":
                assert checks(h)["topology"]["detail"] == "1 GPU, single"
            if profile == "a100-nv12-8":  # no fabric manager on a host provisioned as V100S
                assert checks(h)["topology"]["status"] == "FAIL"
            else:
                assert checks(h)["topology"]["status"] == "PASS", (profile, h)
    finally:
        machines.install_profile("gpu4", original)


def test_a_fresh_fleet_downloaded_each_wheel_and_deb_once(testbed, fleet):
    """The provision of this file's hosts (several fresh hosts at once, by the session's fleet:
    no provision of its own) fetched each wheel and each .deb from the testbed's index and apt
    repositories once, by one host; the others got them from it (provision/wheelshare.py,
    provision/aptshare.py), as the server's request log shows."""
    several = [rec for rec in fleet.served if len(rec[0]) >= 2]
    if not several:
        pytest.skip("no provision of several fresh hosts in this session")
    hosts, wheels, debs = several[-1]
    # cuda-keyring (a few KB) is fetched by cuda-repo's curl on each host, before the hosts meet
    debs = [(client, n) for client, n in debs if "/cuda-keyring_" not in n]
    for served, first in ((wheels, "torch-"), (debs, "cuda/repos/")):
        names = [name for _, name in served]
        assert any(n.startswith(first) for n in names), served
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
        assert {client for client, _ in served} <= {ip_of(testbed, h) for h in hosts}
        assert len({client for client, _ in served}) == 1, served   # one host downloaded
    # the driver, the toolkit, NCCL and the Debian mirror's node exporter among the .debs
    for part in ("cuda-drivers_", "cuda-toolkit-12-8_", "libnccl2_", "debian/"):
        assert any(part in n for _, n in debs), (part, debs)


def _inject(inv, name, kmsg="", health=None):
    """Testbed faults on `name`: kernel lines for the stand-in dmesg, GPU states for the
    stand-in nvidia-smi (torchrig/testbed/profiles/README.md)."""
    sh(inv, name, f"printf %s {shlex.quote(kmsg)} > /etc/torchrig-testbed/kmsg && "
                  f"printf %s {shlex.quote(json.dumps(health or {}))} > /etc/torchrig-testbed/health.json")


def test_health_names_each_injected_fault_and_verify_fails_on_them(testbed):
    """gpu1: 2x V100S (buses 0000:3b:00 and 0000:5e:00) joined by NV2."""
    r = invoke("health", "-i", str(testbed), "-H", "gpu1", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    old = "2020-01-01T00:00:00,000000+00:00 NVRM: Xid (PCI:0000:3b:00): 13, pid=9, Graphics Exception\n"
    new = sh(testbed, "gpu1", "date -u +%Y-%m-%dT%H:%M:%S,000000+00:00", sudo=False).strip()
    _inject(testbed, "gpu1", old + new + " NVRM: Xid (PCI:0000:5e:00): 79, pid=0, GPU has fallen off the bus.\n",
            {"0": {"remap_pending": True, "links_down": [1], "throttle_reasons": 0x40}})
    try:
        r = invoke("health", "-i", str(testbed), "-H", "gpu1", "--json")
        assert r.returncode == 1 and "error: health FAIL" in r.stderr
        got = checks(host(json.loads(r.stdout), "gpu1"))
        assert got["xid"]["status"] == "FAIL"
        assert "GPU 1 (0000:5e:00): Xid 79 (GPU has fallen off the bus)" in got["xid"]["detail"]
        assert "power-cycle" in got["xid"]["detail"] and "GPU 0 (0000:3b:00): Xid 13" in got["xid"]["detail"]
        assert got["memory"]["status"] == "FAIL" and "nvidia-smi -r -i 0" in got["memory"]["detail"]
        assert got["nvlink"]["status"] == "FAIL" and "GPU 0: 1 of the 2 NVLinks" in got["nvlink"]["detail"]
        assert got["clocks"]["status"] == "WARN" and "hardware thermal slowdown" in got["clocks"]["detail"]
        # --since: only what came after (the old application Xid is left out)
        r = invoke("health", "-i", str(testbed), "-H", "gpu1", "--json", "--since", "2021-01-01T00:00")
        assert "Xid 13" not in checks(host(json.loads(r.stdout), "gpu1"))["xid"]["detail"]
        # verify's own probe (the login user) sees the same and fails
        r, data = verify(testbed, "gpu1")
        got = checks(host(data, "gpu1"))
        assert r.returncode == 1 and got["xid"]["status"] == "FAIL" and got["nvlink"]["status"] == "FAIL"
    finally:
        sh(testbed, "gpu1", "rm -f /etc/torchrig-testbed/kmsg /etc/torchrig-testbed/health.json")
    r = invoke("health", "-i", str(testbed), "-H", "gpu1")
    assert r.returncode == 0, r.stdout + r.stderr


def test_dcgm_installed_by_provision_and_its_diag_read_by_verify_and_health(testbed, inventory_doc,
                                                                             tmp_path):
    """var dcgm: provision installs the (stand-in) datacenter-gpu-manager from the testbed's
    CUDA repository, pinned and held, and starts its host engine; `--diag N` reads dcgmi's
    per-test results."""
    inventory_doc["vars"]["dcgm"] = True
    inv = write_inventory(tmp_path, inventory_doc)
    r, data = provision(inv, "gpu1", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    _, st = steps_of(data, "gpu1")
    assert "install NVIDIA DCGM 1:3.3.9: datacenter-gpu-manager=1:3.3.9" in st["dcgm"]["changes"]
    assert "hold" in sh(inv, "gpu1", "apt-mark showhold datacenter-gpu-manager && echo hold")
    r, data = verify(inv, "gpu1", "--diag", "1")
    diag = checks(host(data, "gpu1"))["dcgm-diag"]
    assert r.returncode == 0 and diag["status"] == "PASS", diag
    _inject(inv, "gpu1", health={"1": {"remap_pending": True}})
    try:
        r = invoke("health", "-i", str(inv), "-H", "gpu1", "--json", "--diag", "2")
        diag = checks(host(json.loads(r.stdout), "gpu1"))["dcgm-diag"]
        assert r.returncode == 1 and diag["status"] == "FAIL"
        assert "GPU Memory GPU 1: FAIL (GPU 1 has uncorrectable memory errors" in diag["detail"]
    finally:
        sh(inv, "gpu1", "rm -f /etc/torchrig-testbed/kmsg /etc/torchrig-testbed/health.json")
