"""Quoting, sudo wrapping, fingerprints, redaction and output prefixing: checked by running
the generated command lines in a real bash, not by comparing strings alone."""

import io
import subprocess

import paramiko
import pytest

from torchrig.terminal import PrefixedLines
from torchrig.hostkeys import fingerprint, known_hosts_name
from torchrig.quoting import privileged, sh, with_env
from torchrig.session import fan_out
from torchrig.secrets import redact
from torchrig.errors import TorchrigError

EVIL = ["; touch /tmp/torchrig-pwned", "$(touch /tmp/torchrig-pwned)", "`id`", "a b\tc",
        "it's \"quoted\"", "*", "\\n", "--help", ""]


def bash(line: str) -> str:
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=True).stdout


@pytest.fixture(autouse=True)
def no_pwned():
    subprocess.run(["rm", "-f", "/tmp/torchrig-pwned"])
    yield
    assert not __import__("os").path.exists("/tmp/torchrig-pwned"), "an argument ran as code"


@pytest.mark.parametrize("arg", EVIL)
def test_sh_passes_arguments_verbatim(arg):
    assert bash(sh("printf", "%s|", arg, "end")) == f"{arg}|end|"


@pytest.mark.parametrize("arg", EVIL)
def test_privileged_as_root_keeps_compound_commands_whole(arg):
    # root: no sudo; the compound line runs entirely inside one bash
    line = privileged(sh("printf", "%s", arg) + " && echo second", "root")
    assert not line.startswith("sudo")
    assert bash(line) == f"{arg}second\n"


def test_privileged_for_other_users_is_non_interactive_sudo():
    line = privileged("a && b", "admin")
    assert line == "sudo -n -- bash -c 'a && b'"


@pytest.mark.parametrize("val", EVIL)
def test_with_env_values_are_quoted(val):
    assert bash(with_env('printf %s "$X"', {"X": val})) == val


def test_with_env_rejects_bad_names():
    with pytest.raises(TorchrigError, match="not valid"):
        with_env("true", {"X; rm": "1"})


def test_fingerprint_matches_ssh_keygen(tmp_path):
    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    expected = subprocess.run(["ssh-keygen", "-lf", str(key) + ".pub"], capture_output=True,
                              text=True, check=True).stdout.split()[1]
    pub = paramiko.Ed25519Key.from_private_key_file(str(key))
    assert fingerprint(pub) == expected


def test_known_hosts_name():
    assert known_hosts_name("10.0.0.1", None) == "10.0.0.1"
    assert known_hosts_name("10.0.0.1", 22) == "10.0.0.1"
    assert known_hosts_name("10.0.0.1", 2222) == "[10.0.0.1]:2222"


def test_redact():
    data = {"user": "u", "hf_token": "abc", "nested": {"db_password": "p", "ok": 1},
            "url": "https://bob:hunter2@mirror/x", "list": [{"secret_key": "s"}]}
    out = redact(data)
    assert out["hf_token"] == "***" and out["nested"] == {"db_password": "***", "ok": 1}
    assert out["url"] == "https://bob:***@mirror/x" and out["list"] == [{"secret_key": "***"}]
    assert out["user"] == "u" and "hunter2" not in repr(out)


def test_prefixed_lines_whole_lines_only():
    buf = io.StringIO()
    p = PrefixedLines("gpu1", buf)
    p.write("hel")
    assert buf.getvalue() == ""
    p.write("lo\nwor")
    p.write("ld\r\nlast")
    p.close()
    assert buf.getvalue() == "gpu1 | hello\ngpu1 | world\ngpu1 | last\n"


def test_fan_out_isolates_failures():
    from torchrig.inventory import Host
    hosts = [Host(name=n, connection="ssh", address=n, port=None, user=None, identity_file=None,
                  jump=None, gpus=None, groups=()) for n in ("a", "b", "c")]

    def fn(h):
        if h.name == "b":
            raise ConnectionRefusedError()
        return h.name.upper()

    res = fan_out(hosts, fn, parallel=2)
    assert [(r.host, r.ok, r.value) for r in res] == [("a", True, "A"), ("b", False, None),
                                                      ("c", True, "C")]
    assert "connection refused" in res[1].error


