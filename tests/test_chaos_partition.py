"""Partitions in the chaos engine: the `partition` action in schedules (minority sides counted as
down, placeholders for the holder's companions, the optional mandatory coordinator partition),
the cuts the harness derives for the link emulators' source filters and the daemon's per-node
source address. A stand-in run that partitions the lease holder with a follower away:
tests/integration/test_chaos_partition_processes.py."""

from __future__ import annotations

import json

import pytest

from diloco_node.testbed.chaos.harness import (
    DaemonLauncher,
    HarnessError,
    NodeSlot,
    partition_cuts,
    source_address,
)
from diloco_node.testbed.chaos.schedule import (
    COORDINATOR,
    FOLLOWER,
    Fault,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    check_schedule,
    generate,
)


FIVE = ("n1", "n2", "n3", "n4", "n5")
SPEC5 = ScheduleSpec(nodes=FIVE, duration_s=120, lease_s=2.0, faults=8, warmup_s=10, settle_s=10, recovery_s=4)
SPEC3 = ScheduleSpec(nodes=("n1", "n2", "n3"), duration_s=180, lease_s=3.0, faults=8, coordinator_partition=True)


# ---------------------------------------------------------------------------------------------
# the action in schedules


def test_a_partition_round_trips_through_json_with_its_side():
    schedule = Schedule(1, 120, (Fault(20, "partition", COORDINATOR, 4.0, side=(FOLLOWER,)),
                                 Fault(40, "partition", "n2", 4.0, side=("n4",))))
    again = Schedule.from_dict(json.loads(schedule.to_json()))
    assert again == schedule and again.faults[1].side == ("n4",)
    assert again.faults[1].nodes == ("n2", "n4") and again.faults[1].down == 2
    assert schedule.describe() == [
        "t+20.0s partition the coordinator + another follower from the rest (both ways) for 4.0s",
        "t+40.0s partition n2 + n4 from the rest (both ways) for 4.0s",
    ]


def test_an_old_schedule_without_sides_still_loads():
    raw = {"seed": 0, "duration_s": 60, "faults": [{"at_s": 12, "action": "isolate", "target": "n2",
                                                    "duration_s": 5.0, "param": None}]}
    assert Schedule.from_dict(raw).faults[0].side == ()


@pytest.mark.parametrize(("fault", "message"), [
    (dict(action="kill", target="n1", side=("n2",)), "only a partition has a side"),
    (dict(action="partition", target="n1", side=("n2", "n2")), "each once"),
    (dict(action="partition", target="n1", side=("n1",)), "each once"),
    (dict(action="partition", target="n1", side=(COORDINATOR,)), "the coordinator only as the target"),
    (dict(action="partition", target="n1", side=(FOLLOWER,)), "needs the coordinator as target"),
])
def test_a_malformed_partition_is_refused_with_the_reason(fault, message):
    with pytest.raises(ScheduleError, match=message):
        Fault(at_s=20, duration_s=4, **fault)


def test_every_node_of_a_minority_counts_as_down():
    # Five voters tolerate two down: a two-node partition plus a kill would leave no majority.
    bad = Schedule(0, 120, (Fault(20, "partition", "n1", 4.0, side=("n2",)), Fault(22, "kill", "n3", 2.0)))
    problems = check_schedule(bad, SPEC5, require_coordinator_faults=False)
    assert any("SIGKILL n3" in p and "majority" in p for p in problems), problems
    # a partition that is itself a majority
    bad = Schedule(0, 120, (Fault(20, "partition", "n1", 4.0, side=("n2", "n3")),))
    assert any("takes down a majority" in p for p in check_schedule(bad, SPEC5, require_coordinator_faults=False))
    # and the same partition next to a kill of another node after both have recovered is fine
    ok = Schedule(0, 120, (Fault(20, "partition", "n1", 4.0, side=("n2",)), Fault(30, "kill", "n3", 2.0)))
    assert check_schedule(ok, SPEC5, require_coordinator_faults=False) == []


def test_a_partition_member_is_busy_like_its_target():
    bad = Schedule(0, 120, (Fault(20, "partition", "n1", 4.0, side=("n2",)), Fault(21, "bandwidth", "n2", 2.0, 1.0)))
    problems = check_schedule(bad, SPEC5, require_coordinator_faults=False)
    assert any("cap n2's link" in p and "same node" in p for p in problems), problems


