"""Storage and clock faults end to end with stand-in processes: a full disk on the lease holder,
failing I/O, a crash at a fsync (the unsynced append really dropped), a corrupt checkpoint and a
wall clock stepped by an hour; the checker finds nothing wrong, and it does find the planted bug
of a holder that records a commit before its log line is fsynced."""

from __future__ import annotations

import pytest

from diloco_node.ops.history import find_history_files, load_histories
from diloco_node.testbed.chaos.harness import ChaosConfig, StandinLauncher, run_chaos, standin_config
from diloco_node.testbed.chaos.schedule import COORDINATOR, Fault, Schedule


def _config(tmp_path, duration: float = 16.0) -> ChaosConfig:
    return standin_config(ChaosConfig(workdir=tmp_path, seed=5, duration_s=duration, faults=5, lease_s=0.5,
                                      heartbeat_s=0.1, warmup_s=2, settle_s=2.5, recovery_s=1,
                                      modes=("decoupled",)))


@pytest.mark.slow  # about 25 s: five storage and clock faults plus the coordinator kill and SIGSTOP
def test_storage_and_clock_faults_keep_every_invariant(tmp_path):
    # The generator's rules hold (the coordinator's own kill and SIGSTOP included): one fault per
    # node at a time, a coordinator fault overlapping nothing, at most one node down.
    schedule = Schedule(5, 24, (
        Fault(2.0, "kill", COORDINATOR, 1.0),
        Fault(4.5, "stop", COORDINATOR, 1.0),
        Fault(7.0, "disk_full", COORDINATOR, 1.5),
        Fault(10.0, "crash_at_fsync", COORDINATOR, 1.5, how="log.append=crash-before*1"),
        Fault(13.0, "corrupt", "n2", 1.0, how="checkpoint:flip"),
        Fault(13.0, "clock_jump", "n3", 3.0, -3600.0),
        Fault(16.5, "io_error", COORDINATOR, 1.5),
        Fault(19.0, "crash_at_fsync", COORDINATOR, 1.5, how="checkpoint.write=crash-after*1"),
    ))
    report = run_chaos(_config(tmp_path, 24.0), StandinLauncher(commit_interval_s=0.2), schedule)
    assert report["violations"] == [], report["violations"]
    decoupled = report["decoupled"]
    applied = {f["action"] + ":" + str(f["fault"]): f for f in decoupled["faults_applied"]}
    assert all(f["note"] in ("ok", "arming") or f["note"].startswith("checkpoint.json: flipped")
               for f in applied.values()), applied
    assert decoupled["nodes_dead_at_end"] == {} and report["targets"]["histories"]["ok"]
    assert decoupled["commits"] > 10

    histories = load_histories(find_history_files(tmp_path))
    starts = [e for events in histories.values() for e in events if e.kind == "start"]
    # n2 restarted after its corruption, the crashed holders were restarted: more starts than nodes
    assert len(starts) >= 3 + 4
    assert any("quarantined" in e.detail.get("recovered", "") for e in histories["n2"] if e.kind == "start")
    armed = [e.detail["armed"] for e in histories["nemesis"] if e.kind == "heal" and "armed" in e.detail]
    assert armed == ["ok"] * 5  # disk_full, two crash_at_fsync, clock_jump, io_error: each reached its node
    heals = [e for e in histories["nemesis"] if e.kind == "heal" and e.detail["action"] == "crash_at_fsync"]
    assert any(e.detail.get("exit_code") == 86 for e in heals)  # it crashed at the armed fsync
    walls = [e.t_wall - e.t_mono for e in histories["n3"] if e.kind == "apply"]
    assert max(walls) - min(walls) > 3000  # n3's wall clock really jumped; nothing else moved


def test_the_checker_catches_a_holder_that_claims_a_commit_before_it_is_durable(tmp_path):
    class RecordsBeforeFsync(StandinLauncher):
        def argv(self, slot, bootstrap):
            return [*super().argv(slot, bootstrap), "--record-before-fsync"]

    schedule = Schedule(5, 14, (Fault(2.0, "kill", COORDINATOR, 1.0), Fault(4.5, "stop", COORDINATOR, 1.0),
                                Fault(7.0, "crash_at_fsync", COORDINATOR, 1.5, how="log.append=crash-before*1")))
    report = run_chaos(_config(tmp_path, 14.0), RecordsBeforeFsync(commit_interval_s=0.2), schedule)
    invariants = {v.split(":")[1].strip() for v in report["violations"]}
    assert invariants & {"one_entry_per_index", "committed_index_lost"}, report["violations"]
