"""What a site keeps on its own disk between runs: checkpoints, log compaction, and the restart rule.

- `restart_plan` (pure): given the newest good checkpoint's index (and the older ones') and the
  durable log's extent, decide whether a restart replays the log from a checkpoint or must install
  the global state from peers, or cannot start at all; with the reason. A newest checkpoint past
  the log's end means log.bin lost committed entries at rest: the store reports it as damage
  (quarantine, vote barrier) and the node recovers from an older checkpoint or from its peers.
- `Checkpointer`: writes checkpoints (global state, the learner's weights and AdamW state, counters,
  applied index) atomically on the disk thread, restores from the newest good one, and compacts the
  replicated log below a checkpoint that reads back intact. A checkpoint that cannot be written (a
  full or failing disk) is reported (`/status`'s storage section, one warning per failure streak)
  and skipped: the node and its learner go on, and the next periodic checkpoint tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.entries import Snapshot
from bootstrap.replog import ReplicatedLog
from diloco_node.config.settings import ConfigError
from diloco_node.daemon.coordination_store import CoordinationStore, CoordinationStoreError
from diloco_node.learn.learner_thread import (
    LearnerSnapshot,
    LearnerThread,
    snapshot_from_checkpoint,
    snapshot_meta_and_arrays,
)
from diloco_node.ops.checkpoint import (
    CheckpointError,
    CheckpointStore,
    CheckpointUnreadable,
    read_checkpoint_file,
    verify_checkpoint_file,
)
from diloco_node.ops.storage_health import STORAGE
from diloco_node.sync.replica import Replica
from diloco_node.sync.state_codec import NOT_CURRENT_KEY, checkpoint_not_current

log = logging.getLogger("diloco_node.daemon")


@dataclass(frozen=True, slots=True)
class RestartPlan:
    """How a restarted node gets a global state. `install_floor` > 0: download it from peers as of
    that index (the local state is too old for the log); else replay the log from `applied_index`."""

    applied_index: int
    install_floor: int
    reason: str
    # An older checkpoint to restore instead of the newest (whose index is past the log's end, or
    # whose global state was not current when written).
    fallback_checkpoint: int | None = None
    # The checkpoint's global state is not restored: the log is replayed from the run's initial state.
    initial_state: bool = False


def compaction_point(*, checkpoint_index: int, commit_index: int, snapshot_index: int,
                     retain: int) -> tuple[int | None, str]:
    """How far the log may be compacted after a verified checkpoint at `checkpoint_index`.

    Never past the checkpoint (a restart replays the log from it, so checkpoint and log must
    stay contiguous) nor past the commit index, and `retain` entries below that are kept for
    peers that lag a little; and only once the cut drops at least half as many entries as it keeps.
    Returns (index to compact through, or None; reason).
    """
    bound = min(checkpoint_index, commit_index)
    through = bound - retain
    if through <= snapshot_index:
        return None, (f"nothing to compact: checkpoint {checkpoint_index}, commit {commit_index}, keeping "
                      f"{retain} entries puts the cut at {through}, log already starts after {snapshot_index}")
    # A cut rewrites the retained tail; waiting until it drops at least half as many entries as it
    # keeps bounds the rewriting at ~3x the log's own writes, however often checkpoints come.
    min_drop = max(1, retain // 2)
    if through - snapshot_index < min_drop:
        return None, (f"not yet: the cut at {through} would drop {through - snapshot_index} entries, "
                      f"fewer than {min_drop} (half the {retain} kept)")
    return through, (f"compact through {through}: {retain} entries kept below "
                     f"min(checkpoint {checkpoint_index}, commit {commit_index})")


def restart_plan(*, checkpoint_index: int | None, snapshot_index: int, log_last_index: int,
                 has_peers: bool, older_checkpoints: Sequence[int] = (), log_name: str = "log.bin",
                 not_current: str = "") -> RestartPlan:
    """The durable log holds the entries after `snapshot_index`; a checkpoint must lie between that
    point and the log's end for a replay from it to be complete. One older than the point (the
    newest failed verification and an older one was used, or checkpoints were removed) cannot be
    replayed: the state is installed from peers, as after a snapshot install.

    A checkpoint past the log's end (the log lost committed entries: cut at rest) is not used: the
    newest of `older_checkpoints` (applied indices) inside the log is replayed from; with none, the
    global state is installed from peers as of the log's end (every entry up to it is committed,
    since the checkpoint applied past it) and the lost entries come back from the lease holder.

    A checkpoint whose global state was not current when written (`not_current` says why: a stale
    fragment, a download under way; only the one written at stop) is never replayed onto: that
    would claim the state current at its index. The log is replayed from the newest of
    `older_checkpoints` inside it (checkpoints that were current), else the state is installed from
    peers as of the checkpoint's index, else (an uncompacted log) replayed from the initial state.
    Raises ConfigError when nothing works."""
    applied = checkpoint_index or 0
    if applied > log_last_index:
        lost = (f"checkpoint applied through {applied} but the durable log ({log_name}) ends at "
                f"{log_last_index}: it lost committed entries")
        fitting = [c for c in older_checkpoints if snapshot_index <= c <= log_last_index]
        if fitting:
            older = max(fitting)
            return RestartPlan(older, 0, f"{lost}; replay the log from the older checkpoint at index {older} "
                                         f"through {log_last_index}", fallback_checkpoint=older)
        if not has_peers:
            raise ConfigError(f"{lost}, no older checkpoint lies inside it, and there is no peer to recover the "
                              f"state from; restore {log_name}, or remove the data directory and join the run again")
        return RestartPlan(log_last_index, log_last_index,
                           f"{lost}; installing the global state from peers as of index {log_last_index} and "
                           "catching up the log from the lease holder")
    if not_current and applied >= snapshot_index:
        return _restart_past_a_state_not_current(applied, not_current, snapshot_index=snapshot_index,
                                                 log_last_index=log_last_index, has_peers=has_peers,
                                                 older_checkpoints=older_checkpoints)
    if applied >= snapshot_index:
        source = f"the checkpoint at index {applied}" if checkpoint_index is not None else "the initial state"
        return RestartPlan(applied, 0, f"replay the log from {source} through {log_last_index}")
    if not has_peers:
        raise ConfigError(f"the global state is as of index {applied} but the durable log was compacted "
                          f"through {snapshot_index}, and there is no peer to fetch the state from")
    return RestartPlan(snapshot_index, snapshot_index,
                       f"the global state is as of index {applied} but the durable log starts after "
                       f"{snapshot_index}: installing the global state from peers")


def _restart_past_a_state_not_current(applied: int, not_current: str, *, snapshot_index: int, log_last_index: int,
                                      has_peers: bool, older_checkpoints: Sequence[int]) -> RestartPlan:
    """`restart_plan` for a checkpoint inside the log whose global state was not current."""
    why = f"the checkpoint at index {applied} was written while the global state was not current ({not_current})"
    fitting = [c for c in older_checkpoints if snapshot_index <= c <= log_last_index]
    if fitting:
        older = max(fitting)
        return RestartPlan(older, 0, f"{why}; replay the log from the older checkpoint at index {older} through "
                                     f"{log_last_index}", fallback_checkpoint=older)
    if has_peers and applied > 0:
        return RestartPlan(applied, applied, f"{why}; installing the global state from peers as of index {applied}")
    if snapshot_index == 0:
        return RestartPlan(0, 0, f"{why}; replay the log from the initial state through {log_last_index}",
                           initial_state=True)
    raise ConfigError(f"{why}, no older checkpoint lies inside the durable log (compacted through "
                      f"{snapshot_index}), and there is no peer to install the state from")


def learner_to_resume(snapshot: LearnerSnapshot | None, learner_kind: str, node_id: str) -> LearnerSnapshot | None:
    """The checkpointed learner a `learner_kind` learner resumes from, or None to start from the global state.

    A synthetic learner (`[node] learner = "synthetic"`) checkpoints its counters only, no
    weights. A training learner restarted on such a checkpoint has nothing of its own to resume:
    it starts from the global state like a fresh one (nothing is lost: synthetic deltas carry no
    learning). Any learner resumes the counters of a training learner's checkpoint.
    """
    if snapshot is not None and learner_kind != "synthetic" and not snapshot.params:
        log.warning("%s: the checkpoint's learner holds no weights (written by a synthetic learner); "
                    "the %s learner starts from the global state", node_id, learner_kind)
        return None
    return snapshot


class Checkpointer:
    def __init__(self, *, node_id: str, checkpoints: CheckpointStore, store: CoordinationStore, replica: Replica,
                 disk_executor: Executor, retain_entries: int, report_error: Callable[[str], None]) -> None:
        self.node_id = node_id
        self.checkpoints = checkpoints
        self.store = store
        self.replica = replica
        # Checkpoints and compaction write and fsync megabytes: on their own thread, so they never
        # queue the round's merges, encodes and decodes.
        self.disk_executor = disk_executor
        self.retain_entries = retain_entries
        self.report_error = report_error

    def restore(self, persistent: PersistentState, has_peers: bool) -> tuple[RestartPlan, LearnerSnapshot | None]:
        """Global state from our newest good checkpoint, checked against the durable log."""
        snapshot_index = persistent.log.snapshot.last_index
        log_last = snapshot_index + len(persistent.log.entries)
        loaded = self._load_latest()
        learner: LearnerSnapshot | None = None
        if loaded is None:
            plan = restart_plan(checkpoint_index=None, snapshot_index=snapshot_index, log_last_index=log_last,
                                has_peers=has_peers)
        else:
            meta, arrays = loaded.checkpoint.meta, loaded.checkpoint.arrays
            newest = int(meta["applied_index"])
            not_current = checkpoint_not_current(meta)
            # Its learner is resumed whatever its global state was: only the global state is not trusted.
            learner_source = (meta, arrays) if not_current else None
            older: dict[int, Path] = {}
            if newest > log_last:  # log.bin lost entries the checkpoint applied: damage, not a torn append
                self.store.report_lost_entries(log_last, f"checkpoint {loaded.checkpoint.sequence} applied "
                                                         f"through {newest}")
            if newest > log_last or not_current:
                older = self._older_checkpoints(loaded.checkpoint.sequence)
            plan = restart_plan(checkpoint_index=newest, snapshot_index=snapshot_index, log_last_index=log_last,
                                has_peers=has_peers, older_checkpoints=tuple(older),
                                log_name=str(self.store.log_path) if newest > log_last else "log.bin",
                                not_current=not_current)
            if plan.fallback_checkpoint is not None:
                fallback = read_checkpoint_file(older[plan.fallback_checkpoint])
                meta, arrays = fallback.meta, fallback.arrays
                loaded = type(loaded)(fallback, loaded.skipped)
            if plan.initial_state:
                log.info("%s: the global state of checkpoint %s is not restored", self.node_id,
                         loaded.checkpoint.sequence)
            else:
                digest = self._restore_global_state(meta, arrays)
                log.info("%s: resumed from checkpoint %s at index %d digest %s", self.node_id,
                         loaded.checkpoint.sequence, int(meta["applied_index"]), digest)
            learner_meta, learner_arrays = learner_source or (meta, arrays)
            if learner_meta.get("learner"):
                learner = snapshot_from_checkpoint(learner_meta["learner"], learner_arrays)
        self.replica.applied_index = plan.applied_index
        if plan.install_floor or plan.fallback_checkpoint is not None or plan.initial_state:
            log.warning("%s: %s", self.node_id, plan.reason)
        return plan, learner

    def _older_checkpoints(self, newest_sequence: int) -> dict[int, Path]:
        """applied index -> file of each checkpoint older than `newest_sequence` that verifies (streamed)
        and was written while the state was current. Only when the newest cannot be used; one that
        fails its check is skipped."""
        found: dict[int, Path] = {}
        for sequence in self.checkpoints.sequences():
            if sequence >= newest_sequence:
                continue
            path = self.checkpoints.path_for(sequence)
            try:
                meta = verify_checkpoint_file(path)
                if checkpoint_not_current(meta):
                    continue  # its global state is no better than the newest's
                found.setdefault(int(meta["applied_index"]), path)
            except (CheckpointError, KeyError, TypeError, ValueError) as error:
                log.warning("%s: older checkpoint %s not usable: %s", self.node_id, path.name, error)
        return found

    def _load_latest(self) -> Any:
        """The newest good checkpoint. When every one failed its check (all now quarantined, kept
        aside), the node starts as one without checkpoints: the restart rule replays the log from
        the initial state or installs the global state from peers; only the learner's own progress
        since the last global state is lost. Unreadable ones (an I/O error) still stop the start."""
        try:
            return self.checkpoints.load_latest()
        except CheckpointError as error:
            if self.checkpoints.sequences():
                raise  # some could not be read at all: they may be good once the disk is
            message = f"every checkpoint failed its check and was quarantined; starting without one: {error}"
            log.warning("%s: %s", self.node_id, message)
            self.report_error(message)
            return None

    def _restore_global_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
        """The replicated state (norm references included), verified against the checkpoint's digest."""
        return self.replica.restore_checkpoint(meta, arrays)

    async def checkpoint(self, learner: LearnerThread | None, not_current: str = "") -> tuple[Path, int] | None:
        """Local weights, AdamW state, counters, applied index and the global state, atomically.
        Returns (file, applied index), or None when the disk refused the write (reported; the
        previous checkpoints stay as they were). The caller decides whether the state is worth saving;
        `not_current` (why the state is not the run's at its index, the one at stop) is written with
        it, so that a restart never replays onto it (`restart_plan`) and no export reads it."""
        replica = self.replica
        global_meta, arrays = replica.checkpoint_entries()
        meta: dict[str, Any] = {"node_id": self.node_id, "applied_index": replica.applied_index, **global_meta}
        if not_current:
            meta[NOT_CURRENT_KEY] = not_current
        if learner is not None:
            snap = await asyncio.wrap_future(learner.request_state())
            learner_meta, learner_arrays = snapshot_meta_and_arrays(snap)
            meta["learner"] = learner_meta
            arrays.update(learner_arrays)
        loop = asyncio.get_running_loop()
        try:
            path = await loop.run_in_executor(self.disk_executor, self.checkpoints.save, meta, arrays)
        except OSError as error:
            self._write_failed(error)
            return None
        if STORAGE.succeeded("checkpoint.write"):
            log.warning("%s: checkpoints are written again (%s)", self.node_id, path.name)
        log.info("%s checkpoint %s at index %d%s", self.node_id, path.name, meta["applied_index"],
                 f" (global state not current: {not_current})" if not_current else "")
        return path, int(meta["applied_index"])

    def _write_failed(self, error: OSError) -> None:
        """A checkpoint the disk refused: on /status at once, in the log once per failure streak."""
        first = not STORAGE.is_failing("checkpoint.write")
        STORAGE.failed("checkpoint.write", error)
        message = f"checkpoint not written, training goes on and the next one tries again: {error}"
        if first:
            log.warning("%s: %s", self.node_id, message)
        self.report_error(message)

    async def checkpoint_and_compact(self, learner: LearnerThread | None, coordination: CoordinatorNode,
                                     persistent: PersistentState, stopping: Callable[[], bool]) -> None:
        """The periodic job: a checkpoint, then the log compacted below it if it reads back intact."""
        written = await self.checkpoint(learner)
        if written is None:  # nothing new on disk: the log stays as it is
            return
        path, index = written
        try:
            await self.compact_log(coordination, persistent, path, index, stopping)
        except (OSError, CoordinationStoreError) as error:  # e.g. a full disk: keep the long log
            self.report_error(f"log compaction failed, the log stays as it is: {error}")

    async def compact_log(self, coordination: CoordinatorNode, persistent: PersistentState, path: Path,
                          checkpointed: int, stopping: Callable[[], bool]) -> None:
        """Compact the log below a checkpoint once the checkpoint reads back intact.

        The new `log.bin` (snapshot header + the kept committed entries) is written on the disk
        thread while the log keeps growing; the core then drops the prefix and `store.sync` appends
        the entries added meanwhile and renames the file into place (coordination_store.py).
        """
        loop = asyncio.get_running_loop()
        replog = coordination.log
        # Decided first: most checkpoints cut nothing, and those need not read their file back.
        # Never past the log's end: after a damaged record was found it lacks committed entries for a while.
        through, reason = compaction_point(checkpoint_index=checkpointed,
                                           commit_index=min(replog.commit_index, replog.last_index),
                                           snapshot_index=replog.store.snapshot.last_index,
                                           retain=self.retain_entries)
        if through is None:
            log.debug("%s: %s", self.node_id, reason)
            return
        try:
            # Streamed: the check costs a chunk of memory, not a second copy of the state.
            meta = await loop.run_in_executor(self.disk_executor, verify_checkpoint_file, path)
            verified = int(meta["applied_index"])
            STORAGE.succeeded("checkpoint.read")
        except (CheckpointError, KeyError, TypeError, ValueError) as error:
            self.report_error(f"checkpoint {path.name} did not verify; log not compacted: {error}")
            STORAGE.failed("checkpoint.read", str(error))
            if isinstance(error, CheckpointError) and not isinstance(error, CheckpointUnreadable):
                # Written moments ago and already wrong: the disk corrupts. Never a restart's choice.
                self.checkpoints.quarantine(path, str(error))
            return
        if verified != checkpointed:
            self.report_error(f"checkpoint {path.name} holds index {verified}, expected {checkpointed}; "
                              "log not compacted")
            return
        if _log_moved_past(replog, through):
            # A snapshot was installed while the file was read back (a follower resumed after a pause
            # and the holder had compacted past it): the log no longer holds `through`.
            log.info("%s: compaction through %d dropped: the log moved past it (a snapshot was installed "
                     "meanwhile)", self.node_id, through)
            return
        epoch = replog.epoch_at(through)
        assert epoch is not None
        snapshot = Snapshot(through, epoch, replog.config_at(through))
        committed = [e for i in range(through + 1, replog.commit_index + 1) if (e := replog.entry_at(i)) is not None]
        prepared = await loop.run_in_executor(self.disk_executor, self.store.prepare_compaction, snapshot,
                                              committed)
        if stopping() or _log_moved_past(replog, through):
            self.store.discard_prepared()  # stopping, or a snapshot was installed meanwhile
            return
        before = self.store.log_bytes
        coordination.compact(through, b"")
        self.store.sync(persistent, prepared)
        log.info("%s: log %s; log.bin %d -> %d bytes, first index %d", self.node_id, reason, before,
                 self.store.log_bytes, self.store.log_first_index)


def _log_moved_past(replog: ReplicatedLog, through: int) -> bool:
    """Whether a compaction through `through`, decided before an await, no longer fits the log: a
    snapshot installed meanwhile starts the log at or after it (or the applied index is behind it)."""
    return (replog.store.snapshot.last_index >= through or replog.applied_index < through
            or replog.last_index < replog.commit_index)  # entries dropped meanwhile (a damaged record)
