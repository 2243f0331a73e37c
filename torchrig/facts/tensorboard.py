"""TensorBoard's own lines in its unit's journal (pure): the address it serves on."""

from __future__ import annotations

import re

# "TensorBoard 2.21.0 at http://127.0.0.1:41234/ (Press CTRL+C to quit)" (tensorboard/program.py)
SERVING = re.compile(r"^TensorBoard \S+ at http://127\.0\.0\.1:([0-9]{1,5})/", re.M)


def serving_port(journal: str) -> int | None:
    """The port TensorBoard said it serves on (the last such line: a restart says it again)."""
    ports = [int(p) for p in SERVING.findall(journal)]
    return ports[-1] if ports and 0 < ports[-1] < 65536 else None


def parse_wait(text: str) -> tuple[str, str]:
    """The wait script's reply ('state=<ActiveState>' then the journal) -> (state, journal)."""
    first, _, journal = text.partition("\n")
    return first.removeprefix("state=").strip(), journal
