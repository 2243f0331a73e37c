"""data's operator side: the manifest of a local folder (hashes, chunks, refusals), dataset
names, the fan-out's rounds, what `data ls` and the launch's gate make of the nodes' copies,
the progress lines, and run.py's parts that need no node (the framing of an op, data.pull's
refusals). The node side runs for real in test_data_node.py."""

import base64
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil

import pytest

from torchrig import inventory
from torchrig.datasets import manifest, plan, run, view
from torchrig.datasets.manifest import check_name, dataset_path, hash_file, scan, walk
from torchrig.errors import TorchrigError
from torchrig.launch.jobs import JobRow
from torchrig.session import Fleet

CH = 64 << 10  # a small chunk: a manifest carries its own chunk size, the node takes it from there


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def tree(root, files: dict[str, bytes]):
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


BIG = bytes(range(256)) * (CH * 5 // 2 // 256)   # two and a half chunks


# ---- the manifest ----------------------------------------------------------------------

def test_the_manifest_is_its_content_only_and_names_one_version(tmp_path):
    files = {"b.bin": BIG, "a/x.txt": b"same\n", "a/y.txt": b"same\n", "empty": b""}
    m, local = scan(tree(tmp_path / "one", files), CH)
    assert [f["path"] for f in m.files] == ["a/x.txt", "a/y.txt", "b.bin", "empty"]
    for f in m.files:
        assert (f["size"], f["sha256"]) == (len(files[f["path"]]), sha(files[f["path"]]))
    big = m.files[2]
    assert big["chunks"] == [sha(BIG[i:i + CH]) for i in range(0, len(BIG), CH)]
    assert len(big["chunks"]) == 3 and all("chunks" not in f for f in m.files if f is not big)
    assert m.doc["chunk"] == CH and m.size == len(BIG) + 10
    # one object per content: x and y are one file to store and send
    assert sorted(m.objects()) == sorted({sha(BIG), sha(b"same\n"), sha(b"")})
    assert local[sha(b"same\n")].read_bytes() == b"same\n"
    # the version is the canonical JSON's hash: the same content elsewhere, later, is the same
    other = shutil.copytree(tmp_path / "one", tmp_path / "two")
    os.utime(other / "b.bin", (1, 1))
    m2, _ = scan(other, CH)
    assert m2.doc == m.doc and m2.sha256 == m.sha256
    assert m.sha256 == sha(json.dumps(m.doc, sort_keys=True, separators=(",", ":")).encode())
    (other / "a/y.txt").write_bytes(b"samE\n")
    assert scan(other, CH)[0].sha256 != m.sha256
    (other / "a/y.txt").write_bytes(b"same\n")
    (other / "a/y.txt").rename(other / "a/z.txt")   # a rename is another dataset too
    assert scan(other, CH)[0].sha256 != m.sha256


def test_chunk_hashes_at_the_boundaries(tmp_path):
    for size, n in ((0, 0), (1, 1), (CH - 1, 1), (CH, 1), (CH + 1, 2), (2 * CH, 2)):
        data = os.urandom(size)
        (tmp_path / "f").write_bytes(data)
        h = hash_file(tmp_path / "f", CH)
        assert h == {"size": size, "sha256": sha(data),
                     "chunks": [sha(data[i:i + CH]) for i in range(0, size, CH)]}
        assert len(h["chunks"]) == n
    one = manifest.build([{"path": "f", **hash_file(tmp_path / "f", CH)}], CH)
    assert one.files[0]["chunks"] and len(one.files[0]["chunks"]) == 2
    exact = manifest.build([{"path": "f", "size": CH, "sha256": "0" * 64, "chunks": ["1" * 64]}], CH)
    assert "chunks" not in exact.files[0]  # one chunk: nothing to resume inside it


def test_a_single_file_and_what_the_node_keeps_for_itself(tmp_path):
    (tmp_path / "one.bin").write_bytes(b"x")
    m, _ = scan(tmp_path / "one.bin", CH)
    assert [f["path"] for f in m.files] == ["one.bin"]
    d = tree(tmp_path / "d", {"keep": b"k", ".torchrig/objects/x": b"no", "sub/.torchrig-manifest.json": b"{}",
                              ".torchrig-manifest.json": b"{}", "sub/.torchrig/kept": b"yes"})
    assert [rel for rel, _ in walk(d)] == ["keep", "sub/.torchrig/kept"]


def test_walk_refuses_what_is_not_a_regular_file(tmp_path):
    d = tree(tmp_path / "d", {"real": b"r", "sub/real": b"r"})
    (d / "link").symlink_to(d / "real")
    (d / "dirlink").symlink_to(d / "sub")
    os.mkfifo(d / "sub/fifo")
    with pytest.raises(TorchrigError, match=r"3 entries are not a regular file .*e\.g\. dirlink, link, sub/fifo"):
        walk(d)
    (tmp_path / "e/f").mkdir(parents=True)
    with pytest.raises(TorchrigError, match="no files to push"):
        walk(tmp_path / "e")
    with pytest.raises(TorchrigError, match=r"nothing: no such file or directory; data\.push takes"):
        walk(tmp_path / "nothing")


# ---- names ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["imagenet", "a", "A.b_c-1", "9", "x" * 64])
def test_plain_names_are_taken(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["..", ".", "/", "a/b", "../x", ".hidden", "-x", "_x", "a b",
                                  "x" * 65, "a\n", "é"])
def test_other_names_are_refused(name):
    with pytest.raises(TorchrigError, match="a dataset name is 1-64 letters"):
        check_name(name)


@pytest.mark.parametrize("name", ["", None])
def test_no_name_is_refused(name):
    with pytest.raises(TorchrigError, match="which dataset"):
        check_name(name)


def test_the_node_checks_names_the_same_way_and_the_path_is_under_the_data_dir():
    spec = importlib.util.spec_from_file_location("data_node", run.SCRIPT)
    node = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(node)   # only defines: main() runs when the operator appends it
    assert node.NAME_RE.pattern == manifest.NAME_RE.pattern
    assert node.MANIFEST == ".torchrig-manifest.json" and manifest.RESERVED == (".torchrig",)
    assert dataset_path("/srv/data/", "imagenet") == dataset_path("/srv/data", "imagenet") == "/srv/data/imagenet"


# ---- the fan-out's rounds -----------------------------------------------------------------

@pytest.mark.parametrize("holders", [0, 1, 2, 3])
@pytest.mark.parametrize("needy", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31])
def test_every_node_receives_once_from_a_node_that_already_had_it(holders, needy):
    have = [f"h{i}" for i in range(holders)]
    want = [f"n{i}" for i in range(needy)]
    rounds = plan.rounds(have, want)
    holding, got = set(have), []
    for i, pairs in enumerate(rounds):
        sources = [s for s, _ in pairs]
        assert len(sources) == len(set(sources)), "a source serves one node per round"
        for src, dst in pairs:
            if src == plan.OPERATOR:  # the operator seeds once, only where no node holds it
                assert (i, holders, len(pairs)) == (0, 0, 1)
            else:
                assert src in holding, f"{src} serves {dst} before it holds the dataset"
            assert dst not in holding
        holding |= {dst for _, dst in pairs}   # a node serves from the round after its own
        got += [dst for _, dst in pairs]
    assert sorted(got) == sorted(want) and len(got) == len(set(got))
    # the sources double each round: with k holders, the fewest rounds k * 2**r >= k + n
    k, seed = (holders, 0) if holders else (1, 1 if needy else 0)
    rest = needy - seed
    assert len(rounds) == seed + next(r for r in range(64) if k * 2 ** r >= k + rest)


