"""`power` against real IPMI: OpenIPMI's ipmi_sim on this machine's loopback (the testbed's BMC
stand-in, torchrig/testbed/bmcsim.py), reached through Debian's ipmitool as a real BMC would be.
Needs no testbed hosts: a BMC is reached from the operator's machine."""

import json
import re
import threading
import time

import pytest
from conftest import invoke, sample_argv

from torchrig.testbed.bmcsim import IpmiSim, RedfishSim, free_tcp_port, free_udp_port

GOOD_PW, WRONG_PW = "Bmc-pw-7f3e!", "not-the-pw-19"


@pytest.fixture
def bmcs(tmp_path):
    """gpu3's BMC (password from the operator's environment) and gpu4's (a wrong inline one)."""
    with IpmiSim("admin", GOOD_PW) as gpu3, IpmiSim("admin", "gpu4-real-pw") as gpu4:
        inv = tmp_path / "hosts.yml"
        inv.write_text(f"""groups: {{rack1: {{}}}}
hosts:
  - name: gpu3
    groups: [rack1]
    bmc: {{address: 127.0.0.1, port: {gpu3.port}, user: admin, password_env: GPU3_BMC_PASSWORD,
           cipher_suite: 3}}
  - name: gpu4
    groups: [rack1]
    bmc: {{address: 127.0.0.1, port: {gpu4.port}, user: admin, password: {WRONG_PW},
           cipher_suite: 3}}
  - name: gpu5
    groups: [rack1]
    bmc: {{address: 127.0.0.1, port: {free_udp_port()}, user: admin, password: {WRONG_PW},
           cipher_suite: 3}}
""")
        yield inv, gpu3, gpu4


@pytest.fixture
def power():
    """`power` as a user runs it, every process's argv sampled meanwhile; at the end no password
    is in any call's output or in any command line seen."""
    seen: set = set()
    outputs = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_argv, args=(stop, seen), daemon=True)
    sampler.start()

    def call(inv, *args):
        r = invoke("power", *args, "-i", str(inv), env={"GPU3_BMC_PASSWORD": GOOD_PW},
                   timeout=120)
        return r
    yield call
    stop.set()
    sampler.join()
    for r in outputs:
        assert GOOD_PW not in r.stdout + r.stderr and WRONG_PW not in r.stdout + r.stderr
    assert seen, "the argv sampler saw nothing"
    assert not [a for a in seen if GOOD_PW in a or WRONG_PW in a]


def test_power_status_switch_and_wrong_password(bmcs, power):
    inv, gpu3, gpu4 = bmcs
    r = power(inv, "cycle", "-H", "gpu3")  # no --yes: refused, nothing switched
    assert r.returncode == 1 and "--yes" in r.stderr and gpu3.events() == []

    r = power(inv, "status", "-H", "gpu3", "--json")
    assert r.returncode == 0, r.stderr
    assert [(d["host"], d["power"]) for d in json.loads(r.stdout)] == [("gpu3", "on")]

    r = power(inv, "off", "--yes", "-H", "gpu3")
    assert r.returncode == 0, r.stderr
    assert gpu3.power() == "off"
    r = power(inv, "status", "-H", "gpu3")
    assert re.search(r"^gpu3 \(BMC 127\.0\.0\.1:\d+\): off$", r.stdout, re.M), r.stdout

    r = power(inv, "on", "--yes", "-H", "gpu3")
    assert r.returncode == 0 and gpu3.power() == "on", r.stderr

    r = power(inv, "cycle", "--yes", "-H", "gpu3")
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 20  # ipmi_sim powers on again a second after the off
    while gpu3.events()[-2:] != ["0", "1"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gpu3.events() == ["0", "1", "0", "1"] and gpu3.power() == "on"

    # the rack at once, gpu4's password wrong, nothing answering for gpu5: gpu3 reported, one
    # error line for each of the others
    r = power(inv, "status", "-H", "rack1")
    assert r.returncode == 1
    assert re.search(r"^gpu3 \(BMC 127\.0\.0\.1:\d+\): on$", r.stdout, re.M), r.stdout
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert [e.split(":")[1] for e in errors] == [" gpu4 (BMC 127.0.0.1", " gpu5 (BMC 127.0.0.1"]
    assert f"error: gpu4 (BMC 127.0.0.1:{gpu4.port}): no IPMI session: wrong user or password" \
        in errors[0] and "Traceback" not in r.stderr


@pytest.fixture
def redfish_bmcs(tmp_path):
    """gpu3's Redfish BMC (sushy-tools' emulator), gpu4's with a wrong password, and gpu5 whose
    `BMC` is a plain web server without Redfish."""
    import http.server

    class NotRedfish(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotRedfish)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    with RedfishSim("admin", GOOD_PW) as gpu3:
        inv = tmp_path / "hosts.yml"
        common = "protocol: redfish, scheme: http, address: 127.0.0.1, user: admin"
        inv.write_text(f"""hosts:
  - {{name: gpu3, bmc: {{{common}, port: {gpu3.port}, password_env: GPU3_BMC_PASSWORD}}}}
  - {{name: gpu4, bmc: {{{common}, port: {gpu3.port}, password: {WRONG_PW}}}}}
  - {{name: gpu5, bmc: {{{common}, port: {web.server_address[1]}, password: {WRONG_PW}}}}}
  - {{name: gpu6, bmc: {{{common}, port: {free_tcp_port()}, password: {WRONG_PW}}}}}
""")
        yield inv, gpu3, web.server_address[1]
    web.shutdown()


def test_redfish_status_switch_and_failures(redfish_bmcs, power):
    inv, gpu3, web_port = redfish_bmcs
    r = power(inv, "status", "-H", "gpu3", "--json")
    assert r.returncode == 0, r.stderr
    assert [(d["host"], d["power"]) for d in json.loads(r.stdout)] == [("gpu3", "on")]

    r = power(inv, "off", "-H", "gpu3")  # no --yes: refused, nothing asked of the BMC
    assert r.returncode == 1 and "--yes" in r.stderr and "pending_power" not in gpu3.system()

    # the emulator's fake server applies a switch 1-11 s later: its pending switch is the
    # BMC's side of the request
    r = power(inv, "off", "--yes", "-H", "gpu3")
    assert r.returncode == 0, r.stderr
    assert gpu3.system()["pending_power"]["power_state"] == "Off"
    r = power(inv, "cycle", "--yes", "-H", "gpu3")
    assert r.returncode == 0 and "cycle accepted (ForceRestart)" in r.stdout, r.stderr
    assert gpu3.system()["pending_power"]["power_state"] == "ForceRestart"

    r = power(inv, "status", "-H", "gpu3,gpu4,gpu5,gpu6")
    assert r.returncode == 1
    assert re.search(rf"^gpu3 \(BMC 127\.0\.0\.1:{gpu3.port}\): (on|off)$", r.stdout, re.M)
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(errors) == 3 and "Traceback" not in r.stderr, r.stderr
    assert errors[0].startswith(f"error: gpu4 (BMC 127.0.0.1:{gpu3.port}): the BMC refused "
                                "the login")
    assert errors[1].startswith(f"error: gpu5 (BMC 127.0.0.1:{web_port}): no Redfish service")
    assert errors[2].startswith("error: gpu6 (BMC 127.0.0.1:") and "cannot reach the Redfish " \
        "service at http://127.0.0.1:" in errors[2] and "Connection refused" in errors[2]
