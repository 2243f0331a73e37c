"""provision's planners against fact tables: which changes each step yields (pure, no SSH)."""

import copy
import hashlib
import json

import pytest

from torchrig.provision import steps
from torchrig.provision.apply import make_plan
from torchrig.changes.model import FileChange
from torchrig.settings import DEFAULTS, settings_for
from torchrig.errors import TorchrigError

DEBIAN = open("tests/fixtures/osrelease_03_debian_12.txt").read()
UBUNTU = open("tests/fixtures/osrelease_02_ubuntu_24.04.4.txt").read()
V100 = "3b:00.0 3D controller [0302]: NVIDIA Corporation GV100GL [Tesla V100S PCIe 32GB] [10de:1df6] (rev a1)\n"
H100 = ("18:00.0 3D controller [0302]: NVIDIA Corporation GH100 [H100 SXM5 80GB] [10de:2330] (rev a1)\n"
        "80:00.0 Bridge [0680]: NVIDIA Corporation GH100 [H100 NVSwitch] [10de:22a3] (rev a1)\n")


def fresh(**over):
    f = {"os_release": DEBIAN, "arch": "x86_64", "euid": 0, "disk_free_gb": 100.0, "lspci": V100,
         "secure_boot": False, "packages": {}, "held": [], "available": {}, "dpkg_audit": "",
         "dpkg_updates_pending": False, "files": {}, "dirs": {}, "paths": {}, "users": {},
         "units": {}, "nvidia_smi": {"rc": 127, "output": "nvidia-smi: command not found"},
         "venv": {"python": None, "dists": {}}, "boot_id": "b1",
         "firewall": {"loaded": False, "ephemeral": "32768\t60999\n"}}
    f.update(over)
    return f


def ctx(facts, address="", fleet=("10.0.0.1", "10.0.0.2"), login="admin", **vars_):
    return steps.Ctx(facts, settings_for("h", vars_, "inv.yml"), "h", [], address, fleet=fleet,
                     login=login)


def sha(text):
    return hashlib.sha256(text.encode()).hexdigest()


# What a converged host reports: gather_facts.py's output captured on a testbed host right
# after provision converged it, with the inventory vars it was provisioned with. Not built
# from the planners' own output, so a file or package the planners want but the fact request
# never reads back shows up here as a change on every run.
NCCL_STEP = next(s for s in steps.STEPS if s.name == "nccl-tests")
CAPTURED = json.load(open("tests/fixtures/provision_facts_converged_testbed.json"))


def tb_ctx(facts, **vars_):
    return ctx(facts, CAPTURED["address"], tuple(CAPTURED["fleet"]), CAPTURED["login"],
               **{**CAPTURED["vars"], **vars_})


def converged(lspci=None) -> dict:
    """The captured converged host; with `lspci` (an NVSwitch H100 box) the open driver and
    the fabric manager installed, held and running instead of the proprietary driver."""
    f = copy.deepcopy(CAPTURED["facts"])
    if lspci and "NVSwitch" in lspci:
        ver = f["packages"].pop("cuda-drivers")
        f["packages"].update({"nvidia-open": ver, "nvidia-fabricmanager-570": ver})
        f["held"] = sorted([p for p in f["held"] if p != "cuda-drivers"]
                           + ["nvidia-open", "nvidia-fabricmanager-570"])
        f["units"]["nvidia-fabricmanager.service"] = {"enabled": "enabled", "active": "active"}
        f["lspci"] = lspci
    return f


def describe(changes):
    return [c.describe() for c in changes]


def test_fresh_host_plans_every_step():
    c = ctx(fresh())
    assert steps.preflight(c) == []
    plan = {s.name: describe(s.plan(c)) for s in steps.STEPS}
    assert plan["apt-recover"] == []
    assert any("cuda-keyring" in d for d in plan["cuda-repo"])
    assert plan["cuda-repo"][-2].startswith("apt-get update")
    assert plan["cuda-repo"][-1].startswith(f"write {PIN} ")  # before any install
    assert "install NVIDIA driver 570.172.08 (cuda-drivers): cuda-drivers=570.172.08-1" in plan["driver"]
    assert "hold cuda-drivers (no upgrade behind provision's back)" in plan["driver"]
    assert not any("fabricmanager" in d for d in plan["driver"])  # no NVSwitch on this box
    assert any("cuda-toolkit-12-8=12.8.93-1" in d for d in plan["cuda-toolkit"])
    assert any("libnccl2=2.26.2-1+cuda12.8" in d for d in plan["nccl"])
    assert plan["python-venv"][0] == "create the venv /opt/torchrig/venv"
    # a bare server's python3 has no pip for its venvs, and no compiler or Python.h
    base = next(s for s in steps.STEPS if s.name == "base-packages").plan(c)
    assert [ch.script for ch in base] == [
        "apt_get install --no-install-recommends python3-venv python3-dev build-essential"]
    assert base[0].specs == ("python3-venv", "python3-dev", "build-essential")  # shared .debs
    order = [s.name for s in steps.STEPS]
    assert order.index("base-packages") < min(order.index("python-venv"), order.index("nccl-tests"))
    assert any(d.startswith("directory /srv/torchrig/checkpoints (0755 root:root") for d in plan["service-user"])


