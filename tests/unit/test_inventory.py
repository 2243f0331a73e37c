"""Inventory loading: valid files resolve as documented; every bad file gives one message
naming the file, the host and the field."""

from pathlib import Path

import pytest

from torchrig import inventory
from torchrig.inventory import InventoryError

REPO = Path(__file__).resolve().parents[2]

GOOD = """
known_hosts: kh
defaults: {user: ubuntu, identity_file: keys/id}
vars: {log_dir: /shared, data_dir: /shared-data, env: {API_TOKEN: s3cret}}
groups:
  train: {vars: {data_dir: /group, checkpoint_dir: /group-ckpt}}
  infer: {}
hosts:
  - {name: gpu1, address: 10.0.0.1, gpus: 2, groups: [train], vars: {checkpoint_dir: /host}}
  - {name: gpu2, address: 10.0.0.2, port: 2222, user: root, groups: [train, infer]}
  - {name: head, connection: local}
  - {name: alias-only}
"""


def write(tmp_path, text, name="hosts.yml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_example_inventory_is_valid():
    inv = inventory.load(REPO / "inventory/example.yml")
    assert [h.name for h in inv.hosts] == ["gpu1", "gpu2"]
    assert all(h.gpus == 2 for h in inv.hosts)


def test_defaults_vars_and_paths_resolve(tmp_path):
    inv = inventory.load(write(tmp_path, GOOD))
    g1, g2, head, alias = inv.hosts
    assert g1.user == "ubuntu" and g1.port is None and g2.port == 2222 and g2.user == "root"
    assert g1.identity_file == str(tmp_path / "keys/id")
    assert inv.known_hosts == str(tmp_path / "kh")
    assert g1.settings.given() == {"log_dir": "/shared", "data_dir": "/group",
                                   "checkpoint_dir": "/host", "env": {"API_TOKEN": "s3cret"}}
    assert g2.settings.data_dir == "/group" and g2.settings.checkpoint_dir == "/group-ckpt"
    assert head.settings.rdzv_port == 29400 and head.settings.accelerator == "cuda"  # defaults
    assert not hasattr(g1, "vars")  # the raw vars are not kept: everything reads host.settings
    assert head.is_local and head.address == "localhost"
    assert alias.address == "alias-only"  # so ~/.ssh/config Host aliases apply


@pytest.mark.parametrize("spec,expected", [
    (None, ["gpu1", "gpu2", "head", "alias-only"]),
    ("all", ["gpu1", "gpu2", "head", "alias-only"]),
    ("gpu2", ["gpu2"]),
    ("train", ["gpu1", "gpu2"]),
    ("infer,gpu1", ["gpu2", "gpu1"]),
    ("gpu1, train", ["gpu1", "gpu2"]),
])
def test_select(tmp_path, spec, expected):
    inv = inventory.load(write(tmp_path, GOOD))
    assert [h.name for h in inv.select(spec)] == expected


def test_select_unknown_names_the_choices(tmp_path):
    inv = inventory.load(write(tmp_path, GOOD))
    with pytest.raises(InventoryError, match=r"--host 'gpu9': no such host or group .*hosts: gpu1, gpu2"):
        inv.select("gpu1,gpu9")


HOSTS = "hosts:\n  - {name: gpu1, address: 10.0.0.1}\n"

# (inventory text, regex the single message must match). {f} is the file path.
BAD = [
    ("hosts:\n  - {name: gpu1, address: 10.0.0.1, gpus: two}\n",
     r"{f}: host 'gpu1': field 'gpus' expected an integer, got 'two'"),
    ("hosts:\n  - {name: gpu1}\n  - {address: 10.0.0.2}\n",
     r"{f}: hosts entry #2: field 'name' is required but missing"),
    ("hosts:\n  - {name: gpu1, adress: 10.0.0.1}\n",
     r"{f}: host 'gpu1': field 'adress' is not a known key"),
    ("hosts:\n  - {name: gpu1}\n  - {name: gpu1}\n",
     r"{f}: host 'gpu1': field 'name' is a duplicate"),
    ("hosts:\n  - {name: gpu1, groups: [trian]}\ngroups: {train: {}}\n",
     r"{f}: host 'gpu1': field 'groups' names unknown group 'trian'.*known: train"),
    ("hosts:\n  - {name: gpu1, port: 70000}\n",
     r"{f}: host 'gpu1': field 'port' expected <= 65535, got 70000"),
    ("hosts:\n  - {name: gpu1, port: '22'}\n",
     r"{f}: host 'gpu1': field 'port' expected an integer, got '22'"),
    ("hosts:\n  - {name: gpu1, connection: telnet}\n",
     r"{f}: host 'gpu1': field 'connection' expected 'ssh' or 'local', got 'telnet'"),
    ("hosts:\n  - {name: 'gpu 1; rm -rf /'}\n",
     r"{f}: host 'gpu 1; rm -rf /': field 'name' expected a plain name"),
    ("hosts:\n  - {name: gpu1, vars: [a, b]}\n",
     r"{f}: host 'gpu1': field 'vars' expected a mapping"),
    ("hosts: []\n", r"{f}: field 'hosts' expected at least one entry"),
    ("hsts:\n  - {name: gpu1}\n", r"{f}: field 'hsts' is not a known key"),
    ("hosts:\n  - name: gpu1\n    name: gpu2\n", r"{f}: line 3, column 5: not valid YAML: duplicate key 'name'"),
    ("hosts:\n  - {name: gpu1\n", r"{f}: line \d+, column \d+: not valid YAML"),
    ("- just\n- a list\n", r"{f}: expected a mapping with a 'hosts:' list"),
    ("defaults: {user: 7}\n" + HOSTS, r"{f}: field 'defaults.user' expected a string, got 7"),
    ("groups: {gpu1: {}}\n" + HOSTS, r"{f}: group 'gpu1' has the same name as a host"),
    ("groups: {train: {vars: 3}}\n" + HOSTS, r"{f}: group 'train': field 'vars' expected a mapping"),
]


@pytest.mark.parametrize("text,pattern", BAD)
def test_bad_inventory_message(tmp_path, text, pattern):
    p = write(tmp_path, text)
    with pytest.raises(InventoryError) as exc:
        inventory.load(p)
    msg = str(exc.value)
    import re
    assert re.search(pattern.format(f=re.escape(str(p))), msg), msg
    assert "Traceback" not in msg


def test_missing_file(tmp_path):
    with pytest.raises(InventoryError, match=r"nothere.yml: cannot read the inventory .*--inventory"):
        inventory.load(tmp_path / "nothere.yml")


def test_yaml_merge_keys(tmp_path):
    """`<<: *base` merges (the mapping's own keys win); it used to fail as a 'duplicate key'
    check constructing the merge key."""
    inv = inventory.load(write(tmp_path, """
groups:
  a: {vars: &shared {log_dir: /logs, data_dir: /data}}
  b: {vars: {<<: *shared, data_dir: /other}}
hosts:
  - &gpu {name: gpu1, address: 10.0.0.1, gpus: 2, groups: [a]}
  - <<: *gpu
    name: gpu2
    address: 10.0.0.2
    groups: [b]
"""))
    g1, g2 = inv.hosts
    assert (g2.gpus, g2.address, g2.groups) == (2, "10.0.0.2", ("b",))
    assert g2.settings.given() == {"log_dir": "/logs", "data_dir": "/other"}
    assert g1.settings.given() == {"log_dir": "/logs", "data_dir": "/data"}


@pytest.mark.parametrize("text,pattern", [
    ("hosts:\n  - <<: {name: gpu1}\n    name: gpu2\n    name: gpu3\n", r"duplicate key 'name'"),
    ("a: &a [*a]\n" + HOSTS, r"line 1, column 4: not valid YAML: an alias refers to itself"),
])
def test_merge_and_aliases_still_checked(tmp_path, text, pattern):
    with pytest.raises(InventoryError, match=pattern):
        inventory.load(write(tmp_path, text))


def test_jump_none_opts_out_of_defaults(tmp_path):
    inv = inventory.load(write(tmp_path, "defaults: {jump: bastion}\n"
                                         "hosts:\n  - {name: gpu1}\n  - {name: bastion, jump: none}\n"))
    assert [h.jump for h in inv.hosts] == ["bastion", None]


@pytest.mark.parametrize("var,value,pattern", [
    ("checkpoint_dir", "/ckpt\tx", r"var 'checkpoint_dir': expected an absolute path without control"),
    ("data_dir", "/d\x7f", r"var 'data_dir': expected an absolute path without control"),
    ("env", {"OK": 1, "9LIVES": 1}, r"var 'env': '9LIVES' is not a valid environment variable"),
    ("env", {"OK": [1]}, r"var 'env': 'OK': expected a string or number, got \[1\]"),
    ("secret_env", 7, r"var 'secret_env': expected a list, got 7"),
    ("accelerator", "tpu", r"var 'accelerator': expected 'cuda' or 'cpu', got 'tpu'"),
    ("rdzv_port", "29400", r"var 'rdzv_port': expected an integer, got '29400'"),
    ("rdzv_port", 70000, r"var 'rdzv_port': expected <= 65000, got 70000"),
    ("low_util_percent", 120, r"var 'low_util_percent': expected <= 100, got 120"),
    ("low_util_minutes", 0, r"var 'low_util_minutes': expected >= 1, got 0"),
    ("busbw_min_gbs", {"nvlink": "fast"}, r"var 'busbw_min_gbs': expected a number, got 'fast'"),
    ("busbw_min_gbs", [10], r"var 'busbw_min_gbs': expected a mapping, got \[10\]"),
    ("log_dir", "logs", r"var 'log_dir': expected an absolute path .*, got 'logs'"),
    ("service_user", "Root", r"var 'service_user': expected a Linux user name"),
    ("testbed_profile", "x", r"var 'testbed_profile' is not a var torchrig reads"),
    ("rdzv_prot", 29500, r"var 'rdzv_prot' is not a var torchrig reads; did you mean 'rdzv_port'"),
])
def test_vars_checked_at_load(tmp_path, var, value, pattern):
    import yaml
    p = write(tmp_path, yaml.safe_dump({"vars": {var: value}, "hosts": [{"name": "gpu1"}]}))
    with pytest.raises(InventoryError, match=pattern):
        inventory.load(p)
