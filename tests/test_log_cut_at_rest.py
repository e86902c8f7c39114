"""log.bin cut short at rest (issue 26 item 4): a log shorter than what the node knew durable is
damage, not a torn append; the restart recovers from an older checkpoint or from peers.

Witnesses: `log.mark.json` (the last index known fsynced, rewritten at most every
`MARK_INTERVAL_S`) and the newest checkpoint's applied index. A cut below either quarantines the
file, keeps what is left, and sets the vote barrier (coordination.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.election import ElectionState
from bootstrap.entries import EntryKind, LogEntry
from diloco_node.clock import FakeClock
from diloco_node.config.settings import ConfigError
from diloco_node.daemon import peers
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.coordination_store import MARK_FILE, CoordinationStore
from diloco_node.daemon.log_records import _scan_log
from diloco_node.daemon.persistence import Checkpointer
from diloco_node.daemon.tasks import TaskSet
from diloco_node.ops.checkpoint import CheckpointStore
from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import failpoints
from diloco_node.storage.records import unframe

from conftest import NoDisk
from test_coordination_corruption import QuietClient
from test_daemon_compaction import small_replica

VOTERS = ["a", "b", "c"]


pytestmark = pytest.mark.usefixtures("clean_storage_state")


def _entry(i: int, epoch: int = 2) -> LogEntry:
    return LogEntry(epoch, i, EntryKind.OUTER_COMMIT, bytes([i]) * 5000, fragment=0, round=i)


def _log(tmp_path: Path, last: int, *, mark_every_s: float) -> tuple[CoordinationStore, PersistentState]:
    """A store whose log holds 1..last, appended in two syncs (the mark may follow the second)."""
    store = CoordinationStore(tmp_path)
    store.mark.interval_s = mark_every_s
    state = PersistentState.founding(VOTERS)
    state.election = ElectionState(2, "a")
    state.log.entries.extend(_entry(i) for i in range(2, 4))
    store.sync(state)
    state.log.entries.extend(_entry(i) for i in range(4, last + 1))
    store.sync(state)
    return store, state


def _cut_at_boundary(path: Path, index: int) -> None:
    """Cut log.bin exactly where entry `index`'s record starts."""
    with open(path, "rb") as handle:
        _, located, _, _ = _scan_log(handle, path.stat().st_size, path)
    offset = next(offset for entry, offset, _ in located if entry.index == index)
    path.write_bytes(path.read_bytes()[:offset])


def test_the_mark_follows_the_durable_end_at_most_once_per_interval(tmp_path):
    store, state = _log(tmp_path, 8, mark_every_s=3600.0)
    assert not (tmp_path / MARK_FILE).exists()  # within the interval: no extra write
    store.mark.interval_s = 0.0
    state.log.entries.append(_entry(9))
    store.sync(state)
    assert unframe((tmp_path / MARK_FILE).read_bytes(), "fsynced_through") == {"fsynced_through": 9}


def _marked(directory: Path) -> int:
    return unframe((directory / MARK_FILE).read_bytes(), "fsynced_through")["fsynced_through"]


def test_a_clean_stop_settles_the_mark_at_what_this_process_fsynced(tmp_path):
    store, _ = _log(tmp_path, 8, mark_every_s=3600.0)
    assert not (tmp_path / MARK_FILE).exists()
    store.settle_mark()
    store.close()
    assert _marked(tmp_path) == 8
    # A restart that only read the log marks nothing: those entries may never have been fsynced.
    (tmp_path / MARK_FILE).unlink()
    reloaded = CoordinationStore(tmp_path)
    reloaded.load_persistent()
    reloaded.settle_mark()
    assert not (tmp_path / MARK_FILE).exists()


def test_the_settled_mark_never_passes_a_cut_the_leader_made(tmp_path):
    store, state = _log(tmp_path, 8, mark_every_s=3600.0)
    del state.log.entries[4:]  # a new leader cut 5..8 (uncommitted here): the log ends at 4
    store.sync(state)
    store.settle_mark()
    assert _marked(tmp_path) == 4


def test_a_failed_settle_keeps_the_older_mark_and_says_so(tmp_path):
    store, _ = _log(tmp_path, 8, mark_every_s=3600.0)
    failpoints.arm("log.append=eio*1")
    store.settle_mark()
    assert not (tmp_path / MARK_FILE).exists()
    assert "not written at stop" in str(STORAGE.to_status()["failing"])


def test_a_cut_at_a_record_boundary_below_the_mark_is_damage_and_sets_the_vote_barrier(tmp_path):
    _log(tmp_path, 8, mark_every_s=0.0)
    log_bin = tmp_path / "log.bin"
    _cut_at_boundary(log_bin, 6)
    store = CoordinationStore(tmp_path)
    persistent = store.load_persistent()
    assert [e.index for e in persistent.log.entries] == [1, 2, 3, 4, 5]
    assert store.damaged_after == 5 and "kept as log.bin.corrupt-1" in store.damage_reason
    assert "ends at entry 5" in store.damage_reason and "through 8" in store.damage_reason
    assert STORAGE.to_status()["quarantined"][0]["kept_as"].endswith("log.bin.corrupt-1")
    core = CoordinatorNode("b", persistent, now=0.0, rng=random.Random(0), applied_index=5)
    io = CoordinationIO(core=core, persistent=persistent, store=store, history=NoDisk(), client=QuietClient(),
                        addresses=peers.AddressBook({n: f"https://{n}:7070" for n in VOTERS}),
                        clock=FakeClock(1000.0), tasks=TaskSet(), on_apply=lambda e: None,
                        on_restore_snapshot=lambda s: None, after_step=lambda: None,
                        remember_member=lambda *a: None, report_error=lambda m: None)
    assert io.vote_barrier is not None and "cut at rest" in io.vote_barrier and "after 5" in io.vote_barrier


