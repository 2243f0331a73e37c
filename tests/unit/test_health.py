"""GPU health: the parsers on real outputs (tests/fixtures, see INDEX.md) and the verdicts."""

import json
from datetime import datetime, timezone

import pytest

from _fixtures import fixture
from torchrig.facts import dcgm_diag, nvlink, smi_xml, topo, xid
from torchrig.verify import health
from torchrig.verify.evaluate import FAIL, NOT_RUN, PASS, WARN

XML = fixture("smiqx_01_1xRTX4070_laptop_driver575_cut.xml")


# ------------------------------------------------------------------------------------ Xid

def test_xid_journal_line_with_its_bus_and_catalog_entry():
    [e] = xid.parse(fixture("xid_01_journal_xid79_fallen_off_bus_gist.txt"))
    assert (e.code, e.bus) == (79, "0000:10:00")
    assert e.info.node_fault and "fallen off the bus" in e.info.what
    assert "pid=0, GPU has fallen off the bus." == e.text


def test_xid_dmesg_lines_and_row_remap():
    [e] = xid.parse(fixture("xid_02_dmesg_xid63_row_remap_mlengineering.txt"))
    assert (e.code, e.bus, e.when) == (63, "0000:10:1c", None)
    [e] = xid.parse(fixture("xid_03_dmesg_xid79_pastebin.txt"))
    assert (e.code, e.bus) == (79, "0000:03:00")


def test_fallen_off_message_without_an_xid_is_not_an_xid():
    assert xid.parse(fixture("xid_04_dmesg_fallen_off_without_xid_nvsentinel.txt")) == []


def test_xid_since_keeps_newer_stamped_lines_and_unstamped_ones():
    text = ("2026-12-03T10:00:00+0000 gpu1 kernel: NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE\n"
            "2026-12-03T12:00:00,123456+00:00 NVRM: Xid (PCI:0000:3b:00): 13, pid=2, Graphics\n"
            + fixture("xid_02_dmesg_xid63_row_remap_mlengineering.txt"))
    got = xid.parse(text, since=datetime(2026, 12, 3, 11, tzinfo=timezone.utc))
    assert [e.code for e in got] == [13, 63]


def test_bus_id_maps_to_the_gpu_index():
    assert xid.short_bus("00000000:3B:00.0") == "0000:3b:00"
    assert xid.gpu_index("0000:3B:00", {"00000000:18:00.0": 0, "00000000:3B:00.0": 1}) == 1


def test_catalog_names_its_source_and_only_checked_actions():
    assert "xid-errors" in xid.SOURCE and "2026-12-03" in xid.SOURCE
    assert xid.CATALOG[13].action == "RESTART_APP" and xid.CATALOG[13].checked == "catalog"
    assert all(i.action is None for i in xid.CATALOG.values() if i.checked != "catalog")
    assert {c for c, i in xid.CATALOG.items() if i.node_fault} >= {48, 63, 64, 74, 79, 94, 95}
    assert not any(xid.CATALOG[c].node_fault for c in (13, 31, 43))


@pytest.mark.parametrize("text,want", [("2h", datetime(2026, 12, 3, 10, tzinfo=timezone.utc)),
                                       ("2026-12-03T09:30", datetime(2026, 12, 3, 9, 30, tzinfo=timezone.utc))])
def test_since_forms(text, want):
    assert xid.parse_since(text, now=datetime(2026, 12, 3, 12, tzinfo=timezone.utc)) == want


def test_since_refuses_anything_else_naming_the_forms():
    with pytest.raises(ValueError, match="ISO time.*age"):
        xid.parse_since("yesterday")


def test_kernel_log_falls_back_to_dmesg_when_the_journal_has_no_kernel_lines():
    assert xid.kernel_text({"rc": 0, "out": ""}, {"rc": 0, "out": "x"}) == ("x", "dmesg")
    assert xid.kernel_text({"rc": 0, "out": "k"}, {"rc": 1})[1] == "journalctl -k"
    assert xid.kernel_text({"rc": 1}, {"rc": 1})[1] is None
    assert xid.kernel_text({"rc": 0, "out": ""}, {"rc": 1})[1] is None  # no proof of no Xid


# ---------------------------------------------------------------------------- -q -x

def test_xml_of_a_real_gpu():
    [g] = smi_xml.parse(XML)
    assert (g.index, g.bus_id, g.name) == (0, "00000000:01:00.0", "NVIDIA GeForce RTX 4070 Laptop GPU")
    assert g.ecc_enabled is None and g.uncorrectable_volatile is None
    assert (g.remap_pending, g.remap_failure) == (False, False)
    assert (g.pcie_gen, g.pcie_gen_max, g.pcie_width, g.pcie_width_max, g.pcie_replays) == (2, 4, 8, 8, 0)
    assert g.slowdowns == []  # gpu_idle is active, and normal


