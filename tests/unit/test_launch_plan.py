"""launch's pure parts: names, quoting for unit and env files, rendered units, idle flag."""

import re

import pytest

from torchrig.errors import TorchrigError
from torchrig import job as job_mod
from torchrig.launch import plan
from torchrig.launch.status import low_utilisation
from torchrig.render import env_quote, render, systemd_quote


def job(nodes=2, **kw):
    ns = [plan.Node(f"gpu{i + 1}", f"10.0.0.{i + 1}", i, "/opt/torchrig/venv", "torchrig",
                    "/var/log/torchrig", "/srv/ck", "/srv/data", 2, "eth0") for i in range(nodes)]
    base = dict(name="exp1", script="train.py", args=["--lr", "3e-4"], max_restarts=3,
                rdzv_port=29412, nodes=ns, release="/opt/torchrig/payload/releases/abc")
    base.update(kw)
    return plan.Job(**base)


@pytest.mark.parametrize("name", ["exp1", "a", "gpt2-run_7"])
def test_good_job_names(name):
    assert job_mod.check_job_name(name) == name


@pytest.mark.parametrize("name", ["", "Exp", "a b", "x;rm", "../x", "-x", "a" * 49, "name.service"])
def test_bad_job_names(name):
    with pytest.raises(TorchrigError, match="--job"):
        job_mod.check_job_name(name)


def test_single_node_is_standalone_multi_node_is_c10d():
    one = plan.torchrun_argv(job(1), job(1).nodes[0])
    assert "--standalone" in one and "--rdzv-backend" not in one
    j = job(2)
    first, second = (plan.torchrun_argv(j, n) for n in j.nodes)
    assert first[first.index("--rdzv-endpoint") + 1] == "10.0.0.1:29412"
    assert "is_host=true,join_timeout=300" in first and "is_host=false,join_timeout=300" in second
    assert second[second.index("--local-addr") + 1] == "10.0.0.2"
    assert first[first.index("--log-dir") + 1] == "/var/log/torchrig/exp1"
    assert first[-3:] == ["train.py", "--lr", "3e-4"]


def test_run_id_is_random_per_launch_and_only_in_a_root_file():
    """The rendezvous run id: 128 random bits per launch (never the job name), in a 0600
    root file systemd reads into torchrun's environment; no command line or unit shows it."""
    a, b = job(2), job(2)
    assert a.run_id != b.run_id and len(a.run_id) == 32 and "exp1" not in a.run_id
    files = dict(plan.job_changes(a, a.nodes[0], 10))
    run_file = files["/etc/torchrig/jobs/exp1.run"]
    assert run_file.mode == 0o600 and run_file.owner == "root" and run_file.secret
    assert f"\nPET_RDZV_ID={a.run_id}\n" in run_file.content
    for n in a.nodes:
        unit = plan.render_unit(a, n)
        assert "EnvironmentFile=/etc/torchrig/jobs/exp1.run" in unit
        assert a.run_id not in unit and "--rdzv-id" not in plan.torchrun_argv(a, n)
        assert a.run_id not in plan.render_env(a, n)
    assert "/etc/torchrig/jobs/exp1.run" in plan.job_paths("exp1")  # removed with the job


def test_a_job_never_starts_without_the_firewall_table_where_it_is_on():
    """A table that failed to load at boot (the unit's dependency fails: the job does not
    start), or that the operator's `nft flush ruleset` removed (launch loads it again, or
    refuses): the job's ports were open to anyone while the job trained."""
    import dataclasses
    from torchrig.launch import run
    j = job(2)
    on = dataclasses.replace(j.nodes[0], firewall=True)
    unit = plan.render_unit(j, on)
    assert "Requires=torchrig.firewall.service" in unit and "After=torchrig.firewall.service" in unit
    assert "torchrig.firewall" not in plan.render_unit(j, j.nodes[0])  # firewall: false
    script = run.start_script(j, exclusive=False, firewall=True)
    assert "if [ 1 = 1 ] && ! nft list table inet torchrig" in script
    assert "systemctl restart torchrig.firewall.service" in script
    assert "if [ 0 = 1 ]" in run.start_script(j, exclusive=False)


