"""provision on real testbed hosts: real apt, dpkg and systemd; stand-in NVIDIA packages.
The fresh-path tests take fresh hosts (gpu1, gpu2, gpu3) and tell the session's fleet which they
leave provisioned; the tests that need a provisioned host ask the fleet for it, so each runs
alone too."""

import json
import re
import time

import pytest

from conftest import invoke, invoke_bg, provision, sh, sh_each, steps_of, wait_until, write_inventory


SNAPSHOT = ("find /etc -xdev -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum; "
            "dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' | sha256sum; "
            "ls -la /opt /srv 2>&1 | sha256sum")


def test_unsupported_os_refused_nothing_changed(testbed):
    sh(testbed, "gpu3", "cp --remove-destination /usr/lib/os-release /etc/os-release.torchrig-test && "
                        "printf 'ID=centos\\nVERSION_ID=\"7\"\\nPRETTY_NAME=\"CentOS Linux 7 (Core)\"\\n' "
                        "> /etc/os-release.new && mv /etc/os-release /etc/os-release.orig && "
                        "mv /etc/os-release.new /etc/os-release")
    try:
        before = sh(testbed, "gpu3", SNAPSHOT)
        r, data = provision(testbed, "gpu3", "--yes")
        assert r.returncode == 1
        assert "gpu3: preflight: unsupported OS 'CentOS Linux 7 (Core)'" in r.stderr
        assert sh(testbed, "gpu3", SNAPSHOT) == before
    finally:
        sh(testbed, "gpu3", "mv -f /etc/os-release.orig /etc/os-release && rm -f /etc/os-release.torchrig-test")


def test_dry_run_changes_nothing(testbed, fleet):
    fleet.fresh("gpu2", "this test")  # its plan has everything to do
    before = sh(testbed, "gpu2", SNAPSHOT)
    r = invoke("provision", "-i", str(testbed), "-H", "gpu2", "--dry-run")
    assert r.returncode == 0, r.stderr
    # the plan names the changes and shows files as unified diffs
    assert "install NVIDIA driver 570.172.08 (nvidia-open)" in r.stdout
    assert "+++ b/etc/apt/sources.list.d/torchrig-cuda.sources" in r.stdout
    assert "+Signed-By: /usr/share/keyrings/cuda-archive-keyring.gpg" in r.stdout
    assert sh(testbed, "gpu2", SNAPSHOT) == before


def test_without_yes_and_without_terminal_refuses(testbed, fleet):
    fleet.fresh("gpu2", "this test")  # there are changes to confirm
    before = sh(testbed, "gpu2", SNAPSHOT)
    r = invoke("provision", "-i", str(testbed), "-H", "gpu2")
    assert r.returncode == 1 and "rerun with --yes" in r.stderr
    assert sh(testbed, "gpu2", SNAPSHOT) == before


LOCK = "/var/lib/dpkg/lock-frontend"


def hold_lock(inv, host, unit):
    """Another process holds the dpkg frontend lock, as unattended-upgrades does after boot,
    until the test stops `unit`; returns once the lock is certainly held."""
    sh(inv, host, f"systemd-run --unit={unit} --collect python3 -c "
                  f"\"import fcntl,time; f=open('{LOCK}','w'); "
                  "fcntl.lockf(f, fcntl.LOCK_EX); time.sleep(86400)\"")
    # a non-blocking try from another process fails exactly while the holder has it
    probe = (f"python3 -c \"import fcntl; fcntl.lockf(open('{LOCK}','w'), fcntl.LOCK_EX | "
             "fcntl.LOCK_NB)\" 2>/dev/null && echo free || echo held")
    wait_until(f"{unit} on {host} to hold {LOCK}", lambda: sh(inv, host, probe) == "held", 60, 0.5)


