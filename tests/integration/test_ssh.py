"""The SSH layer against real sshd on testbed hosts: host keys, fan-out, quoting, jump hosts."""

import copy
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import (REPO, invoke, inventory_with_known_hosts, ip_of, wait_until,
                      write_inventory)
from torchrig import inventory
from torchrig.connections import connect
from torchrig.quoting import sh, with_env


def test_exec_on_all_hosts_verified(testbed):
    r = invoke("exec", "--inventory", str(testbed), "--host", "gpu1,gpu2",
               "systemctl is-system-running; hostname")
    assert r.returncode == 0, r.stderr
    for h in ("gpu1", "gpu2"):
        state = re.search(rf"^{h} \| (\w+)$", r.stdout, re.M)
        assert state and state.group(1) in ("running", "degraded"), r.stdout
        assert re.search(rf"^{h} \| {h}$", r.stdout, re.M)
    assert "gpu3 |" not in r.stdout


def test_exec_group_selection_and_sudo(testbed):
    r = invoke("exec", "-i", str(testbed), "-H", "testbed", "--sudo", "id -un && id -un")
    assert r.returncode == 0, r.stderr
    for h in ("gpu1", "gpu2", "gpu3"):
        assert r.stdout.count(f"{h} | root") == 2, r.stdout  # both halves of && ran as root


def test_exec_nonzero_exit_reported(testbed):
    r = invoke("exec", "-i", str(testbed), "-H", "gpu1,gpu2",
               "test $(hostname) = gpu1 || exit 3")
    assert r.returncode == 1
    assert "gpu2: exit status 3" in r.stderr and "gpu1:" not in r.stderr


def test_unknown_host_key_refused_then_accepted(testbed, inventory_doc, tmp_path):
    inv, kh = inventory_with_known_hosts(tmp_path, inventory_doc)
    r = invoke("exec", "-i", str(inv), "-H", "gpu1", "true")
    assert r.returncode == 1
    assert "unknown host key" in r.stderr and "SHA256:" in r.stderr
    assert "--accept-new-host-keys" in r.stderr and "Traceback" not in r.stderr
    assert not kh.exists() or kh.read_text() == ""
    # The fingerprint shown is the host's real one (as ssh-keygen computes it from the key
    # testbed.up read off the host's disk).
    fp = re.search(r"(SHA256:[A-Za-z0-9+/]+)", r.stderr).group(1)
    ip = ip_of(testbed, "gpu1")
    real = subprocess.run(["ssh-keygen", "-lf", inventory_doc["known_hosts"]],
                          capture_output=True, text=True, check=True).stdout
    assert re.search(rf"{re.escape(fp)} {re.escape(ip)} ", real), (fp, real)
    r = invoke("exec", "-i", str(inv), "-H", "gpu1", "--accept-new-host-keys", "echo hi")
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^{re.escape(ip)} ssh-ed25519 ", kh.read_text(), re.M)
    r = invoke("exec", "-i", str(inv), "-H", "gpu1", "echo again")
    assert r.returncode == 0 and "gpu1 | again" in r.stdout


def test_logs_has_the_host_key_flag_like_the_other_tasks(testbed, inventory_doc, tmp_path):
    """`logs` had no --accept-new-host-keys: a first `logs` of a new host could not record
    its key. Now it asks for the flag, and with it records the key (then finds no job)."""
    doc = copy.deepcopy(inventory_doc)
    kh = tmp_path / "known_hosts"
    doc["known_hosts"] = str(kh)
    inv = write_inventory(tmp_path, doc)
    r = invoke("logs", "-i", str(inv), "-H", "gpu1")
    assert r.returncode == 1 and "--accept-new-host-keys" in r.stderr, r.stderr
    assert not kh.exists() or kh.read_text() == ""
    r = invoke("logs", "-i", str(inv), "-H", "gpu1", "--accept-new-host-keys")
    assert "no torchrig job found on gpu1" in r.stderr or r.returncode == 0, r.stderr
    assert kh.read_text().count("ssh-ed25519") == 1


