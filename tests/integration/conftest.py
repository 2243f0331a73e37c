"""Integration tests: a real testbed (nspawn hosts with systemd and sshd) brought up once per
session on its own bridge, state folder and subnet, so a user's testbed is left alone.

Every file runs alone and in any order: a file whose tests need provisioned hosts says which with
`pytestmark = pytest.mark.provisioned("gpu1", "gpu4")`; the session's `fleet` provisions each
host the first time a test needs it and remembers it (provision converges, so a host that an
earlier test provisioned is not provisioned again). Tests that exercise the fresh path ask
`fleet.fresh(host)` first (a host provisioned earlier is reset to fresh) and tell the fleet
when they leave a host provisioned.

The helpers every file uses (run a command on a host, provision, launch/logs/status, bounded
waits) live here, once. Every wait has a bound and says what it waited for when it gives up."""

import atexit
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ENV = {
    "TORCHRIG_TESTBED_STATE": "/var/lib/torchrig-testbed-tests",
    "TORCHRIG_TESTBED_BRIDGE": "trbt0",
    "TORCHRIG_TESTBED_SUBNET": "10.213.7",
}
# A caller may choose other values (parallel runs: each needs its own state, bridge, subnet).
ENV = {k: os.environ.get(k, v) for k, v in ENV.items()}
os.environ.update(ENV)  # before torchrig.testbed.paths is imported by any test
# the operator-side state (verify --bandwidth's kept sweeps) of this session, not the user's
if "TORCHRIG_STATE_DIR" not in os.environ:
    os.environ["TORCHRIG_STATE_DIR"] = tempfile.mkdtemp(prefix="torchrig-tests-state-")
    atexit.register(shutil.rmtree, os.environ["TORCHRIG_STATE_DIR"], True)

if platform.system() != "Linux" or os.geteuid() != 0:
    pytest.skip("integration tests need Linux and root (systemd-nspawn, mounts, netns)",
                allow_module_level=True)

N_HOSTS = 5  # gpu5: a third V100S pair (the elastic job)
PROFILES = "v100s-nvlink-2,gpu2=h100-nvswitch-8,gpu3=pcie-sys-4"  # gpu4, gpu5: V100S pairs too
NODES = "gpu1,gpu4"  # the two V100S pairs the launch tests train on
WORKER = "'^/opt/torchrig/venv/bin/python[0-9.]* -u train.py'"  # pgrep -f: a job's rank process


# The order a full run takes the files in (each file also runs alone, in any order): the
# fresh-path provision tests first, then the files that share the hosts they leave
# provisioned (a file that wants a fresh host again resets it: Fleet.fresh); Slurm on the
# hosts provisioned by then; the testbed's down/up last (after it every host is fresh, and
# a file after it would provision them again).
FILE_ORDER = [
    "test_provision.py", "test_verify.py", "test_ssh.py", "test_fetch.py", "test_launch.py",
    "test_user_project.py", "test_data.py", "test_elastic.py",
    "test_logs_hostile_files.py", "test_launch_hardening.py", "test_launch_failures.py",
    "test_jobs_listing.py", "test_metrics_node_exporter.py", "test_healthwatch.py", "test_tensorboard_service.py", "test_error_messages.py",
    "test_probe_caps.py", "test_secrets_on_hosts.py", "test_power.py",
    "test_report_chromium.py", "test_slurm_provision.py", "test_slurm_jobs.py", "test_testbed_hosts.py",
]


def pytest_collection_modifyitems(session, config, items):
    """Integration items in FILE_ORDER (stable: within a file, pytest's order), after the rest."""
    here = Path(__file__).parent
    rank = {name: i for i, name in enumerate(FILE_ORDER)}
    unplaced = sorted({it.path.name for it in items if it.path.parent == here} - set(rank))
    if unplaced:
        raise pytest.UsageError(f"{', '.join(unplaced)}: not in FILE_ORDER "
                                f"({Path(__file__).relative_to(REPO)}); add it where it belongs")
    items.sort(key=lambda it: (it.path.parent == here, rank.get(it.path.name, len(rank))))


def pytest_configure(config):
    config.addinivalue_line("markers", "provisioned(*hosts): the test needs these testbed hosts "
                                       "provisioned (the session's fleet does it once)")


# ---- running the CLI and commands on hosts -------------------------------------------------

