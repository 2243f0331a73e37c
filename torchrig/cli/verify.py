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
    from torchrig.verify.run import verify as run_verify
    _warm("torchrig.tables")
    with _fleet(c, inventory, host, accept_new_host_keys) as fleet:
        rep = run_verify(fleet, fleet.hosts, bandwidth=bandwidth)
    if bandwidth:  # the sweeps, for `torchrig report` (the nodes keep nothing of them)
        from torchrig.verify import store
        store.save(rep.bandwidth, {h.name: h.address for h in fleet.hosts})
    rep.redact(red := _redactor(fleet.inv))
    from torchrig import tables
    if json_:
        print(json.dumps(red.data(rep.as_dict()), indent=2, default=str))
    else:
        tables.verify_report(rep)
    if not rep.ok:
        raise Exit("error: verify " + rep.status + ": " + "; ".join(rep.failures), code=1)