def test_partitions_must_outlast_the_lease_and_hold_founders_only():
    spec = ScheduleSpec(nodes=FIVE, joiners=("n6",), duration_s=120, lease_s=2.0, faults=8, recovery_s=4)
    bad = Schedule(0, 120, (Fault(20, "partition", "n1", 2.0), Fault(40, "isolate", "n2", 1.0),
                            Fault(60, "partition", "n1", 4.0, side=("n6",))))
    problems = check_schedule(bad, spec, require_coordinator_faults=False)
    assert sum("shorter than 1.5 x lease" in p for p in problems) == 2, problems
    assert any("made of founders, not ['n6']" in p for p in problems), problems


def test_a_required_coordinator_partition_is_always_there():
    assert "no coordinator partition" in check_schedule(generate(5, ScheduleSpec(
        nodes=SPEC3.nodes, duration_s=180, lease_s=3.0, faults=8)), SPEC3)
    for seed in range(20):
        schedule = generate(seed, SPEC3)
        assert check_schedule(schedule, SPEC3) == []
        parts = [f for f in schedule.faults if f.action == "partition"]
        # with three voters the minority is one node: the holder alone, for 1.5-3.5 leases
        assert [(f.target, f.side) for f in parts] == [(COORDINATOR, ())]
        assert 4.5 <= parts[0].duration_s <= 10.5
    assert generate(5, SPEC3) == generate(5, SPEC3)
    with pytest.raises(ScheduleError, match="need >= 3"):
        ScheduleSpec(nodes=SPEC3.nodes, duration_s=180, lease_s=3.0, faults=2, coordinator_partition=True)


def test_three_voters_are_never_drawn_a_partition_but_five_get_two_node_minorities():
    three = ScheduleSpec(nodes=("n1", "n2", "n3"), duration_s=300, lease_s=2.0, faults=12)
    assert not any(f.action == "partition" for seed in range(20) for f in generate(seed, three).faults)
    sides = [f.side for seed in range(20) for f in generate(seed, SPEC5).faults if f.action == "partition"]
    assert () in sides and any(len(side) == 1 for side in sides)
    for seed in range(20):
        schedule = generate(seed, SPEC5)
        assert check_schedule(schedule, SPEC5) == []
        for f in schedule.faults:
            if f.action == "partition" and f.target == COORDINATOR:
                assert set(f.side) <= {FOLLOWER}
            elif f.action == "partition":
                assert set(f.side) <= set(FIVE) - {f.target}


# ---------------------------------------------------------------------------------------------
# what the harness makes of it


def test_cuts_split_both_ways_and_compose():
    nodes = FIVE + ("n6",)  # n6: a joiner, on the majority side
    assert partition_cuts([], nodes) == {n: frozenset() for n in nodes}
    cuts = partition_cuts([frozenset({"n1", "n2"})], nodes)
    assert cuts["n1"] == cuts["n2"] == {"n3", "n4", "n5", "n6"}
    assert all(cuts[n] == {"n1", "n2"} for n in ("n3", "n4", "n5", "n6"))
    # two one-node partitions at once: three sides, each isolated node cut from every other
    cuts = partition_cuts([frozenset({"n1"}), frozenset({"n2"})], nodes)
    assert cuts["n1"] == set(nodes) - {"n1"} and cuts["n2"] == set(nodes) - {"n2"}
    assert cuts["n3"] == {"n1", "n2"}


def test_each_daemon_sends_from_its_own_loopback_address(tmp_path):
    assert [source_address(i) for i in (1, 2, 6)] == ["127.0.0.11", "127.0.0.12", "127.0.0.16"]
    launcher = DaemonLauncher()
    launcher.prepare(tmp_path, 1, 3.0, 0.5, seed=0)
    slot = NodeSlot("n2", "learner", 4000, "127.0.0.1:4001", "127.0.0.12", tmp_path / "d", tmp_path / "l", True)
    argv = launcher.argv(slot, "127.0.0.1:5001")
    assert argv[argv.index("--source-address") + 1] == "127.0.0.12"
    assert argv[argv.index("--listen") + 1] == "127.0.0.1:4000"  # /status is polled here, not via the link


def test_extra_settings_reach_every_daemon_and_bad_ones_are_refused_before_any_start(tmp_path):
    launcher = DaemonLauncher(extra_settings=("relay_fanout=2",))
    launcher.prepare(tmp_path, 1, 3.0, 0.5, seed=0)
    slot = NodeSlot("n1", "learner", 4000, "127.0.0.1:4001", "127.0.0.11", tmp_path / "d", tmp_path / "l", True)
    argv = launcher.argv(slot, None)
    assert "relay_fanout=2" in [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    bad = DaemonLauncher(extra_settings=("relay_fanout=99",))
    with pytest.raises(HarnessError, match="relay_fanout"):
        bad.prepare(tmp_path / "bad", 1, 3.0, 0.5, seed=0)
