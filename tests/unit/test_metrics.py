"""Prometheus metrics: the one definition (payload/metrics.py), the sampler run for real on
files laid out as torchrun writes them (stand-ins for nvidia-smi and systemctl only), the
provision step's plan, `torchrig metrics`' grouping, and the examples in examples/monitoring/."""

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from torchrig import metrics as ops
from torchrig import progress
from torchrig.errors import TorchrigError
from torchrig.changes import managed
from torchrig.provision import steps
from torchrig.settings import DEFAULTS, settings_for

REPO = Path(__file__).resolve().parents[2]
M = ops.defs  # payload/metrics.py, as the sampler loads it
SAMPLER = REPO / "payload" / "gpumon.py"

CSV = ("0, 97, 30000, 81559, 65, 312.50, 0, 2, 0x0000000000000004\n"
       "1, 95, 30100, 81559, 66, 301.10, [N/A], [N/A], 0x0000000000000000\n")


# --- the definition and the text format ------------------------------------------------------

def test_every_series_is_defined_once_with_a_valid_name_type_and_key():
    keys = [spec[3] for spec in M.METRICS.values()]
    assert len(set(keys)) == len(keys)
    for name, (kind, help_, labels, _) in M.METRICS.items():
        assert re.fullmatch(r"torchrig_[a-z_]+", name) and help_
        assert kind in ("gauge", "counter") and (kind == "counter") == name.endswith("_total")
        assert labels[:2] == ("job", "node")
    assert set(M.PROGRESS_FIELDS) <= set(M.METRICS)
    assert {s for s, _ in M.GPU_SERIES.values()} <= set(M.METRICS)


def test_render_then_parse_gives_the_samples_back_escaped_labels_and_nan_included():
    odd = 'a "q" \\ b\nc'
    samples = [("torchrig_job_loss", {"job": odd, "node": "gpu1", "rank": "0"}, float("nan")),
               ("torchrig_job_step", {"job": "j", "node": "gpu1", "rank": "0"}, 1200.0),
               ("torchrig_job_tokens_per_second", {"job": "j", "node": "gpu1", "rank": "0"}, 0.25)]
    text = M.render(samples)
    assert text.count("# TYPE torchrig_job_loss gauge") == 1
    assert len(text.splitlines()) == 3 * 3  # HELP, TYPE, one sample each: the newline is escaped
    back = {n: (lab, v) for n, lab, v in M.parse(text)}
    assert {n: lab for n, (lab, _) in back.items()} == {n: lab for n, lab, _ in samples}
    loss = back["torchrig_job_loss"][1]
    assert loss != loss and back["torchrig_job_step"][1] == 1200.0  # NaN: a diverged loss shows
    assert back["torchrig_job_tokens_per_second"][1] == 0.25


@pytest.mark.parametrize("sample,match", [
    (("torchrig_nope", {"job": "j", "node": "n"}, 1.0), "not defined"),
    (("torchrig_job_step", {"job": "j", "node": "n"}, 1.0), "labels"),
])
def test_render_refuses_a_series_not_in_the_definition(sample, match):
    with pytest.raises(ValueError, match=match):
        M.render([sample])


def test_gpu_series_from_one_query_skip_unsupported_fields_and_split_throttle_bits():
    got = {(n, lab["gpu"], lab.get("reason")): v for n, lab, v in M.gpu_samples(CSV, "j", "gpu1")}
    assert got[("torchrig_gpu_memory_used_bytes", "0", None)] == 30000 * 2**20
    assert got[("torchrig_gpu_ecc_errors_uncorrected_total", "0", None)] == 2
    assert ("torchrig_gpu_ecc_errors_corrected_total", "1", None) not in got  # [N/A]
    assert got[("torchrig_gpu_clock_throttle", "0", "sw_power_cap")] == 1
    assert got[("torchrig_gpu_clock_throttle", "1", "sw_power_cap")] == 0
    assert M.util_line(CSV, 100.4) == "100,97,95"
    assert M.mem_line(CSV, 100.4) == "100,30000,81559,30100,81559"


def test_the_query_as_a_real_h200_answers_it():
    """The sampler's one query, as nvidia-smi (driver 570+) answered it on an idle H200."""
    h200 = "0, 0, 0, 143771, 40, 93.42, 0, 0, 0x0000000000000001\n"
    got = {(n, lab.get("reason")): v for n, lab, v in M.gpu_samples(h200, "j", "n")}
    assert got[("torchrig_gpu_memory_total_bytes", None)] == 143771 * 2**20
    assert got[("torchrig_gpu_power_watts", None)] == 93.42
    assert got[("torchrig_gpu_clock_throttle", "gpu_idle")] == 1
    assert got[("torchrig_gpu_clock_throttle", "sw_power_cap")] == 0


# --- the sampler, run for real ---------------------------------------------------------------

