"""torchrig tensorboard's pure parts: the port TensorBoard announces, the node-side start
script (quoted, run as the job's user, bound to 127.0.0.1), launch's --tensorboard argument,
and the local forward (real sockets: a local echo server stands in for the SSH channel)."""

import shlex
import socket

import pytest
import yaml

from _fixtures import tcp_server
from torchrig.errors import TorchrigError
from torchrig.facts import tensorboard as facts
from torchrig.forward import Forward
from torchrig.launch import tensorboard as tb
from torchrig.launch.run import LaunchOptions, plan_job


def test_serving_port_from_tensorboards_own_line():
    journal = ("TensorFlow installation not found - running with reduced feature set.\n"
               "TensorBoard 2.21.0 at http://127.0.0.1:43211/ (Press CTRL+C to quit)\n")
    assert facts.serving_port(journal) == 43211
    assert facts.serving_port("TensorBoard 2.21.0 at http://0.0.0.0:6006/\n") is None
    assert facts.serving_port("  TensorBoard 2.21.0 at http://127.0.0.1:99999/") is None
    assert facts.parse_wait("state=active\nline\n") == ("active", "line\n")


def _hosts(tmp_path, doc):
    from torchrig import inventory
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(doc))
    return inventory.load(p).hosts


def test_start_script_runs_as_the_jobs_user_on_localhost_only(tmp_path):
    (h,) = _hosts(tmp_path, {"vars": {"log_dir": "/var/log/my logs", "service_user": "trainer"},
                             "hosts": [{"name": "gpu1", "address": "10.0.0.1"}]})
    unit = tb.unit_name("exp1")
    assert unit.startswith("torchrig.tensorboard-exp1-") and unit.endswith(".service")
    # not a job unit: launch and status count torchrig-<job>.service units as jobs
    from torchrig.job import job_of_unit
    assert job_of_unit(unit) is None
    script = tb.start_script(h, "exp1", unit, 0)
    run = next(ln for ln in script.splitlines() if ln.startswith("systemd-run"))
    run += next(ln for ln in script.splitlines() if '"$tb" --logdir' in ln)
    words = shlex.split(run.replace("\\", ""))
    assert "--uid=trainer" in words and "-p" in words and "NoNewPrivileges=yes" in words
    assert words[words.index("--logdir") + 1] == "/var/log/my logs/exp1/tensorboard"
    assert words[words.index("--host") + 1] == "127.0.0.1"
    assert "runuser -u trainer -- test -d '/var/log/my logs/exp1/tensorboard'" in script


def test_launch_gives_train_py_a_tensorboard_dir_only_where_asked(tmp_path):
    o = LaunchOptions(job="exp1", args="--max-steps 5")
    hosts = _hosts(tmp_path, {"hosts": [
        {"name": "gpu1", "address": "10.0.0.1", "gpus": 2, "vars": {"tensorboard": True}},
        {"name": "gpu2", "address": "10.0.0.2", "gpus": 2}]})
    job = plan_job(None, hosts, o, "/opt/torchrig/payload/releases/x", {})
    assert job.args[job.args.index("--tensorboard") + 1] == "/var/log/torchrig/exp1/tensorboard"
    job = plan_job(None, hosts[::-1], o, "/r", {})  # rank 0 on a node without TensorBoard
    assert "--tensorboard" not in job.args
    own = LaunchOptions(job="exp1", args="--tensorboard /elsewhere")
    assert plan_job(None, hosts, own, "/r", {}).args.count("--tensorboard") == 1


def _echo_server():
    def echo(c):
        with c:
            for data in iter(lambda: c.recv(1024), b""):
                c.sendall(b"echo:" + data)
    return tcp_server(echo)


def test_forward_copies_both_ways_and_close_ends_connections():
    srv = _echo_server()
    peers = []

    def open_channel(peer):
        peers.append(peer)
        return socket.create_connection(srv.getsockname())
    fwd = Forward(open_channel, 0)
    try:
        with socket.create_connection(("127.0.0.1", fwd.port), timeout=5) as c:
            c.sendall(b"hello")
            assert c.recv(100) == b"echo:hello"
            assert peers and peers[0][0] == "127.0.0.1"
            fwd.close()
            c.settimeout(5)
            assert c.recv(100) == b""  # the forward's end closed
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", fwd.port), timeout=2)
    finally:
        fwd.close()
        srv.close()


def test_forward_refuses_a_port_in_use_with_one_line():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        with pytest.raises(TorchrigError, match=r"--port \d+: cannot listen on 127.0.0.1"):
            Forward(lambda peer: None, busy.getsockname()[1])
    finally:
        busy.close()


def test_a_channel_that_cannot_open_fails_that_connection_only():
    def refuse(peer):
        raise OSError("administratively prohibited")
    fwd = Forward(refuse, 0)
    try:
        with socket.create_connection(("127.0.0.1", fwd.port), timeout=5) as c:
            c.settimeout(5)
            assert c.recv(10) == b""
        assert "administratively prohibited" in fwd.errors[0]
    finally:
        fwd.close()