def test_dpkg_lock_held_past_timeout_names_holder(testbed, inventory_doc, fleet, tmp_path):
    fleet.fresh("gpu2", "this test")  # its first apt step must have work to do
    inventory_doc["vars"]["apt_lock_timeout"] = 4
    inv = write_inventory(tmp_path, inventory_doc)
    hold_lock(testbed, "gpu2", "torchrig-test-lockholder")
    try:
        r, data = provision(inv, "gpu2", "--yes")
        assert r.returncode == 1
        assert re.search(r"gpu2: step cuda-repo failed: .*dpkg lock /var/lib/dpkg/lock-frontend still "
                         r"held after 4s by pid \d+ \(\S*python3 -c import fcntl", r.stderr), r.stderr
    finally:
        sh(testbed, "gpu2", "systemctl stop torchrig-test-lockholder", check=False)


def test_fresh_provision_waits_for_lock_reboots_and_converges(testbed, fleet):
    """The lock is held until the test sees provision waiting for it (its lock-wait script
    running on the host) and a few seconds more: on any machine speed the step waited."""
    fleet.fresh("gpu2", "this test")
    hold_lock(testbed, "gpu2", "torchrig-test-lockholder2")
    p = invoke_bg("provision", "-i", str(testbed), "-H", "gpu2", "--json", "--yes", "--reboot")
    try:
        # "[a] waiter": the wait script's own text, spelled so this pgrep does not match itself
        wait_until("provision to wait for the dpkg lock on gpu2",
                   lambda: sh(testbed, "gpu2", "pgrep -fc '[a] waiter, not a holder' || true") != "0",
                   600, 1)
        hold_s = 5
        time.sleep(hold_s)  # how long it keeps waiting (not a synchronisation: it is waiting now)
    finally:
        sh(testbed, "gpu2", "systemctl stop torchrig-test-lockholder2", check=False)
    out, err = p.communicate(timeout=1200)
    assert p.returncode == 0, err + out
    data = json.loads(out)
    fleet.mark("gpu2", "test_provision's fresh provision")
    rep, st = steps_of(data, "gpu2")
    assert rep["rebooted"] is True
    # the first apt step waited for the holder instead of failing
    assert st["cuda-repo"]["status"] == "changed" and st["cuda-repo"]["seconds"] >= hold_s
    for name in ("base-packages", "driver", "cuda-toolkit", "nccl", "python-venv", "service-user"):
        assert st[name]["status"] == "changed", st[name]
    assert st["driver-services"]["status"] in ("changed", "ok")

    got = sh_each(testbed, "gpu2", {
        "pkgs": "dpkg-query -W -f='${Package}=${Version}\\n' nvidia-open "
                "nvidia-fabricmanager-570 cuda-toolkit-12-8 libnccl2 libnccl-dev",
        "held": "apt-mark showhold",
        "driver": "nvidia-smi --query-gpu=driver_version --format=csv,noheader | sort -u",
        "active": "systemctl is-active nvidia-fabricmanager nvidia-persistenced",
        "modes": "stat -c '%n %a %U:%G' /opt/torchrig /etc/torchrig /srv/torchrig/data "
                 "/srv/torchrig/checkpoints /var/log/torchrig",
        "src": "cat /etc/apt/sources.list.d/torchrig-cuda.sources",
        # the testbed's image is a bare server's: no venv pip, no compiler (testbed/image.py)
        "base": "dpkg-query -W -f='${Package} ${Status}\\n' python3-venv python3-dev "
                "build-essential; command -v gcc g++ make",
        "home": "getent passwd torchrig | cut -d: -f6"})
    pkgs = got["pkgs"]
    assert pkgs.split() == ["cuda-toolkit-12-8=12.8.93-1", "libnccl-dev=2.26.2-1+cuda12.8",
                            "libnccl2=2.26.2-1+cuda12.8", "nvidia-fabricmanager-570=570.172.08-1",
                            "nvidia-open=570.172.08-1"]
    held = got["held"].split()
    assert {"nvidia-open", "nvidia-fabricmanager-570", "cuda-toolkit-12-8", "libnccl2",
            "libnccl-dev"} <= set(held)
    assert got["driver"] == "570.172.08"
    assert got["active"].split() == ["active", "active"]
    assert sh(testbed, "gpu2", "/opt/torchrig/venv/bin/python -c 'import torch; print(torch.__version__)'",
              sudo=False).splitlines()[-1] == "2.13.0+cpu"
    modes = got["modes"]
    assert modes.splitlines() == ["/opt/torchrig 755 root:root", "/etc/torchrig 755 root:root",
                                  "/srv/torchrig/data 750 torchrig:torchrig",
                                  "/srv/torchrig/checkpoints 755 root:root",
                                  "/var/log/torchrig 755 root:root"]
    src = got["src"]
    assert "Suites: /" in src and "Signed-By: /usr/share/keyrings/cuda-archive-keyring.gpg" in src
    assert got["base"].splitlines() == [   # dpkg-query lists by name, command -v in turn
        "build-essential install ok installed", "python3-dev install ok installed",
        "python3-venv install ok installed", "/usr/bin/gcc", "/usr/bin/g++", "/usr/bin/make"]
    assert got["home"] == "/opt/torchrig/home"


