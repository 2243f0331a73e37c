"""`connection: local` hosts implement the whole Connector interface (run, run with stdin,
stream, put) that SSH hosts do; before, a local host had no stream() or put(), so code
written against an SSH connection broke on it."""

import getpass

import pytest
from invoke.exceptions import CommandTimedOut

from torchrig import inventory
from torchrig.connections import LocalConnection
from torchrig.session import Fleet


def test_local_connector_runs_streams_and_puts(tmp_path):
    c = LocalConnection()
    assert c.run("echo hi", hide=True, warn=True).stdout == "hi\n"
    r = c.run_input("cat; echo err >&2; exit 3", "on stdin\n")
    assert (r.exited, r.stdout, r.stderr) == (3, "on stdin\n", "err\n")
    out, err = [], []
    rc = c.stream("cat; printf x >&2", "a\nb\n", out.append, err.append)
    assert rc == 0 and b"".join(out) == b"a\nb\n" and b"".join(err) == b"x"
    assert c.stream("sleep 5", "", out.append, err.append, silence=0.3) is None
    with pytest.raises(CommandTimedOut):  # a timeout holds while the command keeps printing
        c.run_input("while :; do echo y; sleep 0.05; done", "", timeout=1)
    (tmp_path / "src").write_text("payload")
    c.put(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert (tmp_path / "dst").read_text() == "payload"


def test_a_fleet_of_local_hosts(tmp_path):
    p = tmp_path / "inv.yml"
    p.write_text("hosts:\n  - {name: a, connection: local}\n  - {name: b, connection: local}\n")
    inv = inventory.load(p)
    with Fleet(inv, parallel=2) as fleet:
        assert fleet.conn(inv.hosts[0]) is fleet.conn(inv.hosts[0])
        res = fleet.fan_out(lambda h: fleet.run(h, "cat", data=h.name).stdout)
        assert [(r.host, r.value) for r in res] == [("a", "a"), ("b", "b")]
        assert fleet.run(inv.hosts[0], "whoami").stdout.strip() == getpass.getuser()
