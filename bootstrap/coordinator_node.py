"""One coordination node: membership, election/lease and the replicated log composed behind one API.

The host (the daemon, or the simulation) calls `handle(message, now)` and `tick(now)` and
performs the returned actions in order: persist `persistent` first (it is mutated in place),
then send, apply and restore. It never reads a clock. This module only routes events between
the three state machines and decides membership changes as the lease holder; every protocol
rule lives in election.py, replog.py and membership.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bootstrap.election import Election, ElectionState, LeaseTiming, Role
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot
from bootstrap.membership import Membership, SwimTiming
from bootstrap.messages import (
    Action,
    AppendEntries,
    AppendResponse,
    ApplyEntry,
    InstallSnapshot,
    JoinReply,
    JoinRequest,
    MemberRole,
    MemberState,
    Message,
    Ping,
    PingAck,
    PingRequest,
    RestoreSnapshot,
    Send,
    VoteRequest,
    VoteResponse,
)
from bootstrap.replog import DEFAULT_MAX_ENTRIES_PER_APPEND, LogStore, ReplicatedLog
from wire.errors import LocalProtocolError

# A voter the failure detector has held DEAD this long is removed from the configuration, so a
# site that is gone for good stops counting against the majority. Long enough that a restart or
# a short partition never triggers it; removal is safe anyway and the site is re-added on return.
DEFAULT_REMOVE_DEAD_AFTER_S = 30.0
# A leaving voter waits this long to see its removal committed, then goes anyway (it is then
# simply a dead voter, removed later). Several leases: room for one failover in between.
DEFAULT_LEAVE_TIMEOUT_S = 15.0


@dataclass(slots=True)
class PersistentState:
    """Everything a node must find again after a crash; nothing else survives one."""

    election: ElectionState
    log: LogStore
    incarnation: int = 0  # SWIM incarnation, raised at every start so old rumours lose

    @classmethod
    def founding(cls, voters: list[str]) -> PersistentState:
        """A member of the initial configuration of a brand-new run.

        The founding configuration is entry 1 (epoch 1) on every founder, identical everywhere,
        rather than part of snapshot 0: a joiner replicating from index 1 then learns the whole
        configuration history, and snapshot 0 is the same empty state on every node.
        """
        entry = LogEntry(1, 1, EntryKind.MEMBERSHIP, config=ClusterConfig.of(voters))
        return cls(ElectionState(current_epoch=1), LogStore(Snapshot(0, 0, ClusterConfig()), [entry]))

    @classmethod
    def joining(cls) -> PersistentState:
        """A node that will join an existing run: it knows no configuration until replicated one."""
        return cls(ElectionState(), LogStore(Snapshot(0, 0, ClusterConfig())))


@dataclass(frozen=True, slots=True)
class NodeOptions:
    lease: LeaseTiming = field(default_factory=LeaseTiming)
    swim: SwimTiming = field(default_factory=SwimTiming)
    remove_dead_after_s: float = DEFAULT_REMOVE_DEAD_AFTER_S
    leave_timeout_s: float = DEFAULT_LEAVE_TIMEOUT_S
    manage_membership: bool = True  # the lease holder adds joiners and removes leavers/dead voters
    max_entries_per_append: int = DEFAULT_MAX_ENTRIES_PER_APPEND


class CoordinatorNode:
    # The state machine classes, overridable so the simulation can run deliberately broken
    # variants (bootstrap/simulation/broken.py) and prove its checker catches them.
    election_type: type[Election] = Election
    log_type: type[ReplicatedLog] = ReplicatedLog

    def __init__(
        self,
        node_id: str,
        persistent: PersistentState,
        *,
        now: float,
        rng: random.Random,
        applied_index: int | None = None,
        role: MemberRole = MemberRole.LEARNER,
        address: str = "",
        options: NodeOptions | None = None,
        is_evicted: Callable[[str], bool] = lambda node_id: False,
        vote_floor: tuple[int, int] | None = None,
    ) -> None:
        self.node_id = node_id
        self.options = options or NodeOptions()
        self.persistent = persistent
        persistent.incarnation += 1
        self.election = self.election_type(node_id, persistent.election, self.options.lease, rng, now)
        # The host found its log lacking entries it may have acknowledged (election.py, vote_floor).
        self.election.vote_floor = vote_floor
        applied = persistent.log.snapshot.last_index if applied_index is None else applied_index
        self.log = self.log_type(node_id, persistent.log, applied, self.options.max_entries_per_append)
        self.election.lift_vote_floor(self.log.last_log)
        self.membership = Membership(node_id, address, role, persistent.incarnation, rng, now, self.options.swim)
        self._next_heartbeat_at = now
        self._learned_config: ClusterConfig | None = None
        self.leaving = False
        self.leave_started_at = 0.0
        self.left = False
        self.last_membership_reason = ""
        # Sites evicted from this run (the host's replicated register, applied from EVICTION
        # entries): removed from the configuration, never added back, never replicated to.
        self.is_evicted = is_evicted

    # ------------------------------------------------------------ queries

    @property
    def epoch(self) -> int:
        return self.election.epoch

    @property
    def role(self) -> Role:
        return self.election.role

    def is_lease_holder(self, now: float) -> bool:
        return self.election.lease_active(now)

    def status(self, now: float) -> dict[str, Any]:
        """Status-page view: what we are, and the reasons behind our last decisions."""
        return {
            "node": self.node_id,
            "role": self.role.value,
            "epoch": self.epoch,
            "lease_holder": self.election.leader_id,
            "lease_active": self.is_lease_holder(now),
            "lease_remaining_s": (self.election.lease_until - now) if self.is_lease_holder(now) else 0.0,
            "commit_index": self.log.commit_index,
            "applied_index": self.log.applied_index,
            "last_index": self.log.last_index,
            "voters": self.log.config.sorted_voters(),
            "members": {n: r.state.value for n, r in sorted(self.membership.members.items())},
            "reasons": {
                "vote": self.election.last_vote_reason,
                "step_down": self.election.last_step_down_reason,
                "lease": self.election.last_lease_reason,
                "commit": self.log.last_commit_reason,
                "membership": self.last_membership_reason,
                "failure_detector": self.membership.last_reason,
            },
        }

    # ------------------------------------------------------------ operator events

    def start_join(self, bootstrap_peers: list[str], now: float) -> list[Action]:
        return list(self.membership.start_join(bootstrap_peers, now))

    def leave(self, now: float) -> list[Action]:
        """Graceful leave: announce it; the lease holder removes us; `left` turns True once committed."""
        self.leaving = True
        self.leave_started_at = now
        actions: list[Action] = list(self.membership.leave(now))
        self._check_left(now)
        return actions

    def compact(self, through_index: int, state: bytes) -> Snapshot:
        return self.log.compact(through_index, state)

    def lose_entries(self, from_index: int, now: float, vote_floor: tuple[int, int] | None) -> int:
        """The log lost its entries from `from_index` on while running (a damaged record): it
        cannot serve them, so it steps down; it may have acknowledged them, so it votes only above
        `vote_floor` (the newest entry it held; None: the caller refuses every vote) and does not
        stand until its log is back there. Returns how many entries were dropped."""
        self.election.step_down(now, f"its log lost the entries from {from_index}")
        current = self.election.vote_floor
        if vote_floor is not None and (current is None or vote_floor > current):
            self.election.vote_floor = vote_floor
        dropped = self.log.forget_from(from_index)
        self.election.lift_vote_floor(self.log.last_log)
        return dropped

    def propose(
        self,
        now: float,
        kind: EntryKind,
        payload: bytes = b"",
        *,
        fragment: int | None = None,
        round: int | None = None,
        digest: str = "",
    ) -> tuple[LogEntry | None, str, list[Action]]:
        """Append an entry as the lease holder. Returns (entry or None, reason, actions)."""
        if kind is EntryKind.MEMBERSHIP:
            raise LocalProtocolError("use propose_config_change for membership entries")
        if not self.is_lease_holder(now):
            return None, f"not the lease holder (role {self.role.value}, epoch {self.epoch})", []
        entry = self.log.append_local(self.epoch, kind, payload, fragment=fragment, round=round, digest=digest)
        return entry, f"appended {entry.describe()}", self._after_local_append(now)

    def propose_config_change(
        self, now: float, *, add: str | None = None, remove: str | None = None
    ) -> tuple[LogEntry | None, str, list[Action]]:
        """One voter added or removed, as a log entry, only when the previous change is committed."""
        if (add is None) == (remove is None):
            raise LocalProtocolError("give exactly one of add= or remove=")
        if not self.is_lease_holder(now):
            return None, "not the lease holder", []
        pending = self.log.latest_config_index()
        if pending > self.log.commit_index:
            return None, f"configuration change at index {pending} not committed yet", []
        if self.log.epoch_at(self.log.commit_index) != self.epoch:
            # Raft's fix for single-server changes: a new leader commits in its own epoch first.
            return None, f"no entry of epoch {self.epoch} committed yet", []
        voters = set(self.log.config.voters)
        if add is not None:
            if add in voters:
                return None, f"{add} already votes", []
            voters.add(add)
        else:
            if remove not in voters:
                return None, f"{remove} is not a voter", []
            if len(voters) == 1:
                return None, f"cannot remove the last voter {remove}", []
            voters.discard(remove)
        config = ClusterConfig.of(voters)
        entry = self.log.append_local(self.epoch, EntryKind.MEMBERSHIP, config=config)
        self.last_membership_reason = f"proposed {entry.describe()}"
        return entry, self.last_membership_reason, self._after_local_append(now)

    # ------------------------------------------------------------ messages

    def handle(self, message: Message, now: float) -> list[Action]:
        actions: list[Action] = []
        if isinstance(message, VoteRequest):
            response = self.election.handle_vote_request(message, now, self.log.last_log)
            if response is not None:
                actions.append(Send(message.candidate_id, response))
        elif isinstance(message, VoteResponse):
            became_leader, requests = self.election.handle_vote_response(
                message, now, self.log.config, self.log.last_log)
            actions += self._ask_voters(requests)
            if became_leader:
                actions += self._on_elected(now)
        elif isinstance(message, AppendEntries):
            actions += self._on_append(message, now)
        elif isinstance(message, InstallSnapshot):
            actions += self._on_snapshot(message, now)
        elif isinstance(message, AppendResponse):
            actions += self._on_append_response(message, now)
        elif isinstance(message, (JoinRequest, JoinReply, Ping, PingAck, PingRequest)):
            actions += self.membership.handle(message, now)
        else:
            raise LocalProtocolError(f"unknown message type {type(message).__name__}")
        if self.election.vote_floor is not None:
            self.election.lift_vote_floor(self.log.last_log)
        actions += self._drain_applies()
        return actions

    def _on_append(self, message: AppendEntries, now: float) -> list[Action]:
        accepted, reason = self.election.accept_leader(message.epoch, message.leader_id, now)
        if not accepted:
            return [Send(message.leader_id, AppendResponse(self.epoch, self.node_id, False, 0, message.sent_at, reason))]
        outcome = self.log.handle_append(message)
        response = AppendResponse(self.epoch, self.node_id, outcome.success, outcome.match_index, message.sent_at, outcome.reason)
        return [Send(message.leader_id, response)]

    def _on_snapshot(self, message: InstallSnapshot, now: float) -> list[Action]:
        accepted, reason = self.election.accept_leader(message.epoch, message.leader_id, now)
        if not accepted:
            return [Send(message.leader_id, AppendResponse(self.epoch, self.node_id, False, 0, message.sent_at, reason))]
        actions: list[Action] = []
        restored, reason = self.log.install_snapshot(message.snapshot)
        if restored:
            actions.append(RestoreSnapshot(message.snapshot))
        response = AppendResponse(self.epoch, self.node_id, True, message.snapshot.last_index, message.sent_at, reason)
        actions.append(Send(message.leader_id, response))
        return actions

    def _on_append_response(self, message: AppendResponse, now: float) -> list[Action]:
        if self.election.observe_epoch(message.epoch, now, message.follower_id):
            return []
        if self.role is not Role.LEADER or message.epoch != self.epoch:
            return []
        config = self.log.config
        self.election.record_renewal(message.follower_id, message.epoch, message.sent_at, now, config)
        more = self.log.handle_append_response(message.follower_id, message.success, message.match_index)
        actions: list[Action] = []
        if message.success:
            self._advance_commit(now)
        if more and self.role is Role.LEADER:
            sent = self.log.replication_message(message.follower_id, self.epoch, self.node_id, now)
            actions.append(Send(message.follower_id, sent))
        return actions

    # ------------------------------------------------------------ time

    def tick(self, now: float) -> list[Action]:
        config = self.log.config
        if config is not self._learned_config:  # founding voters know each other without a join
            for voter in config.sorted_voters():
                self.membership.learn(voter, now)
            self._learned_config = config
        actions: list[Action] = list(self.membership.tick(now))
        if self.role is Role.LEADER:
            self.election.refresh_lease(now, self.log.config)
            if not self.election.check_lease(now) and now >= self._next_heartbeat_at:
                self._next_heartbeat_at = now + self.options.lease.heartbeat_interval_s
                actions += self._replicate_to_all(now)
            if self.role is Role.LEADER and self.options.manage_membership:
                actions += self._manage_membership(now)
        else:  # a leaving voter may still lead: it may be needed to commit its own removal
            requests = self.election.campaign_if_due(now, self.log.config, self.log.last_log)
            actions += self._ask_voters(requests)
            if self.role is Role.LEADER:  # a configuration of one elects itself at once
                actions += self._on_elected(now)
        actions += self._drain_applies()
        self._check_left(now)
        return actions

    # ------------------------------------------------------------ leader internals

    def _ask_voters(self, requests: list[VoteRequest]) -> list[Action]:
        voters = [v for v in self.log.config.sorted_voters() if v != self.node_id]
        return [Send(voter, request) for request in requests for voter in voters]

    def _replication_targets(self, now: float) -> list[str]:
        """Voters, live members catching up before they are added, and recent leavers.

        A leaver keeps receiving heartbeats for `leave_timeout_s`, so it learns that its
        removal committed and can stop at once.
        """
        targets = set(self.log.config.voters)
        for node_id, record in self.membership.members.items():
            if record.state is MemberState.ALIVE or (
                record.state is MemberState.LEFT
                and now - self.membership.changed_at[node_id] < self.options.leave_timeout_s
            ):
                targets.add(node_id)
        targets.discard(self.node_id)
        return sorted(t for t in targets if not self.is_evicted(t))

    def _replicate_to_all(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for peer in self._replication_targets(now):
            self.log.track_peer(peer)
            actions.append(Send(peer, self.log.replication_message(peer, self.epoch, self.node_id, now)))
        return actions

    def _on_elected(self, now: float) -> list[Action]:
        self.log.reset_progress(self._replication_targets(now))
        # A no-op of our own epoch lets us commit (and so learn) everything earlier leaders left.
        self.log.append_local(self.epoch, EntryKind.NOOP)
        self.election.refresh_lease(now, self.log.config)
        self._next_heartbeat_at = now + self.options.lease.heartbeat_interval_s
        self._advance_commit(now)
        return self._replicate_to_all(now)

    def _after_local_append(self, now: float) -> list[Action]:
        self._advance_commit(now)  # a configuration of one commits on its own
        actions = self._replicate_to_all(now) if self.role is Role.LEADER else []
        return actions + self._drain_applies()

    def _advance_commit(self, now: float) -> None:
        if self.log.advance_commit(self.log.config, self.epoch):
            committed = self.log.committed_config
            if self.node_id not in committed.voters:
                self.election.step_down(now, f"removed from the configuration at commit {self.log.commit_index}")

    def _manage_membership(self, now: float) -> list[Action]:
        """As lease holder: remove leavers and long-dead voters, add caught-up joiners."""
        if not self.is_lease_holder(now):
            return []
        voters = self.log.config.voters
        change: tuple[str, str] | None = None
        if self.leaving and self.node_id in voters:
            change = ("remove", self.node_id)
        for node_id in sorted(voters):
            if change:
                break
            record = self.membership.record(node_id)
            if node_id != self.node_id and self.is_evicted(node_id):
                change = ("remove", node_id)
                break
            if record is None or node_id == self.node_id:
                continue
            if record.state is MemberState.LEFT:
                change = ("remove", node_id)
            elif (record.state is MemberState.DEAD
                  and now - self.membership.changed_at[node_id] >= self.options.remove_dead_after_s):
                change = ("remove", node_id)
        if change is None:
            for node_id in self.membership.alive_ids():
                record = self.membership.record(node_id)
                if (node_id not in voters and record is not None and record.state is MemberState.ALIVE
                        and not self.is_evicted(node_id)
                        and self.log.match_index.get(node_id, 0) >= self.log.commit_index):
                    change = ("add", node_id)
                    break
        if change is None:
            return []
        kind, node_id = change
        if kind == "add":
            entry, reason, actions = self.propose_config_change(now, add=node_id)
        else:
            entry, reason, actions = self.propose_config_change(now, remove=node_id)
        if entry is None:
            self.last_membership_reason = f"wanted to {kind} {node_id}, waiting: {reason}"
        return actions

    # ------------------------------------------------------------ apply

    def _drain_applies(self) -> list[Action]:
        return [ApplyEntry(entry) for entry in self.log.take_committed()]

    def _check_left(self, now: float) -> None:
        if not self.leaving or self.left:
            return
        if self.node_id not in self.log.committed_config.voters:
            self.left = True
            self.last_membership_reason = "left: our removal is committed"
        elif now - self.leave_started_at >= self.options.leave_timeout_s:
            self.left = True
            self.last_membership_reason = f"left without a committed removal after {self.options.leave_timeout_s:.0f}s"
