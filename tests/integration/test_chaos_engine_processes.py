"""The chaos engine with real processes: the supervisor against real child processes (kill,
stop/continue, restart, slow, reap), the harness end to end with stand-in nodes, and a short chaos
run against the real daemon (about two minutes, in the default suite). Schedules and verdicts:
tests/test_chaos_engine.py."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.chaos.harness import (
    ChaosConfig,
    DaemonLauncher,
    StandinLauncher,
    lock_is_free,
    run_chaos,
    standin_config,
)
from diloco_node.testbed.chaos.schedule import COORDINATOR, Fault, Schedule
from diloco_node.testbed.chaos.supervisor import ProcessSpec, Supervisor, SupervisorError
from diloco_node.ops.history import HistoryEvent, find_history_files, load_histories

from conftest import eventually, process_gone

pytestmark = pytest.mark.integration

NODES = ("n1", "n2", "n3")


# ---------------------------------------------------------------------------------------------
# the supervisor, against real child processes

# Appends a line to a file every 20 ms; spawns a grandchild in its group; says goodbye on SIGTERM
# unless told to ignore it.
CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(out + ".grandchild", "w").write(str(grandchild.pid))
    def bye(*_):
        open(out, "a").write("bye\\n")
        grandchild.kill()
        sys.exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else bye)
    while True:
        with open(out, "a") as f:
            f.write("tick\\n")
        time.sleep(0.02)
""")


def _spec(tmp_path: Path, name: str, mode: str = "polite") -> ProcessSpec:
    out = tmp_path / f"{name}.out"
    return ProcessSpec(name, [sys.executable, "-c", CHILD, str(out), mode], tmp_path / f"{name}.log")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _ticks(tmp_path: Path, name: str) -> int:
    path = tmp_path / f"{name}.out"
    return path.read_text().count("tick") if path.exists() else 0


def _grandchild(tmp_path: Path, name: str) -> int:
    path = tmp_path / f"{name}.out.grandchild"
    assert eventually(lambda: path.exists() and path.read_text().strip() != "")
    return int(path.read_text())


def test_kill_takes_the_whole_group_and_reaps(tmp_path):
    with Supervisor(terminate_grace_s=2) as sup:
        pid = sup.start(_spec(tmp_path, "a"))
        grandchild = _grandchild(tmp_path, "a")
        assert sup.alive("a") and not process_gone(pid)
        sup.kill("a")
        assert not sup.alive("a") and sup.returncode("a") == -signal.SIGKILL
        assert process_gone(pid)
        assert eventually(lambda: process_gone(grandchild))


def test_stop_freezes_and_cont_resumes(tmp_path):
    with Supervisor(terminate_grace_s=2) as sup:
        pid = sup.start(_spec(tmp_path, "a"))
        assert eventually(lambda: _ticks(tmp_path, "a") > 3)
        sup.stop("a")
        assert eventually(lambda: _state(pid) == "T")
        frozen = _ticks(tmp_path, "a")
        time.sleep(0.3)
        assert _ticks(tmp_path, "a") == frozen and sup.stopped("a")
        sup.cont("a")
        assert eventually(lambda: _ticks(tmp_path, "a") > frozen)
        assert not sup.stopped("a")


def test_restart_gives_a_new_process_and_the_old_one_isprocess_gone(tmp_path):
    with Supervisor(terminate_grace_s=2) as sup:
        first = sup.start(_spec(tmp_path, "a"))
        second = sup.restart("a")
        assert second != first and process_gone(first) and sup.alive("a")
        sup.kill("a")
        third = sup.restart("a")  # restarting a dead process just starts it
        assert third not in (first, second) and sup.alive("a")
        assert sup.started_pids == [first, second, third]
    assert all(process_gone(pid) for pid in (first, second, third))


def test_slow_duty_cycles_and_unslow_stops_it(tmp_path):
    with Supervisor(terminate_grace_s=2, slow_period_s=0.1) as sup:
        pid = sup.start(_spec(tmp_path, "a"))
        sup.slow("a", 0.3)
        seen: set[bool] = set()  # stopped part of the time, running part of the time
        assert eventually(lambda: seen.add(_state(pid) == "T") or seen == {True, False}, interval_s=0.005)
        sup.unslow("a")
        time.sleep(0.05)
        states = set()
        for _ in range(50):
            states.add(_state(pid))
            time.sleep(0.005)
        assert "T" not in states


