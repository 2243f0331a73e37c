"""payload/torchrig_torchrun.py: torchrun whose agent's exit barrier waits as long as the
launch says (torchrun: a fixed 300 s)."""

import os
import subprocess
import sys
from pathlib import Path

PAYLOAD = Path(__file__).resolve().parents[2] / "payload"


def test_exit_barrier_timeout_reaches_the_agent(tmp_path):
    (tmp_path / "ok.py").write_text("print('hi')\n")
    env = {**os.environ, "LOGLEVEL": "INFO", "TORCHRIG_EXIT_BARRIER_TIMEOUT": "7",
           "PYTHONPATH": str(PAYLOAD)}
    r = subprocess.run([sys.executable, "-m", "torchrig_torchrun", "--standalone", "--nproc-per-node", "1",
                        "ok.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Waiting 7.0 seconds for other agents to finish" in r.stderr
    env.pop("TORCHRIG_EXIT_BARRIER_TIMEOUT")
    r = subprocess.run([sys.executable, "-m", "torchrig_torchrun", "--standalone", "--nproc-per-node", "1",
                        "ok.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "Waiting 300 seconds for other agents to finish" in r.stderr  # plain torchrun
