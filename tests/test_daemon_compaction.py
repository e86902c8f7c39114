"""Log compaction and snapshot install in the daemon: the durable log's compacted format, crash
safety of the rewrite, the compaction rule, the snapshot notice on the wire, the download floor
and the restart contiguity rule. Fast and in-process (the multi-process runs are in
test_daemon_compaction_cluster.py)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from bootstrap import messages as coord
from bootstrap.coordinator_node import PersistentState
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot
from bootstrap.replog import LogStore, ReplicatedLog
from diloco_node.clock import SystemClock
from diloco_node.ops.checkpoint import CheckpointStore
from diloco_node.config.settings import ConfigError
from diloco_node.daemon import peers
from diloco_node.daemon.coordination_store import CoordinationStore, CoordinationStoreError
from diloco_node.daemon.persistence import compaction_point
from diloco_node.daemon.join import FragmentDownload
from diloco_node.daemon.peers import snapshot_from_wire, snapshot_to_wire
from diloco_node.daemon.persistence import Checkpointer, RestartPlan, restart_plan
from diloco_node.sync.replica import CommitPayload, Replica
from wire import messages as wire
from wire.codecs import decode_named, encode_named
from wire.errors import RemoteProtocolError

from conftest import small_replica
from test_state_download import streamed

# The daemon hashes and checks downloaded fragments in its codec pool (pools.py).
POOL_AND_CLOCK = {"executor": ThreadPoolExecutor(2, thread_name_prefix="codec-test"), "clock": SystemClock()}

VOTERS = ClusterConfig.of(["a", "b", "c"])


def _log(n: int, *, epoch: int = 1, payload: bytes = b"x" * 100) -> list[LogEntry]:
    entries = [LogEntry(1, 1, EntryKind.MEMBERSHIP, config=VOTERS)]
    entries += [LogEntry(epoch, i, EntryKind.OUTER_COMMIT, payload, fragment=i % 2, round=i, digest="d")
                for i in range(2, n + 1)]
    return entries


def _state(entries: list[LogEntry], snapshot: Snapshot | None = None) -> PersistentState:
    state = PersistentState.founding(["a", "b", "c"])
    state.log = LogStore(snapshot or Snapshot(0, 0, ClusterConfig()), list(entries))
    return state


def _compact(state: PersistentState, through: int) -> Snapshot:
    """What the node does: the core drops the prefix (ReplicatedLog.compact)."""
    replog = ReplicatedLog("a", state.log, applied_index=state.log.snapshot.last_index + len(state.log.entries))
    return replog.compact(through, b"")


# ---------------------------------------------------------------- the durable log


def test_compacted_log_round_trips_and_keeps_growing(tmp_path: Path) -> None:
    store = CoordinationStore(tmp_path)
    state = _state(_log(50))
    store.sync(state)
    full = store.log_bytes
    assert full == (tmp_path / "log.bin").stat().st_size and store.log_first_index == 1
    _compact(state, 40)
    store.sync(state)
    assert store.log_first_index == 41
    assert store.log_bytes == (tmp_path / "log.bin").stat().st_size < full / 3
    state.log.entries.append(LogEntry(1, 51, EntryKind.NOOP))  # appends continue after the rewrite
    store.sync(state)
    store.close()
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert (loaded.log.snapshot.last_index, loaded.log.snapshot.last_epoch) == (40, 1)
    assert loaded.log.snapshot.config == VOTERS  # the configuration in effect survives the cut
    assert [e.index for e in loaded.log.entries] == list(range(41, 52))
    assert loaded.log.entries == state.log.entries


def test_a_torn_tail_after_compaction_is_dropped_and_the_header_kept(tmp_path: Path) -> None:
    store = CoordinationStore(tmp_path)
    state = _state(_log(30))
    _compact(state, 20)
    store.sync(state)
    store.close()
    with open(tmp_path / "log.bin", "ab") as handle:
        handle.write(b"\x40\x00\x00\x00torn")
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert loaded.log.snapshot.last_index == 20
    assert [e.index for e in loaded.log.entries] == list(range(21, 31))


def test_a_damaged_header_refuses_to_load_instead_of_dropping_the_log(tmp_path: Path) -> None:
    store = CoordinationStore(tmp_path)
    state = _state(_log(10))
    _compact(state, 5)
    store.sync(state)
    store.close()
    data = bytearray((tmp_path / "log.bin").read_bytes())
    data[10] ^= 0xFF  # inside the header record's body
    (tmp_path / "log.bin").write_bytes(bytes(data))
    with pytest.raises(CoordinationStoreError, match="first record fails its checksum"):
        CoordinationStore(tmp_path).load_persistent()
    assert (tmp_path / "log.bin").read_bytes() == bytes(data)  # nothing truncated


def test_entries_that_do_not_follow_the_snapshot_are_refused(tmp_path: Path) -> None:
    from diloco_node.daemon.coordination_store import encode_log

    gap = encode_log(Snapshot(10, 1, VOTERS), [LogEntry(1, 12, EntryKind.NOOP)])
    (tmp_path / "log.bin").write_bytes(gap)
    with pytest.raises(CoordinationStoreError, match="entry 12 follows the snapshot through 10"):
        CoordinationStore(tmp_path).load_persistent()


def test_crash_before_the_rename_loads_the_old_log_and_removes_the_temp(tmp_path: Path, monkeypatch) -> None:
    store = CoordinationStore(tmp_path)
    state = _state(_log(30))
    store.sync(state)
    old = (tmp_path / "log.bin").read_bytes()

    def crash(*_args: object) -> None:
        raise OSError("power lost")

    _compact(state, 20)
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power lost"):
        store.sync(state)
    monkeypatch.undo()
    assert not (tmp_path / ".log.bin.tmp").exists()  # a rewrite that failed removes its temp file
    assert (tmp_path / "log.bin").read_bytes() == old
    (tmp_path / ".log.bin.tmp").write_bytes(b"left by a crash")  # a crash cannot remove it: the load does
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert loaded.log.snapshot.last_index == 0 and [e.index for e in loaded.log.entries] == list(range(1, 31))
    assert not (tmp_path / ".log.bin.tmp").exists()


def test_prepared_compaction_appends_what_came_meanwhile_then_renames(tmp_path: Path) -> None:
    store = CoordinationStore(tmp_path)
    state = _state(_log(30))
    store.sync(state)
    snapshot = Snapshot(20, 1, VOTERS)
    committed = state.log.entries[20:25]  # 21..25, committed when the compaction started
    prepared = store.prepare_compaction(snapshot, committed)
    # A crash now: log.bin is untouched and the half-made compaction is discarded at load.
    assert CoordinationStore(tmp_path).load_persistent().log.snapshot.last_index == 0
    assert not (tmp_path / ".log.bin.compact.tmp").exists()
    prepared = store.prepare_compaction(snapshot, committed)
    state.log.entries += [LogEntry(2, 31, EntryKind.NOOP), LogEntry(2, 32, EntryKind.NOOP)]
    store.sync(state)  # the live log keeps growing while the compacted one is written
    _compact(state, 20)
    store.sync(state, prepared)
    store.close()
    assert not (tmp_path / ".log.bin.compact.tmp").exists()
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert loaded.log.snapshot.last_index == 20
    assert [e.index for e in loaded.log.entries] == list(range(21, 33))
    assert store.log_bytes == (tmp_path / "log.bin").stat().st_size


def test_a_prepared_compaction_that_no_longer_fits_is_replaced_by_a_full_rewrite(tmp_path: Path) -> None:
    store = CoordinationStore(tmp_path)
    state = _state(_log(30))
    store.sync(state)
    prepared = store.prepare_compaction(Snapshot(20, 1, VOTERS), state.log.entries[20:30])
    # A snapshot from the lease holder was installed meanwhile, through 40: the log restarts there.
    state.log = LogStore(Snapshot(40, 3, VOTERS), [LogEntry(3, 41, EntryKind.NOOP)])
    store.sync(state, prepared)
    store.close()
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert loaded.log.snapshot.last_index == 40 and [e.index for e in loaded.log.entries] == [41]
    assert not (tmp_path / ".log.bin.compact.tmp").exists()


def test_a_log_from_before_compaction_existed_still_loads(tmp_path: Path) -> None:
    from diloco_node.daemon.coordination_store import _encode_entry

    (tmp_path / "log.bin").write_bytes(b"".join(_encode_entry(e) for e in _log(5)))  # no header
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert loaded.log.snapshot.last_index == 0 and [e.index for e in loaded.log.entries] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- the compaction rule


def test_compaction_point_keeps_the_tail_below_the_checkpoint_and_the_commit() -> None:
    through, reason = compaction_point(checkpoint_index=1000, commit_index=1200, snapshot_index=0, retain=256)
    assert through == 744 and "256 entries kept below min(checkpoint 1000, commit 1200)" in reason
    through, _ = compaction_point(checkpoint_index=1000, commit_index=900, snapshot_index=0, retain=256)
    assert through == 644  # never past what is committed
    through, reason = compaction_point(checkpoint_index=1000, commit_index=1200, snapshot_index=800, retain=256)
    assert through is None and "already starts after 800" in reason
    through, reason = compaction_point(checkpoint_index=100, commit_index=100, snapshot_index=0, retain=256)
    assert through is None and "nothing to compact" in reason
    # Checkpoints every few seconds must not rewrite the whole retained tail for a handful of entries.
    through, reason = compaction_point(checkpoint_index=1000, commit_index=1200, snapshot_index=700, retain=256)
    assert through is None and "would drop 44 entries, fewer than 128" in reason
    through, _ = compaction_point(checkpoint_index=1000, commit_index=1200, snapshot_index=616, retain=256)
    assert through == 744


# ---------------------------------------------------------------- the snapshot notice on the wire


def test_snapshot_notice_round_trips_through_a_frame_and_old_builds_refuse_it() -> None:
    message = coord.InstallSnapshot(5, "a", Snapshot(700, 4, VOTERS), sent_at=3.0)
    out = snapshot_to_wire(message, leader_commit=720)
    field_map, payload = out.to_wire()
    frame = wire.LogAppend.from_wire(field_map, payload)
    back = snapshot_from_wire(frame)
    assert back is not None and back.snapshot == message.snapshot and (back.epoch, back.leader_id) == (5, "a")
    assert frame.leader_commit == 720
    # The one mapping for appends takes it as the snapshot install it stands for.
    assert peers.append_from_wire(frame) == back
    # A build without snapshot support reads it as an entry of an unknown kind: a clear refusal.
    with pytest.raises(RemoteProtocolError, match="unknown kind 'snapshot'"):
        peers.entry_from_wire(frame.entries[0])
    # Ordinary appends are not snapshots.
    plain = peers.to_wire(coord.AppendEntries(5, "a", 0, 0, (LogEntry(1, 1, EntryKind.NOOP),), 0, 1.0),
                          epoch=5, commit_index=0, last_index=1)
    assert isinstance(plain, wire.LogAppend) and snapshot_from_wire(plain) is None


def test_a_malformed_snapshot_notice_is_the_peers_error() -> None:
    marker = wire.LogEntry(index=9, epoch=1, kind="snapshot", metadata={}, payload=b"")
    with pytest.raises(RemoteProtocolError, match="no voter list"):
        snapshot_from_wire(wire.LogAppend(2, "a", 8, 0, (marker,), 9))
    extra = wire.LogEntry(index=10, epoch=1, kind="noop", metadata={}, payload=b"")
    with pytest.raises(RemoteProtocolError, match="must travel alone"):
        snapshot_from_wire(wire.LogAppend(2, "a", 8, 0, (marker, extra), 9))


def test_follower_core_installs_the_notice_and_asks_for_a_state_restore() -> None:
    """The notice drives the unmodified core: it restores, acks the snapshot index, drops its log."""
    from bootstrap.coordinator_node import CoordinatorNode
    import random

    persistent = PersistentState.founding(["a", "b", "c"])
    node = CoordinatorNode("b", persistent, now=0.0, rng=random.Random(1), applied_index=0)
    notice = snapshot_from_wire(snapshot_to_wire(coord.InstallSnapshot(3, "a", Snapshot(50, 2, VOTERS), 0.0), 50))
    actions = node.handle(notice, now=1.0)
    restores = [a for a in actions if isinstance(a, coord.RestoreSnapshot)]
    acks = [a.message for a in actions if isinstance(a, coord.Send) and isinstance(a.message, coord.AppendResponse)]
    assert [r.snapshot.last_index for r in restores] == [50]
    assert acks and acks[0].success and acks[0].match_index == 50
    assert node.log.first_index == 51 and node.log.applied_index == 50 and persistent.log.entries == []


# ---------------------------------------------------------------- the download floor


def _commit(replica: Replica, index: int, p: int, round_: int) -> LogEntry:
    names = replica.plan.fragments[p].names
    encoded = encode_named({n: np.full(replica.state.fragment_params(p)[n].shape, 0.01, np.float32) for n in names},
                           "int8")
    payload = CommitPayload(encoded, ("a",), (1.0,)).encode()
    return LogEntry(1, index, EntryKind.OUTER_COMMIT, payload, fragment=p, round=round_,
                    digest=replica.digest_after(p, decode_named(encoded)))


class _Peers:
    """Stand-in PeerClient: each URL serves a replica's fragments as of a given applied index."""

    def __init__(self, served: dict[str, tuple[Replica, int]]) -> None:
        self.served = served
        self.asked: list[str] = []

    async def send_for_stream(self, url, request, **_):
        self.asked.append(url)
        replica, index = self.served[url]
        _, data, digest = replica.fragment_bytes(request.fragment)
        part = data[request.offset:request.offset + request.max_length]
        return streamed(wire.SnapshotChunk(request.fragment, index, request.offset, len(data), digest, part))


