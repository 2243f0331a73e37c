"""The one redactor: every secret form the inventory can hold, masked in every shape of output."""

import pytest

from torchrig.errors import TorchrigError
from torchrig.inventory import Host
from torchrig.launch.plan import redact_env
from torchrig.secrets import MASK, Redactor, redact, redact_text, secret_env_names
from torchrig.settings import Settings, settings_for

# (text, what must not show, what must still show)
URL_FORMS = [
    ("https://bob:hunter2@mirror/x", ["hunter2"], "https://bob:***@mirror/x"),
    ("https://alice:p@ss@host/simple", ["p@ss", "ss@host"], "https://alice:***@host/simple"),
    ("https://:tok3n@host/x", ["tok3n"], "https://***@host/x"),
    ("https://ghp_abcdef123@github.com/NVIDIA/nccl-tests", ["ghp_abcdef123"],
     "https://***@github.com/NVIDIA/nccl-tests"),
    ("http://u:p%40ss%3Aw@[fd00::1]:8080/s", ["p%40ss%3Aw"], "http://u:***@[fd00::1]:8080/s"),
    ("git clone 'https://x:y@h/r.git' /opt", ["x:y@"], "git clone 'https://x:***@h/r.git' /opt"),
    ("fatal: unable to access 'https://oauth2:glpat-XYZ@gitlab/r/': 403",
     ["glpat-XYZ"], "fatal: unable to access 'https://oauth2:***@gitlab/r/': 403"),
    ("two: https://a:b1@h1/ and https://c2@h2/", ["b1", "c2@"],
     "two: https://a:***@h1/ and https://***@h2/"),
]


@pytest.mark.parametrize("text,hidden,shown", URL_FORMS)
def test_url_credentials_masked(text, hidden, shown):
    out = redact_text(text)
    assert out == shown
    for h in hidden:
        assert h not in out


def test_urls_without_credentials_untouched():
    for t in ("https://host/a@b", "http://10.0.0.1:8080/simple?x=a@b", "git@github.com:o/r.git",
              "mail me at a@b.c", "https://host:8443/p"):
        assert redact_text(t) == t


def host(name, vars_):
    return Host(name=name, connection="ssh", address="10.0.0.1", port=None, user=None,
                identity_file=None, jump=None, gpus=None, groups=(),
                settings=Settings.model_validate(vars_))


HOSTS = [
    host("a", {"env": {"HF_HOME": "/data"}, "secret_env": ["WANDB_API"],
               "pip_index_url": "https://ci:p@ss%2Fw0rd@pypi.internal/simple"}),
    # secret_env given as one name, only on the second host; a token as a URL's user name
    host("b", {"env": {"WANDB_API": "wandb-v4lue", "HF_HOME": "/data", "DB_PASSWORD": "s3cr3t-pw"},
               "secret_env": "WANDB_API",
               "nccl_tests_source": "https://ghp_T0KEN@github.com/NVIDIA/nccl-tests"}),
]


def test_redactor_for_hosts_masks_by_form_and_value():
    red = Redactor.for_hosts(HOSTS)
    dumped = repr(red.data([h.model_dump() for h in HOSTS]))
    for secret in ("p@ss%2Fw0rd", "p@ss/w0rd", "ss%2Fw0rd", "wandb-v4lue", "ghp_T0KEN", "s3cr3t-pw"):
        assert secret not in dumped
    b = red.data(HOSTS[1].model_dump())["settings"]
    assert b["env"] == {"WANDB_API": MASK, "HF_HOME": "/data", "DB_PASSWORD": MASK}
    assert b["secret_env"] == ["WANDB_API"]
    # the same values wherever else they appear: decoded by a tool, in an error line
    assert red.text("pip: 401 for ci:p@ss/w0rd and wandb-v4lue") == "pip: 401 for ci:*** and ***"