def invoke(*args, timeout=600, check=False, env=None) -> subprocess.CompletedProcess:
    """Run the toolkit's CLI exactly as a user would (bounded: TimeoutExpired names the command)."""
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **ENV, **(env or {})})
    if check and r.returncode != 0:
        raise AssertionError(f"invoke {' '.join(args)} failed ({r.returncode}):\n"
                             f"{r.stdout}\n{r.stderr}")
    return r


def _sigint_default():
    """Ctrl-C (SIGINT) as a terminal delivers it: a test run started in the background (`&`,
    nohup) hands its children SIGINT ignored, and a follower the test interrupts never ends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def invoke_bg(*args) -> subprocess.Popen:
    """The CLI in the background (a follower, a concurrent launch); the caller bounds its wait."""
    return subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=REPO,
                            env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)


def sh(inv, host, cmd, sudo=True, check=True) -> str:
    """A command on a host through the toolkit (`exec`); its output lines, prefix removed."""
    r = invoke("exec", "-i", str(inv), "-H", host, *(["--sudo"] if sudo else []), cmd)
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd!r} on {host} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return "\n".join(re.findall(rf"^{re.escape(host)} +\| ?(.*)$", r.stdout, re.M))


def sh_each(inv, host, cmds: dict, sudo=True) -> dict:
    """Several commands on a host in one `exec` (one CLI run, not one per check): {key: its
    output lines}, each command run as by sh() (its own exit status is not checked)."""
    mark = "@@torchrig-test-cmd@@"
    script = "\n".join(f"echo '{mark} {i}'\n( {c}\n)" for i, c in enumerate(cmds.values()))
    out = sh(inv, host, script, sudo=sudo, check=False).split("\n")
    at = [i for i, ln in enumerate(out) if ln.startswith(mark)]
    assert len(at) == len(cmds), f"{host}: not every command ran:\n" + "\n".join(out)
    return {k: "\n".join(out[a + 1:b]).strip()
            for k, a, b in zip(cmds, at, [*at[1:], len(out)])}


def cut_ssh(inv, host, user, pattern) -> str:
    """Kill the SSH connection a transfer runs over: the process of `user` matching `pattern`
    (pgrep -f), then every sshd process of its connection up to the listener (kill -9): the
    TCP connection really drops. Returns "user U" and "killed PIDS" lines."""
    return sh(inv, host, rf"""p=$(pgrep -u {user} -f '{pattern}' | head -1); [ -n "$p" ] || exit 9
echo "user $(ps -o user= -p "$p")"
l=$(systemctl show -p MainPID --value ssh); k=
while [ "$p" -gt 1 ]; do
  pp=$(awk '{{print $4}}' /proc/$p/stat)
  [ "$(cat /proc/$p/comm)" = sshd ] && k="$k $p"
  [ "$pp" = "$l" ] && break
  p=$pp
done
echo "killed$k"; kill -9 $k""")


def write_inventory(tmp_path, doc, name="inv.yml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc))
    return p


def inventory_with_known_hosts(tmp_path, inventory_doc, lines=None) -> tuple[Path, Path]:
    """A copy of the testbed inventory whose known_hosts file is a fresh one holding `lines`
    (None: no file at all); returns (inventory, known_hosts)."""
    doc = yaml.safe_load(yaml.safe_dump(inventory_doc))
    kh = tmp_path / "known_hosts"
    if lines is not None:
        kh.write_text("\n".join(lines) + "\n")
    doc["known_hosts"] = str(kh)
    return write_inventory(tmp_path, doc), kh


def ip_of(inv, name) -> str:
    return next(h["address"] for h in yaml.safe_load(Path(inv).read_text())["hosts"]
                if h["name"] == name)


# ---- bounded waits ---------------------------------------------------------------------------

def wait_until(what, probe, timeout, interval=2.0):
    """Call `probe` until it returns something truthy (returned); after `timeout` seconds fail
    naming `what` was awaited and the probe's last answer."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"gave up after {timeout:.0f}s waiting for {what} "
                                 f"(last answer: {last!r})")
        time.sleep(interval)


def unit_state(inv, host, unit) -> str:
    return sh(inv, host, f"systemctl show -p ActiveState --value {unit}", check=False)


def wait_unit_ended(inv, host, unit, timeout=240) -> str:
    return wait_until(f"{unit} on {host} to end (inactive or failed)",
                      lambda: (s := unit_state(inv, host, unit)) in ("inactive", "failed") and s,
                      timeout)


# ---- provision -------------------------------------------------------------------------------

