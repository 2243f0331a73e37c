"""torchrig.facts.os_release against real /etc/os-release captures."""

from __future__ import annotations


import pytest

from _fixtures import fixture
from torchrig.facts import os_release



def test_ubuntu_2204():
    o = os_release.parse(fixture("osrelease_01_ubuntu_22.04.5.txt"))
    assert (o.id, o.version_id, o.codename) == ("ubuntu", "22.04", "jammy")
    assert o.pretty_name == "Ubuntu 22.04.5 LTS"
    assert o.id_like == ("debian",)
    assert o.name == "Ubuntu"
    assert o.fields["HOME_URL"] == "https://www.ubuntu.com/"
    assert os_release.supported(o) == "ubuntu2204"


def test_ubuntu_2404_with_logo():
    o = os_release.parse(fixture("osrelease_02_ubuntu_24.04.4.txt"))
    assert (o.id, o.version_id, o.codename) == ("ubuntu", "24.04", "noble")
    assert o.pretty_name == "Ubuntu 24.04.4 LTS"
    assert o.fields["LOGO"] == "ubuntu-logo"
    assert os_release.supported(o) == "ubuntu2404"


def test_debian_12_no_id_like():
    o = os_release.parse(fixture("osrelease_03_debian_12.txt"))
    assert (o.id, o.version_id, o.codename) == ("debian", "12", "bookworm")
    assert o.pretty_name == "Debian GNU/Linux 12 (bookworm)"
    assert o.id_like == ()
    assert os_release.supported(o) == "debian12"


def test_quoting_comments_crlf_and_codename_fallback():
    text = (
        "# comment\r\n"
        "\r\n"
        "NAME='Debian GNU/Linux'\r\n"
        'PRETTY_NAME="Say \\"hi\\" \\$HOME"\r\n'
        "ID=debian\r\n"
        'VERSION_ID="12"\r\n'
        'VERSION="12 (bookworm)"\r\n'
        "ID_LIKE=\"\"\r\n"
    )
    o = os_release.parse(text)
    assert o.name == "Debian GNU/Linux"
    assert o.pretty_name == 'Say "hi" $HOME'
    assert o.codename == "bookworm"  # from VERSION, no VERSION_CODENAME line
    assert o.id_like == ()
    assert os_release.supported(o) == "debian12"


@pytest.mark.parametrize(
    "text",
    [
        'ID=ubuntu\nVERSION_ID="20.04"\n',  # too old
        'ID=debian\nVERSION_ID="11"\n',
        'ID=pop\nID_LIKE="ubuntu debian"\nVERSION_ID="22.04"\n',  # derivative: strict on ID
        'ID=rhel\nID_LIKE="fedora"\nVERSION_ID="9.4"\n',
        'ID=debian\n',  # testing/sid has no VERSION_ID
        "",
    ],
)
def test_unsupported(text):
    assert os_release.supported(os_release.parse(text)) is None


def test_id_like_split():
    o = os_release.parse('ID=pop\nID_LIKE="ubuntu debian"\n')
    assert o.id_like == ("ubuntu", "debian")


def test_cuda_repo_arch():
    assert os_release.cuda_repo_arch("x86_64") == "x86_64"
    assert os_release.cuda_repo_arch("aarch64\n") == "sbsa"
    assert os_release.cuda_repo_arch("ppc64le") is None
    assert os_release.cuda_repo_arch("armv7l") is None


def test_path():
    assert os_release.PATH == "/etc/os-release"