async def test_download_with_a_floor_skips_peers_that_are_behind_it(monkeypatch) -> None:
    import diloco_node.daemon.join as join

    monkeypatch.setattr(join, "BEHIND_FLOOR_RETRY_S", 0.0)
    behind, current, target = small_replica(), small_replica(), small_replica()
    for i, p in enumerate((0, 1, 0), start=1):
        current.apply(_commit(current, i, p, current.state.round(p) + 1))
    client = _Peers({"http://behind": (behind, 1), "http://current": (current, 3)})
    download = FragmentDownload(client, target, lambda: ["http://behind", "http://current"], min_commit_index=3,
                                **POOL_AND_CLOCK)
    await download.run()
    assert target.state.digest() == current.state.digest()
    assert download.max_commit_index == 3
    assert all(p.commit_index >= 3 for p in download.progress)


async def test_raising_the_floor_refetches_fragments_already_downloaded() -> None:
    old, new, target = small_replica(), small_replica(), small_replica()
    new.apply(_commit(new, 1, 0, 1))
    served = {"http://peer": (old, 0)}
    download = FragmentDownload(_Peers(served), target, lambda: ["http://peer"], **POOL_AND_CLOCK)
    await download.fetch_fragment(0, attempts=1)  # fragment 0 as of index 0
    download.raise_floor(1)  # a snapshot through 1 arrived meanwhile
    served["http://peer"] = (new, 1)
    await download.run()
    assert target.state.round(0) == 1 and target.state.digest() == new.state.digest()


