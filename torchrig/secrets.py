"""Keep secrets out of output: any var whose name looks secret is shown as ***."""

from __future__ import annotations

import re
from typing import Any

SECRET_NAME = re.compile(r"(pass(word)?|secret|token|api[_-]?key|credential|auth)", re.I)
MASK = "***"


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact(value: Any, key: str = "") -> Any:
    """A copy of `value` with secret-named entries masked, recursively; URLs lose passwords."""
    if key and is_secret(key):
        return MASK
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"(://[^/:@\s]+:)[^@/\s]+@", rf"\1{MASK}@", value)
    return value
