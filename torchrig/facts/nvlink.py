"""``nvidia-smi nvlink -s`` (each link's speed, or ``<inactive>``) and ``nvidia-smi nvlink -e``
(each link's replay / recovery / CRC error counters). Pure parsers, keyed by GPU index."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ._text import normalize

STATUS = ["nvidia-smi", "nvlink", "-s"]
ERRORS = ["nvidia-smi", "nvlink", "-e"]

_GPU = re.compile(r"^GPU (\d+):")
_LINK_SPEED = re.compile(r"^\s*Link (\d+): (.+?)\s*$")
_LINK_ERR = re.compile(r"^\s*Link (\d+): ([A-Za-z ]+? Errors?): (\d+)\s*$")


@dataclass
class Links:
    up: list[int] = field(default_factory=list)
    down: list[int] = field(default_factory=list)
    errors: dict[int, dict[str, int]] = field(default_factory=dict)  # link -> {"Replay Errors": n}


def _blocks(text: str):
    gpu = None
    for line in normalize(text).split("\n"):
        m = _GPU.match(line)
        if m:
            gpu = int(m.group(1))
            yield gpu, None
        elif gpu is not None:
            yield gpu, line


def parse_status(text: str) -> dict[int, Links]:
    """{gpu index: Links} from ``nvlink -s``; a GPU with no NVLink has no Link lines."""
    out: dict[int, Links] = {}
    for gpu, line in _blocks(text):
        links = out.setdefault(gpu, Links())
        m = _LINK_SPEED.match(line or "")
        if m and "Errors" not in m.group(2):
            (links.down if "inactive" in m.group(2).lower() else links.up).append(int(m.group(1)))
    return out


def parse_errors(text: str, into: dict[int, Links] | None = None) -> dict[int, Links]:
    """``nvlink -e``'s counters added to ``into`` (parse_status's result) or a new table."""
    out = into if into is not None else {}
    for gpu, line in _blocks(text):
        links = out.setdefault(gpu, Links())
        m = _LINK_ERR.match(line or "")
        if m:
            links.errors.setdefault(int(m.group(1)), {})[m.group(2)] = int(m.group(3))
    return out
