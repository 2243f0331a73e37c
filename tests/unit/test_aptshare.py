"""provision/aptshare.py: which hosts share one .deb download, what apt says it would
download, the meeting in apply (the seed downloads once, the others wait, a seed that stops
early releases them), and steps' scripts for it."""

import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace as NS

from torchrig.changes.model import AptInstall, Cmd
from torchrig.provision import aptshare
from torchrig.provision.apply import HostReport, _apply_plan
from torchrig.provision.live import StepProgress
from torchrig.provision.steps import apt_download, apt_uris, place_debs
from torchrig.settings import Settings

FIXTURES = Path(__file__).parent.parent / "fixtures"
URL = "https://repo.invalid/cuda/repos/debian12/x86_64/"


def planned(name, specs=("cuda-drivers=570.172.08-1", "libnccl2=2.26.2-1+cuda12.8"),
            distro="debian-12", arch="x86_64", url=URL):
    installs = [AptInstall(f"install {s}", f"apt_get install {s}", (s,)) for s in specs]
    steps = [NS(step=NS(name="cuda-repo"), status="planned", changes=[Cmd("apt-get update", "x")]),
             NS(step=NS(name="driver"), status="planned", changes=installs[:1]),
             NS(step=NS(name="nccl"), status="planned", changes=installs[1:]),
             # a step already done installs nothing
             NS(step=NS(name="dcgm"), status="ok", changes=[AptInstall("x", "y", ("dcgm=1",))])]
    return NS(host=NS(name=name), settings=Settings(),
              ctx=NS(distro=distro, arch=arch, repo=NS(url=url)), plan=NS(steps=steps))


def test_hosts_of_one_platform_and_repository_share():
    a, b = planned("a"), planned("b")
    nvswitch = planned("c", specs=("nvidia-open=570.172.08-1", "libnccl2=2.26.2-1+cuda12.8"))
    arm, other = planned("arm", arch="aarch64"), planned("o", url="https://mirror.invalid/")
    arm2 = planned("arm2", arch="aarch64")
    done = planned("done", specs=())
    assert aptshare.specs_of(a) == ("cuda-drivers=570.172.08-1", "libnccl2=2.26.2-1+cuda12.8")
    assert aptshare.specs_of(done) == ()
    gs = aptshare.groups([a, nvswitch, arm, b, other, arm2, done])
    assert [[p.host.name for p in g.hosts] for g in gs] == [["a", "c", "b"], ["arm", "arm2"]]
    # the seed downloads each distinct set of installs, once
    assert gs[0].installs == [aptshare.specs_of(a), aptshare.specs_of(nvswitch)]
    assert gs[1].installs == [aptshare.specs_of(arm)]
    assert gs[0].name.startswith("apt-") and len(gs[0].name) == 20 and gs[0].name != gs[1].name
    assert aptshare.groups([a]) == [] and aptshare.groups([a, other, done]) == []
    # the name follows what is installed
    assert aptshare.groups([a, b])[0].name != aptshare.groups([a, nvswitch])[0].name


def test_what_apt_would_download_is_read_from_its_own_index():
    """Real output (tests/fixtures/INDEX.md): the name apt stores a file under, its size and
    the SHA-256 of the host's signed index; an MD5-only line (no ForceHash) is not taken."""
    text = (FIXTURES / "apt_print_uris_01_debian12_forcehash_sha256.txt").read_text()
    got = aptshare.parse_uris(text + "'http://h/p/x_1_all.deb' x_1_all.deb 10 MD5Sum:" + "0" * 32
                              + "\nE: something else\n")
    assert got == {
        "vim-tiny_2%3a9.0.1378-2+deb12u2_amd64.deb":
            (719960, "168abe22ba74ba3fc1adbd7fdbed5c53903d98bab48f760216157bd0331a7a3f"),
        "munge_0.5.15-2+deb12u1_amd64.deb":
            (106096, "a5d4c6eb1229dda19bb37040872edc275f581c8d8d820df4bc45cb1f82955334")}