# ---------------------------------------------------------------- restart: checkpoint and log


def test_restart_checkpoint_inside_the_log_replays_it() -> None:
    plan = restart_plan(checkpoint_index=120, snapshot_index=100, log_last_index=150, has_peers=True)
    assert plan == RestartPlan(120, 0, "replay the log from the checkpoint at index 120 through 150")


def test_restart_without_checkpoint_on_an_uncompacted_log_replays_from_the_start() -> None:
    plan = restart_plan(checkpoint_index=None, snapshot_index=0, log_last_index=7, has_peers=False)
    assert plan == RestartPlan(0, 0, "replay the log from the initial state through 7")


def test_restart_checkpoint_beyond_the_log_without_peers_is_a_clear_error_naming_the_file() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint applied through 200 but the durable log \(/d/log.bin\) ends "
                                          r"at 150: it lost committed entries, no older checkpoint"):
        restart_plan(checkpoint_index=200, snapshot_index=100, log_last_index=150, has_peers=False,
                     older_checkpoints=(90, 160), log_name="/d/log.bin")


def test_restart_checkpoint_beyond_the_log_replays_from_the_newest_older_checkpoint_inside_it() -> None:
    plan = restart_plan(checkpoint_index=200, snapshot_index=100, log_last_index=150, has_peers=False,
                        older_checkpoints=(90, 120, 140, 160))
    assert (plan.applied_index, plan.install_floor, plan.fallback_checkpoint) == (140, 0, 140)
    assert "replay the log from the older checkpoint at index 140 through 150" in plan.reason


