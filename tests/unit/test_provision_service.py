"""provision's service over pure plans: saved plan files (format, no secrets, 0600, refusal of a
changed host or a different plan) and the progress lines when stderr is not a terminal."""

import dataclasses
import io
import json
import os
import stat

import pytest

from test_provision_plan import converged, fresh, tb_ctx

from torchrig.errors import TorchrigError
from types import SimpleNamespace
from torchrig.provision import live, planfile, service, steps
from torchrig.provision.apply import Planned
from torchrig.changes.model import FileChange
from torchrig.provision.engine import build_plan
from torchrig.secrets import Redactor

TOKEN = "s3cr3t-t0ken-abcdef"


def planned(facts, **vars_) -> Planned:
    c = tb_ctx(facts, **vars_)
    return Planned(SimpleNamespace(name="h"), c.s, c, build_plan(c))  # the service reads its name


def drifted():
    f = converged()
    f["files"][steps.SOURCES_FILE]["content"] += "# edited\n"
    return f


def secret_vars():
    # a repo with credentials: the auth file's content and the plan both involve the token
    return {"cuda_repo_url": f"https://user:{TOKEN}@repo.example/cuda/"}


def fleet_plan(p: Planned) -> service.FleetPlan:
    return service.FleetPlan([p], [], Redactor([TOKEN]))


def test_saved_plan_round_trips_holds_no_secret_and_is_0600(tmp_path):
    p = planned(drifted(), **secret_vars())
    assert p.plan.changes_anything
    path = tmp_path / "plan.json"
    assert service.save(fleet_plan(p), str(path)) == 1
    text = path.read_text()
    # the plan applied writes the token (the apt auth file); the saved file never holds it
    assert any(TOKEN in (getattr(c, "content", None) or "")
               for sp in p.plan.steps for c in sp.changes)
    assert TOKEN not in text and "/etc/apt/auth.conf.d/90-torchrig-cuda.conf" in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [f for f in os.listdir(tmp_path)] == ["plan.json"]  # no temp file left behind
    saved = planfile.read(str(path))
    assert saved.hosts["h"].fingerprint == p.plan.fingerprint
    assert json.loads(text)["hosts"][0]["plan"]["fingerprint"] == p.plan.fingerprint
    # the same host and inventory: the plan is applied (kept)
    again = service.against_saved(fleet_plan(planned(drifted(), **secret_vars())), saved)
    assert [x.host.name for x in again.planned] == ["h"] and again.ok


def test_saved_plan_refuses_a_changed_host_naming_what_changed(tmp_path):
    path = tmp_path / "plan.json"
    service.save(fleet_plan(planned(drifted())), str(path))
    saved = planfile.read(str(path))
    later = drifted()
    later["packages"]["libnccl2"] = "2.0-1"
    later["disk_free_gb"] += 7  # volatile: not a change
    res = service.against_saved(fleet_plan(planned(later)), saved)
    assert res.planned == [] and not res.ok
    (rep,) = res.failed
    assert rep.host == "h" and rep.error.startswith("the host changed since the plan was saved (")
    assert "packages[libnccl2]" in rep.error and "nothing was applied" in rep.error
    assert f"--save-plan {path}" in rep.error


def test_saved_plan_refuses_when_the_inventory_makes_a_different_plan(tmp_path):
    path = tmp_path / "plan.json"
    service.save(fleet_plan(planned(fresh())), str(path))
    saved = planfile.read(str(path))
    res = service.against_saved(fleet_plan(planned(fresh(), driver_version="575.51.03")), saved)
    assert not res.planned
    assert "the plan made from them now differs" in res.failed[0].error


def test_saved_plan_refuses_after_an_upgrade_that_changes_what_a_step_runs(tmp_path, monkeypatch):
    """The same facts and inventory and the same rows shown, but the generated scripts differ
    (as after an upgrade of torchrig): the saved plan no longer matches."""
    from torchrig.provision import apply
    path = tmp_path / "plan.json"
    service.save(fleet_plan(planned(drifted(), **secret_vars())), str(path))
    saved = planfile.read(str(path))
    upgraded = apply.preamble
    monkeypatch.setattr(apply, "preamble", lambda t: upgraded(t) + "echo upgraded\n")
    p = planned(drifted(), **secret_vars())
    assert fleet_plan(p).reports()[0].as_dict() == saved.hosts["h"].report  # same rows shown
    res = service.against_saved(fleet_plan(p), saved)
    assert not res.planned and "torchrig itself changed" in res.failed[0].error