def test_a_fleet_holds_one_connection_per_host(testbed):
    """Every command of a task goes over the host's one SSH connection (sshd sees the same
    client port each time); before, every command opened a new one."""
    from torchrig.session import Fleet
    inv = inventory.load(testbed)
    hosts = inv.select("gpu1,gpu2")
    with Fleet(inv, hosts) as fleet:
        seen = fleet.fan_out(lambda h: {fleet.run(h, "echo $SSH_CONNECTION").stdout.split()[1]
                                        for _ in range(5)})
        assert all(r.ok and len(r.value) == 1 for r in seen), seen
        assert fleet.run(hosts[0], "id -u", root=True).stdout.strip() == "0"
        # Nagle off (connections.ssh_socket): each command's small messages go at once
        sock = fleet.conn(hosts[0]).transport.sock
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert fleet.run(hosts[0], "cat", data="on stdin").stdout == "on stdin"
        fleet.drop(hosts[0])  # as provision does across a reboot: a new connection next time
        again = fleet.run(hosts[0], "echo $SSH_CONNECTION").stdout.split()[1]
        assert again not in seen[0].value


def test_changed_host_key_always_refused(testbed, inventory_doc, tmp_path):
    real = open(inventory_doc["known_hosts"]).read().splitlines()
    ip1, ip2 = (h["address"] for h in inventory_doc["hosts"][:2])
    # gpu1's address now "presents" gpu2's keys in our known_hosts: as after a MITM or reinstall
    forged = [line.replace(ip2, ip1, 1) for line in real if line.startswith(ip2 + " ")]
    inv, kh = inventory_with_known_hosts(tmp_path, inventory_doc, forged)
    for extra in ([], ["--accept-new-host-keys"]):
        r = invoke("exec", "-i", str(inv), "-H", "gpu1", *extra, "touch /tmp/should-not-run")
        assert r.returncode == 1
        assert "HOST KEY CHANGED" in r.stderr, r.stderr
    assert kh.read_text() == "\n".join(forged) + "\n"