def test_xml_faults_are_read():
    bad = (XML.replace("<remapped_row_pending>No", "<remapped_row_pending>Yes")
           .replace("<clocks_event_reason_hw_thermal_slowdown>Not Active",
                    "<clocks_event_reason_hw_thermal_slowdown>Active")
           .replace("<dram_uncorrectable>N/A", "<dram_uncorrectable>3", 1)
           .replace("<replay_counter>0", "<replay_counter>12"))
    [g] = smi_xml.parse(bad)
    assert g.remap_pending and g.slowdowns == ["hw_thermal_slowdown"]
    assert g.uncorrectable_volatile == 3 and g.pcie_replays == 12


def test_xml_refuses_text_that_is_not_it():
    with pytest.raises(ValueError, match="no readable XML"):
        smi_xml.parse("No devices were found")


# ------------------------------------------------------------------------------- NVLink

def test_nvlink_status_inactive_links():
    links = nvlink.parse_status(fixture("nvlink_s_01_v100_two_links_inactive_azhpc.txt"))
    assert links[3].up == [0, 1, 2, 4] and links[3].down == [3, 5]
    assert nvlink.parse_status(fixture("nvlink_s_02_h100_mlengineering.txt"))[0].up == [0, 17]


def test_nvlink_errors_counters():
    links = nvlink.parse_errors(fixture("nvlink_e_01_h100_mlengineering.txt"))
    assert links[0].errors[17] == {"Replay Errors": 0, "Recovery Errors": 0, "CRC Errors": 0}
    assert sorted(links[0].errors) == [0, 1, 17]


def test_topology_promises_links_per_gpu():
    assert topo.promised_nvlinks(topo.parse(fixture("topo_08_h100x8_nv18_mlengineering.txt")))[0] == 18
    assert topo.promised_nvlinks(topo.parse(fixture("topo_04_4gpu_nv1_nv2_dualsocket_delos.txt")))
    assert topo.promised_nvlinks(topo.parse(fixture("topo_01_2x1080ti_consumer_phb.txt"))) == {}


# --------------------------------------------------------------------------------- DCGM

def test_dcgm_diag_json_per_test():
    text = fixture("dcgm_01_diag_r3_j_1xT400_skips_dcgm139_cut.txt").replace('{"..."},', "")
    text = text[:text.index('\t\t\t{\n\t\t\t\t"category" : "Stress"')].rstrip().rstrip(",") + "\n\t\t]\n\t}\n}"
    got = dcgm_diag.parse("Successfully ran diagnostic for group.\n" + text)
    assert [(t.category, t.name, t.gpu, t.status) for t in got][:2] == [
        ("Integration", "PCIe", "0", "SKIP"), ("Hardware", "GPU Memory", "0", "SKIP")]
    assert len(got) == 4


def test_dcgm_4_shape_and_a_failure_is_fail():
    doc = {"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
        {"name": "memory", "test_summary": {"status": "Fail"},
         "results": [{"entity_id": 2, "status": "Fail", "warnings": [{"warning": "DBE on GPU 2"}]}]}]}]}}
    [t] = dcgm_diag.parse(json.dumps(doc))
    assert (t.gpu, t.status, t.info) == ("2", "FAIL", "DBE on GPU 2")
    c = health.diag_check({"dcgm_diag": {"rc": 226, "out": json.dumps(doc), "err": ""}})
    assert c.status == FAIL and "memory GPU 2: FAIL (DBE on GPU 2)" in c.detail


# ----------------------------------------------------------------------------- verdicts

def ok(out):
    return {"rc": 0, "out": out, "err": ""}


def raw(xml=XML, kernel="", nvs="", nve=""):
    return {"health_xml": ok(xml), "kernel_journal": ok(kernel), "kernel_dmesg": {"rc": 1, "out": "", "err": "denied"},
            "nvlink_status": ok(nvs), "nvlink_errors": ok(nve)}


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_healthy_gpu_passes_every_check():
    got = by_name(health.checks(raw(kernel="2026-12-03T10:00:00+0000 h kernel: eth0 up\n"), None))
    assert {n: c.status for n, c in got.items()} == {
        "xid": PASS, "memory": PASS, "pcie-link": PASS, "clocks": PASS, "nvlink": PASS}


