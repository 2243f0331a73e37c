"""provision's driver re-check after installing the driver is bounded: nvidia-smi on a wedged
GPU can hang for good, and it used to run with no time limit (provision then hung forever)."""

import os
import threading
import time

from torchrig.provision import apply
from torchrig.connections import LocalConnection


def test_a_hanging_nvidia_smi_reads_as_not_ok_within_the_bound(tmp_path, monkeypatch):
    stand_in = tmp_path / "nvidia-smi"
    stand_in.write_text("#!/bin/sh\nexec sleep 300\n")
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(apply, "SMI_TIMEOUT", 1, raising=False)
    got = []
    t = threading.Thread(target=lambda: got.append(apply._driver_now(LocalConnection(None))),
                         daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(40)
    assert got == ["unknown"], "still waiting for nvidia-smi" if not got else got
    assert time.monotonic() - t0 < 40
