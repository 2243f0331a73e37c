"""onhost/data/node.py for real on `connection: local` nodes (each its own data folder in
tmp_path; the service user is this user): every op goes through run.call, so the command line
and the stdin framing are the operator's own (runuser, BOOT, the script and its request, then
the byte stream). The manifests use a small chunk (a manifest carries its chunk size; the node
resumes by it), so resuming is tested with files of a few hundred KiB. The testbed test
(tests/integration/test_data.py) adds SSH, real nodes, a firewall and a cut connection."""

import base64
import getpass
import hashlib
import json
import os
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from _fixtures import tcp_server
from torchrig import inventory
from torchrig.datasets import run
from torchrig.datasets.manifest import Manifest, build, scan
from torchrig.errors import TorchrigError
from torchrig.session import Fleet

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the node side runs through runuser")

CH = 64 << 10
SECRET = "hunter2-s3cret"


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture(autouse=True)
def system_python(tmp_path_factory, monkeypatch):
    """A node's `python3` is the system's: where this machine's is a slower wrapper (a pyenv
    shim, ~0.25 s a start), the node side runs /usr/bin/python3, as on a node."""
    if os.path.exists("/usr/bin/python3"):
        bin_ = tmp_path_factory.mktemp("bin")
        (bin_ / "python3").symlink_to("/usr/bin/python3")
        monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")


@pytest.fixture
def nodes(tmp_path):
    """n1, n2, n3 on this machine at 127.0.0.1; n4 at 127.0.0.2 (a node-to-node transfer to
    it arrives from 127.0.0.1: another address than the one its source may serve)."""
    hosts = []
    for name, address in (("n1", "127.0.0.1"), ("n2", "127.0.0.1"), ("n3", "127.0.0.1"),
                          ("n4", "127.0.0.2")):
        (tmp_path / name).mkdir()
        hosts.append({"name": name, "connection": "local", "address": address, "vars": {
            "data_dir": str(tmp_path / name), "service_user": getpass.getuser()}})
    (tmp_path / "inv.yml").write_text(json.dumps({"hosts": hosts}))
    with Fleet(inventory.load(tmp_path / "inv.yml")) as fleet:
        yield fleet


def host(fleet, name):
    return next(h for h in fleet.inv.hosts if h.name == name)


def data_dir(fleet, name) -> Path:
    return Path(host(fleet, name).settings.data_dir)


def op(fleet, name, request, feed=None) -> list[dict]:
    return run.call(fleet, host(fleet, name), request, feed=feed)


def dataset(tmp_path, files: dict[str, bytes], where="src") -> tuple[Manifest, dict]:
    root = tmp_path / where
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return scan(root, CH)


def stream(fleet, m: Manifest, local: dict, todo: list[dict], upto: int | None = None) -> Iterator[bytes]:
    """The bytes an upload sends for `todo` (the operator's own generator), cut after `upto`."""
    push = run._Push(fleet, m, local, "ds", 0, lambda t: None, run.Progress())
    push.progress.start("n1", 0, "")
    sent = 0
    for b in push._bytes(host(fleet, "n1"), todo):
        if upto is not None and sent + len(b) >= upto:
            yield b[:upto - sent]
            return
        sent += len(b)
        yield b


def receive(fleet, name, m, local, upto=None) -> list[dict]:
    todo = op(fleet, name, {"op": "state", "name": "ds", "manifest": m.doc})[-1]["todo"]
    return op(fleet, name, {"op": "recv", "sends": todo, "chunk": m.doc["chunk"]},
              feed=stream(fleet, m, local, todo, upto))


def commit(fleet, name, m, ds="ds") -> dict:
    return op(fleet, name, {"op": "commit", "name": ds, "manifest": m.doc, "sha256": m.sha256})[-1]


def ls(fleet, name, ds=None, full=False) -> list[dict]:
    return op(fleet, name, {"op": "ls", "name": ds, "full": full})[-1]["datasets"]


