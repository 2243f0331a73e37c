"""The testbed's Debian mirror: which names the dependency closure yields (pure parts)."""

from types import SimpleNamespace as NS

from torchrig.testbed import debmirror

# Shape of `apt-cache depends --recurse --no-recommends ...` output (trimmed, from bookworm).
DEPENDS = """slurmd
  Depends: libc6
 |Depends: libsystemd0
  Depends: libelogind0
  Depends: <debconf-2.0>
    cdebconf
    debconf
munge
  Depends: libmunge2
<debconf-2.0>
libmunge2
  Depends: libc6
libc6
cdebconf
"""


def test_closure_names_are_the_unindented_real_packages():
    assert debmirror.closure_names(DEPENDS) == ["cdebconf", "libc6", "libmunge2", "munge", "slurmd"]


def test_mirror_is_keyed_by_the_list_and_the_base(tmp_path, monkeypatch):
    a = debmirror.mirror_path(tmp_path / "base-aaa")
    assert a != debmirror.mirror_path(tmp_path / "base-bbb")
    monkeypatch.setattr(debmirror, "PACKAGES", [*debmirror.PACKAGES, "hello"])
    assert debmirror.mirror_path(tmp_path / "base-aaa") != a


def test_host_source_is_signed_and_flat(tmp_path):
    stanza = debmirror.source_stanza()
    assert "Suites: ./\n" in stanza and f"Signed-By: /{debmirror.KEYRING_FILE}" in stanza
    assert "/debian/" in stanza


# `apt-cache policy python3.11 libc6` on the operator machine (bookworm, trimmed)
POLICY = """python3.11:
  Installed: (none)
  Candidate: 3.11.2-6+deb12u9
  Version table:
     3.11.2-6+deb12u9 500
        500 http://deb.example/debian-security bookworm-security/main amd64 Packages
libc6:
  Installed: 2.36-9+deb12u14
  Candidate: 2.36-9+deb12u14
  Version table:
"""


def test_a_base_package_at_an_older_version_than_apts_stays_in_the_mirror(monkeypatch, tmp_path):
    """python3.11-dev needs its own python3.11: the base's older python3.11 must not keep the
    newer one out of the mirror (the hosts' apt: 'held broken packages')."""
    assert debmirror.candidates(POLICY) == {"python3.11": "3.11.2-6+deb12u9",
                                            "libc6": "2.36-9+deb12u14"}
    runs = {"depends": "python3.11\nlibc6\nzlib1g\n", "policy": POLICY}
    monkeypatch.setattr(debmirror, "_run", lambda cmd, text: NS(stdout=runs[cmd[1]]))
    monkeypatch.setattr(debmirror, "base_installed", lambda base: {
        "python3.11": "3.11.2-6+deb12u8", "libc6": "2.36-9+deb12u14"})
    assert debmirror.needed(["python3.11"], tmp_path) == ["python3.11", "zlib1g"]
