"""One testbed host: an overlay root over the base image, booted under the supervisor."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ..errors import TorchrigError
from . import gpu_profiles
from .paths import host_dir, machine, netns
from .supervisor import cgroup_dirs

SIM_NOTE = ("This host is a torchrig TESTBED SIMULATION (systemd-nspawn container).\n"
            "Its GPUs are described by gpu-profile.json and answered by a stand-in nvidia-smi;\n"
            "no NVIDIA hardware or software is present.\n")


def root_of(name: str) -> Path:
    return host_dir(name) / "root"


def is_mounted(path: Path) -> bool:
    return os.path.ismount(path)


def mount(name: str, base: Path) -> Path:
    d = host_dir(name)
    for sub in ("upper", "work", "root"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    root = d / "root"
    if not is_mounted(root):
        # nspawn's own --overlay does not work here; a plain overlay mount does.
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={base},upperdir={d / 'upper'},workdir={d / 'work'}", str(root)],
                       check=True, capture_output=True)
    return root


def unmount(name: str) -> None:
    root = root_of(name)
    if is_mounted(root):
        subprocess.run(["umount", str(root)], check=True, capture_output=True)


def configure(name: str, ip: str, peers: dict[str, str], pubkey: str, profile: str) -> None:
    """Identity of a host: hostname, /etc/hosts for every peer, its own SSH host keys (kept
    across reboots in the overlay), the operator's key for root and admin, its GPU profile."""
    root = root_of(name)
    (root / "etc/hostname").write_text(name + "\n")
    hosts = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    hosts += [f"{pip} {pname}" for pname, pip in peers.items()]
    # The c10d store listens on a dual-stack socket, so a peer's address reaches it as
    # ::ffff:a.b.c.d; a cluster's DNS answers those reverse lookups, glibc's hosts file does
    # not (without these lines every rank logs "[c10d] The hostname of the client socket
    # cannot be retrieved. err=-3")
    hosts += [f"::ffff:{pip} {pname}" for pname, pip in peers.items()]
    (root / "etc/hosts").write_text("\n".join(hosts) + "\n")
    mid = root / "etc/machine-id"
    if not mid.read_text().strip():  # its own identity, kept across reboots
        mid.write_text(uuid.uuid4().hex + "\n")
    if not list((root / "etc/ssh").glob("ssh_host_*_key")):
        subprocess.run(["ssh-keygen", "-A", "-f", str(root)], check=True, capture_output=True)
    for home, owner in (("root", "root"), ("home/admin", "admin")):
        ssh = root / home / ".ssh"
        ssh.mkdir(mode=0o700, exist_ok=True)
        (ssh / "authorized_keys").write_text(pubkey)
        subprocess.run(["chroot", str(root), "chown", "-R", f"{owner}:{owner}", f"/{home}/.ssh"],
                       check=True, capture_output=True)
    install_profile(name, profile)
    install_gpu_devices(root)


# Hardware simulation, like lspci: once the stand-in driver has "loaded its module" at boot,
# the GPUs' device files appear (/dev/nvidiaN, NVIDIA's char major 195, nothing behind them),
# so software that looks for them (Slurm's gres.conf File=) finds one per simulated GPU.
GPU_DEVICES_UNIT = """[Unit]
Description=torchrig testbed: device files of the simulated GPUs (stand-ins, no driver behind them)
After=nvidia-standin-module.service
ConditionPathExists=/run/nvidia-standin/module-version

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/bin/python3 -c 'import json, os; n = len(json.load(open("/etc/torchrig-testbed/gpu-profile.json"))["gpus"]); [os.path.exists(f"/dev/nvidia{i}") or os.mknod(f"/dev/nvidia{i}", 0o20666, os.makedev(195, i)) for i in range(n)]'

[Install]
WantedBy=multi-user.target
"""
GPU_DEVICES = "nvidia-standin-devices.service"  # never torchrig-<name>.service: that is a job's unit name


def install_gpu_devices(root: Path) -> None:
    unit = root / "etc/systemd/system" / GPU_DEVICES
    unit.write_text(GPU_DEVICES_UNIT)
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    if not (wants / GPU_DEVICES).is_symlink():
        (wants / GPU_DEVICES).symlink_to(f"/etc/systemd/system/{GPU_DEVICES}")


def install_profile(name: str, profile: str) -> None:
    """Give host `name` the simulated GPUs of `profile` (stand-in nvidia-smi's JSON, simulated
    lspci); a running host sees them at its next nvidia-smi call."""
    root = root_of(name)
    sim = root / "etc/torchrig-testbed"
    sim.mkdir(exist_ok=True)
    (sim / "README").write_text(SIM_NOTE)
    (sim / "gpu-profile.json").write_text(gpu_profiles.to_json(profile))
    (sim / "profile-name").write_text(profile + "\n")
    lspci = root / "usr/local/bin/lspci"
    lspci.write_text(lspci_standin(gpu_profiles.load(profile)))
    lspci.chmod(0o755)
    dmesg = root / "usr/local/bin/dmesg"
    dmesg.write_text(DMESG_STANDIN)
    dmesg.chmod(0o755)


