"""Two testbeds starting at once share one cache: the second waits for the first builder."""

import fcntl
import threading

from torchrig.testbed import lab


def test_a_second_builder_waits_for_the_first(tmp_path, monkeypatch):
    monkeypatch.setattr(lab, "CACHE", tmp_path)
    said, order = [], []
    holder = open(tmp_path / ".lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX)  # another testbed is building

    def second():
        with lab._cache_lock(said.append):
            order.append("second built")

    t = threading.Thread(target=second)
    t.start()
    t.join(0.5)
    assert t.is_alive() and order == []  # still waiting
    assert said and "waiting for another testbed" in said[0]
    order.append("first done")
    fcntl.flock(holder, fcntl.LOCK_UN)
    t.join(5)
    assert order == ["first done", "second built"]


def test_no_wait_and_no_message_when_nobody_builds(tmp_path, monkeypatch):
    monkeypatch.setattr(lab, "CACHE", tmp_path / "cache")
    said = []
    with lab._cache_lock(said.append):
        pass
    assert said == []


def test_a_base_image_another_testbeds_hosts_stand_on_is_in_use():
    """A new recipe's base removes the old ones, but not one a running testbed's overlays use
    (removing it pulled files such as sudoers from under those hosts)."""
    from torchrig.testbed import image
    mounts = ("overlay /var/lib/torchrig-testbed-tests/hosts/gpu1/root overlay rw,relatime,"
              "lowerdir=/var/cache/torchrig-testbed/base-0123456789ab,upperdir=/var/lib/x/upper,"
              "workdir=/var/lib/x/work 0 0\n"
              "/dev/sda1 /var/cache/torchrig-testbed/base-ffffffffffff ext4 rw 0 0\n")
    assert image.in_use(mounts) == {"/var/cache/torchrig-testbed/base-0123456789ab"}