# ---- what the nodes' copies say -------------------------------------------------------------

A, B = "a" * 64, "b" * 64


def test_agreement_names_every_node_that_differs():
    same = [plan.NodeCopy("n1", A, 2, 10), plan.NodeCopy("n2", A, 2, 10)]
    assert plan.agreement(same) == []
    assert plan.agreement(same + [plan.NodeCopy("n3")]) == ["n3: not there"]
    assert plan.agreement(same + [plan.NodeCopy("n3", error="unreachable: no route")]) == \
        ["n3: unreachable: no route"]
    assert plan.agreement([plan.NodeCopy("n1", A, problems=["x.bin: missing", "y: a symlink"])] + same[1:]) == \
        ["n1: x.bin: missing", "n1: y: a symlink"]
    assert plan.agreement(same + [plan.NodeCopy("n3", B), plan.NodeCopy("n4")]) == [
        "n4: not there", f"different versions: n1, n2 {A[:16]}; n3 {B[:16]}"]
    assert plan.agreement([plan.NodeCopy("n1")]) == ["n1: not there"]  # nowhere is not "agree"


def test_ls_rows_one_per_dataset_with_each_nodes_copy():
    def ds(name, sha, problems=()):
        return {"name": name, "sha256": sha, "files": 3, "bytes": 30, "problems": list(problems)}
    found = {"n1": [ds("imagenet", A), ds("tiny", B)], "n2": [ds("imagenet", A)],
             "n3": [ds("imagenet", A, ["x: missing"])]}
    rows = view.ls_rows(found, None)
    assert [(r["name"], r["agree"]) for r in rows] == [("imagenet", False), ("tiny", False)]
    assert rows[0]["why"] == ["n3: x: missing"] and rows[1]["why"] == ["n2: not there", "n3: not there"]
    assert rows[0]["nodes"]["n1"] == {"sha256": A, "files": 3, "bytes": 30, "problems": [], "error": None}
    assert view.ls_rows({"n1": [ds("imagenet", A)], "n2": [ds("imagenet", A)]}, None)[0]["agree"]
    down = view.ls_rows({"n1": [ds("imagenet", A)], "n2": "unreachable: timed out"}, "imagenet")
    assert down[0]["why"] == ["n2: unreachable: timed out"] and down[0]["nodes"]["n2"]["error"]
    nowhere = view.ls_rows({"n1": []}, "missing")
    assert nowhere == [{"name": "missing", "agree": False, "why": ["n1: not there"],
                        "nodes": {"n1": {"sha256": None, "files": 0, "bytes": 0, "problems": [],
                                         "error": None}}}]
    assert run.copies(found, "imagenet") == [plan.NodeCopy("n1", A, 3, 30), plan.NodeCopy("n2", A, 3, 30),
                                             plan.NodeCopy("n3", A, 3, 30, ["x: missing"])]