def test_converged_host_plans_nothing():
    for lspci in (V100, H100):
        done = tb_ctx(converged(lspci))
        on = [s for s in steps.STEPS if s.enabled(done) is None]
        assert {s.name: describe(s.plan(done)) for s in on} == {s.name: [] for s in on}
        rep = make_plan(done)
        assert {st.name: st.status for st in rep.steps} == {
            "preflight": "ok", **{s.name: "ok" for s in on}, "nccl-tests": "skipped", "dcgm": "skipped",
            **{n: "skipped" for n in ("slurm-packages", "munge", "slurm-config")}}


def drifted() -> dict:
    """The captured converged host where four things drifted (a hold, a mode, an owner, a
    version); plan it with tb_ctx (the vars it was provisioned with)."""
    f = converged()
    f["held"] = [p for p in f["held"] if p != "libnccl2"]
    f["files"][steps.SOURCES_FILE]["mode"] = 0o666
    f["dirs"]["/srv/torchrig/data"]["owner"] = "root"
    f["packages"]["cuda-toolkit-12-8"] = "12.8.61-1"
    return f


def test_drift_is_detected_per_item():
    d = tb_ctx(drifted())
    assert describe(steps.nccl(d)) == ["hold libnccl2 (no upgrade behind provision's back)"]
    assert describe(steps.cuda_repo(d))[0].startswith("write /etc/apt/sources.list.d/torchrig-cuda.sources")
    assert describe(steps.service_user(d)) == ["directory /srv/torchrig/data (0750 torchrig:torchrig)"]
    assert describe(steps.cuda_toolkit(d))[0] == "install CUDA toolkit 12.8: cuda-toolkit-12-8=12.8.93-1"


def _drifted() -> dict:
    """The converged host after someone edited, removed and added what provision manages."""
    f = converged()
    for path in list(f["files"]):
        if f["files"][path]:
            f["files"][path] = dict(f["files"][path], sha256="0" * 64, content="edited\n")
    f["files"]["/etc/apt/sources.list.d/cuda-debian12-x86_64.list"] = {
        "sha256": "1" * 64, "mode": 0o644, "owner": "root", "group": "root", "content": "deb x\n"}
    f["packages"] = {p: "0.1" for p in f["packages"]}
    f["held"], f["users"] = [], {}
    f["units"] = {u: {"enabled": "disabled", "active": "inactive"} for u in f["units"]}
    f["dirs"] = {p: dict(d, mode=0o777) for p, d in f["dirs"].items()}
    f["venv"] = {"python": "3.11.2", "dists": {"torch": "2.0.0"}}
    return f


@pytest.mark.parametrize("table", ["fresh", "converged", "drifted"])
def test_every_planner_reads_only_requested_facts(table):
    """Every planner over fresh, converged and drifted fact tables, on the testbed's vars and
    on vars that turn every optional part on (mirror credentials, nccl-tests, NVSwitch): each
    fact a planner reads goes through the accessors, which raise for one not requested."""
    facts = {"fresh": fresh(), "converged": converged(), "drifted": _drifted()}[table]
    for vars_, lspci in (({}, None), ({"cuda_repo_url": "https://u:p@mirror.internal/cuda",
                                       "nccl_tests": True, "dcgm": True}, H100)):
        f = dict(copy.deepcopy(facts), **({"lspci": lspci} if lspci else {}))
        c = tb_ctx(f, **vars_)
        plan = {s.name: describe(s.plan(c)) for s in steps.STEPS}
        assert make_plan(c).steps[0].status == "ok"
        if table == "drifted":
            assert plan["cuda-repo"][:2] == [
                "write /etc/apt/sources.list.d/torchrig-cuda.sources (mode 0644, root:root)",
                "remove /etc/apt/sources.list.d/cuda-debian12-x86_64.list"] or vars_
            assert all(plan[n] for n in ("driver", "driver-services", "cuda-toolkit", "nccl",
                                         "python-venv", "service-user")), plan