def test_saved_plan_digest_covers_file_bodies_without_holding_a_secret():
    p = planned(drifted(), **secret_vars())
    red = Redactor([TOKEN])
    scripts = apply_scripts(p, red)
    assert scripts and not any(TOKEN in s for s in scripts)
    # a file's body reaches the digest as its hash: another body, another digest
    sp = next(sp for sp in p.plan.steps if any(isinstance(c, FileChange) and not c.secret
                                               and c.content for c in sp.changes))
    i, c = next((i, c) for i, c in enumerate(sp.changes)
                if isinstance(c, FileChange) and not c.secret and c.content)
    sp.changes[i] = dataclasses.replace(c, content=c.content + "# another body\n")
    assert apply_scripts(p, red) != scripts


def apply_scripts(p, red):
    from torchrig.provision.apply import scripts_for_digest
    return scripts_for_digest(p, red)


def test_saved_plan_refuses_a_host_it_does_not_cover(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(planfile.dumps([planfile.SavedHost("other", "f", "d", {}, {})]))
    res = service.against_saved(fleet_plan(planned(fresh())), planfile.read(str(path)))
    assert res.failed[0].error.startswith(f"not in the saved plan {path} (it has other)")


@pytest.mark.parametrize("text,why", [
    ("not json", "not JSON"),
    ('{"hosts": []}', 'no "kind"'),
    ('{"kind": "torchrig-provision-plan", "version": 9, "hosts": []}', "version 9"),
    ('{"kind": "torchrig-provision-plan", "version": 2, "hosts": [{"host": "h"}]}', "lacks"),
    ('{"kind": "torchrig-provision-plan", "version": 2, "hosts": []}', "no hosts"),
    # a plan saved by a torchrig whose digest covered only the rows shown
    ('{"kind": "torchrig-provision-plan", "version": 1, "hosts": []}', "version 1, this torchrig reads version 2"),
])
def test_not_a_plan_file_is_one_clear_error(tmp_path, text, why):
    f = tmp_path / "x.json"
    f.write_text(text)
    with pytest.raises(TorchrigError, match=rf"^--plan {f}: not a torchrig provision plan \(.*{why}"):
        planfile.read(str(f))
    with pytest.raises(TorchrigError, match=r"cannot read it"):
        planfile.read(str(tmp_path / "missing.json"))


def test_plan_file_write_replaces_atomically_and_never_follows_a_link(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old")
    os.chmod(target, 0o644)
    planfile.write(str(target), "new")
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o600
    # a link planted at the temp name is not followed (O_EXCL | O_NOFOLLOW)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / f".plan.json.{os.getpid()}.tmp")
    with pytest.raises(TorchrigError, match="--save-plan .*cannot write it"):
        planfile.write(str(target), "x")
    assert victim.read_text() == "keep" and target.read_text() == "new"


def test_fingerprint_is_in_the_json_plan():
    p = planned(drifted())
    (d,) = fleet_plan(p).as_dict()
    assert d["fingerprint"] == p.plan.fingerprint and len(d["fingerprint"]) == 16


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_lines_when_not_a_terminal():
    out, clock = io.StringIO(), Clock()
    pr = live.LineProgress(out, clean=Redactor([TOKEN]).text, every=30, clock=clock)
    pr.started("gpu1", "driver", f"install cuda-drivers (token {TOKEN})")
    pr.started("gpu2", "python-venv", "pip install torch")
    clock.t += 29
    assert pr.due() == []
    clock.t += 2
    assert pr.due() == [("gpu1", "driver", 31.0), ("gpu2", "python-venv", 31.0)]
    assert pr.due() == []  # once per interval
    pr.finished("gpu1", "driver", "changed", 40.25)
    clock.t += 30
    assert pr.due() == [("gpu2", "python-venv", 61.0)]
    assert out.getvalue().splitlines() == [
        "gpu1 | driver: install cuda-drivers (token ***)",
        "gpu2 | python-venv: pip install torch",
        "gpu1 | driver: changed in 40.2s"]


def test_progress_ticker_writes_still_running_lines():
    out = io.StringIO()
    with live.LineProgress(out, every=0.05) as pr:
        pr.started("gpu1", "cuda-toolkit", "install cuda-toolkit-12-8")
        import time
        deadline = time.monotonic() + 10
        while "still running" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        pr.finished("gpu1", "cuda-toolkit", "changed", 0.2)
    lines = out.getvalue().splitlines()
    assert lines[0] == "gpu1 | cuda-toolkit: install cuda-toolkit-12-8"
    assert any(ln.startswith("gpu1 | cuda-toolkit: still running (") for ln in lines[1:-1])
    assert lines[-1] == "gpu1 | cuda-toolkit: changed in 0.2s"


def test_progress_is_live_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    assert isinstance(live.for_stream(io.StringIO()), live.LineProgress)
    pr = live.for_stream(Tty())
    assert isinstance(pr, live.LiveProgress)
    pr.clock = Clock()
    pr.started("gpu1", "driver", "x")
    pr.clock.t += 75
    from rich.console import Console
    con = Console(file=io.StringIO(), width=80)
    con.print(pr.table())
    assert con.file.getvalue().split() == ["gpu1", "driver", "75s"]
