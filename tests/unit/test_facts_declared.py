"""provision's facts are declared once (facts/provision_facts.FACTS: request part + pure
parser), the planners name what they read (steps.Step.reads), and the probe request, the
facts dict, the planners' view and the fingerprint all derive from the two."""

import json

import pytest

from torchrig.changes.factview import FactNotRequested, Facts, fingerprint
from torchrig.facts import provision_facts as pf
from torchrig.provision import steps
from torchrig.settings import DEFAULTS

from _fixtures import FIXTURES


def contains(req: dict, part: dict) -> bool:
    """Every entry of a fact's request part is in the built request."""
    for key, v in part.items():
        if isinstance(v, dict):
            if any(req[key].get(k) != x for k, x in v.items()):
                return False
        elif isinstance(v, list):
            if not set(map(json.dumps, v)) <= set(map(json.dumps, req[key])):
                return False
        elif req[key] != v:
            return False
    return True


def test_every_declared_fact_is_gathered_by_the_built_request():
    want = steps.fact_request(DEFAULTS)
    req = pf.probe_request(want)
    for f in pf.FACTS:
        part = f.gather(want)
        assert part, f"fact {f.name}: the planners' reads ask nothing of it"
        assert contains(req, part), f"fact {f.name}: its request part is not in the probe request"
    # nothing in the request that no declared fact asked for
    for key in ("run", "read", "glob", "stat", "exists", "users"):
        assert set(req[key]) == {k for f in pf.FACTS for k in f.gather(want).get(key, ())}, key


def test_every_fact_a_planner_names_is_declared_and_every_declared_one_is_read():
    named, keys = set(), set()
    for who, r in steps.readers(DEFAULTS):
        named |= set(r.get("facts", ()))
        keys |= set(r) - {"facts"}
    assert named <= pf.plain() and keys <= set(pf.want_keys())
    # kernel only describes the host in the fingerprint (a new kernel re-plans); every other
    # declared fact is read by some planner
    assert pf.plain() - named == {"kernel"}
    assert set(pf.want_keys()) == keys


def test_a_planner_naming_an_undeclared_fact_is_an_error_naming_both(monkeypatch):
    bad = steps.Step("gpu-clocks", lambda c: [], reads=lambda s: steps.reads("gpu_clocks"))
    monkeypatch.setattr(steps, "STEPS", [*steps.STEPS, bad])
    with pytest.raises(steps.UndeclaredFact, match=r"step gpu-clocks reads fact\(s\) 'gpu_clocks', "
                                                   r"which facts/provision_facts.FACTS does not declare"):
        steps.fact_request(DEFAULTS)
    bad = steps.Step("gpu-clocks", lambda c: [], reads=lambda s: {"clocks": ["sm"]})
    monkeypatch.setattr(steps, "STEPS", [*steps.STEPS[:-1], bad])
    with pytest.raises(steps.UndeclaredFact, match=r"step gpu-clocks reads 'clocks', which no fact"):
        steps.fact_request(DEFAULTS)


def test_a_plain_fact_no_planner_names_is_refused():
    c = steps.Ctx(json.loads((FIXTURES / "provision_facts_converged_testbed.json").read_text())["facts"],
                  DEFAULTS, "h")
    assert c.facts["lspci"] is not None
    with pytest.raises(FactNotRequested, match=r"'kernel' was read but no planner names it"):
        c.facts["kernel"]


def test_adding_a_fact_is_one_declaration_and_the_reads_of_its_planner(monkeypatch):
    """A new fact (the host's hostname, parsed from what the probe's host part returns):
    declared once, named by the step that reads it; the request, the facts dict, the view and
    the fingerprint follow with no other edit."""
    hostname = pf.Fact("hostname", lambda want: {"host": True},
                       lambda raw, want: raw["host"]["hostname"].lower())
    monkeypatch.setattr(pf, "FACTS", (*pf.FACTS, hostname))
    seen = []
    step = steps.Step("motd", lambda c: seen.append(c.facts["hostname"]) or [],
                      reads=lambda s: steps.reads("hostname"))
    monkeypatch.setattr(steps, "STEPS", [*steps.STEPS, step])
    want = steps.fact_request(DEFAULTS)
    assert "hostname" in want["facts"] and pf.probe_request(want)["host"] is True
    cap = json.loads((FIXTURES / "probe_01_provision_reply_testbed_gpu1.json").read_text())
    raw = pf.facts(cap["want"], cap["reply"])   # the request that reply answered
    assert raw["hostname"] == cap["reply"]["host"]["hostname"].lower()
    step.plan(steps.Ctx(raw, DEFAULTS, "h"))
    assert seen == [raw["hostname"]]
    assert fingerprint(raw) != fingerprint({**raw, "hostname": "other"})