def _pub(tmp_path, name):
    key = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return (tmp_path / f"{name}.pub").read_text().split()[:2]  # [type, base64]


def test_known_hosts_markers_as_openssh(tmp_path, capsys):
    """@cert-authority is skipped with a note, @revoked keys are never accepted, a line paramiko
    cannot read is skipped: paramiko's own loader raises on each (a traceback before)."""
    from torchrig.hostkeys import HostKeyPolicy, HostKeyRevoked, _load_known_hosts
    good, ca, bad = (_pub(tmp_path, n) for n in ("good", "ca", "bad"))
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@cert-authority *.example.com {' '.join(ca)}\n"
                  f"10.0.0.1 {' '.join(good)}\n"
                  f"10.0.0.2 {' '.join(bad)}\n"
                  f"@revoked * {' '.join(bad)}\n"
                  "10.0.0.3 ssh-ed25519 not-base64!\n")
    client = paramiko.SSHClient()
    revoked = _load_known_hosts(client, str(kh))
    keys = client.get_host_keys()
    assert keys.lookup("10.0.0.1")["ssh-ed25519"].get_base64() == good[1]
    assert keys.lookup("10.0.0.2") is None  # its only key is revoked
    err = capsys.readouterr().err
    assert "line 1: @cert-authority skipped" in err and "line 5: not a host key line" in err
    bad_key = paramiko.Ed25519Key(data=__import__("base64").b64decode(bad[1]))
    for accept_new in (False, True):
        with pytest.raises(HostKeyRevoked, match="10.0.0.2 .*@revoked"):
            HostKeyPolicy(str(kh), accept_new, revoked).missing_host_key(client, "10.0.0.2",
                                                                         bad_key)
    assert kh.read_text().count("\n") == 5  # accept-new recorded nothing


def test_ssh_config_proxyjump_hops_in_openssh_order(tmp_path, monkeypatch):
    """`ProxyJump a,b`: ssh connects to a, from there to b, from there to the host. Fabric 3
    chains them the other way round (b first)."""
    from torchrig.inventory import Host, Inventory
    from torchrig.connections import connect
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh/config").write_text("Host target\n  ProxyJump first,second\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    h = Host(name="target", connection="ssh", address="target", port=None, user=None,
             identity_file=None, jump=None, gpus=None, groups=())
    inv = Inventory(path="i.yml", known_hosts=str(tmp_path / "kh"), hosts=(h,), groups={})
    cxn = connect(h, inv)
    hops = []
    gw = cxn.gateway
    while gw:
        hops.append(gw.host)
        gw = gw.gateway
    assert hops == ["second", "first"]  # the host's own gateway is the last hop


def _fastest(fn, runs: int = 3) -> float:
    """The least of a few timings: what the code costs, not what a loaded machine added."""
    import time
    best = float("inf")
    for _ in range(runs):
        t0 = time.monotonic()
        fn()
        best = min(best, time.monotonic() - t0)
    return best


def test_prefixed_lines_long_line_is_linear():
    """A single 8 MB line in 4 KB chunks (as Fabric delivers it) took 18 s: re-splitting the
    growing buffer on every chunk is quadratic. Measured against itself at a quarter of the
    size in the same run (linear: about 4x; the quadratic code: about 16x), not a wall clock."""
    chunk = "x" * 4096

    def one_line(chunks):
        buf = io.StringIO()
        p = PrefixedLines("h", buf)
        for _ in range(chunks):
            p.write(chunk)
        p.write("\nnext\n")
        assert buf.getvalue() == "h | " + chunk * chunks + "\nh | next\n"
    small, big = _fastest(lambda: one_line(512)), _fastest(lambda: one_line(2048))
    assert big < 8 * small + 0.05, f"2 MB: {small:.3f}s, 8 MB: {big:.3f}s"