def _standins(tmp_path, state="active", csv=CSV):
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    (b / "nvidia-smi").write_text(f"#!/bin/sh\ncat {b / 'smi.out'}\n")
    (b / "smi.out").write_text(csv)
    (b / "systemctl").write_text(f"#!/bin/sh\nprintf 'ActiveState={state}\\nNRestarts=1\\n'\n")
    for f in ("nvidia-smi", "systemctl"):
        (b / f).chmod(0o755)
    return b


def _job_logs(tmp_path, lines0, attempt=2):
    logdir = tmp_path / "logs" / "exp1"
    for rank, lines in ((0, lines0), (1, [progress.format_line("start", {"rank": 1, "local_rank": 1})])):
        d = logdir / "exp1_abc" / f"attempt_{attempt}" / str(rank)
        d.mkdir(parents=True)
        (d / "stdout.log").write_text("".join(ln + "\n" for ln in lines))
    return logdir


STEP = {"step": 40, "loss": "2.3456", "lr": "3.00e-04", "tok/s": "12345", "samples/s": "12.3",
        "mfu": "41.2%", "epoch": 0}


def _sample(tmp_path, *extra, state="active", lines=None, csv=CSV):
    b = _standins(tmp_path, state, csv)
    lines = lines if lines is not None else [
        progress.format_line("start", {"rank": 0, "local_rank": 0, "host": "gpu1"}),
        progress.format_line("step", dict(STEP, step=20)),
        progress.format_line("step", STEP), "a line of the job's own"]
    logdir = tmp_path / "logs" / "exp1"
    if not logdir.exists():
        logdir = _job_logs(tmp_path, lines)
    out = tmp_path / "metrics"
    out.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-I", str(SAMPLER), "--job", "exp1", "--node", "gpu1",
                        "--unit", "torchrig-exp1.service", "--logdir", str(logdir),
                        "--util-file", str(logdir / "gpu_util.csv"), "--textfile-dir", str(out),
                        "--mem-file", str(logdir / "gpu_mem.csv"),
                        *extra], env={"PATH": f"{b}:/usr/bin:/bin"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return out, logdir


def _series(out):
    return {(n, lab.get("gpu"), lab.get("reason"), lab.get("state")): (lab, v)
            for n, lab, v in M.parse((out / "torchrig_exp1.prom").read_text())}


def test_sampler_writes_the_progress_line_values_and_gpu_series_atomically(tmp_path):
    out, logdir = _sample(tmp_path)
    s = _series(out)
    lab, step = s[("torchrig_job_step", None, None, None)]
    assert lab == {"job": "exp1", "node": "gpu1", "rank": "0"} and step == 40
    assert s[("torchrig_job_loss", None, None, None)][1] == 2.3456
    assert s[("torchrig_job_tokens_per_second", None, None, None)][1] == 12345
    assert s[("torchrig_job_samples_per_second", None, None, None)][1] == 12.3
    assert s[("torchrig_job_mfu_ratio", None, None, None)][1] == pytest.approx(0.412)
    assert s[("torchrig_job_restarts", None, None, None)][1] == 3  # attempt 2 + 1 systemd restart
    assert s[("torchrig_job_state", None, None, "active")][1] == 1
    assert s[("torchrig_job_state", None, None, "failed")][1] == 0
    assert s[("torchrig_gpu_utilization_percent", "1", None, None)][1] == 95
    assert 0 <= s[("torchrig_job_last_progress_age_seconds", None, None, None)][1] < 60
    prom = out / "torchrig_exp1.prom"
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644  # node_exporter's user reads it
    assert sorted(p.name for p in out.iterdir()) == ["torchrig_exp1.prom"]  # no temp file left
    assert (logdir / "gpu_util.csv").read_text().strip().endswith(",97,95")  # torchrig status's line
    assert (logdir / "gpu_mem.csv").read_text().strip().endswith(",30000,81559,30100,81559")


def test_sampler_without_gpu_series_or_for_an_ended_job(tmp_path):
    out, _ = _sample(tmp_path, "--no-gpu")
    assert not any(n.startswith("torchrig_gpu_") for n, *_ in _series(out))
    assert ("torchrig_job_step", None, None, None) in _series(out)
    out, _ = _sample(tmp_path, state="inactive")  # an ended job holds no GPU
    s = _series(out)
    assert not any(n.startswith("torchrig_gpu_") for n, *_ in s)
    assert s[("torchrig_job_state", None, None, "inactive")][1] == 1


def test_sampler_replaces_a_planted_symlink_and_skips_a_fifo(tmp_path):
    """The job's user owns both folders: a symlink where the .prom goes is replaced, never
    written through; a FIFO as a log file does not block the sampler."""
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "torchrig_exp1.prom").symlink_to(victim)
    logdir = _job_logs(tmp_path, [progress.format_line("step", STEP)])
    fifo = logdir / "exp1_abc" / "attempt_2" / "1" / "stdout.log"
    fifo.unlink()
    os.mkfifo(fifo)
    out, _ = _sample(tmp_path)
    assert victim.read_text() == "keep\n"
    assert not (out / "torchrig_exp1.prom").is_symlink()
    assert ("torchrig_job_step", None, None, None) in _series(out)


