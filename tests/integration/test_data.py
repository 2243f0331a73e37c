"""data.push/ls/rm and launch --data on three testbed nodes: a folder of many small files and
one big file staged everywhere for about one upload from this machine (counted on the nodes:
nftables counters of the bytes reaching their sshd), verified on every node; a second push sends
nothing; a push whose SSH connection is cut resumes and ends verified; a file corrupted by hand
is found by data.ls and by launch --data, and repaired by the next push; nodes that cannot reach
each other get the bytes from here; data.rm refuses while a running job uses the dataset."""

import hashlib
import json
import os
import sys

import pytest

from conftest import cut_ssh, invoke, invoke_bg, ip_of, launch, logs, sh, stop, wait_until

HOSTS = ("gpu1", "gpu2", "gpu4")
SEL = ",".join(HOSTS)
PAIR = "gpu1,gpu4"  # jobs run on one GPU profile (gpu2 is the 8-GPU box: the version gate)
pytestmark = pytest.mark.provisioned(*HOSTS)
DATA = "/srv/torchrig/data"
BIG = 256 << 20
COUNT = r"""nft list table inet tcount >/dev/null 2>&1 || { nft add table inet tcount &&
nft add chain inet tcount in '{ type filter hook input priority -5; }' &&
nft add rule inet tcount in tcp dport 22 counter; }
nft list table inet tcount | grep -o 'bytes [0-9]*' | cut -d' ' -f2"""


def data(inv, action, *args, hosts=SEL, timeout=600):
    return invoke(f"data.{action}", "-i", str(inv), "-H", hosts, *args, timeout=timeout)


def ssh_bytes(inv) -> int:
    """Bytes that reached the nodes' sshd so far (one counter per node, made on first use)."""
    return sum(int(sh(inv, h, COUNT) or 0) for h in HOSTS)


def tree_sums(root) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def node_sums(inv, host, name) -> dict[str, str]:
    text = sh(inv, host, f"cd {DATA}/{name}/ && find . -type f ! -name .torchrig-manifest.json "
                         "-exec sha256sum {} +")
    return {ln.split(None, 1)[1][2:]: ln.split()[0] for ln in text.splitlines()}


@pytest.fixture(scope="module")
def staged(fleet, tmp_path_factory):
    """The dataset: 150 small files in folders and one 256 MiB file, pushed once."""
    inv = fleet.provisioned(*HOSTS)
    src = tmp_path_factory.mktemp("ds") / "corpus"
    for i in range(150):
        p = src / f"shard{i % 5}" / f"part{i}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(100 + 37 * i))
    with open(src / "big.bin", "wb") as f:
        for _ in range(BIG >> 20):
            f.write(os.urandom(1 << 20))
    before = ssh_bytes(inv)
    r = data(inv, "push", str(src), "--name", "corpus", "--json")
    after = ssh_bytes(inv)
    return inv, src, r, after - before


def test_one_push_costs_about_one_upload_and_every_node_holds_the_same_bytes(staged):
    inv, src, r, counted = staged
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, fs in os.walk(src) for n in fs)
    assert res["bytes"] == size and res["files"] == 151
    # counted where it arrives, not by torchrig: the nodes' sshd received one copy (and the
    # scripts and replies), not three
    assert size <= counted < 1.25 * size, (counted, size)
    assert res["operator_bytes"] == size
    froms = {h: d["from"] for h, d in res["nodes"].items()}
    assert list(froms.values()).count("this machine") == 1 and set(froms) == set(HOSTS), froms
    want = tree_sums(src)
    for h in HOSTS:
        assert node_sums(inv, h, "corpus") == want, h
    # the service user's, link switched to a version folder, never root's
    assert sh(inv, "gpu2", f"stat -c %U {DATA}/corpus/big.bin") == "torchrig"
    ls = data(inv, "ls", "--json")
    assert ls.returncode == 0, ls.stdout + ls.stderr
    [row] = [d for d in json.loads(ls.stdout) if d["name"] == "corpus"]
    assert row["agree"] and {n["sha256"] for n in row["nodes"].values()} == {res["sha256"]}


def test_a_second_push_sends_nothing(staged):
    inv, src, first, _ = staged
    before = ssh_bytes(inv)
    r = data(inv, "push", str(src), "--name", "corpus", "--json")
    counted = ssh_bytes(inv) - before
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["operator_bytes"] == 0 and all(d["from"] is None for d in res["nodes"].values())
    assert not any(d["switched"] for d in res["nodes"].values())
    assert counted < 2 << 20, counted  # the requests and the manifest, no file bytes