def test_unit_has_the_settings_that_matter():
    j = job(2)
    unit = plan.render_unit(j, j.nodes[1])
    for needle in ("KillMode=mixed", "TimeoutStopSec=120", "LimitMEMLOCK=infinity",
                   "LimitNOFILE=1048576", "Restart=on-abnormal", "User=torchrig",
                   "EnvironmentFile=/etc/torchrig/jobs/exp1.env",
                   "WorkingDirectory=/opt/torchrig/payload/releases/abc"):
        assert needle in unit
    assert job_mod.TORCHRUN_GRACE < 120  # the stop timeout outlasts torchrun's own grace


def test_env_file_redacts_secrets_only_when_shown():
    j = job(1, env={"HF_TOKEN": "t0k", "MY_VAR": "x"}, secret_keys={"MY_VAR"})
    shown = plan.render_env(j, j.nodes[0], redact=True)
    real = plan.render_env(j, j.nodes[0])
    assert "HF_TOKEN='***'" in shown and "MY_VAR='***'" in shown and "t0k" not in shown
    assert "HF_TOKEN='t0k'" in real and "GLOO_SOCKET_IFNAME='eth0'" in real


@pytest.mark.parametrize("arg", ["plain", "a b", 'say "hi"', "it's", "$HOME", "100%", "back\\slash", ""])
def test_systemd_quote(arg):
    q = systemd_quote(arg)
    assert q.startswith('"') and q.endswith('"')
    # undo systemd's unquoting rules: \\ -> \, \" -> ", $$ -> $, %% -> %
    inner = q[1:-1]
    out, i = "", 0
    while i < len(inner):
        two = inner[i:i + 2]
        if two in ("\\\\", '\\"', "$$", "%%"):
            out += two[1]
            i += 2
        else:
            assert inner[i] not in '"$%' and inner[i] != "\\", q
            out += inner[i]
            i += 1
    assert out == arg


def test_newlines_refused_in_units_and_env():
    with pytest.raises(TorchrigError):
        systemd_quote("a\nb")
    with pytest.raises(TorchrigError):
        env_quote("a\nb")


def test_env_and_args_parsing():
    assert plan.parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(TorchrigError, match="KEY=VALUE"):
        plan.parse_env(["1A=2"])
    assert plan.split_args("--a 'b c' \"d\"") == ["--a", "b c", "d"]
    with pytest.raises(TorchrigError, match="--args"):
        plan.split_args("--a 'unclosed")
    # URL credentials would be in torchrun's argv on the node and in the 0644 unit file
    for args in ("--data https://user:s3cr3t@host/d", "--data=https://ghp_T0KENxx@host/d"):
        with pytest.raises(TorchrigError, match="credentials") as e:
            plan.split_args(args)
        assert "s3cr3t" not in str(e.value) and "T0KEN" not in str(e.value)
    assert plan.split_args("--data https://host/d") == ["--data", "https://host/d"]


def test_job_ports_differ_per_job():
    assert job_mod.job_port("a", 29400) != job_mod.job_port("b", 29400)
    assert 29400 <= job_mod.job_port("a", 29400) < 29900


def test_missing_template_value_names_the_template():
    with pytest.raises(TorchrigError, match=r"templates/etc/systemd/system/torchrig-JOB.service.j2:\d+"):
        render("etc/systemd/system/torchrig-JOB.service.j2", job="x")


def test_low_utilisation_flag():
    window = 600
    idle = [(age, [3.0, 5.0]) for age in range(0, 601, 60)]
    assert "below 20%" in low_utilisation(idle, window, 20)
    busy = idle[:-1] + [(30, [95.0, 3.0])]
    assert low_utilisation(busy, window, 20) is None
    assert low_utilisation(idle[:3], window, 20) is None  # 2 minutes of history: no verdict


# --- issue 9: names that cannot collide, full matches, escaping for each directive ---

@pytest.mark.parametrize("name", ["exp1\n", "exp1\n\n", "\nexp1"])
def test_job_name_with_newline_refused(name):
    with pytest.raises(TorchrigError, match="--job"):
        job_mod.check_job_name(name)


@pytest.mark.parametrize("item", ["FOO\n=bar", "FOO\n\n=bar", "A B=1", "=x"])
def test_env_key_with_newline_refused(item):
    with pytest.raises(TorchrigError, match="--env"):
        plan.parse_env([item])