def test_restart_checkpoint_beyond_the_log_installs_from_peers_as_of_the_logs_end() -> None:
    plan = restart_plan(checkpoint_index=200, snapshot_index=100, log_last_index=150, has_peers=True,
                        older_checkpoints=(90, 160))
    assert (plan.applied_index, plan.install_floor, plan.fallback_checkpoint) == (150, 150, None)
    assert plan.reason.endswith("installing the global state from peers as of index 150 and catching up the log "
                                "from the lease holder")


def test_restart_checkpoint_older_than_the_compacted_log_installs_from_peers() -> None:
    plan = restart_plan(checkpoint_index=60, snapshot_index=100, log_last_index=150, has_peers=True)
    assert (plan.applied_index, plan.install_floor) == (100, 100)
    assert plan.reason == ("the global state is as of index 60 but the durable log starts after 100: "
                           "installing the global state from peers")


def test_restart_compacted_log_without_checkpoint_or_peers_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="compacted through 100, and there is no peer"):
        restart_plan(checkpoint_index=None, snapshot_index=100, log_last_index=105, has_peers=False)


@pytest.mark.parametrize("older, has_peers, snapshot, expected", [
    ((90, 110, 130), True, 100, (130, 0, 130, False)),  # an older current checkpoint inside the log: replayed from
    ((90,), True, 100, (140, 140, None, False)),  # none inside it: installed from peers as of its index
    ((), False, 0, (0, 0, None, True)),  # alone on an uncompacted log: replayed from the initial state
])
def test_restart_never_replays_onto_a_checkpoint_written_while_the_state_was_not_current(
        older: tuple[int, ...], has_peers: bool, snapshot: int, expected: tuple) -> None:
    plan = restart_plan(checkpoint_index=140, snapshot_index=snapshot, log_last_index=150, has_peers=has_peers,
                        older_checkpoints=older, not_current="fragment 1 stale since index 138: payload unreadable")
    assert (plan.applied_index, plan.install_floor, plan.fallback_checkpoint, plan.initial_state) == expected
    assert plan.reason.startswith("the checkpoint at index 140 was written while the global state was not current "
                                  "(fragment 1 stale since index 138")


