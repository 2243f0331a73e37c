"""A TEST DOUBLE of session.Connector that counts round trips: FakeConnector answers each
command through the test's `answer(host, command, data)` -> (exit, stdout, stderr) and records
every call per host (calls: [(host, command, data, stdout)]). fake_fleet() makes a real Fleet
whose connections are these, so the code under test runs unchanged above the connection."""

from __future__ import annotations

import base64
import json
import re

from torchrig import session
from torchrig.connections import Ran


class FakeConnector:
    """Test double: no host, no SSH; every run/run_input/stream/put is one counted call."""

    def __init__(self, host, answer, calls: list):
        self.host, self.answer, self.calls = host, answer, calls
        self.user, self.lost, self.is_connected = "root", False, True

    def open(self):
        pass

    def _call(self, command, data=""):
        rc, out, err = self.answer(self.host.name, command, data or "")
        self.calls.append((self.host.name, command, data or "", out))
        return Ran(rc, out, err)

    def run(self, command, *, root=False, **kwargs):
        r = self._call(command)
        return type("Result", (), {"exited": r.exited, "stdout": r.stdout, "stderr": r.stderr,
                                   "ok": r.exited == 0})()

    def run_input(self, command, data, timeout=600, *, root=False):
        return self._call(command, data)

    def stream(self, command, data, on_out, on_err, *, root=False, timeout=None, silence=None):
        r = self._call(command, data if isinstance(data, str) else "")
        on_out(r.stdout.encode())
        on_err(r.stderr.encode())
        return r.exited

    def put(self, local, remote):
        self._call(f"put {local} {remote}")

    def close(self):
        pass


def fake_fleet(monkeypatch, inv, answer, hosts=None):
    """(a Fleet over inv whose connections are FakeConnectors, the calls list they fill)."""
    calls: list = []
    monkeypatch.setattr(session, "connect",
                        lambda host, inv, accept_new=False: FakeConnector(host, answer, calls))
    return session.Fleet(inv, hosts, parallel=4), calls


def probe_request(data: str, end: str = "$") -> dict | None:
    """The request a probe's stdin carries (facts/probe.py stdin()), None for other input.
    end: what follows the probe (a start script's look: its heredoc's delimiter line)."""
    m = re.search(r'\nmain\("([A-Za-z0-9+/=]+)"\)\n' + end, data)
    return json.loads(base64.b64decode(m.group(1))) if m else None


def per_host(calls: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for host, *_ in calls:
        out[host] = out.get(host, 0) + 1
    return out
