#!/usr/bin/env python3
"""torchrig all-reduce bandwidth payload: an nccl-tests style all_reduce sweep under torchrun.

Depends only on the Python standard library and torch.

Launch (one node, 8 GPUs; prints the table, and the JSON on one line for the caller):
    torchrun --standalone --nproc-per-node 8 allreduce_bench.py --json -

Without torchrun it runs as one process (world size 1; busbw is then 0, as in nccl-tests).

Backend: NCCL with rank r on cuda:LOCAL_RANK when CUDA is available, gloo on CPU tensors
otherwise (--backend overrides). Each message size gets --warmup untimed and --iters timed
in-place all_reduce(sum) calls; a rank's time is the mean per call (CUDA synchronized
before the clock stops) and the reported time is the maximum over ranks. As nccl-tests
(doc/PERFORMANCE.md) defines them:
    algbw = bytes / time                      (GB/s, 1 GB = 1e9 bytes)
    busbw = algbw * 2(n-1)/n                  (all_reduce, n = world size)
After the timed calls each rank fills its tensor with rank+1 and does one more all_reduce;
every element must then equal n(n+1)/2. Elements that do not are counted (summed over ranks)
as "#wrong"; any wrong element makes the exit status 1.

Output (rank 0):
    a table like nccl-tests' (size, count, type, redop, time, algbw, busbw, #wrong),
    "# Out of bounds values : N OK|FAILED" and "# Avg bus bandwidth    : X";
    with --json PATH, one JSON document written to PATH; with --json -, the same document on
    one stdout line: "ALLREDUCE_JSON {...}". Keys: backend, world_size, nnodes,
    local_world_size, device, device_name, dtype, op, redop, warmup, iters, time_reduction,
    bus_factor, rows [{bytes, count, time_us, algbw_gbs, busbw_gbs, wrong}], max_busbw_gbs,
    avg_busbw_gbs, wrong_total, hosts (hostname of each rank, in rank order).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

JSON_PREFIX = "ALLREDUCE_JSON "

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# nccl-tests' names for the "type" column
NCCL_TYPE_NAMES = {"float32": "float", "bfloat16": "bfloat16", "float16": "half"}

# Defaults that depend on where the tensors live.
DEFAULT_MAX_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}
DEFAULT_ITERS = {"cpu": 5, "cuda": 20}
DEFAULT_WARMUP = {"cpu": 2, "cuda": 5}  # nccl-tests warms up 5 calls (-w 5): NCCL sets up lazily

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.I)
_SIZE_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


# --------------------------------------------------------------------------------------
# nccl-tests arithmetic (pure functions)
# --------------------------------------------------------------------------------------


def allreduce_bus_factor(nranks: int) -> float:
    """nccl-tests' all_reduce bus bandwidth factor 2(n-1)/n (0 for a single rank)."""
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    return (2.0 * (nranks - 1)) / nranks


def algbw_gbs(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9): bytes / time."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return nbytes / 1.0e9 / seconds


def busbw_gbs(algbw: float, nranks: int) -> float:
    """All-reduce bus bandwidth in GB/s: algbw * 2(n-1)/n."""
    return algbw * allreduce_bus_factor(nranks)


