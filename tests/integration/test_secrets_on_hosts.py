"""Secrets on real hosts: provision with a pip index and an nccl-tests git URL that carry
credentials, served by a server that refuses anything without them. Every output mode, every
file the host wrote and every process's command line on this machine (the hosts' processes
included) is searched for each secret form. The first test needs a fresh gpu1 (the session's fleet
resets it when an earlier file provisioned it); the others need it provisioned."""

import base64
import json
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import invoke, write_inventory

HOST = "gpu1"
PORT = 8091
PIP_USER, PIP_PW = "ci-user", "Zq9s3cr@t/pw"        # in the URL: raw '@', '/' percent-encoded
GIT_TOKEN = "ghpTOKENxY7"                             # a token as the URL's user name
WANDB, DB_PW, COLON_TOKEN, HF = "wandbV4lueQ7", "dbPw5Xk", "colTok3nQ", "hfSecretR8"
MARKERS = ["Zq9s3cr", "t%2Fpw", GIT_TOKEN, WANDB, DB_PW, COLON_TOKEN, HF]

STANDIN_GIT = r'''#!/usr/bin/python3
# TESTBED STAND-IN for git clone: asks the configured credential helper as git does, proves
# the credentials against the server, then leaves a clone whose config holds the URL it got.
import base64, json, os, subprocess, sys, time, urllib.error, urllib.request
SEEN = "/var/lib/standin-git-seen"
args = sys.argv[1:]
helpers = [a.split("=", 1)[1] for a in args if a.startswith("credential.helper=")]
cred = {}
if helpers and helpers[-1].startswith("!"):
    h = helpers[-1][1:]
    out = subprocess.run(["sh", "-c", h + ' "$@"', h, "get"], input="", capture_output=True,
                         text=True).stdout
    cred = dict(l.split("=", 1) for l in out.splitlines() if "=" in l)
url, dest = args[-2], args[-1]
req = urllib.request.Request(url + "/info/refs")
if cred:
    pair = f"{cred.get('username', '')}:{cred.get('password', '')}".encode()
    req.add_header("Authorization", "Basic " + base64.b64encode(pair).decode())
try:
    status = urllib.request.urlopen(req, timeout=10).status
except urllib.error.HTTPError as e:
    status = e.code
# stay until the process sampler has seen this command line (it leaves SEEN), at most 60 s
for _ in range(600):
    if os.path.exists(SEEN):
        os.unlink(SEEN)
        break
    time.sleep(0.1)
os.makedirs(dest + "/.git")
open(dest + "/.git/config", "w").write(f'[remote "origin"]\n\turl = {url}\n')
with open("/var/log/standin-git.log", "a") as f:
    f.write(json.dumps({"argv": sys.argv, "status": status}) + "\n")
sys.exit(0 if status == 200 else 128)
'''


class AuthServer:
    """The testbed's web root (pip index), plus /nccl-tests.git, each behind Basic auth."""

    def __init__(self, addr, www):
        want = {"pip": self._basic(PIP_USER, PIP_PW), "git": self._basic(GIT_TOKEN, "")}
        self.counts = {"ok": 0, "denied": 0}
        outer = self

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self):
                git = self.path.startswith("/nccl-tests.git")
                if self.headers.get("Authorization") != want["git" if git else "pip"]:
                    outer.counts["denied"] += 1
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="test"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                outer.counts["ok"] += 1
                if git:
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                super().do_GET()

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer((addr, PORT), partial(Handler, directory=str(www)))
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def _basic(user, pw):
        return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class ArgvSampler:
    """Every process's command line on this machine, sampled: the testbed hosts share its
    kernel, so their processes (root's apt, pip, git on the host) are in this /proc too."""

    def __init__(self, seen_flag: Path):
        self.seen_flag = seen_flag  # touched when a clone is seen: the stand-in git waits for it
        self.hits, self.seen, self._stop = set(), 0, threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self._stop.is_set():
            for p in Path("/proc").glob("[0-9]*"):
                try:
                    argv = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if "pip" in argv and "install" in argv or "clone" in argv:
                    self.seen += 1
                if "clone" in argv and "credential.helper" in argv:
                    self.seen_flag.touch()
                for m in MARKERS:
                    if m in argv:
                        self.hits.add(argv[:300])
            time.sleep(0.1)

    def stop(self):
        self._stop.set()
        if self.t.is_alive():
            self.t.join()


