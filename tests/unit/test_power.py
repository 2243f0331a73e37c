"""power's pure parts: the inventory's bmc: section, the plan, ipmitool's command line and
replies, and that the redactor knows the BMC password."""

import re

import pytest

from torchrig import inventory
from torchrig.errors import TorchrigError
from torchrig.inventory import Bmc, InventoryError
from torchrig.power import ipmi, plan, redfish
from torchrig.secrets import Redactor

BMC = "{address: 10.0.0.13, user: admin, password_env: GPU3_BMC}"


def load(tmp_path, bmc: str):
    p = tmp_path / "hosts.yml"
    p.write_text(f"hosts:\n  - name: gpu3\n    bmc: {bmc}\n  - name: gpu4\n")
    return inventory.load(p)


def test_bmc_loads_with_defaults(tmp_path):
    inv = load(tmp_path, BMC)
    b = inv.host("gpu3").bmc
    assert (b.address, b.protocol, b.user, b.port, b.cipher_suite) == \
        ("10.0.0.13", "ipmi", "admin", None, None)
    assert inv.host("gpu4").bmc is None


@pytest.mark.parametrize("bmc, pattern", [
    ("{address: 10.0.0.13, user: admin}", r"host 'gpu3': field 'bmc' give exactly one of password"),
    ("{address: 10.0.0.13, user: admin, password: a, password_env: B}", r"exactly one of"),
    ("{address: '-oProxy', user: admin, password: x}", r"field 'bmc.address' .*not starting with '-'"),
    ("{address: 'a b', user: admin, password: x}", r"field 'bmc.address' .*without spaces"),
    ("{address: h, user: 'ad min', password: x}", r"field 'bmc.user'"),
    ("{address: h, user: u, password: x, protocol: snmp}", r"field 'bmc.protocol' expected 'ipmi' or 'redfish'"),
    ("{address: h, user: u, password: x, protocol: redfish, cipher_suite: 3}",
     r"field 'bmc' cipher_suite is not a setting of protocol redfish"),
    ("{address: h, user: u, password: x, tls_verify: false}",
     r"field 'bmc' tls_verify is not a setting of protocol ipmi"),
    ("{address: h, user: u, password_env: 'not a name'}", r"field 'bmc.password_env'"),
    ("{address: h, user: u, password: x, port: 0}", r"field 'bmc.port' expected >= 1"),
    ("{address: h, user: u, password: x, cipher_suite: 18}", r"field 'bmc.cipher_suite' expected <= 17"),
    ("{address: h, user: u, password: x, pasword: y}", r"field 'bmc.pasword' is not a known key"),
])
def test_bad_bmc_is_one_message(tmp_path, bmc, pattern):
    with pytest.raises(InventoryError, match=pattern) as e:
        load(tmp_path, bmc)
    assert "\n" not in str(e.value)


def test_password_inline_and_from_env_are_redacted(tmp_path, monkeypatch):
    inv = load(tmp_path, BMC)
    monkeypatch.setenv("GPU3_BMC", "env-s3cret")
    assert Redactor.for_hosts(inv.hosts).text("x env-s3cret y") == "x *** y"
    inline = load(tmp_path, "{address: h, user: u, password: inline-pw}")
    red = Redactor.for_hosts(inline.hosts)
    assert red.text("pw=inline-pw") == "pw=***"
    assert red.data(inline.host("gpu3").model_dump())["bmc"]["password"] == "***"


def test_plan_refuses_hosts_without_bmc_and_unknown_actions(tmp_path):
    inv = load(tmp_path, BMC)
    targets = plan.plan([inv.host("gpu3")], "status", "hosts.yml")
    assert [(t.host, t.action, t.where) for t in targets] == \
        [("gpu3", "status", "gpu3 (BMC 10.0.0.13)")]
    with pytest.raises(TorchrigError, match=r"host 'gpu4' has no 'bmc:'"):
        plan.plan(inv.hosts, "status", "hosts.yml")
    with pytest.raises(TorchrigError, match=r"power 'reboot': unknown action; expected one of"):
        plan.plan([inv.host("gpu3")], "reboot", "hosts.yml")


@pytest.mark.parametrize("action, refused", [("status", False), ("on", True), ("off", True),
                                             ("cycle", True)])
def test_switching_needs_yes(tmp_path, action, refused):
    targets = plan.plan([load(tmp_path, BMC).host("gpu3")], action, "hosts.yml")
    plan.refuse_without_yes(targets, yes=True)
    if refused:
        with pytest.raises(TorchrigError, match=rf"power {action} switches the power of gpu3.*--yes"):
            plan.refuse_without_yes(targets, yes=False)
    else:
        plan.refuse_without_yes(targets, yes=False)


def test_ipmitool_argv_reads_the_password_from_its_environment():
    b = Bmc(address="10.0.0.13", user="admin", password="pw-in-file")
    cmd = ipmi.argv(b, "cycle")
    assert cmd[:2] == ["ipmitool", "-I"] and cmd[-3:] == ["chassis", "power", "cycle"]
    assert "-E" in cmd and "-P" not in cmd and "-C" not in cmd and "pw-in-file" not in cmd
    assert cmd[cmd.index("-p") + 1] == "623"
    c2 = ipmi.argv(Bmc(address="h", user="u", password_env="X", port=6230, cipher_suite=3), "status")
    assert c2[c2.index("-p") + 1] == "6230" and c2[c2.index("-C") + 1] == "3"


