"""Text that a job, a node or a file on a node controls -> safe for the operator's terminal.

The one sanitiser every output path uses (tables, error lines, log lines, progress, notices):
- `printable`: control characters shown as \\xNN (\\uNNNN), so the text cannot move the
  cursor, erase the screen, retitle the terminal or plant an OSC 8 hyperlink;
- `markup`: the same, then rich's markup escaped, for strings rich renders as markup (a stray
  `[/x]` in one job's label would otherwise raise MarkupError and print no row for anyone,
  and `[link=...]` would plant a link);
- `say`: print() of such text (newlines kept: they are the line structure);
- `html`: the same text for the HTML report (html.escape; plotly renders some tags in hover
  and title text, so they must reach it escaped);
- `PrefixedLines`: a stream sink writing whole lines as 'host | line', each printable.
"""

from __future__ import annotations

import html as _html
import re
import sys
import threading
from typing import TextIO

# C0 controls but TAB and newline, DEL, C1 controls (0x9b is a CSI on its own), and the Unicode
# format characters that reorder or split what is shown (bidi embeddings, overrides and
# isolates; line and paragraph separators)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
                      "\u202a-\u202e\u2066-\u2069]")


def _shown(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text, newlines: bool = False) -> str:
    """`text` (str() of it) safe to write to a terminal: every control character but TAB (and
    newline when `newlines`) shown as \\xNN."""
    text = str(text)
    if text.isprintable():  # no control or format character at all (C speed: long lines)
        return text
    text = _CONTROL.sub(_shown, text)
    return text if newlines else text.replace("\n", "\\x0a")


def markup(text, newlines: bool = False) -> str:
    """`text` safe inside rich markup: printable, then rich's markup escaped."""
    from rich.markup import escape
    return escape(printable(text, newlines))


def say(text, file=None, newlines: bool = True, flush: bool = False) -> None:
    """print() a line that holds node or job text."""
    print(printable(text, newlines), file=file or sys.stdout, flush=flush)


def html(text) -> str:
    """`text` safe in an HTML page and in plotly's text fields (which render <b>, <a>, <br>)."""
    return _html.escape(printable(text, newlines=True))


class PrefixedLines:
    """File-like sink for Fabric's out_stream: writes whole lines as 'host | line', each
    through the terminal sanitiser (the host's output may hold any escape sequence)."""

    _lock = threading.Lock()  # shared: lines from different hosts never interleave mid-line

    def __init__(self, prefix: str, out: TextIO):
        self.prefix, self.out = prefix, out
        self.parts: list[str] = []  # the unfinished line, in pieces: joined once, when it ends

    def write(self, data: str) -> None:
        # Only the new data is split: re-splitting a growing buffer on every chunk made a
        # single long line quadratic (8 MB: 18 s).
        if "\n" not in data:
            if data:
                self.parts.append(data)
            return
        head, *lines = data.split("\n")
        tail = lines.pop()
        self._emit(["".join(self.parts) + head, *lines])
        self.parts = [tail] if tail else []

    def _emit(self, lines: list[str]) -> None:
        if lines:
            with self._lock:
                for line in lines:
                    self.out.write(f"{self.prefix} | {printable(line.rstrip(chr(13)))}\n")
                self.out.flush()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.parts:
            self._emit(["".join(self.parts)])
            self.parts = []
