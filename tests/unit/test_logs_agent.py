"""torchrun agent output (unit journals captured on the testbed, see fixtures/INDEX.md) ->
the failed rank and its cause, and what each node waits for."""

from _fixtures import fixture

from torchrig.logs import agent, diagnose

UNIT = "torchrig-t.service"


def node(host, rank, name, kernel=""):
    return diagnose.node_from(host, rank, {"journal": fixture(name), "year": 2026,
                                           "utc_offset": "+0000", "kernel": kernel})


def test_exit_code_1_without_error_json_names_rank_and_code():
    log = agent.parse(fixture("torchrun_02_journal_exit1_rank3_node1of2.txt"))
    e = log.first_failure()
    assert (e.local_rank, e.pid, e.exitcode, e.global_rank) == (1, 720, 1, 3)
    # the other worker was stopped by the agent (SIGTERM, -15): a consequence, not a cause
    assert log.root_cause["global_rank"] == 3 and log.root_cause["error_file"] == "<N/A>"
    f = diagnose.failures([node("gpu2", 1, "torchrun_02_journal_exit1_rank3_node1of2.txt")], UNIT)
    assert f[0].cause == "exited with code 1"
    assert f[0].lines[-2:] == ["about to exit 1", "fatal: giving up"]


def test_sigkill_is_named_and_comes_before_the_peers_it_broke():
    nodes = [node("gpu1", 0, "torchrun_04_journal_sigkill_peer_node0of2_gloo_errors.txt"),
             node("gpu2", 1, "torchrun_03_journal_sigkill_rank3_node1of2.txt")]
    found = diagnose.failures(nodes, UNIT)
    # gpu1's ranks failed 2.6 s later with gloo "Connection reset by peer" (and wrote error.json)
    assert [(f.host, f.global_rank, f.cause) for f in found] == [
        ("gpu2", 3, "killed by SIGKILL"), ("gpu1", 0, "exited with code 1")]
    text = diagnose.report(found)
    assert text.startswith("first failure: [gpu2/r3] (local rank 1, pid 1096) killed by SIGKILL")
    assert "then: [gpu1/r0] exited with code 1" in text


def test_sigterm_lines_logged_first_are_not_the_first_failure():
    """torchrun logs 'Sending process P closing signal SIGTERM' for the survivors before the
    'failed' line of the worker that caused it: the earliest line is not the cause."""
    text = fixture("torchrun_05_journal_sigsegv_rank3_node1of2.txt")
    assert text.index("closing signal SIGTERM") < text.index("failed (exitcode: -11)")
    e = agent.parse(text).first_failure()
    assert (e.exitcode, e.local_rank, e.global_rank) == (-11, 1, 3)
    assert agent.describe_exit(e.exitcode) == "killed by SIGSEGV (segmentation fault)"
    # the same shape without the summary's Root Cause block (a restart follows instead)
    cut = text[:text.index("Traceback (most recent call last):\n  File \"<frozen runpy>\"")]
    e2 = agent.parse(cut).first_failure()
    assert (e2.pid, e2.exitcode, e2.terminated) == (e.pid, -11, False)


def test_restarts_the_last_episode_counts_and_rendezvous_result_gives_global_rank():
    log = agent.parse(fixture("torchrun_09_stdout_info_sigkill_restart_standalone.txt"))
    assert log.restarts == 1 and len([e for e in log.exits if not e.terminated]) == 2
    assert log.first_failure().pid == 4960 and log.first_failure().global_rank == 1
    assert log.nproc == 2


def test_global_rank_from_node_rank_when_the_agent_did_not_log_it():
    e = agent.Exit(local_rank=1, pid=5, exitcode=-9, when="", line=0)
    assert agent.global_rank(e, node_rank=2, nproc=4) == 9


def test_signal_names():
    assert agent.signal_name(-9) == "SIGKILL" and agent.signal_name(-7) == "SIGBUS"
    assert agent.signal_name(1) is None and agent.signal_name(-6) == "SIGABRT"
    assert agent.describe_exit(-6) == "killed by SIGABRT (aborted)"
    assert agent.describe_exit(-9, "host memory") == "killed by the OOM killer (host memory)"


KERNEL_GLOBAL = ("Out of memory: Killed process 1096 (python) total-vm:9000000kB, anon-rss:8000000kB, "
                 "file-rss:0kB, shmem-rss:0kB, UID:999 pgtables:20000kB oom_score_adj:0")


def test_sigkill_with_a_kernel_oom_kill_of_that_pid_says_oom():
    nodes = [node("gpu2", 1, "torchrun_03_journal_sigkill_rank3_node1of2.txt", KERNEL_GLOBAL)]
    assert diagnose.failures(nodes, UNIT)[0].cause == "killed by the OOM killer (host memory)"
    # another pid's kill is not this rank's
    other = KERNEL_GLOBAL.replace("1096", "777")
    nodes = [node("gpu2", 1, "torchrun_03_journal_sigkill_rank3_node1of2.txt", other)]
    assert diagnose.failures(nodes, UNIT)[0].cause == "killed by SIGKILL"


