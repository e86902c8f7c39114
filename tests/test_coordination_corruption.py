"""Corruption at rest of the coordination files: detected by checksum, quarantined, recovered.

election.json and election.copy.json (the vote), identity.json, log.bin, each with a flipped bit
and cut short. A damaged copy of the vote is replaced from the other (never reset to "no vote");
a damaged identity stops the node with the kept file named (it never starts as someone new); a
damaged log keeps its good prefix and the node does not vote until a lease holder gave it back
what it may have acknowledged.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.election import ElectionState
from bootstrap.entries import EntryKind, LogEntry
from diloco_node.clock import FakeClock
from diloco_node.daemon import peers
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.coordination_records import DamagedStateError, VoteFloor
from diloco_node.daemon.coordination_store import FLOOR_FILE, CoordinationStore
from diloco_node.daemon.tasks import TaskSet
from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage.records import frame, unframe
from wire.errors import RemoteProtocolError

from conftest import NoDisk

VOTERS = ["a", "b", "c"]


pytestmark = pytest.mark.usefixtures("clean_storage_state")


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x04
    path.write_bytes(bytes(data))


def cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


DAMAGE = {"bit flip": lambda p: flip_bit(p, len(p.read_bytes()) // 2), "truncation": lambda p: cut(p, 9)}


def _voted(tmp_path: Path) -> CoordinationStore:
    store = CoordinationStore(tmp_path)
    state = PersistentState.founding(VOTERS)
    state.election = ElectionState(7, "c")
    store.sync(state)
    return store


def test_a_record_file_carries_a_checksum_and_the_old_format_still_reads() -> None:
    record = {"current_epoch": 3, "voted_for": "a"}
    assert unframe(frame(record), "current_epoch") == record
    assert unframe(json.dumps(record).encode(), "current_epoch") == record  # written before the framing


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", ["election.json", "election.copy.json"])
def test_a_damaged_copy_of_the_vote_is_quarantined_and_the_other_keeps_the_vote(tmp_path, name, damage):
    store = _voted(tmp_path)
    DAMAGE[damage](tmp_path / name)
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert (loaded.election.current_epoch, loaded.election.voted_for) == (7, "c")  # not reset to "no vote"
    assert (tmp_path / f"{name}.corrupt-1").exists() and not (tmp_path / name).exists()
    [listed] = STORAGE.to_status()["quarantined"]
    assert listed["file"].endswith(name) and "election record damaged" in listed["reason"]
    again = CoordinationStore(tmp_path)
    state = again.load_persistent()
    again.sync(state)  # the missing copy is written again at the next sync
    assert unframe((tmp_path / name).read_bytes(), "current_epoch") == {"current_epoch": 7, "voted_for": "c"}
    del store


def test_both_copies_damaged_refuses_to_start_rather_than_forget_the_vote(tmp_path):
    _voted(tmp_path)
    flip_bit(tmp_path / "election.json", 20)
    cut(tmp_path / "election.copy.json", 5)
    with pytest.raises(DamagedStateError, match="every copy of the election record is damaged.*vote twice"):
        CoordinationStore(tmp_path).load_persistent()
    assert len(STORAGE.to_status()["quarantined"]) == 2


def test_the_newer_copy_wins_after_a_crash_between_the_two_writes(tmp_path):
    _voted(tmp_path)
    (tmp_path / "election.json").write_bytes(frame({"current_epoch": 8, "voted_for": "b"}))  # the copy: still 7
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert (loaded.election.current_epoch, loaded.election.voted_for) == (8, "b")
    (tmp_path / "election.json").write_bytes(frame({"current_epoch": 7, "voted_for": None}))
    (tmp_path / "election.copy.json").write_bytes(frame({"current_epoch": 7, "voted_for": "c"}))
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert loaded.election.voted_for == "c"  # in one epoch a vote is never withdrawn


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_identity_stops_the_node_and_it_never_starts_as_someone_new(tmp_path, damage):
    store = CoordinationStore(tmp_path)
    store.save_identity({"node_id": "b", "manifest": {"run": "r"}, "addresses": {}})
    store.sync(PersistentState.founding(VOTERS))
    DAMAGE[damage](tmp_path / "identity.json")
    with pytest.raises(DamagedStateError, match=r"identity.json is damaged .*kept as identity.json.corrupt-1"):
        CoordinationStore(tmp_path).load_identity()
    assert STORAGE.to_status()["quarantined"][0]["kept_as"].endswith("identity.json.corrupt-1")
    restarted = CoordinationStore(tmp_path)
    assert restarted.exists()  # not a fresh directory: the node does not found or join again
    with pytest.raises(DamagedStateError, match=r"no identity.json \(quarantined: \['identity.json.corrupt-1'\]\)"):
        restarted.load_identity()


def _log_with_commits(tmp_path: Path, last: int) -> CoordinationStore:
    store = CoordinationStore(tmp_path)
    state = PersistentState.founding(VOTERS)
    state.election = ElectionState(2, "a")
    state.log.entries.extend(LogEntry(2, i, EntryKind.OUTER_COMMIT, bytes([i]) * 5000, fragment=0, round=i)
                             for i in range(2, last + 1))
    store.sync(state)
    return store


def _payload_offset(path: Path, index: int) -> int:
    return path.read_bytes().index(bytes([index]) * 5000)


def test_a_bit_flip_inside_the_log_is_quarantined_and_its_good_prefix_kept(tmp_path):
    _log_with_commits(tmp_path, 8)
    log_bin = tmp_path / "log.bin"
    flip_bit(log_bin, _payload_offset(log_bin, 5) + 100)
    store = CoordinationStore(tmp_path)
    loaded = store.load_persistent()
    assert [e.index for e in loaded.log.entries] == [1, 2, 3, 4]
    assert store.damaged_after == 4 and "kept as log.bin.corrupt-1" in store.damage_reason
    assert (tmp_path / "log.bin.corrupt-1").exists()
    assert STORAGE.to_status()["quarantined"][0]["reason"].startswith("the record at byte")
    assert [e.index for e in CoordinationStore(tmp_path).load_persistent().log.entries] == [1, 2, 3, 4]


def test_a_log_cut_short_mid_record_loses_only_its_torn_tail(tmp_path):
    _log_with_commits(tmp_path, 8)
    # A torn append never got past its fsync, so the vote floor never covered it (still entry 7).
    (tmp_path / FLOOR_FILE).write_bytes(VoteFloor.encode((2, 7)))
    log_bin = tmp_path / "log.bin"
    cut(log_bin, _payload_offset(log_bin, 8) + 10)
    store = CoordinationStore(tmp_path)
    assert [e.index for e in store.load_persistent().log.entries] == list(range(1, 8))
    # Indistinguishable from an append torn by a crash (never acknowledged): trimmed, not quarantined.
    assert store.damaged_after is None and STORAGE.to_status()["quarantined"] == []


class Signed:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id


class QuietClient:
    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, url, message, *, peer=None, deadline_s=None):
        self.sent.append(message)
        return []


def _damaged_io(tmp_path: Path) -> tuple[CoordinationIO, CoordinationStore, QuietClient]:
    """b's log held 1..8 of epoch 2 (its vote floor), and a bit flip at rest lost it 5..8."""
    log_bin = tmp_path / "log.bin"
    flip_bit(log_bin, _payload_offset(log_bin, 5) + 100)
    store = CoordinationStore(tmp_path)
    persistent = store.load_persistent()
    core = CoordinatorNode("b", persistent, now=0.0, rng=random.Random(0), applied_index=4)
    client = QuietClient()
    io = CoordinationIO(core=core, persistent=persistent, store=store, history=NoDisk(), client=client,
                        addresses=peers.AddressBook({n: f"https://{n}:7070" for n in VOTERS}), clock=FakeClock(1000.0),
                        tasks=TaskSet(), on_apply=lambda e: None, on_restore_snapshot=lambda s: None,
                        after_step=lambda: None, remember_member=lambda *a: None, report_error=lambda m: None)
    return io, store, client


