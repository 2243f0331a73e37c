"""`torchrig status` prints a line the job wrote (its latest progress): terminal control
sequences in it are shown, not obeyed (a job could clear the operator's screen or retitle it)."""

import io

from rich.console import Console

from torchrig import tables
from torchrig.session import Result


def test_progress_line_control_sequences_are_neutralised(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(tables, "console", Console(file=out, force_terminal=True, width=200,
                                                   highlight=False))
    d = {"unit": {"ActiveState": "active", "SubState": "running", "NRestarts": "0"},
         "attempt": 0, "uptime_s": 5, "gpus": [], "low_util": None,
         "progress": "step=3 loss=1.0\x1b[2J\x1b]0;pwned\x07"}
    tables.status_table("j", [Result("gpu1", True, d)])
    text = out.getvalue()
    assert "\x1b[2J" not in text and "\x1b]0;" not in text
    assert "step=3 loss=1.0\\x1b[2J" in text