def test_each_fault_is_named_with_its_gpu_verdict_and_advice():
    line = fixture("xid_01_journal_xid79_fallen_off_bus_gist.txt").replace("0000:10:00", "0000:01:00")
    bad = XML.replace("<remapped_row_pending>No", "<remapped_row_pending>Yes").replace(
        "<clocks_event_reason_hw_power_brake_slowdown>Not Active",
        "<clocks_event_reason_hw_power_brake_slowdown>Active")
    got = by_name(health.checks(raw(xml=bad, kernel=line), None))
    assert got["xid"].status == FAIL and "GPU 0 (0000:01:00): Xid 79" in got["xid"].detail
    assert "power-cycle" in got["xid"].detail
    assert got["memory"].status == FAIL and "nvidia-smi -r -i 0" in got["memory"].detail
    assert got["clocks"].status == WARN and "power brake" in got["clocks"].detail


def test_an_application_xid_warns_and_an_unknown_one_fails():
    k = ("NVRM: Xid (PCI:0000:01:00): 13, pid=5, Graphics Exception\n"
         "NVRM: Xid (PCI:0000:01:00): 999, pid=5, something new\n")
    c = health.xid_check({"kernel_journal": ok(k)}, {"00000000:01:00.0": 0}, None)
    assert c.status == FAIL and c.detail.index("Xid 999") < c.detail.index("Xid 13")
    c = health.xid_check({"kernel_journal": ok(k.splitlines()[0])}, {}, None)
    assert c.status == WARN and "RESTART_APP" in c.detail


def test_unreadable_kernel_log_is_not_run_and_says_how():
    c = health.xid_check({"kernel_journal": {"rc": 1, "out": "", "err": "No journal files"},
                          "kernel_dmesg": {"rc": 1, "out": "", "err": "dmesg: read kernel buffer failed: Operation not permitted"}},
                         {}, None)
    assert c.status == NOT_RUN and "Operation not permitted" in c.detail and "root" in c.detail
    c = health.xid_check({"kernel_journal": {"rc": 1, "out": "", "err": "x"}}, {}, None, as_root=False)
    assert c.status == WARN and "torchrig health" in c.detail


def test_a_link_the_topology_promises_down_fails():
    status = ("GPU 0: Tesla V100S (UUID: GPU-a)\n\t Link 0: 25.781 GB/s\n\t Link 1: <inactive>\n"
              "GPU 1: Tesla V100S (UUID: GPU-b)\n\t Link 0: 25.781 GB/s\n\t Link 1: 25.781 GB/s\n")
    topo_out = fixture("topo_13_2xRTX2080Ti_pix_gpu_numa_id.txt").replace("PIX", "NV2")
    c = health.nvlink_check({"nvlink_status": ok(status), "nvlink_errors": ok("")}, topo_out)
    assert c.status == FAIL and "GPU 0: 1 of the 2 NVLinks" in c.detail and "(down: 1)" in c.detail


def test_nvlink_error_counters_warn():
    errs = "GPU 0: x (UUID: GPU-a)\n         Link 3: Replay Errors: 2353\n         Link 3: CRC Errors: 0\n"
    c = health.nvlink_check({"nvlink_status": ok("GPU 0: x (UUID: GPU-a)\n\t Link 3: 25 GB/s\n"),
                             "nvlink_errors": ok(errs)}, None)
    assert c.status == WARN and "link 3 replay errors 2353" in c.detail


def test_nvidia_smi_failing_makes_the_gpu_checks_not_run():
    got = by_name(health.checks({"health_xml": {"rc": 15, "out": "Unable to determine the device handle", "err": ""},
                                 "kernel_journal": ok("")}, None))
    assert got["memory"].status == NOT_RUN and "device handle" in got["memory"].detail


# ------------------------------------------------------------------ the task's pieces

def test_health_verdict_of_a_probe_reply_has_verifys_gpu_checks_and_healths():
    import types
    from torchrig.verify import health_run
    smi = "0, NVIDIA GeForce RTX 4070 Laptop GPU, GPU-1, 00000000:01:00.0, 575.51.02, 8188, Enabled, [N/A], [N/A], 2, 4, 8, 8, 30, 2026, 8.9\n"
    reply = {"run": {"smi_query": ok(smi), "topo": ok(""), **raw(kernel=fixture(
        "xid_01_journal_xid79_fallen_off_bus_gist.txt").replace("0000:10:00", "0000:01:00"))}}
    v = health_run.verdict(types.SimpleNamespace(name="gpu1", gpus=1), reply, None)
    st = {c.name: c.status for c in v.checks}
    assert st["driver"] == PASS and st["gpu-count"] == PASS and st["xid"] == FAIL
    assert v.status == FAIL and "GPU 0 (0000:01:00)" in next(c.detail for c in v.checks if c.name == "xid")