async def _stands_not(io: CoordinationIO, client: QuietClient) -> None:
    """Its own (pre-)vote requests do not leave: it does not stand."""
    io.dispatch(io.core.tick(1000.0))
    await io.tasks.close()
    assert not any(isinstance(m, peers.wire.VoteRequest) for m in client.sent)
    io.tasks = TaskSet()


def _vote(candidate: str, last_epoch: int, last_index: int, epoch: int = 3):
    return peers.to_wire(coord.VoteRequest(epoch, candidate, last_epoch, last_index), epoch=0, commit_index=0,
                         last_index=0)


async def test_after_log_damage_the_node_votes_only_above_its_floor_until_its_log_is_back(tmp_path):
    _log_with_commits(tmp_path, 8)
    io, store, client = _damaged_io(tmp_path)
    try:
        assert io.vote_barrier is not None and "after 4" in io.vote_barrier and "(epoch 2, index 8)" in io.vote_barrier
        assert io.core.election.vote_floor == (2, 8)
        # c, whose log ends where ours does now, is refused: 5..8 may be committed and it lacks them.
        refused = await io.on_vote_request(_vote("c", 2, 4), Signed("c"))
        assert not refused.granted and "may have acknowledged" in refused.reason
        # a, whose log is as up to date as the newest ours held, gets the vote.
        granted = await io.on_vote_request(_vote("a", 2, 8), Signed("a"))
        assert granted.granted and io.persistent.election.voted_for == "a"
        await _stands_not(io, client)

        # Lease holder a (epoch 3) sends back 5..8 and its epoch's no-op.
        entries = tuple([LogEntry(2, i, EntryKind.OUTER_COMMIT, bytes([i]) * 5000, fragment=0, round=i)
                         for i in range(5, 9)] + [LogEntry(3, 9, EntryKind.NOOP)])
        partial = coord.AppendEntries(3, "a", 4, 2, entries[:2], 6, sent_at=1.0)
        reply = await io.on_log_append(peers.to_wire(partial, epoch=3, commit_index=6, last_index=6), Signed("a"))
        assert reply.success and io.vote_barrier is not None  # its log ends at (2, 6), below the floor
        rest = coord.AppendEntries(3, "a", 6, 2, entries[2:], 9, sent_at=2.0)
        reply = await io.on_log_append(peers.to_wire(rest, epoch=3, commit_index=9, last_index=9), Signed("a"))
        assert reply.success and io.vote_barrier is None and store.damaged_after is None
        assert io.core.election.vote_floor is None
        reloaded = CoordinationStore(tmp_path)
        assert [e.index for e in reloaded.load_persistent().log.entries] == list(range(1, 10))
        assert reloaded.damaged_after is None and reloaded.floor.loaded == (3, 9)
    finally:
        await io.tasks.close()


