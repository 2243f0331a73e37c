"""``/etc/os-release`` (pure), and NVIDIA CUDA repository naming.

``PATH`` is the file to read; reading it is the caller's business. The format
(os-release(5)) is shell-like ``KEY=value`` lines, values optionally in single or
double quotes with backslash escapes inside double quotes; ``#`` starts a comment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torchrig.facts._text import lines as _lines

PATH = "/etc/os-release"


@dataclass(frozen=True)
class OsRelease:
    id: str | None  # "ubuntu", "debian"
    version_id: str | None  # "22.04", "12"
    codename: str | None  # "jammy", "bookworm"
    pretty_name: str | None
    id_like: tuple[str, ...]  # ("debian",); () when absent
    name: str | None = None
    fields: dict[str, str] = field(default_factory=dict, hash=False, compare=False)


_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)=(.*?)\s*$")


def _unquote(raw: str) -> str:
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        return re.sub(r'\\([\\$"`])', r"\1", raw[1:-1])
    if len(raw) >= 2 and raw[0] == raw[-1] == "'":
        return raw[1:-1]
    return raw


def parse(text: str) -> OsRelease:
    fields: dict[str, str] = {}
    for line in _lines(text):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            fields[m.group(1)] = _unquote(m.group(2))
    codename = fields.get("VERSION_CODENAME") or fields.get("UBUNTU_CODENAME")
    if not codename:
        m = re.search(r"\(([A-Za-z]+)", fields.get("VERSION", ""))  # "12 (bookworm)"
        codename = m.group(1).lower() if m else None
    return OsRelease(
        id=fields["ID"].lower() if fields.get("ID") else None,
        version_id=fields.get("VERSION_ID") or None,
        codename=codename or None,
        pretty_name=fields.get("PRETTY_NAME") or None,
        id_like=tuple(fields.get("ID_LIKE", "").split()),
        name=fields.get("NAME") or None,
        fields=fields,
    )


# NVIDIA names its CUDA apt repositories after the distribution and release:
# https://developer.download.nvidia.com/compute/cuda/repos/<ubuntu2204|ubuntu2404|debian12>/<x86_64|sbsa>/
_SUPPORTED = {
    ("ubuntu", "22.04"): "ubuntu2204",
    ("ubuntu", "24.04"): "ubuntu2404",
    ("debian", "12"): "debian12",
}
# the distributions provision supports, by their CUDA repo name
DISTROS = frozenset(_SUPPORTED.values())


def supported(osr: OsRelease) -> str | None:
    """CUDA repo path component for a supported distribution, else None.

    Strict on ID: derivatives (Pop!_OS, Mint: ID_LIKE=ubuntu) are not supported.
    """
    if osr.id is None or osr.version_id is None:
        return None
    return _SUPPORTED.get((osr.id, osr.version_id))


def cuda_repo_arch(uname_m: str) -> str | None:
    """``uname -m`` -> CUDA repo arch: x86_64 -> "x86_64", aarch64 -> "sbsa" (server ARM)."""
    return {"x86_64": "x86_64", "aarch64": "sbsa"}.get(uname_m.strip())
