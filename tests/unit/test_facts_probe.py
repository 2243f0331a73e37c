"""The probe (facts/probe_host.py, run for real here as it runs on a host) and the parsers of
its raw output (facts/dpkg, systemd, python_env, provision_facts, job_state), the latter
against output captured from the testbed hosts (tests/fixtures/INDEX.md)."""

import json
import os
import subprocess
import sys

import pytest

from torchrig.errors import TorchrigError
from torchrig.facts import dpkg, job_state, probe, provision_facts, python_env, systemd, verify_facts

from _fixtures import FIXTURES, fixture


def run_probe(req: dict, timeout: int = 60) -> dict:
    r = subprocess.run([sys.executable, "-I", "-"], input=probe.stdin(req), capture_output=True,
                       text=True, timeout=timeout)
    return probe.reply(r.returncode, r.stdout, r.stderr)


# ---------------------------------------------------------------- parsers, from captures

def test_dpkg_query_keeps_installed_and_held_drops_known_but_not_installed():
    got = dpkg.parse_query(fixture("dpkg_query_01_testbed_held_unknown_missing.txt"))
    assert got == {"cuda-drivers": "570.172.08-1", "cuda-keyring": "1.1-1",
                   "cuda-toolkit-12-8": "12.8.93-1", "libnccl-dev": "2.26.2-1+cuda12.8",
                   "libnccl2": "2.26.2-1+cuda12.8"}  # nvidia-open is "un": not installed


def test_dpkg_query_removed_with_config_files_is_not_installed():
    text = "nvidia-open\t570.172.08-1\trc \nlibnccl2\t2.26.2-1\thi \nbroken\t1\tiF \n"
    assert dpkg.parse_query(text) == {"libnccl2": "2.26.2-1"}


def test_apt_mark_showhold():
    assert dpkg.parse_holds(fixture("apt_mark_showhold_01_testbed.txt")) == [
        "cuda-drivers", "cuda-toolkit-12-8", "libnccl-dev", "libnccl2"]


def test_apt_cache_show_names_only_the_pins_the_archive_has():
    got = dpkg.parse_apt_cache_show(fixture("apt_cache_show_01_testbed_two_of_three_pins.txt"))
    assert got == {"libnccl2=2.26.2-1+cuda12.8", "cuda-keyring=1.1-1"}


def test_systemctl_show_blocks_map_to_units_in_argument_order():
    units = ["ssh.service", "nvidia-persistenced.service", "torchrig-nosuch.service",
             "torchrig-capture.service"]
    props = systemd.parse_show(fixture("systemctl_show_01_units_loaded_notfound_transient.txt"), units)
    assert [systemd.unit_state(props[u]) for u in units] == [
        {"enabled": "enabled", "active": "active"}, {"enabled": "enabled", "active": "active"},
        {"enabled": "not-found", "active": "inactive"}, {"enabled": "transient", "active": "active"}]
    # a unit systemctl printed no block for (output cut short) reads as unknown, not as another's
    short = systemd.parse_show("LoadState=loaded\nActiveState=active\nUnitFileState=enabled\n", units[:2])
    assert systemd.unit_state(short[units[1]]) == {"enabled": "not-found", "active": "unknown"}
    assert systemd.parse_show("", units[:1]) == {units[0]: {}}


def test_job_unit_show_and_uptime():
    props = systemd.parse_show(fixture("systemctl_show_02_job_unit_running.txt"), ["u"])["u"]
    assert props["ActiveState"] == "active" and props["SubState"] == "running"
    assert job_state.uptime(props, 13046.7444) == 30.0
    gone = systemd.parse_show(fixture("systemctl_show_03_job_unit_not_found.txt"), ["u"])["u"]
    assert gone["LoadState"] == "not-found" and job_state.uptime(gone, 5.0) is None
    assert job_state.uptime({"ActiveEnterTimestampMonotonic": "x"}, 5.0) is None


def test_venv_from_its_files():
    assert python_env.pyvenv_version(fixture("pyvenv_cfg_01_debian12_python3_11.txt")) == "3.11.2"
    assert python_env.pyvenv_version("home = /usr/bin\n") is None
    assert python_env.parse_metadata(fixture("distinfo_01_torch_metadata_head4096.txt")) == \
        ("torch", "2.13.0+cpu")
    assert python_env.dists(["Name: Typing_Extensions\nVersion: 4.16.0\n", "Name: x\n", None]) == \
        {"typing-extensions": "4.16.0"}