def test_dcgm_only_when_asked_pinned_held_and_its_host_engine_running():
    dcgm = next(s for s in steps.STEPS if s.name == "dcgm")
    assert dcgm.enabled(ctx(fresh())) == "disabled (var dcgm: false)"
    c = ctx(fresh(), dcgm=True)
    assert dcgm.enabled(c) is None
    assert describe(dcgm.plan(c)) == [
        "install NVIDIA DCGM 1:3.3.9: datacenter-gpu-manager=1:3.3.9",
        "hold datacenter-gpu-manager (no upgrade behind provision's back)",
        "enable and start nvidia-dcgm.service"]
    assert steps._pinned(c)["datacenter-gpu-manager"] == "1:3.3.9"  # cuda-repo checks it is listed
    done = ctx(fresh(packages={"datacenter-gpu-manager": "1:3.3.9"}, held=["datacenter-gpu-manager"],
                     units={"nvidia-dcgm.service": {"enabled": "enabled", "active": "active"}}),
               dcgm=True)
    assert dcgm.plan(done) == []


def test_a_fact_not_requested_is_an_error_not_a_default():
    from torchrig.changes.factview import FactNotRequested
    c = tb_ctx(converged())
    with pytest.raises(FactNotRequested, match=r"files\['/etc/forgotten.conf'\] was read .* not requested"):
        c.facts.file("/etc/forgotten.conf")
    with pytest.raises(FactNotRequested):
        c.facts.pkg("not-asked-for")
    with pytest.raises(FactNotRequested):
        c.facts["no_such_fact"]
    # a planner writing a managed file that the request lacks fails the same way
    from torchrig.changes import managed
    stray = managed.ManagedFile("etc/torchrig/cuda.env.j2".replace("cuda", "stray"))
    with pytest.raises(FactNotRequested):
        stray.change(c.facts, content="x\n")


def test_fact_request_covers_every_managed_file():
    from torchrig.changes import managed
    req = steps.fact_request(tb_ctx(fresh()).s)
    asked = set(req["files"]) | set(req["secret_files"])
    assert {f.path() for f in managed.PROVISION_FILES} | set(managed.PROVISION_ABSENT) == asked
    assert set(req["secret_files"]) == {steps.AUTH_FILE, managed.MUNGE_KEY.path()}


def test_open_modules_for_turing_and_newer_with_fabricmanager_on_nvswitch():
    c = ctx(fresh(lspci=H100))
    assert c.driver_pkg == "nvidia-open" and c.nvswitch
    plan = describe(steps.driver(c))
    assert any("nvidia-open=570.172.08-1, nvidia-fabricmanager-570=570.172.08-1" in d for d in plan)
    assert "enable nvidia-fabricmanager.service" in plan
    assert describe(steps.driver_services(c)) == ["start nvidia-persistenced.service",
                                                  "start nvidia-fabricmanager.service"]
    assert ctx(fresh(lspci=H100), driver_flavor="proprietary").driver_pkg == "cuda-drivers"


@pytest.mark.parametrize("over,needle", [
    ({"os_release": 'ID=centos\nVERSION_ID="7"\nPRETTY_NAME="CentOS Linux 7"\n'}, "unsupported OS 'CentOS Linux 7'"),
    ({"os_release": UBUNTU.replace('VERSION_ID="24.04"', 'VERSION_ID="20.04"')}, "unsupported OS"),
    ({"arch": "ppc64le"}, "unsupported architecture 'ppc64le'"),
    ({"euid": 1000}, "cannot become root"),
    ({"disk_free_gb": 3.2}, "only 3.2 GB free on /"),
    ({"lspci": "00:02.0 VGA compatible controller [0300]: Intel Corporation [8086:3e92]\n"}, "no NVIDIA GPU"),
    ({"lspci": None}, "lspci not found"),
    ({"secure_boot": True}, "Secure Boot is enabled"),
])
def test_preflight_refusals(over, needle):
    problems = steps.preflight(ctx(fresh(**over)))
    assert any(needle in p for p in problems), problems
    rep = make_plan(ctx(fresh(**over)))
    assert not rep.ok and [s.name for s in rep.steps] == ["preflight"]