def provision(inv, hosts, *flags, timeout=900):
    """`provision --json`: (result, parsed JSON or None)."""
    r = invoke("provision", "-i", str(inv), "-H", hosts, "--json", *flags, timeout=timeout)
    try:
        data = json.loads(r.stdout)
    except ValueError:
        data = None
    return r, data


def steps_of(data, host):
    rep = next(d for d in data if d["host"] == host)
    return rep, {s["name"]: s for s in rep["steps"]}


# ---- jobs ------------------------------------------------------------------------------------

def launch(inv, job, *args, hosts=NODES, timeout=400, early_window=False):
    """`launch`. Without --early-fail-window in args (or early_window=True: launch's default,
    as a user gets it), the window is 0: a launch returns when every worker runs, instead of
    watching a job that keeps running for 10 s more. The window's own tests (and the basic
    job's launch) give it."""
    if not early_window and "--early-fail-window" not in args:
        args = (*args, "--early-fail-window", "0")
    return invoke("launch", "-i", str(inv), "-H", hosts, "--job", job, *args, timeout=timeout)


def logs(inv, job, *args, hosts=NODES, timeout=600):
    return invoke("logs", "-i", str(inv), "-H", hosts, "--job", job, *args, timeout=timeout)


def status(inv, job, hosts=NODES):
    r = invoke("status", "-i", str(inv), "-H", hosts, "--job", job, "--json")
    return r, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else None)


def stop(inv, job, hosts=NODES, timeout=300):
    return invoke("stop", "-i", str(inv), "-H", hosts, "--job", job, timeout=timeout)


def wait_step(inv, job, step, hosts=NODES, timeout=240) -> int:
    """Until rank 0 has logged a training step >= `step`; returns the highest seen."""
    def probe():
        r = logs(inv, job, "--rank", "0", "--grep", "^step=", hosts=hosts)
        steps = [int(s) for s in re.findall(r"step=(\d+) ", r.stdout)]
        return max(steps) if steps and max(steps) >= step else None
    return wait_until(f"job {job}'s rank 0 to log step {step}", probe, timeout)


# ---- the testbed and its provisioned hosts ----------------------------------------------------

class Fleet:
    """Which testbed hosts this session has provisioned (with the testbed's own inventory)."""

    def __init__(self, inv: Path):
        self.inv = inv
        self.done: dict[str, str] = {}  # host -> who provisioned it
        # per provision of fresh hosts here: (the hosts, the wheels the index served them,
        # the .debs the apt repositories served them), each as (client, file)
        self.served: list[tuple[list[str], list[tuple[str, str]], list[tuple[str, str]]]] = []

    def provisioned(self, *hosts) -> Path:
        """Provision the hosts not yet provisioned this session (all at once, with --reboot),
        noting which wheels and .debs the testbed's server sent meanwhile (its request log)."""
        todo = [h for h in hosts if h not in self.done]
        if todo:
            from torchrig.testbed import paths, pyindex
            log = paths.http_log()
            at = log.stat().st_size if log.exists() else 0
            r, data = provision(self.inv, ",".join(todo), "--yes", "--reboot", timeout=1200)
            assert r.returncode == 0, f"provisioning {todo} for the tests failed:\n{r.stdout}\n{r.stderr}"
            with open(log, "rb") as f:
                f.seek(at)
                text = f.read().decode(errors="replace")
            self.served.append((todo, pyindex.wheels_served(text), paths.debs_served(text)))
            for h in todo:
                self.done[h] = "the provisioned fixture"
        return self.inv

    def fresh(self, host, test):
        """A test of the fresh path: a host this session provisioned is made fresh again
        (the testbed drops what was written on it; in file order none needs it)."""
        if host in self.done:
            from torchrig.testbed import lab
            lab.reset_host(host, log=lambda *_: None)
            del self.done[host]

    def mark(self, host, by):
        """A test left `host` provisioned (converged with the testbed's inventory)."""
        self.done[host] = by

    def forget(self):
        """The testbed was brought down and up again: every host is fresh."""
        self.done.clear()


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    inv = tmp_path_factory.mktemp("testbed") / "testbed.yml"
    invoke("testbed.down", timeout=180)  # leftovers of an aborted earlier run
    invoke("testbed.up", "--hosts", str(N_HOSTS),
           "--profile", PROFILES,
           "--inventory", str(inv), check=True, timeout=900)
    yield inv
    invoke("testbed.down", timeout=180)


