"""`torchrig data push|ls|rm`: datasets in every node's data folder, the same bytes everywhere.

Every read and write on a node goes through onhost/data/node.py as the service user (see
there for the layout and the ops). Here: the manifest (hashed once on this machine), each
node's state, the transfers (this machine to the seed node over SSH; then node to node over
the cluster network, each pair with its own one-time token; straight from here where a pair
cannot connect), a cut upload resumed from what arrived, and the switch on every node only
when every node holds every file, verified."""

from __future__ import annotations

import base64
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import paramiko

from ..connections import ConnectionLost
from ..errors import TorchrigError
from ..inventory import Host, resolve
from ..onhost import HERE as ONHOST
from ..quoting import sh
from ..session import CannotConnect, Fleet, describe_error
from . import plan
from .manifest import CHUNK, Manifest, build, check_name, dataset_path, scan

SCRIPT = ONHOST / "data" / "node.py"
# what `python3 -I -c` runs: the script (a length line, then its text) from stdin, so the rest
# of stdin is the op's byte stream; nothing of the request is in a command line
BOOT = "import sys;b=sys.stdin.buffer;exec(b.read(int(b.readline())))"
RETRIES = 5
DROPS = (ConnectionLost, CannotConnect, paramiko.SSHException, EOFError, socket.error)
IO = 1 << 20


@dataclass(frozen=True)
class Where:
    """Whose store node.py works in on a host: a folder of the service user's (`runuser` to
    that user: the data folder), or a root-only one (`user` None: provision's wheel cache,
    which root reads and so no job may write)."""
    folder: Callable[[Host], str]
    user: Callable[[Host], str | None] = lambda h: None
    make: bool = False     # create the folder (0700) when missing: a root-only one only


DATA = Where(lambda h: h.settings.data_dir, lambda h: h.settings.service_user)


def command(host: Host, op: str, where: Where = DATA) -> str:
    user = where.user(host)
    run_as = ("runuser", "-u", user, "--") if user else ()
    return "cd / && " + sh(*run_as, "python3", "-I", "-c", BOOT, "torchrig-data", op)


def head(host: Host, request: dict, where: Where = DATA) -> bytes:
    req = {**request, "data_dir": where.folder(host), **({"make": True} if where.make else {})}
    b64 = base64.b64encode(json.dumps(req).encode()).decode()
    body = (SCRIPT.read_text() + f'\nimport base64\nmain(json.loads(base64.b64decode("{b64}")))\n').encode()
    return f"{len(body)}\n".encode() + body


class Ended(TorchrigError):
    """A node op ended without its reply and without a refusal of its own (killed, or its
    session went away): for a transfer, a cut to resume from."""


class Lines:
    """A node op's stdout as JSON lines, each handed to `on_line` as it arrives."""

    def __init__(self, on_line: Callable[[dict], None] | None = None):
        self.buf, self.lines, self.on_line = bytearray(), [], on_line

    def __call__(self, chunk: bytes) -> None:
        self.buf.extend(chunk)
        while (i := self.buf.find(b"\n")) >= 0:
            raw, self.buf = bytes(self.buf[:i]), self.buf[i + 1:]
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            self.lines.append(obj)
            if self.on_line:
                self.on_line(obj)


def call(fleet: Fleet, host: Host, request: dict, feed: Iterator[bytes] | None = None,
         on_line: Callable[[dict], None] | None = None, timeout: float | None = 600,
         where: Where = DATA) -> list[dict]:
    """One op on `host` in the store `where` names; its JSON lines. A refusal (exit 3,
    `error:` line) is a TorchrigError naming the host; a lost connection raises one of DROPS."""
    lines, err = Lines(on_line), bytearray()
    first = head(host, request, where)
    data = first if feed is None else _chain(first, feed)
    rc = fleet.conn(host).stream(command(host, request["op"], where), data, lines, err.extend,
                                 root=True, timeout=timeout)
    if rc != 0:
        text = err.decode(errors="replace").strip().splitlines()
        msg = next((ln[len("error: "):] for ln in reversed(text) if ln.startswith("error: ")),
                   text[-1] if text else f"exit {rc}")
        raise (TorchrigError if rc == 3 else Ended)(f"{host.name}: data {request['op']}: {msg}")
    return lines.lines


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def last(lines: list[dict], key: str) -> dict:
    return next((o for o in reversed(lines) if key in o), {})


