"""The vote floor (coordination_records.VoteFloor, issue 37 item 1): the newest (epoch, index)
log.bin ever held, made durable by the same `sync()` that makes the log durable, so before any
acknowledgement that depends on it leaves; never lowered by the log; read at start, where a log
that ends in the floor's epoch before its index is damage (cut at rest), and a node whose log lost
entries votes only for a candidate at least as up to date as it."""

from __future__ import annotations

import random

import pytest

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.election import ElectionState
from bootstrap.entries import EntryKind, LogEntry
from diloco_node.clock import FakeClock
from diloco_node.daemon import peers
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.coordination_records import FLOOR_RECORD_BYTES, VoteFloor
from diloco_node.daemon.coordination_store import FLOOR_FILE, MARK_FILE, CoordinationStore
from diloco_node.daemon.tasks import TaskSet
from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import failpoints
from wire.errors import RemoteProtocolError

from conftest import NoDisk
from test_coordination_corruption import QuietClient, Signed
from test_log_cut_at_rest import _cut_at_boundary

VOTERS = ["a", "b", "c"]


pytestmark = pytest.mark.usefixtures("clean_storage_state")


def _on_disk(tmp_path) -> tuple[int, int] | None:
    path = tmp_path / FLOOR_FILE
    return VoteFloor(tmp_path).load() if path.exists() else None


def _entry(index: int, epoch: int = 2) -> LogEntry:
    return LogEntry(epoch, index, EntryKind.OUTER_COMMIT, bytes([index % 256]) * 5000, fragment=0, round=index)


def _follower(tmp_path) -> CoordinationIO:
    """b, a founder of a, b, c: its log holds the founding entry (epoch 1, index 1)."""
    CoordinationStore(tmp_path).sync(PersistentState.founding(VOTERS))
    store = CoordinationStore(tmp_path)
    persistent = store.load_persistent()
    core = CoordinatorNode("b", persistent, now=0.0, rng=random.Random(0), applied_index=1)
    return CoordinationIO(core=core, persistent=persistent, store=store, history=NoDisk(), client=QuietClient(),
                          addresses=peers.AddressBook({n: f"https://{n}:7070" for n in VOTERS}),
                          clock=FakeClock(1000.0), tasks=TaskSet(), on_apply=lambda e: None,
                          on_restore_snapshot=lambda s: None, after_step=lambda: None,
                          remember_member=lambda *a: None, report_error=lambda m: None)


async def test_no_acknowledgement_leaves_before_the_floor_covers_it(tmp_path):
    io = _follower(tmp_path)
    assert _on_disk(tmp_path) == (1, 1)
    try:
        for prev_index, entries in ((1, [_entry(i) for i in range(2, 5)]), (4, [_entry(i) for i in range(5, 7)])):
            prev_epoch = 1 if prev_index == 1 else 2
            append = coord.AppendEntries(2, "a", prev_index, prev_epoch, tuple(entries), 0, sent_at=1.0)
            wire_append = peers.to_wire(append, epoch=2, commit_index=0, last_index=entries[-1].index)
            if entries[-1].index == 6:
                # The floor cannot be written: the append is in log.bin, but no acknowledgement leaves.
                failpoints.arm("vote_floor.write=eio*1")
                with pytest.raises(RemoteProtocolError, match="cannot persist") as refused:
                    await io.on_log_append(wire_append, Signed("a"))
                assert refused.value.status_hint == 503 and _on_disk(tmp_path) == (2, 4)
                assert "vote_floor.write" in STORAGE.to_status()["failing"]
            reply = await io.on_log_append(wire_append, Signed("a"))
            assert reply.success and reply.index == entries[-1].index
            # Whatever the reply acknowledges, the floor on disk covered it before the reply existed.
            assert _on_disk(tmp_path) >= (entries[-1].epoch, reply.index)
        assert _on_disk(tmp_path) == (2, 6)
    finally:
        await io.tasks.close()


def _synced(tmp_path, entries: list[LogEntry], *, mark_every_s: float = 3600.0) -> tuple[CoordinationStore,
                                                                                          PersistentState]:
    store = CoordinationStore(tmp_path)
    store.mark.interval_s = mark_every_s
    state = PersistentState.founding(VOTERS)
    state.election = ElectionState(2, "a")
    state.log.entries.extend(entries)
    store.sync(state)
    return store, state