def test_inventory_env_keys_checked_when_rendered():
    j = job(1)
    j.nodes[0].env = {"GOOD": "1", "BAD\nLD_PRELOAD": "/x.so"}
    with pytest.raises(TorchrigError, match=r"gpu1: env: 'BAD\\nLD_PRELOAD'"):
        plan.render_env(j, j.nodes[0])


def _unit_files(name, interval=30):
    j = job(1, name=name)
    files = {plan.unit_path(name): "main", plan.env_path(name): "env"}
    files.update({p: "gpumon" for p in plan.render_gpumon(j, j.nodes[0], interval)})
    return files


@pytest.mark.parametrize("a,b", [("x", "x-gpumon"), ("x-gpumon", "x"), ("a", "a-b"), ("exp1", "exp1_gpumon")])
def test_no_two_jobs_share_a_unit_file(a, b):
    assert not set(_unit_files(a)) & set(_unit_files(b))


def test_samplers_are_not_jobs():
    from torchrig.launch.run import busy_jobs
    listed = ("torchrig-exp1.service loaded active running torchrig job exp1\n"
              "torchrig-gpumon@exp1.service loaded activating start torchrig job exp1: sample\n"
              "torchrig-old.service loaded deactivating stop-sigterm torchrig job old\n")
    assert busy_jobs(listed) == ["exp1", "old"]
    assert job_mod.job_of_unit(job_mod.gpumon_name("x")) is None
    assert job_mod.job_of_unit(job_mod.unit_name("x-gpumon")) == "x-gpumon"


def test_busy_check_counts_stopping_jobs():
    from torchrig.launch.run import BUSY_UNITS
    assert "deactivating" in BUSY_UNITS and "activating" in BUSY_UNITS


def test_launch_probe_asks_health_versions_jobs_and_release_in_one_round_trip(tmp_path):
    """launch's first probe (run.probe_nodes, the real probe on this machine): GPU health, the
    version gate, the node's running jobs and the release in one round trip per node, as
    root; the release found there only once pushed (push.found); the busy refusal is
    decided here from the raw list."""
    import os
    from types import SimpleNamespace
    from torchrig import inventory, resources
    from torchrig.errors import TorchrigError
    from torchrig.launch import run, stage
    from torchrig.launch.push import push
    from torchrig.launch.run import _refuse_busy
    from torchrig.launch.tree import payload_tree
    from torchrig.connections import LocalConnection
    from torchrig.session import Fleet
    p = tmp_path / "inv.yml"
    p.write_text(f"vars: {{prefix: {tmp_path / 'prefix'}}}\nhosts:\n  - {{name: head, connection: local}}\n")
    inv = inventory.load(p)
    src = stage.Source(payload_tree(resources.PAYLOAD), stage.PAYLOAD_BASE, "")
    with Fleet(inv) as fleet:
        ran = []
        real = fleet.run
        fleet.run = lambda h, cmd, **kw: ran.append((cmd, kw.get("root"))) or real(h, cmd, **kw)
        got = run.probe_nodes(fleet, inv.hosts, src)
        assert ran == [("python3 -I -", True)] and not got.versions.unreachable
        assert got.found == {"head": run.push.Found(False)}
        raw = got.versions.also["head"]
        assert raw["run"]["busy"]["rc"] in (0, 1) and "health_xml" in raw["run"]
        assert [v.host for v in got.health.hosts] == ["head"]
        if os.geteuid() == 0:  # the push scripts chown to root
            (tmp_path / "prefix").mkdir(mode=0o755)
            push(LocalConnection(), src.tree, stage.push_base(src, str(tmp_path / "prefix")))
            assert run.probe_nodes(fleet, inv.hosts, src).found == {"head": run.push.Found(True)}
            (tmp_path / "new").mkdir()  # another tree: the delta's base is the current release
            (tmp_path / "new" / "train.py").write_text("print('new')\n")
            new = stage.Source(payload_tree(tmp_path / "new"), stage.PAYLOAD_BASE, "")
            f = run.probe_nodes(fleet, inv.hosts, new).found["head"]
            assert (f.have, f.src, f.remote) == (False, src.tree.hash, src.tree.manifest())
            rel, sent = push(LocalConnection(), new.tree, stage.push_base(new, str(tmp_path / "prefix")), f)
            assert sent == 1 and sorted(os.listdir(rel)) == [".complete", ".manifest.json", "train.py"]
    gpu = SimpleNamespace(name="n1", settings=SimpleNamespace(accelerator="cuda"))
    cpu = SimpleNamespace(name="n1", settings=SimpleNamespace(accelerator="cpu"))
    other = {"rc": 0, "out": "torchrig-old.service loaded active running x\n", "err": ""}
    _refuse_busy(gpu, "new", {"rc": 0, "out": "", "err": ""})
    _refuse_busy(cpu, "new", other)  # CPU nodes may run two jobs
    with pytest.raises(TorchrigError, match="n1 already runs job\\(s\\) old on its GPUs"):
        _refuse_busy(gpu, "new", other)
    with pytest.raises(TorchrigError, match="job 'old' is already running on n1"):
        _refuse_busy(cpu, "old", other)
    with pytest.raises(TorchrigError, match="n1: systemctl list-units failed: boom"):
        _refuse_busy(cpu, "new", {"rc": 1, "out": "", "err": "boom\n"})


