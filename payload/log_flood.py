"""Benchmark aid for `invoke logs`: every rank writes --lines numbered lines as fast as it
can, each stamped with the time it was written, so delivery latency and loss can be measured."""

import argparse
import os
import time

import progress

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--lines", type=int, default=20000)
ap.add_argument("--delay", type=float, default=0.0, help="seconds to wait before writing")
a = ap.parse_args()
rank = int(os.environ.get("RANK", "0"))
print(progress.format_line("start", {"rank": rank, "local_rank": os.environ.get("LOCAL_RANK", "0")}),
      flush=True)
time.sleep(a.delay)
for i in range(a.lines):
    print(f"flood rank={rank} seq={i} t={time.time():.6f}", flush=(i % 64 == 63))
print(f"flood rank={rank} end t={time.time():.6f}", flush=True)