def test_with_env_names_full_match():
    for bad in ("FOO\n", "1X", "A-B", "é"):
        with pytest.raises(TorchrigError, match="not valid"):
            with_env("true", {bad: "1"})


def test_lost_connection_names_what_ran():
    from torchrig.quoting import doing as _doing
    line = privileged("systemctl show torchrig-x.service\nmore", "admin")
    assert _doing(line) == "systemctl show torchrig-x.service"
    assert _doing("x" * 100).endswith("...") and len(_doing("x" * 100)) == 80
    assert _doing("#!/bin/bash\nset -euo pipefail\n# why\napt-get install -y x\n") == \
        "apt-get install -y x"


def test_exec_of_one_long_line_is_linear(tmp_path):
    """The real `exec` on a `connection: local` host (the same Invoke runner code as over SSH):
    one 8 MB line took 18-32 s (Invoke joined all output so far on every 1 KB chunk). Measured
    against a 2 MB line in the same run: the quadratic code took about 10x as long (start-up
    included), linear code about 1-2x; not a wall-clock bound a loaded machine breaks."""
    import os
    import sys
    from pathlib import Path
    inv = tmp_path / "inv.yml"
    inv.write_text("hosts:\n  - {name: head, connection: local}\n")

    def line_of(n):
        def run():
            r = subprocess.run([sys.executable, "-m", "invoke", "exec", "-i", str(inv),
                                f"head -c {n} /dev/zero | tr '\\0' x; echo; echo next"],
                               cwd=Path(__file__).resolve().parents[2], capture_output=True,
                               text=True, timeout=300, env=os.environ)
            assert r.returncode == 0, r.stderr
            assert r.stdout.startswith("head | " + "x" * n + "\nhead | next\n")
        return run
    small, big = _fastest(line_of(2_000_000), 2), _fastest(line_of(8_000_000), 2)
    assert big < 5 * small, f"2 MB: {small:.1f}s, 8 MB: {big:.1f}s"


@pytest.mark.parametrize("exc,why", [
    (paramiko.ssh_exception.NoValidConnectionsError(
        {("10.0.0.9", 22): ConnectionRefusedError(111, "Connection refused")}),
     "connection refused (nothing listens on that port: sshd stopped, or a wrong port)"),
    (OSError(113, "No route to host"), "no route to the host (it is down, or not on a network "
                                      "this machine reaches)"),
    (__import__("socket").timeout("timed out"), "no answer within 10s (the host is down, or a "
                                               "firewall drops the port)"),
    (__import__("socket").gaierror(-2, "Name or service not known"),
     "cannot resolve the address (Name or service not known)"),
    (paramiko.SSHException("Error reading SSH protocol banner"),
     "no SSH server answered on that port (Error reading SSH protocol banner)"),
    (EOFError(), "no SSH server answered on that port (EOFError)"),
    # through a jump host: the target refused by it, or the jump host itself down
    (paramiko.ChannelException(2, "Connect failed"), "the jump host could not open a connection "
     "to it (Connect failed: the host is down, sshd stopped, or a wrong address or port)"),
])
def test_an_unreachable_host_is_classified_once(exc, why):
    """The one classification (session.cannot_connect, used by Fleet.conn for every task): which
    host, what failed, what to try; fan_out's per-host text is the same without the host."""
    from torchrig.inventory import Host
    from torchrig.session import CannotConnect, cannot_connect, describe_error

    class Cxn:
        user, port = "ops", 2222
    h = Host(name="gpu9", connection="ssh", address="10.0.0.9", port=2222, user="ops",
             identity_file=None, jump="bastion", gpus=None, groups=())
    e = cannot_connect(h, Cxn(), exc)
    assert isinstance(e, CannotConnect) and isinstance(e, TorchrigError)
    assert str(e) == (f"gpu9: unreachable: SSH to ops@10.0.0.9:2222 through jump host bastion "
                      f"failed: {why}; check that the host is up and sshd runs there, and its "
                      "address and port in the inventory (try: ssh -p 2222 ops@10.0.0.9)")
    assert describe_error(e) == e.reason == str(e)[len("gpu9: "):]
    assert describe_error(exc) == f"unreachable: {why}"


