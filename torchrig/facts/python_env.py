"""A venv from its files, without running its interpreter (pure): pyvenv.cfg and the
dist-info METADATA of the installed distributions."""

from __future__ import annotations

import re

DIST_INFO = "lib/python3*/site-packages/{name}.dist-info/METADATA"
METADATA_LIMIT = 4096  # Name and Version come first


def pyvenv_version(cfg: str) -> str | None:
    m = re.search(r"^version(?:_info)?\s*=\s*(\S+)", cfg, re.M)
    return m.group(1) if m else None


def normalize(name: str) -> str:
    """PEP 503 name: torch, nvidia-nccl-cu12."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def parse_metadata(text: str) -> tuple[str, str] | None:
    """(normalized name, version) from a METADATA file's head; None when either is missing."""
    n = re.search(r"^Name: (.+)$", text, re.M)
    v = re.search(r"^Version: (.+)$", text, re.M)
    return (normalize(n.group(1)), v.group(1).strip()) if n and v else None


def dists(metadata_texts) -> dict[str, str]:
    """{name: version} of the METADATA texts that parse (None entries skipped)."""
    return dict(filter(None, (parse_metadata(t) for t in metadata_texts if t)))
