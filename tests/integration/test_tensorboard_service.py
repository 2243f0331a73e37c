"""TensorBoard through SSH and the end of a job in `status`, on one testbed node (gpu1): var
tensorboard installs TensorBoard (from the testbed's wheel index), a train.py job writes events
(stopped once `status --watch` saw it train),
`torchrig tensorboard` serves them through a forwarded port, Ctrl-C (or the operator vanishing)
leaves nothing running on the node. One job serves every test here."""

import json
import re
import signal
import socket
import threading
import time
import urllib.request

import pytest
import yaml

from conftest import (invoke, invoke_bg, launch, provision, sh, status, wait_unit_ended, wait_until,
                      write_inventory)

pytestmark = pytest.mark.provisioned("gpu1")
HOST = "gpu1"
JOB = "t-tb"
# the unit and its process: nothing of either may be left once `torchrig tensorboard` ended
WATCHED: list[str] = []  # status --json --watch 1's output while the job trained
LEFT = ("systemctl list-units --all --plain --no-legend 'torchrig.tensorboard*'; "
        "pgrep -a -f '[b]in/tensorboard' || true")


@pytest.fixture(scope="module")
def tb_inv(fleet, tmp_path_factory):
    """gpu1 with var tensorboard (provision converges: only the venv step changes) and a job
    that trained, was watched by status --watch, and was stopped."""
    testbed = fleet.provisioned(HOST)  # before the file's mark would: this fixture comes first
    doc = yaml.safe_load(testbed.read_text())
    doc["vars"]["tensorboard"] = True
    inv = write_inventory(tmp_path_factory.mktemp("tb"), doc)
    r, data = provision(inv, HOST, "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    venv = next(s for s in data[0]["steps"] if s["name"] == "python-venv")
    assert any("tensorboard==2.21.0" in c for c in venv["changes"]), venv
    # a job that trains until stopped: status --watch samples it while it trains (its trend,
    # for the test below), however fast this machine trains
    r = launch(inv, JOB, "--args", "--max-steps 100000 --log-every 5", hosts=HOST)
    assert r.returncode == 0, r.stderr
    try:
        watch = invoke_bg("status", "-i", str(inv), "-H", HOST, "--job", JOB, "--json", "--watch", "1")
        out: list[str] = []
        threading.Thread(target=lambda: out.extend(iter(watch.stdout.readline, "")), daemon=True).start()
        try:
            wait_until("status --watch to see the job train in 3 rounds",
                       lambda: sum("step=" in (d["nodes"][HOST].get("progress") or "")
                                   for d in _docs("".join(out))) >= 3, 300, 1)
        finally:
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=60)
        WATCHED.append("".join(out))
    finally:
        invoke("stop", "-i", str(inv), "-H", HOST, "--job", JOB, check=True)  # it ends: SIGTERM
    return inv


def _docs(text: str) -> list[dict]:
    """The JSON documents `status --json --watch` printed, one per round (a round Ctrl-C cut
    short is left out)."""
    dec, docs = json.JSONDecoder(), []
    i = text.find("{")
    while i != -1:
        try:
            doc, end = dec.raw_decode(text, i)
        except ValueError:
            break
        docs.append(doc)
        i = text.find("{", end)
    return docs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode(errors="replace")


def _start(inv, port):
    p = invoke_bg("tensorboard", "-i", str(inv), "-H", HOST, "--job", JOB, "--port", str(port))
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(iter(p.stdout.readline, "")), daemon=True).start()
    wait_until("torchrig tensorboard to say where it serves",
               lambda: any("http://127.0.0.1:" in ln for ln in out) or p.poll() is not None, 180, 0.3)
    assert p.poll() is None, ("".join(out), p.stderr.read())
    return p, out


def test_status_of_an_ended_job_says_when_it_ended_and_how_long_it_ran(tb_inv):
    # a job of its own that runs to its end (the fixture's job was stopped: `stop` resets its
    # failed state, and systemd then forgets the unit's timestamps: docs/how-it-works.md, status)
    job = "t-tb-end"
    r = launch(tb_inv, job, "--args", "--max-steps 10 --log-every 5", hosts=HOST)
    assert r.returncode == 0, r.stderr
    wait_unit_ended(tb_inv, HOST, f"torchrig-{job}", 240)
    before = time.time()
    r, st = status(tb_inv, job, hosts=HOST)
    node = st["nodes"][HOST]
    assert node["unit"]["ActiveState"] == "inactive" and node["uptime_s"] is None
    assert 1 < node["ran_s"] < 300 and before - 600 < node["ended_at"] <= before + 5
    text = invoke("status", "-i", str(tb_inv), "-H", HOST, "--job", job, check=True).stdout
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(node["ended_at"]))
    assert re.search(rf"ran \d+s, ended {when}:\d\d UTC", text), text


def test_status_watch_keeps_a_trend_of_tokens_per_s_and_gpu_use(tb_inv):
    docs = _docs(WATCHED[0])
    assert len(docs) >= 3, WATCHED[0][-2000:]
    trend = docs[-1]["trend"][HOST]
    assert len(trend["gpu_util"]) == len(docs)  # one sample per round
    assert len(trend["tokens_per_s"]) == len(docs)
    assert any(v for v in trend["tokens_per_s"]), trend  # rank 0's step lines, while it trained


def test_tensorboard_serves_the_jobs_events_through_ssh_and_ctrl_c_stops_both(tb_inv):
    port = _free_port()
    p, out = _start(tb_inv, port)
    try:
        assert f"http://127.0.0.1:{port}/" in "".join(out)
        assert "<title>TensorBoard</title>" in _get(f"http://127.0.0.1:{port}/")
        # the events train.py wrote, read by TensorBoard on the node as the job's user
        tags = wait_until("TensorBoard to list the job's scalars",
                          lambda: (t := _get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags"))
                          and "train/loss" in t and t, 60, 1)
        assert "perf/tokens_per_s" in tags
        ps = sh(tb_inv, HOST, "ps -eo user=,args= | grep '[b]in/tensorboard'")
        assert ps.split()[0] == "torchrig" and "--host 127.0.0.1" in ps, ps
        p.send_signal(signal.SIGINT)  # Ctrl-C
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, p.stderr.read()
    assert re.search(r"TensorBoard stopped; its unit torchrig\.tensorboard-t-tb-\w+\.service is gone",
                     "".join(out)), out
    assert sh(tb_inv, HOST, LEFT) == ""
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_operator_vanishing_stops_tensorboard_on_the_node(tb_inv):
    """No Ctrl-C: the operator's process dies (SIGKILL, a closed laptop). The watch script's
    SSH channel closes with it, and the node stops the unit itself."""
    p, _ = _start(tb_inv, _free_port())
    assert "torchrig.tensorboard" in sh(tb_inv, HOST, LEFT)
    p.kill()
    p.wait(timeout=10)
    wait_until("the node to stop TensorBoard", lambda: sh(tb_inv, HOST, LEFT) == "", 30, 1)


def test_a_job_without_tensorboard_is_one_error_line(tb_inv):
    r = invoke("tensorboard", "-i", str(tb_inv), "-H", HOST, "--job", "t-no-such-job")
    assert r.returncode == 1
    assert r.stderr.strip().startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "t-no-such-job" in r.stderr and "Traceback" not in r.stderr