@pytest.mark.parametrize("action, stdout, want", [
    ("status", "Chassis Power is on\n", "on"),
    ("status", "Chassis Power is off\n", "off"),
    ("cycle", "Chassis Power Control: Cycle\n", "cycle accepted (Cycle)"),
    ("off", "Chassis Power Control: Down/Off\n", "off accepted (Down/Off)"),
])
def test_ipmitool_replies(action, stdout, want):
    assert ipmi.parse_reply(action, stdout) == want


def test_unexpected_reply_is_an_error():
    with pytest.raises(TorchrigError, match="not one it gives"):
        ipmi.parse_reply("status", "Chassis Power Control: Up/On\n")


@pytest.mark.parametrize("stderr, pattern", [
    ("Error: Unable to establish IPMI v2 / RMCP+ session\n", r"wrong user or password.*UDP port 623"),
    ("Address lookup for bmc3 failed\nCould not open socket!\n"
     "Error: Unable to establish IPMI v2 / RMCP+ session\n", r"does not resolve"),
    ("Set Chassis Power Control to Cycle failed: Command not supported in present state\n",
     r"ipmitool failed \(exit 1\): Set Chassis Power Control to Cycle failed: Command not"),
    ("", r"ipmitool failed \(exit 1\): no message"),
])
def test_ipmitool_failures_explained(stderr, pattern):
    assert re.search(pattern, ipmi.explain_failure(stderr, 1, 623))


def test_password_longer_than_ipmi_allows():
    ipmi.check_password("x" * 20)
    with pytest.raises(TorchrigError, match="longer than IPMI's 20 bytes"):
        ipmi.check_password("x" * 21)


def test_the_password_goes_to_ipmitool_in_its_environment_only(monkeypatch):
    """ipmitool overwrites a -P password in its own argv once parsed, so sampling argv during
    a call rarely sees one: this checks the call itself."""
    import subprocess

    from torchrig.power import run
    calls = []

    def fake_run(argv, **kw):
        calls.append((argv, kw["env"]))
        return subprocess.CompletedProcess(argv, 0, "Chassis Power is off\n", "")
    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("GPU3_BMC", "env-s3cret")
    t = plan.Target("gpu3", Bmc(address="h", user="u", password_env="GPU3_BMC"), "status")
    assert run.ipmi_call(t) == "off"
    (argv, env), = calls
    assert env[ipmi.PASSWORD_ENV] == "env-s3cret" and not [a for a in argv if "s3cret" in a]
    monkeypatch.delenv("GPU3_BMC")
    with pytest.raises(TorchrigError, match="'GPU3_BMC' is not set in this machine's environment"):
        run.ipmi_call(t)


def test_redfish_url_and_tls():
    b = Bmc(address="10.0.0.13", user="u", password="p", protocol="redfish")
    assert redfish.base_url(b) == "https://10.0.0.13" and redfish.tls_verify(b) is True
    b = Bmc(address="fe80::1", user="u", password="p", protocol="redfish", scheme="http",
            port=8000, tls_verify=False)
    assert redfish.base_url(b) == "http://[fe80::1]:8000" and redfish.tls_verify(b) is False


@pytest.mark.parametrize("action, allowed, want", [
    ("cycle", {"On", "ForceOff", "ForceRestart", "PowerCycle"}, "PowerCycle"),
    ("cycle", {"On", "ForceOff", "ForceRestart"}, "ForceRestart"),
    ("on", {"ForceOn"}, "ForceOn"),
    ("off", {"On", "ForceOff"}, "ForceOff"),
    ("off", set(), "ForceOff"),  # a BMC that lists none: the standard one
])
def test_redfish_reset_type(action, allowed, want):
    assert redfish.reset_type(action, allowed) == want


def test_redfish_reset_type_not_offered():
    with pytest.raises(TorchrigError, match=r"allows none of ForceOff for power off \(it allows: On\)"):
        redfish.reset_type("off", {"On"})


def test_redfish_system_choice():
    assert redfish.pick_system(["1"], None) == "1"
    assert redfish.pick_system(["a", "b"], "b") == "b"
    with pytest.raises(TorchrigError, match=r"has 2 systems \(a, b\); name the host's one with bmc.system"):
        redfish.pick_system(["a", "b"], None)
    with pytest.raises(TorchrigError, match=r"no system 'c' \(it has: a, b\); fix bmc.system"):
        redfish.pick_system(["a", "b"], "c")


@pytest.mark.parametrize("value, word", [("On", "on"), ("Off", "off"),
                                         ("PoweringOff", "powering off"), (None, "unknown"),
                                         ("Weird", "unknown (Weird)")])
def test_redfish_power_state(value, word):
    assert redfish.state_word(value) == word


@pytest.mark.parametrize("kind, message, pattern", [
    ("AccessError", "HTTP GET ... returned code 401", r"refused the login .*bmc.user"),
    ("ConnectionError", "Unable to connect to https://h/redfish/v1/. Error: ... "
     "NewConnectionError(\"...: [Errno 111] Connection refused\"))", r"at https://h \(Connection refused\); check bmc.address"),
    ("ConnectionError", "... SSLError(SSLCertVerificationError(1, '[SSL: "
     "CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate'))",
     r"CERTIFICATE_VERIFY_FAILED.*tls_verify: false"),
    ("ResourceNotFoundError", "HTTP GET returned code 404", r"no Redfish service at https://h/redfish/v1"),
    ("ServerSideError", "returned code 500", r"Redfish error \(ServerSideError\): returned code 500"),
])
def test_redfish_errors_explained(kind, message, pattern):
    assert re.search(pattern, redfish.explain(kind, message, "https://h"))
