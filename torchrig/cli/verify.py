"""verify: PASS or FAIL per host and across the fleet."""

from __future__ import annotations

import json

from invoke import Exit

from .common import _fleet, _redactor, _warm, fleet_task


@fleet_task(help={"bandwidth": "also measure all-reduce busbw (torchrun in each node and across "
                               "nodes; nccl-tests where built) against the expected minimum",
                  "json": "print the report as JSON"})
def verify(c, inventory=None, host=None, bandwidth=False, json_=False, accept_new_host_keys=False):
    """GPUs, topology, driver health, one version gate across nodes, network; PASS or FAIL."""
    from torchrig.verify import service
    _warm("torchrig.tables")
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        red = _redactor(fleet.inv)
        rep = service.verify(fleet, bandwidth, red)
    from torchrig import tables
    if json_:
        print(json.dumps(red.data(rep.as_dict()), indent=2, default=str))
    else:
        tables.verify_report(rep)
    if not rep.ok:
        raise Exit("error: verify " + rep.status + ": " + "; ".join(rep.failures), code=1)

