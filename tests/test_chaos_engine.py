"""The chaos engine without processes: schedules (deterministic, constrained), the harness's
verdicts on targets and step-downs, the history tail. The supervisor against real child processes,
the harness with stand-in nodes and a short run against the real daemon are in
tests/integration/test_chaos_engine_processes.py."""

from __future__ import annotations

import json

import pytest

from diloco_node.testbed.chaos.harness import ChaosConfig
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
from diloco_node.ops.history import HistoryWriter

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
# the harness's verdicts and the history


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
