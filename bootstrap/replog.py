"""The replicated log of one node: storage, follower and leader replication, commit, apply, compaction.

Entries are appended by the lease holder, persisted and acknowledged by followers, committed
once a majority of the voting configuration holds them (counting only entries of the leader's
own epoch, Raft's rule), and handed to the application strictly in index order exactly once.
Uncommitted conflicting entries are truncated; committed ones never are. The configuration in
effect is the newest membership entry in the log, committed or not (single-server changes).
No I/O, no clock: the caller passes epochs and times in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot
from bootstrap.messages import AppendEntries, InstallSnapshot
from wire.errors import LocalProtocolError, RemoteProtocolError

# Entries per AppendEntries: bounds one message (payloads are merged gradients, possibly MBs).
DEFAULT_MAX_ENTRIES_PER_APPEND = 16


@dataclass(slots=True)
class LogStore:
    """The part of the log that must survive a crash: the snapshot and the entries after it."""

    snapshot: Snapshot
    entries: list[LogEntry] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class AppendOutcome:
    success: bool
    match_index: int  # on success the last matching index; on failure a hint to back off to
    reason: str


def majority_commit_index(
    *,
    config: ClusterConfig,
    self_id: str,
    self_last_index: int,
    match_index: Mapping[str, int],
    commit_index: int,
    current_epoch: int,
    epoch_at: Callable[[int], int | None],
) -> tuple[int, str]:
    """Pure commit rule: the highest index a majority holds, if it was written in our epoch.

    Entries of older epochs are committed only indirectly, by a later entry of ours (Raft 5.4.2):
    a majority holding an old entry does not stop a newer leader from overwriting it.
    """
    held = sorted(
        (self_last_index if voter == self_id else match_index.get(voter, 0)) for voter in config.voters
    )
    held.reverse()
    if len(held) < config.quorum or not held:
        return commit_index, f"no majority possible in {config.describe()}"
    majority_index = held[config.quorum - 1]
    if majority_index <= commit_index:
        return commit_index, f"majority holds only up to {majority_index}"
    if epoch_at(majority_index) != current_epoch:
        return commit_index, f"entry {majority_index} is from an older epoch; waiting for one of epoch {current_epoch}"
    return majority_index, f"entry {majority_index} held by {config.quorum} of {len(config.voters)} voters"


class ReplicatedLog:
    """Log state machine. Leader-side progress (next/match) is volatile and reset on each win."""

    def __init__(
        self,
        node_id: str,
        store: LogStore,
        applied_index: int,
        max_entries_per_append: int = DEFAULT_MAX_ENTRIES_PER_APPEND,
    ) -> None:
        if applied_index < store.snapshot.last_index:
            raise LocalProtocolError(
                f"application applied through {applied_index} but the snapshot covers "
                f"{store.snapshot.last_index}: restore the snapshot into the application first"
            )
        self.node_id = node_id
        self.store = store
        self.max_entries_per_append = max_entries_per_append
        # Anything the application applied was committed, hence it is in our log or snapshot.
        if applied_index > self.last_index:
            raise LocalProtocolError(f"application applied {applied_index} beyond our last index {self.last_index}")
        self.commit_index = applied_index
        self.applied_index = applied_index
        self.next_index: dict[str, int] = {}
        self.match_index: dict[str, int] = {}
        self.last_commit_reason = ""
        self._config_cache: tuple[tuple[int, int, int], ClusterConfig] | None = None

    # ------------------------------------------------------------ reading

    @property
    def first_index(self) -> int:
        return self.store.snapshot.last_index + 1

    @property
    def last_index(self) -> int:
        return self.store.snapshot.last_index + len(self.store.entries)

    @property
    def last_epoch(self) -> int:
        return self.store.entries[-1].epoch if self.store.entries else self.store.snapshot.last_epoch

    @property
    def last_log(self) -> tuple[int, int]:
        return self.last_epoch, self.last_index

    def entry_at(self, index: int) -> LogEntry | None:
        offset = index - self.first_index
        if 0 <= offset < len(self.store.entries):
            return self.store.entries[offset]
        return None

    def epoch_at(self, index: int) -> int | None:
        if index == self.store.snapshot.last_index:
            return self.store.snapshot.last_epoch
        entry = self.entry_at(index)
        return entry.epoch if entry is not None else None

    def config_at(self, index: int) -> ClusterConfig:
        """The configuration in effect after `index`: the newest membership entry at or before it."""
        for offset in range(min(index, self.last_index) - self.first_index, -1, -1):
            entry = self.store.entries[offset]
            if entry.config is not None:
                return entry.config
        return self.store.snapshot.config

    @property
    def config(self) -> ClusterConfig:
        # Cached: asked on every event. Same last (index, epoch) means the same log (log matching).
        key = (self.last_index, self.last_epoch, self.store.snapshot.last_index)
        if self._config_cache is None or self._config_cache[0] != key:
            self._config_cache = (key, self.config_at(self.last_index))
        return self._config_cache[1]

    @property
    def committed_config(self) -> ClusterConfig:
        return self.config_at(self.commit_index)

    def latest_config_index(self) -> int:
        for offset in range(len(self.store.entries) - 1, -1, -1):
            if self.store.entries[offset].config is not None:
                return self.store.entries[offset].index
        return self.store.snapshot.last_index

    # ------------------------------------------------------------ follower side

    def handle_append(self, message: AppendEntries) -> AppendOutcome:
        """Check consistency at prev, truncate conflicts (never committed ones), append, commit."""
        snapshot = self.store.snapshot
        prev_index, prev_epoch = message.prev_index, message.prev_epoch
        entries = message.entries
        last_new_index = message.prev_index + len(message.entries)
        if prev_index < snapshot.last_index:
            # Everything through our snapshot is committed, and a leader holds every committed entry.
            skip = snapshot.last_index - prev_index
            entries = entries[skip:]
            prev_index, prev_epoch = snapshot.last_index, snapshot.last_epoch
        elif prev_index > self.last_index:
            return AppendOutcome(False, self.last_index, f"missing entries: prev {prev_index} beyond our last {self.last_index}")
        elif self.epoch_at(prev_index) != prev_epoch:
            return AppendOutcome(False, self._conflict_hint(prev_index), f"entry {prev_index} epoch {self.epoch_at(prev_index)} != leader's {prev_epoch}")
        for entry in entries:
            existing_epoch = self.epoch_at(entry.index)
            if existing_epoch == entry.epoch:
                continue  # log matching: same index and epoch means same entry and same prefix
            if existing_epoch is not None:
                if entry.index <= self.commit_index:
                    raise RemoteProtocolError(
                        f"leader {message.leader_id} tried to overwrite committed entry {entry.index}", 409
                    )
                del self.store.entries[entry.index - self.first_index :]
            self.store.entries.append(entry)
        new_commit = min(message.leader_commit, last_new_index)
        if new_commit > self.commit_index:
            self.commit_index = new_commit
            self.last_commit_reason = f"leader {message.leader_id} committed through {message.leader_commit}"
        return AppendOutcome(True, last_new_index, f"appended through {last_new_index}")

    def forget_from(self, index: int) -> int:
        """Drop the entries from `index` on, committed ones included: their bytes were lost (a
        damaged record found at run time). Returns how many were dropped.

        The commit and applied indices stay where they are, above the log's end for a while: the
        application holds what it applied, so nothing is applied twice; the entries come back by a
        leader's appends (or a snapshot covering them, `install_snapshot`), and applying resumes
        after `applied_index` once the commit index passes it again. Whoever calls this must not
        lead, nor vote below what the log held (the caller's vote floor)."""
        if index <= self.store.snapshot.last_index:
            raise LocalProtocolError(f"cannot forget from {index}: the snapshot covers {self.store.snapshot.last_index}")
        dropped = max(0, self.last_index - index + 1)
        del self.store.entries[index - self.first_index:]
        self.next_index.clear()
        self.match_index.clear()
        return dropped

    def _conflict_hint(self, prev_index: int) -> int:
        """Back off past the whole conflicting epoch at once, but never below what is committed."""
        floor = max(self.commit_index, self.store.snapshot.last_index)
        conflicting_epoch = self.epoch_at(prev_index)
        index = min(prev_index, self.last_index)
        while index - 1 > floor and self.epoch_at(index - 1) == conflicting_epoch:
            index -= 1
        return max(floor, index - 1)

    def install_snapshot(self, snapshot: Snapshot) -> tuple[bool, str]:
        """Adopt a leader's snapshot if it is ahead of what we committed. True if the app must restore.

        A log that lost committed entries its application already applied (`forget_from`) adopts a
        snapshot covering them as its new start without a restore: the application holds that
        state already, and the entries after it come back by appends."""
        if snapshot.last_index <= self.commit_index:
            if snapshot.last_index > self.last_index and snapshot.last_index <= self.applied_index:
                self.store.snapshot = snapshot
                self.store.entries.clear()
                return False, (f"adopted snapshot through {snapshot.last_index} as the log's start: the log lost "
                               f"entries the application holds (applied through {self.applied_index})")
            if snapshot.last_index <= self.last_index:
                return False, f"snapshot through {snapshot.last_index} is not ahead of our commit {self.commit_index}"
            # Lost entries the application has not applied either: only the snapshot holds them now.
        if self.epoch_at(snapshot.last_index) == snapshot.last_epoch:
            kept = [entry for entry in self.store.entries if entry.index > snapshot.last_index]
        else:
            kept = []
        self.store.snapshot = snapshot
        self.store.entries[:] = kept
        self.commit_index = snapshot.last_index
        self.applied_index = snapshot.last_index
        self.last_commit_reason = f"installed snapshot through {snapshot.last_index}"
        return True, self.last_commit_reason

    # ------------------------------------------------------------ leader side

    def reset_progress(self, peers: list[str]) -> None:
        self.next_index = {peer: self.last_index + 1 for peer in peers}
        self.match_index = {peer: 0 for peer in peers}

    def track_peer(self, peer: str) -> None:
        if peer not in self.next_index:
            self.next_index[peer] = self.last_index + 1
            self.match_index[peer] = 0

    def append_local(
        self,
        epoch: int,
        kind: EntryKind,
        payload: bytes = b"",
        *,
        fragment: int | None = None,
        round: int | None = None,
        digest: str = "",
        config: ClusterConfig | None = None,
    ) -> LogEntry:
        entry = LogEntry(epoch, self.last_index + 1, kind, payload, fragment, round, digest, config)
        self.store.entries.append(entry)
        return entry

    def replication_message(self, peer: str, epoch: int, leader_id: str, sent_at: float) -> AppendEntries | InstallSnapshot:
        next_index = self.next_index.get(peer, self.last_index + 1)
        if next_index <= self.store.snapshot.last_index:
            return InstallSnapshot(epoch, leader_id, self.store.snapshot, sent_at)
        next_index = min(next_index, self.last_index + 1)
        prev_index = next_index - 1
        prev_epoch = self.epoch_at(prev_index)
        assert prev_epoch is not None, "prev is the snapshot point or inside the log"
        start = next_index - self.first_index
        entries = tuple(self.store.entries[start : start + self.max_entries_per_append])
        return AppendEntries(epoch, leader_id, prev_index, prev_epoch, entries, self.commit_index, sent_at)

    def without_acknowledged(self, message: AppendEntries, peer: str) -> AppendEntries:
        """`message` (built earlier for `peer`, same epoch) less the entries `peer` acknowledged since.

        An append waits in a queue while the previous one to that peer is in flight; when the
        previous one's acknowledgement covers its entries, sending them again would cost their
        payloads once more for nothing. What is left starts after the last acknowledged entry,
        which the follower holds with that epoch (it said so), so the consistency check passes
        exactly as for a message built now; the commit index is the current one (only committed
        entries are counted there, so a later figure is as safe as the one built in).
        """
        acknowledged = self.match_index.get(peer, 0)
        if not message.entries or message.entries[0].index > acknowledged:
            return message
        kept = tuple(entry for entry in message.entries if entry.index > acknowledged)
        last_dropped = message.entries[len(message.entries) - len(kept) - 1]
        return replace(message, prev_index=last_dropped.index, prev_epoch=last_dropped.epoch, entries=kept,
                       leader_commit=max(message.leader_commit, self.commit_index))

    def handle_append_response(self, peer: str, success: bool, match_index: int) -> bool:
        """Update a follower's progress; True when it still lacks entries (send again now)."""
        if peer not in self.next_index:
            return False
        if success:
            if match_index > self.match_index[peer]:
                self.match_index[peer] = match_index
            self.next_index[peer] = max(self.next_index[peer], self.match_index[peer] + 1)
            return self.next_index[peer] <= self.last_index
        if match_index < self.match_index[peer]:
            # The follower holds less than it once acknowledged: its log was cut at rest (it says
            # so and will not vote until it has caught up). Believe it, so the missing entries go
            # out now rather than after the next compaction forces a snapshot. Lowering a match
            # index only makes the commit rule more conservative, and a stale rejection costs at
            # most a resend of entries the follower already has (it accepts them unchanged).
            self.match_index[peer] = match_index
        backed_off = min(self.next_index[peer], match_index + 1)
        self.next_index[peer] = max(self.match_index[peer] + 1, backed_off)
        return True

    def advance_commit(self, config: ClusterConfig, current_epoch: int) -> bool:
        new_commit, reason = majority_commit_index(
            config=config,
            self_id=self.node_id,
            self_last_index=self.last_index,
            match_index=self.match_index,
            commit_index=self.commit_index,
            current_epoch=current_epoch,
            epoch_at=self.epoch_at,
        )
        self.last_commit_reason = reason
        if new_commit > self.commit_index:
            self.commit_index = new_commit
            return True
        return False

    # ------------------------------------------------------------ apply and compaction

    def take_committed(self) -> list[LogEntry]:
        """Entries newly committed since the last call, in index order; each is returned once."""
        ready = []
        while self.applied_index < self.commit_index:
            entry = self.entry_at(self.applied_index + 1)
            assert entry is not None, "committed entries are in the log until applied and compacted"
            ready.append(entry)
            self.applied_index += 1
        return ready

    def compact(self, through_index: int, state: bytes) -> Snapshot:
        """Replace entries through `through_index` (applied) with a snapshot of the applied state."""
        if through_index > self.applied_index:
            raise LocalProtocolError(f"cannot compact through {through_index}: only {self.applied_index} applied")
        if through_index <= self.store.snapshot.last_index:
            return self.store.snapshot
        if through_index > self.last_index:
            raise LocalProtocolError(f"cannot compact through {through_index}: the log ends at {self.last_index}")
        epoch = self.epoch_at(through_index)
        assert epoch is not None
        snapshot = Snapshot(through_index, epoch, self.config_at(through_index), state)
        del self.store.entries[: through_index - self.first_index + 1]
        self.store.snapshot = snapshot
        return snapshot
