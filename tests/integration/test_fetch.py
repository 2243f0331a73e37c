"""fetch on a testbed node: a finished job's checkpoint to the operator, hash and manifest
checked against the node's; the SSH connection cut mid-transfer (the node-side sshd of that
connection killed) and the transfer resumed from the bytes received; a corrupt newest
checkpoint refused; and what a job can plant in its checkpoint folder (a symlink to
/etc/shadow, a FIFO) refused without leaking a byte of it."""

import hashlib
import json

import pytest

from conftest import cut_ssh, invoke, invoke_bg, launch, sh, wait_unit_ended, wait_until

NODE, JOB = "gpu1", "t-fetch"
DIR = f"/srv/torchrig/checkpoints/{JOB}"


@pytest.fixture(scope="module")
def inv(fleet):
    """A finished single-node job with checkpoints at steps 10, 20 and 30."""
    inv = fleet.provisioned(NODE)
    r = launch(inv, JOB, "--args", "--max-steps 30 --log-every 10 --ckpt-every 10 --keep 5",
               hosts=NODE)
    assert r.returncode == 0, r.stderr
    assert wait_unit_ended(inv, NODE, f"torchrig-{JOB}.service") == "inactive"
    return inv


def fetch(inv, *args):
    return invoke("fetch", "-i", str(inv), "-H", NODE, "--job", JOB, *args, timeout=300)


