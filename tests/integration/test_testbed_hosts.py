"""The testbed itself: real hosts that reboot with their identity, and a clean teardown."""

import re

from conftest import N_HOSTS, PROFILES, invoke, wait_until


def _exec(inv, host, cmd, **kw):
    r = invoke("exec", "-i", str(inv), "-H", host, cmd, **kw)
    return r, dict(re.findall(r"^(\S+) +\| (.*)$", r.stdout, re.M))


def test_status_json(testbed):
    import json
    r = invoke("testbed.status", "--json", check=True)
    st = json.loads(r.stdout)
    assert len(st["hosts"]) == N_HOSTS and st["serving"]
    assert all(h["running"] and h["ssh"] and h["mounted"] for h in st["hosts"].values())
    assert st["hosts"]["gpu2"]["profile"] == "h100-nvswitch-8"


def test_hosts_are_distinct_machines(testbed):
    r = invoke("exec", "-i", str(testbed), "cat /etc/machine-id; cat /etc/ssh/ssh_host_ed25519_key.pub",
               check=True)
    ids = re.findall(r"^(gpu\d) \| ([0-9a-f]{32})$", r.stdout, re.M)
    keys = re.findall(r"^(gpu\d) \| ssh-ed25519 (\S+)", r.stdout, re.M)
    assert len({i for _, i in ids}) == N_HOSTS and len({k for _, k in keys}) == N_HOSTS


def test_hosts_have_disjoint_cgroup_trees(testbed):
    """Every host's processes live under a cgroup of its own: hosts whose systemds shared one
    tree broke each other's units on reboot (status 219/CGROUP, a host left 'booting up')."""
    from torchrig.testbed import machines
    paths = {}
    for i in range(1, N_HOSTS + 1):
        name = f"gpu{i}"
        pids = machines._inside(machines.root_of(name))
        assert pids, f"no process found inside {name}"
        groups = set()
        for pid in pids:
            try:
                text = open(f"/proc/{pid}/cgroup").read()
            except OSError:
                continue  # exited meanwhile
            groups |= set(re.findall(r"^0::(\S+)$", text, re.M))
        paths[name] = groups
        assert all(g.startswith(f"/torchrig-testbed/{machines.machine(name)}/") for g in groups), groups
    for a in paths:
        for b in paths:
            assert a == b or not paths[a] & paths[b], (a, b, paths[a] & paths[b])


def test_no_route_out(testbed):
    r, out = _exec(testbed, "gpu1", "ip route; ip route get 1.1.1.1 >/dev/null 2>&1 && echo ROUTE || echo NOROUTE")
    assert "gpu1 | NOROUTE" in r.stdout and "default" not in r.stdout


def test_stand_in_repo_and_index_are_served(testbed, inventory_doc):
    v = inventory_doc["vars"]
    cmd = (f"curl -fsS {v['cuda_repo_url']}/debian12/x86_64/InRelease | head -3; "
           f"curl -fsS {v['pip_index_url']}/torch/ | grep -o 'torch-2.13.0[^<]*whl' | head -1")
    r, _ = _exec(testbed, "gpu1", cmd)
    assert r.returncode == 0, r.stderr
    assert "BEGIN PGP SIGNED MESSAGE" in r.stdout and "torch-2.13.0+cpu" in r.stdout


def test_reboot_keeps_address_and_keys(testbed):
    _, before = _exec(testbed, "gpu3", "cat /proc/sys/kernel/random/boot_id")
    invoke("exec", "-i", str(testbed), "-H", "gpu3", "--sudo", "systemctl reboot")

    def back():  # a new boot id, and systemd done booting
        r, _ = _exec(testbed, "gpu3", "cat /proc/sys/kernel/random/boot_id; systemctl is-system-running --wait")
        # the boot id's own line: the last line (the system state) always differs from it
        now = re.findall(r"^gpu3 \| ([0-9a-f-]{36})$", r.stdout, re.M)
        return r.returncode == 0 and now and now[0] != before.get("gpu3") and r.stdout
    # the known_hosts written at testbed.up still verifies it: same keys, same address
    after = wait_until("gpu3 to come back from its reboot with a new boot id", back, 120, 1)
    assert re.search(r"^gpu3 \| running$", after, re.M), \
        after + _exec(testbed, "gpu3", "systemctl --failed --no-legend")[0].stdout


def test_down_leaves_nothing_then_up_again(testbed, fleet):
    """Runs last in this file: tear down, check the machine is clean, bring it back (fresh:
    the session's fleet forgets what it provisioned)."""
    r = invoke("testbed.down", check=True)
    fleet.forget()
    assert "removed" in r.stdout
    from torchrig.testbed import lab
    assert lab.leftovers() == []
    assert not testbed.exists()
    r = invoke("testbed.up", "--hosts", str(N_HOSTS),
               "--profile", PROFILES,
               "--inventory", str(testbed), check=True)
    assert testbed.exists()
