"""Safety invariants of the coordination protocol, checked by the simulation after every event.

The checker is told what each node did (applied, restored, committed, accepted an append) and
looks at the nodes' state; it keeps the "truth" (the first committed entry seen at each index)
and reports every disagreement as a human-readable violation string.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bootstrap.coordinator_node import CoordinatorNode
from bootstrap.election import Role
from bootstrap.entries import ClusterConfig, LogEntry, Snapshot, majorities_can_be_disjoint


def entry_identity(entry: LogEntry) -> bytes:
    """What "the same entry" means: every field that the application could observe."""
    config = entry.config.describe() if entry.config is not None else ""
    header = f"{entry.epoch}|{entry.index}|{entry.kind.value}|{entry.fragment}|{entry.round}|{entry.digest}|{config}|"
    return header.encode() + entry.payload_bytes()


def chain_digest(previous: bytes, entry: LogEntry) -> bytes:
    """The simulated application's state: a hash chain over everything applied, in order."""
    return hashlib.blake2b(previous + entry_identity(entry), digest_size=16).digest()


@dataclass(slots=True)
class InvariantChecker:
    violations: list[str] = field(default_factory=list)
    truth: dict[int, bytes] = field(default_factory=dict)  # index -> identity of the committed entry
    truth_digest: dict[int, bytes] = field(default_factory=lambda: {0: b""})
    truth_configs: dict[int, ClusterConfig] = field(default_factory=dict)
    applied: dict[str, int] = field(default_factory=dict)  # durable per node, across restarts
    max_epoch: dict[str, int] = field(default_factory=dict)
    leader_of_epoch: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.truth_configs[0] = ClusterConfig()  # snapshot 0: empty; founders' config is entry 1

    def _fail(self, time: float, message: str) -> None:
        self.violations.append(f"t={time:.3f}s {message}")

    # ------------------------------------------------------------ committed entries

    def on_commit_advance(self, time: float, node: CoordinatorNode, old_commit: int) -> None:
        """Every newly committed index must hold the same entry on every node, forever."""
        for index in range(old_commit + 1, node.log.commit_index + 1):
            entry = node.log.entry_at(index)
            if entry is None:
                continue  # covered by a snapshot, checked at restore
            identity = entry_identity(entry)
            known = self.truth.get(index)
            if known is None:
                self.truth[index] = identity
                if entry.config is not None:
                    self._check_config_step(time, index, entry.config)
            elif known != identity:
                self._fail(time, f"{node.node_id} committed {entry.describe()} but index {index} was committed differently")

    def _check_config_step(self, time: float, index: int, config: ClusterConfig) -> None:
        previous_index = max(i for i in self.truth_configs if i < index)
        previous = self.truth_configs[previous_index]
        if not previous.voters:
            self.truth_configs[index] = config  # the founding configuration
            return
        changed = previous.voters ^ config.voters
        if len(changed) > 1:
            self._fail(time, f"committed config at {index} {config.describe()} changes {len(changed)} voters of {previous.describe()}")
        if majorities_can_be_disjoint(previous, config):
            self._fail(time, f"committed configs {previous.describe()} and {config.describe()} admit disjoint majorities")
        self.truth_configs[index] = config

    def latest_committed_config(self) -> ClusterConfig:
        return self.truth_configs[max(self.truth_configs)]

    def on_apply(self, time: float, node_id: str, entry: LogEntry, digest_after: bytes) -> None:
        expected = self.applied.get(node_id, 0) + 1
        if entry.index != expected:
            self._fail(time, f"{node_id} applied index {entry.index}, expected {expected} (gap or repeat)")
        self.applied[node_id] = entry.index
        identity = entry_identity(entry)
        known = self.truth.setdefault(entry.index, identity)
        if known != identity:
            self._fail(time, f"{node_id} applied {entry.describe()} but index {entry.index} was committed differently")
        known_digest = self.truth_digest.setdefault(entry.index, digest_after)
        if known_digest != digest_after:
            self._fail(time, f"{node_id} state after {entry.index} differs from other replicas")

    def state_installed(self, node_id: str, index: int) -> None:
        """`node_id`'s application was replaced by the run's state as of `index` (a restart whose log
        lost entries it had applied); its applies go on from there."""
        self.applied[node_id] = index

    def on_restore(self, time: float, node_id: str, snapshot: Snapshot) -> None:
        applied = self.applied.get(node_id, 0)
        if snapshot.last_index <= applied:
            self._fail(time, f"{node_id} restored snapshot {snapshot.last_index} at or behind applied {applied}")
        known = self.truth_digest.get(snapshot.last_index)
        if known is not None and known != snapshot.state:
            self._fail(time, f"{node_id} restored a snapshot at {snapshot.last_index} unlike the committed state")
        self.applied[node_id] = snapshot.last_index

    # ------------------------------------------------------------ epochs and leases

    def on_append_accepted(self, time: float, node_id: str, message_epoch: int, epoch_before: int) -> None:
        if message_epoch < epoch_before:
            self._fail(time, f"{node_id} accepted entries stamped epoch {message_epoch} after seeing epoch {epoch_before}")

    def after_event(
        self,
        time: float,
        node: CoordinatorNode,
        leaders: Iterable[CoordinatorNode],
        local_time_of: Callable[[str], float],
    ) -> None:
        epoch = node.epoch
        previous = self.max_epoch.get(node.node_id, 0)
        if epoch < previous:
            self._fail(time, f"{node.node_id} epoch went back from {previous} to {epoch}")
        self.max_epoch[node.node_id] = epoch
        if node.role is Role.LEADER:
            holder = self.leader_of_epoch.setdefault(epoch, node.node_id)
            if holder != node.node_id:
                self._fail(time, f"two lease holders in epoch {epoch}: {holder} and {node.node_id}")
        active = [n for n in leaders if n.is_lease_holder(local_time_of(n.node_id))]
        if len(active) > 1:
            names = ", ".join(f"{n.node_id}@e{n.epoch}" for n in active)
            self._fail(time, f"{len(active)} active lease holders at once: {names}")
        for leader in leaders:
            # Single-server changes: the configuration a leader uses is one voter away from the
            # one before it in its log, which was committed before the change was proposed.
            config_index = leader.log.latest_config_index()
            before = leader.log.config_at(config_index - 1)
            if config_index >= leader.log.first_index and before.voters:
                config = leader.log.config
                if len(before.voters ^ config.voters) > 1 or majorities_can_be_disjoint(before, config):
                    self._fail(time, f"leader {leader.node_id} moved from {before.describe()} to "
                                     f"{config.describe()} in one step: majorities may be disjoint")
