"""provision's firewall step (torchrig's nftables table over the job ports): the rules it
renders and the changes it plans, from fact tables (pure, no SSH)."""

import hashlib

import pytest

from torchrig.errors import TorchrigError
from torchrig.facts.netfilter import UNIT, parse_ephemeral
from torchrig.changes import managed
from torchrig.provision import firewall, steps
from torchrig.settings import settings_for
from test_provision_plan import fresh

FLEET = ("10.0.0.1", "10.0.0.2", "fd00::3")


def ctx(facts, **vars_):
    return steps.Ctx(facts, settings_for("h", vars_, "inv.yml"), "h", [], "10.0.0.1",
                     fleet=FLEET, login="admin", ssh_port=2222)


def stat(body, mode=0o644):
    return {"sha256": hashlib.sha256(body.encode()).hexdigest(), "mode": mode, "owner": "root",
            "group": "root", "content": body}


def converged(**over):
    """A host where the step already ran: nftables in, both files written, the table loaded."""
    c = ctx(fresh())
    files = {managed.FIREWALL_RULES.path(): stat(firewall.render_rules(c)),
             managed.FIREWALL_UNIT.path(): stat(managed.FIREWALL_UNIT.render(
                 rules=managed.FIREWALL_RULES.path()))}
    f = fresh(packages={"nftables": "1.0.6-2+deb12u2"}, files=files,
              units={UNIT: {"enabled": "enabled", "active": "active"}},
              firewall={"loaded": True, "ephemeral": "32768\t60999\n"})
    f.update(over)
    return f


def test_rules_admit_the_fleet_to_the_job_ports_and_only_owners_to_the_rendezvous():
    rules = firewall.render_rules(ctx(fresh(firewall={"loaded": False, "ephemeral": "40000 50000\n"})))
    assert rules.splitlines()[5:8] == ["table inet torchrig", "delete table inet torchrig",
                                       "table inet torchrig {"]  # one atomic replacement
    assert "elements = { 10.0.0.1, 10.0.0.2 }" in rules and "elements = { fd00::3 }" in rules
    assert "tcp dport { 29400-29899, 40000-50000 } ip saddr @fleet4 accept" in rules
    assert "tcp dport { 29400-29899, 40000-50000 } reject with icmpx type admin-prohibited" in rules
    assert "tcp dport { 2222, 9100 } accept" in rules     # SSH and node_exporter left alone
    assert ("tcp dport 29400-29899 ct state new meta skuid != { root, torchrig, admin } reject"
            in rules)
    # the job's other listeners (gloo, NCCL, a one-node job's store) on this node and the
    # fleet's: other local users were let through on lo and to every fleet address
    for to in ('oif "lo"', "ip daddr @fleet4", "ip6 daddr @fleet6"):
        assert (f"tcp dport 40000-50000 ct state new {to} meta skuid != {{ root, torchrig, admin }}"
                " reject" in rules), to
    unit = managed.FIREWALL_UNIT.render(rules=managed.FIREWALL_RULES.path())
    assert "PartOf=nftables.service" in unit and "ReloadPropagatedFrom=nftables.service" in unit
    other = firewall.render_rules(steps.Ctx(fresh(), settings_for(
        "h", {"rdzv_port": 31000, "service_user": "jobs"}, "inv.yml"), "h", [], "", fleet=FLEET,
        login="root"))
    assert "31000-31499" in other and "skuid != { root, jobs }" in other


def test_fresh_host_installs_writes_enables_and_loads():
    got = [c.describe() for c in firewall.plan(ctx(fresh()))]
    assert got == ["install nftables",
                   "write /etc/torchrig/firewall.nft (mode 0644, root:root)",
                   "write /etc/systemd/system/torchrig.firewall.service (mode 0644, root:root)",
                   "enable torchrig.firewall.service",
                   "load torchrig's nftables table (its rules changed)"]
    assert steps.STEPS.index(next(s for s in steps.STEPS if s.name == "firewall")) > \
        steps.STEPS.index(next(s for s in steps.STEPS if s.name == "service-user"))