def test_restart_on_a_state_not_current_without_peers_or_older_checkpoint_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="not current .*no older checkpoint lies inside the durable log "
                                          r"\(compacted through 100\), and there is no peer"):
        restart_plan(checkpoint_index=140, snapshot_index=100, log_last_index=150, has_peers=False,
                     older_checkpoints=(90,), not_current="a download under way")


def test_checkpointer_restores_the_global_state_and_applies_the_restart_plan(tmp_path: Path) -> None:
    """The real Checkpointer on real stores: a checkpoint inside the log is restored bit for bit."""
    source = small_replica()
    source.apply(_commit(source, 1, 0, 1))  # something to restore beyond the initial state
    checkpoints = CheckpointStore(tmp_path / "checkpoints")
    meta, arrays = source.checkpoint_entries()
    checkpoints.save({"applied_index": 120, **meta}, arrays)
    state = source.state
    target = small_replica()
    entries = [LogEntry(1, i, EntryKind.NOOP) for i in range(101, 151)]
    checkpointer = Checkpointer(node_id="a", checkpoints=checkpoints, store=None, replica=target,  # type: ignore[arg-type]
                                disk_executor=None, retain_entries=256, report_error=lambda _: None)  # type: ignore[arg-type]
    try:
        plan, learner = checkpointer.restore(_state(entries, Snapshot(100, 1, VOTERS)), has_peers=True)
    finally:
        checkpoints.close()
    assert plan.install_floor == 0 and learner is None
    assert target.applied_index == 120 and target.state.digest() == state.digest()


