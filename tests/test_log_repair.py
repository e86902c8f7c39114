"""A damaged record of log.bin found while the node runs: repaired without a restart.

The replicated log drops the entries whose bytes were lost, keeping its commit and applied
indices (nothing is applied twice when they come back); the core steps down and votes only above
its vote floor; the daemon quarantines the file, keeps its good prefix and gets the entries back
from the lease holder (a real cluster: tests/integration/test_log_repair_cluster.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.election import ElectionState, Role
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot
from bootstrap.messages import AppendEntries
from bootstrap.replog import LogStore, ReplicatedLog
from diloco_node.clock import FakeClock
from diloco_node.daemon import peers
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.coordination_store import CoordinationStore, PayloadDamaged
from diloco_node.daemon.lost_entries import accept_loss
from diloco_node.daemon.tasks import TaskSet
from diloco_node.ops.storage_health import STORAGE
from wire.errors import LocalProtocolError

from conftest import NoDisk

VOTERS = ["a", "b", "c"]
CONFIG = ClusterConfig.of(VOTERS)


pytestmark = pytest.mark.usefixtures("clean_storage_state")


def entry(epoch: int, index: int) -> LogEntry:
    return LogEntry(epoch, index, EntryKind.OUTER_COMMIT, bytes([index]) * 5000, fragment=0, round=index)


def append(prev_index: int, prev_epoch: int, entries: list[LogEntry], commit: int, epoch: int = 3) -> AppendEntries:
    return AppendEntries(epoch, "a", prev_index, prev_epoch, tuple(entries), commit, 0.0)


def applied_log(last: int) -> ReplicatedLog:
    """b's log 1..last of epoch 2, committed and applied through `last`."""
    log = ReplicatedLog("b", LogStore(Snapshot(0, 0, CONFIG)), applied_index=0)
    log.handle_append(append(0, 0, [entry(2, i) for i in range(1, last + 1)], commit=last, epoch=2))
    assert [e.index for e in log.take_committed()] == list(range(1, last + 1))
    return log


def test_entries_lost_after_they_were_applied_come_back_without_being_applied_twice():
    log = applied_log(8)
    assert log.forget_from(5) == 4
    assert (log.last_index, log.commit_index, log.applied_index) == (4, 8, 8)
    assert log.take_committed() == []
    with pytest.raises(LocalProtocolError, match="the log ends at 4"):
        log.compact(6, b"")  # never past the log's end, though applied through 8
    # The holder sends 5..8 again and a new entry 9, which it commits.
    outcome = log.handle_append(append(4, 2, [entry(2, 5), entry(2, 6)], commit=9))
    assert outcome.success and log.commit_index == 8 and log.take_committed() == []
    log.handle_append(append(6, 2, [entry(2, 7), entry(2, 8), entry(3, 9)], commit=9))
    assert [e.index for e in log.take_committed()] == [9]  # 5..8 were applied once, before the loss
    assert (log.last_index, log.commit_index, log.applied_index) == (9, 9, 9)


def test_an_append_past_the_shortened_log_is_refused_with_its_end_as_the_hint():
    log = applied_log(8)
    log.forget_from(5)
    outcome = log.handle_append(append(8, 2, [entry(3, 9)], commit=9))
    assert not outcome.success and outcome.match_index == 4  # the holder backs off to 5
    assert log.take_committed() == []


def test_a_snapshot_covering_the_lost_entries_becomes_the_logs_start_without_a_restore():
    log = applied_log(8)
    log.forget_from(5)
    restore, reason = log.install_snapshot(Snapshot(6, 2, CONFIG))  # the holder compacted through 6
    assert not restore and "adopted snapshot through 6" in reason
    assert (log.first_index, log.last_index, log.commit_index, log.applied_index) == (7, 6, 8, 8)
    log.handle_append(append(6, 2, [entry(2, 7), entry(2, 8), entry(3, 9)], commit=9))
    assert [e.index for e in log.take_committed()] == [9]


def test_a_snapshot_past_what_was_applied_is_restored_as_before():
    log = applied_log(8)
    log.commit_index = 10  # committed through 10, applied through 8, then 5.. lost
    log.forget_from(5)
    restore, _ = log.install_snapshot(Snapshot(9, 2, CONFIG))
    assert restore and (log.first_index, log.commit_index, log.applied_index) == (10, 9, 9)


def test_a_holder_that_lost_entries_steps_down_and_does_not_stand_below_its_floor():
    state = PersistentState.founding(["a"])
    core = CoordinatorNode("a", state, now=0.0, rng=random.Random(0))
    now = 0.0
    while core.role is not Role.LEADER:
        now += 0.5
        core.tick(now)
    core.propose(now, EntryKind.OUTER_COMMIT, b"x", fragment=0, round=1)
    held = core.log.last_log
    assert core.lose_entries(held[1], now, vote_floor=held) == 1
    assert core.role is Role.FOLLOWER and core.election.vote_floor == held
    for _ in range(20):
        now += 1.0
        assert not any(isinstance(getattr(a, "message", None), coord.VoteRequest) for a in core.tick(now))
    assert core.role is Role.FOLLOWER


# ---- the daemon: CoordinationIO and CoordinationStore on a real directory -----------------------

class Signed:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id