def test_ubuntu_and_arm_repo_paths():
    c = ctx(fresh(os_release=UBUNTU, arch="aarch64"))
    assert steps.preflight(c) == []
    assert c.repo.url == DEFAULTS.cuda_repo_url + "/ubuntu2404/sbsa/"


def test_interrupted_dpkg_is_recovered_first():
    c = ctx(fresh(dpkg_audit="The following packages are only half configured: libnccl2"))
    assert describe(steps.apt_recover(c)) == ["finish an interrupted dpkg run (dpkg --configure -a)"]


def test_mirror_credentials_never_in_urls_plans_or_diffs():
    c = ctx(fresh(), cuda_repo_url="https://bob:hunter2@mirror.internal/cuda/repos")
    changes = steps.cuda_repo(c)
    text = "\n".join(describe(changes) + [ch.diff() for ch in changes if isinstance(ch, FileChange)])
    assert "hunter2" not in text and "bob:" not in text
    assert c.repo.url == "https://mirror.internal/cuda/repos/debian12/x86_64/"
    auth = [ch for ch in changes if isinstance(ch, FileChange) and ch.path == steps.AUTH_FILE][0]
    assert auth.mode == 0o600 and auth.secret and "password hunter2" in auth.content
    keyring = next(ch for ch in changes if "cuda-keyring" in ch.describe())
    assert "--netrc-file" in keyring.script  # the keyring download authenticates from the file


def test_venv_pins_torch_and_uses_configured_index():
    c = ctx(fresh(venv={"python": "3.11.2", "dists": {"torch": "2.12.0", "numpy": "2.3.0"}}),
            pip_index_url="http://10.0.0.1:8080/simple", pip_trusted_host="10.0.0.1")
    (cmd,) = steps.python_venv(c)
    assert cmd.describe() == "pip install torch==2.13.0 into /opt/torchrig/venv"
    assert "--index-url http://10.0.0.1:8080/simple --trusted-host 10.0.0.1" in cmd.script


def test_tensorboard_only_when_asked_pinned_from_its_own_index():
    have = {"torch": "2.13.0", "numpy": "2.3.0"}
    assert steps.python_venv(ctx(fresh(venv={"python": "3.11.2", "dists": have}))) == []
    c = ctx(fresh(venv={"python": "3.11.2", "dists": have}), tensorboard=True,
            tensorboard_index_url="https://tb:t0ken@mirror.internal/simple")
    (cmd,) = steps.python_venv(c)
    assert cmd.describe() == "pip install tensorboard==2.21.0 into /opt/torchrig/venv"
    assert "--index-url https://mirror.internal/simple" in cmd.script and "t0ken" not in cmd.describe()
    # no index of its own: the node's pip configuration, not the torch index
    (cmd,) = steps.python_venv(ctx(fresh(venv={"python": "3.11.2", "dists": have}),
                                   tensorboard=True, pip_index_url="http://10.0.0.1/simple"))
    assert "--index-url" not in cmd.script
    done = {**have, "tensorboard": "2.21.0"}
    assert steps.python_venv(ctx(fresh(venv={"python": "3.11.2", "dists": done}),
                                 tensorboard=True)) == []


def test_driver_needs_reboot_states():
    assert steps.driver_state({"nvidia_smi": {"rc": 0, "output": "0, x, 570"}})[0] == "ok"
    kind, advice = steps.driver_state({"nvidia_smi": {"rc": 18, "output":
        "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 570.172"}})
    assert kind == "driver-library-mismatch" and "reboot" in advice.lower()
    rep = make_plan(ctx(fresh(lspci=H100)))
    ds = [s for s in rep.steps if s.name == "driver-services"][0]
    assert ds.status == "planned" and "needs the driver loaded" in ds.error


def test_bad_var_is_a_clear_error():
    with pytest.raises(TorchrigError, match=r"inv.yml: host 'h': var 'driver_flavor'"):
        settings_for("h", {"driver_flavor": "nouveau"}, "inv.yml")


def test_file_change_script_is_atomic_and_quoted(tmp_path):
    import subprocess
    target = tmp_path / "we ird; $(touch pwned)" / "f.conf"
    ch = FileChange(str(target), "a 'b' $c\n", mode=0o640, owner="root", group="root")
    subprocess.run(["bash", "-ec", ch.script], check=True, cwd=tmp_path)
    assert target.read_text() == "a 'b' $c\n" and oct(target.stat().st_mode & 0o777) == "0o640"
    assert not (tmp_path / "pwned").exists()
    assert list(target.parent.iterdir()) == [target]  # no temp file left beside it


