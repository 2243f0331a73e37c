"""Where the testbed keeps things, and its private network. Overridable for parallel runs."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

# Survives testbed.down: the debootstrapped base image, wheels, the stand-in apt repo.
CACHE = Path(os.environ.get("TORCHRIG_TESTBED_CACHE", "/var/cache/torchrig-testbed"))
# Lives from testbed.up to testbed.down: host overlays, keys, the served web root.
STATE = Path(os.environ.get("TORCHRIG_TESTBED_STATE", "/var/lib/torchrig-testbed"))

BRIDGE = os.environ.get("TORCHRIG_TESTBED_BRIDGE", "trb0")
SUBNET = os.environ.get("TORCHRIG_TESTBED_SUBNET", "10.213.0")  # a /24, no route out
GATEWAY_IP = f"{SUBNET}.1"   # the operator side of the bridge: serves apt and pip
HTTP_PORT = 8080
MAX_HOSTS = 32


def host_ip(index: int) -> str:
    """gpu1 -> .11, gpu2 -> .12, ..."""
    return f"{SUBNET}.{10 + index}"


def host_dir(name: str) -> Path:
    return STATE / "hosts" / name


# Names on this machine carry the bridge name, so two testbeds (a user's and the tests')
# never share a namespace, an interface or an nspawn machine name.
def netns(name: str) -> str:
    return f"torchrig-{BRIDGE}-{name}"


def veth(name: str) -> str:
    v = f"{BRIDGE}-{name}"
    if len(v) > 15:  # IFNAMSIZ
        raise ValueError(f"interface name {v!r} too long: use a shorter bridge name")
    return v


def machine(name: str) -> str:
    return f"{BRIDGE}-{name}"


def www() -> Path:
    return STATE / "www"


def http_log() -> Path:
    """The testbed server's request log (http.server's format, one line per request)."""
    return STATE / "http.log"


# a line of that log for a file served: client, path
SERVED = re.compile(r'(\S+) - - \[[^\]]*\] "GET /([^ "?]+) HTTP/[0-9.]+" 200 ')


def served(log_text: str) -> list[tuple[str, str]]:
    """(client address, path) of each file the server sent, in order."""
    return [(m.group(1), unquote(m.group(2))) for m in map(SERVED.match, log_text.splitlines()) if m]


def debs_served(log_text: str) -> list[tuple[str, str]]:
    """(client, path) of each .deb served (the stand-in CUDA repository's and the Debian
    mirror's)."""
    return [(c, p) for c, p in served(log_text) if p.endswith(".deb")]


def base_url() -> str:
    return f"http://{GATEWAY_IP}:{HTTP_PORT}"
