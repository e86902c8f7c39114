"""The chaos engine: schedules (deterministic, constrained), the supervisor against real child
processes (kill, stop/continue, restart, slow, reap), the harness end to end with stand-in nodes,
and a short chaos run against the real daemon (about two minutes, in the default suite)."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.chaos.harness import ChaosConfig, DaemonLauncher, StandinLauncher, run_chaos, standin_config
from diloco_node.testbed.chaos.schedule import (
    COORDINATOR,
    STOP_PAST_LEASE_FACTOR,
    Fault,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    check_schedule,
    generate,
    one_learner_down,
)
from diloco_node.testbed.chaos.supervisor import ProcessSpec, Supervisor, SupervisorError
from diloco_node.ops.history import HistoryEvent, HistoryWriter, find_history_files, load_histories

NODES = ("n1", "n2", "n3")
SHORT = ScheduleSpec(nodes=NODES, duration_s=60, lease_s=3.0, faults=4, warmup_s=10, settle_s=15,
                     recovery_s=4, degrade_s=(3, 8), kill_down_s=(1, 3))
SOAK = ScheduleSpec(nodes=NODES, joiners=("n4",), duration_s=600, lease_s=3.0, faults=24)
FIVE = ScheduleSpec(nodes=("n1", "n2", "n3", "n4", "n5"), duration_s=300, lease_s=2.0, faults=20)


# ---------------------------------------------------------------------------------------------
# schedules


def test_schedules_are_deterministic_per_seed():
    assert generate(7, SOAK) == generate(7, SOAK)
    assert generate(7, SOAK).faults != generate(8, SOAK).faults
    assert Schedule.from_dict(json.loads(generate(7, SOAK).to_json())) == generate(7, SOAK)


def _outages_at(schedule: Schedule, t: float) -> int:
    """Founders down at `t`: one per killed/stopped/isolated node, each node of a partition's minority."""
    return sum(1 + len(f.side) for f in schedule.faults if f.is_outage and f.at_s <= t < f.end_s)


@pytest.mark.parametrize("spec", [SHORT, SOAK, FIVE], ids=["short", "soak", "five-nodes"])
def test_generated_schedules_respect_the_constraints(spec):
    for seed in range(25):
        schedule = generate(seed, spec)
        assert check_schedule(schedule, spec) == []
        assert len(schedule.faults) == spec.faults
        # never a majority down at once (checked on a 0.1 s grid, independently of the generator)
        grid = [i * 0.1 for i in range(int(spec.duration_s / 0.1))]
        assert max(_outages_at(schedule, t) for t in grid) <= (len(spec.nodes) - 1) // 2
        # everything healed before the settle period; nothing before the warm-up ends
        assert all(f.end_s <= spec.duration_s - spec.settle_s for f in schedule.faults)
        assert all(f.at_s >= spec.warmup_s for f in schedule.faults)
        # at least one coordinator kill, and a coordinator SIGSTOP past the lease
        assert any(f.action == "kill" and f.target == COORDINATOR for f in schedule.faults)
        stops = [f for f in schedule.faults if f.action == "stop" and f.target == COORDINATOR]
        assert stops and all(f.duration_s >= spec.lease_s * STOP_PAST_LEASE_FACTOR > spec.lease_s for f in stops)
        # one fault per node at a time (a partition occupies its whole minority side)
        for a in schedule.faults:
            for b in schedule.faults:
                if a is not b and {a.target, *a.side} & {b.target, *b.side} and a.action != "join":
                    assert a.end_s <= b.at_s or b.end_s <= a.at_s


def test_the_soak_schedule_has_twenty_faults_and_a_join():
    schedule = generate(0, SOAK)
    assert len(schedule.faults) >= 20
    assert [f.target for f in schedule.faults if f.action == "join"] == ["n4"]
    assert {f.action for f in schedule.faults} >= {"kill", "stop", "join"}


