"""The daemon's history recorder: turns what the node did into `history.jsonl` events (docs/CHAOS.md).

The composition root owns one `DaemonHistory` and calls it at its choke points; the sans-IO
coordination core stays clock-free and unaware of it. Rather than interpreting each action, the
recorder *observes* the coordinator after every call into it (after the durable state was synced,
so an event never claims more than the node will remember) and writes what changed:

- `lease_lost` when the node stops being the leader (step-down, newer epoch), then
- `vote` when it promised its vote to another candidate in its current epoch,
- `lease_acquired` when it became the leader of its epoch, with `index` = its last log index
  before it won (the entries of its own epoch, i.e. its no-op, are not counted),
- `append` for every log entry that is new at an index (first write or a rewrite after a
  truncation), `commit` once per index when the commit index passes it.

Applies, learner steps and the lifecycle (`start`, `leave`, `stop`) are reported directly by the
node. Every event carries the node's *current* epoch. Thread-safe where the writer is: `learner_step`
runs in the learner thread, everything else on the event loop.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from bootstrap.coordinator_node import CoordinatorNode
from bootstrap.election import Role
from bootstrap.entries import EntryKind, LogEntry, PayloadUnavailable
from diloco_node.clock import SystemClock
from diloco_node.ops.history import HISTORY_FILE_NAME, UNREADABLE_ENTRY, FsyncPolicy, HistoryWriter
from diloco_node.sync.replica import CommitPayload
from wire import digest as content_digest
from wire.errors import RemoteProtocolError

# A synchronous learner (quorum K > 1: a merge waits for peers) may run this many sync periods
# H (plus the overlap tau) past the last global fragment it adopted: one period of its own work
# and one while the merge of its contribution is in flight (DiLoCo's overlap). Steps beyond that
# are steps a blocking synchronous learner would have spent waiting at the fragment barrier for
# a missing peer, so they are reported as unproductive. Decoupled learners (K = 1) never wait.
SYNC_BARRIER_PERIODS = 2
# A learner step's productive time is the wall time since the previous step ended (the learner
# thread only trains: boundary work and the pacing sleep of a slower device are part of it), but
# at most this many times its own duration, so a pause (a SIGSTOP, a stopped process) is not
# counted as training.
MAX_STEP_GAP_FACTOR = 2.0


def entry_digest(entry: LogEntry) -> str | None:
    """Identity of a log entry: BLAKE3 (wire/digest.py, like every content digest) over everything a
    replica can observe of it, each field length-prefixed so different splits of the same bytes
    cannot collide. None when its payload cannot be read back now (a failing disk): the event then
    names no entry rather than one that no other node holds."""
    h = content_digest.hasher(b"diloco-log-entry\0")

    def field(data: bytes) -> None:
        h.update(struct.pack("<Q", len(data)))
        h.update(data)

    field(str(entry.epoch).encode())
    field(str(entry.index).encode())
    field(entry.kind.value.encode())
    field(b"" if entry.fragment is None else str(entry.fragment).encode())
    field(b"" if entry.round is None else str(entry.round).encode())
    field(entry.digest.encode())
    field(b"" if entry.config is None else ",".join(entry.config.sorted_voters()).encode())
    try:
        field(entry.payload_bytes())
    except PayloadUnavailable:  # unreadable now: recorded as unknown, not invented
        return None
    return h.hexdigest()


def commit_contributors(entry: LogEntry) -> list[str]:
    """The learners merged into an outer-step commit (empty for other entries or a bad payload)."""
    if entry.kind is not EntryKind.OUTER_COMMIT:
        return []
    try:
        return list(CommitPayload.decode(entry.payload_bytes()).contributors)
    except (RemoteProtocolError, PayloadUnavailable):
        return []  # the replica refuses it at apply time and says why; the history stays honest


class ReplicaView(Protocol):
    """What the recorder reads of the replica after an apply (diloco_node.sync.replica.Replica)."""

    applied_index: int
    diverged: set[int]

    @property
    def state(self) -> Any: ...


class SyncSettings(Protocol):
    """The run's sync settings the recorder needs (run_config's sync section)."""

    @property
    def min_quorum(self) -> int: ...
    @property
    def period(self) -> int: ...
    @property
    def overlap(self) -> int: ...


class LearnerView(Protocol):
    """What the recorder reads of the learner in its own thread (learner_thread.LearnerThread)."""

    step_seconds: float
    c_steps: list[int]


class DaemonHistory:
    """One node's history recorder. `observe(coordinator)` after every call into the core."""

    def __init__(
        self,
        writer: HistoryWriter,
        *,
        pace_s: float = 0.0,
        barrier_steps: int | None = None,
        mono_clock: Callable[[], float] = SystemClock().monotonic,
    ) -> None:
        """`pace_s`: the learner's minimum step interval (a stand-in for a slower device, so it
        counts as training time); `barrier_steps`: see SYNC_BARRIER_PERIODS (None: decoupled)."""
        self.writer = writer
        self.node_id = writer.node
        self.pace_s = pace_s
        self.barrier_steps = barrier_steps
        self._epoch = 0
        self._role = Role.FOLLOWER
        self._vote: tuple[int, str | None] = (0, None)
        self._led_epochs: set[int] = set()
        self._uncommitted: dict[int, LogEntry] = {}  # index -> entry already reported as appended
        self._commit_recorded = 0
        self._digests: dict[int, tuple[LogEntry, str]] = {}  # index -> (entry, digest), small cache
        self._next_apply_is_snapshot = False
        self._last_tokens: int | None = None
        self._mono = mono_clock
        self._last_step_end: float | None = None
        self.started = False
        self._closed = False  # a learner thread outliving the node's shutdown records nothing

    @classmethod
    def open(cls, data_dir: str | os.PathLike[str], node_id: str, *, fsync: FsyncPolicy = "critical",
             pace_s: float = 0.0, barrier_steps: int | None = None,
             mono_clock: Callable[[], float] = SystemClock().monotonic,
             wall_clock: Callable[[], float] = SystemClock().wall) -> DaemonHistory:
        """The recorder writing `<data_dir>/history.jsonl`; steps are timed on `mono_clock`, read
        in the learner's thread. `t_wall` comes from `wall_clock` (the process's wall time, skewed
        in a chaos run's clock jump), `t_mono` from the host's monotonic clock."""
        writer = HistoryWriter(Path(data_dir) / HISTORY_FILE_NAME, node_id, fsync=fsync, wall_clock=wall_clock)
        return cls(writer, pace_s=pace_s, barrier_steps=barrier_steps, mono_clock=mono_clock)

    @staticmethod
    def barrier_for(sync: SyncSettings) -> int | None:
        """The synchronous barrier in steps for a run's sync settings (None when decoupled)."""
        return SYNC_BARRIER_PERIODS * sync.period + sync.overlap if sync.min_quorum > 1 else None

    # ------------------------------------------------------------------ lifecycle

    def start(self, coordinator: CoordinatorNode, applied_index: int, sync: SyncSettings | None = None) -> None:
        """Process up, checkpoint loaded: record `start` and take the coordinator as the baseline
        (entries already in the durable log were reported by an earlier life). `sync`: the run's
        sync settings, which say whether learners are synchronous (see SYNC_BARRIER_PERIODS)."""
        if sync is not None:
            self.barrier_steps = self.barrier_for(sync)
        log = coordinator.log
        self._epoch = coordinator.epoch
        self._role = coordinator.role
        self._vote = (coordinator.epoch, coordinator.election.state.voted_for)
        self._commit_recorded = log.commit_index
        self._uncommitted = {i: e for i in range(log.commit_index + 1, log.last_index + 1)
                             if (e := log.entry_at(i)) is not None}
        self.started = True
        self.writer.record("start", epoch=coordinator.epoch, index=applied_index, detail={"pid": os.getpid()})

    def leave(self, coordinator: CoordinatorNode, reason: str) -> None:
        self.writer.record("leave", epoch=coordinator.epoch, detail={"reason": reason})

    def stop(self, coordinator: CoordinatorNode | None, applied_index: int) -> None:
        self.writer.record("stop", epoch=coordinator.epoch if coordinator else None, index=applied_index)

    def close(self) -> None:
        self._closed = True
        self.writer.close()

    # ------------------------------------------------------------------ coordination

    def observe(self, coordinator: CoordinatorNode) -> None:
        """Record what changed in the coordinator since the last call (after `store.sync`)."""
        if not self.started:
            return
        epoch, role, election = coordinator.epoch, coordinator.role, coordinator.election
        if self._role is Role.LEADER and (role is not Role.LEADER or epoch != self._epoch):
            self.writer.record("lease_lost", epoch=epoch, detail={
                "reason": election.last_step_down_reason or f"epoch {epoch} began",
                "holder": election.leader_id if election.leader_id != self.node_id else None,
                "led_epoch": self._epoch})
        vote = (epoch, election.state.voted_for)
        if vote != self._vote and vote[1] not in (None, self.node_id):
            self.writer.record("vote", epoch=epoch, detail={"for": vote[1]})
        self._vote = vote
        if role is Role.LEADER and epoch not in self._led_epochs:
            self._led_epochs.add(epoch)
            self.writer.record("lease_acquired", epoch=epoch, index=self._last_index_before(coordinator, epoch),
                               detail={"votes": sorted(election.votes)})
        self._epoch, self._role = epoch, role
        self._record_appends(coordinator)
        self._record_commits(coordinator)

    @staticmethod
    def _last_index_before(coordinator: CoordinatorNode, epoch: int) -> int:
        """The leader's last log index when it won: a candidate holds no entry of the epoch it
        campaigns for, so everything of `epoch` in its log was appended since (its no-op)."""
        log = coordinator.log
        index = log.last_index
        while index >= log.first_index:
            entry = log.entry_at(index)
            if entry is None or entry.epoch < epoch:
                break
            index -= 1
        return index

    def _record_appends(self, coordinator: CoordinatorNode) -> None:
        log = coordinator.log
        epoch = coordinator.epoch
        for index in range(max(self._commit_recorded + 1, log.first_index), log.last_index + 1):
            entry = log.entry_at(index)
            if entry is None or self._uncommitted.get(index) is entry:
                continue
            self._uncommitted[index] = entry
            self.writer.record("append", epoch=epoch, index=index, entry_digest=self._digest(entry),
                               fragment=entry.fragment, round=entry.round,
                               detail={"entry_epoch": entry.epoch, "entry_kind": entry.kind.value})
        for index in [i for i in self._uncommitted if i > log.last_index]:
            del self._uncommitted[index]  # truncated by a newer leader

    def _record_commits(self, coordinator: CoordinatorNode) -> None:
        log = coordinator.log
        epoch = coordinator.epoch
        while self._commit_recorded < log.commit_index:
            index = self._commit_recorded + 1
            self._commit_recorded = index
            self._uncommitted.pop(index, None)
            entry = log.entry_at(index)
            if entry is None:  # covered by an installed snapshot: the entry itself is not here
                continue
            detail: dict[str, Any] = {"entry_epoch": entry.epoch, "entry_kind": entry.kind.value}
            if entry.kind is EntryKind.OUTER_COMMIT:
                detail["contributors"] = commit_contributors(entry)
            self.writer.record("commit", epoch=epoch, index=index, entry_digest=self._digest(entry),
                               fragment=entry.fragment, round=entry.round, detail=detail)

    def _digest(self, entry: LogEntry) -> str:
        cached = self._digests.get(entry.index)
        if cached is not None and cached[0] is entry:
            return cached[1]
        digest = entry_digest(entry)
        if digest is None:
            return UNREADABLE_ENTRY  # not cached: read again at the next event, once the disk answers
        self._digests[entry.index] = (entry, digest)
        if len(self._digests) > 256:  # only the recent tail is ever looked up again
            for index in sorted(self._digests)[:128]:
                del self._digests[index]
        return digest

    # ------------------------------------------------------------------ applies

    def state_replaced(self) -> None:
        """The global state was replaced by a download (snapshot install): the next apply recorded
        says `snapshot: true`, since the state jumped rather than followed the previous apply."""
        self._next_apply_is_snapshot = True

    def applied(self, entry: LogEntry, replica: ReplicaView, consistent_from: int, epoch: int,
                current: bool = True) -> None:
        """After `replica.apply(entry)`. Nothing is recorded while the replica is not one
        consistent state (`current` False, the state keeper's verdict): a joiner replaying the log
        below the newest index its download was served at, or a fragment stale since an entry
        could not be applied to it, until a copy that includes that entry is installed. The first
        apply after such a stretch is marked `snapshot` (the state jumped by a download, not by
        applies)."""
        if not current or replica.applied_index < consistent_from or replica.diverged:
            self._next_apply_is_snapshot = True
            return
        state = replica.state
        detail: dict[str, Any] = {"finite": bool(state.is_finite()), "entry_epoch": entry.epoch,
                                  "entry_kind": entry.kind.value}
        if self._next_apply_is_snapshot:
            detail["snapshot"] = True
            self._next_apply_is_snapshot = False
        self.writer.record("apply", epoch=epoch, index=entry.index, entry_digest=self._digest(entry),
                           state_digest=state.digest(), fragment=entry.fragment, round=entry.round, detail=detail)

    # ------------------------------------------------------------------ learner (its own thread)

    def evaluated(self, index: int, loss: float | None, seconds: float, set_name: str = "held_out") -> None:
        """The global model as of commit `index` evaluated on one of this site's held-out sets: the
        slice of its training data ("held_out") or an eval set by name; one event per set."""
        if self._closed:
            return
        self.writer.record("eval", index=index, detail={"loss": loss, "seconds": seconds, "set": set_name})

    def learner_step(self, step: int, loss: float, tokens: int, learner: LearnerView | None,
                     figures: Mapping[str, float | None] | None = None) -> None:
        """One learner step done; the writer batches these into about one event per second.
        `figures`: a step window closed at this step (learn/figures.py: tokens_per_s, step_time_s,
        mfu, grad_norm, lr); the step event that covers it carries them (unknown ones left out)."""
        if self._closed:
            return
        previous, self._last_tokens = self._last_tokens, tokens
        new_tokens = max(0, tokens - previous) if previous is not None else 0
        now = self._mono()
        previous_end, self._last_step_end = self._last_step_end, now
        nominal = max(learner.step_seconds if learner is not None else 0.0, self.pace_s)
        seconds = nominal if previous_end is None else min(now - previous_end, MAX_STEP_GAP_FACTOR * nominal)
        waiting = self.barrier_steps is not None and learner is not None and self._past_barrier(learner.c_steps)
        extra: dict[str, Any] = {"learner_step": step}
        if loss == loss and abs(loss) != float("inf"):  # JSON has no NaN; a non-finite loss is left out
            extra["loss"] = loss
        for name, value in (figures or {}).items():
            if value is not None and math.isfinite(value):
                extra[name] = value
        self.writer.step(1, new_tokens, 0.0 if waiting else seconds, **extra)

    def _past_barrier(self, c_steps: Sequence[int]) -> bool:
        assert self.barrier_steps is not None
        return max(c_steps, default=0) > self.barrier_steps
