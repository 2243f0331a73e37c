"""Golden plans and generated scripts: what provision and launch would send to a host, for
fixed inputs, compared whole against files under tests/golden/ (not only the human summary),
and every generated script passes `bash -n`.

A deliberate change to a generator changes its golden file: regenerate them all, then read the
diff before committing it:

    TORCHRIG_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/unit/test_golden.py   (or: make golden)
"""

import difflib
import json
import os
import subprocess
from pathlib import Path

import pytest

from test_provision_plan import CAPTURED, H100, UBUNTU, ctx, drifted, fresh
from torchrig.launch import plan as lplan
from torchrig.launch import run
from torchrig import onhost
from torchrig.provision.apply import plan_report, step_script
from torchrig.provision.engine import build_plan
from torchrig.provision.apply import preamble

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = os.environ.get("TORCHRIG_UPDATE_GOLDEN") == "1"


def check_golden(name: str, text: str):
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no golden file {path}: regenerate (see this module's docstring)"
    want = path.read_text()
    if text != want:
        diff = "".join(list(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                                 f"golden/{name}", "generated"))[:60])
        raise AssertionError(f"{name} differs from its golden file; if the change is meant, "
                             f"regenerate (see this module's docstring) and review the diff:\n{diff}")


def bash_n(script: str, what: str):
    r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"{what}: bash -n: {r.stderr}"


def section(title: str, body: str) -> str:
    return f"===== {title}\n{body}{'' if body.endswith(chr(10)) else chr(10)}"


# ---- provision: the plan and each step's root script, for fixed fact tables -----------------

FACT_TABLES = {
    "fresh-debian12-v100": lambda: (fresh(), {}),
    "fresh-ubuntu24-h100-nvswitch": lambda: (fresh(os_release=UBUNTU, lspci=H100), {"nccl_tests": True}),
    "drifted-debian12-v100": lambda: (drifted(), {**CAPTURED["vars"], "address": CAPTURED["address"]}),
}


def provision_scripts(name):
    """(golden text, [(what, full root script)]) for one fact table."""
    facts, vars_ = FACT_TABLES[name]()
    c = ctx(facts, **vars_)
    plan = build_plan(c)  # the one walk provision's plan and apply use
    out = [section("plan", json.dumps(plan_report(plan).as_dict(), indent=1, sort_keys=True) + "\n")]
    scripts = []
    pre = preamble(c.s.apt_lock_timeout)
    for sp in plan.steps:
        step, changes = sp.step, sp.changes
        if sp.status != "planned" or not changes:
            continue
        script = step_script(step, changes, c.s)
        assert script.startswith(pre)  # the preamble has a golden file of its own
        out.append(section(f"step {step.name} (after the preamble)", script[len(pre):]))
        scripts.append((f"{name}: step {step.name}", script))
    return "".join(out), scripts


@pytest.mark.parametrize("name", sorted(FACT_TABLES))
def test_provision_plan_and_step_scripts_golden(name):
    text, scripts = provision_scripts(name)
    check_golden(f"provision/{name}.txt", text)
    assert scripts  # each table has work to do


def test_provision_preamble_golden():
    check_golden("provision/preamble.sh", preamble(ctx(fresh()).s.apt_lock_timeout))


# ---- launch: torchrun argv, env file, units, and the root scripts, for a fixed job ----------

def _job():
    nodes = [lplan.Node(f"gpu{i + 1}", f"10.0.0.{i + 1}", i, "/opt/torchrig/venv", "torchrig",
                        "/var/log/torchrig", "/srv/torchrig/checkpoints", "/srv/torchrig/data", 2,
                        "eth0", env={"NCCL_DEBUG": "WARN"}, home="/opt/torchrig/home")
             for i in range(2)]
    return lplan.Job(name="exp1", script="train.py", args=["--max-steps", "100", "it's \"quoted\""],
                     max_restarts=3, rdzv_port=29412, nodes=nodes,
                     release="/opt/torchrig/payload/releases/0123456789abcdef",
                     env={"HF_TOKEN": "t0k-secret", "WEIRD": "a b $(id) 'c'"},
                     secret_keys={"HF_TOKEN"}, launch_id="feedc0ffee123456",
                     run_id="0123456789abcdef0123456789abcdef")


def launch_scripts():
    j = _job()
    out, scripts = [], []
    base, h, src = "/opt/torchrig/payload", "0123456789abcdef", "fedcba9876543210"
    switch = onhost.script("push/switch.sh", base=base, h=h)  # what launch sends: in install
    for n in j.nodes:
        out.append(section(f"{n.host} torchrun argv", json.dumps(lplan.torchrun_argv(j, n), indent=1) + "\n"))
        out.append(section(f"{n.host} {lplan.env_path(j.name)}", lplan.render_env(j, n)))
        out.append(section(f"{n.host} {lplan.env_path(j.name)} as shown", lplan.render_env(j, n, redact=True)))
        out.append(section(f"{n.host} {lplan.unit_path(j.name)}", lplan.render_unit(j, n)))
        for path, text in lplan.render_gpumon(j, n, run.GPU_SAMPLE_S).items():
            out.append(section(f"{n.host} {path}", text))
        scripts.append((f"{n.host} install", run.install_script(j, n, switch)))
    scripts += [("start (GPU node)", run.start_script(j, True)),
                ("start (CPU node)", run.start_script(j, False)),
                ("undo (keep files)", run.undo_script(j, False)),
                ("undo (remove files)", run.undo_script(j, True)),
                ("stop", run.stop_script(j.name))]
    scripts += [("push probe", onhost.script("push/probe.sh", base=base, h=h)),
                ("push install", onhost.script("push/install.sh", base=base, h=h, src=src)),
                ("push switch", onhost.script("push/switch.sh", base=base, h=h))]
    out += [section(what, text) for what, text in scripts]
    return "".join(out), scripts


def test_launch_files_and_scripts_golden():
    text, _ = launch_scripts()
    check_golden("launch/exp1-2nodes.txt", text)


# ---- every generated script is valid bash --------------------------------------------------

def test_every_generated_script_passes_bash_n():
    scripts = list(launch_scripts()[1])
    for name in FACT_TABLES:
        scripts += provision_scripts(name)[1]
    scripts.append(("provision preamble", preamble(ctx(fresh()).s.apt_lock_timeout)))
    assert len(scripts) > 15
    for what, script in scripts:
        bash_n(script, what)


def test_bash_n_catches_a_broken_script():
    """The check above can fail: an unclosed quote in a script is caught."""
    with pytest.raises(AssertionError, match="bash -n"):
        bash_n(run.start_script(_job(), True) + "echo 'unclosed\n", "broken")
