"""Log entry payloads live in log.bin, not in memory (daemon/coordination_store.py): after every way an
entry reaches the disk (append, reload, a rewrite after truncation, compaction) the in-memory log
holds a `StoredPayload` that reads the same bytes back, and a reference to an entry the log no
longer holds, or a damaged record, fails with a reason instead of returning wrong bytes."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from bootstrap.coordinator_node import PersistentState
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot, StoredPayload
from bootstrap.replog import LogStore, ReplicatedLog
from diloco_node.daemon import peers
from diloco_node.daemon.coordination_store import INLINE_PAYLOAD_BYTES, CoordinationStore, CoordinationStoreError

VOTERS = ClusterConfig.of(["a", "b", "c"])


def _payload(i: int, size: int = 20_000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def _entries(first: int, last: int, epoch: int = 1) -> list[LogEntry]:
    return [LogEntry(epoch, i, EntryKind.OUTER_COMMIT, _payload(i * 10 + epoch), fragment=i % 3, round=i, digest=f"d{i}")
            for i in range(first, last + 1)]


def _state(entries: list[LogEntry]) -> PersistentState:
    state = PersistentState.founding(["a", "b", "c"])
    state.log = LogStore(Snapshot(0, 0, ClusterConfig()), [LogEntry(1, 1, EntryKind.MEMBERSHIP, config=VOTERS)])
    state.log.entries += entries
    return state


def _check_stored(entries: list[LogEntry], expected: dict[int, bytes]) -> None:
    for entry in entries:
        if entry.kind is EntryKind.OUTER_COMMIT:
            assert isinstance(entry.payload, StoredPayload), f"entry {entry.index} still holds its bytes"
            assert entry.payload_size == len(expected[entry.index])
            assert entry.payload_bytes() == expected[entry.index]


def test_appended_entries_keep_only_a_reference_and_read_the_same_bytes(tmp_path: Path) -> None:
    original = _entries(2, 20)
    expected = {e.index: e.payload for e in original}
    state = _state(original)
    store = CoordinationStore(tmp_path)
    store.sync(state)
    _check_stored(state.log.entries, expected)
    assert state.log.entries[0].payload == b""  # small payloads stay inline
    state.log.entries += _entries(21, 25)
    expected.update({e.index: e.payload for e in state.log.entries[20:]})
    store.sync(state)
    _check_stored(state.log.entries, expected)
    # what a follower is sent: the same bytes
    assert peers.entry_to_wire(state.log.entries[5]).payload == expected[6]
    store.close()
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert [(e.index, e.epoch, e.digest) for e in loaded.log.entries] == \
        [(e.index, e.epoch, e.digest) for e in state.log.entries]
    _check_stored(loaded.log.entries, expected)


def test_loading_holds_one_payload_at_a_time_not_the_whole_log(tmp_path: Path) -> None:
    import tracemalloc

    size, count = 1 << 20, 24  # a 24 MiB log of 1 MiB payloads
    entries = [LogEntry(1, i, EntryKind.OUTER_COMMIT, _payload(i, size), fragment=0, round=i) for i in range(2, 2 + count)]
    expected = {e.index: e.payload for e in entries}
    store = CoordinationStore(tmp_path)
    store.sync(_state(entries))
    store.close()
    del entries
    tracemalloc.start()
    try:
        loaded = CoordinationStore(tmp_path).load_persistent()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A few records' worth (the record read, its unpacked payload), never the log's 24 MiB.
    assert peak < 6 * size, f"loading peaked at {peak / size:.1f} MiB"
    _check_stored(loaded.log.entries, expected)


def test_a_truncated_suffix_is_rewritten_and_old_references_refuse(tmp_path: Path) -> None:
    state = _state(_entries(2, 12))
    store = CoordinationStore(tmp_path)
    store.sync(state)
    stale = state.log.entries[9]  # entry 10 of epoch 1, about to be replaced
    expected = {e.index: e.payload_bytes() for e in state.log.entries if e.index < 10}
    del state.log.entries[8:]  # a new leader truncated 9.. and sent its own
    state.log.entries += _entries(9, 14, epoch=2)
    expected.update({e.index: e.payload for e in state.log.entries if e.index >= 9})
    store.sync(state)
    _check_stored(state.log.entries, expected)
    with pytest.raises(CoordinationStoreError, match="entry 10 of epoch 1 is no longer in the log"):
        stale.payload_bytes()
    store.close()
    _check_stored(CoordinationStore(tmp_path).load_persistent().log.entries, expected)


def test_compaction_moves_the_references_to_the_new_file(tmp_path: Path) -> None:
    state = _state(_entries(2, 40))
    store = CoordinationStore(tmp_path)
    store.sync(state)
    expected = {e.index: e.payload_bytes() for e in state.log.entries}
    replog = ReplicatedLog("a", state.log, applied_index=40)
    committed = [e for e in state.log.entries if e.index > 30]
    dropped = state.log.entries[5]
    prepared = store.prepare_compaction(Snapshot(30, 1, VOTERS), committed)
    state.log.entries += _entries(41, 43)  # appended while the compaction was written
    expected.update({e.index: e.payload for e in state.log.entries[-3:]})
    store.sync(state)
    replog.compact(30, b"")
    store.sync(state, prepared)
    assert store.log_first_index == 31
    _check_stored(state.log.entries, expected)
    assert [e.index for e in state.log.entries] == list(range(31, 44))
    with pytest.raises(CoordinationStoreError, match="entry 6 of epoch 1 is no longer in the log"):
        dropped.payload_bytes()
    store.close()
    loaded = CoordinationStore(tmp_path).load_persistent()
    _check_stored(loaded.log.entries, expected)


def test_a_torn_tail_is_dropped_and_the_rest_reads_back(tmp_path: Path) -> None:
    state = _state(_entries(2, 10))
    store = CoordinationStore(tmp_path)
    store.sync(state)
    expected = {e.index: e.payload_bytes() for e in state.log.entries}
    store.close()
    log = tmp_path / "log.bin"
    log.write_bytes(log.read_bytes()[:-5000])  # a crash in the middle of the last append
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert [e.index for e in loaded.log.entries] == list(range(1, 10))
    _check_stored(loaded.log.entries, expected)


def test_a_record_damaged_after_loading_is_refused_by_its_checksum(tmp_path: Path) -> None:
    state = _state(_entries(2, 5))
    store = CoordinationStore(tmp_path)
    store.sync(state)
    log = tmp_path / "log.bin"
    data = bytearray(log.read_bytes())
    data[-100] ^= 0xFF  # inside entry 5's payload
    log.write_bytes(bytes(data))
    assert state.log.entries[2].payload_bytes()  # entry 3 is intact
    with pytest.raises(CoordinationStoreError, match="entry 5: the record at byte .* fails its checksum"):
        state.log.entries[4].payload_bytes()


def test_payloads_read_from_another_thread_while_the_log_grows(tmp_path: Path) -> None:
    state = _state(_entries(2, 6))
    store = CoordinationStore(tmp_path)
    store.sync(state)
    expected = {e.index: e.payload_bytes() for e in state.log.entries}
    errors: list[str] = []
    stop = threading.Event()
    readers = list(state.log.entries[1:])

    def read() -> None:
        while not stop.is_set():
            for entry in readers:
                if entry.payload_bytes() != expected[entry.index]:
                    errors.append(f"entry {entry.index} read other bytes")

    thread = threading.Thread(target=read)
    thread.start()
    for first in range(7, 40, 3):
        batch = _entries(first, first + 2)
        expected.update({e.index: e.payload for e in batch})
        state.log.entries += batch
        store.sync(state)
    stop.set()
    thread.join()
    store.close()
    assert errors == []
    _check_stored(state.log.entries, expected)


def test_stored_payload_checks_the_size_it_promised() -> None:
    entry = LogEntry(1, 2, EntryKind.OUTER_COMMIT, StoredPayload(5, lambda: b"1234"))
    assert entry.payload_size == 5
    with pytest.raises(Exception, match="read 4 bytes, expected 5"):
        entry.payload_bytes()
    with pytest.raises(Exception, match="bytes or a StoredPayload"):
        LogEntry(1, 2, EntryKind.OUTER_COMMIT, "text")  # type: ignore[arg-type]
    assert INLINE_PAYLOAD_BYTES < 20_000  # the entries above are big enough to be stored


def test_an_entry_whose_bytes_are_gone_marks_its_fragment_for_refetch(tmp_path: Path) -> None:
    """A replica asked to apply an entry whose payload left the disk does not fail: the fragment
    is marked diverged (fetched again from a peer) with the reason."""
    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.daemon.coordination_store import PayloadGone
    from diloco_node.sync.fragments import plan_fragments
    from diloco_node.sync.replica import Replica

    shapes = {"w": (4, 4)}
    replica = Replica(plan_fragments(shapes, 1, 2, 0), {"w": np.zeros((4, 4), np.float32)}, OuterOptimizer())

    def gone() -> bytes:
        raise PayloadGone("log.bin: entry 2 of epoch 1 is no longer in the log")

    entry = LogEntry(1, 2, EntryKind.OUTER_COMMIT, StoredPayload(10_000, gone), fragment=0, round=1, digest="d")
    outcome = replica.apply(entry)
    assert outcome.diverged and not outcome.applied and 0 in replica.diverged
    assert "no longer in the log" in outcome.reason


def test_a_stored_payload_is_read_in_pieces_and_a_damaged_record_refused_by_its_checksum(tmp_path: Path) -> None:
    state = _state(_entries(2, 5))
    store = CoordinationStore(tmp_path)
    store.sync(state)
    payload = state.log.entries[2].payload  # entry 3
    assert isinstance(payload, StoredPayload)
    pieces = list(payload.pieces(3000))  # straight from log.bin: the record is never whole in memory
    assert [len(p) for p in pieces] == [3000] * 6 + [2000] and b"".join(pieces) == _payload(31)
    log = tmp_path / "log.bin"
    data = bytearray(log.read_bytes())
    data[-100] ^= 0xFF  # inside entry 5's payload
    log.write_bytes(bytes(data))
    damaged = state.log.entries[4].payload.pieces(3000)
    # The checksum covers the whole record, so a reader learns of the damage at its end, before it
    # can act on the bytes (a holder hashes a payload whole before it names it in an append).
    with pytest.raises(CoordinationStoreError, match="entry 5: the record at byte .* fails its checksum"):
        list(damaged)
    # A compaction or rewrite copies records piece by piece too: the intact ones come out whole.
    state.log.entries[:] = state.log.entries[:4]
    store.sync(state)
    assert state.log.entries[2].payload_bytes() == _payload(31)