def _systemd_unquote(q):
    assert q.startswith('"') and q.endswith('"'), q
    out, i, inner = "", 0, q[1:-1]
    while i < len(inner):
        two = inner[i:i + 2]
        if two in ("\\\\", '\\"', "$$", "%%"):
            out, i = out + two[1], i + 2
        else:
            assert inner[i] not in '"$%\\', q
            out, i = out + inner[i], i + 1
    return out


def test_sampler_exec_start_quoted_and_runs_as_service_user():
    j = job(1)
    j.nodes[0].log_dir = '/var/log/a "b" 100%h $X'
    unit = plan.render_gpumon(j, j.nodes[0], 30)[plan.gpumon_paths("exp1")[0]]
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    rest = line[len("ExecStart="):]
    args = re.findall(r'"(?:[^"\\]|\\.)*"', rest)
    assert " ".join(args) == rest
    assert [_systemd_unquote(a) for a in args] == plan.sampler_argv(j, j.nodes[0])
    argv = plan.sampler_argv(j, j.nodes[0])
    assert argv[:3] == ["/usr/bin/python3", "-I", j.release + "/gpumon.py"]
    assert argv[argv.index("--util-file") + 1] == j.nodes[0].log_dir + "/exp1/gpu_util.csv"
    assert argv[argv.index("--mem-file") + 1] == j.nodes[0].log_dir + "/exp1/gpu_mem.csv"
    assert "\nUser=torchrig\n" in unit and "\nGroup=torchrig\n" in unit


def test_working_directory_escaped_for_its_directive():
    unit = plan.render_unit(job(1, release="/opt/a%b/payload/releases/abc"), job(1).nodes[0])
    assert "\nWorkingDirectory=/opt/a%%b/payload/releases/abc\n" in unit
    for bad in ("/opt/x\nExecStartPre=/bin/evil", "/opt/x\\", "relative/x", " /opt/x", "/opt/\tx"):
        with pytest.raises(TorchrigError, match="unit file"):
            plan.render_unit(job(1, release=bad), job(1).nodes[0])


def test_every_rendered_line_is_one_directive():
    """Whatever odd characters reach them, the rendered files keep one line per directive."""
    odd = '/srv/o d%d "q" \'s\' $V `c` ;x'
    j = job(2, release=odd + "/rel", env={"K": odd})
    for n in j.nodes:
        n.log_dir, n.checkpoint_dir, n.data_dir = odd + "/log", odd + "/ck", odd + "/data"
        texts = [plan.render_unit(j, n), plan.render_env(j, n),
                 *plan.render_gpumon(j, n, 30).values()]
        for text in texts:
            for ln in text.splitlines():
                assert not ln or ln.startswith(("#", "[")) or re.match(r"[A-Za-z_][A-Za-z0-9_]*=", ln), ln


def test_each_launch_marks_the_unit_it_wrote():
    a, b = job(1), job(1)
    assert a.launch_id != b.launch_id
    unit = plan.render_unit(a, a.nodes[0])
    assert plan.launch_marker(a) in unit.splitlines()
    assert plan.launch_marker(b) not in unit.splitlines()