def snapshot(root: Path) -> dict:
    """Every path under root with what a write would change."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            out[os.path.relpath(os.path.join(d, n), root)] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
    return out


FILES = {"big.bin": os.urandom(CH * 5 + CH // 2), "sub/a.txt": b"alpha\n", "sub/b.txt": b"alpha\n",
         "empty": b""}


# ---- receive and commit ----------------------------------------------------------------------

def test_recv_then_commit_then_ls(nodes, tmp_path):
    m, local = dataset(tmp_path, FILES)
    st = op(nodes, "n1", {"op": "state", "name": "ds", "manifest": m.doc})[-1]
    assert st["have"] == [] and st["current"] is None
    assert sorted(t["sha256"] for t in st["todo"]) == sorted(m.objects()) and all(t["offset"] == 0 for t in st["todo"])
    lines = receive(nodes, "n1", m, local)
    assert sorted(o["done"] for o in lines if "done" in o) == sorted(m.objects())
    assert lines[-1] == {"received": m.size - len(FILES["sub/b.txt"])}  # one object per content
    assert op(nodes, "n1", {"op": "state", "name": "ds", "manifest": m.doc})[-1]["todo"] == []
    res = commit(nodes, "n1", m)
    assert res["switched"] and res["version"] == m.sha256[:16] and res["replaced"] is None
    d = data_dir(nodes, "n1")
    assert os.readlink(d / "ds") == f".torchrig/sets/ds/{m.sha256[:16]}"
    for rel, data in FILES.items():
        assert (d / "ds" / rel).read_bytes() == data
        obj = d / ".torchrig/objects" / sha(data)
        assert (d / "ds" / rel).stat().st_ino == obj.stat().st_ino   # a hard link, not a copy
        assert obj.stat().st_mode & 0o777 == 0o444
    assert os.listdir(d / ".torchrig/incoming") == []
    [one] = ls(nodes, "n1")
    assert (one["name"], one["sha256"], one["files"], one["bytes"], one["problems"]) == \
        ("ds", m.sha256, 4, m.size, [])
    assert ls(nodes, "n1", full=True)[0]["problems"] == []
    assert commit(nodes, "n1", m) == {"switched": False, "version": m.sha256[:16]}  # nothing to do


def test_commit_refuses_while_a_file_is_missing(nodes, tmp_path):
    m, _ = dataset(tmp_path, FILES)
    with pytest.raises(TorchrigError, match=r"n1: data commit: not every file is here and verified \(4 missing, e\.g\. big\.bin\)"):
        commit(nodes, "n1", m)
    assert not os.path.lexists(data_dir(nodes, "n1") / "ds")


def test_received_bytes_that_are_not_the_files_are_refused(nodes, tmp_path):
    m, local = dataset(tmp_path, {"f": b"x" * 1000})
    todo = [{"sha256": sha(b"x" * 1000), "size": 1000, "offset": 0}]
    lines = op(nodes, "n1", {"op": "recv", "sends": todo, "chunk": CH}, feed=iter([b"y" * 1000]))
    assert lines[0]["bad"] == sha(b"x" * 1000) and "sha256 of the received bytes" in lines[0]["why"]
    d = data_dir(nodes, "n1") / ".torchrig"
    assert os.listdir(d / "objects") == [] and os.listdir(d / "incoming") == []


# ---- what the node refuses before it writes anything ----------------------------------------------

EMPTY = sha(b"")


BAD_PATHS = [
    (["../x"], "not a plain relative path inside the dataset"),
    (["a/../../x"], "not a plain relative path inside the dataset"),
    (["{tmp}/escaped"], "not a plain relative path inside the dataset"),   # absolute
    (["a//x"], "not a plain relative path"),
    (["./x"], "not a plain relative path"),
    (["x/"], "not a plain relative path"),
    ([""], "not a plain relative path"),
    (["a\0b"], "not a plain relative path"),
    ([".torchrig-manifest.json"], "not a plain relative path"),
    (["x", "x"], "names 'x' twice"),
    (["a", "a/b"], "'a' is both a file and a folder"),
]


def test_a_manifest_path_outside_the_dataset_is_refused_before_anything_is_written(nodes, tmp_path):
    def bad(paths):
        return build([{"path": p.format(tmp=tmp_path), "size": 0, "sha256": EMPTY, "chunks": []}
                      for p in paths], CH)
    d = data_dir(nodes, "n1")
    with pytest.raises(TorchrigError, match="n1: data state: the manifest's path '../x' is not a plain"):
        op(nodes, "n1", {"op": "state", "name": "ds", "manifest": bad(["../x"]).doc})
    assert os.listdir(d) == []   # not even the store's own folders
    # with the object there, a commit would link it wherever the path says: refused first
    receive(nodes, "n1", *dataset(tmp_path, {"e": b""}, "empty"))
    before = snapshot(tmp_path)
    for paths, why in BAD_PATHS:   # every op that takes a manifest checks it the same way
        with pytest.raises(TorchrigError, match=f"n1: data commit: .*{why}"):
            commit(nodes, "n1", bad(paths))
        assert snapshot(tmp_path) == before, paths
    assert not (tmp_path / "escaped").exists() and not os.path.lexists(d / "ds")


@pytest.mark.parametrize("request_, why", [
    ({"op": "state", "name": "../x", "manifest": {"chunk": CH, "files": []}}, "is not a dataset name"),
    ({"op": "recv", "sends": [{"sha256": "../../x", "size": 1, "offset": 0}], "chunk": CH}, "is not an object"),
    ({"op": "recv", "sends": [{"sha256": EMPTY, "size": 1, "offset": 2}], "chunk": CH}, "is not an object"),
    ({"op": "recv", "sends": [], "chunk": 0}, "chunk 0 is not a size"),
    ({"op": "serve", "objects": ["../../etc/passwd"], "bind": "127.0.0.1", "token": "t", "peers": []},
     "is not a sha256"),
    ({"op": "state", "name": "ds", "manifest": {"chunk": 0, "files": []}}, "the manifest is not one"),
])
def test_other_requests_naming_something_outside_the_store_are_refused(nodes, request_, why):
    with pytest.raises(TorchrigError, match=why):
        op(nodes, "n1", request_)
    assert os.listdir(data_dir(nodes, "n1")) == []


# ---- a cut transfer resumes at whole, verified chunks --------------------------------------------

def test_a_cut_recv_keeps_what_arrived_and_resumes_at_whole_verified_chunks(nodes, tmp_path):
    m, local = dataset(tmp_path, {"big.bin": FILES["big.bin"]})
    cut_at = 2 * CH + CH // 3
    lines = receive(nodes, "n1", m, local, upto=cut_at)
    obj = sha(FILES["big.bin"])
    assert lines == [{"cut": obj, "at": cut_at, "from": "the operator"}, {"received": cut_at}]
    part = data_dir(nodes, "n1") / ".torchrig/incoming" / f"{obj}.part"
    assert part.read_bytes() == FILES["big.bin"][:cut_at]   # what arrived stays
    st = op(nodes, "n1", {"op": "state", "name": "ds", "manifest": m.doc})[-1]
    assert st["todo"] == [{"sha256": obj, "size": len(FILES["big.bin"]), "offset": 2 * CH}]
    lines = receive(nodes, "n1", m, local)   # from the offset the node gave
    assert lines == [{"done": obj}, {"received": len(FILES["big.bin"]) - 2 * CH}]
    assert commit(nodes, "n1", m)["switched"]
    assert (data_dir(nodes, "n1") / "ds/big.bin").read_bytes() == FILES["big.bin"]


def test_a_corrupted_chunk_of_a_partial_file_is_not_kept(nodes, tmp_path):
    m, local = dataset(tmp_path, {"big.bin": FILES["big.bin"]})
    obj = sha(FILES["big.bin"])
    receive(nodes, "n1", m, local, upto=4 * CH + 10)
    part = data_dir(nodes, "n1") / ".torchrig/incoming" / f"{obj}.part"

    def offset():
        return op(nodes, "n1", {"op": "state", "name": "ds", "manifest": m.doc})[-1]["todo"][0]["offset"]
    assert offset() == 4 * CH
    with open(part, "r+b") as f:   # one byte of the second chunk flipped on the disk
        f.seek(CH + 7)
        b = f.read(1)
        f.seek(CH + 7)
        f.write(bytes([b[0] ^ 1]))
    assert offset() == CH            # the chunks after the bad one are not trusted either
    part.write_bytes(b"\0" + FILES["big.bin"][1:3 * CH])
    assert offset() == 0
    assert receive(nodes, "n1", m, local) == [{"done": obj}, {"received": len(FILES["big.bin"])}]
    assert (data_dir(nodes, "n1") / ".torchrig/objects" / obj).read_bytes() == FILES["big.bin"]


# ---- versions: the switch, what is dropped, rm --------------------------------------------------

def test_a_new_version_switches_the_link_and_drops_only_what_nothing_else_uses(nodes, tmp_path):
    shared, old_only, new_only, other = b"shared" * 100, b"only in v1", b"only in v2", b"other's"
    v1, l1 = dataset(tmp_path, {"s": shared, "o": old_only}, "v1")
    v2, l2 = dataset(tmp_path, {"s": shared, "n": new_only}, "v2")
    o, lo = dataset(tmp_path, {"z": old_only, "y": other}, "o")
    d = data_dir(nodes, "n1")
    for m, local, name in ((v1, l1, "ds"), (o, lo, "other")):
        receive(nodes, "n1", m, local)
        assert commit(nodes, "n1", m, name)["switched"]
    held = open(d / "ds/o", "rb")   # a job reading the old version while it is replaced
    try:
        receive(nodes, "n1", v2, l2)
        res = commit(nodes, "n1", v2)
        assert res == {"switched": True, "version": v2.sha256[:16], "replaced": v1.sha256[:16],
                       "objects_dropped": 0}   # old_only is still the other dataset's
        assert held.read() == old_only
    finally:
        held.close()
    assert os.readlink(d / "ds") == f".torchrig/sets/ds/{v2.sha256[:16]}"
    assert os.listdir(d / ".torchrig/sets/ds") == [v2.sha256[:16]]
    assert sorted(os.listdir(d / ".torchrig/objects")) == sorted({sha(shared), sha(old_only), sha(new_only), sha(other)})
    assert sorted(p for p in os.listdir(d) if p != ".torchrig") == ["ds", "other"]  # no temporary link left
    # the other dataset goes: now old_only is nobody's, shared and new_only stay v2's
    assert op(nodes, "n1", {"op": "rm", "name": "other"})[-1] == {"removed": True, "objects_dropped": 2}
    assert sorted(os.listdir(d / ".torchrig/objects")) == sorted({sha(shared), sha(new_only)})
    assert not os.path.lexists(d / "other") and not os.path.lexists(d / ".torchrig/sets/other")
    assert [s["name"] for s in ls(nodes, "n1")] == ["ds"] and ls(nodes, "n1")[0]["problems"] == []
    assert op(nodes, "n1", {"op": "rm", "name": "other"})[-1] == {"removed": False}
    assert op(nodes, "n1", {"op": "rm", "name": "ds"})[-1] == {"removed": True, "objects_dropped": 2}
    assert os.listdir(d / ".torchrig/objects") == [] and os.listdir(d / ".torchrig/sets") == []
    assert json.loads((d / ".torchrig/objects.json").read_text()) == {}


def test_a_version_changed_by_hand_is_found_and_a_push_repairs_it(nodes, tmp_path):
    files = {"a": b"a" * 1000, "sub/b": b"b" * 1000, "sub/c": b"c" * 1000, "d": b"d" * 1000, "e": b"e" * 10}
    m, local = dataset(tmp_path, files)
    receive(nodes, "n1", m, local)
    commit(nodes, "n1", m)
    d = data_dir(nodes, "n1") / "ds"
    with open(d / "a", "ab") as f:                 # grown
        f.write(b"!")
    st = os.stat(d / "sub/b")                      # the same size and mtime: only a hash sees it
    with open(d / "sub/b", "r+b") as f:
        f.write(b"B")
    os.utime(d / "sub/b", ns=(st.st_atime_ns, st.st_mtime_ns))
    (d / "sub/c").unlink()
    (d / "d").rename(tmp_path / "d")               # replaced: same bytes, another file
    (d / "d").write_bytes(b"d" * 1000)
    (d / "e").unlink()
    (d / "e").symlink_to(tmp_path / "src/e")       # the right bytes, behind a link
    quick = ls(nodes, "n1")[0]["problems"]
    assert quick == ["a: 1001 bytes, the manifest says 1000", "d: changed since it was pushed (modified or replaced)",
                     "e: a symlink, or not a folder on its way (not followed)", "sub/c: missing"]
    full = ls(nodes, "n1", full=True)[0]["problems"]
    assert f"sub/b: sha256 {sha(b'B' + b'b' * 999)[:16]}... differs from the manifest's {sha(files['sub/b'])[:16]}..." in full
    assert len(full) == 4 and not any(p.startswith("d:") for p in full)  # full: the bytes only
    with pytest.raises(TorchrigError, match=r"dataset ds is not the same on every node: n1: a: 1001 bytes"):
        run.check(nodes, "ds", hosts=[host(nodes, "n1")])
    # a push: the objects changed with their links are sent again, and the version rebuilt
    assert receive(nodes, "n1", m, local)[-1] == {"received": 2000}   # a and sub/b
    res = commit(nodes, "n1", m)
    assert res["switched"] and res["replaced"] == res["version"] == m.sha256[:16]
    assert ls(nodes, "n1", full=True)[0]["problems"] == []
    assert {rel: (d / rel).read_bytes() for rel in files} == files
    assert os.listdir(data_dir(nodes, "n1") / ".torchrig/sets/ds") == [m.sha256[:16]]  # nothing set aside left


def test_ls_neither_follows_nor_lists_what_a_user_put_in_the_data_folder(nodes, tmp_path):
    m, local = dataset(tmp_path, {"sub/x": b"x" * 100, "y": b"y"})
    receive(nodes, "n1", m, local)
    commit(nodes, "n1", m)
    d = data_dir(nodes, "n1")
    (d / "elsewhere").symlink_to("/etc")
    (d / "fake").symlink_to(tmp_path / "src")            # looks like a dataset's folder
    (d / "handmade").mkdir()
    (d / ".torchrig/sets/ghost").symlink_to(tmp_path)
    assert [s["name"] for s in ls(nodes, "n1")] == ["ds"]
    for name, why in (("elsewhere", "points at '/etc', not at a torchrig dataset"),
                      ("handmade", "exists and is not a torchrig dataset")):
        with pytest.raises(TorchrigError, match=why):
            ls(nodes, "n1", name)
    # a folder of the version swapped for a link to the very same bytes: not followed
    version = d / ".torchrig/sets/ds" / m.sha256[:16]
    (version / "sub").rename(tmp_path / "moved")
    (version / "sub").symlink_to(tmp_path / "moved")
    assert ls(nodes, "n1", "ds", full=True)[0]["problems"] == \
        ["sub/x: a symlink, or not a folder on its way (not followed)"]


def test_a_link_in_place_of_a_datasets_versions_is_not_written_through(nodes, tmp_path):
    m, local = dataset(tmp_path, {"x": b"x"})
    receive(nodes, "n1", m, local)
    d = data_dir(nodes, "n1")
    (tmp_path / "victim").mkdir()
    (d / ".torchrig/sets/ds").symlink_to(tmp_path / "victim")
    with pytest.raises(TorchrigError, match=r"sets/ds is not a folder; move it away"):
        commit(nodes, "n1", m)
    assert os.listdir(tmp_path / "victim") == [] and not os.path.lexists(d / "ds")


# ---- node to node ------------------------------------------------------------------------------

@contextmanager
def serving(fleet, name, objects, peers, token):
    """The node's serve op, running until the block ends (its stdin closes); yields its port."""
    ready, end, lines = threading.Event(), threading.Event(), []

    def feed():
        end.wait()
        yield b""

    def serve():
        try:
            run.call(fleet, host(fleet, name), {"op": "serve", "bind": "127.0.0.1", "token": token,
                                                "peers": peers, "objects": objects, "bwlimit": 0},
                     feed=feed(), on_line=lambda o: (lines.append(o), ready.set()), timeout=60)
        finally:
            ready.set()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        assert ready.wait(30) and "port" in lines[0], lines
        yield lines[0]["port"]
    finally:
        end.set()
        t.join(30)