def test_oom_of_the_units_cgroup():
    line = ("oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
            "oom_memcg=/system.slice/torchrig-t.service,task_memcg=/system.slice/torchrig-t.service,"
            "task=python,pid=4242,uid=999")
    assert agent.oom_kill(line, 1, UNIT) == "cgroup memory limit"
    assert agent.oom_kill(line, 1, "torchrig-other.service") is None


def test_exit_barrier_and_rejoin_waits_with_their_deadlines():
    nodes = [node("gpu1", 0, "torchrun_07_journal_info_exit_barrier_node0of2.txt"),
             node("gpu2", 1, "torchrun_08_journal_info_rejoining_node1of2.txt")]
    assert diagnose.waiting(nodes, 2) == {
        "gpu1": "finished, waiting for peers at the exit barrier, gives up at 18:46:50",
        "gpu2": "restarting, waiting for 1 more node to rejoin, gives up at 18:42:24"}
    f = diagnose.failures(nodes, UNIT)
    assert [(x.host, x.global_rank, x.cause) for x in f] == [("gpu2", 3, "killed by SIGKILL")]


def test_a_finished_job_waits_for_nothing_and_has_no_failure():
    text = fixture("torchrun_07_journal_info_exit_barrier_node0of2.txt")
    done = text + ("I1130 18:41:51.000000 1664 torch/distributed/elastic/agent/server/api.py:1001] "
                   "Done waiting for other agents. Elapsed: 0.2 seconds\n")
    log = agent.parse(done)
    assert log.state is None and log.first_failure() is None


def test_only_the_last_start_of_the_unit_counts():
    old = fixture("torchrun_02_journal_exit1_rank3_node1of2.txt")
    new = fixture("torchrun_07_journal_info_exit_barrier_node0of2.txt")
    assert agent.parse(old + new).first_failure() is None


def test_glog_time_to_unix():
    assert agent.to_unix("1130 18:41:54.855000", 2026, "+0000") == 1796064114.855
    assert agent.to_unix("1130 19:41:54", 2026, "+0100") == 1796064114.0
    assert agent.to_unix("garbage", 2026, "+0000") is None


def test_after_both_waits_ran_out_nothing_is_waited_for_and_the_cause_stays():
    nodes = [node("gpu1", 0, "torchrun_10_journal_info_exit_barrier_timed_out_node0of2.txt"),
             node("gpu2", 1, "torchrun_11_journal_info_rejoin_timed_out_node1of2.txt")]
    assert diagnose.waiting(nodes, 2) == {}
    assert nodes[1].log.rdzv_timed_out and nodes[1].log.ended
    f = diagnose.failures(nodes, UNIT)
    assert [(x.host, x.global_rank, x.pid, x.cause) for x in f] == [("gpu2", 3, 1703, "killed by SIGKILL")]


def test_kernel_oom_kill_captured_on_this_machine():
    """The kernel's own lines (a testbed worker moved into a memory cgroup with a limit just
    above its use; host pid 3088): the pid's kill is an OOM kill of a cgroup limit."""
    text = fixture("kernel_oom_01_memcg_v1_worker_over_limit.txt")
    assert agent.oom_kill(text, 3088, UNIT) == "cgroup memory limit"
    assert agent.oom_kill(text, 3089, UNIT) is None
    host_wide = text.replace("Memory cgroup out of memory", "Out of memory").replace(
        "CONSTRAINT_MEMCG", "CONSTRAINT_NONE")
    assert agent.oom_kill(host_wide, 3088, UNIT) == "host memory"


def test_failure_time_is_when_the_agent_noticed_not_when_it_logged_it():
    """Node 1's agent logged its OOM-killed rank 6 s after stopping the other one (which hung
    in gloo); node 0's ranks failed in between. The first failure is still node 1's."""
    nodes = [node("gpu1", 0, "torchrun_13_journal_oom_peer_node0of2.txt"),
             node("gpu2", 1, "torchrun_12_journal_oom_killed_rank3_node1of2_slow_sigterm.txt")]
    found = diagnose.failures(nodes, UNIT)
    assert [(f.host, f.global_rank, f.pid, f.cause) for f in found][0] == ("gpu2", 3, 8498, "killed by SIGKILL")
    assert found[0].at == agent.to_unix("1130 19:08:38.483000", 2026, "+0000")