def test_file_change_makes_missing_folders_0755_under_a_strict_umask(tmp_path):
    import subprocess
    target = tmp_path / "usr" / "lib" / "gpu-sample"
    ch = FileChange(str(target), "#!/bin/sh\n", mode=0o755)
    subprocess.run(["bash", "-ec", "umask 077\n" + ch.script], check=True)
    assert [oct(p.stat().st_mode & 0o777) for p in (tmp_path / "usr", target.parent, target)] == \
        ["0o755"] * 3


# --- credentials and temp files: the step scripts run for real with stand-in pip/git/make ---

STANDIN = """#!/usr/bin/env python3
import json, os, subprocess, sys
rec = {"argv": sys.argv, "env_keys": sorted(os.environ)}
if os.path.basename(sys.argv[0]) == "pip" and os.environ.get("NETRC"):
    import netrc, stat
    p = os.environ["NETRC"]
    rec["netrc"] = netrc.netrc(p).authenticators("idx.internal")
    rec["netrc_mode"] = oct(stat.S_IMODE(os.stat(p).st_mode))
    rec["netrc_dir"] = os.path.dirname(p)
    rec["netrc_dir_mode"] = oct(stat.S_IMODE(os.stat(os.path.dirname(p)).st_mode))
if "-r" in sys.argv:
    rec["requirements"] = open(sys.argv[sys.argv.index("-r") + 1]).read()
if os.path.basename(sys.argv[0]) == "git":
    helpers = [a.split("=", 1)[1] for a in sys.argv if a.startswith("credential.helper=")]
    if helpers and helpers[-1]:
        h = helpers[-1][1:]  # as git runs a '!' helper: through the shell, with 'get'
        out = subprocess.run(["sh", "-c", h + ' "$@"', h, "get"], capture_output=True, text=True,
                             input="protocol=https\\nhost=h\\n").stdout
        rec["credential"] = dict(l.split("=", 1) for l in out.splitlines() if "=" in l)
    url, dest = sys.argv[-2], sys.argv[-1]
    os.makedirs(dest + "/.git")
    open(dest + "/.git/config", "w").write(f'[remote "origin"]\\n\\turl = {url}\\n')
with open(os.environ["STANDIN_LOG"], "a") as f:
    f.write(json.dumps(rec) + "\\n")
"""


def run_steps(tmp_path, changes):
    """Run changes' scripts under the real preamble, with pip/git/make stand-ins that record
    their argv; return the records."""
    import json
    import os
    import subprocess
    from torchrig.provision.apply import preamble
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for name in ("git", "make", "pip"):
        (bin_ / name).write_text(STANDIN)
        (bin_ / name).chmod(0o755)
    log = tmp_path / "standin.log"
    script = preamble(5) + "\n".join(ch.script for ch in changes) + "\n"
    r = subprocess.run(["bash", "-s"], input=script, capture_output=True, text=True,
                       env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}",
                            "STANDIN_LOG": str(log), "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp.")]  # temp folder removed
    return [json.loads(ln) for ln in log.read_text().splitlines()]


def test_pip_index_credentials_in_a_private_netrc_never_in_argv(tmp_path):
    prefix = tmp_path / "opt"
    (prefix / "venv/bin").mkdir(parents=True)
    (prefix / "venv/bin/pip").symlink_to(tmp_path / "bin/pip")
    c = ctx(fresh(venv={"python": "3.11.2", "dists": {}}), prefix=str(prefix),
            pip_index_url="https://ci:p%40ss%3Aw0rd@idx.internal:8443/simple")
    (cmd,) = steps.python_venv(c)
    assert "w0rd" not in cmd.describe()
    (rec,) = [r for r in run_steps(tmp_path, [cmd]) if r["argv"][0].endswith("pip")]
    argv = " ".join(rec["argv"])
    assert "--index-url https://idx.internal:8443/simple" in argv
    assert "w0rd" not in argv and "ci:" not in argv
    assert rec["netrc"] == ["ci", "", "p@ss:w0rd"]  # percent-decoded for pip
    assert rec["netrc_mode"] == "0o600" and rec["netrc_dir_mode"] == "0o700"
    assert rec["netrc_dir"].startswith(str(tmp_path) + "/tmp.")  # mktemp -d, not a fixed path