def test_only_files_exactly_as_the_hosts_index_says_are_placed():
    want = {"a_1_amd64.deb": (10, "a" * 64), "b_1_amd64.deb": (20, "b" * 64),
            "c_1_amd64.deb": (30, "c" * 64), "d_1_amd64.deb": (40, "d" * 64)}
    files = [{"path": "a_1_amd64.deb", "size": 10, "sha256": "a" * 64},
             {"path": "b_1_amd64.deb", "size": 20, "sha256": "f" * 64},   # another build
             {"path": "c_1_amd64.deb", "size": 31, "sha256": "c" * 64},   # another size
             {"path": "e_1_amd64.deb", "size": 50, "sha256": "e" * 64}]   # not wanted here
    assert aptshare.matching(want, files) == ["a_1_amd64.deb"]


def test_the_scripts_download_into_roots_cache_and_ask_apt_for_sha256():
    s = Settings()
    dl = apt_download(s, [["cuda-drivers=570.172.08-1", "a b"], ["nvidia-open=570.172.08-1"]])
    dest = "/var/lib/torchrig/wheels/.torchrig/download"
    apt = ("apt_get install --download-only --no-install-recommends --allow-downgrades "
           f"--allow-change-held-packages -o Dir::Cache::Archives={dest}/ ")
    assert f"{apt}cuda-drivers=570.172.08-1 'a b'\n{apt}nvidia-open=570.172.08-1\n" in dl
    assert f"mkdir -- {dest}/partial" in dl and f"rm -rf -- {dest}/partial {dest}/lock" in dl
    assert "-o Acquire::ForceHash=SHA256" in apt_uris(["x"]) and "--print-uris" in apt_uris(["x"])


def test_place_debs_links_the_named_files_into_apts_cache(tmp_path):
    """Run for real (bash) against folders here: only the named files, by link."""
    src, dst = tmp_path / "set", tmp_path / "archives"
    src.mkdir()
    dst.mkdir()
    for n in ("a_1%3a2_amd64.deb", "b_1_amd64.deb", "c_1_amd64.deb"):
        (src / n).write_text(n)
    subprocess.run(["bash", "-euc", place_debs(str(src), ["a_1%3a2_amd64.deb", "b_1_amd64.deb"],
                                                str(dst))], check=True)
    assert sorted(p.name for p in dst.iterdir()) == ["a_1%3a2_amd64.deb", "b_1_amd64.deb"]
    assert (dst / "b_1_amd64.deb").stat().st_ino == (src / "b_1_amd64.deb").stat().st_ino


class FakeMeet(aptshare.Meet):
    """The meeting's logic with the SSH work replaced: share and _place record their calls."""

    def __init__(self, planned, fail=False):
        super().__init__(fleet=None, planned=planned, progress=StepProgress())
        self.calls, self.fail = [], fail
        self.notes = []
        self.progress.note = lambda host, text: self.notes.append((host, text))

    def share(self, g):
        self.calls.append(("share", g.hosts[0].host.name))
        if self.fail:
            raise RuntimeError("apt-get --download-only failed: 404")
        self.files[g.name] = [{"path": "x.deb"}]
        return {"shared": True, "files": 1, "downloaded_by": g.hosts[0].host.name}

    def _place(self, p, g, files):
        self.calls.append(("place", p.host.name))
        return len(files)


def test_the_seed_downloads_once_and_the_others_wait_for_it():
    a, b, c = planned("a"), planned("b"), planned("c")
    m = FakeMeet([a, b, c])
    waiting = [threading.Thread(target=m.arrive, args=(p,)) for p in (b, c)]
    for t in waiting:
        t.start()
    for t in waiting:
        t.join(0.3)
    assert all(t.is_alive() for t in waiting) and m.calls == []   # nobody goes before the seed
    m.arrive(a)
    for t in waiting:
        t.join(5)
    assert not any(t.is_alive() for t in waiting)
    assert m.calls[0] == ("share", "a") and [c for c in m.calls if c[0] == "share"] == [("share", "a")]
    assert sorted(h for k, h in m.calls if k == "place") == ["a", "b", "c"]
    assert m.account()[m.groups[0].name]["placed"] == {"a": 1, "b": 1, "c": 1}