@pytest.mark.parametrize("field,value,expected", [
    ("script", "../tasks.py", "--script '../tasks.py': a path inside payload/"),
    ("script", "nosuch.py", "--script 'nosuch.py': no such file"),
    ("nproc", "abc", "--nproc-per-node 'abc': a positive number or 'gpu'"),
    ("nproc", "0", "--nproc-per-node '0'"),
    ("args", "--url https://u:pw@h/x", "--args .*credentials"),
])
def test_bad_flags_are_refused_before_any_host_is_touched(tmp_path, field, value, expected):
    """Checked after the version gate and the payload push before: a typo cost a round of SSH
    and left a pushed release behind. The host here cannot be reached: the flag's error must
    come first."""
    from torchrig import inventory
    from torchrig.launch.run import LaunchOptions, launch
    from torchrig.session import Fleet
    inv_path = tmp_path / "inv.yml"
    inv_path.write_text("hosts:\n  - {name: h1, address: 127.0.0.1, port: 1}\n")
    inv = inventory.load(inv_path)
    o = LaunchOptions(job="j1", **{field: value})
    with pytest.raises(TorchrigError, match=expected):
        launch(Fleet(inv), inv.hosts, o)


def test_agent_logs_at_info_and_its_exit_barrier_is_the_operators():
    """status/logs --failures read the agent's INFO lines (rendezvous results, restarts,
    waits); torchrun's 300 s exit barrier has no flag: the unit runs it through the payload's
    torchrig_torchrun with the operator's bound."""
    j = job()
    j.exit_barrier_timeout = 45
    n = j.nodes[1]
    env = plan.node_env(j, n)
    assert env["LOGLEVEL"] == "INFO" and env["TORCHRIG_EXIT_BARRIER_TIMEOUT"] == "45"
    argv = plan.torchrun_argv(j, n)
    assert argv[1:3] == ["-m", "torchrig_torchrun"]
    assert f"is_host=false,join_timeout={j.rdzv_timeout}" in argv



def _facts_of(changes):
    """What a node reports for files it holds exactly as written (launch_request's shape)."""
    import hashlib
    from torchrig.changes import managed
    from torchrig.changes.factview import Facts
    req = managed.launch_request("exp1")
    files = {p: {"sha256": hashlib.sha256(ch.content.encode()).hexdigest(), "mode": ch.mode,
                 "owner": "root", "group": "root", "content": ch.content}
             for p, ch in changes}
    return Facts({"files": files}, req)


def test_job_files_go_through_the_change_engine():
    j = job(1, env={"HF_TOKEN": "t0k"})
    written = plan.job_changes(j, j.nodes[0], 30)
    assert [(p, oct(ch.mode), ch.secret) for p, ch in written] == [
        ("/etc/torchrig/jobs/exp1.env", "0o600", True),
        ("/etc/torchrig/jobs/exp1.run", "0o600", True),
        ("/etc/systemd/system/torchrig-exp1.service", "0o644", False),
        ("/etc/systemd/system/torchrig-gpumon@exp1.service", "0o644", False),
        ("/etc/systemd/system/torchrig-gpumon@exp1.timer", "0o644", False),
        ("/etc/systemd/system/torchrig-ended@exp1.service", "0o644", False),
        ("/etc/systemd/system/torchrig-health@exp1.service", "0o644", False),
        ("/etc/systemd/system/torchrig-health@exp1.timer", "0o644", False)]
    env = written[0][1]
    assert "HF_TOKEN='t0k'" in env.content
    assert "t0k" not in env.diff() and "+HF_TOKEN='***'" in env.diff()  # dry run: masked
    assert "t0k" not in env.script  # base64 in a printf (a builtin): never in any argv
    # the same job again (a new launch): only the unit's launch line, the run id and the
    # health watcher's launch (its start state is the new launch's) differ
    j2 = job(1, env={"HF_TOKEN": "t0k"})
    diffed = plan.job_changes(j2, j2.nodes[0], 30, _facts_of(written))
    assert [p for p, ch in diffed if ch] == ["/etc/torchrig/jobs/exp1.run",
                                             "/etc/systemd/system/torchrig-exp1.service",
                                             "/etc/systemd/system/torchrig-health@exp1.service"]
    d = diffed[2][1].diff()
    assert [ln[:19] for ln in d.splitlines() if ln[:1] in "+-" and ln[:3] not in ("---", "+++")] \
        == ["-# torchrig launch ", "+# torchrig launch "]