@pytest.fixture
def secret_inventory(testbed, tmp_path):
    from torchrig.testbed.paths import GATEWAY_IP
    doc = yaml.safe_load(testbed.read_text())
    doc["vars"].update({
        "pip_index_url": f"http://{PIP_USER}:{PIP_PW.replace('/', '%2F')}@{GATEWAY_IP}:{PORT}/pypi/simple",
        "nccl_tests": True,
        "nccl_tests_source": f"http://{GIT_TOKEN}@{GATEWAY_IP}:{PORT}/nccl-tests.git",
        # free-form values: a secret_env name, a ':token@' URL, a secret-looking name
        "env": {"WANDB_KEYLESS": WANDB, "MIRROR": f"https://:{COLON_TOKEN}@example.invalid/x",
                "HF_TOKEN": HF},
    })
    # secret_env on another host than the one used: it is honoured from every host
    other = next(h for h in doc["hosts"] if h["name"] != HOST)
    other.setdefault("vars", {})["secret_env"] = "WANDB_KEYLESS"
    return write_inventory(tmp_path, doc)


def _no_markers(text, what):
    leaked = [m for m in MARKERS if m in text]
    assert not leaked, f"{what} shows {leaked}:\n{text[-3000:]}"


def test_no_secret_in_any_output_file_or_command_line(testbed, fleet, secret_inventory):
    fleet.fresh(HOST, "this test")  # pip and git must fetch through the server
    from torchrig.testbed.machines import host_dir, root_of
    from torchrig.testbed.paths import GATEWAY_IP, www
    inv = str(secret_inventory)
    root = root_of(HOST)
    for name, text in (("git", STANDIN_GIT), ("make", "#!/bin/sh\nexit 0\n")):
        (root / "usr/local/bin" / name).write_text(text)
        (root / "usr/local/bin" / name).chmod(0o755)
    server = AuthServer(GATEWAY_IP, www())
    sampler = ArgvSampler(root / "var/lib/standin-git-seen")
    try:
        outputs = {}
        for mode in (["hosts"], ["hosts", "--json"]):
            r = invoke(*mode, "-i", inv)
            assert r.returncode == 0, r.stderr
            outputs[" ".join(mode)] = r.stdout + r.stderr
        assert "WANDB_KEYLESS" in outputs["hosts --json"]
        for mode in (["--dry-run"], ["--dry-run", "--json"]):
            r = invoke("provision", "-i", inv, "-H", HOST, *mode)
            assert r.returncode == 0, r.stderr
            outputs["provision " + " ".join(mode)] = r.stdout + r.stderr
        assert f"from http://{GATEWAY_IP}:{PORT}/nccl-tests.git" in outputs["provision --dry-run"]
        # apply in text mode (the apply log on stderr), across the driver's reboot
        r = invoke("provision", "-i", inv, "-H", HOST, "--yes", "--reboot", timeout=1200)
        outputs["provision apply"] = r.stdout + r.stderr
        assert r.returncode == 0, r.stdout + r.stderr
        # again with --json, the clone redone so its step shows in the JSON
        invoke("exec", "-i", inv, "-H", HOST, "--sudo", "rm -rf /opt/torchrig/nccl-tests", check=True)
        r = invoke("provision", "-i", inv, "-H", HOST, "--yes", "--json", timeout=600)
        outputs["provision --json"] = r.stdout + r.stderr
        assert r.returncode == 0, r.stdout + r.stderr
        fleet.mark(HOST, "test_secrets_on_hosts")
        steps = {s["name"]: s for s in json.loads(r.stdout)[0]["steps"]}
        assert steps["nccl-tests"]["status"] == "changed"
        sampler.stop()  # launch's --env below is the operator's own command line
        r = invoke("launch", "-i", inv, "-H", HOST, "--nodes", "1", "--job", "t-secrets",
                   "--dry-run", "--env", f"DB_URL=postgres://app:{DB_PW}@db.internal/x")
        outputs["launch --dry-run"] = r.stdout + r.stderr
        assert r.returncode == 0, r.stderr
        assert "DB_URL='postgres://app:***@db.internal/x'" in r.stdout, r.stdout
        assert "MIRROR='https://***@example.invalid/x'" in r.stdout and "WANDB_KEYLESS='***'" in r.stdout
    finally:
        sampler.stop()
        server.close()
        for name in ("git", "make"):
            (root / "usr/local/bin" / name).unlink(missing_ok=True)
        sampler.seen_flag.unlink(missing_ok=True)
    for what, text in outputs.items():
        _no_markers(text, what)
    # the credentials did reach pip and git (the server refuses requests without them)
    assert server.counts["ok"] > 10
    log = [json.loads(ln) for ln in (root / "var/log/standin-git.log").read_text().splitlines()]
    assert [e["status"] for e in log] == [200, 200]
    assert sampler.seen > 0  # the sampler did see pip/git at work
    assert not sampler.hits, sampler.hits
    # every file the host wrote (its overlay's upper layer), the clone's config included
    assert (root / "opt/torchrig/nccl-tests/.git/config").read_text().count("nccl-tests.git") == 1
    hits = []
    for p in (host_dir(HOST) / "upper").rglob("*"):
        if p.is_file() and not p.is_symlink():
            try:
                data = p.read_bytes()
            except OSError:
                continue
            hits += [f"{p}: {m}" for m in MARKERS if m.encode() in data]
    assert not hits, hits
    # no fixed-path leftovers in /tmp from provision (keyring .deb, tarball, netrc)
    assert not [p.name for p in (root / "tmp").iterdir() if p.name.startswith(("torchrig", "tmp."))]