def test_sigkilled_rank_beats_the_local_peer_torchrun_names_as_root_cause():
    """Seen on the testbed (2026-11-30, the journal went with the testbed): gpu4's local rank 1
    SIGKILLed; local rank 0 lost its gloo connection, raised, wrote error.json and exited 1
    before the agent polled; torchrun, ordering by error.json time, logged rank 0 as `failed`
    and as the Root Cause, and listed the killed rank only under Failures."""
    text = (fixture("torchrun_03_journal_sigkill_rank3_node1of2.txt")
            .replace("W1130 18:41:06.717000 1017 torch/distributed/elastic/multiprocessing/api.py:1028] "
                     "Sending process 1095 closing signal SIGTERM\n", "")
            .replace("failed (exitcode: -9) local_rank: 1 (pid: 1096)", "failed (exitcode: 1) local_rank: 0 (pid: 1095)"))
    a, b = text.index("Failures:"), text.index("Root Cause")
    c = text.index("=====", b)
    fails, root = text[a:b], text[b:c]
    swapped = (fails.replace("-15 (pid: 1095)  (SIGTERM)", "-9 (pid: 1096)  (SIGKILL)")
               .replace("2 (local_rank: 0)", "3 (local_rank: 1)"),
               root.replace("-9 (pid: 1096)  (SIGKILL)", "1 (pid: 1095)").replace("3 (local_rank: 1)", "2 (local_rank: 0)"))
    text = text[:a] + swapped[0] + swapped[1] + text[c:]
    log = agent.parse(text)
    assert log.root_cause["pid"] == 1095                     # torchrun's pick
    e = log.first_failure()
    assert (e.pid, e.local_rank, e.global_rank, e.exitcode) == (1096, 1, 3, -9)


# ------------------------------------------- the agent lines older torch releases print

def test_python_logging_prefix_of_older_torch():
    """torch 1.x-2.0 logged through Python's logging with its default format
    (`ERROR:torch.distributed.elastic.multiprocessing.api:failed ...`): a real SIGKILL of
    local rank 3 (the other three were sent SIGTERM). The old parser found no failure at all."""
    log = agent.parse(fixture("torchrun_14_pylogging_sigkill_rank3_colossalai.txt"))
    e = log.first_failure()
    assert (e.local_rank, e.pid, e.exitcode, e.terminated) == (3, 812917, -9, False)
    assert log.nproc == 4 and agent.describe_exit(e.exitcode) == "killed by SIGKILL"


def test_bracketed_timestamp_prefix_of_torch_2_1_to_2_3():
    """`[2025-08-07 22:38:53,831] torch.distributed.elastic.multiprocessing.api: [ERROR] failed
    ...` (real; the paste lost the first line's `[`): the rank, its signal and when the agent
    noticed (its first closing-signal line), as glog lines give them."""
    log = agent.parse(fixture("torchrun_15_bracketed_sigfpe_rank1_codetr.txt"))
    e = log.first_failure()
    assert (e.local_rank, e.pid, e.exitcode) == (1, 2235249, -8)
    assert agent.describe_exit(e.exitcode) == "killed by SIGFPE (arithmetic error)"
    assert e.when == "0807 22:38:53.659"
    assert agent.to_unix(e.when, 2025, "+0000") == 1754606333.659
    assert sum(x.terminated for x in log.exits) == 0 and len(log.exits) == 1
    e = agent.parse(fixture("torchrun_16_bracketed_exit1_rank2_salience_detr.txt")).first_failure()
    assert (e.local_rank, e.pid, e.exitcode, e.when) == (2, 5939, 1, "0508 08:47:31.261")


def test_closing_lines_of_newer_torch():
    """torch 2.6+ says `Closing process P via signal SIGTERM` (the first line is real, from
    NVIDIA/nvidia-resiliency-ext#18; the two `failed` lines are made in glog's shape): the
    worker it closed is a consequence, not the cause."""
    text = ("W0227 17:39:41.936000 293814 site-packages/torch/distributed/elastic/multiprocessing/"
            "api.py:766] Closing process 293866 via signal SIGTERM\n"
            "E0227 17:39:42.100000 293814 site-packages/torch/distributed/elastic/multiprocessing/"
            "api.py:874] failed (exitcode: 1) local_rank: 0 (pid: 293866) of binary: /usr/bin/python3\n"
            "E0227 17:39:42.100000 293814 site-packages/torch/distributed/elastic/multiprocessing/"
            "api.py:874] failed (exitcode: -11) local_rank: 1 (pid: 293867) of binary: /usr/bin/python3\n")
    e = agent.parse(text).first_failure()
    assert (e.pid, e.exitcode, e.when) == (293867, -11, "0227 17:39:41.936000")


def test_journal_read_with_its_default_prefix_gives_what_o_cat_gives():
    """One unit's journal as `journalctl -u` prints it by default (`Dec 02 00:05:04 gpu1
    torchrig-t-power[974]: E1202 ...`) and with `-o cat` (captured together on the testbed:
    node 0 of a job whose peer lost power). The old parser found nothing in the first."""
    short = agent.parse(fixture("torchrun_17_journal_short_prefix_power_off_peer_node0of2.txt"))
    cat = agent.parse(fixture("torchrun_18_journal_cat_same_unit_as_17.txt"))
    e = short.first_failure()
    assert (e.local_rank, e.pid, e.exitcode, e.when) == (0, 1032, 1, "1202 00:05:03.857000")
    assert short.exits == cat.exits and short.restarts == cat.restarts == 1
    assert (short.nnodes, short.nproc, short.join_timeout) == (cat.nnodes, cat.nproc, cat.join_timeout) == (2, 2, 30)
    assert short.rdzv_timed_out and short.ended and short.state is None
    assert short.rank_lines == cat.rank_lines and short.rank_lines[0]