def node_sha(inv, name) -> str:
    return sh(inv, NODE, f"sha256sum {DIR}/{name}").split()[0]


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_matches_the_nodes_hash_and_a_second_fetch_transfers_nothing(inv, tmp_path):
    r = fetch(inv, "--to", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    [f] = json.loads(r.stdout)["files"]
    assert (f["name"], f["step"], f["transferred"]) == ("ckpt_00000030.pt", 30, f["size"])
    assert f["sha256"] == node_sha(inv, f["name"]) == sha(tmp_path / f["name"])
    manifest = json.loads((tmp_path / "MANIFEST.json").read_text())
    [m] = manifest["files"]
    assert manifest["job"] == m["job"] == JOB and m["node"] == NODE
    assert (m["name"], m["step"], m["size"], m["sha256"]) == (f["name"], 30, f["size"], f["sha256"])
    assert m["node_path"] == f"{DIR}/{f['name']}" and m["fetched_at"].endswith("Z")
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    r = fetch(inv, "--to", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "already there, unchanged: nothing transferred" in r.stdout
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_fetch_resumes_after_the_ssh_connection_is_cut(inv, tmp_path):
    p = invoke_bg("fetch", "-i", str(inv), "-H", NODE, "--job", JOB, "--step", "20",
                  "--to", str(tmp_path), "--bwlimit", "100", "--json")
    try:
        wait_until("a partial file of 200 kB", lambda: any(
            x.stat().st_size > 200_000 for x in tmp_path.glob(".ckpt_00000020.pt.*.part")), 60, 0.2)
        # the node side: root's process sending its private snapshot of the checkpoint
        cut = cut_ssh(inv, NODE, "root", "torchrig-fetch send")
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert "user root" in cut and len(cut.split("killed")[1].split()) >= 1, cut
    assert p.returncode == 0, err
    assert "(connection lost); resuming with a fresh connection" in err, err
    assert "over paramiko" not in err, err  # OpenSSH's ssh carried the bytes, before and after the cut
    [f] = json.loads(out)["files"]
    assert len(f["resumed_at"]) == 1 and 200_000 < f["resumed_at"][0] < f["size"], f
    assert f["transferred"] == f["size"]  # resumed: no byte sent twice
    assert f["sha256"] == node_sha(inv, "ckpt_00000020.pt") == sha(tmp_path / "ckpt_00000020.pt")
    assert not list(tmp_path.glob(".*.part"))


def test_a_corrupt_newest_is_refused_and_planted_links_leak_nothing(inv, tmp_path):
    plant = (f"cd {DIR} && runuser -u torchrig -- sh -c 'head -c 4096 ckpt_00000030.pt > "
             "ckpt_00000040.pt && ln -s /etc/shadow ckpt_00000050.pt && mkfifo ckpt_00000060.pt "
             "&& ln -s /etc/shadow notes.txt'")
    sh(inv, NODE, plant)
    shadow = sh(inv, NODE, "head -1 /etc/shadow").encode()
    try:
        r = fetch(inv, "--to", str(tmp_path / "a"), "--json")
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert [f["name"] for f in data["files"]] == ["ckpt_00000030.pt"]
        why = {x["name"]: x["why"] for x in data["refused"]}
        assert why["ckpt_00000050.pt"] == "a symlink (not followed)"
        assert why["ckpt_00000060.pt"].startswith("not a regular file")
        assert "central directory" in why["ckpt_00000040.pt"], why
        assert "gpu1: taking ckpt_00000030.pt, the newest checkpoint that loads" in r.stderr
        r = fetch(inv, "--to", str(tmp_path / "s"), "--step", "50")
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [
            "error: --step 50: ckpt_00000050.pt is a symlink (not followed): refused"], r.stderr
        r = fetch(inv, "--to", str(tmp_path / "all"), "--all", "--json")
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert {f["name"] for f in data["files"]} == {f"ckpt_000000{s}0.pt" for s in (1, 2, 3, 4)}
        assert {x["name"] for x in data["left_out"]} == {"ckpt_00000050.pt", "ckpt_00000060.pt",
                                                         "notes.txt"}
        files = [x for x in tmp_path.rglob("*") if x.is_file()]
        assert len(shadow) > 10 and not any(shadow in x.read_bytes() for x in files)
    finally:
        sh(inv, NODE, f"rm -f {DIR}/ckpt_00000040.pt {DIR}/ckpt_00000050.pt "
                      f"{DIR}/ckpt_00000060.pt {DIR}/notes.txt")


RAW_PICKLE = """import os, pickle, sys
class Boom:
    def __reduce__(self):
        return os.system, ("id",)
data = pickle.dumps(Boom(), protocol=2)
size = os.path.getsize(sys.argv[1])
open(sys.argv[2], "wb").write(data + b"\\0" * (size - len(data)))
"""


def test_a_checkpoint_rewritten_in_place_after_the_hash_is_never_sent_as_checked(inv, tmp_path):
    """The job's user plants a raw pickle (that runs code when loaded without weights_only) as
    the newest checkpoint, and swaps a good checkpoint's bytes in place (same inode, size,
    mtime) while fetch looks at it, then back: fetch refuses it and sends only bytes it
    checked, the manifest naming the hash that was load-checked."""
    import shlex
    from pathlib import Path
    import torch
    attack = (Path(__file__).parents[1] / "swap_attack.py").read_text()
    bad, good = f"{DIR}/ckpt_00000040.pt", f"{DIR}/ckpt_00000030.pt"
    sh(inv, NODE, f"runuser -u torchrig -- python3 -c {shlex.quote(RAW_PICKLE)} {good} {bad} && "
                  f"systemd-run --unit t-swap-attack --uid torchrig -p RuntimeMaxSec=300 -- "
                  f"python3 -u -c {shlex.quote(attack)} {bad} {good} 240")
    try:
        wait_until("the attacker watching", lambda: "watching" in sh(
            inv, NODE, "journalctl -u t-swap-attack -o cat --no-pager"), 60, 0.5)
        r = invoke("fetch", "--inventory", str(inv), "--host", NODE, "--job", JOB,
                   "--to", str(tmp_path), "--json", timeout=600)
        did = sh(inv, NODE, "journalctl -u t-swap-attack -o cat --no-pager")
        left = sh(inv, NODE, "ls -a /srv/torchrig/checkpoints")
    finally:
        sh(inv, NODE, f"systemctl stop t-swap-attack 2>/dev/null; "
                      f"systemctl reset-failed t-swap-attack 2>/dev/null; rm -f {bad}", check=False)
    assert "rewrote with the good checkpoint" in did, did  # the attack happened
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    why = {x["name"]: x["why"] for x in data["refused"]}
    assert "Weights only load failed" in why.get("ckpt_00000040.pt", ""), why
    assert [f["name"] for f in data["files"]] == ["ckpt_00000030.pt"]
    [m] = json.loads((tmp_path / "MANIFEST.json").read_text())["files"]
    got = tmp_path / m["name"]
    assert m["checked"]["sha256"] == m["sha256"] == sha(got) and m["checked"]["load_check"] == "ok"
    assert "snapshot" in m["checked"]["how"] and "as torchrig" in m["checked"]["how"]
    torch.load(got, weights_only=True)
    assert ".torchrig-fetch-" not in left, left  # the snapshot is removed after the transfer