@pytest.fixture(scope="session")
def fleet(testbed):
    return Fleet(testbed)


@pytest.fixture(autouse=True)
def _provisioned_hosts(request):
    """Honour a test's `provisioned` mark (usually a file's pytestmark)."""
    mark = request.node.get_closest_marker("provisioned")
    if mark:
        request.getfixturevalue("fleet").provisioned(*mark.args)


@pytest.fixture
def inventory_doc(testbed):
    return yaml.safe_load(testbed.read_text())


# ---- a Slurm cluster (inventory `slurm:`), provisioned once per session -----------------------

# Controller gpu3 and the two V100S pairs the launch tests train on as compute nodes; the
# testbed's containers have no delegated cgroup tree, so Slurm tracks processes by parent
# (slurm.cgroup: false; real hosts keep the cgroup plugins). GRES on the testbed is backed by
# the stand-in device files the testbed creates for each simulated GPU (/dev/nvidiaN). A
# powered-off node is DOWN after 30 s instead of the default 60 (the power-off test waits it).
SLURM = {"controller": "gpu3", "compute": ["gpu1", "gpu4"], "partition": "gpu", "cgroup": False,
         "node_timeout": 30}


class SlurmCluster:
    """The session's Slurm cluster: `inv` (the testbed inventory plus its slurm: section),
    `controller`, `compute` (host names = Slurm node names), `partition`; `first` is the
    provision that set it up ((result, JSON)) and `argv` the process command lines sampled
    on this machine (the hosts share its kernel) while it ran."""

    def __init__(self, inv, first, argv, seconds):
        self.inv, self.first, self.argv, self.seconds = inv, first, argv, seconds
        self.controller, self.compute, self.partition = SLURM["controller"], SLURM["compute"], SLURM["partition"]
        self.hosts = ",".join([self.controller, *self.compute])

    def run(self, cmd, host=None, **kw) -> str:
        """A command on the controller (or `host`), e.g. sinfo/squeue/scontrol."""
        return sh(self.inv, host or self.controller, cmd, **kw)


def sample_argv(stop, seen: set):
    """Every process's command line on this machine until `stop` is set (testbed hosts' too)."""
    while not stop.is_set():
        for p in Path("/proc").glob("[0-9]*"):
            try:
                seen.add((p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
        time.sleep(0.05)


def wait_slurm_idle(cluster, timeout=120) -> str:
    """Until sinfo lists every compute node idle; returns its `node state gres` lines."""
    def probe():
        out = cluster.run("sinfo -N -h -o '%N %t %G'", check=False)
        rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.split()}
        return out if all(n in rows and rows[n].split()[1] == "idle" for n in cluster.compute) else None
    return wait_until("every Slurm compute node idle in sinfo", probe, timeout)


@pytest.fixture(scope="session")
def slurm_cluster(fleet, tmp_path_factory) -> SlurmCluster:
    """One provision of the Slurm inventory, `--yes --reboot`, makes the cluster: on fresh
    hosts the driver it installs loads only after the reboot, so the Slurm configs (which
    describe every node's GPUs) wait for the reboots. A compute node an earlier test already
    provisioned is put back in that state first: its stand-in module unloaded (the stand-in's
    rmmod) and the persistence daemon stopped, as a fresh driver install leaves them."""
    import threading
    hosts = [SLURM["controller"], *SLURM["compute"]]
    for h in SLURM["compute"]:
        if h in fleet.done:
            sh(fleet.inv, h, "systemctl stop nvidia-persistenced && rm -f /run/nvidia-standin/module-version")
    doc = yaml.safe_load(fleet.inv.read_text())
    doc["slurm"] = SLURM
    inv = write_inventory(tmp_path_factory.mktemp("slurm"), doc, "slurm.yml")
    stop, seen = threading.Event(), set()
    sampler = threading.Thread(target=sample_argv, args=(stop, seen), daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        first = provision(inv, ",".join(hosts), "--yes", "--reboot", timeout=1500)
    finally:
        stop.set()
        sampler.join()
    cluster = SlurmCluster(inv, first, seen, time.monotonic() - t0)
    assert first[0].returncode == 0, f"provisioning the Slurm cluster failed:\n{first[0].stdout}\n{first[0].stderr}"
    for h in hosts:
        fleet.mark(h, "the Slurm cluster's provision")
    wait_slurm_idle(cluster)
    return cluster