def test_the_floor_never_comes_down_with_the_log_and_a_lower_epoch_end_is_no_damage(tmp_path):
    store, state = _synced(tmp_path, [_entry(i, 1) for i in range(2, 6)] + [_entry(i) for i in range(6, 9)])
    assert _on_disk(tmp_path) == (2, 8)
    # A new holder's catch-up replaced 6..8 (epoch 2, never committed) with its own older-epoch entries
    # first (a batch of at most N entries): the log ends lower for a while, the floor stays.
    del state.log.entries[5:]
    state.log.entries.extend([_entry(6, 1), _entry(7, 1)])
    store.sync(state)
    assert _on_disk(tmp_path) == (2, 8)
    reloaded = CoordinationStore(tmp_path)
    assert reloaded.load_persistent().log.entries[-1].index == 7
    assert reloaded.damaged_after is None and reloaded.floor.loaded == (2, 8)


def test_a_log_cut_in_the_floors_epoch_is_damage_even_past_the_mark(tmp_path):
    _synced(tmp_path, [_entry(i) for i in range(2, 9)], mark_every_s=3600.0)  # the mark never written
    assert not (tmp_path / MARK_FILE).exists() and _on_disk(tmp_path) == (2, 8)
    _cut_at_boundary(tmp_path / "log.bin", 8)  # what a torn append of 8 would look like, but 8 was fsynced
    store = CoordinationStore(tmp_path)
    assert store.load_persistent().log.entries[-1].index == 7
    assert store.damaged_after == 7 and FLOOR_FILE in store.damage_reason
    assert store.floor.loaded == (2, 8)


def test_a_damaged_floor_is_quarantined_and_unknown(tmp_path):
    _synced(tmp_path, [_entry(i) for i in range(2, 9)])
    record = bytearray(VoteFloor.encode((2, 8)))
    assert len(record) == FLOOR_RECORD_BYTES
    (tmp_path / FLOOR_FILE).write_bytes(bytes(record[:-3]))  # a write torn by a crash
    store = CoordinationStore(tmp_path)
    assert store.load_persistent().log.entries[-1].index == 8 and store.floor.loaded is None
    assert STORAGE.to_status()["quarantined"][0]["file"].endswith(FLOOR_FILE)
    record[9] ^= 1  # a bit flipped at rest
    (tmp_path / FLOOR_FILE).write_bytes(bytes(record))
    assert CoordinationStore(tmp_path).floor.load() is None
    # Unknown, with a whole log: written again by the next sync.
    store.sync(store.load_persistent())
    assert _on_disk(tmp_path) == (2, 8)


async def test_a_node_with_a_floor_votes_for_a_complete_candidate_and_the_election_completes(tmp_path):
    """Two of three voters cut at rest (b and c), a intact: b and c grant a's vote, refuse each other."""
    entries = [_entry(i) for i in range(2, 9)]
    ios = []
    for name in ("b", "c"):
        directory = tmp_path / name
        _synced(directory, entries, mark_every_s=0.0)
        _cut_at_boundary(directory / "log.bin", 5)
        store = CoordinationStore(directory)
        persistent = store.load_persistent()
        core = CoordinatorNode(name, persistent, now=0.0, rng=random.Random(0), applied_index=4)
        ios.append(CoordinationIO(core=core, persistent=persistent, store=store, history=NoDisk(),
                                  client=QuietClient(), addresses=peers.AddressBook({}), clock=FakeClock(1000.0),
                                  tasks=TaskSet(), on_apply=lambda e: None, on_restore_snapshot=lambda s: None,
                                  after_step=lambda: None, remember_member=lambda *a: None,
                                  report_error=lambda m: None))
    b, c = ios
    try:
        for voter, other in ((b, "c"), (c, "b")):
            asked = peers.to_wire(coord.VoteRequest(3, other, 2, 4), epoch=0, commit_index=0, last_index=0)
            assert not (await voter.on_vote_request(asked, Signed(other))).granted
            asked = peers.to_wire(coord.VoteRequest(3, "a", 2, 8), epoch=0, commit_index=0, last_index=0)
            assert (await voter.on_vote_request(asked, Signed("a"))).granted
    finally:
        for io in ios:
            await io.tasks.close()
