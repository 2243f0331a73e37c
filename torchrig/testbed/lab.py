"""testbed.up / down / status: N simulated GPU servers on this machine.

Each host is a real Linux machine to the toolkit (systemd, sshd, its own address and keys);
only the GPUs and NVIDIA's servers are simulated. The toolkit has no testbed special cases:
everything that differs (mirror and index URLs, known_hosts) is in the inventory it writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ..errors import TorchrigError
from . import aptrepo, debmirror, gpu_profiles, image, machines, net, pyindex
from .supervisor import cgroup_dirs
from .paths import (BRIDGE, CACHE, GATEWAY_IP, HTTP_PORT, MAX_HOSTS, STATE,
                    base_url, host_ip, http_log, www)

DEFAULT_PROFILE = "v100s-nvlink-2"


def require_root() -> None:
    if platform.system() != "Linux":
        raise TorchrigError("the testbed needs Linux (systemd-nspawn, overlayfs, netns)")
    if os.geteuid() != 0:
        raise TorchrigError("the testbed needs root (mounts, network namespaces, nspawn); "
                            "rerun as root, e.g. `sudo -E torchrig testbed.up`")


def parse_profiles(spec: str | None, names: list[str]) -> dict[str, str]:
    """'v100s-nvlink-2' for all, or 'h100-nvswitch-8,gpu2=pcie-sys-4' (default + per host)."""
    known = gpu_profiles.names()
    default, per_host = DEFAULT_PROFILE, {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        host, _, prof = item.rpartition("=")
        if prof not in known:
            raise TorchrigError(f"--profile: unknown GPU profile {prof!r}; known: "
                                f"{', '.join(known)} (add one as torchrig/testbed/profiles/NAME.yml)")
        if host and host not in names:
            raise TorchrigError(f"--profile: {host!r} is not one of the testbed hosts "
                                f"({', '.join(names)})")
        if host:
            per_host[host] = prof
        else:
            default = prof
    return {n: per_host.get(n, default) for n in names}


def _operator_key() -> str:
    key = STATE / "id_ed25519"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "torchrig-testbed",
                        "-f", str(key)], check=True)
    return (STATE / "id_ed25519.pub").read_text()


def _serve() -> None:
    """Plain HTTP on the bridge address only: the apt repo and the pip index."""
    pidf = STATE / "http.pid"
    if _pid_alive(pidf):
        return
    log = open(http_log(), "ab")
    p = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", GATEWAY_IP,
                          "--directory", str(www()), str(HTTP_PORT)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    pidf.write_text(str(p.pid))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((GATEWAY_IP, HTTP_PORT), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TorchrigError(f"the testbed's HTTP server did not start; see {http_log()}")


def _pid_alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _state() -> dict:
    try:
        return json.loads((STATE / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def up(n: int, profile: str | None, inventory_path: str, log=print) -> dict:
    require_root()
    if not 1 <= n <= MAX_HOSTS:
        raise TorchrigError(f"--hosts must be between 1 and {MAX_HOSTS}, got {n}")
    names = [f"gpu{i}" for i in range(1, n + 1)]
    profiles = parse_profiles(profile, names)
    previous = _state().get("hosts", {})
    extra = [h for h in previous if h not in names]
    if extra:
        raise TorchrigError(f"a testbed with {len(previous)} hosts is up; run `torchrig "
                            "testbed.down` first to change the number of hosts")
    t0 = time.monotonic()
    with _cache_lock(log):
        base = image.ensure_base(log)
        repo = aptrepo.ensure_repo()
        mirror = debmirror.ensure_mirror(base, log)
        wheels = pyindex.ensure_wheels()
    STATE.mkdir(parents=True, exist_ok=True)
    os.chmod(STATE, 0o700)
    pubkey = _operator_key()
    w = www()
    (w / aptrepo.REPO_PATH).parent.mkdir(parents=True, exist_ok=True)
    _link(w / aptrepo.REPO_PATH, repo)
    _link(w / debmirror.URL_PATH, mirror)
    pyindex.write_index(wheels, w / "pypi")
    net.ensure_bridge()
    _serve()
    peers = {name: host_ip(i) for i, name in enumerate(names, 1)}
    for name in names:
        net.add_host(name, peers[name])
        _boot(name, base, peers, pubkey, profiles[name])
    for name in names:
        machines.wait_ssh(peers[name])
    known = [f"{peers[n]} {k}" for n in names for k in machines.host_keys(n)]
    (STATE / "known_hosts").write_text("\n".join(known) + "\n")
    state = {"hosts": {n: {"ip": peers[n], "profile": profiles[n]} for n in names},
             "inventory": str(Path(inventory_path).resolve())}
    (STATE / "state.json").write_text(json.dumps(state, indent=1))
    write_inventory(inventory_path, names, peers, profiles)
    state["seconds"] = round(time.monotonic() - t0, 1)
    return state


@contextlib.contextmanager
def _cache_lock(log):
    """The cache is shared by every testbed on this machine (parallel test runs): one builder
    at a time, or a second `up` would delete the first one's half-built image under it."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another testbed to finish building the cache in {CACHE}")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _boot(name: str, base: Path, peers: dict[str, str], pubkey: str, profile: str) -> None:
    machines.mount(name, base)
    machines.configure(name, peers[name], peers, pubkey, profile)
    debmirror.configure_host(machines.root_of(name))
    machines.start(name)


# what a host keeps across a reset: its identity (the known_hosts lines, the machine id)
_IDENTITY = ("etc/machine-id", "etc/ssh/ssh_host_*")


