"""Deliberately broken protocol variants, by name, to prove the invariant checker can fail.

Each variant breaks exactly one safety rule of the real state machines. They exist for tests
and for `benchmarks/coordination.py --broken NAME`; nothing in production imports them.
"""

from __future__ import annotations

from bootstrap.coordinator_node import CoordinatorNode
from bootstrap.election import Election, Role, lease_expiry
from bootstrap.entries import ClusterConfig
from bootstrap.messages import VoteRequest, VoteResponse
from bootstrap.replog import ReplicatedLog


class _VoteWithoutLogCheck(Election):
    def handle_vote_request(self, request: VoteRequest, now: float, our_last_log: tuple[int, int]) -> VoteResponse | None:
        return super().handle_vote_request(request, now, (0, 0))  # every candidate looks up to date


class _VoteIgnoringLease(Election):
    def handle_vote_request(self, request: VoteRequest, now: float, our_last_log: tuple[int, int]) -> VoteResponse | None:
        if self.role is Role.LEADER:
            return super().handle_vote_request(request, now, our_last_log)
        self.heard_leader_at = None  # forget the live lease holder we promised to wait for
        return super().handle_vote_request(request, now, our_last_log)


class _VoteBelowMark(Election):
    def handle_vote_request(self, request: VoteRequest, now: float, our_last_log: tuple[int, int]) -> VoteResponse | None:
        floor, self.vote_floor = self.vote_floor, None  # votes by the log it has, not the one it had
        try:
            return super().handle_vote_request(request, now, our_last_log)
        finally:
            self.vote_floor = floor


class _CommitWithoutMajority(ReplicatedLog):
    def advance_commit(self, config: ClusterConfig, current_epoch: int) -> bool:
        if self.last_index > self.commit_index:
            self.commit_index = self.last_index  # the leader's own copy is "enough"
            return True
        return False


class _ReapplyAfterLoss(ReplicatedLog):
    def forget_from(self, index: int) -> int:
        dropped = super().forget_from(index)
        # Counts the lost entries as never applied: they are applied again when they come back.
        self.commit_index = self.applied_index = min(self.applied_index, self.last_index)
        return dropped


class _LeaseIgnoringDrift(Election):
    def refresh_lease(self, now: float, config: ClusterConfig) -> None:
        until, reason = lease_expiry(config=config, self_id=self.node_id, now=now,
                                     renewal_sent_at=self.renewal_sent_at, span_s=self.timing.lease_s)
        self.lease_until, self.last_lease_reason = until, reason  # the full lease, no drift allowance


class VoteWithoutLogCheck(CoordinatorNode):
    election_type = _VoteWithoutLogCheck


class VoteIgnoringLease(CoordinatorNode):
    election_type = _VoteIgnoringLease


class VoteBelowMark(CoordinatorNode):
    election_type = _VoteBelowMark


class CommitWithoutMajority(CoordinatorNode):
    log_type = _CommitWithoutMajority


class LeaseIgnoringDrift(CoordinatorNode):
    election_type = _LeaseIgnoringDrift


class ReapplyAfterLoss(CoordinatorNode):
    log_type = _ReapplyAfterLoss


BROKEN_VARIANTS: dict[str, type[CoordinatorNode]] = {
    "vote_without_log_check": VoteWithoutLogCheck,
    "vote_ignoring_lease": VoteIgnoringLease,
    "commit_without_majority": CommitWithoutMajority,
    # Unsafe only after a log lost entries at rest: run with SimConfig(log_damage=True).
    "vote_below_mark": VoteBelowMark,
    # Applies entries its log lost while running a second time: also only with log_damage.
    "reapply_after_loss": ReapplyAfterLoss,
    # Subtle: unsafe only when clocks drift apart during a narrow window, shorter than an
    # election round trip at a 1 % bound; a directed 20 %-drift scenario test catches it.
    "lease_ignoring_drift": LeaseIgnoringDrift,
}

# Broken host behaviour, as settings of the simulation (bootstrap/simulation/harness.py, SimConfig):
# the node's state machines are the real ones, the host around them breaks a storage rule.
BROKEN_SIM_SETTINGS: dict[str, dict[str, object]] = {
    # Sends votes and append acknowledgements before fsyncing what they promise, and syncs once
    # per tick: a crash in between loses a granted vote or an acknowledged entry.
    "ack_before_fsync": {"fsync_before_ack": False},
    # Repairs a stale fragment from any peer, even one that has not applied the entry the fragment
    # is stale since, and calls the state current at once: the entry's apply is skipped for good.
    "repair_below_floor": {"repair_floor": False},
}