async def test_a_snapshot_installed_while_the_checkpoint_is_read_back_drops_the_compaction(
        tmp_path: Path, monkeypatch) -> None:
    """A follower resumed after a pause runs its overdue periodic checkpoint; while the disk thread
    reads the file back, the loop installs the lease holder's snapshot (the holder compacted past
    the follower meanwhile). The compaction decided before that read no longer fits the log: it is
    dropped, the log left as the snapshot made it. Before, it asserted on the epoch of an index the
    log no longer held, which ended the node's periodic task (its /status froze at "ready, applied
    N" while it went on applying: the compaction cluster test timed out once on that)."""
    from types import SimpleNamespace

    import diloco_node.daemon.persistence as persistence
    from diloco_node.ops.checkpoint import verify_checkpoint_file

    state = _state(_log(100))
    replog = ReplicatedLog("b", state.log, applied_index=100)
    replog.commit_index = 100
    store = CoordinationStore(tmp_path / "coordination")
    store.sync(state)
    replica = small_replica()
    replica.applied_index = 100
    errors: list[str] = []

    def read_back_while_a_snapshot_arrives(path: Path) -> dict:
        meta = verify_checkpoint_file(path)
        restored, _ = replog.install_snapshot(Snapshot(130, 1, VOTERS))  # what the loop does meanwhile
        assert restored
        store.sync(state)
        return meta

    monkeypatch.setattr(persistence, "verify_checkpoint_file", read_back_while_a_snapshot_arrives)
    with CheckpointStore(tmp_path / "checkpoints") as checkpoints, ThreadPoolExecutor(1) as disk:
        checkpointer = Checkpointer(node_id="b", checkpoints=checkpoints, store=store, replica=replica,
                                    disk_executor=disk, retain_entries=16, report_error=errors.append)
        coordination = SimpleNamespace(log=replog, compact=replog.compact)
        await checkpointer.checkpoint_and_compact(None, coordination, state, stopping=lambda: False)  # type: ignore[arg-type]
    store.close()
    assert errors == []
    assert (replog.store.snapshot.last_index, replog.first_index, replog.applied_index) == (130, 131, 130)
    loaded = CoordinationStore(tmp_path / "coordination").load_persistent()
    assert loaded.log.snapshot.last_index == 130 and loaded.log.entries == []
    assert not (tmp_path / "coordination" / ".log.bin.compact.tmp").exists()


# ---------------------------------------------------------------- /status and /metrics


def test_status_shows_the_logs_first_index_and_size() -> None:
    from diloco_node.ops.status import StatusBuilder, StatusDocument, StatusFormatError, render_metrics

    builder = StatusBuilder("a", "run-1", "learner", 0.0)
    builder.set_log(first_index=745, size_bytes=604_648)
    doc = builder.document(1.0)
    back = StatusDocument.from_json(doc.to_json())
    assert (back.log_first_index, back.log_bytes) == (745, 604_648)
    text = render_metrics(doc)
    assert "diloco_log_first_index 745" in text and "diloco_log_bytes 604648" in text
    raw = doc.to_dict()
    del raw["log_first_index"], raw["log_bytes"]  # a node from before compaction
    assert StatusDocument.from_dict(raw).log_first_index == 1
    raw["log_bytes"] = "big"
    with pytest.raises(StatusFormatError, match="log_bytes"):
        StatusDocument.from_dict(raw)