# A container has no kernel log of its own (journalctl -k finds nothing, dmesg shows the
# machine's): the simulated GPUs' kernel messages come from this stand-in, first on PATH
# like lspci's. Tests append "2026-12-03T14:00:00,000000+00:00 NVRM: Xid (...)" lines
# (dmesg --time-format iso's form) to KMSG.
KMSG = "/etc/torchrig-testbed/kmsg"
DMESG_STANDIN = f"""#!/bin/sh
# torchrig TESTBED STAND-IN for `dmesg` (not util-linux): the simulated GPUs' kernel messages,
# injected into {KMSG} by tests. --time-format iso prints them as stored, else with a
# seconds-since-boot stamp as plain dmesg does.
[ -f {KMSG} ] || exit 0
case " $* " in
  *" --time-format iso "*|*" --time-format=iso "*) cat {KMSG} ;;
  *) sed 's/^[^ ]* /[    1.000000] /' {KMSG} ;;
esac
"""


# PCI identity of the simulated GPUs, by marketing name: (chip, device id).
PCI_CHIPS = {"V100": ("GV100GL", "1df6"), "H100": ("GH100", "2330"), "A100": ("GA100", "20b0"),
             "A6000": ("GA102GL", "2230"), "2080": ("TU102", "1e07"), "L4": ("AD104GL", "27b8"),
             "4090": ("AD102", "2684")}


def lspci_standin(profile: dict) -> str:
    """The simulated PCI bus: NVIDIA devices of the profile (GPUs, NVSwitches) first, then
    the container's real lspci. Hardware simulation, installed by the testbed, not a package."""
    lines = []
    for g in profile["gpus"]:
        chip, dev = next((v for k, v in PCI_CHIPS.items() if k in g["name"]), ("GPU", "ffff"))
        bus = g["pci_bus_id"].split(":", 1)[1].lower()
        lines.append(f"{bus} 3D controller [0302]: NVIDIA Corporation {chip} [{g['name']}] "
                     f"[10de:{dev}] (rev a1)")
    if profile.get("nvswitch"):
        lines += [f"{0x80 + i:02x}:00.0 Bridge [0680]: NVIDIA Corporation GH100 [H100 NVSwitch] "
                  f"[10de:22a3] (rev a1)" for i in range(4)]
    body = "\n".join(lines)
    return ("#!/bin/sh\n# torchrig TESTBED STAND-IN: simulated NVIDIA PCI devices, then the real bus.\n"
            f"cat <<'EOF'\n{body}\nEOF\nexec /usr/bin/lspci \"$@\"\n")


def host_keys(name: str) -> list[str]:
    """'type base64' of each host key, read from the host's disk (the trust anchor, as a
    cloud console would print them), never from the network."""
    out = []
    for pub in sorted((root_of(name) / "etc/ssh").glob("ssh_host_*_key.pub")):
        parts = pub.read_text().split()
        out.append(f"{parts[0]} {parts[1]}")
    return out


def _pidfile(name: str) -> Path:
    return host_dir(name) / "supervisor.pid"


def supervisor_pid(name: str) -> int | None:
    try:
        pid = int(_pidfile(name).read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def start(name: str) -> None:
    if supervisor_pid(name):
        return
    log = open(host_dir(name) / "console.log", "ab")
    p = subprocess.Popen(
        [sys.executable, "-m", "torchrig.testbed.supervisor", machine(name), str(root_of(name)),
         f"/run/netns/{netns(name)}"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        cwd="/", env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    _pidfile(name).write_text(str(p.pid))


def stop(name: str, timeout: float = 60) -> None:
    """Clean poweroff through the supervisor; SIGKILL the whole session if it hangs."""
    pid = supervisor_pid(name)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
            time.sleep(0.5)
    _pidfile(name).unlink(missing_ok=True)
    # An nspawn left over from a crashed supervisor, or a container that outlived its nspawn,
    # would pin the mount: kill whatever still runs inside this host's root.
    subprocess.run(["pkill", "-KILL", "-f", "--", f"--machine={machine(name)} "], capture_output=True)
    for pid in _inside(root_of(name)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for top in cgroup_dirs(machine(name)):  # the host's own cgroups (see supervisor.own_cgroup)
        for d, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(d)  # empty cgroups only; one still in use stays
            except OSError:
                pass


def _inside(root: Path) -> list[int]:
    """Processes whose root directory is `root` (a container's, seen from outside). Compared by
    device and inode: readlink of /proc/PID/root shows "/" from inside the container."""
    try:
        want = (os.stat(root).st_dev, os.stat(root).st_ino)
    except OSError:
        return []
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and p.name != str(os.getpid()):
            try:
                st = os.stat(p / "root")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == want:
                out.append(int(p.name))
    return out


def power_off(name: str) -> None:
    """Pull the plug: SIGKILL the container's init, which takes every process of the host
    with it at once (no shutdown, no FIN from a clean exit), then its nspawn and supervisor.
    The overlay and the network namespace stay, as a disk and a cable would: start() boots it."""
    nspawn = subprocess.run(["pgrep", "-f", "--", f"--machine={machine(name)} "],
                            capture_output=True, text=True).stdout.split()
    for pid in nspawn:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            children = []
        for child in children:
            try:
                os.kill(int(child), signal.SIGKILL)
            except ProcessLookupError:
                pass
    sup = supervisor_pid(name)
    if sup:
        os.killpg(sup, signal.SIGKILL)
    stop(name, timeout=10)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap if it is our child (same process started it)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie that is not ours still counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_ssh(ip: str, timeout: float = 60) -> None:
    """Until sshd on the host sends its banner."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((ip, 22), timeout=2) as s:
                s.settimeout(2)
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TorchrigError(f"testbed host at {ip} did not answer on SSH within {timeout:.0f}s; "
                        "see its console.log under the testbed state directory")