STAMPS = ("sha256sum /var/log/dpkg.log /var/log/apt/history.log; "
          "systemctl show -p ActiveEnterTimestampMonotonic -p InvocationID "
          "nvidia-persistenced nvidia-fabricmanager")


@pytest.mark.provisioned("gpu2")
def test_second_run_changes_nothing(testbed):
    before = sh(testbed, "gpu2", STAMPS)
    r, data = provision(testbed, "gpu2", "--yes")
    assert r.returncode == 0, r.stderr
    rep, st = steps_of(data, "gpu2")
    assert rep["changed"] == 0 and not rep["rebooted"]
    assert {s["status"] for s in st.values()} <= {"ok", "skipped"}
    # no apt-get install ran (dpkg and apt logs unchanged), no unit was (re)started
    assert sh(testbed, "gpu2", STAMPS) == before


@pytest.mark.provisioned("gpu2")
def test_apply_refuses_a_plan_the_host_no_longer_matches(testbed):
    """The plan carries a fingerprint of the facts it was built from: a host that changed
    between plan and apply is refused with what changed, nothing applied; re-planning works."""
    from torchrig.inventory import load
    from torchrig.provision.apply import apply_host, plan_hosts
    from torchrig.session import Fleet
    inv = load(str(testbed))
    fl = Fleet(inv, [x for x in inv.hosts if x.name == "gpu2"])

    def plan_host(fl, h):
        (r,) = plan_hosts(fl)
        return r.value
    h = fl.hosts[0]
    sh(testbed, "gpu2", "rm /etc/modprobe.d/blacklist-nouveau.conf")
    p = plan_host(fl, h)
    assert [c for st in p.report.steps for c in st.changes][:1] == [
        "write /etc/modprobe.d/blacklist-nouveau.conf (mode 0644, root:root)"]
    sh(testbed, "gpu2", "echo edited >> /etc/torchrig/cuda.env")  # after the operator saw the plan
    rep = apply_host(fl, p, reboot=False)
    assert not rep.ok and rep.changed == 0
    assert rep.error == ("the host changed since the plan was made (files[/etc/torchrig/cuda.env]): "
                         "nothing was applied; rerun provision to see the new plan")
    assert sh(testbed, "gpu2", "test -e /etc/modprobe.d/blacklist-nouveau.conf || echo absent") == "absent"
    rep = apply_host(fl, plan_host(fl, h), reboot=False)
    assert rep.ok and rep.changed == 2, rep   # driver (blacklist) and cuda-toolkit (cuda.env)
    assert apply_host(fl, plan_host(fl, h), reboot=False).changed == 0


