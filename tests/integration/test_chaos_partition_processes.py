"""Partitions in the chaos engine with real processes: a stand-in run that partitions the lease
holder with a follower away and heals (the schedules and cuts without processes:
tests/test_chaos_partition.py)."""

from __future__ import annotations

import pytest

from diloco_node.testbed.chaos.harness import ChaosConfig, StandinLauncher, run_chaos, standin_config
from diloco_node.testbed.chaos.schedule import COORDINATOR, FOLLOWER, Fault, Schedule
from diloco_node.ops.history import find_history_files, load_histories

pytestmark = pytest.mark.integration

FIVE = ("n1", "n2", "n3", "n4", "n5")


def test_harness_partitions_the_holder_with_a_follower_and_heals(tmp_path):
    """Five stand-ins (they do not network, so this exercises the engine's bookkeeping, not the
    protocol): the holder and one follower are cut off from the other three, then healed."""
    config = standin_config(ChaosConfig(
        workdir=tmp_path, seed=4, nodes=5, duration_s=14, faults=5, lease_s=0.5, heartbeat_s=0.1,
        warmup_s=2, settle_s=2.5, recovery_s=1, modes=("decoupled",), coordinator_partition=True,
    ))
    schedule = Schedule(4, 14, (
        Fault(2.0, "kill", COORDINATOR, 0.5),
        Fault(4.0, "partition", COORDINATOR, 1.0, side=(FOLLOWER,)),
        Fault(6.5, "stop", COORDINATOR, 1.0),
        Fault(9.0, "isolate", "n3", 1.0),
        Fault(9.1, "partition", "n4", 1.0),  # with n3 isolated: two one-node sides at once
    ))
    report = run_chaos(config, StandinLauncher(commit_interval_s=0.2), schedule)
    assert report["violations"] == [], report["violations"]
    applied = report["decoupled"]["faults_applied"]
    first = applied[1]
    assert first["action"] == "partition" and first["coordinator"] is True and first["note"] == "ok"
    minority = {first["target"], *first["side"]}
    assert len(minority) == 2 and minority <= set(FIVE)
    majority = set(FIVE) - minority
    assert {n: set(c) for n, c in first["cuts"].items()} == {
        **{n: majority for n in minority}, **{n: minority for n in majority}}
    # the isolation and the overlapping one-node partition: n3 and n4 cut from all, the rest from both
    third = applied[4]
    assert set(third["cuts"]["n3"]) == set(FIVE) - {"n3"} and set(third["cuts"]["n4"]) == set(FIVE) - {"n4"}
    assert set(third["cuts"]["n1"]) == {"n3", "n4"}

    histories = load_histories(find_history_files(tmp_path))
    heals = {e.detail["fault"]: e.detail for e in histories["nemesis"] if e.kind == "heal"}
    assert heals[1]["cuts"] == {}  # nothing else in force then: every filter cleared
    assert set(heals[3]["cuts"]) == set(FIVE)  # n3 healed while n4 is still cut off: n4's cuts remain
    assert all(set(c) == {"n4"} for n, c in heals[3]["cuts"].items() if n != "n4")
    assert heals[4]["cuts"] == {}
