"""provision/wheels.py (pure): which hosts share one download, the pins pip installs by; and
steps' scripts for it (the download, the install from the cache with its fallback)."""

import subprocess
from types import SimpleNamespace as NS

import pytest

from torchrig.changes.model import Cmd
from torchrig.errors import TorchrigError
from torchrig.provision import wheels
from torchrig.provision.steps import PipInstall, _pip_install, from_wheels, pip_download
from torchrig.settings import Settings

S = Settings()
SHA = "a" * 64


def planned(name, reqs=("torch==2.13.0",), distro="debian-12", arch="x86_64", venv_todo=True,
            trusted=None, index="https://idx.invalid/simple"):
    s = Settings(pip_trusted_host=trusted)
    pip = _pip_install(s, list(reqs), index, "pip_index_url")
    tb = _pip_install(s, ["tensorboard==2.21.0"], index, "tensorboard_index_url")
    step = NS(step=NS(name="python-venv"), status="planned" if venv_todo else "ok",
              changes=[Cmd("create the venv", "python3 -m venv v"), pip, tb] if venv_todo else [])
    other = NS(step=NS(name="nccl"), status="planned", changes=[Cmd("x", "y")])
    return NS(host=NS(name=name), settings=s, ctx=NS(distro=distro, arch=arch),
              plan=NS(steps=[other, step]))


def test_hosts_with_the_same_install_on_one_platform_share():
    a, b, c = planned("a"), planned("b"), planned("c", reqs=("torch==2.13.0", "six"))
    arm = planned("arm", arch="aarch64")
    done = planned("done", venv_todo=False)
    gs = wheels.groups([a, b, c, arm, done])
    assert len(gs) == 2
    two = next(g for g in gs if len(g.needers) == 2)
    assert [p.host.name for p in two.needers] == ["a", "b"]          # a: the seed
    assert [p.host.name for p in two.others] == ["c", "done"]        # may hold the wheels
    one = next(g for g in gs if g is not two)
    assert [p.host.name for p in one.needers] == ["c"]               # alone, but others may hold
    assert two.pip.reqs == ("torch==2.13.0",) and two.pip.var == "pip_index_url"


def test_a_single_host_alone_keeps_todays_path():
    assert wheels.groups([planned("a")]) == []
    assert wheels.groups([planned("a"), planned("arm", arch="aarch64")]) == []


def test_the_cache_name_follows_what_is_installed_from_where_on_which_platform():
    p = planned("a")
    name = wheels.set_name(wheels.pip_of(p), None, ("debian-12", "x86_64"))
    assert name == wheels.set_name(wheels.pip_of(planned("b")), None, ("debian-12", "x86_64"))
    assert name.startswith("pip-") and len(name) == 20
    for other in (wheels.set_name(wheels.pip_of(p), "mirror", ("debian-12", "x86_64")),
                  wheels.set_name(wheels.pip_of(p), None, ("debian-12", "aarch64")),
                  wheels.set_name(wheels.pip_of(planned("c", index="https://other.invalid/")),
                                  None, ("debian-12", "x86_64"))):
        assert other != name