def test_stop_wins_over_a_running_slow_cycle(tmp_path):
    with Supervisor(terminate_grace_s=2, slow_period_s=0.05) as sup:
        pid = sup.start(_spec(tmp_path, "a"))
        sup.slow("a", 0.5)
        sup.stop("a")
        # SIGSTOP takes effect when the child next runs: wait for it, then watch it stay stopped.
        assert eventually(lambda: _state(pid) == "T")
        for _ in range(20):  # several slow periods: the throttle never continues it
            assert _state(pid) == "T"
            time.sleep(0.01)
        sup.cont("a")


def test_terminate_is_graceful_then_forceful(tmp_path):
    with Supervisor(terminate_grace_s=2) as sup:
        sup.start(_spec(tmp_path, "polite"))
        sup.start(_spec(tmp_path, "stubborn", mode="stubborn"))
        assert eventually(lambda: _ticks(tmp_path, "polite") > 0 and _ticks(tmp_path, "stubborn") > 0)
        assert sup.terminate("polite") == 0
        assert (tmp_path / "polite.out").read_text().endswith("bye\n")
        started = time.monotonic()
        assert sup.terminate("stubborn", grace_s=0.3) == -signal.SIGKILL
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt])
def test_leaving_the_block_by_an_exception_reaps_everything(tmp_path, interrupt):
    pids: list[int] = []
    grandchildren: list[int] = []
    with pytest.raises(interrupt):
        with Supervisor(terminate_grace_s=1) as sup:
            for name in ("a", "b", "c"):
                pids.append(sup.start(_spec(tmp_path, name, mode="stubborn" if name == "c" else "polite")))
                grandchildren.append(_grandchild(tmp_path, name))
            sup.stop("a")  # a stopped process must not survive either
            sup.slow("b", 0.5)
            raise interrupt()
    assert all(process_gone(pid) for pid in pids)
    assert eventually(lambda: all(process_gone(pid) for pid in grandchildren))


def test_misuse_is_refused_by_name(tmp_path):
    with Supervisor(terminate_grace_s=1) as sup:
        sup.start(_spec(tmp_path, "a"))
        with pytest.raises(SupervisorError, match="a is already running"):
            sup.start(_spec(tmp_path, "a"))
        with pytest.raises(SupervisorError, match="unknown process 'zz'"):
            sup.stop("zz")
        sup.kill("a")
        with pytest.raises(SupervisorError, match="a is not running"):
            sup.stop("a")
        sup.restart("a")
        with pytest.raises(SupervisorError, match="fraction"):
            sup.slow("a", 1.5)


LOCK_HOG = textwrap.dedent("""
    import fcntl, sys, time
    with open(sys.argv[1], "a+") as lock:
        while True:  # inside the lock 99% of the time, as a stand-in can be on a loaded machine
            fcntl.flock(lock, fcntl.LOCK_EX)
            time.sleep(0.0099)
            fcntl.flock(lock, fcntl.LOCK_UN)
            time.sleep(0.0001)
""")


def test_a_standin_is_never_frozen_inside_the_shared_lock(tmp_path):
    launcher = StandinLauncher()
    launcher.prepare(tmp_path, min_quorum=1, lease_s=0.5, heartbeat_s=0.1, seed=0)
    lock = tmp_path / "standin-cluster" / "lock"
    with Supervisor(terminate_grace_s=1) as sup:
        sup.start(ProcessSpec("hog", [sys.executable, "-c", LOCK_HOG, str(lock)], tmp_path / "hog.log"))
        time.sleep(0.3)
        for _ in range(5):
            asyncio.run(launcher.freeze(sup, "hog"))
            assert sup.stopped("hog") and lock_is_free(lock)
            sup.cont("hog")
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# the harness end to end, with stand-in nodes (real processes, no daemon)


