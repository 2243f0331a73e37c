"""OpenSSH's `ssh` carrying fetch's bytes: the argv built from what paramiko connected to (the
pinned key only, no secret), when paramiko keeps the bytes, and a stream through a stand-in
`ssh` on PATH (a local bash: argv and stdin as the real one gets them)."""

import os
import stat

import pytest

from torchrig import openssh
from torchrig.connections import LocalConnection, connect
from torchrig.inventory import load

TARGET = openssh.Target("10.0.0.5", 2222, "admin", ("/keys/id_ed25519",), "ssh-ed25519",
                        "AAAAC3NzaC1lZDI1NTE5AAAAIPinnedKeyBase64")


def opt(argv, name):
    return [argv[i + 1].split("=", 1)[1] for i, a in enumerate(argv)
            if a == "-o" and argv[i + 1].startswith(name + "=")]


def test_argv_checks_only_the_pinned_key_and_reads_no_config():
    argv = openssh.argv(TARGET, "/private/known_hosts", "sudo -n -- bash -c 'x'")
    assert argv[:3] == ["ssh", "-F", "/dev/null"]  # no ssh_config: only what is said here
    assert opt(argv, "StrictHostKeyChecking") == ["yes"] and opt(argv, "BatchMode") == ["yes"]
    assert opt(argv, "UserKnownHostsFile") == ["/private/known_hosts"]
    assert opt(argv, "GlobalKnownHostsFile") == ["/dev/null"]
    assert opt(argv, "HostKeyAlias") == ["[10.0.0.5]:2222"]  # the pinned line's name
    assert opt(argv, "UpdateHostKeys") == ["no"] and opt(argv, "CheckHostIP") == ["no"]
    assert argv[-7:] == ["-p", "2222", "-l", "admin", "--", "10.0.0.5", "sudo -n -- bash -c 'x'"]
    assert argv[argv.index("-i") + 1] == "/keys/id_ed25519"
    assert openssh.pinned_line(TARGET) == (
        "[10.0.0.5]:2222 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPinnedKeyBase64\n")
    port22 = openssh.Target("h", 22, "u", (), "ssh-ed25519", "K")
    assert opt(openssh.argv(port22, "kh", "c"), "HostKeyAlias") == ["h"]
    assert "-i" not in openssh.argv(port22, "kh", "c")


@pytest.mark.parametrize("kw, why", [
    ({"env": "paramiko"}, "TORCHRIG_BULK_SSH=paramiko"),
    ({"ssh": None}, "no ssh client"),
    ({"gateway": object()}, "jump host"),
    ({"proxycommand": "nc %h %p"}, "ProxyCommand"),
    ({"connect_kwargs": {"password": "hunter2"}}, "sets password"),
    ({"connect_kwargs": {"pkey": object(), "key_filename": ["k"]}}, "sets pkey"),
    ({"strategy": object}, "authentication strategy"),
    ({}, None),
    ({"connect_kwargs": {"key_filename": ["k"], "banner_timeout": 10, "password": None}}, None),
])
def test_what_keeps_the_bytes_on_paramiko(kw, why):
    args = {"ssh": "/usr/bin/ssh", "env": None, "gateway": None, "proxycommand": None,
            "connect_kwargs": {}, "strategy": None, **kw}
    got = openssh.why_not(args["ssh"], args["env"], args["gateway"], args["proxycommand"],
                          args["connect_kwargs"], args["strategy"])
    assert (got is None) if why is None else (why in got), got
    if got and "connect_kwargs" in kw:
        assert "hunter2" not in got  # the setting is named, never its value


def test_a_local_host_has_no_carrier_and_says_nothing():
    assert openssh.carrier(LocalConnection()) == (None, None)


def test_a_jump_host_keeps_paramiko(tmp_path):
    kh = tmp_path / "known_hosts"
    inv_file = tmp_path / "inv.yml"
    inv_file.write_text(f"known_hosts: {kh}\nhosts:\n  - name: a\n    address: 10.9.9.9\n"
                        "    jump: admin@10.9.9.1\n")
    cxn = connect(load(inv_file).host("a"), load(inv_file))
    cxn.client.get_transport = lambda: pytest.fail("no key is read when ssh cannot be used")
    over, why = openssh.carrier(cxn)
    assert over is None and "jump host" in why


def fake_ssh(tmp_path, monkeypatch, body: str):
    """A stand-in `ssh` first on PATH: records its argv (one word a line), then `body`."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    ssh = bin_ / "ssh"
    ssh.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/argv\n{body}\n')
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    return tmp_path / "argv"


def test_a_stream_over_ssh_carries_stdin_and_stdout_and_the_pinned_file_goes_away(
        tmp_path, monkeypatch):
    argv_file = fake_ssh(tmp_path, monkeypatch, 'exec bash -c "${@: -1}"')
    out, err = bytearray(), bytearray()
    with openssh.Carrier(TARGET) as over:
        kh = over.known_hosts
        mode = stat.S_IMODE(os.stat(kh).st_mode)
        pinned = open(kh).read()
        rc = over.stream("head -c 3000000 /dev/zero; cat >&2; exit 4", "the request\n",
                         out.extend, err.extend, silence=30)
    assert rc == 4 and out == b"\0" * 3_000_000 and err == b"the request\n"
    assert mode == 0o600 and pinned == openssh.pinned_line(TARGET)
    assert not os.path.exists(kh) and not os.path.exists(os.path.dirname(kh))
    argv = argv_file.read_text().splitlines()
    assert f"UserKnownHostsFile={kh}" in argv and "the request" not in "".join(argv)


def test_a_silent_ssh_is_a_drop(tmp_path, monkeypatch):
    fake_ssh(tmp_path, monkeypatch, "sleep 30")
    with openssh.Carrier(TARGET) as over:
        assert over.stream("x", "", print, print, silence=0.3) is None


def test_a_started_ssh_is_taken_by_the_stream_of_its_command_and_ended_otherwise(
        tmp_path, monkeypatch):
    """start(): ssh runs before its stdin exists (fetch overlaps its handshake with the
    listing); the stream of the same command takes that process (one ssh, the request still
    on stdin), another command's stream or close() ends it (no ssh left behind)."""
    fake_ssh(tmp_path, monkeypatch, f'echo $$ >> {tmp_path}/pids\nexec bash -c "${{@: -1}}"')
    pids = tmp_path / "pids"
    out = bytearray()
    with openssh.Carrier(TARGET) as over:
        over.start("cat")
        first = over._started[1]
        assert over.stream("cat", "the request\n", out.extend, print, silence=30) == 0
        assert out == b"the request\n" and first.returncode == 0
        assert len(pids.read_text().split()) == 1  # the started one carried it
        over.start("cat")
        unused = over._started[1]
        assert over.stream("echo other", "", out.extend, print, silence=30) == 0
        assert unused.returncode is not None and out.endswith(b"other\n")
        over.start("sleep 30")
        left = over._started[1]
    assert left.returncode is not None and over._started is None