@pytest.mark.provisioned("gpu2")
def test_saved_plan_applies_exactly_and_is_refused_once_the_host_changed(testbed, tmp_path):
    """`--dry-run --save-plan FILE` then `--plan FILE`: a host changed in between is refused
    (nothing applied); a fresh plan applies, once. Progress lines go to stderr, not --json's
    stdout."""
    import os
    import stat
    sh(testbed, "gpu2", "rm /etc/modprobe.d/blacklist-nouveau.conf")
    f1, f2 = str(tmp_path / "p1.json"), str(tmp_path / "p2.json")
    r, data = provision(testbed, "gpu2", "--dry-run", "--save-plan", f1)
    assert r.returncode == 0, r.stderr
    assert f"plan for 1 host(s) saved to {f1}" in r.stderr
    assert stat.S_IMODE(os.stat(f1).st_mode) == 0o600
    saved = json.load(open(f1))
    assert saved["hosts"][0]["fingerprint"] == data[0]["fingerprint"]
    sh(testbed, "gpu2", "echo edited >> /etc/torchrig/cuda.env")  # after the plan was saved
    r = invoke("provision", "-i", str(testbed), "--plan", f1)  # its hosts: gpu2
    assert r.returncode == 1
    assert (f"error: provision --plan {f1} (nothing applied on any host) failed on gpu2: the host "
            "changed since the plan was saved (") in r.stderr, r.stderr
    assert "files[/etc/torchrig/cuda.env]" in r.stderr
    assert sh(testbed, "gpu2", "test -e /etc/modprobe.d/blacklist-nouveau.conf || echo absent") == "absent"
    r, _ = provision(testbed, "gpu2", "--dry-run", "--save-plan", f2)
    assert r.returncode == 0, r.stderr
    r, data = provision(testbed, "gpu2", "--plan", f2)
    assert r.returncode == 0, r.stderr
    rep, st = steps_of(data, "gpu2")
    assert rep["changed"] == 2 and st["driver"]["status"] == "changed"
    # non-TTY progress: each step's start and end as plain lines on stderr
    assert re.search(r"^gpu2 \| driver: write /etc/modprobe.d/blacklist-nouveau.conf", r.stderr, re.M)
    assert re.search(r"^gpu2 \| driver: changed in \d+\.\d+s$", r.stderr, re.M), r.stderr
    r = invoke("provision", "-i", str(testbed), "--plan", f2)  # applied: the host moved on
    assert r.returncode == 1 and "the host changed since the plan was saved" in r.stderr


def test_reboot_needed_is_reported_then_reboot_path(testbed, fleet):
    fleet.fresh("gpu1", "this test")
    r, data = provision(testbed, "gpu1", "--yes")
    assert r.returncode == 1
    assert "gpu1: the new NVIDIA driver needs a reboot" in r.stderr and "--reboot" in r.stderr
    rep, st = steps_of(data, "gpu1")
    assert rep["reboot_required"] and st["driver"]["status"] == "changed"
    assert st["driver-services"]["status"] == "skipped"
    assert "cuda-drivers=570.172.08-1" in " ".join(st["driver"]["changes"])  # V100: proprietary
    r, data = provision(testbed, "gpu1", "--yes", "--reboot")
    assert r.returncode == 0, r.stderr
    rep, st = steps_of(data, "gpu1")
    assert rep["rebooted"] and st["driver-services"]["status"] in ("changed", "ok")  # enabled: starts at boot
    fleet.mark("gpu1", "test_provision's reboot path")
    assert sh(testbed, "gpu1", "systemctl is-active nvidia-persistenced") == "active"


# every installed package of the NVIDIA driver, the CUDA toolkit and NCCL, with its version
STACK = ("dpkg-query -W -f='${db:Status-Abbrev} ${Package}=${Version}\\n' '*nvidia*' 'cuda-*' "
         "'libnccl*' | awk '$1 ~ /^.i/ {print $2}'")
UPGRADE = ("export DEBIAN_FRONTEND=noninteractive; apt-get update -q >/dev/null && "
           "apt-get upgrade -y -q -o Dpkg::Options::=--force-confold >/dev/null && "
           "apt-get dist-upgrade -y -q -o Dpkg::Options::=--force-confold >/dev/null && echo upgraded")