def test_check_schedule_names_each_broken_constraint():
    bad = Schedule(0, 60, (
        Fault(12, "kill", "n1", 5.0),
        Fault(13, "kill", "n2", 5.0),  # with n1: two of three down
        Fault(30, "stop", COORDINATOR, 1.0),  # not past the 3 s lease
        Fault(44, "slow", "n3", 5.0, 0.5),  # healed at 49 > 45
    ))
    problems = check_schedule(bad, SHORT)
    assert any("SIGKILL n2" in p and "majority" in p for p in problems)
    assert any("shorter than 1.5 x lease" in p for p in problems)
    assert any("after t+45.0s" in p for p in problems)
    assert "no coordinator kill" in problems


def test_impossible_specs_are_refused_with_reasons():
    with pytest.raises(ScheduleError, match="at least 3 founding nodes"):
        ScheduleSpec(nodes=("a", "b"), duration_s=60, lease_s=1, faults=2)
    with pytest.raises(ScheduleError, match="cannot fit"):
        generate(0, ScheduleSpec(nodes=NODES, duration_s=40, lease_s=3, faults=30, warmup_s=5, settle_s=5))
    with pytest.raises(ScheduleError, match="speed fraction"):
        Fault(1, "slow", "n1", 2, 1.5)


def test_one_learner_down_a_third_of_the_time():
    schedule = one_learner_down(3, SOAK)
    assert {f.action for f in schedule.faults} == {"kill"}
    assert len({f.target for f in schedule.faults}) == 1 and schedule.faults[0].target != "n1"
    assert sum(f.duration_s for f in schedule.faults) == pytest.approx(SOAK.duration_s / 3, abs=0.05)
    assert check_schedule(schedule, SOAK, require_coordinator_faults=False) == []
    with pytest.raises(ScheduleError, match="does not fit"):
        one_learner_down(3, SHORT, down_fraction=0.7, outages=1)


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