@pytest.mark.parametrize("bad", ["4", "x", "0"])
def test_diag_level_is_one_to_three(bad):
    from torchrig.cli.health import diag_level
    from torchrig.errors import TorchrigError
    assert diag_level("2") == 2 and diag_level(None) is None
    with pytest.raises(TorchrigError, match="1, 2 or 3"):
        diag_level(bad)


# -------------------------------------------------------------- launch's health gate

def _report(bad_hosts, names=("gpu1", "gpu2", "gpu3")):
    from torchrig.verify.evaluate import Check, HostVerdict
    from torchrig.verify.run import VerifyReport
    rep = VerifyReport()
    for name in names:
        v = HostVerdict(name, [Check("driver", PASS, "ok"), Check("persistence", WARN, "off")])
        if name in bad_hosts:
            v.checks.append(Check("xid", FAIL, "GPU 1 (0000:5e:00): Xid 79 (GPU has fallen off the bus)"))
        rep.hosts.append(v)
    return rep


@pytest.fixture
def gate(monkeypatch):
    import types
    from torchrig.launch import health_gate
    from torchrig.verify import health_run
    seen = []
    monkeypatch.setattr(health_run, "check", 
                        lambda fleet, hosts: seen.append([h.name for h in hosts])
                        or _report({"gpu2"}, [h.name for h in hosts]))
    hosts = [types.SimpleNamespace(name=n) for n in ("gpu1", "gpu2", "gpu3")]
    return health_gate, hosts, seen


def test_launch_refuses_an_unhealthy_node_naming_host_gpu_and_reason(gate):
    from torchrig.errors import TorchrigError
    health_gate, hosts, _ = gate
    with pytest.raises(TorchrigError, match=r"^nothing started: unhealthy node\(s\): gpu2: xid: GPU 1 "
                                            r"\(0000:5e:00\): Xid 79 .*--skip-unhealthy"):
        health_gate.gate(None, hosts)


def test_skip_unhealthy_leaves_the_node_out_and_says_so(gate):
    health_gate, hosts, _ = gate
    said = []
    assert [h.name for h in health_gate.gate(None, hosts, skip=True, log=said.append)] == ["gpu1", "gpu3"]
    assert said == ["left out unhealthy node(s) gpu2: gpu2: xid: GPU 1 (0000:5e:00): Xid 79 (GPU has fallen off the bus)"]


def test_with_nodes_only_the_first_n_are_gated_unless_skipping(gate, monkeypatch):
    """launch's one probe judges health: only the first N nodes are probed, unless
    --skip-unhealthy (every selected host; the first N healthy ones are the nodes); the
    unhealthy node is refused or left out before the version gate looks at the nodes."""
    import types
    from torchrig.errors import TorchrigError
    from torchrig.launch import run, service
    _, hosts, seen = gate

    class Judged(Exception):
        pass

    def probe_nodes(fleet, hosts, src=None):
        seen.append([h.name for h in hosts])
        return run.Probed(None, _report({"gpu2"}, [h.name for h in hosts]), {})

    def judge_versions(rep, hosts, job, requires_python=None):
        raise Judged([h.name for h in hosts])
    monkeypatch.setattr(run, "probe_nodes", probe_nodes)
    monkeypatch.setattr(run, "judge_versions", judge_versions)
    s = types.SimpleNamespace(backend="systemd")

    def launch(nodes, **kw):
        fleet = types.SimpleNamespace(hosts=[types.SimpleNamespace(name=h.name, settings=s)
                                             for h in hosts], inv=None)
        with pytest.raises(Judged) as got:
            service.launch(fleet, run.LaunchOptions(job="j"), nodes=nodes, **kw)
        assert [h.name for h in fleet.hosts] == got.value.args[0]  # what Ctrl-C names
        return got.value.args[0]
    assert launch(1) == ["gpu1"] and seen == [["gpu1"]]
    said = []
    assert launch(2, skip_unhealthy=True, log=said.append) == ["gpu1", "gpu3"]
    assert seen[-1] == ["gpu1", "gpu2", "gpu3"] and said[0].startswith("left out unhealthy node(s) gpu2")
    with pytest.raises(TorchrigError, match=r"^nothing started: unhealthy node\(s\): gpu2: xid"):
        launch(2)


# ------------------------------------------------------------------- Slurm drain/resume