def test_provision_facts_from_a_captured_reply():
    cap = json.loads((FIXTURES / "probe_01_provision_reply_testbed_gpu1.json").read_text())
    want, raw = cap["want"], cap["reply"]
    assert set(provision_facts.probe_request(want)["run"]) == set(raw["run"])
    f = provision_facts.facts(want, raw)
    assert f["packages"]["libnccl2"] == "2.26.2-1+cuda12.8" and "nvidia-open" not in f["packages"]
    assert f["held"] == ["cuda-drivers", "cuda-toolkit-12-8", "libnccl-dev", "libnccl2"]
    # every pin not installed at its version is looked up; installed ones are not listed
    assert f["available"] == {s: True for s in want["available"]
                              if s.partition("=")[0] not in f["packages"]}
    assert f["units"] == {"nvidia-persistenced.service": {"enabled": "enabled", "active": "active"},
                          "nvidia-fabricmanager.service": {"enabled": "not-found", "active": "inactive"}}
    assert f["venv"]["python"] == "3.11.2" and f["venv"]["dists"]["torch"] == "2.13.0+cpu"
    assert f["secure_boot"] is False and f["nvidia_smi"]["rc"] == 0
    assert "VERSION_CODENAME=bookworm" in f["os_release"] and len(f["boot_id"]) == 36
    assert all("content" not in (f["files"][p] or {}) for p in want["secret_files"])
    assert all("content" in f["files"][p] for p in want["files"] if f["files"][p])
    assert set(f) == {"os_release", "arch", "kernel", "euid", "boot_id", "disk_free_gb", "lspci",
                      "secure_boot", "packages", "held", "available", "dpkg_audit",
                      "dpkg_updates_pending", "files", "dirs", "paths", "users", "units",
                      "nvidia_smi", "venv", "firewall"}
    # torchrig's nftables table loaded, and the kernel's ephemeral range (the firewall's job ports)
    assert f["firewall"] == {"loaded": True, "ephemeral": "32768\t60999\n"}


def test_secure_boot_from_mokutil_or_the_efi_variable():
    missing = {"rc": 127, "out": "", "err": "mokutil: command not found"}
    assert provision_facts.secure_boot({"rc": 0, "out": "SecureBoot enabled\n", "err": ""}, {})
    assert not provision_facts.secure_boot({"rc": 0, "out": "SecureBoot disabled\n", "err": ""}, {})
    assert provision_facts.secure_boot(missing, {"/sys/firmware/efi/efivars/SecureBoot-x": "\x06\0\0\0\x01"})
    assert not provision_facts.secure_boot(missing, {"/sys/firmware/efi/efivars/SecureBoot-x": "\x06\0\0\0\0"})
    assert not provision_facts.secure_boot(missing, {})


def test_verify_network_and_runtime_parsing():
    peer = {"address": "gpu1", "port": 29400}
    got = {"resolved": "10.0.0.1", "reachable": True, "connect_ms": 0.3,
           "route": {"rc": 0, "out": '[{"dst":"10.0.0.1","dev":"eth1","prefsrc":"10.0.0.2"}]', "err": ""}}
    assert verify_facts.network(peer, got) == {"address": "gpu1", "port": 29400, "resolved": "10.0.0.1",
                                               "reachable": True, "connect_ms": 0.3,
                                               "interface": "eth1", "source": "10.0.0.2"}
    bad = verify_facts.network(peer, {"resolved": "10.0.0.1", "route": {"rc": 2, "out": "", "err": "RTNETLINK"}})
    assert bad["route_error"] == "RTNETLINK"
    assert verify_facts.torch_runtime({"rc": 0, "out": 'noise\n{"torch": "2.13.0"}\n', "err": ""}) == \
        {"torch": "2.13.0"}
    assert verify_facts.torch_runtime({"rc": 1, "out": "", "err": "ModuleNotFoundError: torch\n"}) == \
        {"error": "ModuleNotFoundError: torch"}
    assert verify_facts.cuda_toolkit('{"cuda": {"version": "12.8.1"}}') == "12.8.1"
    assert verify_facts.cuda_toolkit("[1]") is None and verify_facts.cuda_toolkit("") is None
    # no version.json (cuda-nvcc-13-0 without cuda-toolkit-13-0, as on an H200 box): nvcc's
    assert verify_facts.cuda_toolkit("", fixture("nvcc_01_cuda13_0_h200_container.txt")) == "13.0.88"
    assert verify_facts.cuda_toolkit('{"cuda": {"version": "13.0.2"}}', "release 12.8, V12.8.93") == "13.0.2"