def test_harness_end_to_end_with_standins(tmp_path):
    config = standin_config(ChaosConfig(
        workdir=tmp_path, seed=3, duration_s=12, faults=3, lease_s=0.5, heartbeat_s=0.1,
        warmup_s=2, settle_s=2.5, recovery_s=1, modes=("decoupled",),
    ))
    # Explicit, so the SIGSTOP outlasts the 0.5 s lease by a wide margin even on a loaded machine.
    schedule = Schedule(3, 12, (
        Fault(2.0, "kill", COORDINATOR, 1.0),
        Fault(5.0, "stop", COORDINATOR, 2.0),
        Fault(8.0, "bandwidth", "n2", 1.0, 2.0),
    ))
    report = run_chaos(config, StandinLauncher(commit_interval_s=0.2), schedule)
    assert report["nodes"] == "standin" and report["faults"] == 3
    assert report["violations"] == [], report["violations"]
    decoupled = report["decoupled"]
    applied = decoupled["faults_applied"]
    assert {(f["action"], f["coordinator"]) for f in applied} >= {("kill", True), ("stop", True)}
    assert all(f["note"] == "ok" for f in applied)
    assert decoupled["commits"] > 10 and 0 < decoupled["goodput"] <= 1 and 0 < decoupled["uptime"] <= 1
    assert len(decoupled["failover_s"]["all"]) == 2 and decoupled["failover_s"]["unrecovered"] == 0
    # the SIGSTOPped holder was superseded and stepped down once continued
    assert len(decoupled["stale_leader_step_down_s"]["all"]) == 1
    assert decoupled["stale_leader_step_down_s"]["never"] == 0
    assert report["targets"]["violations"]["ok"] and report["targets"]["histories"]["ok"]
    assert decoupled["nodes_dead_at_end"] == {}

    histories = load_histories(find_history_files(tmp_path))
    # every process the run started is gone: each start event names its pid
    pids = [e.detail["pid"] for events in histories.values() for e in events if e.kind == "start"]
    assert len(pids) == 4  # three nodes plus the restart after the kill
    assert all(process_gone(pid) for pid in pids)
    finals = [e for e in histories["nemesis"] if e.kind == "final"]
    assert sorted(e.detail["target"] for e in finals) == list(NODES)
    assert len({(e.index, e.state_digest) for e in finals}) == 1

    # the same histories with one forged commit: the checker must notice
    forged = HistoryEvent(t_wall=0, t_mono=finals[0].t_mono - 1, node="n2", kind="commit", epoch=99,
                          index=1, entry_digest="forged")
    histories["n2"].append(forged)
    assert {v.invariant for v in check_histories(histories)} >= {"one_entry_per_index"}


# ---------------------------------------------------------------------------------------------
# the real daemon


def test_short_chaos_against_the_real_daemon(tmp_path):
    """About 45 s: the two faults every schedule must have (a coordinator kill and a coordinator
    SIGSTOP past the lease) on three real daemons. Fails (never skips) when the daemon is missing
    or not ready. The daemons' learners are synthetic (random deltas at a fixed pace): what this
    test runs is the harness against the real daemon's coordination, commits and restarts; JAX
    learners under a coordinator kill run in test_daemon_cluster.py, and under every fault in
    `benchmarks/chaos.py soak`. Three JAX learners training through the run made it the default
    suite's costliest test for no path of its own."""
    import diloco_node.daemon  # noqa: F401  (ImportError fails the test)

    config = ChaosConfig(workdir=tmp_path, seed=11, duration_s=36, faults=2, lease_s=3.0, heartbeat_s=0.5,
                         warmup_s=8, settle_s=10, recovery_s=4, modes=("decoupled",))
    report = run_chaos(config, DaemonLauncher(extra_settings=("learner=synthetic",)))
    (tmp_path / "report.json").write_text(json.dumps(report, indent=2))
    assert report["violations"] == [], report["violations"]
    assert report["decoupled"]["nodes_without_history"] == []  # the checker saw every node
    applied = report["decoupled"]["faults_applied"]
    assert {(f["action"], f["coordinator"]) for f in applied} >= {("kill", True), ("stop", True)}, applied
    assert report["targets"]["failover_gap"]["ok"], report["targets"]
    assert report["decoupled"]["commits"] > 0


def test_a_cluster_that_never_gets_ready_fails_with_the_reason(tmp_path):
    class Broken(StandinLauncher):
        def argv(self, slot, bootstrap):
            return [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]

    config = standin_config(ChaosConfig(workdir=tmp_path, duration_s=30, faults=2, lease_s=0.5, warmup_s=2,
                                        settle_s=3, recovery_s=1, modes=("decoupled",)))
    from diloco_node.testbed.chaos.harness import HarnessError

    with pytest.raises(HarnessError, match=r"decoupled: cluster not ready after \d+s: n1: exited with 3 \(log .*node.log\)"):
        run_chaos(config, Broken())