def test_a_requirement_url_with_credentials_never_in_argv(tmp_path):
    """extra_pip_packages may hold a URL with a token (`pkg @ https://user:token@host/...`):
    the requirements reach pip in a file in the script's private folder, not in its argv."""
    prefix = tmp_path / "opt"
    (prefix / "venv/bin").mkdir(parents=True)
    (prefix / "venv/bin/pip").symlink_to(tmp_path / "bin/pip")
    req = "priv @ https://ci:s3cr3t-t0k@idx.internal/priv-1.0-py3-none-any.whl"
    c = ctx(fresh(venv={"python": "3.11.2", "dists": {}}), prefix=str(prefix),
            extra_pip_packages=[req])
    (cmd,) = steps.python_venv(c)
    (rec,) = [r for r in run_steps(tmp_path, [cmd]) if r["argv"][0].endswith("pip")]
    assert not [a for a in rec["argv"] if "s3cr3t" in a]
    assert rec["requirements"].splitlines()[-1] == req
    assert "torch==" in rec["requirements"]
    with pytest.raises(TorchrigError, match="line break"):
        steps.python_venv(ctx(fresh(venv={"python": "3.11.2", "dists": {}}),
                              extra_pip_packages=["ok\n--index-url=http://evil/"]))
    # pip runs `git clone URL` for a git+ requirement: a token there would be in git's argv
    for bad in ["git+https://ci:tok@git.internal/priv.git", "priv @ git+https://tok@git.internal/p"]:
        with pytest.raises(TorchrigError, match="git\\+ URL with credentials"):
            steps.python_venv(ctx(fresh(venv={"python": "3.11.2", "dists": {}}),
                                  extra_pip_packages=[bad]))
    assert steps.python_venv(ctx(fresh(venv={"python": "3.11.2", "dists": {}}),
                                 extra_pip_packages=["git+https://git.internal/pub.git"]))


@pytest.mark.parametrize("url,user,password", [
    ("https://oauth2:glpat%2Ftok@git.internal/nccl-tests.git", "oauth2", "glpat/tok"),
    ("https://ghp_T0KEN@github.com/NVIDIA/nccl-tests", "ghp_T0KEN", ""),
    ("https://:only-t0ken@git.internal/r.git", "", "only-t0ken"),
])
def test_git_token_from_a_helper_never_in_argv_plan_or_clone_config(tmp_path, url, user, password):
    prefix = tmp_path / "opt"
    prefix.mkdir()
    c = ctx(fresh(), prefix=str(prefix), nccl_tests_source=url)
    (cmd,) = steps.nccl_tests(c)
    secret = password or user
    rep = make_plan(c)
    assert secret not in repr(rep) and secret not in cmd.describe()
    recs = run_steps(tmp_path, [cmd])
    git = next(r for r in recs if r["argv"][0].endswith("git"))
    assert not any(secret in a for r in recs for a in r["argv"])
    assert git["credential"] == {"username": user, "password": password}
    assert secret not in (prefix / "nccl-tests/.git/config").read_text()


def test_no_step_uses_a_fixed_tmp_path():
    c = ctx(fresh(), nccl_tests_source="/home/op/nccl-tests.tgz",
            cuda_repo_url="https://u:p@mirror/cuda/repos")
    scripts = [ch.script for st in steps.STEPS for ch in st.plan(c)]
    assert any("cuda-keyring" in s for s in scripts) and any("tar -xzf" in s for s in scripts)
    assert not [s for s in scripts if "/tmp" in s]


def test_repo_url_keeps_ipv6_brackets_and_decodes_credentials():
    c = ctx(fresh(), cuda_repo_url="http://mirror%40corp:p%40ss%3Aw@[fd00::5]:8080/cuda/repos")
    assert c.repo.url == "http://[fd00::5]:8080/cuda/repos/debian12/x86_64/"
    auth = [ch for ch in steps.cuda_repo(c) if isinstance(ch, FileChange) and ch.path == steps.AUTH_FILE][0]
    assert auth.content == "machine fd00::5\nlogin mirror@corp\npassword p@ss:w\n"