def test_job_progress_prefers_rank_zero_and_counts_torchrun_starts():
    files = {"r1/attempt_1/1/stdout.log": {"first_line": "start rank=3\n", "text": "step=9 a\n"},
             "r1/attempt_1/0/stdout.log": {"first_line": "start rank=0\n", "text": "x\nstep=8 b\nnoise\n"},
             "r1/attempt_1/2/stdout.log": None}
    assert job_state.progress(files) == "step=8 b"
    assert job_state.attempts([["r1/attempt_0", 10.0], ["r1/attempt_1", 20.0], ["r0/attempt_0", 5.0]]) == (1, 2)
    assert job_state.attempts([]) == (None, 0)


# ---------------------------------------------------------------- the probe itself

def test_the_request_travels_inert_on_stdin():
    """Nothing of the request in a command line, and no request text can become code."""
    evil = 'x")\nraise SystemExit(9)\n#'
    text = probe.stdin({"exists": [evil]})
    assert evil not in text and probe.COMMAND == "python3 -I -"
    assert run_probe({"exists": [evil]})["exists"] == {evil: False}


# each command marks itself present, waits (up to `wait` s) until `k` are present at once,
# and prints the most it saw: a count, not a timing, so machine speed does not matter. The
# first to see `k` leaves a flag that ends every other's wait: a command that polled just
# before the last one arrived cannot miss the moment all were there (the first leaves at
# once) and wait out `wait`. `wait` stays well inside the command's kill timeout.
OVERLAP = """import os, sys, time
d, me, k, wait = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
flag = d + ".all-seen"
open(os.path.join(d, me), "w").close()
seen, end = 0, time.monotonic() + wait
while seen < k and not os.path.exists(flag) and time.monotonic() < end:
    seen = max(seen, len(os.listdir(d)))
    time.sleep(0.05)
if seen >= k:
    open(flag, "w").close()
os.remove(os.path.join(d, me))
print(seen)
"""


def test_commands_run_concurrently_within_the_bound(tmp_path):
    def most_at_once(jobs, k, wait):
        d = tmp_path / f"j{jobs}"
        d.mkdir()
        # the probe kills a command only long after its wait ends (a loaded machine can take
        # seconds to start python), and this test waits for the probe longer still
        kill = wait + 120
        got = run_probe({"run": {str(i): {"argv": ["python3", "-c", OVERLAP, str(d), str(i), str(k),
                                                    str(wait)], "timeout": kill}
                                 for i in range(4)}, "jobs": jobs}, timeout=int(4 * kill))["run"]
        assert all(r["rc"] == 0 for r in got.values()), got
        return max(int(r["out"]) for r in got.values())
    assert most_at_once(4, 4, 60) == 4     # all four at once (each waits for the others)
    assert most_at_once(2, 3, 1.5) == 2    # never more than the bound


def test_a_calls_error_is_raised_where_its_result_is_taken():
    from torchrig.facts import probe_host
    gate = probe_host.threading.BoundedSemaphore(1)
    ok, bad = probe_host.Later(gate, divmod, 7, 2), probe_host.Later(gate, divmod, 1, 0)
    assert ok.result() == (3, 1)
    with pytest.raises(ZeroDivisionError):
        bad.result()


def test_a_probe_starts_without_the_modules_only_some_requests_need():
    """A probe's own start is paid on every node at every round trip: what only a connection
    check (socket) or a hash (hashlib) needs is imported there, and no thread pool module
    (concurrent.futures brings logging); the answers are unchanged."""
    src = "import sys\n" + probe.stdin({"host": True, "run": {"a": ["true"]}}) + (
        "\nprint(sorted({'concurrent.futures', 'logging', 'socket', 'hashlib'} & set(sys.modules)),"
        " file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-I", "-"], input=src, capture_output=True, text=True,
                       timeout=60)
    got = probe.reply(r.returncode, r.stdout, "")
    assert r.stderr.strip() == "[]"
    assert got["host"]["hostname"] == os.uname().nodename and got["run"]["a"]["rc"] == 0
    assert run_probe({"stat": {__file__: False}})["stat"][__file__]["sha256"] == (
        __import__("hashlib").sha256(open(__file__, "rb").read()).hexdigest())