@pytest.mark.provisioned("gpu2")
def test_operator_upgrade_moves_no_nvidia_cuda_or_nccl_package(testbed):
    """The stand-in repository is built like NVIDIA's: nvidia-open depends on libnvidia-ml1 and
    nvidia-kernel-open-dkms with `>=`, and a newer build of the same driver branch (and a
    newer NCCL) is published beside the pinned one. An operator's own upgrade must move none
    of the stack under the loaded driver (the library would no longer match the module)."""
    newer = sh(testbed, "gpu2", "apt-cache madison libnvidia-ml1 libnccl2", sudo=False)
    assert "570.195.03-1" in newer and "2.27.3-1+cuda12.8" in newer, newer
    before = dict(ln.split("=", 1) for ln in sh(testbed, "gpu2", STACK).split())
    # every package of the driver is the pinned build, not the newest one apt could pick
    driver = {p: v for p, v in before.items() if v.startswith("570.")}
    assert {"nvidia-open", "libnvidia-ml1", "nvidia-kernel-open-dkms",
            "nvidia-fabricmanager-570"} <= set(driver), before
    assert set(driver.values()) == {"570.172.08-1"}, before
    assert before["cuda-nvcc-12-8"] == "12.8.93-1" and before["libnccl2"] == "2.26.2-1+cuda12.8"
    # the CUDA toolkit's components are held with it
    assert {"cuda-toolkit-12-8", "cuda-nvcc-12-8", "libnccl2", "libnccl-dev"} <= \
        set(sh(testbed, "gpu2", "apt-mark showhold").split())
    # the distribution's own packages may move (and say so on stderr: ca-certificates'
    # rehash warns); the chain's last word says every step of it succeeded
    assert sh(testbed, "gpu2", UPGRADE).splitlines()[-1] == "upgraded"
    assert dict(ln.split("=", 1) for ln in sh(testbed, "gpu2", STACK).split()) == before
    assert sh(testbed, "gpu2", "nvidia-smi --query-gpu=driver_version --format=csv,noheader "
                               "| sort -u") == "570.172.08"
    # provision agrees: nothing to do (the host is left as provision left it)
    r, data = provision(testbed, "gpu2", "--yes")
    assert r.returncode == 0, r.stderr
    assert steps_of(data, "gpu2")[0]["changed"] == 0


@pytest.mark.provisioned("gpu1")
def test_interrupted_dpkg_converges(testbed):
    """A dpkg run killed between unpack and configure leaves the package half-installed
    ('iU', reported by dpkg --audit); `dpkg --unpack` leaves exactly that state."""
    sh(testbed, "gpu1", "apt-mark unhold libnccl-dev >/dev/null && dpkg -r libnccl-dev >/dev/null && "
                        "cd /tmp && apt-get download -q libnccl-dev=2.26.2-1+cuda12.8 >/dev/null && "
                        "dpkg --unpack /tmp/libnccl-dev_*.deb >/dev/null 2>&1")
    assert "libnccl-dev" in sh(testbed, "gpu1", "dpkg --audit")
    r, data = provision(testbed, "gpu1", "--yes")
    assert r.returncode == 0, r.stderr
    rep, st = steps_of(data, "gpu1")
    assert st["apt-recover"]["status"] == "changed"
    assert sh(testbed, "gpu1", "dpkg --audit") == ""
    assert "libnccl-dev" in sh(testbed, "gpu1", "apt-mark showhold").split()
    r, data = provision(testbed, "gpu1", "--yes")
    assert steps_of(data, "gpu1")[0]["changed"] == 0


def test_module_that_never_loads_fails_after_one_reboot(testbed, fleet):
    """A driver whose kernel module does not load at boot (Secure Boot refusing it, a failed
    DKMS build): one reboot, then a clear failure, never a reboot loop or 'ok'. The testbed's
    stand-in module loader is made to fail with a systemd drop-in, like a failing modprobe."""
    fleet.fresh("gpu3", "this test")
    dropin = "/etc/systemd/system/nvidia-standin-module.service.d"
    sh(testbed, "gpu3", f"mkdir -p {dropin} && printf '[Service]\\nExecStart=\\nExecStart=/bin/false\\n' "
                        f"> {dropin}/torchrig-test-fail.conf")
    try:
        r, data = provision(testbed, "gpu3", "--yes", "--reboot")
        assert r.returncode == 1, r.stderr
        assert "gpu3: the NVIDIA driver is still not usable after the reboot (no-driver)" in r.stderr
        assert "dmesg" in r.stderr
        rep, st = steps_of(data, "gpu3")
        assert rep["rebooted"] and not rep["ok"]
        assert st["driver"]["status"] == "changed" and st["driver-services"]["status"] == "skipped"
    finally:
        sh(testbed, "gpu3", f"rm -rf {dropin} && systemctl daemon-reload")