class QuietClient:
    async def send(self, url, message, *, peer=None, deadline_s=None):
        return []


def _running_follower(tmp_path: Path, applied: list[LogEntry]) -> CoordinationIO:
    """b, a follower of epoch 2 whose log holds 1..8, committed and applied."""
    store = CoordinationStore(tmp_path)
    state = PersistentState.founding(VOTERS)
    state.election = ElectionState(2, "a")
    state.log.entries.extend(entry(2, i) for i in range(2, 9))
    store.sync(state)
    store = CoordinationStore(tmp_path)
    persistent = store.load_persistent()
    core = CoordinatorNode("b", persistent, now=0.0, rng=random.Random(0), applied_index=8)
    return CoordinationIO(core=core, persistent=persistent, store=store, history=NoDisk(), client=QuietClient(),
                          addresses=peers.AddressBook({n: f"https://{n}:7070" for n in VOTERS}),
                          clock=FakeClock(1000.0), tasks=TaskSet(), on_apply=applied.append,
                          on_restore_snapshot=lambda s: None, after_step=lambda: None,
                          remember_member=lambda *a: None, report_error=lambda m: None)


def _vote(candidate: str, last_epoch: int, last_index: int):
    return peers.to_wire(coord.VoteRequest(3, candidate, last_epoch, last_index), epoch=0, commit_index=0,
                         last_index=0)


async def test_a_record_damaged_while_running_is_quarantined_and_its_entries_fetched_again(tmp_path):
    applied: list[LogEntry] = []
    io = _running_follower(tmp_path, applied)
    store, log_bin = io.store, tmp_path / "log.bin"
    try:
        data = bytearray(log_bin.read_bytes())
        data[data.index(bytes([5]) * 5000) + 100] ^= 0x04  # a bit flips in entry 5's record, at rest
        log_bin.write_bytes(bytes(data))
        assert io.core.log.entry_at(6).payload.read() == bytes([6]) * 5000
        with pytest.raises(PayloadDamaged):
            io.core.log.entry_at(5).payload.read()  # e.g. read for a follower's append
        assert store.damage_found == 5 and "log.read" in STORAGE.to_status()["failing"]

        io.repair_damaged_log()  # what the ticker does next
        assert (tmp_path / "log.bin.corrupt-1").exists() and store.damaged_after == 4
        assert "log.read" not in STORAGE.to_status()["failing"]
        log = io.core.log
        assert (log.last_index, log.commit_index, log.applied_index) == (4, 8, 8)
        assert io.log_repair == {"lost_after": 4, "dropped": 4, "held": [2, 8], "refilled": False,
                                 "reason": store.damage_reason}
        assert "found while running" in io.vote_barrier and "(epoch 2, index 8)" in io.vote_barrier
        assert [e.index for e in CoordinationStore(tmp_path).load_persistent().log.entries] == [1, 2, 3, 4]
        assert io.core.log.entry_at(4).payload.read() == bytes([4]) * 5000  # kept entries still read back
        # It votes only for a candidate as up to date as the newest entry its log held.
        assert not (await io.on_vote_request(_vote("c", 2, 4), Signed("c"))).granted
        assert (await io.on_vote_request(_vote("a", 2, 8), Signed("a"))).granted

        # Lease holder a (epoch 3) sends 5..8 back and its no-op 9, committed.
        back = peers.to_wire(append(4, 2, [entry(2, i) for i in range(5, 9)] + [LogEntry(3, 9, EntryKind.NOOP)],
                                    commit=9), epoch=3, commit_index=9, last_index=9)
        reply = await io.on_log_append(back, Signed("a"))
        assert reply.success and io.vote_barrier is None and io.log_repair["refilled"]
        assert [e.index for e in applied] == [9]  # never 5..8 again: the state held them already
        reloaded = CoordinationStore(tmp_path)
        assert [e.index for e in reloaded.load_persistent().log.entries] == list(range(1, 10))
        assert reloaded.damaged_after is None and reloaded.floor.loaded == (3, 9)
    finally:
        await io.tasks.close()


async def test_a_damaged_record_already_rewritten_away_changes_nothing(tmp_path):
    io = _running_follower(tmp_path, [])
    try:
        io.store.damage_found = 5  # reported from a file a rewrite has since replaced
        io.repair_damaged_log()
        assert io.store.damage_found is None and io.log_repair is None and io.vote_barrier is None
        assert io.core.log.last_index == 8 and not list(tmp_path.glob("log.bin.corrupt-*"))
    finally:
        await io.tasks.close()


async def test_a_loss_found_while_running_below_what_was_applied_is_not_accepted_before_a_restart(tmp_path):
    io = _running_follower(tmp_path, [])
    try:
        data = bytearray((tmp_path / "log.bin").read_bytes())
        data[data.index(bytes([5]) * 5000) + 100] ^= 0x04
        (tmp_path / "log.bin").write_bytes(bytes(data))
        with pytest.raises(PayloadDamaged):
            io.core.log.entry_at(5).payload.read()
        io.repair_damaged_log()
        status, body = accept_loss(io, by="Ada", reason="test", lost_after=4)
        assert status == 409 and "restart it first" in body["error"] and io.vote_barrier is not None
        assert not (tmp_path / "loss-accepted.json").exists()
    finally:
        await io.tasks.close()
