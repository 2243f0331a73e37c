"""``nvidia-smi -q -x``'s health fields per GPU. The one definition is payload/smi_xml.py
(stdlib only, pushed with every release for the node's health watcher); this loads that same
file, as torchrig/progress.py loads the progress protocol."""

from __future__ import annotations

from ..resources import payload_module

_defs = payload_module("smi_xml")

COMMAND = _defs.COMMAND
SLOWDOWNS = _defs.SLOWDOWNS
GpuHealth = _defs.GpuHealth
parse = _defs.parse
