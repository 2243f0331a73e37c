"""GPU health's facts: the commands the probe runs for them (one round trip, beside verify's)
and the raw results kept for verify/health.py, which parses and judges them."""

from __future__ import annotations

from . import nvlink, smi_xml, xid

# name in the probe's reply -> argv (or a run spec). The kernel log since boot can be long
# (past the probe's cap, which keeps a command's first bytes): the node keeps only its newest
# lines that can be Xid lines (xid.KEEP), and the parser reads the Xids from those.
RUN = {"health_xml": smi_xml.COMMAND, "nvlink_status": nvlink.STATUS,
       "nvlink_errors": nvlink.ERRORS,
       "kernel_journal": {"argv": xid.JOURNAL, "keep": xid.KEEP},
       "kernel_dmesg": {"argv": xid.DMESG, "keep": xid.KEEP}}
DIAG_LEVELS = (1, 2, 3)
DIAG_TIMEOUT = {1: 300, 2: 900, 3: 3600}  # dcgmi diag -r 3 takes ~10 min on an 8-GPU node


def diag_command(level: int) -> dict:
    return {"argv": ["dcgmi", "diag", "-r", str(level), "-j"], "timeout": DIAG_TIMEOUT[level]}


def probe_run(diag: int | None = None) -> dict:
    run = dict(RUN)
    if diag:
        run["dcgm_diag"] = diag_command(diag)
    return run


def facts(run: dict) -> dict:
    """The raw results of probe_run()'s commands, as the probe returned them."""
    return {k: run[k] for k in (*RUN, "dcgm_diag") if k in run}