def test_operator_tarball_travels_in_the_script_into_a_private_folder(tmp_path):
    """nccl-tests from the operator's tarball: no upload to a fixed /tmp path; the script
    carries it, extracts it under the prefix and leaves no temp file behind."""
    import os
    import subprocess
    import tarfile
    from torchrig.provision.apply import step_script
    src = tmp_path / "src" / "nccl-tests-2.16.4"
    src.mkdir(parents=True)
    (src / "Makefile").write_text("all:\n")
    tgz = tmp_path / "nccl-tests.tgz"
    with tarfile.open(tgz, "w:gz") as t:
        t.add(src, arcname=src.name)
    prefix = tmp_path / "opt"
    c = ctx(fresh(), prefix=str(prefix), nccl_tests_source=str(tgz))
    script = step_script(NCCL_STEP, steps.nccl_tests(c), c.s)
    assert "/tmp/torchrig" not in script and "$TORCHRIG_TMP" in script
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "make").write_text("#!/bin/sh\nexit 0\n")
    (bin_ / "make").chmod(0o755)
    tmp = tmp_path / "t"
    tmp.mkdir()
    subprocess.run(["bash", "-s"], input=script, text=True, check=True,
                   env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "TMPDIR": str(tmp)})
    assert (prefix / "nccl-tests/Makefile").read_text() == "all:\n"
    assert list(tmp.iterdir()) == []
    with pytest.raises(TorchrigError, match="var nccl_tests_source: cannot read /nope.tgz"):
        step_script(NCCL_STEP, [], ctx(fresh(), nccl_tests_source="/nope.tgz").s)


def test_netrc_entries_for_a_bare_token_and_refused_whitespace():
    from torchrig.provision.desired import split_credentials
    assert steps.netrc(split_credentials("https://:t0k@idx.internal/s"), "pip_index_url") == \
        "machine idx.internal\npassword t0k\n"
    with pytest.raises(TorchrigError, match="var 'pip_index_url': credentials with whitespace"):
        steps.netrc(split_credentials("https://u:a%20b@idx.internal/s"), "pip_index_url")


@pytest.mark.parametrize("var,value", [("checkpoint_dir", "/srv/data/ckpt"), ("log_dir", "/srv/data"),
                                       ("prefix", "/srv/data/../data/opt")])
def test_root_folders_never_inside_the_service_users_data_dir(var, value):
    """data_dir belongs to the service user: a job can plant a symlink anywhere in it, which
    root's `install -d` (provision) and mkdir (push) would follow (e.g. chmod 0755 /root)."""
    with pytest.raises(TorchrigError, match=rf"^inv.yml: host 'h': {var} '.*' lies in data_dir '/srv/data'"):
        settings_for("h", {"data_dir": "/srv/data", var: value}, "inv.yml")
    assert settings_for("h", {"data_dir": "/srv/data", var: "/srv/database"}, "inv.yml")


def test_fingerprint_ignores_free_space_and_names_what_changed():
    from torchrig.changes.factview import fingerprint, what_changed
    a = converged()
    b = copy.deepcopy(a)
    b["disk_free_gb"] += 3.5
    assert fingerprint(a) == fingerprint(b)
    b["files"][steps.SOURCES_FILE]["content"] += "# edited\n"
    b["packages"]["libnccl2"] = "2.0-1"
    assert fingerprint(a) != fingerprint(b)
    assert what_changed(a, b) == ["files[/etc/apt/sources.list.d/torchrig-cuda.sources]",
                                  "packages[libnccl2]"]


def test_plan_walk_runs_each_planner_once_and_carries_its_fingerprint(monkeypatch):
    from torchrig.provision import engine
    from torchrig.changes.factview import fingerprint
    calls = []
    wrapped = [steps.Step(s.name, (lambda p: lambda c: calls.append(1) or p(c))(s.plan),
                          s.needs_driver, s.reprobes_driver, s.upload, s.enabled)
               for s in steps.STEPS]
    monkeypatch.setattr(engine, "STEPS", wrapped)
    facts = fresh()
    plan = engine.build_plan(ctx(facts))
    assert plan.fingerprint == fingerprint(facts) and plan.changes_anything
    # nccl-tests is on by default: every planner once, but the Slurm ones (no slurm: section)
    # and DCGM's (off by default)
    assert len(calls) == len([s for s in steps.STEPS
                              if not s.name.startswith(("slurm", "munge", "dcgm"))])
    reasons = {sp.step.name: sp.reason for sp in plan.steps}
    assert reasons["nccl-tests"] == "needs the driver loaded (now: not-installed); a reboot may be needed"
    assert [s.name for s in steps.STEPS if s.upload(ctx(fresh(), nccl_tests_source="/x.tgz").s)] \
        == ["nccl-tests"]


PIN = "/etc/apt/preferences.d/torchrig-nvidia-driver.pref"