def test_a_file_corrupted_by_hand_is_found_refused_by_launch_and_repaired(staged, tmp_path):
    inv, src, _, _ = staged
    # same size, new bytes (by root: the stored files are read-only, 0444, to the service user
    # too): only the push's records (and a full re-hash) can tell
    sh(inv, "gpu4", f"python3 -c \"f=open('{DATA}/corpus/shard3/part8.txt', 'r+b'); "
                    "f.write(b'garbage')\"")
    ls = data(inv, "ls", "--name", "corpus")
    assert ls.returncode == 1
    assert "gpu4" in ls.stdout and "shard3/part8.txt" in ls.stdout and "nodes differ" in ls.stdout
    full = data(inv, "ls", "--name", "corpus", "--full", "--json")
    [row] = json.loads(full.stdout)
    assert any("shard3/part8.txt: sha256" in p for p in row["nodes"]["gpu4"]["problems"]), row
    job = "t-data-refused"
    r = launch(inv, job, "--data", "corpus", hosts=PAIR)  # gpu4 holds the bad file
    assert r.returncode == 1
    assert "gpu4: shard3/part8.txt" in r.stderr and "data.push" in r.stderr, r.stderr
    assert sh(inv, "gpu1", f"test -e /etc/systemd/system/torchrig-{job}.service || echo none") == "none"
    before = ssh_bytes(inv)
    r = data(inv, "push", str(src), "--name", "corpus", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["nodes"]["gpu4"]["from"] in ("gpu1", "gpu2") and res["operator_bytes"] == 0, res
    assert ssh_bytes(inv) - before < 2 << 20
    assert node_sums(inv, "gpu4", "corpus") == tree_sums(src)
    assert data(inv, "ls", "--name", "corpus", "--full").returncode == 0


def test_a_push_cut_mid_transfer_resumes_and_ends_verified(staged, tmp_path):
    inv = staged[0]
    src = tmp_path / "cut"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(96 << 20))
    p = invoke_bg("data.push", "-i", str(inv), "-H", "gpu1", str(src), "--name", "cut",
                  "--bwlimit", "8192", "--json")
    try:
        part = f"{DATA}/.torchrig/incoming/*.part"
        wait_until("a partial file of 40 MiB on gpu1", lambda: int(sh(
            inv, "gpu1", f"stat -c %s {part} 2>/dev/null || echo 0").split()[0]) > 40 << 20, 120, 0.5)
        cut = cut_ssh(inv, "gpu1", "torchrig", "torchrig-data recv")
        out, err = p.communicate(timeout=240)
    finally:
        p.kill()
    assert "user torchrig" in cut and cut.split("killed")[1].split(), cut
    assert p.returncode == 0, err
    assert "transfer cut" in err and "resuming with a fresh connection" in err, err
    res = json.loads(out)
    [at] = res["nodes"]["gpu1"]["resumed_at"]
    assert at > 0 and at % (32 << 20) == 0, at  # whole chunks kept, checked against their hashes
    # resumed, not restarted: far less than twice the file crossed the link
    assert res["operator_bytes"] < (96 << 20) + (64 << 20), res["operator_bytes"]
    assert node_sums(inv, "gpu1", "cut") == tree_sums(src)
    assert sh(inv, "gpu1", f"ls {DATA}/.torchrig/incoming/ | wc -l") == "0"


def test_nodes_that_cannot_reach_each_other_get_the_bytes_from_here(staged, tmp_path):
    inv = staged[0]
    src = tmp_path / "walled"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(4 << 20))
    others = " , ".join(ip_of(inv, h) for h in HOSTS if h != "gpu1")
    wall = ("nft add table inet twall && nft add chain inet twall in "
            "'{ type filter hook input priority -10; }' && nft add rule inet twall in ip saddr "
            f"'{{ {others} }}' tcp dport 1024-65535 reject with tcp reset")
    for h in HOSTS:  # no node accepts a transfer from another
        sh(inv, h, wall.replace(others, " , ".join(ip_of(inv, o) for o in HOSTS if o != h)))
    try:
        r = data(inv, "push", str(src), "--name", "walled", "--json")
    finally:
        for h in HOSTS:
            sh(inv, h, "nft delete table inet twall")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert all(d["from"] == "this machine" for d in res["nodes"].values()), res
    assert len(res["fallbacks"]) == 2 and res["operator_bytes"] == 3 * (4 << 20)
    assert r.stderr.count("sending it from this machine") == 2, r.stderr
    assert data(inv, "ls", "--name", "walled").returncode == 0