def bandwidths(nbytes: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for an all_reduce of nbytes taking seconds on nranks ranks."""
    alg = algbw_gbs(nbytes, seconds)
    return alg, busbw_gbs(alg, nranks)


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int, elem_size: int) -> list[int]:
    """Message sizes min, min*f, min*f^2, ... <= max (as nccl-tests -b/-e/-f), each rounded
    down to a whole number of elements; sizes that round to the same value appear once."""
    if factor < 2:
        raise ValueError(f"factor must be >= 2, got {factor}")
    sizes: list[int] = []
    size = min_bytes
    while size <= max_bytes:
        aligned = (size // elem_size) * elem_size
        if aligned > 0 and (not sizes or sizes[-1] != aligned):
            sizes.append(aligned)
        size *= factor
    return sizes


def exact_int_limit(dtype: torch.dtype) -> int:
    """Largest N such that every integer 0..N is exactly representable in dtype."""
    # significand bits (with the implicit one): float32 24, bfloat16 8, float16 11
    bits = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11, torch.float64: 53}[dtype]
    return 2**bits


def check_values(rank: int, nranks: int, dtype: torch.dtype) -> tuple[int, int]:
    """(value this rank contributes, expected sum) for the correctness check.

    rank+1 per rank, expecting n(n+1)/2, whenever that sum (and so every partial sum a
    reduction algorithm can form, all being smaller non-negative integers) is exact in dtype.
    For worlds too large for that (bf16 beyond 22 ranks, fp16 beyond 63), every rank
    contributes 1, and ranks past the exact limit contribute 0.
    """
    limit = exact_int_limit(dtype)
    total = nranks * (nranks + 1) // 2
    if total <= limit:
        return rank + 1, total
    return (1 if rank < limit else 0), min(nranks, limit)


def summarize(rows: list[dict]) -> dict:
    """max_busbw_gbs, avg_busbw_gbs (mean over rows, as nccl-tests' Avg bus bandwidth),
    wrong_total."""
    bus = [r["busbw_gbs"] for r in rows]
    return {
        "max_busbw_gbs": max(bus) if bus else 0.0,
        "avg_busbw_gbs": sum(bus) / len(bus) if bus else 0.0,
        "wrong_total": int(sum(r["wrong"] for r in rows)),
    }


def nnodes_from_env(env=None) -> int:
    """GROUP_WORLD_SIZE (torchrun: number of nodes), else WORLD_SIZE / LOCAL_WORLD_SIZE."""
    env = os.environ if env is None else env
    if env.get("GROUP_WORLD_SIZE", "").isdigit():
        return max(1, int(env["GROUP_WORLD_SIZE"]))
    world = int(env.get("WORLD_SIZE", 1) or 1)
    local = int(env.get("LOCAL_WORLD_SIZE", world) or world)
    return max(1, world // max(1, local))


def format_table_header() -> str:
    return "\n".join([
        "#                                                      in-place",
        f"#{'size':>12} {'count':>13} {'type':>9} {'redop':>7} {'time':>10} {'algbw':>8} "
        f"{'busbw':>8} {'#wrong':>7}",
        f"#{'(B)':>12} {'(elements)':>13} {'':>9} {'':>7} {'(us)':>10} {'(GB/s)':>8} "
        f"{'(GB/s)':>8} {'':>7}",
    ])


def format_row(row: dict, type_name: str) -> str:
    return (f" {row['bytes']:>12d} {row['count']:>13d} {type_name:>9} {'sum':>7} "
            f"{row['time_us']:>10.1f} {row['algbw_gbs']:>8.2f} {row['busbw_gbs']:>8.2f} "
            f"{row['wrong']:>7d}")


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def parse_size(s: str) -> int:
    """Bytes: an integer with an optional binary suffix K, M, G or T (1M = 1048576), as
    nccl-tests' -b/-e. 'KB', 'KiB' and lower case are accepted too."""
    m = _SIZE_RE.match(s)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 64K, 1M or 1G, got {s!r}")
    n = int(m.group(1)) * _SIZE_MULT[m.group(2).lower()]
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {s!r}")
    return n


def _int_at_least(low: int, what: str):
    """An argparse type: an integer >= low, else one clear message."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonneg_int = _int_at_least(0, "a non-negative integer")
_factor = _int_at_least(2, "an integer >= 2")


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="allreduce_bench.py",
        description="nccl-tests style all_reduce bandwidth sweep (run under torchrun).",
    )
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: nccl when CUDA is available, else gloo (CPU tensors)")
    p.add_argument("--min-bytes", type=parse_size, default=1 << 20, metavar="SIZE",
                   help="smallest message (default 1M)")
    p.add_argument("--max-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="largest message (default 64M on CPU, 1G on GPU)")
    p.add_argument("--factor", type=_factor, default=2, help="size multiplier (default 2)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--warmup", type=_nonneg_int, default=None,
                   help="untimed calls per size (default 2 on CPU, 5 on GPU)")
    p.add_argument("--iters", type=_positive_int, default=None,
                   help="timed calls per size (default 5 on CPU, 20 on GPU)")
    p.add_argument("--init-timeout", type=_positive_float, default=60.0, metavar="SECONDS",
                   help="process group timeout (default 60)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the JSON result to PATH; '-' prints it on one stdout line "
                        f"prefixed with '{JSON_PREFIX.strip()} '")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.backend == "auto":
        args.backend = "nccl" if cuda else "gloo"
    if args.backend == "nccl" and not cuda:
        parser.error("--backend nccl needs CUDA, but CUDA is not available on this machine "
                     "(use --backend gloo)")
    args.device_type = "cuda" if args.backend == "nccl" else "cpu"
    if args.max_bytes is None:
        args.max_bytes = max(args.min_bytes, DEFAULT_MAX_BYTES[args.device_type])
    if args.iters is None:
        args.iters = DEFAULT_ITERS[args.device_type]
    if args.warmup is None:
        args.warmup = DEFAULT_WARMUP[args.device_type]
    elem = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes ({args.min_bytes}) is larger than --max-bytes "
                     f"({args.max_bytes})")
    if args.min_bytes < elem:
        parser.error(f"--min-bytes must be at least one {args.dtype} element ({elem} bytes)")
    return args


# --------------------------------------------------------------------------------------
# Distributed run
# --------------------------------------------------------------------------------------


class BenchError(RuntimeError):
    """A setup problem reported as one clear line, without a traceback."""


def setup(args) -> tuple[int, int, torch.device]:
    """Init the process group (torchrun's env, or a private world of one) -> rank, n, device."""
    env = os.environ
    under_torchrun = "RANK" in env and "WORLD_SIZE" in env
    local_rank = int(env.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(seconds=args.init_timeout)
    if args.backend == "nccl":
        ndev = torch.cuda.device_count()
        if local_rank >= ndev:
            raise BenchError(f"LOCAL_RANK={local_rank} but only {ndev} CUDA device(s) visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init_process_group
    else:
        device = torch.device("cpu")
    kwargs = dict(backend=args.backend, timeout=timeout)
    if args.backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL init: a bad fabric fails here, in the timeout
    if under_torchrun:
        dist.init_process_group(**kwargs)
    else:  # single process: a world of one, no rendezvous, no port
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device):
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def bench_size(nbytes: int, args, rank: int, nranks: int, device: torch.device) -> dict:
    dtype = DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    count = nbytes // elem
    value, expected = check_values(rank, nranks, dtype)
    buf = torch.full((count,), float(value), dtype=dtype, device=device)
    for _ in range(args.warmup):
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    _sync(device)
    _barrier(device)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    _sync(device)
    elapsed = (time.perf_counter() - t0) / args.iters
    # every rank reports the slowest rank's time, as nccl-tests with -a 3 (max)
    t = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    seconds = max(float(t.item()), 1e-9)

    # correctness: a fresh fill, one all_reduce, count elements != n(n+1)/2 (NaN counts)
    buf.fill_(float(value))
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    wrong = (buf != expected).sum().to(torch.int64).reshape(1)
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM)
    del buf

    alg, bus = bandwidths(nbytes, seconds, nranks)
    return {"bytes": nbytes, "count": count, "time_us": seconds * 1e6,
            "algbw_gbs": alg, "busbw_gbs": bus, "wrong": int(wrong.item())}


def _out(msg: str):
    # one write per message: ranks share torchrun's stdout
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def _write_json(path: str, doc: dict):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def run(args) -> int:
    rank, nranks, device = setup(args)
    try:
        dtype = DTYPES[args.dtype]
        elem = torch.empty((), dtype=dtype).element_size()
        sizes = sweep_sizes(args.min_bytes, args.max_bytes, args.factor, elem)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        hosts: list = [None] * nranks
        dist.all_gather_object(hosts, socket.gethostname())
        type_name = NCCL_TYPE_NAMES[args.dtype]
        if rank == 0:
            _out(f"# allreduce_bench: backend={args.backend} world_size={nranks} "
                 f"nnodes={nnodes_from_env()} local_world_size={local_world} "
                 f"device={device.type} ({device_name}) dtype={args.dtype} "
                 f"warmup={args.warmup} iters={args.iters} time=max over ranks")
            if nranks < 2:  # busbw = algbw x 2(n-1)/n = 0: not a measurement of any link
                _out("# busbw is not defined for fewer than 2 ranks: run under torchrun with "
                     "--nproc-per-node 2 or more to measure the links")
            _out("#\n" + format_table_header())
        rows = []
        for nbytes in sizes:
            row = bench_size(nbytes, args, rank, nranks, device)
            rows.append(row)
            if rank == 0:
                _out(format_row(row, type_name))
        summary = summarize(rows)
        if rank == 0:
            ok = "OK" if summary["wrong_total"] == 0 else "FAILED"
            _out(f"# Out of bounds values : {summary['wrong_total']} {ok}\n"
                 f"# Avg bus bandwidth    : {summary['avg_busbw_gbs']:.6g}\n#")
            if args.json is not None:
                doc = {
                    "backend": args.backend,
                    "world_size": nranks,
                    "nnodes": nnodes_from_env(),
                    "local_world_size": local_world,
                    "device": device.type,
                    "device_name": device_name,
                    "dtype": args.dtype,
                    "op": "all_reduce",
                    "redop": "sum",
                    "warmup": args.warmup,
                    "iters": args.iters,
                    "time_reduction": "max",
                    "bus_factor": allreduce_bus_factor(nranks),
                    "rows": rows,
                    **summary,
                    "hosts": hosts,
                }
                if args.json == "-":
                    _out(JSON_PREFIX + json.dumps(doc, separators=(",", ":")))
                else:
                    _write_json(args.json, doc)
        # a last collective, so no rank tears down while another is still printing/using it
        _barrier(device)
        return 1 if summary["wrong_total"] else 0
    finally:
        dist.destroy_process_group()


@record
def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except BenchError as e:
        sys.stderr.write(f"allreduce_bench.py: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