def test_install_reloads_systemd_only_for_the_units_it_already_holds():
    """install.sh asks systemd which of the job's units written it holds (list-units: none
    loaded for that) and, for those, whether the loaded copy is stale (an earlier run of the
    job's name); a full daemon-reload only then."""
    from torchrig.launch.run import install_script
    j = job(1)
    units = plan.job_units("exp1")
    assert units == [p.rsplit("/", 1)[1] for p, _ in plan.job_changes(j, j.nodes[0], 30)
                     if p.startswith("/etc/systemd/system/")]
    text = install_script(j, j.nodes[0])
    held = f"held=$(systemctl list-units --all --plain --no-legend {' '.join(units)} | "
    check = ('if [ -n "$held" ] && systemctl show -p NeedDaemonReload --value $held | '
             "grep -qx yes; then")
    assert held in text and check in text and text.index(held) < text.index(check)
    assert text.count("systemctl daemon-reload") == 1
    assert text.index(check) > text.index("mv -f \"$tmp\" /etc/systemd/system/torchrig-health@exp1.timer")


def test_a_launch_file_not_in_the_request_is_an_error():
    from torchrig.changes import managed
    from torchrig.changes.factview import Facts, FactNotRequested
    j = job(1)
    with pytest.raises(FactNotRequested):
        plan.job_changes(j, j.nodes[0], 30, Facts({"files": {}}, managed.launch_request("other")))


def test_a_project_job_runs_its_module_with_its_environment_and_support_files():
    """A user's project (launch --workdir --module): torchrun from the job environment's
    python, `-m pkg.train`, the release then its support folder on PYTHONPATH, the sampler
    from the support folder; a payload job has none of these."""
    j = job(module=True, script="pkg.train", support=".torchrig",
            python="/opt/torchrig/envs/0123456789abcdef/bin/python")
    n = j.nodes[1]
    argv = plan.torchrun_argv(j, n)
    assert argv[0] == "/opt/torchrig/envs/0123456789abcdef/bin/python"
    assert argv[argv.index("--tee") + 2:] == ["-m", "pkg.train", *j.args]
    assert plan.script_and_args(argv) == ("-m pkg.train", j.args)
    env = plan.node_env(j, n)
    assert env["PYTHONPATH"] == f"{j.release}:{j.release}/.torchrig"
    src = job(module=True, script="pkg.train", support=".torchrig", paths=("src", "lib/py"))
    assert plan.node_env(src, src.nodes[0])["PYTHONPATH"] == \
        f"{src.release}:{src.release}/src:{src.release}/lib/py:{src.release}/.torchrig"
    assert plan.sampler_argv(j, n)[2] == f"{j.release}/.torchrig/gpumon.py"
    p = job()
    assert "PYTHONPATH" not in plan.node_env(p, p.nodes[0])
    assert plan.sampler_argv(p, p.nodes[0])[2] == f"{p.release}/gpumon.py"
    assert plan.torchrun_argv(p, p.nodes[0])[0] == f"{p.nodes[0].venv}/bin/python"


def test_the_job_gets_a_home_it_can_write_and_inductor_caches_there_not_in_the_shared_tmp():
    """HOME is the service user's home under the prefix (made by launch's jobdirs.py), whatever
    an older node's passwd says; Inductor's cache is there, not /tmp/torchinductor_<user>,
    which another local user could make first; the inventory's env still has the last word."""
    from torchrig.inventory import Host
    from torchrig.launch.run import _node
    from torchrig.settings import Settings

    def node(**vars):
        h = Host(name="gpu1", connection="ssh", address="10.0.0.1", port=None, user=None,
                 identity_file=None, jump=None, gpus=2, groups=(),
                 settings=Settings.model_validate({"prefix": "/srv/tr", **vars}))
        return _node(None, h, 0, "gpu", "eth0")
    def one(n):
        return plan.Job("exp1", "train.py", [], 0, 29412, [n], "/r")
    n = node()
    assert n.home == "/srv/tr/home" == Settings.model_validate({"prefix": "/srv/tr"}).service_home
    env = plan.node_env(one(n), n)
    assert env["HOME"] == "/srv/tr/home"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/srv/tr/home/.cache/torchinductor"
    mine = node(env={"HOME": "/data/me"})
    assert plan.node_env(one(mine), mine)["HOME"] == "/data/me"
    assert "\nPrivateTmp=yes\n" in plan.render_unit(one(n), n)