@pytest.mark.provisioned(HOST)
def test_benchmark_copy_ignores_a_planted_tmp_folder(testbed):
    """Another local user pre-creates verify's old fixed folder with a symlink to a file of the
    login user: verify --bandwidth must neither write through it nor run what is there."""
    from torchrig.testbed.machines import root_of
    root = root_of(HOST)
    plant = ("useradd -M -s /usr/sbin/nologin mallory 2>/dev/null || true; "
             "echo 'precious' > /home/admin/victim && chown admin: /home/admin/victim && "
             "rm -rf /tmp/torchrig-verify && "
             "runuser -u mallory -- sh -c 'mkdir -m 777 /tmp/torchrig-verify && "
             "ln -s /home/admin/victim /tmp/torchrig-verify/allreduce_bench.py'")
    invoke("exec", "-i", str(testbed), "-H", HOST, "--sudo", plant, check=True)
    r = invoke("verify", "-i", str(testbed), "-H", HOST, "--bandwidth", "--json", timeout=600)
    data = json.loads(r.stdout)
    node = next(b for b in data["bandwidth"] if b["scope"] == "node")
    assert node["result"] and node["result"]["world_size"] == 2, node  # the benchmark ran
    assert (root / "home/admin/victim").read_text() == "precious\n"
    assert not [p for p in (root / "tmp").iterdir() if p.name.startswith("tmp.")]  # removed


@pytest.mark.provisioned(HOST)
def test_logs_and_status_mask_what_a_job_prints(testbed, secret_inventory):
    """A job that prints its secrets (env_check.py shows the env names it is given): `logs`
    shows *** for each form (a secret_env name set on another host, a secret-looking name, a
    URL's credentials); `status` and its --json too."""
    inv = str(secret_inventory)
    r = invoke("launch", "-i", inv, "-H", HOST, "--nodes", "1", "--job", "t-leak", "--script",
               "env_check.py", "--nproc-per-node", "1",
               "--env", "TORCHRIG_SHOW_ENV=WANDB_KEYLESS,HF_TOKEN,MIRROR", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    out = invoke("logs", "-i", inv, "-H", HOST, "--job", "t-leak", "-f", timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "ENV_CHECK" in ln)
    env = json.loads(line.split("ENV_CHECK ", 1)[1])["env"]
    assert env == {"WANDB_KEYLESS": "***", "HF_TOKEN": "***",
                   "MIRROR": "https://***@example.invalid/x"}, line
    texts = [out.stdout + out.stderr, r.stdout + r.stderr]
    for flags in ([], ["--json"]):
        st = invoke("status", "-i", inv, "-H", HOST, "--job", "t-leak", *flags)
        texts.append(st.stdout + st.stderr)
    for text in texts:
        _no_markers(text, "launch/logs/status")