def test_the_view_follows_the_declarations():
    want = steps.fact_request(DEFAULTS)
    f = Facts({}, want)
    assert f.venv(DEFAULTS.venv) == {} and f.node() == {}
    with pytest.raises(FactNotRequested, match="venv '/elsewhere'"):
        f.venv("/elsewhere")
    with pytest.raises(FactNotRequested, match=r"units\['sshd.service'\] was read .* not requested"):
        f.unit("sshd.service")
    with pytest.raises(FactNotRequested, match="node"):
        Facts({}, {k: v for k, v in want.items() if k != "node"}).node()
    # volatile facts (free space) stay out of the fingerprint
    assert pf.volatile() == {"disk_free_gb"}


def only(step_reads: dict, s) -> dict:
    """The want of one planner alone (plus what Ctx's derived properties read)."""
    return steps.merge_reads([("Ctx", steps.Ctx.READS), ("the planner", step_reads)])


@pytest.mark.parametrize("table", ["fresh", "converged", "drifted", "h100", "slurm"])
def test_each_planner_names_everything_it_reads(table):
    """Each planner run over a view that holds only what it names (its Step.reads): a fact it
    reads without naming it raises FactNotRequested here, even when another planner asked
    the probe for it."""
    from test_provision_plan import DEBIAN, H100, UBUNTU, _drifted, converged, ctx, fresh, tb_ctx
    from test_slurm_plan import SPEC, cluster_facts, raw
    from torchrig.provision import slurm
    if table == "slurm":   # the cluster's plan, too, over what it names alone
        alone = {h: Facts(f.raw, steps.merge_reads([("cluster", steps.SLURM_CLUSTER_READS)]))
                 for h, f in cluster_facts().items()}
        cl = slurm.plan_cluster(SPEC, alone, new_key=lambda: "k" * 64)
        assert cl.files and not cl.blocked
        contexts = [steps.Ctx({**raw(h), "os_release": DEBIAN}, DEFAULTS, h, [], cluster=cl)
                    for h in ("head", "gpu1")]
    elif table == "h100":
        contexts = [ctx(fresh(os_release=UBUNTU, lspci=H100), nccl_tests=True,
                        cuda_repo_url="https://u:p@mirror.internal/cuda"),
                    tb_ctx(converged(H100), firewall=False, node_exporter=False)]
    else:
        contexts = [tb_ctx({"fresh": fresh, "converged": converged, "drifted": _drifted}[table]())]
    ran = set()
    for c in contexts:
        for what, reads, run in [("preflight", steps.PREFLIGHT_READS, steps.preflight),
                                 *((st.name, st.reads(c.s), st) for st in steps.STEPS)]:
            alone = steps.Ctx(Facts(c.facts.raw, only(reads, c.s)), c.s, c.host,
                              c.payload_requirements, c.address, c.cluster, c.fleet, c.login)
            try:
                if isinstance(run, steps.Step):
                    if run.enabled(alone) is not None:
                        continue
                    run = run.plan
                run(alone)
            except FactNotRequested as e:
                pytest.fail(f"{what} reads what its reads do not name: {e}")
            ran.add(what)
    if table in ("fresh", "slurm"):
        assert ran >= {"preflight", "cuda-repo", "driver", "python-venv", "firewall"} | (
            {"slurm-packages", "munge", "slurm-config"} if table == "slurm" else set())


def test_the_real_probe_answers_every_declared_fact(tmp_path):
    """The built request run by the real probe (here, not as root: commands the machine lacks
    answer 127) and every parser reading only what its own request part asked for."""
    import subprocess
    import sys

    from torchrig.facts import probe
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "pyvenv.cfg").write_text("version = 3.11.2\n")
    want = dict(steps.fact_request(DEFAULTS), venv=str(venv))
    r = subprocess.run([sys.executable, "-I", "-"], input=probe.stdin(pf.probe_request(want)),
                       capture_output=True, text=True, timeout=120)
    got = pf.facts(want, probe.reply(r.returncode, r.stdout, r.stderr))
    assert list(got) == [f.name for f in pf.FACTS]
    assert got["venv"]["python"] == "3.11.2" and set(got["units"]) == set(want["units"])
    assert set(got["files"]) == {*want["files"], *want["secret_files"]}