def test_converged_plans_nothing_and_a_flushed_table_is_loaded_again():
    assert firewall.plan(ctx(converged())) == []
    flushed = firewall.plan(ctx(converged(firewall={"loaded": False, "ephemeral": "32768 60999"})))
    assert [c.describe() for c in flushed] == ["load torchrig's nftables table (not loaded)"]
    # a fleet that grew: the rules are rewritten and loaded again
    grown = steps.Ctx(converged(), settings_for("h", {}, "inv.yml"), "h", [], "10.0.0.1",
                      fleet=FLEET + ("10.0.0.9",), login="admin", ssh_port=2222)
    assert [c.describe() for c in firewall.plan(grown)][-1] == \
        "load torchrig's nftables table (its rules changed)"


def test_switched_off_removes_what_an_earlier_provision_put_there():
    off = [c.describe() for c in firewall.plan(steps.Ctx(converged(), settings_for(
        "h", {"firewall": False}, "inv.yml"), "h", [], "", fleet=FLEET))]
    assert off == ["stop and disable torchrig.firewall.service (var firewall: false)",
                   "remove /etc/torchrig/firewall.nft",
                   "remove /etc/systemd/system/torchrig.firewall.service"]
    assert firewall.plan(steps.Ctx(fresh(), settings_for("h", {"firewall": False}, "inv.yml"),
                                   "h", [], "", fleet=FLEET)) == []


def test_fleet_addresses_by_ip_and_a_name_that_does_not_resolve_is_one_clear_error():
    assert firewall.resolve("10.0.0.7", "host a") == ["10.0.0.7"]
    assert firewall.resolve("fd00::0:3", "host a") == ["fd00::3"]
    assert "127.0.0.1" in firewall.resolve("localhost", "host a")
    with pytest.raises(TorchrigError, match=r"host gpu9: address 'nosuch\.invalid' does not "
                                            r"resolve.*firewall: false"):
        firewall.resolve("nosuch.invalid", "host gpu9")


def test_login_user_that_nft_cannot_name_is_refused():
    c = steps.Ctx(fresh(), settings_for("h", {}, "inv.yml"), "h", [], "", fleet=FLEET,
                  login="Admin User")
    with pytest.raises(TorchrigError, match="login user 'Admin User'.*firewall: false"):
        firewall.render_rules(c)


@pytest.mark.parametrize("text,want", [("32768\t60999\n", (32768, 60999)), ("1024 5000", (1024, 5000)),
                                       ("", (32768, 60999)), ("9 x", (32768, 60999)),
                                       ("5000 1024", (32768, 60999))])
def test_ephemeral_range(text, want):
    assert parse_ephemeral(text) == want


def test_a_slurm_hosts_rules_let_slurmctld_call_srun_back():
    """slurmctld (user slurm) connects to srun's ephemeral listener on the job's node: without
    that user among the owners, every Slurm job of the fleet hung at its start."""
    from types import SimpleNamespace

    from torchrig.provision.slurm import USER
    c = ctx(fresh(firewall={"loaded": False, "ephemeral": "40000 50000\n"}))
    c.cluster = SimpleNamespace(roles=lambda host: {"compute"} if host == c.host else set())
    assert f"skuid != {{ root, torchrig, admin, {USER} }}" in firewall.render_rules(c)
    c.cluster = SimpleNamespace(roles=lambda host: set())  # a host outside the cluster
    assert USER not in firewall.render_rules(c)


def test_the_firewall_unit_is_not_read_as_a_job():
    """It was torchrig-firewall.service: active (a oneshot that stays), so launch on a GPU node
    refused every job ("already runs job(s) firewall on its GPUs")."""
    from torchrig.launch.run import busy_jobs
    listed = f"{UNIT} loaded active exited torchrig firewall\n" \
             "torchrig-exp1.service loaded active running torchrig job exp1\n"
    assert busy_jobs(listed) == ["exp1"]
    assert managed.FIREWALL_UNIT.path().endswith("/" + UNIT)
