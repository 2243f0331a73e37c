#!/usr/bin/env python3
"""A small plain DDP script of one's own that prints NO torchrig progress lines (only its own
`epoch 1 done, loss 0.123`), and needs one third-party package (six, requirements.txt): what
`torchrig status` shows for it is the unit's state, its restarts and the last line it printed;
`metrics` and `report` say that no step lines were seen (docs/payload.md, "Progress lines from
your own script").

Run locally (six installed, or on PYTHONPATH):

    torchrun --standalone --nproc-per-node 2 examples/plain_project/train.py --steps 3

--fail-at STEP makes rank 1 raise at that step (what `torchrig logs --failures` diagnoses).
DDP from torchrun's environment: NCCL on a GPU, gloo on the CPU.
"""

import argparse
import os

import six  # the project's own dependency (requirements.txt): pure Python
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps, one an epoch (default 20)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--fail-at", type=int, default=0, metavar="STEP",
                   help="rank 1 raises RuntimeError at this step (0: never)")
    a = p.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(six.text_type("plain script: %d ranks, backend %s, six %s")
              % (world, dist.get_backend(), six.__version__))

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1 + rank)
    w = torch.linspace(-1, 1, 8)
    for epoch in range(1, a.steps + 1):
        if epoch == a.fail_at and rank == 1:
            raise RuntimeError("plain script: failing at epoch %d on purpose (--fail-at)" % epoch)
        x = torch.randn(a.batch, 8, generator=gen)
        y = (x @ w).unsqueeze(1)
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        if rank == 0:
            print("epoch %d done, loss %.3f" % (epoch, mean.item()))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