def test_progress_age_counts_from_when_a_line_was_first_seen_when_more_lines_follow(tmp_path):
    lines = [progress.format_line("step", STEP), "noise after the last progress line"]
    out, logdir = _sample(tmp_path, lines=lines)
    state = json.loads((logdir / ".gpumon-state.json").read_text())
    state["seen"] -= 500  # as if first seen 500 s ago
    (logdir / ".gpumon-state.json").write_text(json.dumps(state))
    out, _ = _sample(tmp_path)
    age = _series(out)[("torchrig_job_last_progress_age_seconds", None, None, None)][1]
    assert 500 <= age < 560


# --- provision ---------------------------------------------------------------------------------

def _ctx(facts, address="10.0.0.7", **vars_):
    from test_provision_plan import ctx, fresh
    return ctx(fresh(**facts), address, **vars_)


def test_node_exporter_config_goes_first_then_pinned_install_hold_and_a_checked_start():
    c = _ctx({})
    ch = steps.node_exporter(c)
    desc = [x.describe() for x in ch]
    assert desc[0].startswith("write /etc/default/prometheus-node-exporter")
    assert "--web.listen-address=10.0.0.7:9100 " in ch[0].content  # the cluster address
    assert "0.0.0.0" not in ch[0].content
    assert "--collector.textfile.directory=/var/lib/torchrig/metrics" in ch[0].content
    assert desc[1] == "install prometheus-node-exporter 1.5.0-1+b6: prometheus-node-exporter=1.5.0-1+b6"
    assert desc[2].startswith("hold prometheus-node-exporter")
    assert "http://10.0.0.7:9100/metrics" in ch[-1].script and "systemctl restart" in ch[-1].script
    assert ("/var/lib/torchrig/metrics", 0o755, "torchrig") in steps.dirs(c.s)


def test_node_exporter_converged_changes_nothing_and_a_new_address_restarts_it():
    body = managed.NODE_EXPORTER_ARGS.render(listen="10.0.0.7:9100", textfile_dir="/var/lib/torchrig/metrics")
    import hashlib
    facts = {"packages": {"prometheus-node-exporter": "1.5.0-1+b6"}, "held": ["prometheus-node-exporter"],
             "files": {"/etc/default/prometheus-node-exporter": {
                 "sha256": hashlib.sha256(body.encode()).hexdigest(), "mode": 0o644, "owner": "root",
                 "group": "root", "content": body}},
             "units": {"prometheus-node-exporter.service": {"enabled": "enabled", "active": "active"}}}
    assert steps.node_exporter(_ctx(facts)) == []
    moved = [x.describe() for x in steps.node_exporter(_ctx(facts, node_exporter_address="192.0.2.5"))]
    assert moved[0].startswith("write /etc/default/prometheus-node-exporter")
    assert moved[1].startswith("restart prometheus-node-exporter.service (its config changed)")
    off = _ctx(facts, node_exporter=False)
    assert next(s for s in steps.STEPS if s.name == "node-exporter").enabled(off)


@pytest.mark.parametrize("vars_,match", [
    ({"metrics_dir": "/var/lib/my metrics"}, "metrics_dir"),
    ({"node_exporter_address": "0.0.0.0 --web.config.file=/x"}, "node_exporter_address"),
    ({"metrics_dir": "/srv/m", "log_dir": "/srv/m/logs"}, "lies in metrics_dir"),
])
def test_metrics_settings_refused(vars_, match):
    with pytest.raises(TorchrigError, match=match):
        settings_for("h", vars_, "inv.yml")


def test_scrape_targets_default_to_the_inventory_address():
    from torchrig.inventory import Host
    h = Host(name="gpu1", connection="ssh", address="10.1.2.3", port=None, user=None,
             identity_file=None, jump=None, gpus=2, groups=(), settings=DEFAULTS)
    assert ops.scrape_targets([h]) == [("gpu1", "10.1.2.3:9100")]


# --- torchrig metrics' grouping ---------------------------------------------------------------

