"""One settings model: its vars table (docs/inventory.md), its defaults shared with the
testbed, torchrun's command line built once, and the product's independence from the testbed."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from torchrig import settings, torchrun
from torchrig.inventory import Host
from torchrig.launch import plan
from torchrig.settings import DEFAULTS, Settings
from torchrig.verify.evaluate import HostVerdict
from torchrig.verify.run import HostOpts, cross_node_cmd

REPO = Path(__file__).resolve().parents[2]


def test_the_vars_table_is_generated_from_the_model():
    doc = (REPO / settings.TABLE_FILE).read_text()
    assert settings.doc_with_table(doc) == doc, (
        f"{settings.TABLE_FILE}'s vars table differs from torchrig/settings.py: "
        "run `python -m torchrig.settings --write`")
    for name in Settings.model_fields:  # every var is in it, once
        assert doc.count(f"| `{name}` |") == 1, name


def test_running_the_module_writes_only_when_asked(tmp_path):
    """`python -m torchrig.settings` rewrote README.md in the current folder unasked: it
    prints the table; only --write [FILE] changes a file (by default the inventory reference,
    relative to the current folder)."""
    stale = (REPO / settings.TABLE_FILE).read_text().replace("| `accelerator` |", "| `old` |", 1)
    target = tmp_path / settings.TABLE_FILE
    target.parent.mkdir()
    target.write_text(stale)
    run = [sys.executable, "-m", "torchrig.settings"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this tree's module, from another folder
    r = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == settings.vars_table(), r.stderr
    assert target.read_text() == stale
    r = subprocess.run([*run, "--write"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout == f"{settings.TABLE_FILE}: vars table written\n", r.stderr
    assert target.read_text() == settings.doc_with_table(stale) != stale


def test_the_table_follows_a_changed_default(monkeypatch):
    table = settings.vars_table()
    assert "| `rdzv_port` | `29400` |" in table and "| `nccl_tests` | true |" in table
    monkeypatch.setattr(Settings.model_fields["rdzv_port"], "default", 29500)
    assert "| `rdzv_port` | `29500` |" in settings.vars_table()


def test_defaults_and_derived_paths():
    s = Settings.model_validate({"log_dir": "/logs", "accelerator": "cpu"})
    assert s.given() == {"log_dir": "/logs", "accelerator": "cpu"}
    assert (s.rdzv_port, s.venv, s.job_log_dir("exp1")) == (29400, "/opt/torchrig/venv", "/logs/exp1")
    assert s.util_file("exp1") == "/logs/exp1/gpu_util.csv"
    assert settings.procs_per_node("cpu", 8) == settings.CPU_PROCS == 2
    assert settings.procs_per_node("cuda", 8) == 8
    assert Settings.model_validate({"env": {"N": 4, "B": True}}).job_env == {"N": "4", "B": "True"}


def _host(name: str, address: str) -> Host:
    return Host(name=name, connection="ssh", address=address, port=None, user=None,
                identity_file=None, jump=None, gpus=2, groups=())


def test_launch_and_verify_build_c10d_args_with_one_builder(monkeypatch):
    """Both command lines come from torchrun.rendezvous/command: a change there reaches both."""
    calls = []

    def fake(*a, **kw):
        calls.append(a)
        return ["--RDZV-MARK"]
    monkeypatch.setattr(torchrun, "rendezvous", fake)
    nodes = [plan.Node(f"gpu{i}", f"10.0.0.{i}", i, "/v", "u", "/l", "/c", "/d", 2, None)
             for i in (1, 2)]
    job = plan.Job("exp1", "train.py", [], 0, 29412, nodes, "/r", rdzv_timeout=77)
    unit_argv = plan.torchrun_argv(job, nodes[1])
    hosts = [_host("gpu1", "10.0.0.1"), _host("gpu2", "10.0.0.2")]
    o = HostOpts("/v", "/p", "cuda", 29400, {}, "10.0.0.2")
    bench = cross_node_cmd(hosts[1], hosts, o, HostVerdict("gpu2", gpus=[{}, {}]), "10.0.0.1:29400", "r1")
    assert "--RDZV-MARK" in unit_argv and "--RDZV-MARK" in bench
    assert calls == [(2, "10.0.0.1:29412", False, "10.0.0.2"),
                     (2, "10.0.0.1:29400", False, "10.0.0.2")]
    assert "PET_RDZV_ID=r1" in bench  # the run id in torchrun's environment
    assert unit_argv[:3] == ["/v/bin/python", "-m", "torchrig_torchrun"]  # exit barrier bounded
    assert "/v/bin/python -m torch.distributed.run --RDZV-MARK --nproc-per-node 2" in bench


def test_rendezvous_args():
    assert torchrun.rendezvous(1, "h:1", True, "a") == ["--standalone"]
    args = torchrun.rendezvous(3, "10.0.0.1:29400", False, "10.0.0.3", join_timeout=60)
    # no --rdzv-id: the run id reaches torchrun in its environment (torchrun.RUN_ID_ENV)
    assert args == ["--nnodes", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400",
                    "--rdzv-conf", "is_host=false,join_timeout=60", "--local-addr", "10.0.0.3"]
    assert "is_host=true" in torchrun.rendezvous(2, "e:1", True, "a")


def test_testbed_takes_its_versions_from_the_products_defaults():
    """Change the product's defaults: the stand-in repo and wheel index follow (run apart, so
    the changed defaults are in place when the testbed's modules are first imported)."""
    code = """
import json, torchrig.settings as s
s.DEFAULTS = s.Settings(driver_version="580.1.2", cuda_version="13.0",
                        cuda_package_version="13.0.48-1", nccl_version="2.28.3-1+cuda13.0",
                        torch_version="2.99.0")
from torchrig.testbed import aptrepo, pyindex
print(json.dumps({"debs": sorted({d.name + "=" + d.version for d in aptrepo.packages(b"")}),
                  "wheels": pyindex.REQUIREMENTS}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for want in ("nvidia-open=580.1.2-1", "cuda-drivers=580.1.2-1",
                 "nvidia-fabricmanager-580=580.1.2-1", "cuda-toolkit-13-0=13.0.48-1",
                 "libnccl2=2.28.3-1+cuda13.0", "libnccl-dev=2.28.3-1+cuda13.0"):
        assert want in out["debs"], (want, out["debs"])
    assert "torch==2.99.0" in out["wheels"]


def test_testbed_serves_what_a_default_provision_installs():
    from torchrig.provision.desired import DRIVER_PACKAGE
    from torchrig.testbed import aptrepo, pyindex
    debs = {(d.name, d.version) for d in aptrepo.packages(b"")}
    s = DEFAULTS
    assert {(DRIVER_PACKAGE["open"], s.driver_deb), (s.fabricmanager_pkg, s.driver_deb),
            (s.cuda_pkg, s.cuda_package_version), ("libnccl2", s.nccl_version)} <= debs
    assert f"torch=={s.torch_version}" in pyindex.REQUIREMENTS


def _product_modules() -> list[Path]:
    pkg = REPO / "torchrig"
    return sorted(p for p in pkg.rglob("*.py") if "testbed" not in p.relative_to(pkg).parts)


def _imports(path: Path, top_level_only: bool = False) -> list[str]:
    """Every module an import statement in `path` names, relative ones resolved."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(REPO).with_suffix("").parts
    package = rel[:-1] if rel[-1] != "__init__" else rel[:-1]
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def test_the_product_never_imports_the_testbed():
    """Layering: torchrig's modules (all but torchrig/testbed/) import nothing of it; the task
    collection's testbed module (torchrig/cli/testbed.py) only inside its testbed tasks, never
    at the top."""
    assert len(_product_modules()) > 20
    cli = REPO / "torchrig/cli/testbed.py"
    bad = [(str(p.relative_to(REPO)), m) for p in _product_modules() for m in
           _imports(p, top_level_only=p == cli)
           if m == "torchrig.testbed" or m.startswith("torchrig.testbed.")]
    assert not bad, bad