def _gone(pid: int) -> bool:
    """No such process, or a zombie awaiting an init that does not reap (containers)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _ticks(tmp_path: Path, name: str) -> int:
    path = tmp_path / f"{name}.out"
    return path.read_text().count("tick") if path.exists() else 0


def _grandchild(tmp_path: Path, name: str) -> int:
    path = tmp_path / f"{name}.out.grandchild"
    assert _wait_for(lambda: path.exists() and path.read_text().strip() != "")
    return int(path.read_text())


@pytest.mark.integration
def test_kill_takes_the_whole_group_and_reaps(tmp_path):
    with Supervisor(terminate_grace_s=2) as sup:
        pid = sup.start(_spec(tmp_path, "a"))
        grandchild = _grandchild(tmp_path, "a")
        assert sup.alive("a") and not _gone(pid)
        sup.kill("a")
        assert not sup.alive("a") and sup.returncode("a") == -signal.SIGKILL
        assert _gone(pid)
        assert _wait_for(lambda: _gone(grandchild))


@pytest.mark.integration
def test_stop_freezes_and_cont_resumes(tmp_path):
    with Supervisor(terminate_grace_s=2) as sup:
        pid = sup.start(_spec(tmp_path, "a"))
        assert _wait_for(lambda: _ticks(tmp_path, "a") > 3)
        sup.stop("a")
        assert _wait_for(lambda: _state(pid) == "T")
        frozen = _ticks(tmp_path, "a")
        time.sleep(0.3)
        assert _ticks(tmp_path, "a") == frozen and sup.stopped("a")
        sup.cont("a")
        assert _wait_for(lambda: _ticks(tmp_path, "a") > frozen)
        assert not sup.stopped("a")


@pytest.mark.integration
def test_restart_gives_a_new_process_and_the_old_one_is_gone(tmp_path):
    with Supervisor(terminate_grace_s=2) as sup:
        first = sup.start(_spec(tmp_path, "a"))
        second = sup.restart("a")
        assert second != first and _gone(first) and sup.alive("a")
        sup.kill("a")
        third = sup.restart("a")  # restarting a dead process just starts it
        assert third not in (first, second) and sup.alive("a")
        assert sup.started_pids == [first, second, third]
    assert all(_gone(pid) for pid in (first, second, third))


@pytest.mark.integration
def test_slow_duty_cycles_and_unslow_stops_it(tmp_path):
    with Supervisor(terminate_grace_s=2, slow_period_s=0.1) as sup:
        pid = sup.start(_spec(tmp_path, "a"))
        sup.slow("a", 0.3)
        seen = set()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            seen.add(_state(pid) == "T")
            time.sleep(0.005)
        assert seen == {True, False}  # stopped part of the time, running part of the time
        sup.unslow("a")
        time.sleep(0.05)
        states = set()
        for _ in range(50):
            states.add(_state(pid))
            time.sleep(0.005)
        assert "T" not in states


@pytest.mark.integration
def test_stop_wins_over_a_running_slow_cycle(tmp_path):
    with Supervisor(terminate_grace_s=2, slow_period_s=0.05) as sup:
        pid = sup.start(_spec(tmp_path, "a"))
        sup.slow("a", 0.5)
        sup.stop("a")
        time.sleep(0.05)
        for _ in range(20):  # several slow periods: the throttle never continues it
            assert _state(pid) == "T"
            time.sleep(0.01)
        sup.cont("a")


@pytest.mark.integration
def test_terminate_is_graceful_then_forceful(tmp_path):
    with Supervisor(terminate_grace_s=2) as sup:
        sup.start(_spec(tmp_path, "polite"))
        sup.start(_spec(tmp_path, "stubborn", mode="stubborn"))
        assert _wait_for(lambda: _ticks(tmp_path, "polite") > 0 and _ticks(tmp_path, "stubborn") > 0)
        assert sup.terminate("polite") == 0
        assert (tmp_path / "polite.out").read_text().endswith("bye\n")
        started = time.monotonic()
        assert sup.terminate("stubborn", grace_s=0.3) == -signal.SIGKILL
        assert time.monotonic() - started < 5


@pytest.mark.integration
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
    assert all(_gone(pid) for pid in pids)
    assert _wait_for(lambda: all(_gone(pid) for pid in grandchildren))


@pytest.mark.integration
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


# ---------------------------------------------------------------------------------------------
# the harness end to end, with stand-in nodes (real processes, no daemon)


@pytest.mark.integration
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
    assert all(_gone(pid) for pid in pids)
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


@pytest.mark.integration
def test_short_chaos_against_the_real_daemon(tmp_path):
    """About 45 s: the two faults every schedule must have (a coordinator kill and a coordinator
    SIGSTOP past the lease) on three real daemons. Fails (never skips) when the daemon is missing
    or not ready. Longer runs with more faults: `benchmarks/chaos.py soak`."""
    import diloco_node.daemon  # noqa: F401  (ImportError fails the test)

    config = ChaosConfig(workdir=tmp_path, seed=11, duration_s=36, faults=2, lease_s=3.0, heartbeat_s=0.5,
                         warmup_s=8, settle_s=10, recovery_s=4, modes=("decoupled",))
    report = run_chaos(config, DaemonLauncher())
    (tmp_path / "report.json").write_text(json.dumps(report, indent=2))
    assert report["violations"] == [], report["violations"]
    assert report["decoupled"]["nodes_without_history"] == []  # the checker saw every node
    applied = report["decoupled"]["faults_applied"]
    assert {(f["action"], f["coordinator"]) for f in applied} >= {("kill", True), ("stop", True)}, applied
    assert report["targets"]["failover_gap"]["ok"], report["targets"]
    assert report["decoupled"]["commits"] > 0


def test_targets_are_judged_only_where_they_apply(tmp_path):
    from diloco_node.testbed.chaos.harness import evaluate_targets

    def mode(goodput, failovers, unrecovered=0):
        return {"goodput": goodput, "failover_s": {"all": failovers, "unrecovered": unrecovered}}

    down = ChaosConfig(workdir=tmp_path, scenario="learner-down", lease_s=3.0)
    targets = evaluate_targets({"violations": [], "decoupled": mode(0.88, []), "synchronous": mode(0.62, [])}, down)
    assert {k: v["ok"] for k, v in targets.items()} == {
        "violations": True, "histories": True, "nodes_alive": True, "decoupled_goodput": True,
        "synchronous_goodput": False}
    chaos = ChaosConfig(workdir=tmp_path, lease_s=3.0)
    silent_and_dead = {**mode(0.5, [2.0, 9.5]), "nodes_without_history": ["n2"], "nodes_dead_at_end": {"n3": 1}}
    targets = evaluate_targets({"violations": ["x"], "decoupled": silent_and_dead}, chaos)
    assert {k: v["ok"] for k, v in targets.items()} == {
        "violations": False, "histories": False, "nodes_alive": False, "failover_gap": False}
    assert targets["nodes_alive"]["value"] == {"decoupled:n3": 1}
    assert targets["histories"]["value"] == ["n2"]
    assert targets["failover_gap"]["value"] == 9.5 and targets["failover_gap"]["target"] == "<= 9s (3 x lease)"
    targets = evaluate_targets({"violations": [], "decoupled": mode(0.5, [2.0], unrecovered=1)}, chaos)
    assert targets["failover_gap"]["ok"] is False


@pytest.mark.integration
def test_a_cluster_that_never_gets_ready_fails_with_the_reason(tmp_path):
    class Broken(StandinLauncher):
        def argv(self, slot, bootstrap):
            return [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]

    config = standin_config(ChaosConfig(workdir=tmp_path, duration_s=30, faults=2, lease_s=0.5, warmup_s=2,
                                        settle_s=3, recovery_s=1, modes=("decoupled",)))
    from diloco_node.testbed.chaos.harness import HarnessError

    with pytest.raises(HarnessError, match=r"decoupled: cluster not ready after \d+s: n1: exited with 3 \(log .*node.log\)"):
        run_chaos(config, Broken())


def test_a_stale_holder_that_steps_down_before_the_heal_line_counts_as_zero():
    """Seen against the real daemon: the continued holder wrote `lease_lost` 30 ms before the
    harness wrote its `heal` line; the step-down must not be matched to a later lease loss."""
    from diloco_node.testbed.chaos.metrics import step_down_times
    from diloco_node.ops.history import HistoryEvent

    def ev(node, kind, t, **kw):
        return HistoryEvent(t_wall=t, t_mono=t, node=node, kind=kind, **kw)

    h = {"a": [ev("a", "lease_acquired", 1.0, epoch=2, index=1), ev("a", "lease_lost", 9.97, epoch=2),
               ev("a", "lease_lost", 60.0, epoch=4)],
         "b": [ev("b", "lease_acquired", 8.0, epoch=3, index=9)],
         "nemesis": [ev("nemesis", "fault", 5.0, detail={"action": "stop", "target": "a", "coordinator": True, "fault": 0}),
                     ev("nemesis", "heal", 10.0, detail={"action": "stop", "target": "a", "fault": 0})]}
    assert step_down_times(h) == ([0.0], 0)


def test_the_history_tail_knows_what_was_committed_by_when(tmp_path):
    """Finals are judged against commits recorded before the (lagging) status was current."""
    from diloco_node.testbed.chaos.harness import _HistoryTail

    clock = iter([1.0, 2.0, 3.0, 4.0])
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path, "n1", mono_clock=lambda: next(clock)) as w:
        for index in (5, 7, 6, 9):  # a replayed lower index does not lower the maximum
            w.record("commit", epoch=2, index=index, entry_digest=f"e{index}")
    tail = _HistoryTail(path)
    tail.poll()
    assert [tail.max_commit_before(t) for t in (0.5, 1.0, 2.5, 3.5, 9.0)] == [0, 5, 7, 7, 9]
    assert tail.max_commit == 9
