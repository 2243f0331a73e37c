"""Quoting, sudo wrapping, fingerprints, redaction and output prefixing: checked by running
the generated command lines in a real bash, not by comparing strings alone."""

import io
import subprocess

import paramiko
import pytest

from torchrig.execute import PrefixedLines
from torchrig.remote import fingerprint, known_hosts_name, privileged, sh, with_env, fan_out
from torchrig.secrets import redact
from torchrig.errors import TorchrigError

EVIL = ["; touch /tmp/torchrig-pwned", "$(touch /tmp/torchrig-pwned)", "`id`", "a b\tc",
        "it's \"quoted\"", "*", "\\n", "--help", ""]


def bash(line: str) -> str:
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=True).stdout


@pytest.fixture(autouse=True)
def no_pwned():
    subprocess.run(["rm", "-f", "/tmp/torchrig-pwned"])
    yield
    assert not __import__("os").path.exists("/tmp/torchrig-pwned"), "an argument ran as code"


@pytest.mark.parametrize("arg", EVIL)
def test_sh_passes_arguments_verbatim(arg):
    assert bash(sh("printf", "%s|", arg, "end")) == f"{arg}|end|"


@pytest.mark.parametrize("arg", EVIL)
def test_privileged_as_root_keeps_compound_commands_whole(arg):
    # root: no sudo; the compound line runs entirely inside one bash
    line = privileged(sh("printf", "%s", arg) + " && echo second", "root")
    assert not line.startswith("sudo")
    assert bash(line) == f"{arg}second\n"


def test_privileged_for_other_users_is_non_interactive_sudo():
    line = privileged("a && b", "admin")
    assert line == "sudo -n -- bash -c 'a && b'"


@pytest.mark.parametrize("val", EVIL)
def test_with_env_values_are_quoted(val):
    assert bash(with_env('printf %s "$X"', {"X": val})) == val


def test_with_env_rejects_bad_names():
    with pytest.raises(TorchrigError, match="not valid"):
        with_env("true", {"X; rm": "1"})


def test_fingerprint_matches_ssh_keygen(tmp_path):
    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    expected = subprocess.run(["ssh-keygen", "-lf", str(key) + ".pub"], capture_output=True,
                              text=True, check=True).stdout.split()[1]
    pub = paramiko.Ed25519Key.from_private_key_file(str(key))
    assert fingerprint(pub) == expected


def test_known_hosts_name():
    assert known_hosts_name("10.0.0.1", None) == "10.0.0.1"
    assert known_hosts_name("10.0.0.1", 22) == "10.0.0.1"
    assert known_hosts_name("10.0.0.1", 2222) == "[10.0.0.1]:2222"


def test_redact():
    data = {"user": "u", "hf_token": "abc", "nested": {"db_password": "p", "ok": 1},
            "url": "https://bob:hunter2@mirror/x", "list": [{"secret_key": "s"}]}
    out = redact(data)
    assert out["hf_token"] == "***" and out["nested"] == {"db_password": "***", "ok": 1}
    assert out["url"] == "https://bob:***@mirror/x" and out["list"] == [{"secret_key": "***"}]
    assert out["user"] == "u" and "hunter2" not in repr(out)


def test_prefixed_lines_whole_lines_only():
    buf = io.StringIO()
    p = PrefixedLines("gpu1", buf)
    p.write("hel")
    assert buf.getvalue() == ""
    p.write("lo\nwor")
    p.write("ld\r\nlast")
    p.close()
    assert buf.getvalue() == "gpu1 | hello\ngpu1 | world\ngpu1 | last\n"


def test_fan_out_isolates_failures():
    from torchrig.inventory import Host
    hosts = [Host(name=n, connection="ssh", address=n, port=None, user=None, identity_file=None,
                  jump=None, gpus=None, groups=(), vars={}) for n in ("a", "b", "c")]

    def fn(h):
        if h.name == "b":
            raise ConnectionRefusedError()
        return h.name.upper()

    res = fan_out(hosts, fn, parallel=2)
    assert [(r.host, r.ok, r.value) for r in res] == [("a", True, "A"), ("b", False, None),
                                                      ("c", True, "C")]
    assert "connection refused" in res[1].error