async def test_after_log_damage_without_a_floor_the_node_votes_only_once_a_lease_holder_gave_its_entries_back(
        tmp_path):
    _log_with_commits(tmp_path, 8)
    (tmp_path / FLOOR_FILE).unlink()  # a data directory from before the floor, or one that lost it too
    io, store, client = _damaged_io(tmp_path)
    try:
        assert io.vote_barrier is not None and "after 4" in io.vote_barrier and "no vote floor" in io.vote_barrier
        for candidate, last in (("c", (2, 4)), ("a", (2, 8))):  # whoever asks
            with pytest.raises(RemoteProtocolError, match="does not vote yet") as refused:
                await io.on_vote_request(_vote(candidate, *last), Signed(candidate))
            assert refused.value.status_hint == 503
        await _stands_not(io, client)
        assert not (tmp_path / FLOOR_FILE).exists()  # never set to the cut log's end while barred

        # Lease holder a (epoch 3) sends back 5..8 and its epoch's no-op, and commits the no-op.
        entries = tuple([LogEntry(2, i, EntryKind.OUTER_COMMIT, bytes([i]) * 5000, fragment=0, round=i)
                         for i in range(5, 9)] + [LogEntry(3, 9, EntryKind.NOOP)])
        partial = coord.AppendEntries(3, "a", 4, 2, entries[:2], 6, sent_at=1.0)
        reply = await io.on_log_append(peers.to_wire(partial, epoch=3, commit_index=6, last_index=6), Signed("a"))
        assert reply.success and io.vote_barrier is not None  # committed 6: not an entry of the holder's epoch
        rest = coord.AppendEntries(3, "a", 6, 2, entries[2:], 9, sent_at=2.0)
        reply = await io.on_log_append(peers.to_wire(rest, epoch=3, commit_index=9, last_index=9), Signed("a"))
        assert reply.success and io.vote_barrier is None and store.damaged_after is None
        assert [e.index for e in CoordinationStore(tmp_path).load_persistent().log.entries] == list(range(1, 10))
        # Written again once the barrier lifted (the next sync): its log holds all it acknowledged.
        io.dispatch([])
        assert CoordinationStore(tmp_path).floor.load() == (3, 9)
    finally:
        await io.tasks.close()
