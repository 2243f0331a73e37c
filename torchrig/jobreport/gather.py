"""`torchrig report`'s edge: one probe round trip per node (as root, over the task's fleet
session) reads the job's unit, its journal (torchrun's agent lines and the ranks' progress
lines, filtered on the node by journalctl), the kernel's OOM lines, the node's clock and the
sampler's GPU history files; the operator keeps verify's busbw sweeps (verify/store.py).
Everything is parsed on the operator side (data.py)."""

from __future__ import annotations

from ..facts import probe, systemd
from ..job import unit_name
from ..progress import protocol
from ..verify import store

UNIT_PROPS = ["LoadState", "ActiveState", "Result", "NRestarts", "ExecMainStartTimestamp",
              "ExecMainExitTimestamp", "ExecStart"]
# the versions the report states: torch from the venv's package metadata (no torch import)
TORCH_VERSION = "import importlib.metadata as m; print(m.version('torch'))"
JOURNAL_LINES = 200000   # newest matching journal lines per node
# caps on them: journalctl -o json already writes null for a field over 4096 bytes, but a job
# can print up to that (a byte that is not UTF-8 taking up to 4 in JSON) on each of 200000
# lines. A longer JSON line is left out (cut JSON does not parse; a progress line is ~300
# bytes), and past the total the rest is read and dropped on the node.
JOURNAL_MAX_LINE = 4 << 10
JOURNAL_MAX_BYTES = 64 << 20
HISTORY_BYTES = 8 << 20  # newest bytes of each GPU history file (months at a sample per 30 s)


def journal_pattern() -> str:
    """PCRE2 for journalctl --grep: every line that is not a rank's (torchrun's agent, systemd),
    and the ranks' progress lines (`[default<local rank>]:` then a kind of payload/progress.py):
    the ranks' other output, however much, stays on the node."""
    kinds = "|".join(k + ("=" if k in protocol.KEYED else r"(\s|$)") for k in protocol.KINDS)
    return rf"^(?!\[default\d+\]:)|^\[default\d+\]:({kinds})"


def request(unit: str, util_file: str, mem_file: str, venv: str) -> dict:
    return {"run": {"unit": systemd.show_argv([unit], UNIT_PROPS),
                    "torch": [f"{venv}/bin/python", "-I", "-c", TORCH_VERSION],
                    "driver": ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    "journal": {"argv": ["journalctl", "-u", unit, "-o", "json",
                                         "--output-fields=MESSAGE", "--no-pager",
                                         "-n", str(JOURNAL_LINES), "--case-sensitive=true",
                                         "--grep", journal_pattern()], "timeout": 120,
                                "max_line": JOURNAL_MAX_LINE, "max_bytes": JOURNAL_MAX_BYTES},
                    "kernel": {"argv": ["journalctl", "-k", "-o", "cat", "--no-pager", "-n", "200",
                                        "--case-sensitive=false", "--grep", "oom|killed process"],
                               "timeout": 60},
                    "clock": ["date", "+%Y %z"]},
            "read": {"util": {"path": util_file, "limit": HISTORY_BYTES, "tail": True},
                     "mem": {"path": mem_file, "limit": HISTORY_BYTES, "tail": True}},
            "host": True}


def gather(fleet, job: str) -> dict:
    """{"nodes": [(host name, probe reply | error text)], "bandwidth": {host: record}} for the
    fleet's hosts, in their order (a node's rank for the diagnosis is its position)."""
    unit = unit_name(job)

    def one(h):
        s = h.settings
        r = fleet.run(h, probe.COMMAND, root=True, timeout=180,
                      data=probe.stdin(request(unit, s.util_file(job), s.mem_file(job), s.venv)))
        return probe.reply(r.exited, r.stdout, r.stderr, "reading the job")
    res = fleet.fan_out(one)
    return {"nodes": [(r.host, r.value if r.ok else r.error) for r in res],
            "bandwidth": store.load(fleet.hosts)}
