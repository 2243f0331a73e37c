"""torchrun (torch.distributed.run), with the exit barrier's timeout set by the operator.

A node whose workers all finished waits in torchrun's exit barrier for the other nodes'
agents (so that a store it hosts stays up while they finish). torchrun fixes that wait at
300 s and has no flag for it; a node whose worker died meanwhile restarts and waits for a
rejoin that the finished nodes never make, so the whole job hangs for that long. The launch
sets TORCHRIG_EXIT_BARRIER_TIMEOUT (seconds); without it this is plain torchrun.

Run as `python -m torchrig_torchrun <torchrun arguments>` from the payload release."""
import os
import sys

from torch.distributed.launcher import api
from torch.distributed.run import main


def bounded(agent_cls, timeout: float):
    """The agent class with `exit_barrier_timeout` defaulting to `timeout` (torchrun's
    launcher passes everything else by keyword)."""
    class Agent(agent_cls):
        def __init__(self, *args, **kwargs):
            if len(args) < 4:  # (spec, logs_specs, start_method, exit_barrier_timeout, ...)
                kwargs.setdefault("exit_barrier_timeout", timeout)
            super().__init__(*args, **kwargs)
    return Agent


if __name__ == "__main__":
    t = os.environ.get("TORCHRIG_EXIT_BARRIER_TIMEOUT")
    if t:
        api.LocalElasticAgent = bounded(api.LocalElasticAgent, float(t))
    sys.exit(main())