def reset_host(name: str, log=print) -> None:
    """One host of the running testbed made fresh again, as `up` made it (for tests of the
    fresh path in any order): everything written on it since is dropped, its address, machine
    id and SSH host keys are kept."""
    require_root()
    hosts = _state().get("hosts", {})
    if name not in hosts:
        raise TorchrigError(f"no testbed host {name!r} is up (hosts: {', '.join(hosts) or 'none'})")
    peers = {n: h["ip"] for n, h in hosts.items()}
    machines.stop(name)
    machines.unmount(name)
    upper = machines.root_of(name).parent / "upper"
    kept = {p.relative_to(upper): (p.read_bytes(), p.stat().st_mode & 0o7777)
            for pattern in _IDENTITY for p in upper.glob(pattern) if p.is_file() and not p.is_symlink()}
    for sub in ("upper", "work"):
        shutil.rmtree(upper.parent / sub, ignore_errors=True)
    base = image.ensure_base(log)
    machines.mount(name, base)
    root = machines.root_of(name)
    for rel, (data, mode) in kept.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        os.chmod(root / rel, mode)
    _boot(name, base, peers, _operator_key(), hosts[name]["profile"])
    machines.wait_ssh(peers[name])


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def write_inventory(path: str, names: list[str], peers: dict[str, str],
                    profiles: dict[str, str]) -> None:
    doc = {
        "known_hosts": str(STATE / "known_hosts"),
        "defaults": {"user": "admin", "identity_file": str(STATE / "id_ed25519")},
        "vars": {
            # What a real air-gapped cluster sets to its own mirrors.
            "cuda_repo_url": f"{base_url()}/cuda/repos",
            "pip_index_url": f"{base_url()}/pypi/simple",
            "pip_trusted_host": GATEWAY_IP,
            "tensorboard_index_url": f"{base_url()}/pypi/simple",  # installed only where asked
            "deps_index_url": f"{base_url()}/pypi/simple",  # a project's requirements
            # the stand-in CUDA cannot compile nccl-tests (and the hosts have no compiler)
            "nccl_tests": False,
            # CPU torch and gloo: the stand-in GPUs cannot run CUDA
            "accelerator": "cpu",
        },
        "groups": {"testbed": {"description": "simulated GPU servers (torchrig testbed)"}},
        "hosts": [{"name": n, "address": peers[n], "gpus": len(gpu_profiles.load(profiles[n])["gpus"]),
                   "groups": ["testbed"]}
                  for n in names],
    }
    # the GPU profiles as a comment: torchrig itself reads nothing of the testbed's
    header = ("# Written by `torchrig testbed.up`: hosts of the local TESTBED SIMULATION\n"
              "# (systemd-nspawn containers with stand-in GPUs). `torchrig testbed.down` removes it.\n"
              + "".join(f"# {n}: GPU profile {profiles[n]}\n" for n in names))
    tmp = Path(path).with_suffix(".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    tmp.replace(path)


def down(log=print) -> list[str]:
    """Stop every host, unmount, remove interfaces and namespaces, stop the server."""
    require_root()
    state = _state()
    names = sorted(set(state.get("hosts", {})) |
                   {p.name for p in (STATE / "hosts").glob("*") if p.is_dir()})
    for name in names:
        machines.stop(name)
    for name in names:
        machines.unmount(name)
        net.remove_host(name)
    pid = _pid_alive(STATE / "http.pid")
    if pid:
        os.kill(pid, signal.SIGTERM)
    net.remove_bridge()
    inv = state.get("inventory")
    if inv and Path(inv).exists():
        Path(inv).unlink()
    if STATE.exists():
        shutil.rmtree(STATE)
    return names


def status() -> dict:
    state = _state()
    hosts = {}
    for name, h in state.get("hosts", {}).items():
        try:
            machines.wait_ssh(h["ip"], timeout=1)
            ssh = True
        except TorchrigError:
            ssh = False
        hosts[name] = {**h, "running": bool(machines.supervisor_pid(name)),
                       "mounted": machines.is_mounted(machines.root_of(name)), "ssh": ssh}
    return {"up": bool(hosts), "bridge": BRIDGE, "server": f"{base_url()}/",
            "serving": bool(_pid_alive(STATE / "http.pid")), "hosts": hosts,
            "inventory": state.get("inventory"), "cache": str(CACHE)}


def leftovers() -> list[str]:
    """What a testbed could leave behind on this machine; empty after a clean down."""
    out = []
    mounts = Path("/proc/mounts").read_text()
    out += [f"mount {line.split()[1]}" for line in mounts.splitlines() if str(STATE) in line]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    out += [f"link {w}" for w in links.split()
            if w.rstrip(":").split("@")[0] == BRIDGE or w.startswith(f"{BRIDGE}-")]
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += [f"netns {line.split()[0]}" for line in ns.splitlines()
            if line.startswith(f"torchrig-{BRIDGE}-")]
    ps = subprocess.run(["pgrep", "-af", f"supervisor {BRIDGE}-|--machine={BRIDGE}-"],
                        capture_output=True, text=True).stdout
    out += [f"process {line}" for line in ps.splitlines() if "pgrep" not in line]
    for top in {str(Path(d).parent) for d in cgroup_dirs("x")}:  # .../torchrig-testbed
        out += [f"cgroup {d}" for d in sorted(Path(top).glob(f"{BRIDGE}-*"))]
    return out