def test_the_ssh_socket_sends_and_acknowledges_at_once_and_fails_as_paramikos_own_connect():
    """Nagle's algorithm is off on torchrig's SSH sockets (with it, each command waited 40 ms
    for the server's delayed ACK), and every read is acknowledged at once (sshd's own Nagle
    held each connection's first channel 40 ms for a delayed ACK); a port nobody listens on
    reads as every unreachable host."""
    import socket
    from torchrig.connections import CONNECT_TIMEOUT, ssh_socket, unreachable_why
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with ssh_socket("127.0.0.1", port) as s:
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            assert s.gettimeout() == CONNECT_TIMEOUT  # paramiko's connect timeout, kept
            peer, _ = server.accept()
            with peer:
                # delayed ACKs, as the kernel chooses them in a busy exchange; then a read
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 0
                peer.sendall(b"hostkeys-00")
                assert s.recv(64) == b"hostkeys-00"
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1
    with pytest.raises(OSError) as e:  # the listener is gone: refused
        ssh_socket("127.0.0.1", port)
    assert unreachable_why(e.value).startswith("connection refused")


def test_a_dead_jump_host_is_named_with_its_own_address_and_hint():
    from torchrig.inventory import Host
    from torchrig.connections import JumpHostFailed
    from torchrig.session import cannot_connect

    class Cxn:
        user, port = "ops", 2222
    h = Host(name="gpu9", connection="ssh", address="10.0.0.9", port=2222, user="ops",
             identity_file=None, jump="bastion", gpus=None, groups=())
    e = cannot_connect(h, Cxn(), JumpHostFailed("ops", "10.0.0.1", 22, "connection refused (x)"))
    assert str(e) == ("gpu9: unreachable: SSH to ops@10.0.0.9:2222 through jump host bastion "
                      "failed: the jump host ops@10.0.0.1:22 could not be reached: connection "
                      "refused (x); check that the jump host is up and sshd runs there (try: "
                      "ssh -p 22 ops@10.0.0.1)")


def test_a_refused_login_is_not_called_unreachable():
    from torchrig.inventory import Host
    from torchrig.session import cannot_connect
    h = Host(name="gpu9", connection="ssh", address="10.0.0.9", port=None, user=None,
             identity_file=None, jump=None, gpus=None, groups=())
    e = cannot_connect(h, object(), paramiko.AuthenticationException("Authentication failed."))
    assert str(e) == ("gpu9: SSH authentication failed (Authentication failed.); check user and "
                      "identity_file in the inventory")


def test_the_connector_is_the_only_way_to_run_as_root():
    """Every command run as root goes through a Connector's root=True (connections.py applies
    quoting.privileged): no other module wraps a command in sudo itself."""
    import re
    from pathlib import Path
    pkg = Path(__file__).resolve().parents[2] / "torchrig"
    allowed = {"connections.py", "quoting.py"}
    bad = [f"{p.relative_to(pkg)}:{n}" for p in pkg.rglob("*.py") if p.name not in allowed
           and "testbed" not in p.parts
           for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"\bprivileged\(|\bas_root\(|[\"']sudo -n", line)]
    assert not bad, bad


def test_root_true_runs_as_root_on_a_local_connection():
    from torchrig.connections import LocalConnection, as_root
    c = LocalConnection()
    assert as_root(c, "a && b") == privileged("a && b", c.user)
    if c.user == "root":
        assert c.run("id -u && id -u", root=True, hide=True).stdout == "0\n0\n"
        assert c.run_input("cat; id -u", "x\n", root=True).stdout == "x\n0\n"
