"""What a job's output can make the root probe hold, on a testbed node: a job unit that prints
progress lines of 4 kB (journalctl -o json writes a longer one as null), a line of 5 kB, and
then a line a second. `report` says its journal was cut (and still shows the short progress
lines); `status` says its 5 kB line was cut, and `--watch` reads only the journal lines after
the last round's cursor, keeping the earlier ones. The unit is a transient one named as a
job's, on a host that needs no provisioning (the probe needs python3)."""

import json
import secrets
import shlex
import time

from conftest import invoke, sh, wait_until

NODE = "gpu1"
LONG, SHORT = 20, 3
JOBCODE = f"""import time
for i in range({SHORT}):
    print("[default0]:step=%d loss=2.5" % (i + 1), flush=True)
for i in range({LONG}):
    print("[default0]:step=%d loss=2.0 pad=" % (100 + i) + "x" * 3900, flush=True)
print("agent: " + "y" * 5000, flush=True)  # -o json writes it as null; -o cat in full
i = 0
while True:
    i += 1
    print("tick %d" % i, flush=True)
    time.sleep(1)
"""


def start_unit(inv) -> str:
    """A job unit with a journal of its own (a fresh name each time) -> the job's name."""
    job = f"t-caps-{secrets.token_hex(4)}"
    unit = f"torchrig-{job}.service"
    sh(inv, NODE, f"systemd-run --unit {unit} --description {unit} -p RuntimeMaxSec=900 -- "
                  f"python3 -u -c {shlex.quote(JOBCODE)}")
    wait_until("the unit's first ticks", lambda: "tick 2" in sh(
        inv, NODE, f"journalctl -u {unit} -o cat --no-pager -n 3"), 60, 0.5)
    return job


def stop_unit(inv, job):
    sh(inv, NODE, f"systemctl stop torchrig-{job}.service; "
                  f"systemctl reset-failed torchrig-{job}.service 2>/dev/null || true")


def test_report_says_its_journal_was_cut_and_keeps_the_short_lines(testbed, tmp_path):
    job = start_unit(testbed)
    try:
        r = invoke("report", "--inventory", str(testbed), "--host", NODE, "--job", job,
                   "--out", str(tmp_path), timeout=300)
    finally:
        stop_unit(testbed, job)
    assert r.returncode == 0, r.stderr
    want = (f"warning: {NODE}: the journal was cut on the node: {LONG} line(s) longer than "
            "4096 bytes cut")
    assert want in r.stderr, r.stderr
    assert f"{SHORT} progress line(s)" in r.stdout, r.stdout
    page = (tmp_path / f"{job}-report.html").read_text()
    assert f"{LONG} line(s) longer than 4096 bytes cut" in page and "x" * 1000 not in page


def test_status_watch_reads_the_journal_after_its_cursor(testbed):
    from torchrig import inventory
    from torchrig.launch.status import node_states as status
    from torchrig.session import Fleet as Session
    job = start_unit(testbed)
    inv = inventory.load(testbed)
    kept: dict = {}
    try:
        with Session(inv, [h for h in inv.hosts if h.name == NODE]) as fleet:
            first = status(fleet, fleet.hosts, job, kept=kept)
            assert first.ok, first.failures
            one = kept[NODE]["journal"]
            assert one["cursor"] and one["read"] >= SHORT + LONG + 2, {**one, "journal": "..."}
            time.sleep(4)
            second = status(fleet, fleet.hosts, job, kept=kept)
            assert second.ok
            two = kept[NODE]["journal"]
    finally:
        stop_unit(testbed, job)
    assert 1 <= two["read"] <= 10 and two["cursor"] != one["cursor"], {**two, "journal": "..."}
    ticks = [ln for ln in two["journal"].splitlines() if ln.startswith("tick ")]
    assert ticks[0] == "tick 1" and len(ticks) >= 5, ticks  # the first round's lines are kept
    # status's journal keeps each line up to 4 KiB: the 5 kB line is cut, and said so
    assert first.results[0].value["journal_cut"] == (
        "the journal was cut on the node: 1 line(s) longer than 4096 bytes cut")
    assert second.results[0].value["journal_cut"] is None  # the round after reads no long line
    print(json.dumps({"first_read": one["read"], "second_read": two["read"]}))