def test_a_failed_download_leaves_every_host_on_the_index_and_says_why():
    a, b = planned("a"), planned("b")
    m = FakeMeet([a, b], fail=True)
    m.arrive(a)
    m.arrive(b)
    assert m.calls == [("share", "a")]
    assert "404" in m.account()[m.groups[0].name]["error"]
    assert [h for h, t in m.notes if "apt downloads from the index" in t] == ["a", "b"]


def test_a_seed_that_stops_before_its_installs_releases_the_others():
    a, b = planned("a"), planned("b")
    m = FakeMeet([a, b])
    t = threading.Thread(target=m.arrive, args=(b,))
    t.start()
    m.left(b)      # not the seed: changes nothing
    t.join(0.3)
    assert t.is_alive()
    m.left(a)      # the seed's apply ended without arriving
    t.join(5)
    assert not t.is_alive() and m.calls == []
    assert "a, which was to download them, stopped before its installs" in \
        m.account()[m.groups[0].name]["error"]


class Cxn:
    def __init__(self):
        self.scripts = []

    def run_input(self, command, data, timeout, root=False):
        self.scripts.append(data)
        return NS(exited=0, stdout="", stderr="")


def test_apply_meets_once_before_the_first_step_that_apt_installs():
    step = lambda name: NS(name=name, needs_driver=False, reprobes_driver=False,  # noqa: E731
                           upload=lambda s: None)
    sp = lambda name, changes: NS(step=step(name), status="planned", changes=changes,  # noqa: E731
                                  describe=lambda: [c.summary for c in changes], reason=None)
    plan = NS(driver="ok", steps=[
        sp("cuda-repo", [Cmd("apt-get update", "echo update")]),
        sp("driver", [AptInstall("install d", "echo install-d", ("d",))]),
        sp("nccl", [AptInstall("install n", "echo install-n", ("n",))])])
    cxn, seen = Cxn(), []
    before = lambda: seen.append(len(cxn.scripts))  # noqa: E731 - how many steps ran by then
    _apply_plan(cxn, plan, Settings(), HostReport("a"), StepProgress(), before)
    assert seen == [1]    # once, after cuda-repo, before the driver's install
    assert len(cxn.scripts) == 3


def test_a_step_that_waits_for_the_driver_still_meets_the_others():
    """The seed's only install waits for the driver (a reboot away): it still arrives, after
    cuda-repo, so the others are not held until its apply ends."""
    step = NS(name="dcgm", needs_driver=True, reprobes_driver=False, upload=lambda s: None)
    changes = [AptInstall("install dcgm", "echo install", ("datacenter-gpu-manager=1:3.3.9",))]
    plan = NS(driver="not-installed", steps=[
        NS(step=NS(name="cuda-repo", needs_driver=False, reprobes_driver=False,
                   upload=lambda s: None), status="planned",
           changes=[Cmd("apt-get update", "echo update")], describe=lambda: ["apt-get update"],
           reason=None),
        NS(step=step, status="planned", changes=changes, describe=lambda: ["install dcgm"],
           reason=None)])
    cxn, seen, rep = Cxn(), [], HostReport("a")
    waiting = _apply_plan(cxn, plan, Settings(), rep, StepProgress(),
                          lambda: seen.append(len(cxn.scripts)))
    assert seen == [1] and waiting == "not-installed"
    assert [(r.name, r.status) for r in rep.steps] == [("cuda-repo", "changed"), ("dcgm", "skipped")]
