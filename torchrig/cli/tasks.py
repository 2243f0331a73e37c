"""torchrig: turn SSH-reachable bare-metal GPU servers into a PyTorch DDP fleet.

The task collection, declared once: `ns = Collection(...)` and `ns.configure(...)`. Each task
lives in its domain's module beside this one (common.py holds the prologue they share); a
task parses its flags, calls its domain's service, renders the result and picks the exit
status. Heavy modules are imported inside tasks so `torchrig --list` stays fast.
"""

from __future__ import annotations

from invoke import Collection

from .data import data
from .health import health
from .hosts import exec_, hosts, init
from .job_outputs import fetch, job_report
from .jobs import jobs
from .launch import launch, stop
from .logs import logs
from .power import power
from .provision import provision
from .status import metrics, status, tensorboard
from .testbed import demo, testbed
from .verify import verify

ns = Collection(init, hosts, exec_, provision, verify, health, launch, logs, status, job_report,
                stop, jobs, metrics, tensorboard, fetch, data, power, demo, testbed)
ns.configure({
    "torchrig": {
        "inventory": None,  # a config file's torchrig.inventory (see common._inventory_path)
        # hosts at once; sshd's MaxStartups bounds one host. Text, so that a bad
        # INVOKE_TORCHRIG_PARALLEL reaches torchrig's check, not Invoke's int() (a traceback).
        "parallel": "16",
    },
})