def test_a_job_trains_on_a_staged_token_folder_and_prints_a_validation_loss(staged, tmp_path):
    """The docs' path for a user's own text: prepare_data.py here (byte-level), data.push,
    launch the example payload with --data: rank 0 reads train.bin/val.bin through
    TORCHRIG_DATA and prints its eval lines; the loss is finite and falls."""
    import math
    import re
    import subprocess

    from conftest import REPO
    inv = staged[0]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(sorted((REPO / "docs").glob("*.md"))):
        (corpus / f"{i}.txt").write_text(doc.read_text())
    subprocess.run([sys.executable, str(REPO / "payload" / "prepare_data.py"), str(corpus),
                    "--out", str(tmp_path / "tokens")], check=True, capture_output=True)
    r = data(inv, "push", str(tmp_path / "tokens"), "--name", "tokens", hosts=PAIR)
    assert r.returncode == 0, r.stderr
    job = "t-data-tokens"
    r = launch(inv, job, "--data", "tokens", "--args",
               "--max-steps 20 --log-every 5 --eval-every 10 --eval-batches 2", hosts=PAIR)
    assert r.returncode == 0, r.stderr
    out = logs(inv, job, "-f", hosts=PAIR, timeout=300).stdout
    evals = re.findall(r"eval step=(\d+) val_loss=(\S+) windows=(\d+) tokens=(\d+)", out)
    assert [int(s) for s, *_ in evals] == [10, 20], out[-2000:]
    losses = [float(v) for _, v, *_ in evals]
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0] < math.log(256) + 1, evals
    # the folder came through TORCHRIG_DATA, the model's vocabulary from its meta.json
    assert f"data={DATA}/tokens" in out and "vocab_size=256" in out, out[-2000:]
    assert data(inv, "rm", "--name", "tokens", hosts=PAIR).returncode == 0


def test_rm_refuses_while_a_job_uses_the_dataset(staged, tmp_path):
    inv = staged[0]
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "count.py").write_text(
        "import os, time\nroot = os.environ['TORCHRIG_DATA']\n"
        "n = sum(len(fs) for _, _, fs in os.walk(root))\n"
        "print(f'files={n} in {root}', flush=True)\ntime.sleep(300)\n")
    job = "t-data-user"
    r = launch(inv, job, "--workdir", str(proj), "--script", "count.py", "--data", "corpus",
               "--early-fail-window", "0", hosts=PAIR)
    assert r.returncode == 0, r.stderr
    try:
        # 151 files and the version's manifest, read through TORCHRIG_DATA
        wait_until("the job to count the dataset's files", lambda: f"files=152 in {DATA}/corpus"
                   in logs(inv, job, "--grep", "files=", hosts=PAIR).stdout, 120)
        rm = data(inv, "rm", "--name", "corpus")
        assert rm.returncode == 1 and f"used by running job(s) {job}" in rm.stderr, rm.stderr
        assert sh(inv, "gpu4", f"test -L {DATA}/corpus && echo kept") == "kept"
    finally:
        stop(inv, job, hosts=PAIR)
    rm = data(inv, "rm", "--name", "corpus")
    assert rm.returncode == 0, rm.stderr
    for h in HOSTS:
        assert sh(inv, h, f"test -e {DATA}/corpus || test -e {DATA}/.torchrig/sets/corpus "
                          "|| echo gone") == "gone"


def test_pull_downloads_once_and_fans_out_with_credentials_never_shown(staged, tmp_path):
    """A server that refuses requests without its Basic credentials; the URL carries them.
    The file reaches every node (downloaded by one), and the password is in no output and in
    no command line torchrig starts on this machine or on the testbed hosts (the operator's own
    `invoke data.pull URL`, typed with the password, is the one line that may carry it)."""
    import base64
    import threading
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    from conftest import sample_argv
    from torchrig.testbed.paths import GATEWAY_IP
    inv = staged[0]
    user, pw = "reader", "pUllS3cr3t"
    want = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
    (tmp_path / "tok.bin").write_bytes(os.urandom(6 << 20))
    gets = []

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Authorization") == want
            gets.append((self.client_address[0], ok))
            if not ok:
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer((GATEWAY_IP, 0), partial(Handler, directory=str(tmp_path)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    stop_sampling, seen = threading.Event(), set()
    sampler = threading.Thread(target=sample_argv, args=(stop_sampling, seen), daemon=True)
    sampler.start()
    url = f"http://{user}:{pw}@{GATEWAY_IP}:{httpd.server_address[1]}/tok.bin"
    try:
        r = data(inv, "pull", url, "--name", "pulled", "--json")
        bad = data(inv, "pull", url.replace(pw, "wR0ngPw9"), "--name", "pulled2", hosts="gpu1")
    finally:
        stop_sampling.set()
        sampler.join()
        httpd.shutdown()
        httpd.server_close()
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert [ok for _, ok in gets].count(True) == 1, gets  # one download, then node to node
    assert sorted(d["from"] for d in res["nodes"].values()).count(GATEWAY_IP) == 1, res
    sha = hashlib.sha256((tmp_path / "tok.bin").read_bytes()).hexdigest()
    for h in HOSTS:
        assert node_sums(inv, h, "pulled") == {"tok.bin": sha}, h
    assert bad.returncode == 1 and "HTTP 401" in bad.stderr, bad.stderr
    typed = f"{sys.executable} -m invoke data.pull "
    seen = {s for s in seen if not s.startswith(typed)}
    for text in (r.stdout, r.stderr, bad.stdout, bad.stderr, *seen):
        assert pw not in text and "wR0ngPw9" not in text, text[:300]
    assert seen, "the sampler saw no process"
