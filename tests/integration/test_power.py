"""`power` against real IPMI: OpenIPMI's ipmi_sim on this machine's loopback (the testbed's BMC
stand-in, torchrig/testbed/bmcsim.py), reached through Debian's ipmitool as a real BMC would be.
Needs no testbed hosts: a BMC is reached from the operator's machine."""

import json
import re
import threading
import time

import pytest
from conftest import invoke, sample_argv

from torchrig.testbed.bmcsim import IpmiSim

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
""")
        yield inv, gpu3, gpu4


def power(inv, *args):
    return invoke("power", *args, "-i", str(inv), env={"GPU3_BMC_PASSWORD": GOOD_PW}, timeout=120)


def test_power_status_switch_and_wrong_password(bmcs):
    inv, gpu3, gpu4 = bmcs
    seen: set = set()
    stop = threading.Event()
    sampler = threading.Thread(target=sample_argv, args=(stop, seen), daemon=True)
    sampler.start()
    outputs = []
    try:
        r = power(inv, "cycle", "-H", "gpu3")  # no --yes: refused, nothing switched
        outputs.append(r)
        assert r.returncode == 1 and "--yes" in r.stderr and gpu3.events() == []

        r = power(inv, "status", "-H", "gpu3", "--json")
        outputs.append(r)
        assert r.returncode == 0, r.stderr
        assert [(d["host"], d["power"]) for d in json.loads(r.stdout)] == [("gpu3", "on")]

        r = power(inv, "off", "--yes", "-H", "gpu3")
        outputs.append(r)
        assert r.returncode == 0, r.stderr
        assert gpu3.power() == "off"
        r = power(inv, "status", "-H", "gpu3")
        outputs.append(r)
        assert re.search(r"^gpu3 \(BMC 127\.0\.0\.1:\d+\): off$", r.stdout, re.M), r.stdout

        r = power(inv, "on", "--yes", "-H", "gpu3")
        outputs.append(r)
        assert r.returncode == 0 and gpu3.power() == "on", r.stderr

        r = power(inv, "cycle", "--yes", "-H", "gpu3")
        outputs.append(r)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 20  # ipmi_sim powers on again a second after the off
        while gpu3.events()[-2:] != ["0", "1"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gpu3.events() == ["0", "1", "0", "1"] and gpu3.power() == "on"

        # both hosts at once, gpu4's password wrong: gpu3 reported, one error line for gpu4
        r = power(inv, "status", "-H", "rack1")
        outputs.append(r)
        assert r.returncode == 1
        assert re.search(r"^gpu3 \(BMC 127\.0\.0\.1:\d+\): on$", r.stdout, re.M), r.stdout
        errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(errors) == 1 and errors[0].startswith(f"error: gpu4 (BMC 127.0.0.1:{gpu4.port})")
        assert "password" in errors[0] and "Traceback" not in r.stderr
    finally:
        stop.set()
        sampler.join()
    for r in outputs:
        for pw in (GOOD_PW, WRONG_PW):
            assert pw not in r.stdout + r.stderr
    assert any("ipmitool" in a for a in seen), "the sampler never saw ipmitool run"
    assert not [a for a in seen if GOOD_PW in a or WRONG_PW in a]
