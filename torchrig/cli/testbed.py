"""testbed.up/down/status and demo: the local testbed of simulated GPU servers."""

from __future__ import annotations

import json
import sys

from invoke import Collection, Exit

from .common import _log, _number, task, user_errors
from .launch import launch
from .logs import _color
from .provision import provision
from .verify import verify


@task(name="up", help={"hosts": "number of simulated servers, named gpu1..gpuN (default 2)",
            "profile": "GPU profile for all hosts, and/or per host: "
                       "'h100-nvswitch-8' or 'v100s-nvlink-2,gpu2=pcie-sys-4'",
            "inventory": "where to write the testbed's inventory (default inventory/testbed.yml)"})
@user_errors
def testbed_up(c, hosts=None, profile=None, inventory="inventory/testbed.yml"):
    """Start a local TESTBED of simulated GPU servers (root; systemd-nspawn containers)."""
    from torchrig.testbed import lab
    n = _number("hosts", 2 if hosts is None else hosts, 1)
    st = lab.up(n, profile, inventory, log=_log)
    for name, h in st["hosts"].items():
        print(f"{name}  {h['ip']}  profile={h['profile']}")
    print(f"testbed up in {st['seconds']}s; inventory: {inventory} "
          f"(e.g. torchrig exec --inventory {inventory} \"nvidia-smi -L || true\"); "
          "take it down with: torchrig testbed.down")


@task(name="down")
@user_errors
def testbed_down(c):
    """Stop the testbed: hosts halted, mounts, interfaces and its server removed."""
    from torchrig.testbed import lab
    names = lab.down()
    left = lab.leftovers()
    if left:
        raise Exit("error: testbed.down left behind: " + "; ".join(left), code=1)
    print(f"testbed down ({len(names)} host(s) removed; base image cache kept)")


@task(name="status", help={"json": "print the status as JSON"})
@user_errors
def testbed_status(c, json_=False):
    """Show the testbed's hosts: running, addressable, SSH answering."""
    from torchrig.testbed import lab
    from torchrig.tables import testbed_table
    st = lab.status()
    if json_:
        print(json.dumps(st, indent=2))
    else:
        testbed_table(st)


@task(help={"steps": "training steps for the demo job (default 60)"})
@user_errors
def demo(c, steps=None):
    """The whole path on a local testbed: 2 hosts up, provision, verify, a 2-node x 2-process
    DDP job (gloo on CPU) followed to the end, and a summary. Leaves the testbed up."""
    import time as _time
    steps = _number("steps", 60 if steps is None else steps, 1)
    t0 = _time.monotonic()
    inv_path = "inventory/testbed.yml"

    def stage(msg):
        print(f"\n=== {msg} ({_time.monotonic() - t0:.0f}s) ===", flush=True)

    stage("testbed: 2 simulated GPU servers (systemd-nspawn)")
    testbed_up(c, hosts=2)
    stage("provision: driver, CUDA, NCCL (testbed stand-ins), venv with torch")
    provision(c, inventory=inv_path, yes=True, reboot=True)
    stage("verify: GPUs, topology, versions, network, all-reduce bandwidth")
    verify(c, inventory=inv_path, bandwidth=True)
    stage("launch: 2 nodes x 2 processes, c10d rendezvous, gloo")
    job = _time.strftime("demo-%Y%m%d-%H%M%S")
    launch(c, inventory=inv_path, nodes=2, job=job, nproc_per_node="2",
           args=f"--max-steps {steps} --log-every 10 --ckpt-every 20")
    stage("logs: every rank, followed until the job ends")
    from torchrig import inventory as _inv
    from torchrig.launch.joblogs import job_logs
    from torchrig.logs.stream import Printer
    from torchrig.progress import run_summary
    from torchrig.session import Fleet
    inv = _inv.load(inv_path)
    seen = []  # rank 0's lines, for the summary

    class Tee(Printer):
        def line(self, item):
            super().line(item)
            if item.global_rank == 0:
                seen.append(item.text)

    with Fleet(inv, inv.select(None)[:2]) as fleet:  # logs' one service, as `logs -f` calls it
        job_logs(fleet, job, Tee(sys.stdout, _color(None)), follow=True)
    s = run_summary(seen)
    stage("summary")
    if s is None:
        raise Exit(f"error: demo job {job} did not finish; see: torchrig logs -i {inv_path} --job {job}",
                   code=1)
    rate = "?" if s["median_tok_s"] is None else f"{s['median_tok_s']:.0f}"
    print(f"job {job}: {s['steps']} steps, loss {s['first_loss'] or '?'} -> {s['last_loss']}, "
          f"median {rate} tokens/s (4 ranks, CPU), checkpoint {s['ckpt']} (on the rank-0 node)")
    print(f"a report with plots: torchrig report -i {inv_path} --job {job}")
    print(f"demo done in {_time.monotonic() - t0:.0f}s. The testbed is still up: "
          f"torchrig exec -i {inv_path} 'hostname'; take it down with: torchrig testbed.down")


testbed = Collection("testbed", testbed_up, testbed_down, testbed_status)