# ---- progress ------------------------------------------------------------------------------

class Progress:
    """Bytes per node: done, total, source. `show` renders (the CLI's live view or lines)."""

    def __init__(self, show: Callable[[str, dict], None] | None = None):
        self.nodes: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.show = show or (lambda host, d: None)

    def start(self, host: str, total: int, source: str) -> None:
        with self.lock:
            self.nodes[host] = {"done": 0, "total": total, "source": source or "this machine",
                                "t0": time.monotonic(), "state": "receiving"}
        self.show(host, self.nodes[host])

    def add(self, host: str, n: int) -> None:
        with self.lock:
            self.nodes[host]["done"] += n
        self.show(host, self.nodes[host])

    def set(self, host: str, done: int, state: str | None = None, exact: bool = False) -> None:
        with self.lock:
            d = self.nodes[host]
            d["done"] = done if exact else max(d["done"], done)
            if state:
                d["state"] = state
        self.show(host, d)


# ---- push ------------------------------------------------------------------------------------

@dataclass
class PushResult:
    name: str
    sha256: str
    files: int
    bytes: int
    operator_bytes: int = 0        # what this machine sent (the seed, and any fallback)
    nodes: dict[str, dict] = field(default_factory=dict)  # host -> from, bytes, seconds, switched
    fallbacks: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class _Push:
    def __init__(self, fleet: Fleet, manifest: Manifest, local: dict[str, Path], name: str,
                 bwlimit: int, log: Callable[[str], None], progress: Progress,
                 hosts: list[Host] | None = None, where: Where = DATA):
        self.fleet, self.m, self.local, self.name = fleet, manifest, local, name
        self.hosts, self.where = list(fleet.hosts if hosts is None else hosts), where
        self.bwlimit, self.log, self.progress = bwlimit, log, progress
        self.res = PushResult(name, manifest.sha256, len(manifest.files), manifest.size)
        self.sent_lock = threading.Lock()
        self.download: dict | None = None  # data.pull: the request a node downloads with
        self.from_here = True   # a node its source cannot serve gets the bytes from here

    def call(self, host: Host, request: dict, **kw) -> list[dict]:
        return call(self.fleet, host, request, where=self.where, **kw)

    def state(self, host: Host) -> dict:
        return last(self.call(host, {"op": "state", "name": self.name, "manifest": self.m.doc}),
                    "todo")

    # this machine -> a node, over SSH, resumed after a drop
    def upload(self, host: Host, todo: list[dict]) -> None:
        total = sum(t["size"] - t["offset"] for t in todo)
        self.progress.start(host.name, total, plan.OPERATOR)
        t0, stalls, resumed = time.monotonic(), 0, []
        while todo:
            before = self.progress.nodes[host.name]["done"]
            lines, why = [], ""
            try:
                lines = self.call(host, {"op": "recv", "sends": todo, "chunk": self.m.doc["chunk"]},
                                  feed=self._bytes(host, todo), timeout=None)
            except Ended as e:
                why = "the node's side ended" if "exit -1" in str(e) else str(e).split(": ", 2)[-1]
            except DROPS as e:
                why = describe_error(e) or type(e).__name__
            bad = [o for o in lines if "bad" in o]
            if bad:
                raise TorchrigError(f"{host.name}: {bad[0]['why']} (a file changed on this machine "
                                    "since it was hashed? run data push again)")
            got = {o["done"] for o in lines if "done" in o}
            todo = [t for t in todo if t["sha256"] not in got]
            if not todo:
                break
            stalls = 0 if self.progress.nodes[host.name]["done"] > before else stalls + 1
            if stalls > RETRIES:
                raise TorchrigError(f"{host.name}: gave up after {RETRIES} tries in a row without "
                                    f"progress ({why or 'the transfer ended early'}); run data "
                                    "push again to resume")
            self.log(f"{host.name}: transfer cut ({why or 'ended early'}); resuming with a fresh "
                     "connection from what arrived")
            self.fleet.drop(host)
            time.sleep(min(0.5 * 2 ** stalls, 5))
            todo = self.state(host)["todo"]  # where each partial file resumes, checked there
            self.progress.set(host.name, total - sum(t["size"] - t["offset"] for t in todo),
                              exact=True)
            resumed.append(sum(t["offset"] for t in todo))
        self.res.nodes[host.name] = {"from": "this machine", "resumed_at": resumed,
                                     "seconds": round(time.monotonic() - t0, 2)}

    def _bytes(self, host: Host, todo: list[dict]) -> Iterator[bytes]:
        t0, sent = time.monotonic(), 0
        for t in todo:
            path = self.local[t["sha256"]]
            with open(path, "rb") as f:
                f.seek(t["offset"])
                left = t["size"] - t["offset"]
                while left:
                    b = f.read(min(IO, left, max(self.bwlimit // 4, 4096) if self.bwlimit else IO))
                    if not b:
                        raise TorchrigError(f"{path} is shorter than when it was hashed; run data "
                                            "push again")
                    left -= len(b)
                    sent += len(b)
                    with self.sent_lock:
                        self.res.operator_bytes += len(b)
                    self.progress.add(host.name, len(b))
                    yield b
                    if self.bwlimit:
                        ahead = sent / self.bwlimit - (time.monotonic() - t0)
                        if ahead > 0:
                            time.sleep(ahead)

    # a node -> a node, over the cluster network
    def relay(self, src: Host, dst: Host, todo: list[dict]) -> str | None:
        """None when dst got the bytes from src; else why it could not (the caller sends them
        from here)."""
        token = secrets.token_hex(32)
        ready, end = threading.Event(), threading.Event()
        served: dict = {}

        def on_serve(o: dict) -> None:
            served.update(o)
            if "port" in o or "unreachable" in o:
                ready.set()

        def feed() -> Iterator[bytes]:
            end.wait()  # stdin open while dst pulls; closing it ends the server
            yield b""

        def serve() -> None:
            try:
                self.call(src, {"op": "serve", "bind": src.address, "token": token,
                                "peers": resolve(dst.address, f"host {dst.name}"),
                                "objects": sorted(self.m.objects()), "bwlimit": self.bwlimit},
                          feed=feed(), on_line=on_serve, timeout=None)
            except Exception as e:  # noqa: BLE001 - reported as the pair's failure
                served["unreachable"] = f"{src.name}: {describe_error(e)}"
            ready.set()

        t0 = time.monotonic()
        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            ready.wait(120)
            if "port" not in served:
                return self._fallback(dst, served.get("unreachable", "no transfer server"))
            self.progress.start(dst.name, sum(t["size"] - t["offset"] for t in todo), src.name)
            base = self.progress.nodes[dst.name]["done"]
            lines = self.call(dst, {"op": "pull", "peer": src.address, "port": served["port"],
                                    "token": token, "sends": todo, "chunk": self.m.doc["chunk"]},
                              on_line=lambda o: "bytes" in o and self.progress.set(dst.name, base + o["bytes"]),
                              timeout=None)
        finally:
            end.set()
            server.join(30)
        gone = last(lines, "unreachable")
        if gone:
            return self._fallback(dst, gone["unreachable"])
        bad = [o for o in lines if "bad" in o]
        if bad:
            raise TorchrigError(f"{dst.name}: from {src.name}: {bad[0]['why']}")
        self.progress.set(dst.name, self.progress.nodes[dst.name]["total"], "received")
        self.res.nodes[dst.name] = {"from": src.name, "seconds": round(time.monotonic() - t0, 2)}
        return None

    def _fallback(self, dst: Host, why: str) -> str:
        self.res.fallbacks.append(f"{dst.name}: {why}")
        return why


def push(fleet: Fleet, source: Path, name: str, bwlimit: int, log: Callable[[str], None],
         progress: Progress | None = None, running_users: Callable[[], list[str]] | None = None
         ) -> PushResult:
    name = check_name(name)
    source = Path(source)
    log(f"hashing {source} ...")
    m, local = scan(source)
    log(f"{len(m.files)} file(s), {plan.human(m.size)}, manifest {m.sha256[:16]}")
    p = _Push(fleet, m, local, name, bwlimit, log, progress or Progress())
    return _distribute(p, running_users)


def pull(fleet: Fleet, url: str, name: str, file_name: str | None, authorization: str | None,
         bwlimit: int, log: Callable[[str], None], progress: Progress | None = None,
         running_users: Callable[[], list[str]] | None = None) -> PushResult:
    """data.pull: the first selected node downloads the URL (credentials on its stdin only),
    then the others get it from the nodes that hold it, as a push's fan-out does; a node that
    cannot reach one downloads it itself."""
    from urllib.parse import unquote, urlsplit
    name = check_name(name)
    parts = urlsplit(url)
    # the URL itself is in no message: its user:password@ would be
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TorchrigError("data.pull: the URL is not an http:// or https:// URL with a host")
    try:
        parts.port
    except ValueError as e:
        raise TorchrigError(f"data.pull: the URL's port: {e}") from None
    file_name = file_name or unquote(parts.path.rstrip("/").rsplit("/", 1)[-1])
    if not file_name or not plan.SAFE_FILE.fullmatch(file_name):
        raise TorchrigError(f"data.pull: the file's name {file_name!r} is not a plain file name; "
                            "give one with --file NAME")
    seed = fleet.hosts[0]
    progress = progress or Progress()
    progress.start(seed.name, 0, parts.hostname)
    request = {"op": "download", "url": url, "authorization": authorization, "chunk": CHUNK}
    t0 = time.monotonic()
    entry = last(call(fleet, seed, request, timeout=None,
                      on_line=lambda o: "bytes" in o and progress.set(seed.name, o["bytes"])),
                 "entry")["entry"]
    progress.nodes[seed.name]["total"] = entry["size"]
    progress.set(seed.name, entry["size"], "received")
    m = build([{"path": file_name, **entry}])
    log(f"{seed.name}: downloaded {plan.human(entry['size'])} (sha256 {entry['sha256'][:16]}) "
        f"in {time.monotonic() - t0:.1f} s")
    p = _Push(fleet, m, {}, name, bwlimit, log, progress)
    p.download = request
    p.res.nodes[seed.name] = {"from": parts.hostname, "seconds": round(time.monotonic() - t0, 2)}
    return _distribute(p, running_users)


def _distribute(p: _Push, running_users: Callable[[], list[str]] | None) -> PushResult:
    """Every selected node gets what it lacks (the seed from here, then node to node), then
    every node switches; or, when any node failed, none does."""
    fleet, m, name, log = p.fleet, p.m, p.name, p.log
    hosts = {h.name: h for h in p.hosts}
    states = fleet.fan_out(p.state, p.hosts)
    down = [f"{r.host}: {r.error}" for r in states if not r.ok]
    if down:
        raise TorchrigError("data: " + "; ".join(down))
    st = {r.host: r.value for r in states}
    if running_users and any(s["current"] != m.sha256[:16] for s in st.values()):
        jobs = running_users()
        if jobs:
            raise TorchrigError(f"dataset {name} is used by running job(s) {', '.join(jobs)}: "
                                "changing it under them is refused; stop them first, or use "
                                "another --name")
    holders = [h for h, s in st.items() if not s["todo"]]
    needy = [h for h, s in st.items() if s["todo"]]
    for h in holders:
        p.res.nodes.setdefault(h, {"from": None, "seconds": 0.0})

    def one(pair):
        src, dst = pair
        if src != plan.OPERATOR:
            # this pair's own reason (pairs of a round run at once: fallbacks[-1] may be another's)
            gone = p.relay(hosts[src], hosts[dst], st[dst]["todo"])
            if gone is None:
                return
            if not p.from_here and not p.download:
                raise TorchrigError(f"cannot get it from {src} ({gone})")
            log(f"{dst}: cannot get it from {src} ({gone}); "
                + ("it downloads it itself" if p.download else "sending it from this machine"))
        if p.download:
            p.call(hosts[dst], p.download, timeout=None)
            p.res.nodes[dst] = {"from": "its own download"}
            return
        p.upload(hosts[dst], p.state(hosts[dst])["todo"] if src != plan.OPERATOR else st[dst]["todo"])

    for pairs in plan.rounds(holders, needy):
        done = fleet.fan_out(one, pairs, name=lambda pair: pair[1])
        failed = [f"{r.host}: {r.error}" for r in done if not r.ok]
        if failed:
            raise TorchrigError("data: nothing switched (what arrived is kept for the next "
                                "try): " + "; ".join(failed))
    commits = fleet.fan_out(lambda h: p.call(h, {"op": "commit", "name": name, "manifest": m.doc,
                                                 "sha256": m.sha256})[-1], p.hosts)
    failed = [f"{r.host}: {r.error}" for r in commits if not r.ok]
    if failed:
        raise TorchrigError("data: " + "; ".join(failed))
    for r in commits:
        p.res.nodes.setdefault(r.host, {})["switched"] = r.value.get("switched", False)
    return p.res


# ---- ls, rm, the launch's check ------------------------------------------------------------

def listing(fleet: Fleet, name: str | None = None, full: bool = False,
            hosts: list[Host] | None = None) -> dict[str, list[dict] | str]:
    """{host: its datasets (node.py's ls) or the error reaching it}."""
    rs = fleet.fan_out(lambda h: last(call(fleet, h, {"op": "ls", "name": name, "full": full},
                                           timeout=None), "datasets")["datasets"], hosts)
    return {r.host: (r.value if r.ok else r.error) for r in rs}


def copies(found: dict[str, list[dict] | str], name: str) -> list[plan.NodeCopy]:
    out = []
    for host, sets in found.items():
        if isinstance(sets, str):
            out.append(plan.NodeCopy(host, error=sets))
            continue
        d = next((s for s in sets if s["name"] == name), None)
        out.append(plan.NodeCopy(host) if d is None else
                   plan.NodeCopy(host, d["sha256"], d["files"], d["bytes"], d["problems"]))
    return out


def check(fleet: Fleet, name: str, full: bool = False, hosts: list[Host] | None = None) -> str:
    """The launch's gate: every node holds dataset `name`, the same version, as pushed (full:
    every file re-hashed). Returns the dataset's path on the nodes; else one error naming
    each node and file."""
    name = check_name(name)
    found = listing(fleet, name, full, hosts)
    why = plan.agreement(copies(found, name))
    if why:
        raise TorchrigError(f"dataset {name} is not the same on every node: " + "; ".join(why[:8]) +
                            (f" (and {len(why) - 8} more)" if len(why) > 8 else "") +
                            f"; run `torchrig data.push PATH --name {name}` to repair it")
    return dataset_path((hosts or fleet.hosts)[0].settings.data_dir, name)


def remove(fleet: Fleet, name: str) -> dict[str, dict | str]:
    name = check_name(name)
    rs = fleet.fan_out(lambda h: call(fleet, h, {"op": "rm", "name": name})[-1])
    return {r.host: (r.value if r.ok else r.error) for r in rs}