def test_pins_name_each_wheel_with_its_hashes():
    files = [{"path": "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "sha256": SHA},
             {"path": "typing_extensions-4.12.2-py3-none-any.whl", "sha256": "b" * 64},
             {"path": "typing_extensions-4.12.2-1build-py3-none-any.whl", "sha256": "c" * 64}]
    assert wheels.pins(files) == [
        f"torch==2.13.0+cpu --hash=sha256:{SHA}",
        f"typing_extensions==4.12.2 --hash=sha256:{'b' * 64} --hash=sha256:{'c' * 64}"]
    with pytest.raises(ValueError, match="not a wheel"):
        wheels.pins([{"path": "pkg-1.0.tar.gz", "sha256": SHA}])


def test_the_download_and_the_install_from_the_cache():
    s = Settings(pip_trusted_host="10.0.0.1")
    pip = _pip_install(s, ["torch==2.13.0", "pkg @ https://u:tok3n@h.invalid/p.whl"],
                       "https://user:s3cret@idx.invalid/simple", "pip_index_url")
    assert isinstance(pip, PipInstall)
    dl = pip_download(s, pip)
    assert ('"$TORCHRIG_TMP"/pip/bin/pip download --quiet --disable-pip-version-check '
            '--only-binary=:all: --dest /var/lib/torchrig/wheels/.torchrig/download') in dl
    assert f"{s.wheel_cache_dir}/.torchrig/download" in dl and "--trusted-host 10.0.0.1" in dl
    for secret in ("s3cret", "tok3n"):
        assert secret not in dl       # netrc and requirements travel base64-encoded in files
    inst = from_wheels(s, pip, "/var/lib/torchrig/wheels/pip-x", [f"torch==2.13.0 --hash=sha256:{SHA}"], "gpu1")
    assert "--no-index --find-links /var/lib/torchrig/wheels/pip-x --require-hashes" in inst.script
    assert inst.script.endswith(pip.script + "\n}")  # else from the index, as before
    assert inst.summary == pip.summary + " (wheels from gpu1, sha256-checked)"
    for script in (dl, inst.script):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_a_group_that_cannot_share_stays_on_the_index_and_says_why(monkeypatch):
    from torchrig.provision import wheelshare
    a, b = planned("a"), planned("b")
    before = [list(sp.changes) for p in (a, b) for sp in p.plan.steps]

    def broken(fleet, g, progress):
        raise TorchrigError("pip download failed: no wheel for pkg @ https://u:s3cretpw@h.invalid/")
    monkeypatch.setattr(wheelshare, "_share", broken)
    notes = []
    progress = NS(note=lambda host, text: notes.append((host, text)))
    m = wheelshare.Meet(None, [a, b], progress)
    m.arrive(a)
    m.arrive(b)
    out = m.account()
    assert list(out.values())[0]["error"].startswith("pip download failed: no wheel for pkg @ https://")
    assert [h for h, _ in notes] == ["a", "b"] and all("from the index" in t for _, t in notes)
    assert "s3cretpw" not in repr(out) + repr(notes)   # through the redactor
    assert [list(sp.changes) for p in (a, b) for sp in p.plan.steps] == before


def test_swap_replaces_only_the_index_install():
    from torchrig.provision import wheelshare
    a = planned("a")
    tb = a.plan.steps[1].changes[2]
    assert wheels.pip_of(a) is not None  # the index install, before
    new = Cmd("from the cache", "true")
    wheelshare.swap(a, new)
    assert a.plan.steps[1].changes[1:] == [new, tb] and wheels.pip_of(a) is None


# ---- the operator's wheels, for real on `connection: local` nodes (root: node.py's root store) --

@pytest.fixture
def local_fleet(tmp_path):
    import json
    import os
    from torchrig import inventory
    from torchrig.session import Fleet
    if os.geteuid() != 0:
        pytest.skip("root's store: the node side runs as root")
    wheels_dir = tmp_path / "operator"
    wheels_dir.mkdir()
    hosts = [{"name": n, "connection": "local", "address": "127.0.0.1", "vars": {
        "wheel_cache_dir": str(tmp_path / "cache" / n), "pip_wheels_dir": str(wheels_dir)}}
        for n in ("n1", "n2", "n3")]
    (tmp_path / "inv.yml").write_text(json.dumps({"hosts": hosts}))
    with Fleet(inventory.load(tmp_path / "inv.yml")) as fleet:
        yield fleet, wheels_dir


def test_the_operators_wheels_reach_every_host_once_from_here_then_node_to_node(local_fleet, tmp_path):
    import hashlib
    import os
    from torchrig.provision import wheelshare
    fleet, wheels_dir = local_fleet
    files = {"torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl": os.urandom(300_000),
             "six-1.16.0-py2.py3-none-any.whl": b"six"}
    for n, data in files.items():
        (wheels_dir / n).write_bytes(data)
    (wheels_dir / "README").write_text("not a wheel: left out")
    ps = []
    for h in fleet.hosts:
        p = planned(h.name)
        p.host, p.settings = h, h.settings
        ps.append(p)
    notes = []
    m = wheelshare.Meet(fleet, ps, NS(note=lambda host, text: notes.append((host, text))))
    for p in ps:
        m.arrive(p)   # the seed's arrival shares for the group; each swaps its own install
    out = m.account()
    (res,) = out.values()
    assert res["shared"] and res["source"] == "this machine" and res["fallbacks"] == []
    assert res["operator_bytes"] == sum(map(len, files.values()))   # each byte once from here
    for h in fleet.hosts:
        got = tmp_path / "cache" / h.name / next(iter(out))
        assert {f.name: f.read_bytes() for f in got.iterdir() if f.suffix == ".whl"} == files
    pip = ps[1].plan.steps[1].changes[1]
    assert "--no-index --find-links" in pip.script and "(wheels from this machine" in pip.summary
    for n, data in files.items():
        name, ver = n.split("-")[:2]
        assert f"{name}=={ver} --hash=sha256:{hashlib.sha256(data).hexdigest()}" in \
            wheels.pins([{"path": n, "sha256": hashlib.sha256(data).hexdigest()}])
    again = [planned(h.name) for h in fleet.hosts]
    for p, h in zip(again, fleet.hosts):
        p.host, p.settings = h, h.settings
    m = wheelshare.Meet(fleet, again)
    m.arrive(again[0])
    assert list(m.account().values())[0]["operator_bytes"] == 0  # all held


def test_an_empty_operator_folder_is_one_clear_reason(tmp_path):
    from torchrig.provision import wheelshare
    with pytest.raises(TorchrigError, match=r"var pip_wheels_dir: no .whl file in .*pip download"):
        wheelshare.from_operator(str(tmp_path))


# ---- the meeting: the share runs where the seed is about to pip install ------------------------

def test_the_wheels_meet_shares_in_the_first_needers_arrival_and_the_others_wait(monkeypatch):
    import threading
    from torchrig.provision import wheelshare
    a, b, c = planned("a"), planned("b"), planned("c")
    calls = []

    def fake(fleet, g, progress):
        calls.append([p.host.name for p in g.needers])
        return {"shared": True, "source": "a"}, ["pkg==1 --hash=sha256:" + "0" * 64]
    monkeypatch.setattr(wheelshare, "_share", fake)
    m = wheelshare.Meet(None, [a, b, c])
    waiting = [threading.Thread(target=m.arrive, args=(p,)) for p in (b, c)]
    for t in waiting:
        t.start()
    for t in waiting:
        t.join(0.3)
    assert all(t.is_alive() for t in waiting) and calls == []   # nobody goes before the seed
    m.arrive(a)
    for t in waiting:
        t.join(5)
    assert not any(t.is_alive() for t in waiting) and calls == [["a", "b", "c"]]
    m.arrive(a)                                                  # after a reboot: not again
    (got,) = m.account().values()
    assert calls == [["a", "b", "c"]] and got["shared"] and got["hosts"] == ["a", "b", "c"]
    assert all(wheels.pip_of(p) is None for p in (a, b, c))      # each installs from its cache
    pips = [p.plan.steps[1].changes[1] for p in (a, b, c)]
    assert all("--no-index --find-links" in c.script and "--require-hashes" in c.script for c in pips)
    assert ["(wheels from this host's cache" in pips[0].summary] + \
        ["(wheels from a" in c.summary for c in pips[1:]] == [True] * 3


def test_a_wheel_seed_that_stops_before_its_pip_install_releases_the_others():
    import threading
    from torchrig.provision import wheelshare
    a, b = planned("a"), planned("b")
    notes = []
    m = wheelshare.Meet(None, [a, b], NS(note=lambda host, text: notes.append((host, text))))
    t = threading.Thread(target=m.arrive, args=(b,))
    t.start()
    m.left(b)      # not the seed: changes nothing
    t.join(0.3)
    assert t.is_alive()
    m.left(a)      # the seed's apply ended (an earlier step failed) without arriving
    t.join(5)
    assert not t.is_alive()
    why = "a, which was to fetch them, stopped before its pip install"
    assert [v["error"] for v in m.account().values()] == [why]
    assert notes == [("b", f"wheels not shared ({why}): pip installs from the index")]
    assert wheels.pip_of(b) is not None                          # b installs from the index


def test_apply_meets_before_the_pip_step_and_runs_what_the_meeting_swapped_in():
    """The seed's pip download needs the venv module's pip, which base-packages installs on a
    bare host: the meeting is after it, and the pip step's changes are read after the meeting."""
    from torchrig.provision.apply import HostReport, _apply_plan
    from torchrig.provision.live import StepProgress

    class Cxn:
        scripts = []

        def run_input(self, command, data, timeout, root=False):
            self.scripts.append(data)
            return NS(exited=0, stdout="", stderr="")

    def sp(name, changes):
        st = NS(step=NS(name=name, needs_driver=False, reprobes_driver=False,
                        upload=lambda s: None), status="planned", changes=changes, reason=None)
        st.describe = lambda: [c.summary for c in st.changes]
        return st
    p = planned("a")
    venv = p.plan.steps[1]
    index_install = wheels.pip_of(p)
    plan = NS(driver="ok", steps=[sp("base-packages", [Cmd("install python3-venv", "echo base")]),
                                  sp("python-venv", venv.changes)])
    cxn, seen = Cxn(), []

    def meet():
        seen.append(len(cxn.scripts))
        plan.steps[1].changes = [Cmd("from the cache", "echo cached")]
    rep = HostReport("a")
    _apply_plan(cxn, plan, Settings(), rep, StepProgress(), None, meet)
    assert seen == [1]                     # after base-packages, before the pip step
    assert "echo cached" in cxn.scripts[1] and index_install.script not in cxn.scripts[1]
    assert [(s.name, s.status) for s in rep.steps] == [("base-packages", "changed"),
                                                       ("python-venv", "changed")]
