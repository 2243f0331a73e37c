"""Fleet.preconnect(): every host's connection opens on a thread while the task goes on, and
a host's first conn() takes that connection, or that attempt's error, never a second try
(an unreachable host costs one connect timeout, as without preconnect)."""

import socket

import pytest

from torchrig import inventory, session
from torchrig.session import CannotConnect, Fleet


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused at once
    return port


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = session.connect

    def connect(host, inv, **kw):
        calls.append(host.name)
        return real(host, inv, **kw)
    monkeypatch.setattr(session, "connect", connect)
    return calls


def test_preconnect_opens_each_host_once_and_keeps_its_error(tmp_path, counted):
    key = tmp_path / "id"
    key.write_text("not used: the port refuses first\n")
    p = tmp_path / "inv.yml"
    p.write_text("known_hosts: " + str(tmp_path / "kh") + "\nhosts:\n"
                 "  - {name: a, connection: local}\n"
                 f"  - {{name: down, address: 127.0.0.1, port: {_closed_port()}, user: root, "
                 f"identity_file: {key}}}\n")
    (tmp_path / "kh").write_text("")
    inv = inventory.load(p)
    a, down = inv.hosts
    with Fleet(inv) as fleet:
        fleet.preconnect()
        assert fleet.run(a, "echo up").stdout == "up\n"
        with pytest.raises(CannotConnect, match="unreachable"):
            fleet.conn(down)
        assert sorted(counted) == ["a", "down"]  # the error came from preconnect's attempt
        with pytest.raises(CannotConnect):     # a later use tries again
            fleet.conn(down)
        assert sorted(counted) == ["a", "down", "down"]
        assert fleet.conn(a) is fleet.conn(a) and counted.count("a") == 1
