"""A tiny DDP run: a linear model, a few steps, gloo on CPU (nccl with GPUs). Prints plain
lines (no torchrig progress lines) unless --progress, then steps through the progress module
torchrig pushes with every release."""

import argparse
import os
import time

import six  # the project's dependency: installed by torchrig into the job environment
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--progress", action="store_true", help="print torchrig progress lines")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model (Inductor: a C++ compiler and Python.h)")
    a = ap.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    model = DDP(torch.compile(net) if a.compile else net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        print(f"six {six.__version__} world {dist.get_world_size()} cwd {os.getcwd()}", flush=True)
        # what libraries do with the home and /tmp: torch.hub (like Hugging Face's cache) makes
        # its folder under ~/.cache; torch.compile's Inductor picks its cache folder
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        os.makedirs(torch.hub.get_dir(), exist_ok=True)
        print(f"hub {torch.hub.get_dir()} inductor {cache_dir()} "
              f"tmp {sorted(n for n in os.listdir('/tmp') if n.startswith('torchinductor'))}",
              flush=True)
    for step in range(1, a.steps + 1):
        x = torch.randn(16, 8)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            if a.progress:   # the two lines docs/payload.md shows a user's own script
                import progress
                progress.step(step, loss=loss.item())
            else:
                print(f"epoch 0 batch {step}: loss {loss.item():.4f}", flush=True)
        time.sleep(a.sleep)
    if rank == 0:
        print(f"finished {a.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":   # launch --module trainer.run
    main()