def test_the_running_jobs_that_use_a_dataset():
    rows = [JobRow("j1", "systemd", "running", {"n1": "running"}, data="imagenet"),
            JobRow("j0", "systemd", "running", {"n1": "running", "n2": "stopped"}, data="imagenet"),
            JobRow("j2", "systemd", "stopped", {"n1": "stopped"}, data="imagenet"),
            JobRow("j3", "systemd", "running", {"n1": "running"}, data="tiny"),
            JobRow("j4", "slurm", "running", {}, data="imagenet"),
            JobRow("j5", "slurm", "failed", {}, data="imagenet")]
    assert plan.users(rows, "imagenet") == ["j0", "j1", "j4"]
    assert plan.users(rows, "other") == []


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                     (1536 << 20, "1.5 GiB"), (3 << 40, "3.0 TiB"),
                                     (5 << 50, "5120.0 TiB")])
def test_human_sizes(n, text):
    assert plan.human(n) == text


def test_progress_lines():
    d = {"done": 512 << 20, "total": 1 << 30, "source": "gpu1", "t0": 100.0}
    assert view.progress_line("gpu2", d, 104.0) == \
        "gpu2: 512.0 MiB of 1.0 GiB from gpu1, 128.0 MiB/s, ETA 4 s"
    assert view.progress_line("gpu2", {**d, "done": 1 << 30}, 104.0).endswith(", done")
    assert view.progress_line("gpu2", {**d, "done": 0}, 104.0).endswith("0 B/s, ETA ?")
    assert view.progress_line("gpu1", {**d, "total": 0, "source": "example.org"}, 102.0) == \
        "gpu1: 512.0 MiB from example.org, 256.0 MiB/s"