def test_a_missing_command_a_timeout_and_raw_streams():
    got = run_probe({"run": {"missing": ["torchrig-no-such-tool"],
                             "slow": {"argv": ["sleep", "30"], "timeout": 1},
                             "both": ["sh", "-c", "echo out; echo err >&2; exit 3"]}})["run"]
    assert got["missing"]["rc"] == 127 and "command not found" in got["missing"]["err"]
    assert got["slow"]["rc"] == 124
    assert got["both"] == {"rc": 3, "out": "out\n", "err": "err\n"}


def test_reads_never_follow_a_link_block_on_a_fifo_or_read_a_hard_link(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    (tmp_path / "link").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo")
    os.link(secret, tmp_path / "hard")
    (tmp_path / "dirlink").symlink_to(tmp_path)
    (tmp_path / "ok").write_text("line1\nline2\nline3\n")
    req = {"read": {n: {"path": str(tmp_path / n)} for n in ("link", "fifo", "hard", "ok", "absent")}}
    req["read"]["via-dir-link"] = {"path": str(tmp_path / "dirlink" / "ok")}
    req["read"]["tail"] = {"path": str(tmp_path / "ok"), "limit": 6, "tail": True, "first_line": True}
    req["read"]["followed"] = {"path": str(tmp_path / "link"), "follow": True}
    got = run_probe(req, timeout=20)["read"]
    assert got["link"] is None and got["fifo"] is None and got["hard"] is None
    assert got["absent"] is None and got["via-dir-link"] is None
    assert got["ok"] == {"text": "line1\nline2\nline3\n"}
    assert got["tail"] == {"first_line": "line1\n", "text": "line3\n"}
    assert got["followed"] == {"text": "root only\n"}  # root's own files only (os-release)


def test_stat_hashes_secret_files_without_returning_them(tmp_path):
    (tmp_path / "auth.conf").write_text("machine x login u password p\n")
    got = run_probe({"stat": {str(tmp_path / "auth.conf"): False, str(tmp_path): False,
                              str(tmp_path / "none"): True}})["stat"]
    f = got[str(tmp_path / "auth.conf")]
    assert "content" not in f and len(f["sha256"]) == 64 and not f["is_dir"]
    assert got[str(tmp_path)]["is_dir"] and got[str(tmp_path / "none")] is None


def test_tree_reads_only_the_newest_attempt_and_skips_symlinked_folders(tmp_path):
    old = tmp_path / "run_a" / "attempt_0" / "0"
    old.mkdir(parents=True)
    (old / "stdout.log").write_text("start rank=0\nstep=1\n")
    new = tmp_path / "run_b" / "attempt_1" / "0"
    new.mkdir(parents=True)
    (new / "stdout.log").write_text("start rank=0\nstep=5\n")
    os.utime(tmp_path / "run_a" / "attempt_0", (1, 1))
    elsewhere = tmp_path.parent / (tmp_path.name + "-elsewhere")
    (elsewhere / "attempt_9" / "0").mkdir(parents=True)
    (tmp_path / "run_c").symlink_to(elsewhere)  # a folder the job points elsewhere
    got = run_probe({"tree": {"t": {"root": str(tmp_path), "walk": [r"[^.].*", r"attempt_\d+"],
                                    "then": [r"\d+"], "read": {"name": "stdout.log", "first_line": True}}}})
    t = got["tree"]["t"]
    assert sorted(d for d, _ in t["dirs"]) == ["run_a/attempt_0", "run_b/attempt_1"]
    assert t["files"] == {"run_b/attempt_1/0/stdout.log": {"first_line": "start rank=0\n",
                                                           "text": "start rank=0\nstep=5\n"}}
    assert run_probe({"tree": {"t": {"root": str(tmp_path / "run_c")}}})["tree"]["t"] == \
        {"dirs": [], "files": {}}


def test_verify_reads_the_cuda_version_through_the_alternatives_symlink(tmp_path, monkeypatch):
    """/usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-13.0 on real installs."""
    real = tmp_path / "cuda-13.0"
    real.mkdir()
    (real / "version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "13.0.2"}}')
    (tmp_path / "alternatives-cuda").symlink_to(real)
    (tmp_path / "cuda").symlink_to(tmp_path / "alternatives-cuda")
    monkeypatch.setattr(verify_facts, "CUDA_VERSION_FILE", str(tmp_path / "cuda" / "version.json"))
    raw = run_probe(verify_facts.probe_request(str(tmp_path / "venv"), False, None))
    assert verify_facts.facts(str(tmp_path / "venv"), None, raw)["cuda_toolkit"] == "13.0.2"


def test_a_failed_probe_is_one_clear_error():
    with pytest.raises(TorchrigError, match="cannot become root"):
        probe.reply(1, "", "sudo: a password is required\n")
    with pytest.raises(TorchrigError, match=r"status failed \(exit 2\): boom"):
        probe.reply(2, "", "boom\n", "status")
    with pytest.raises(TorchrigError, match="not JSON"):
        probe.reply(0, "Traceback", "")


def test_status_from_a_captured_reply_of_a_running_job():
    cap = json.loads((FIXTURES / "probe_02_status_reply_testbed_running_job.json").read_text())
    raw = cap["reply"]
    assert set(job_state.probe_request(cap["unit"], "/l", "/l/u.csv", 1 << 16)["run"]) == set(raw["run"])
    d = job_state.state(cap["unit"], raw, 1800)
    assert d["unit"]["ActiveState"] == "active" and d["unit"]["LoadState"] == "loaded"
    assert d["attempt"] == 0 and d["torchrun_starts"] == 1
    assert d["progress"].startswith("step=50 loss=2.5560")  # rank 0 prints progress
    assert d["uptime_s"] == 46.2 and [g["mem_total"] for g in d["gpus"]] == ["32768", "32768"]
    assert d["util_samples"] == [(45, [0.0, 0.0]), (14, [0.0, 0.0])]


def journal_probe(tmp_path, request: dict, journalctl: str) -> dict:
    """The probe's journal kind run for real, journalctl (this shell script) and systemctl
    being stand-ins on PATH (no journal of a unit here)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "journalctl").write_text("#!/bin/sh\n" + journalctl)
    (bin_ / "systemctl").write_text("#!/bin/sh\necho 'Mon 2026-11-30 10:00:00 UTC'\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    r = subprocess.run([sys.executable, "-I", "-"], input=probe.stdin({"journal": request}),
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"})
    return probe.reply(r.returncode, r.stdout, r.stderr)["journal"]


def test_journal_request_keeps_agent_lines_and_each_ranks_last_lines(tmp_path):
    """The probe's journal kind (status reads it in its one probe per node; logs --failures
    too): lines before the unit's last start dropped, each rank's last `keep` lines kept,
    kernel OOM lines since the start. journalctl and systemctl are stand-ins on PATH."""
    from torchrig.logs import diagnose
    got = journal_probe(tmp_path, diagnose.journal_request("torchrig-j.service", keep=2, lines=100),
                        "case \" $* \" in *\" -k \"*) printf 'eth0 up\\nOut of memory: Killed process 42 (python)\\n';;\n"
                        "*) printf 'old run line\\nStarted torchrig-j.service\\n[default0]:a1\\n[default1]:b1\\n"
                        "agent: rendezvous done\\n[default0]:a2\\n[default0]:a3\\n';; esac\n")
    assert got["journal"].splitlines() == ["Started torchrig-j.service", "[default1]:b1",
                                           "agent: rendezvous done", "[default0]:a2", "[default0]:a3"]
    assert got["kernel"] == "Out of memory: Killed process 42 (python)"
    assert diagnose.node_from("gpu1", 0, got).host == "gpu1"


def test_launch_start_check_from_the_probe(tmp_path):
    """launch waits for each node's workers: the unit's state and the newest attempt's rank
    folders, read by the probe (no shell on the node)."""
    for rank in ("0", "1"):
        (tmp_path / "run1" / "attempt_0" / rank).mkdir(parents=True)
    (tmp_path / "run1" / "attempt_0" / "0" / "stdout.log").write_text("x\n")
    req = job_state.start_request("u.service", str(tmp_path))
    assert req["run"]["unit"] == ["systemctl", "show",
                                  "--property=ActiveState,Result,ActiveEnterTimestampMonotonic",
                                  "--", "u.service"]
    req["run"]["unit"] = ["printf", "ActiveState=active\\nResult=success\\n"]
    assert job_state.started("u.service", run_probe(req)) == ("active", "success", 2)
    req["tree"]["logs"]["root"] = str(tmp_path / "none")
    assert job_state.started("u.service", run_probe(req)) == ("active", "success", 0)


def _probe_while_a_rank_appears(req, rank_dir):
    """(the probe's answer to req, seconds it took) while rank_dir is made 0.4 s in."""
    import threading
    import time
    later = threading.Timer(0.4, rank_dir.mkdir)
    later.start()
    t0 = time.monotonic()
    got = run_probe(req)
    took = time.monotonic() - t0
    later.join()
    return got, took


def test_launch_start_check_waits_on_the_node_until_its_answer_changes(tmp_path):
    """The probe's "until": given the digest of the last answer it answers once the answer
    differs (here: a rank folder made 0.4 s in), or after the wait with the same digest; a
    rank writing its stdout.log changes nothing (the check reads no output)."""
    import time
    attempt = tmp_path / "run1" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    (attempt / "0" / "stdout.log").write_text("x\n")
    req = job_state.start_request("u.service", str(tmp_path))
    req["run"]["unit"] = ["printf", "ActiveState=active\\nResult=success\\n"]
    first = run_probe(req)
    assert first["seen"]  # no digest given: answered at once, with its digest
    assert job_state.started("u.service", first) == ("active", "success", 1)

    again = job_state.start_request("u.service", str(tmp_path), first["seen"], 0.6)
    again["run"] = req["run"]
    with open(attempt / "0" / "stdout.log", "a") as f:
        f.write("step=1\n")  # output alone: no change
    t0 = time.monotonic()
    same = run_probe(again)
    assert time.monotonic() - t0 >= 0.6 and same["seen"] == first["seen"]

    again["until"]["seconds"] = 20
    changed, took = _probe_while_a_rank_appears(again, attempt / "1")
    assert 0.4 <= took < 10, took
    assert changed["seen"] != first["seen"]
    assert job_state.started("u.service", changed) == ("active", "success", 2)


def test_the_start_check_sees_a_spawn_between_the_units_looks_without_a_command_per_look(
        tmp_path):
    """"quick": between the whole answer's gatherings (every `every` s, the unit's systemctl
    included) the node looks at the rank folders alone, so a folder made 0.4 s in is answered
    well before the next whole look, and the command ran only for the first answer and the
    one that changed. Without "quick" the same change waits for the next whole look."""
    attempt = tmp_path / "run1" / "attempt_0"
    attempt.mkdir(parents=True)
    count = tmp_path / "count"
    unit = ["sh", "-c", f"echo >> {count}; printf 'ActiveState=active\\n'"]
    first = job_state.start_request("u.service", str(tmp_path))
    first["run"]["unit"] = unit
    req = job_state.start_request("u.service", str(tmp_path), run_probe(first)["seen"], 20)
    req["run"]["unit"] = unit
    req["until"]["every"] = 2.0
    count.unlink()
    got, took = _probe_while_a_rank_appears(req, attempt / "0")
    assert 0.4 <= took < 1.5, took
    assert job_state.started("u.service", got)[2] == 1
    assert count.read_text().count("\n") == 2
    del req["until"]["quick"]
    req["until"]["seen"] = got["seen"]
    count.unlink()
    got, took = _probe_while_a_rank_appears(req, attempt / "1")
    assert took >= 2.0 and job_state.started("u.service", got)[2] == 2, took
    assert count.read_text().count("\n") == 2


def test_status_counts_restarts_as_the_metrics_and_the_report_do(capsys):
    """status showed the unit's NRestarts alone; metrics and report counted torchrun's restarts
    too. One definition now: payload/metrics.py restarts() = NRestarts + torchrun's attempt."""
    from torchrig import tables
    from torchrig.metrics import defs
    from torchrig.session import Result
    cap = json.loads((FIXTURES / "probe_02_status_reply_testbed_running_job.json").read_text())
    raw = cap["reply"]
    raw["run"]["unit"]["out"] = raw["run"]["unit"]["out"].replace("NRestarts=0", "NRestarts=1")
    dirs = raw["tree"]["logs"]["dirs"]
    dirs.append([dirs[0][0].replace("attempt_0", "attempt_2"), dirs[0][1] + 1])
    d = job_state.state(cap["unit"], raw, 1800)
    assert d["attempt"] == 2 and d["restarts"] == defs.restarts(1, 2) == 3
    tables.status_table("j", [Result("gpu1", True, {**d, "low_util": None})])
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "gpu1" in ln)
    assert [c.strip() for c in row.split("│")][3:5] == ["3", "2"]  # restarts, attempt


# ---------------------------------------------------------------- caps on what comes back

def test_a_commands_output_is_cut_per_line_and_in_total_and_says_so():
    long_line = "import sys; sys.stdout.write('a' * 5_000_000 + '\\nshort\\n')"
    many = "import sys\nfor i in range(100000): print('line %06d' % i)"
    got = run_probe({"run": {"long": {"argv": ["python3", "-c", long_line], "max_line": 1000},
                             "many": {"argv": ["python3", "-c", many], "max_bytes": 10000},
                             "small": ["echo", "hi"]}})["run"]
    assert got["long"]["out"] == "a" * 1000 + "\nshort\n" and got["long"]["rc"] == 0
    assert got["long"]["cut"]["lines"] == 1 and got["long"]["cut"]["max_line"] == 1000
    assert got["many"]["rc"] == 0 and got["many"]["out"].startswith("line 000000\n")
    assert len(got["many"]["out"]) <= 10000 and got["many"]["out"].endswith("\n")
    assert got["many"]["cut"]["dropped_bytes"] == 100000 * 12 - len(got["many"]["out"])
    assert got["small"] == {"rc": 0, "out": "hi\n", "err": ""}  # nothing cut: no "cut"
    assert probe.cut_note(got["long"]["cut"], "the journal") == (
        "the journal was cut on the node: 1 line(s) longer than 1000 bytes cut")
    assert "bytes past the first 10000 left out" in probe.cut_note(got["many"]["cut"], "x")
    assert probe.cut_note(None, "x") is None


def test_the_probe_stays_small_while_a_command_prints_hundreds_of_megabytes():
    """300 lines of 1 MB each: the probe holds the first 64 KiB of each, not 300 MB (its peak
    resident size, measured by a parent that runs nothing else)."""
    big = "import sys\nline = b'a' * 1000000 + b'\\n'\nfor _ in range(300): sys.stdout.buffer.write(line)"
    req = {"run": {"big": {"argv": ["python3", "-c", big], "timeout": 120}}}
    parent = ("import resource, subprocess, sys\n"
              "r = subprocess.run([sys.executable, '-I', '-'], input=sys.stdin.read(), text=True,"
              " capture_output=True)\n"
              "sys.stdout.write(r.stdout[-300:])\n"
              "print('\\nmaxrss_kb=%d' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    r = subprocess.run([sys.executable, "-c", parent], input=probe.stdin(req), capture_output=True,
                       text=True, timeout=300)
    rss = int(r.stdout.rsplit("maxrss_kb=", 1)[1])
    assert '"lines": 300' in r.stdout, r.stdout
    assert rss < 150_000, rss  # kB; capture_output held all 300 MB (well above)


def test_journal_lines_are_cut_and_a_later_round_reads_after_its_cursor(tmp_path):
    """status --watch: the first read gives a cursor, the next asks for the lines after it
    (journalctl --after-cursor; a stand-in on PATH serves both) and the operator keeps both
    rounds' lines as one read would; a line longer than max_line is cut, and said so."""
    from torchrig.logs import diagnose
    stand_in = ("case \" $* \" in\n"
                "*\" -k \"*) ;;\n"
                "*\" --after-cursor c1 \"*) printf 'agent: round two\\n[default0]:r2\\n-- cursor: c2\\n';;\n"
                "*\" --after-cursor gone \"*) echo 'Failed to seek to cursor' >&2; exit 1;;\n"
                "*\" --show-cursor \"*) printf 'Started torchrig-j.service\\nagent: round one\\n';"
                " head -c 5000 /dev/zero | tr '\\0' x; printf '\\n-- cursor: c1\\n';;\n"
                "esac\n")

    def read(after=None):
        return journal_probe(tmp_path, {**diagnose.journal_request(
            "torchrig-j.service", keep=0, lines=100, after={"cursor": after}), "max_line": 100}, stand_in)
    one = read()
    assert one["cursor"] == "c1" and one["read"] == 3
    assert one["journal"].splitlines() == ["Started torchrig-j.service", "agent: round one", "x" * 100]
    assert one["cut"] == {"lines": 1, "max_line": 100}
    two = read("c1")
    assert two["cursor"] == "c2" and two["read"] == 2 and "cut" not in two
    merged = diagnose.merge_journal(one, two, keep=0)
    assert merged["journal"].splitlines() == ["Started torchrig-j.service", "agent: round one",
                                              "x" * 100, "agent: round two"]  # rank lines: keep=0
    assert merged["cursor"] == "c2"
    again = read("gone")  # rotated away: a fresh read, which replaces what was kept
    assert again["reset"] and again["cursor"] == "c1"
    assert diagnose.merge_journal(merged, again, keep=0)["journal"] == one["journal"]


def test_a_tree_reads_at_most_its_files(tmp_path):
    attempt = tmp_path / "logs/j_1/attempt_0"
    for r in range(5):
        (attempt / str(r)).mkdir(parents=True)
        (attempt / str(r) / "stdout.log").write_text(f"rank {r}\n")
    got = run_probe({"tree": {"t": {"root": str(tmp_path / "logs"), "walk": [r"j_\d+", r"attempt_\d+"],
                                    "then": [r"\d+"], "read": {"name": "stdout.log"},
                                    "most": 3}}})["tree"]["t"]
    assert sorted(got["files"]) == [f"j_1/attempt_0/{r}/stdout.log" for r in range(3)]
    assert got["cut"] == {"files_left_out": 2, "most": 3}


def test_a_journal_read_keeps_a_bounded_number_of_ranks_and_bytes(monkeypatch):
    """A worker writes `[defaultN]:` lines with a new N each: every one was kept (a deque per
    rank), 500,000 lines of 64 KiB in the root probe. Ranks past MAX_RANKS and bytes past
    MAX_KEPT (the oldest lines) are left out now, and said so."""
    from torchrig.facts import probe_host
    monkeypatch.setattr(probe_host, "MAX_KEPT", 10_000)
    flood = [(i, f"[default{i}]:" + "x" * 100) for i in range(1000)]
    cut = {}
    kept = probe_host.keep_lines(iter([(0, "Started torchrig-j.service")] + flood), keep=20, cut=cut)
    assert {ln.split("]:")[0] for _, ln in kept if ln.startswith("[default")} <= {
        f"[default{i}" for i in range(probe_host.MAX_RANKS)}
    assert cut["ranks_left_out"] == 1000 - probe_host.MAX_RANKS
    assert sum(len(ln) + 1 for _, ln in kept) <= 10_000 and kept[-1] == flood[probe_host.MAX_RANKS - 1]
    assert cut["oldest_dropped"] == probe_host.MAX_RANKS + 1 - len(kept)
    note = probe.cut_note(cut, "the journal")
    assert f"{1000 - probe_host.MAX_RANKS} line(s) of ranks past the first 256 left out" in note
    assert "line(s) left out (at most 10000 bytes kept)" in note


def test_probe_merge_joins_requests_and_refuses_a_name_asked_two_ways():
    """One round trip for several callers' facts (launch: health, versions, jobs, release)."""
    import pytest
    from torchrig.facts import probe
    got = probe.merge({"run": {"a": ["x"]}, "exists": ["/p"], "host": True},
                      {"run": {"a": ["x"], "b": ["y"]}, "exists": ["/p", "/q"], "read": {"r": {"path": "/r"}}})
    assert got == {"run": {"a": ["x"], "b": ["y"]}, "exists": ["/p", "/q"], "host": True,
                   "read": {"r": {"path": "/r"}}}
    with pytest.raises(ValueError, match="run: \\['a'\\] asked for twice"):
        probe.merge({"run": {"a": ["x"]}}, {"run": {"a": ["z"]}})
    with pytest.raises(ValueError, match="connect: asked for twice"):
        probe.merge({"connect": {"port": 1}}, {"connect": {"port": 2}})


def test_a_run_with_keep_ships_only_matching_lines_the_newest_under_its_cap():
    """A long log filtered on the node: only the lines with the text, the newest when they
    exceed the cap (the old capped() kept a log's first bytes: its newest lines were lost),
    and how many lines the command printed, so that 'nothing matched' is not 'nothing read'."""
    log = ("import sys\nfor i in range(50000):\n"
           "    print('line %06d Xid %d' % (i, i) if i % 1000 == 0 else 'line %06d noise' % i)")
    got = run_probe({"run": {
        "all": {"argv": ["python3", "-c", log], "keep": "Xid"},
        "newest": {"argv": ["python3", "-c", log], "keep": "Xid", "max_bytes": 100},
        "none": {"argv": ["python3", "-c", log], "keep": "no such text"}}})["run"]
    assert got["all"]["lines"] == 50000 and "cut" not in got["all"]
    assert got["all"]["out"].splitlines() == ["line %06d Xid %d" % (i, i) for i in range(0, 50000, 1000)]
    newest = got["newest"]["out"].splitlines()
    assert newest[-1] == "line 049000 Xid 49000" and len(got["newest"]["out"]) <= 100
    assert newest == ["line %06d Xid %d" % (i, i) for i in range(50000 - 1000 * len(newest), 50000, 1000)]
    assert got["newest"]["cut"]["dropped_bytes"] == len(got["all"]["out"]) - len(got["newest"]["out"])
    assert got["none"] == {"rc": 0, "out": "", "err": "", "lines": 50000}