def test_a_cut_inside_a_record_below_the_mark_is_damage(tmp_path):
    _log(tmp_path, 8, mark_every_s=0.0)
    log_bin = tmp_path / "log.bin"
    log_bin.write_bytes(log_bin.read_bytes()[:log_bin.read_bytes().index(bytes([8]) * 5000) + 10])
    store = CoordinationStore(tmp_path)
    assert [e.index for e in store.load_persistent().log.entries] == list(range(1, 8))
    assert store.damaged_after == 7 and (tmp_path / "log.bin.corrupt-1").exists()


def test_a_torn_append_past_the_mark_is_still_trimmed_quietly(tmp_path):
    store, state = _log(tmp_path, 8, mark_every_s=0.0)  # mark at 8
    store.mark.interval_s = 3600.0
    state.log.entries.append(_entry(9))
    failpoints.arm("vote_floor.write=eio*1")  # the crash came before the floor covered 9
    with pytest.raises(OSError):
        store.sync(state)  # 9 appended and fsynced, the mark not yet moved, the floor not raised
    log_bin = tmp_path / "log.bin"
    log_bin.write_bytes(log_bin.read_bytes()[:-100])
    reloaded = CoordinationStore(tmp_path)
    assert reloaded.load_persistent().log.entries[-1].index == 8 and reloaded.damaged_after is None
    assert STORAGE.to_status()["quarantined"] == []


def test_a_leader_truncating_the_suffix_lowers_the_mark_first(tmp_path):
    store, state = _log(tmp_path, 8, mark_every_s=0.0)
    del state.log.entries[6:]  # a new leader replaced 7..8 (uncommitted here) with its own entry
    state.log.entries.append(_entry(7, epoch=3))
    store.sync(state)
    assert unframe((tmp_path / MARK_FILE).read_bytes(), "fsynced_through")["fsynced_through"] == 7
    reloaded = CoordinationStore(tmp_path)
    assert reloaded.load_persistent().log.entries[-1].index == 7 and reloaded.damaged_after is None


def test_a_damaged_mark_is_quarantined_and_the_log_read_as_it_is(tmp_path):
    _log(tmp_path, 8, mark_every_s=0.0)
    (tmp_path / MARK_FILE).write_bytes(b'{"fsynced_through": 9, "format": 2, "crc32": 1}')
    store = CoordinationStore(tmp_path)
    assert store.load_persistent().log.entries[-1].index == 8 and store.damaged_after is None
    assert STORAGE.to_status()["quarantined"][0]["file"].endswith(MARK_FILE)


# ---------------------------------------------------------------- restart: checkpoint past the log


def _checkpointed(tmp_path: Path, applied: list[int]) -> CheckpointStore:
    checkpoints = CheckpointStore(tmp_path / "checkpoints", keep=max(2, len(applied)))
    source = small_replica()
    for index in applied:
        meta, arrays = source.checkpoint_entries()
        checkpoints.save({"applied_index": index, **meta}, arrays)
    return checkpoints


def _restore(tmp_path: Path, applied: list[int], *, has_peers: bool):
    _log(tmp_path / "coordination", 8, mark_every_s=3600.0)  # no mark: only the checkpoint witnesses
    store = CoordinationStore(tmp_path / "coordination")
    persistent = store.load_persistent()
    checkpoints = _checkpointed(tmp_path, applied)
    checkpointer = Checkpointer(node_id="b", checkpoints=checkpoints, store=store, replica=small_replica(),
                                disk_executor=None, retain_entries=256, report_error=lambda _: None)  # type: ignore[arg-type]
    try:
        plan, _ = checkpointer.restore(persistent, has_peers=has_peers)
    finally:
        checkpoints.close()
    return plan, store, checkpointer


def test_a_checkpoint_past_the_logs_end_is_damage_and_an_older_checkpoint_is_replayed(tmp_path):
    plan, store, checkpointer = _restore(tmp_path, [6, 12], has_peers=False)
    assert (plan.applied_index, plan.install_floor, plan.fallback_checkpoint) == (6, 0, 6)
    assert checkpointer.replica.applied_index == 6
    assert store.damaged_after == 8 and "checkpoint 2 applied through 12" in store.damage_reason
    assert (tmp_path / "coordination" / "log.bin.corrupt-1").exists()


def test_a_checkpoint_past_the_logs_end_without_an_older_one_installs_from_peers(tmp_path):
    plan, store, _ = _restore(tmp_path, [12], has_peers=True)
    assert (plan.applied_index, plan.install_floor) == (8, 8)
    assert store.damaged_after == 8


def test_a_checkpoint_past_the_logs_end_alone_refuses_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"durable log \(.*coordination/log.bin\) ends at 8: it lost committed"):
        _restore(tmp_path, [12], has_peers=False)
