"""Testbed stand-in for a server's BMC: OpenIPMI's `ipmi_sim` (Debian's openipmi package)
answering IPMI over LAN on this machine's loopback, with a user and password and a chassis
whose power a test reads and whose switches it sees (standins/ipmi-chassis). Tests only; the
product reaches it exactly as a real BMC, through ipmitool."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

CHASSIS = Path(__file__).with_name("standins") / "ipmi-chassis"
# One BMC (MC 0x20) with no sensors: enough for chassis status and control.
EMU = """mc_setbmc 0x20
mc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02 persist_sdr
mc_enable 0x20
"""
LAN_CONF = """name "torchrig-bmc"
set_working_mc 0x20
  startlan 1
    addr 127.0.0.1 {port}
    priv_limit admin
    allowed_auths_callback md5
    allowed_auths_user md5
    allowed_auths_operator md5
    allowed_auths_admin md5
    guid a123456789abcdefa123456789abcdef
  endlan
  chassis_control "{chassis} {dir}"
  user 2 true "{user}" "{password}" admin 10 md5
"""


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    want = f"0100007F:{port:04X}"
    return any(line.split()[1] == want
               for line in Path("/proc/net/udp").read_text().splitlines()[1:])


class IpmiSim:
    """`with IpmiSim(user, password) as bmc:` a BMC at 127.0.0.1:bmc.port; bmc.power() is the
    chassis' state ('on'/'off'), bmc.events() its switches so far ('0' off, '1' on)."""

    def __init__(self, user: str, password: str, power: str = "on"):
        self.user, self.password, self.initial = user, password, power
        self.dir = Path(tempfile.mkdtemp(prefix="torchrig-bmcsim-"))  # 0700, ours
        self.port = free_udp_port()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> IpmiSim:
        (self.dir / "power").write_text("1\n" if self.initial == "on" else "0\n")
        (self.dir / "events").write_text("")
        conf = self.dir / "lan.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(LAN_CONF.format(port=self.port, chassis=CHASSIS, dir=self.dir,
                                    user=self.user, password=self.password))
        (self.dir / "sim.emu").write_text(EMU)
        (self.dir / "state").mkdir()
        self.proc = subprocess.Popen(
            ["ipmi_sim", "-c", str(conf), "-f", str(self.dir / "sim.emu"),
             "-s", str(self.dir / "state"), "-n", "-p"],
            stdin=subprocess.DEVNULL, stdout=open(self.dir / "sim.log", "w"),
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not _listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"ipmi_sim did not start: {(self.dir / 'sim.log').read_text()}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def power(self) -> str:
        return "on" if (self.dir / "power").read_text().strip() == "1" else "off"

    def events(self) -> list[str]:
        return (self.dir / "events").read_text().split()


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SYSTEM_UUID = "27946b59-9e44-4fa7-8e91-f3527a1ef094"
SUSHY_CONF = """SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'
SUSHY_EMULATOR_LISTEN_PORT = {port}
SUSHY_EMULATOR_AUTH_FILE = {auth!r}
SUSHY_EMULATOR_FAKE_DRIVER = True
SUSHY_EMULATOR_STATE_DIR = {state!r}
SUSHY_EMULATOR_FAKE_SYSTEMS = [{{'uuid': {uuid!r}, 'name': 'server', 'power_state': {power!r},
                                 'external_notifier': False, 'nics': []}}]
"""


class RedfishSim:
    """`with RedfishSim(user, password) as bmc:` a Redfish service at http://127.0.0.1:bmc.port:
    OpenStack's sushy-tools emulator with its fake driver (a server without libvirt), HTTP
    Basic auth from a bcrypt htpasswd file. bmc.system() is the emulator's own record of the
    server (power_state, and pending_power: a switch the fake hardware applies 1-11 s later)."""

    def __init__(self, user: str, password: str, power: str = "On"):
        self.user, self.password, self.initial = user, password, power
        self.dir = Path(tempfile.mkdtemp(prefix="torchrig-redfishsim-"))
        self.port = free_tcp_port()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RedfishSim:
        import sys

        import bcrypt
        auth = self.dir / "htpasswd"
        auth.write_text(f"{self.user}:"
                        + bcrypt.hashpw(self.password.encode(), bcrypt.gensalt(4)).decode() + "\n")
        conf = self.dir / "emulator.conf"
        conf.write_text(SUSHY_CONF.format(port=self.port, auth=str(auth), uuid=SYSTEM_UUID,
                                          state=str(self.dir / "state"), power=self.initial))
        emulator = Path(sys.executable).with_name("sushy-emulator")
        self.proc = subprocess.Popen([str(emulator), "--config", str(conf)],
                                     stdin=subprocess.DEVNULL,
                                     stdout=open(self.dir / "emulator.log", "w"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "emulator.log").read_text()
                self.__exit__(None, None, None)
                raise RuntimeError(f"sushy-emulator did not start: {log}")
            time.sleep(0.1)

    __exit__ = IpmiSim.__exit__

    def system(self) -> dict:
        """The fake server as the emulator stores it (its sqlite state, pickled values)."""
        import pickle
        import sqlite3
        with sqlite3.connect(self.dir / "state" / "fakedriver.sqlite") as db:
            row = db.execute("select value from cache where key=?",
                             (pickle.dumps(SYSTEM_UUID),)).fetchone()
        return pickle.loads(row[0])