def test_views_group_by_job_and_node_and_filter_a_job():
    text = M.render(M.gpu_samples(CSV, "exp1", "gpu1")
                    + M.job_samples("exp1", "gpu1", 0, dict(STEP), 3.0, 1, "active", 1e9)
                    + M.job_samples("other", "gpu1", 0, None, None, 0, "failed", 1e9))
    got = ops.views(M.parse(text))
    assert [(v.job, v.state) for v in got] == [("exp1", "active"), ("other", "failed")]
    d = got[0].as_dict()
    assert (d["step"], d["loss"], d["tok/s"], d["rank"]) == (40, 2.3456, 12345, "0")
    assert d["gpus"]["0"]["util_percent"] == 97 and d["throttled"] == {"0": ["sw_power_cap"]}
    assert [v.job for v in ops.views(M.parse(text), job="other")] == ["other"]
    # ages by the node's clock: a sampler that stopped shows
    fresh, stale = (ops.views(M.parse(text), "exp1", node_time=t)[0] for t in (1e9 + 20, 1e9 + 600))
    assert (fresh.sample_age_s, fresh.stale) == (20, False) and (stale.sample_age_s, stale.stale) == (600, True)


# --- the examples -----------------------------------------------------------------------------

EXAMPLES = REPO / "examples" / "monitoring"


def test_dashboard_queries_name_only_defined_series():
    dash = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    assert len(exprs) >= 10
    named = {n for e in exprs for n in re.findall(r"\btorchrig_[a-z_]+", e)}
    assert named and named <= set(M.METRICS), named - set(M.METRICS)
    # the job's progress and every kind of GPU series are on it
    assert {"torchrig_job_loss", "torchrig_job_tokens_per_second",
            "torchrig_gpu_utilization_percent", "torchrig_gpu_memory_used_bytes"} <= named
    for p in dash["panels"]:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_scrape_config_is_yaml_naming_the_exporter_port():
    doc = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())
    targets = [t for sc in doc["scrape_configs"] for c in sc["static_configs"] for t in c["targets"]]
    assert targets and all(t.rsplit(":", 1)[1] == str(DEFAULTS.node_exporter_port) for t in targets)


def test_the_sampler_unit_follows_the_node_exporter_and_gpu_metrics_vars():
    from test_launch_plan import job
    from torchrig.inventory import Host
    from torchrig.launch import plan
    from torchrig.launch.run import _node
    host = lambda **v: Host(name="gpu1", connection="ssh", address="10.0.0.1", port=None,  # noqa: E731
                            user=None, identity_file=None, jump=None, gpus=2, groups=(),
                            settings=settings_for("gpu1", v, "inv.yml"))
    j = job(1)
    n = _node(None, host(), 0, "gpu", "eth0")
    argv = plan.sampler_argv(j, n)
    assert argv[argv.index("--textfile-dir") + 1] == "/var/lib/torchrig/metrics" and "--no-gpu" not in argv
    argv = plan.sampler_argv(j, _node(None, host(gpu_metrics=False, node_exporter=False), 0, "gpu", None))
    assert "--no-gpu" in argv and "--textfile-dir" not in argv


def test_node_exporter_on_ubuntu_waits_for_its_own_pin():
    """The default pin is Debian 12's: on Ubuntu the step is skipped, saying which var to set,
    instead of an apt failure half-way; with the var set it installs that version."""
    from test_provision_plan import UBUNTU
    skipped = _ctx({"os_release": UBUNTU})
    why = steps.node_exporter_skip(skipped)
    assert "node_exporter_version" in why and "ubuntu2404" in why
    assert "prometheus-node-exporter" not in steps._pinned(skipped)
    pinned = _ctx({"os_release": UBUNTU}, node_exporter_version="1.7.0-1ubuntu0.3")
    assert steps.node_exporter_skip(pinned) is None
    assert "prometheus-node-exporter=1.7.0-1ubuntu0.3" in steps.node_exporter(pinned)[1].describe()


def test_sampler_follows_no_link_where_the_status_file_goes(tmp_path):
    """The job can put a symlink (or a FIFO) where gpu_util.csv goes: the sampler neither
    appends through it nor blocks, and still writes its .prom file."""
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    logdir = _job_logs(tmp_path, [progress.format_line("step", STEP)])
    (logdir / "gpu_util.csv").symlink_to(victim)
    out, _ = _sample(tmp_path)
    assert victim.read_text() == "keep\n" and ("torchrig_job_step", None, None, None) in _series(out)
    (logdir / "gpu_util.csv").unlink()
    os.mkfifo(logdir / "gpu_util.csv")
    out, _ = _sample(tmp_path)  # returns (bounded by its timeout) and exits 0


def test_the_table_flags_a_stale_sample_and_an_unreachable_node(capsys):
    from torchrig import tables
    from torchrig.session import Result
    text = M.render(M.job_samples("exp1", "gpu1", 0, dict(STEP), 3.0, 1, "active", 1e9))
    stale = ops.views(M.parse(text), node_time=1e9 + 600)
    tables.metrics_table("metrics", [Result("gpu1", True, stale), Result("gpu2", False, error="no route")])
    out = capsys.readouterr().out
    assert "sampled 600s ago" in out and "12345" in out and "no route" in out