def test_secret_env_names():
    assert secret_env_names(None) == set()
    assert secret_env_names("HF_TOKEN") == {"HF_TOKEN"}  # one name, not a set of characters
    assert secret_env_names(["A", "B"]) == {"A", "B"}
    with pytest.raises(TorchrigError, match="secret_env.*list of environment variable names"):
        secret_env_names({"A": 1})
    with pytest.raises(TorchrigError, match="host 'x': var 'secret_env': expected a list"):
        settings_for("x", {"secret_env": 3}, "inv.yml")  # a host never holds a bad one


def test_data_keeps_types_and_masks_named_keys():
    out = redact({"user": "u", "hf_token": "abc", "nested": {"db_password": "p", "ok": 1},
                  "secret": True, "list": [{"secret_key": "s"}], "api_key": None})
    assert out == {"user": "u", "hf_token": MASK, "nested": {"db_password": MASK, "ok": 1},
                   "secret": True, "list": [{"secret_key": MASK}], "api_key": None}


def test_dataclasses_are_redacted_field_by_field():
    from torchrig.provision.apply import HostReport, StepResult
    rep = HostReport("h", steps=[StepResult("nccl-tests", "failed",
                                            changes=["build from https://ghp_x1@h/r"],
                                            error="fatal: 'https://u:pw@h/r' not found")])
    out = Redactor().data(rep)
    assert out.steps[0].changes == ["build from https://***@h/r"]
    assert out.steps[0].error == "fatal: 'https://u:***@h/r' not found"
    assert rep.steps[0].error.endswith("not found") and "pw" in rep.steps[0].error  # a copy


def test_launch_env_redaction_masks_url_passwords_in_values():
    env = {"DATA_URL": "s3://key:S3CR3T@bucket/x", "HF_TOKEN": "t", "MINE": "plain", "X": "y"}
    assert redact_env(env, {"MINE"}) == {"DATA_URL": "s3://key:***@bucket/x", "HF_TOKEN": MASK,
                                         "MINE": MASK, "X": "y"}


# --- the CLI's output paths that need no host: every secret form, every mode ---------------

SECRETS = {"hunter2@x", "p@ss", "ghp_Tok3nUser", "only-t0ken", "wandb-v4lue", "s3cr3t-pw",
           "p@ss:w"}
INVENTORY = """
known_hosts: {kh}
vars:
  cuda_repo_url: http://mirror%40corp:p%40ss%3Aw@[fd00::5]:8080/cuda/repos
  pip_index_url: https://alice:hunter2@x@pypi.internal/simple
groups:
  a: {{}}
hosts:
  - name: h1
    address: 127.0.0.1
    vars:
      nccl_tests_source: https://ghp_Tok3nUser@github.com/NVIDIA/nccl-tests
      env: {{WANDB_KEYLESS: wandb-v4lue, HF_HOME: /data}}
  - name: h2
    address: 127.0.0.1
    port: 1
    vars:
      secret_env: WANDB_KEYLESS
      env: {{DB_PASSWORD: s3cr3t-pw, MIRROR: "https://:only-t0ken@h/x",
             EXTRA_WHEEL: "https://u:p@ss@h/pkg.whl"}}
"""


def cli(tmp_path, *args):
    import subprocess
    import sys
    from pathlib import Path
    inv = tmp_path / "inv.yml"
    kh = tmp_path / "kh"
    kh.write_text("")
    inv.write_text(INVENTORY.format(kh=kh))
    return subprocess.run([sys.executable, "-m", "invoke", *args, "-i", str(inv)],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args", [["hosts"], ["hosts", "--json"], ["provision", "--dry-run"],
                                  ["provision", "--dry-run", "--json"]])
def test_cli_outputs_never_show_a_secret(tmp_path, args):
    r = cli(tmp_path, *args)
    out = r.stdout + r.stderr
    assert "Traceback" not in out
    leaked = [s for s in SECRETS if s in out]
    assert not leaked, out
    if args[0] == "hosts":
        assert r.returncode == 0 and "WANDB_KEYLESS" in out and "/data" in out
    else:  # h1's secret_env is h2's: masked there too; the hosts' error lines are masked as well
        assert r.returncode == 1 and "error: " in out and "h2: unreachable: SSH to" in out
