"""The testbed refuses a subnet another interface already holds (two testbeds on one /24
would answer for each other's addresses)."""

import os
import shutil
import subprocess
import uuid

import pytest

from torchrig.errors import TorchrigError
from torchrig.testbed import net


def test_other_devices_on_the_subnet_are_named_and_the_bridge_itself_is_not():
    routes = [{"dst": "10.213.7.0/24", "dev": "trbt0"}, {"dst": "10.213.7.0/24", "dev": "trbi"},
              {"dst": "10.213.7.0/24"}]
    assert net.taken_by(routes, "trbt0") == ["trbi"]
    assert net.taken_by(routes[:1], "trbt0") == []


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and ip")
def test_a_bridge_on_a_subnet_another_interface_holds_is_refused(monkeypatch):
    other = "trbx" + uuid.uuid4().hex[:6]
    subnet = "10.213.251"
    subprocess.run(["ip", "link", "add", other, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{subnet}.1/24", "dev", other], check=True)
        subprocess.run(["ip", "link", "set", other, "up"], check=True)
        monkeypatch.setattr(net, "SUBNET", subnet)
        monkeypatch.setattr(net, "BRIDGE", "trby" + uuid.uuid4().hex[:6])
        with pytest.raises(TorchrigError, match=rf"{subnet}\.0/24 is already on {other}"):
            net.ensure_bridge()
        assert subprocess.run(["ip", "link", "show", net.BRIDGE],
                              capture_output=True).returncode != 0  # nothing made
    finally:
        subprocess.run(["ip", "link", "del", other], check=False)
