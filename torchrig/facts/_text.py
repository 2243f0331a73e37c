"""Small text helpers shared by the fact parsers (pure)."""

from __future__ import annotations

import math
import re

# CSI sequences (colours, underline, cursor moves) and OSC sequences.
_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def finite(text: str) -> float:
    """float(text), refusing inf, nan and what overflows to them ('1e999'): not a reading, and
    int() of one raises OverflowError, which would escape a parser's ValueError handling."""
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"not a finite number: {text!r}")
    return v


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text)


def normalize(text: str) -> str:
    """Strip a BOM and ANSI escapes; turn CRLF / CR line ends into LF."""
    if text.startswith("\ufeff"):
        text = text[1:]
    text = strip_ansi(text)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def lines(text: str) -> list[str]:
    return normalize(text).split("\n")
