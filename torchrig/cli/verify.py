"""verify: PASS or FAIL per host and across the fleet."""

from __future__ import annotations

from .common import _fleet, _redactor, _warm, fleet_task
from .health import DIAG_HELP, diag_level, render


@fleet_task(help={"bandwidth": "also measure all-reduce busbw (torchrun in each node and across "
                               "nodes; nccl-tests where built) against the expected minimum",
                  "json": "print the report as JSON", "diag": DIAG_HELP})
def verify(c, inventory=None, host=None, bandwidth=False, json_=False, diag=None,
           accept_new_host_keys=False):
    """GPUs and their health, topology, driver, one version gate across nodes, network; PASS
    or FAIL."""
    from torchrig.verify import service
    _warm("torchrig.tables")
    level = diag_level(diag)
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        red = _redactor(fleet.inv)
        rep = service.verify(fleet, bandwidth, red, diag=level)
    render(rep, red, json_, "verify")