def test_driver_is_pinned_at_its_exact_build_before_it_is_installed():
    """NVIDIA's metapackages depend on the driver's library and kernel-module packages with
    `>=`: a hold on the metapackage leaves those free to move under the loaded module. One
    apt preferences pin on the exact build, written with the repository (cuda-repo: before
    any install, and before aptshare's download for the fleet resolves the same packages),
    makes apt install and keep exactly that build of every driver package."""
    ch = steps.cuda_repo(ctx(fresh()))
    pin = next(i for i, c in enumerate(ch) if isinstance(c, FileChange) and c.path == PIN)
    names = [s.name for s in steps.STEPS]
    assert names.index("cuda-repo") < names.index("driver")
    assert not any(PIN in d for d in describe(steps.driver(ctx(fresh()))))
    lines = [ln for ln in ch[pin].content.splitlines() if not ln.startswith("#")]
    assert lines == ["Package: *nvidia* cuda-drivers* libcuda* libnvcuvid* libnvoptix* libxnvctrl*",
                     f"Pin: version {DEFAULTS.driver_version}-*", "Pin-Priority: 1001"]
    # any packaging revision of that version: NVIDIA's Ubuntu packages of the driver are
    # 570.172.08-0ubuntu1 beside the metapackage's -1; an exact "-1" pin matched none of them
    assert DEFAULTS.driver_deb.startswith(f"{DEFAULTS.driver_version}-")
    # a pin another version of the driver asks for replaces it
    again = fresh(files={PIN: {"content": ch[pin].content, "mode": 0o644, "owner": "root",
                               "group": "root", "is_dir": False, "sha256": sha(ch[pin].content)}})
    assert PIN not in " ".join(describe(steps.cuda_repo(ctx(again))))
    assert PIN in " ".join(describe(steps.cuda_repo(ctx(again, driver_version="570.133.20"))))


def test_every_installed_package_of_the_toolkit_and_nccl_is_held():
    """`apt-mark hold cuda-toolkit-12-8` holds the metapackage only: its components (each
    with its own version) and NCCL's packages are held too, as installed."""
    f = converged()
    f["packages"].update({"cuda-cudart-12-8": "12.8.90-1", "libcublas-12-8": "12.8.4.1-1",
                          "libnccl-tests-extra": "1"})
    assert describe(steps.cuda_toolkit(tb_ctx(f))) == [
        "hold cuda-cudart-12-8, libcublas-12-8 (no upgrade behind provision's back)"]
    assert describe(steps.nccl(tb_ctx(f))) == [
        "hold libnccl-tests-extra (no upgrade behind provision's back)"]
    f["held"] += ["cuda-cudart-12-8", "libcublas-12-8", "libnccl-tests-extra"]
    assert steps.cuda_toolkit(tb_ctx(f)) == [] and steps.nccl(tb_ctx(f)) == []


def test_an_install_releases_the_held_components_then_holds_what_it_installed():
    """apt never moves a held package to satisfy another: a new toolkit build first releases
    the held components, and the hold after it covers what the install brought in (known
    only on the host, so the globs resolve there)."""
    f = converged()
    f["packages"].update({"cuda-toolkit-12-8": "12.8.61-1", "cuda-nvcc-12-8": "12.8.61-1"})
    f["held"] += ["cuda-nvcc-12-8"]
    install, hold = steps.cuda_toolkit(tb_ctx(f))[:2]
    assert install.script.startswith("apt-mark unhold cuda-nvcc-12-8 cuda-toolkit-12-8 >/dev/null\n")
    assert hold.script.startswith("apt-mark hold cuda-toolkit-12-8 $(dpkg-query -W ")
    assert "'*-12-8' 'cuda-toolkit-*config-common'" in hold.script


def test_facts_of_a_glob_nobody_asked_for_are_refused():
    from torchrig.changes.factview import FactNotRequested
    c = ctx(fresh(packages={"libnccl2": "1", "libfoo": "2"}))
    assert c.facts.installed(("libnccl*",)) == {"libnccl2": "1"}
    with pytest.raises(FactNotRequested):
        c.facts.installed(("libfoo*",))


def test_base_packages_installs_only_what_is_missing():
    some = ctx(fresh(packages={"python3-venv": "3.11.2-1+b1", "build-essential": "12.9"}))
    step = next(s for s in steps.STEPS if s.name == "base-packages")
    assert [ch.specs for ch in step.plan(some)] == [("python3-dev",)]
    done = ctx(fresh(packages=dict.fromkeys(steps.BASE_PACKAGES, "1")))
    assert step.plan(done) == []
