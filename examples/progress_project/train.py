#!/usr/bin/env python3
"""A small plain DDP script of one's own that prints torchrig progress lines, so `torchrig
status`, `metrics` and `report` show its steps and loss (docs/payload.md, "Progress lines from
your own script").

The only torchrig part is `import progress` (payload/progress.py, standard library only, pushed
with every release beside your project; run locally with PYTHONPATH=payload):

    PYTHONPATH=payload torchrun --standalone --nproc-per-node 2 \\
        examples/progress_project/train.py --steps 3

DDP from torchrun's environment: NCCL on a GPU, gloo on the CPU.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import progress


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    a = p.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)  # before init_process_group
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")  # rank, world size: torchrun's env
    rank, world = dist.get_rank(), dist.get_world_size()
    progress.start(device=device, backend=dist.get_backend())  # every rank: who it is

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    w = torch.linspace(-1, 1, 16)
    loss = torch.zeros((), device=device)
    t0 = time.monotonic()
    for step in range(1, a.steps + 1):
        x = torch.randn(a.batch, 16, generator=gen)
        y = (x @ w).unsqueeze(1) + 0.1 * torch.randn(a.batch, 1, generator=gen)
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank's loss, averaged: what rank 0 reports
        mean /= world
        rate = a.batch * world * step / (time.monotonic() - t0)
        # rank 0 only (progress reads RANK): step=3 loss=0.8421 samples/s=4096
        progress.step(step, loss=mean.item(), **{"samples/s": rate})
    progress.done(a.steps, loss=mean.item())
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