def test_plain_progress_is_a_line_per_node_now_and_then_and_one_when_done():
    out = io.StringIO()   # not a terminal: lines, not bars
    with view.live_progress(out) as p:
        p.start("gpu2", 1000, plan.OPERATOR)
        for _ in range(50):
            p.add("gpu2", 10)
        p.set("gpu2", 1000, "received")
        p.set("gpu2", 1000, "received")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("gpu2: 0 B of 1000 B from this machine")
    assert lines[1].startswith("gpu2: 1000 B of 1000 B from this machine") and lines[1].endswith("done")
    assert p.nodes["gpu2"]["done"] == 1000
    p.set("gpu2", 10)                 # a late, smaller report never moves it back
    assert p.nodes["gpu2"]["done"] == 1000
    p.set("gpu2", 10, exact=True)     # a resume's recount does
    assert p.nodes["gpu2"]["done"] == 10


# ---- run.py without a node ------------------------------------------------------------------

@pytest.fixture
def fleet(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text(json.dumps({"hosts": [{"name": "n1", "connection": "local", "vars": {
        "data_dir": "/srv/some data", "service_user": "jobs"}}]}))
    with Fleet(inventory.load(inv)) as f:
        yield f


def test_an_op_is_a_fixed_command_line_and_its_request_travels_on_stdin(fleet):
    host = fleet.hosts[0]
    req = {"op": "download", "url": "https://u:hunter2@example.org/x", "authorization": "Bearer tok3n"}
    cmd = run.command(host, "download")
    assert cmd == ("cd / && runuser -u jobs -- python3 -I -c "
                   f"'{run.BOOT}' torchrig-data download")
    first = run.head(host, req)
    length, body = first.split(b"\n", 1)
    assert int(length) == len(body) and body.startswith(run.SCRIPT.read_bytes())
    b64 = re.search(rb'b64decode\("([^"]+)"\)', body).group(1)
    assert json.loads(base64.b64decode(b64)) == {**req, "data_dir": "/srv/some data"}


def test_the_wheel_cache_is_roots_own_store(fleet):
    """provision's wheel cache: node.py as root (no runuser), in var wheel_cache_dir, made."""
    from torchrig.provision.wheelshare import CACHE
    host = fleet.hosts[0]
    assert run.command(host, "ls", CACHE) == f"cd / && python3 -I -c '{run.BOOT}' torchrig-data ls"
    b64 = re.search(rb'b64decode\("([^"]+)"\)', run.head(host, {"op": "ls"}, CACHE)).group(1)
    assert json.loads(base64.b64decode(b64)) == {"op": "ls", "data_dir": "/var/lib/torchrig/wheels",
                                                 "make": True}


def test_the_json_lines_of_an_op_arrive_in_any_pieces():
    seen = []
    lines = run.Lines(seen.append)
    for piece in (b'{"bytes": 1', b'0}\n{"done": "x"}\nnot json\n', b'{"recei', b'ved": 3}\n', b'{"half'):
        lines(piece)
    assert lines.lines == seen == [{"bytes": 10}, {"done": "x"}, {"received": 3}]
    assert run.last(lines.lines, "done") == {"done": "x"} and run.last(lines.lines, "port") == {}


@pytest.mark.parametrize("url, why", [
    ("ftp://user:hunter2@example.org/x", "not an http:// or https:// URL"),
    ("user:hunter2@example.org/x", "not an http:// or https:// URL"),
    ("https://user:hunter2@/x", "not an http:// or https:// URL"),
    ("https://user:hunter2@example.org:99999/x", "the URL's port: Port out of range"),
    ("https://user:hunter2@example.org:x/y", "the URL's port"),
    ("https://user:hunter2@example.org/", "give one with --file NAME"),
    ("https://user:hunter2@example.org/..", "give one with --file NAME"),
    ("https://user:hunter2@example.org/.hidden", "give one with --file NAME"),
])
def test_a_pull_refuses_a_bad_url_without_showing_its_credentials(fleet, url, why):
    with pytest.raises(TorchrigError, match=re.escape(why)) as e:
        run.pull(fleet, url, "ds", None, None, 0, log=print)
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize("name, ok", [("train.tar.gz", True), ("_x", True), ("a+b-c.1", True),
                                      (".hidden", False), ("..", False), ("a/b", False),
                                      ("a b", False), ("x" * 256, False), ("", False)])
def test_a_pulled_files_name(name, ok):
    assert bool(plan.SAFE_FILE.fullmatch(name)) is ok
