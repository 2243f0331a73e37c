"""Probe replies for `torchrig report`'s tests, shaped as gather.request() gets them back:
journalctl -o json lines (newest first, as journalctl 252 prints them with --grep and -n), the
sampler's files, the unit's properties."""

import json

T0 = 1796080000.0


def jline(t: float, seq: int, msg) -> str:
    return json.dumps({"__CURSOR": f"s=ab;i={seq:x};b=cd;m=1;t=2;x=3", "MESSAGE": msg,
                       "__REALTIME_TIMESTAMP": str(int(t * 1e6)), "_BOOT_ID": "cd"})


def glog(t: float, level: str, text: str) -> str:
    import time
    return time.strftime(f"{level}%m%d %H:%M:%S.000000 3103 torch/distributed/elastic/agent/"
                         "server/api.py:1000] ", time.gmtime(t)) + text


def journal(msgs: list[tuple[float, object]]) -> str:
    return "\n".join(jline(t, i + 1, m) for i, (t, m) in reversed(list(enumerate(msgs))))


def reply(msgs, util="", mem="", state="inactive", load="loaded", props="", **run) -> dict:
    """`props`: more of the unit's properties (lines); `run`: more commands' {rc, out, err}."""
    return {"run": {"unit": {"rc": 0, "out": f"LoadState={load}\nActiveState={state}\n"
                                             f"Result=success\n{props}", "err": ""}, **run,
                    "journal": {"rc": 0, "out": journal(msgs), "err": ""},
                    "kernel": {"rc": 1, "out": "", "err": ""},
                    "clock": {"rc": 0, "out": "2026 +0000\n", "err": ""}},
            "read": {"util": {"text": util} if util is not None else None,
                     "mem": {"text": mem} if mem is not None else None},
            "host": {"time": T0 + 100}}


def rank0_node() -> dict:
    """gpu1: ranks 0 and 1; rank 1 is SIGKILLed at step 20, the group restarts, resumes from
    the step-10 checkpoint and finishes at step 30."""
    t = T0
    msgs = [(t, "an older run's last line"),
            (t + 1, "Started torchrig-j1.service - torchrig job j1"),
            (t + 2, "[default0]:start rank=0 local_rank=0 host=gpu1 world_size=4"),
            (t + 2, "[default1]:start rank=1 local_rank=1 host=gpu1 world_size=4")]
    for i, s in enumerate((5, 10, 15, 20)):
        msgs.append((t + 3 + i, f"[default0]:step={s} loss={3 - i * 0.2:.4f} lr=1e-3 tok/s={1000 + i} epoch=0"))
    msgs += [(t + 8, glog(t + 8, "W", "Sending process 1200 closing signal SIGTERM")),
             (t + 8, glog(t + 8, "E", "failed (exitcode: -9) local_rank: 1 (pid: 1201) of binary: python")),
             (t + 9, glog(t + 9, "W", "[default] Worker group FAILED. 2/3 attempts left; will restart worker group")),
             (t + 10, "[default0]:start rank=0 local_rank=0 host=gpu1 world_size=4"),
             (t + 10, "[default1]:start rank=1 local_rank=1 host=gpu1 world_size=4"),
             (t + 11, "[default0]:resume step=10 epoch=0 ckpt=/ckpt/ckpt_00000010.pt")]
    for i, s in enumerate((15, 20, 25, 30)):
        msgs.append((t + 12 + i, f"[default0]:step={s} loss={2.5 - i * 0.2:.4f} tok/s={900 + i} epoch=0"))
    msgs += [(t + 16, "[default0]:done step=30 loss=1.9000 ckpt=/ckpt/ckpt_00000030.pt"),
             (t + 17, "torchrig-j1.service: Main process exited, code=exited, status=0/SUCCESS"),
             (t + 17, "torchrig-j1.service: Deactivated successfully.")]
    util = "\n".join(f"{int(t + 5 * i)},{50 + i},{60 + i}" for i, _ in enumerate(range(4)))
    util += "\nnan,1,2\n1796080001,inf,3\ngarbage\n"
    mem = "\n".join(f"{int(t + 5 * i)},{1000 + i},32768,{2000 + i},32768" for i in range(4)) + "\n1,2\n"
    return reply(msgs, util, mem)


def peer_node() -> dict:
    t = T0
    msgs = [(t + 1, "Started torchrig-j1.service - torchrig job j1"),
            (t + 2, "[default0]:start rank=2 local_rank=0 host=gpu2 world_size=4"),
            (t + 2, "[default0]:some other output the report never needs"),
            (t + 17, "torchrig-j1.service: Deactivated successfully.")]
    util = "\n".join(f"{int(t + 5 * i)},{40 + i},{30 + i}" for i in range(3))
    return reply(msgs, util, None)


BANDWIDTH = {"gpu1": {"host": "gpu1", "address": "10.0.0.1", "time": T0,
                      "node": {"hosts": ["gpu1"], "status": "PASS", "world_size": 2,
                               "points": [[1048576, 0.3], [4194304, 0.4], [16777216, 0.45]]},
                      "cluster": {"hosts": ["gpu1", "gpu2"], "status": "PASS", "world_size": 4,
                                  "points": [[1048576, 0.2], [16777216, 0.41]]}}}


def gathered() -> dict:
    return {"nodes": [("gpu1", rank0_node()), ("gpu2", peer_node()),
                      ("gpu3", reply([], load="not-found")), ("gpu4", "SSH connection lost")],
            "bandwidth": BANDWIDTH}