def test_a_node_serves_only_its_peer_with_the_token(nodes, tmp_path):
    m, local = dataset(tmp_path, {"big.bin": FILES["big.bin"]})
    receive(nodes, "n1", m, local)
    todo = op(nodes, "n2", {"op": "state", "name": "ds", "manifest": m.doc})[-1]["todo"]

    def pull(port, token):
        return op(nodes, "n2", {"op": "pull", "peer": "127.0.0.1", "port": port, "token": token,
                                "sends": todo, "chunk": CH})
    with serving(nodes, "n1", sorted(m.objects()), ["127.0.0.2"], "t" * 64) as port:
        assert "closed the transfer" in pull(port, "t" * 64)[-1]["unreachable"]  # not from 127.0.0.1
    with serving(nodes, "n1", sorted(m.objects()), ["127.0.0.1"], "t" * 64) as port:
        assert "closed the transfer" in pull(port, "u" * 64)[-1]["unreachable"]  # a wrong token
        assert pull(port, "t" * 64)[-2:] == [{"done": sha(FILES["big.bin"])}, {"received": len(FILES["big.bin"])}]
    with serving(nodes, "n1", [sha(b"another")], ["127.0.0.1"], "t" * 64) as port:
        with pytest.raises(TorchrigError, match="not an object of this transfer"):
            pull(port, "t" * 64)
    assert commit(nodes, "n2", m)["switched"]