def test_the_layering_check_sees_relative_imports():
    assert "torchrig.settings.DEFAULTS" in _imports(REPO / "torchrig/testbed/aptrepo.py")
    assert "torchrig.testbed.lab" in _imports(REPO / "torchrig/cli/testbed.py")  # inside the testbed tasks
    src = REPO / "torchrig/launch/run.py"
    assert "torchrig.quoting.sh" in _imports(src) and "torchrig.launch.plan" in _imports(src)


def test_torchrig_runs_without_the_testbed(tmp_path):
    """Every product module imports, and the CLI loads an inventory and lists its hosts, with
    torchrig.testbed made unimportable (as where it is not shipped)."""
    inv = tmp_path / "hosts.yml"
    inv.write_text("hosts:\n  - {name: gpu1, address: 10.0.0.1, gpus: 8}\n")
    mods = [".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            for p in _product_modules()]
    code = f"""
import importlib, sys
sys.modules["torchrig.testbed"] = None  # any import of it fails
for m in {mods!r}:
    if not m.startswith("torchrig.onhost."):  # scripts run on hosts, not modules
        importlib.import_module(m)
from invoke import Program, Collection
from torchrig.cli import tasks
Program(namespace=tasks.ns, name="invoke").run(["invoke", "hosts", "-i", {str(inv)!r}, "--json"])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)[0]["settings"]["rdzv_port"] == 29400
