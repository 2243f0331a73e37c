"""The testbed's Debian mirror: which names the dependency closure yields (pure parts)."""

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
