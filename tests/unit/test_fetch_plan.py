"""fetch's pure parts: which node, which checkpoints in which order, which names may be
written on the operator's side, where a transfer resumes, the manifest."""

import re
from pathlib import Path

import pytest

from torchrig.errors import TorchrigError
from torchrig.fetch import plan

CHECKPOINT = Path(__file__).resolve().parents[2] / "payload" / "checkpoint.py"


def listing(*steps, skipped=(), other=()):
    files = [{"name": f"ckpt_{s:08d}.pt", "size": 10, "mtime": 0} for s in steps]
    return {"exists": True, "files": files + [{"name": n, "size": 1, "mtime": 0} for n in other],
            "skipped": [{"name": n, "why": w} for n, w in skipped]}


def test_the_checkpoint_name_is_the_payloads():
    pattern = re.search(r'CKPT_RE = re\.compile\(r"([^"]+)"\)', CHECKPOINT.read_text()).group(1)
    assert plan.CKPT_RE.pattern == pattern
    assert plan.step_of("ckpt_00000040.pt") == 40 and plan.step_of("ckpt_123000000.pt") == 123000000
    assert plan.step_of(".tmp_ckpt_ckpt_00000040.pt.77") is None and plan.step_of("ckpt_40.pt") is None


def test_the_host_with_the_newest_checkpoint_is_chosen():
    # rank 0 can move between nodes across restarts: the newest step wins, not the first host
    assert plan.choose_host({"gpu1": listing(10, 20), "gpu4": listing(30), "gpu2": listing()}) == "gpu4"
    assert plan.choose_host({"gpu1": listing(), "gpu4": {"exists": False, "files": []}}) is None


def test_candidates_newest_first_by_step_not_by_name():
    names, refused = plan.candidates(listing(99999999, 100000000, 20), None)
    assert names == ["ckpt_100000000.pt", "ckpt_99999999.pt", "ckpt_00000020.pt"] and refused == []


def test_candidates_of_one_step_and_refusals():
    lst = listing(10, 20, skipped=[("ckpt_00000030.pt", "a symlink (not followed)"),
                                   ("notes.txt", "a symlink (not followed)")])
    names, refused = plan.candidates(lst, None)
    assert names == ["ckpt_00000020.pt", "ckpt_00000010.pt"]
    assert refused == [{"name": "ckpt_00000030.pt", "why": "a symlink (not followed)"}]
    assert plan.candidates(lst, 10) == (["ckpt_00000010.pt"], [])
    with pytest.raises(TorchrigError, match=r"--step 15: no such checkpoint \(steps there: 10, 20\)"):
        plan.candidates(lst, 15)
    with pytest.raises(TorchrigError, match=r"--step 30: ckpt_00000030.pt is a symlink \(not followed\): refused"):
        plan.candidates(lst, 30)


@pytest.mark.parametrize("name,ok", [
    ("ckpt_00000010.pt", True), ("notes.txt", True), ("a+b-c_d.bin", True),
    ("..", False), (".", False), ("../etc", False), ("a/b", False), ("/etc/passwd", False),
    (".hidden", False), (".ckpt_00000010.pt.0123.part", False), ("a..b", False),
    ("MANIFEST.json", False), ("x\n", False), ("", False), ("a\\b", False), ("é", False),
])
def test_names_from_the_node_that_may_be_written_here(name, ok):
    assert plan.safe_name(name) is ok


def test_all_files_leaves_out_unsafe_names_and_the_nodes_refusals():
    lst = listing(10, other=["MANIFEST.json", "..x", "log.txt"],
                  skipped=[("evil", "a symlink (not followed)")])
    names, left = plan.all_files(lst)
    assert names == ["ckpt_00000010.pt", "log.txt"]
    assert {e["name"] for e in left} == {"evil", "MANIFEST.json", "..x"}


def test_resume_offsets_and_partial_names():
    assert plan.resume_offset(0, 100) == 0
    assert plan.resume_offset(40, 100) == 40
    assert plan.resume_offset(100, 100) == 100
    assert plan.resume_offset(140, 100) == 0    # longer than the file: not a prefix of it
    sha = "ab" * 32
    assert plan.part_name("ckpt_00000010.pt", sha) == ".ckpt_00000010.pt.abababababababab.part"
    assert plan.part_name("x", sha) != plan.part_name("x", "cd" * 32)  # new content: new partial


def test_manifest_belongs_to_one_job():
    assert plan.parse_manifest(None, "j1", "M") == {"job": "j1", "files": []}
    with pytest.raises(TorchrigError, match="M belongs to job 'j2', not 'j1'"):
        plan.parse_manifest('{"job": "j2", "files": []}', "j1", "M")
    with pytest.raises(TorchrigError, match="M is not a torchrig manifest"):
        plan.parse_manifest("{not json", "j1", "M")
    with pytest.raises(TorchrigError, match="not a torchrig manifest"):
        plan.parse_manifest('["x"]', "j1", "M")


def test_manifest_merge_keeps_unchanged_records_and_replaces_changed_ones():
    doc = {"job": "j", "files": [{"name": "b", "sha256": "1", "fetched_at": "old"}]}
    same = plan.merge_manifest(doc, [{"name": "b", "sha256": "1", "fetched_at": "new"}])
    assert same == doc  # fetching what is there changes nothing
    new = plan.merge_manifest(doc, [{"name": "b", "sha256": "2", "fetched_at": "new"},
                                    {"name": "a", "sha256": "3", "fetched_at": "new"}])
    assert [(f["name"], f["sha256"]) for f in new["files"]] == [("a", "3"), ("b", "2")]


@pytest.mark.parametrize("rc,alive,start,offset,outcome", [
    (0, True, 0, 100, "done"),
    (0, True, 40, 100, "done"),         # a resumed read that finished
    (-1, False, 0, 40, "dropped"),      # the connection died mid-way (paramiko: no exit status)
    (-1, True, 40, 70, "dropped"),      # the node's process was killed (an exit signal)
    (None, True, 40, 40, "dropped"),    # silence: nothing came for a minute
    (-9, True, 0, 0, "dropped"),        # a local process killed
    (-1, False, 40, 100, "done"),       # every byte arrived before the drop: the hash decides
    (0, True, 0, 40, "dropped"),        # ended early: ask again (the node then says why)
    (1, False, 0, 0, "dropped"),        # an exit status from a lost connection: retried
    (3, True, 0, 0, "failed"),          # the node refused (changed, a symlink now, ...)
    (3, False, 40, 70, "failed"),
    (1, True, 40, 40, "failed"),        # runuser/sudo failed at once: retrying fails the same
    (1, True, 40, 70, "dropped"),       # failed after progress: retried from 70
    (0, True, 0, 140, "grew"),
])
def test_what_a_read_means(rc, alive, start, offset, outcome):
    assert plan.after_read(rc, alive, start, offset, 100) == outcome


def test_the_nodes_lines_are_told_apart_from_its_errors():
    from torchrig.onhost import HERE
    node = (HERE / "fetch" / "node.py").read_text()
    assert f'TRAILER = "{plan.NODE_SAYS}"' in node  # one protocol on both sides
    err = (f'{plan.NODE_SAYS}{{"ident": [1, 2, 3, 4]}}\nwarning: x\n'
           f'{plan.NODE_SAYS}{{"sha256": "ab", "ident": [1, 2, 3, 4]}}\n').encode()
    assert plan.node_says(err) == ({"ident": [1, 2, 3, 4], "sha256": "ab"}, "warning: x")
    assert plan.node_says(f"{plan.NODE_SAYS}not json\n".encode()) == \
        ({}, f"{plan.NODE_SAYS}not json")