def test_a_push_sends_each_byte_once_from_here_then_node_to_node(nodes, tmp_path):
    src = tmp_path / "src"
    for rel, data in FILES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    three = Fleet(nodes.inv, [host(nodes, n) for n in ("n1", "n2", "n3")])
    res = run.push(three, src, "ds", 0, log=lambda t: None)
    m, _ = scan(src)
    assert res.sha256 == m.sha256 and res.files == 4 and res.fallbacks == []
    assert res.operator_bytes == m.size - len(FILES["sub/b.txt"])   # each object once
    assert [res.nodes[n]["from"] for n in ("n1", "n2", "n3")] == ["this machine", "n1", "n1"]
    assert all(res.nodes[n]["switched"] for n in ("n1", "n2", "n3"))
    assert run.check(three, "ds", full=True) == f"{data_dir(nodes, 'n1')}/ds"
    again = run.push(three, src, "ds", 0, log=lambda t: None)
    assert again.operator_bytes == 0 and not any(d["switched"] for d in again.nodes.values())


def test_a_node_its_source_may_not_serve_gets_the_bytes_from_here(nodes, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(FILES["big.bin"])
    pair = Fleet(nodes.inv, [host(nodes, "n1"), host(nodes, "n4")])
    log = []
    res = run.push(pair, src, "ds", 0, log=log.append)
    assert res.operator_bytes == 2 * len(FILES["big.bin"])
    assert len(res.fallbacks) == 1 and res.fallbacks[0].startswith("n4: 127.0.0.1 closed the transfer")
    assert any(line.startswith("n4: cannot get it from n1 (127.0.0.1 closed the transfer") for line in log)
    assert res.nodes["n4"]["from"] == "this machine"
    assert run.check(pair, "ds", full=True)


# ---- data.pull: one download on a node -----------------------------------------------------------

def http_server(body: bytes, *, length: int | None = None, reset: bool = False, auth: str | None = None,
                address="127.0.0.1"):
    """A real HTTP server on loopback: the body (announced as `length` bytes), then a close, or a
    reset (RST) when `reset`; 401 without the Basic `auth` when given. -> (its socket, the
    requests it saw)."""
    seen = []

    def handle(c):
        req = b""
        while b"\r\n\r\n" not in req:
            b = c.recv(65536)
            if not b:
                break
            req += b
        seen.append(req.decode(errors="replace"))
        if auth and f"authorization: basic {base64.b64encode(auth.encode()).decode()}".lower() \
                not in req.decode().lower():
            c.sendall(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            c.close()
            return
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                  % (len(body) if length is None else length) + body)
        if reset:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()

    return tcp_server(handle, address), seen


def download(fleet, url):
    return op(fleet, "n1", {"op": "download", "url": url, "authorization": None, "chunk": CH})


def no_download_left(fleet):
    d = data_dir(fleet, "n1") / ".torchrig"
    return os.listdir(d / "objects") == [] and os.listdir(d / "incoming") == []


@pytest.mark.parametrize("server, why", [
    ({"length": 100_000, "reset": True}, r"the download broke off after \d+ bytes \(Connection reset by peer\)"),
    ({"length": 100_000}, "the server closed the connection after 3000 of 100000 bytes"),
])
def test_a_download_cut_by_the_server_is_one_clear_error(nodes, server, why):
    srv, _ = http_server(b"z" * 3000, **server)
    try:
        with pytest.raises(TorchrigError, match=f"^n1: data download: {why}$") as e:
            download(nodes, f"http://user:{SECRET}@127.0.0.1:{srv.getsockname()[1]}/f")
    finally:
        srv.close()
    assert type(e.value) is TorchrigError and SECRET not in str(e.value) and "user" not in str(e.value)
    assert no_download_left(nodes)


def test_a_refused_connection_is_one_clear_error(nodes):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nothing listens there now
    with pytest.raises(TorchrigError, match=r"^n1: data download: cannot download it \(\[Errno 111\] Connection refused\)$") as e:
        download(nodes, f"http://user:{SECRET}@127.0.0.1:{port}/f")
    assert type(e.value) is TorchrigError and SECRET not in str(e.value)
    assert no_download_left(nodes)


def test_a_download_from_an_ipv6_address_with_a_port_and_credentials(nodes):
    try:
        srv, _ = http_server(b"six", auth=f"user:{SECRET}", address="::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        entry = download(nodes, f"http://user:{SECRET}@[::1]:{srv.getsockname()[1]}/f")[-1]["entry"]
    finally:
        srv.close()
    assert entry == {"size": 3, "sha256": sha(b"six"), "chunks": [sha(b"six")]}
    assert (data_dir(nodes, "n1") / ".torchrig/objects" / sha(b"six")).read_bytes() == b"six"


def test_a_pull_downloads_once_and_the_credentials_are_in_no_command_line(nodes):
    body = os.urandom(CH * 3)
    srv, seen = http_server(body, auth=f"user:{SECRET}")
    pair = Fleet(nodes.inv, [host(nodes, "n1"), host(nodes, "n2")])
    commands = []
    for h in pair.hosts:   # what each node runs, as its process list would show it
        cxn = pair.conn(h)
        real = cxn.stream
        cxn.stream = lambda command, *a, real=real, **kw: (commands.append(command), real(command, *a, **kw))[1]
    log = []
    try:
        res = run.pull(pair, f"http://user:{SECRET}@127.0.0.1:{srv.getsockname()[1]}/train.bin",
                       "ds", None, None, 0, log=log.append)
    finally:
        srv.close()
    assert len(seen) == 1 and res.nodes["n2"]["from"] == "n1"   # downloaded once, then relayed
    assert (data_dir(nodes, "n2") / "ds/train.bin").read_bytes() == body
    assert any(c.endswith("torchrig-data download") for c in commands)
    assert not any(SECRET in c or "user:" in c for c in commands + log)
    assert SECRET not in json.dumps(res.as_dict())


# ---- root's store: provision's wheel cache ---------------------------------------------------

def test_roots_store_is_made_root_only_and_adopts_what_was_downloaded_into_it(nodes, tmp_path):
    """The wheel cache (wheelshare.CACHE): node.py as root (no runuser) in a 0700 folder it
    makes; `adopt` takes the files a download left in .torchrig/download into the store; then
    the fan-out sends them node to node into the others' root-only stores."""
    cache = run.Where(lambda h: str(tmp_path / "cache" / h.name), make=True)
    three = [host(nodes, n) for n in ("n1", "n2", "n3")]
    for h in three:
        assert run.call(nodes, h, {"op": "ls"}, where=cache)[-1] == {"datasets": []}
        st = os.lstat(tmp_path / "cache" / h.name)
        assert st.st_uid == 0 and st.st_mode & 0o777 == 0o700
    # the folder it made above the cache stays open to others (/var/lib/torchrig holds the
    # service user's metrics folder too): a 0750 parent hid it from node_exporter and the jobs
    assert os.lstat(tmp_path / "cache").st_mode & 0o777 == 0o755
    dl = tmp_path / "cache" / "n1" / ".torchrig" / "download"
    dl.mkdir()
    wheels = {"a-1.0-py3-none-any.whl": os.urandom(CH * 2 + 5), "b-2.0-py3-none-any.whl": b"bee"}
    for n, data in wheels.items():
        (dl / n).write_bytes(data)
    entries = run.call(nodes, three[0], {"op": "adopt", "chunk": CH}, where=cache)[-1]["entries"]
    assert [(e["path"], e["sha256"], e["size"]) for e in entries] == \
        [(n, sha(d), len(d)) for n, d in sorted(wheels.items())]
    assert not dl.exists() and len(entries[0]["chunks"]) == 3
    m = build(entries, CH)
    assert run.call(nodes, three[0], {"op": "commit", "name": "pip-x", "manifest": m.doc,
                                      "sha256": m.sha256}, where=cache)[-1]["switched"]
    p = run._Push(nodes, m, {}, "pip-x", 0, lambda t: None, run.Progress(), hosts=three,
                  where=cache)
    p.from_here = False
    res = run._distribute(p, None)
    assert res.fallbacks == [] and res.operator_bytes == 0
    for h in ("n2", "n3"):
        got = tmp_path / "cache" / h / "pip-x"
        assert {f.name: f.read_bytes() for f in got.iterdir() if f.suffix == ".whl"} == wheels
        assert (tmp_path / "cache" / h / "pip-x").resolve().stat().st_uid == 0
    listed = run.call(nodes, three[2], {"op": "ls", "name": "pip-x", "manifests": True},
                      where=cache)[-1]["datasets"][0]
    assert listed["problems"] == [] and listed["manifest"] == m.doc


def test_roots_store_open_to_others_is_refused(nodes, tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o770)
    os.chmod(folder, 0o770)
    cache = run.Where(lambda h: str(folder), make=True)
    with pytest.raises(TorchrigError, match="open to other users .*mode 770.* root's alone"):
        run.call(nodes, host(nodes, "n1"), {"op": "ls"}, where=cache)


def test_a_file_left_in_download_that_is_not_a_plain_file_is_refused(nodes, tmp_path):
    cache = run.Where(lambda h: str(tmp_path / "c"), make=True)
    run.call(nodes, host(nodes, "n1"), {"op": "ls"}, where=cache)
    dl = tmp_path / "c" / ".torchrig" / "download"
    dl.mkdir()
    (dl / "x-1.0-py3-none-any.whl").symlink_to("/etc/shadow")
    with pytest.raises(TorchrigError, match="x-1.0-py3-none-any.whl"):
        run.call(nodes, host(nodes, "n1"), {"op": "adopt", "chunk": CH}, where=cache)
    assert not any((tmp_path / "c" / ".torchrig" / "objects").iterdir())


def test_a_node_its_source_cannot_serve_fails_the_fan_out_when_here_has_no_copy(nodes, tmp_path):
    m, local = dataset(tmp_path, {"w-1-py3-none-any.whl": b"x" * 1000})
    receive(nodes, "n1", m, local)
    p = run._Push(nodes, m, {}, "ds", 0, lambda t: None, run.Progress(),
                  hosts=[host(nodes, "n1"), host(nodes, "n4")])
    p.from_here = False
    with pytest.raises(TorchrigError, match="n4: cannot get it from n1 .*closed the transfer"):
        run._distribute(p, None)