class _SlurmFleet:
    def __init__(self, compute=("gpu1", "gpu2")):
        import types
        self.inv = types.SimpleNamespace(slurm=types.SimpleNamespace(controller="gpu3", compute=list(compute)),
                                         host=lambda n: types.SimpleNamespace(name=n))
        self.ran = []

    def run(self, h, cmd, root=False, timeout=None):
        import types
        self.ran.append((h.name, cmd, root))
        return types.SimpleNamespace(exited=0, stdout="", stderr="")


def test_slurm_gate_drains_the_unhealthy_compute_node_with_the_reason(gate):
    import types
    health_gate, hosts, seen = gate
    fleet, said = _SlurmFleet(), []
    hosts.append(types.SimpleNamespace(name="ctl"))
    got = health_gate.gate_slurm(fleet, hosts, skip=True, log=said.append)
    # gpu3 and ctl are no compute nodes here: not judged, kept
    assert [h.name for h in got] == ["gpu1", "gpu3", "ctl"] and seen == [["gpu1", "gpu2"]]
    assert fleet.ran == [("gpu3", "scontrol update nodename=gpu2 state=drain 'reason=torchrig health: "
                                  "xid: GPU 1 (0000:5e:00): Xid 79 (GPU has fallen off the bus)'", True)]
    assert said[0].startswith("drained Slurm node gpu2") and "health --resume gpu2" in said[0]


def test_resume_refuses_a_node_still_unhealthy_and_resumes_a_fixed_one(gate):
    import types
    from torchrig.errors import TorchrigError
    health_gate, _, _ = gate
    fleet = _SlurmFleet()
    with pytest.raises(TorchrigError, match="--resume gpu2: its health is still FAIL: xid: GPU 1"):
        health_gate.resume(fleet, types.SimpleNamespace(name="gpu2"))
    health_gate.resume(fleet, types.SimpleNamespace(name="gpu1"), log=lambda *_: None)
    assert fleet.ran == [("gpu3", "scontrol update nodename=gpu1 state=resume", True)]
    with pytest.raises(TorchrigError, match="not a compute node"):
        health_gate.resume(fleet, types.SimpleNamespace(name="gpu9"))


def test_the_newest_xid_of_a_kernel_log_past_the_probes_cap_is_found(tmp_path):
    """GPU health's own kernel-log commands (health_facts.RUN) through the real probe, with
    journalctl and dmesg replaced by scripts printing a log of 40 MB whose one Xid is its last
    line: the node keeps the Xid lines, so the newest fault is judged, not cut off."""
    import subprocess
    import sys
    from torchrig.facts import health_facts, probe
    bins = tmp_path / "bin"
    bins.mkdir()
    xid_line = next(ln for ln in fixture("xid_01_journal_xid79_fallen_off_bus_gist.txt").splitlines()
                    if "NVRM: Xid" in ln)
    assert xid.KEEP in xid_line
    (bins / "journalctl").write_text(
        "#!/usr/bin/python3\nimport sys\nline = b'2026-12-03T10:00:00+0000 h kernel: ' + b'n' * 60 + b'\\n'\n"
        "for _ in range(400000): sys.stdout.buffer.write(line)\n"
        f"print({xid_line!r})\n")
    (bins / "dmesg").write_text("#!/bin/sh\necho 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1\n")
    for f in bins.iterdir():
        f.chmod(0o755)
    req = {"run": {k: v for k, v in health_facts.RUN.items() if k.startswith("kernel_")}}
    r = subprocess.run([sys.executable, "-I", "-"], input=probe.stdin(req), capture_output=True,
                       text=True, timeout=120, env={"PATH": f"{bins}:/usr/bin:/bin"})
    facts = probe.reply(r.returncode, r.stdout, r.stderr)["run"]
    assert facts["kernel_journal"]["lines"] == 400001 and len(r.stdout) < 10_000
    c = health.xid_check(facts, {}, None)
    assert c.status == FAIL and "Xid 79" in c.detail, c.detail


def test_a_filtered_journal_that_read_lines_is_read_even_without_an_xid():
    """The probe keeps only Xid lines: an empty journal output with lines read is a journal
    read (PASS), not one to replace with dmesg; with no line read, dmesg decides as before."""
    journal = {"rc": 0, "out": "", "err": "", "lines": 1200}
    denied = {"rc": 1, "out": "", "err": "dmesg: read kernel buffer failed: Operation not permitted"}
    assert health.xid_check({"kernel_journal": journal, "kernel_dmesg": denied}, {}, None).status == PASS
    empty = {**journal, "lines": 0}
    assert health.xid_check({"kernel_journal": empty, "kernel_dmesg": denied}, {}, None).status == NOT_RUN