def test_one_host_down_others_succeed(testbed, inventory_doc, tmp_path):
    doc = copy.deepcopy(inventory_doc)
    subnet = doc["hosts"][0]["address"].rsplit(".", 1)[0]
    doc["hosts"].append({"name": "gpu-dead", "address": f"{subnet}.250", "groups": ["testbed"]})
    inv = write_inventory(tmp_path, doc)
    t0 = time.monotonic()
    r = invoke("exec", "-i", str(inv), "uname -n", timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 1
    live = [h["name"] for h in inventory_doc["hosts"]]  # the testbed's, before gpu-dead
    for h in live:
        assert re.search(rf"^{h} +\| {h}$", r.stdout, re.M), r.stdout
    assert re.search(r"gpu-dead: unreachable: SSH to \S+:22 failed: (no route to the host|no "
                     r"answer)", r.stderr), r.stderr
    assert f"1 of {len(live) + 1} host(s)" in r.stderr
    assert took < 90, f"a dead host held the run for {took:.0f}s"


QUOTING_EVIL = ["; touch /tmp/pwned", "$(touch /tmp/pwned)", "`touch /tmp/pwned`", "a'b\"c $(id)"]


@pytest.mark.parametrize("user", ["admin", "root"])
def test_quoting_on_real_host(testbed, inventory_doc, tmp_path, user):
    doc = copy.deepcopy(inventory_doc)
    doc["defaults"]["user"] = user
    doc["hosts"][0].setdefault("vars", {})["env"] = {"EVIL": QUOTING_EVIL[0]}  # an inventory value too
    inv = inventory.load(write_inventory(tmp_path, doc))
    h = inv.host("gpu1")
    cxn = connect(h, inv)
    try:
        cxn.run("rm -f /tmp/pwned", root=True)
        for evil in QUOTING_EVIL + [h.settings.env["EVIL"]]:
            out = cxn.run(sh("printf", "%s", evil) + " && " + sh("printf", "|%s", evil), root=True).stdout
            assert out == f"{evil}|{evil}"
            out = cxn.run(with_env('printf %s "$JOB_ARG"', {"JOB_ARG": evil})).stdout
            assert out == evil
        assert cxn.run("test -e /tmp/pwned", root=True, warn=True).exited == 1, "injection ran"
        assert cxn.run("id -u", root=True).stdout.strip() == "0"
    finally:
        cxn.close()


def test_proxyjump_through_bastion(testbed, inventory_doc, tmp_path):
    doc = copy.deepcopy(inventory_doc)
    ip1 = doc["hosts"][0]["address"]
    doc["hosts"][1]["jump"] = "gpu1"  # an inventory host as the bastion
    inv = write_inventory(tmp_path, doc)
    r = invoke("exec", "-i", str(inv), "-H", "gpu2", 'echo "from=${SSH_CONNECTION%% *}"')
    assert r.returncode == 0, r.stderr
    assert f"gpu2 | from={ip1}" in r.stdout  # the connection came from the bastion


def test_a_dead_host_behind_a_jump_host_and_a_dead_jump_host_say_which(testbed, inventory_doc,
                                                                        tmp_path):
    """Behind a jump host an unreachable target read `SSH error: ChannelException(2, 'Connect
    failed')`, and a dead jump host was blamed on the target."""
    doc = copy.deepcopy(inventory_doc)
    doc["hosts"][1]["jump"] = "gpu1"
    doc["hosts"][1]["port"] = 2  # nothing listens there: gpu1's sshd refuses to forward
    doc["hosts"][2]["jump"] = "gpu4"
    doc["hosts"][3]["port"] = 2  # the jump host gpu4 itself is dead
    inv = write_inventory(tmp_path, doc)
    r = invoke("exec", "-i", str(inv), "-H", "gpu2", "true")
    assert r.returncode == 1 and "ChannelException" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "through jump host gpu1 failed: the jump host could not open a connection to it" in r.stderr
    r = invoke("exec", "-i", str(inv), "-H", "gpu3", "true")
    assert r.returncode == 1, r.stdout + r.stderr
    ip4 = doc["hosts"][3]["address"]
    assert re.search(rf"through jump host gpu4 failed: the jump host \w+@{re.escape(ip4)}:2 could "
                     rf"not be reached: connection refused .*; check that the jump host is up "
                     rf"and sshd runs there \(try: ssh -p 2 \w+@{re.escape(ip4)}\)", r.stderr), r.stderr


def test_ssh_config_is_honoured(testbed, inventory_doc, tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    h3 = inventory_doc["hosts"][2]
    (home / ".ssh/config").write_text(
        f"Host bench-box\n  HostName {h3['address']}\n  User root\n"
        f"  IdentityFile {inventory_doc['defaults']['identity_file']}\n")
    doc = {"known_hosts": inventory_doc["known_hosts"], "hosts": [{"name": "bench-box"}]}
    inv = write_inventory(tmp_path, doc)
    r = invoke("exec", "-i", str(inv), "id -un; hostname", env={"HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert "bench-box | root" in r.stdout and "bench-box | gpu3" in r.stdout


def test_local_connection(tmp_path):
    inv = write_inventory(tmp_path, {"hosts": [{"name": "head", "connection": "local"}]})
    r = invoke("exec", "-i", str(inv), "--sudo", "echo local-$(id -u) && hostname")
    assert r.returncode == 0, r.stderr
    assert "head | local-0" in r.stdout and f"head | {os.uname().nodename}" in r.stdout


def _sshd_pids(name: str) -> list[int]:
    from torchrig.testbed.machines import _inside, root_of
    out = []
    for pid in _inside(root_of(name)):
        try:
            if open(f"/proc/{pid}/comm").read().strip().startswith("sshd"):
                out.append(pid)
        except OSError:
            pass
    return out


def test_frozen_host_ends_in_bounded_time(testbed):
    """A host whose sshd stops answering mid-command (SIGSTOP: TCP stays up, nothing comes
    back) ends that host's run with a clear error, instead of waiting forever."""
    import signal
    from torchrig.testbed.machines import _inside, root_of
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "invoke", "exec", "-i", str(testbed), "-H", "gpu2",
                          "sleep 300"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)

    def running():  # the command runs on gpu2: its SSH session exists, and sshd serves it
        for pid in _inside(root_of("gpu2")):
            try:
                if open(f"/proc/{pid}/cmdline", "rb").read() == b"sleep\x00300\x00":
                    return True
            except OSError:
                pass
        return p.poll() is not None  # ended early: the asserts below say why
    wait_until("`sleep 300` to run on gpu2 through exec", running, 60, 0.2)
    frozen = _sshd_pids("gpu2")
    assert frozen
    try:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        out, err = p.communicate(timeout=120)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        p.kill()
    took = time.monotonic() - t0
    assert p.returncode == 1, out + err
    assert re.search(r"gpu2: SSH connection to admin@[\d.]+ lost: the server answered no keepalive "
                     r"for 30s .*while running: sleep 300", err), err
    assert "Traceback" not in out + err
    assert took < 80, f"{took:.0f}s"


def test_known_hosts_markers(testbed, inventory_doc, tmp_path):
    """@revoked: that key is refused (even with --accept-new-host-keys), other hosts work;
    @cert-authority: skipped with a warning, not a crash of every host."""
    real = open(inventory_doc["known_hosts"]).read().splitlines()
    ip1 = inventory_doc["hosts"][0]["address"]
    mine = [ln.split(None, 1)[1] for ln in real if ln.startswith(ip1 + " ")]
    inv, kh = inventory_with_known_hosts(tmp_path, inventory_doc,
                                         [f"@cert-authority *.example.com {mine[0]}"] + real +
                                         [f"@revoked * {k}" for k in mine])
    for extra in ([], ["--accept-new-host-keys"]):
        r = invoke("exec", "-i", str(inv), "-H", "gpu1,gpu2", *extra, "hostname")
        assert r.returncode == 1
        assert re.search(r"gpu1: host key for [\d.]+ \(\S+ SHA256:\S+\) is marked @revoked", r.stderr)
        assert "gpu2 | gpu2" in r.stdout and "gpu1 |" not in r.stdout
        assert "@cert-authority skipped" in r.stderr and "Traceback" not in r.stderr
    assert kh.read_text().count("\n") == len(real) + 1 + len(mine)  # nothing recorded


def test_ssh_config_proxyjump_chain_in_order(testbed, inventory_doc, tmp_path):
    """`ProxyJump gpu1,gpu2`: OpenSSH goes to gpu1, from there to gpu2, from there to the host,
    so the host sees the connection come from gpu2 (Fabric alone came from gpu1)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    ip1, ip2, ip3 = (h["address"] for h in inventory_doc["hosts"][:3])
    key = inventory_doc["defaults"]["identity_file"]
    (home / ".ssh/config").write_text(
        f"Host via-chain\n  HostName {ip3}\n  ProxyJump {ip1},{ip2}\n"
        f"Host *\n  User admin\n  IdentityFile {key}\n")
    doc = {"known_hosts": inventory_doc["known_hosts"], "hosts": [{"name": "via-chain"}]}
    inv = write_inventory(tmp_path, doc)
    r = invoke("exec", "-i", str(inv), 'echo "from=${SSH_CONNECTION%% *}"; hostname',
               env={"HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert f"via-chain | from={ip2}" in r.stdout and "via-chain | gpu3" in r.stdout
