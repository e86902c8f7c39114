"""Epochs, votes and the coordinator lease: every election and lease transition of one node.

Raft-shaped: epochs only grow, one vote per epoch, a vote only for a candidate whose log is at
least as up to date as ours, and only when no live lease holder has been heard within the lease
time on our own monotonic clock. The lease holder renews through heartbeats acknowledged by a
majority and dates each renewal by its *own* send time, shortened for the worst clock drift.
See docs/COORDINATION.md for the safety argument. No I/O, no clock reads: `now` comes in.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping
from dataclasses import dataclass

from bootstrap.entries import ClusterConfig
from bootstrap.messages import VoteRequest, VoteResponse
from wire.errors import LocalProtocolError

# Default lease: long enough that 5-6 heartbeats (one every 0.5 s) fit in one lease, so a couple of
# lost WAN packets never drop it; short against an outer step (minutes), so failover is cheap.
DEFAULT_LEASE_S = 3.0
DEFAULT_HEARTBEAT_INTERVAL_S = 0.5
# Bound on any clock's rate error against real time. Quartz is ~1e-4; 1 % covers NTP slewing,
# throttled VMs and suspended containers with room to spare, and costs only 2 % of the lease.
DEFAULT_MAX_DRIFT_RATE = 0.01
# Subtracted from the leader's lease to absorb scheduling delay between deciding and acting.
DEFAULT_SAFETY_MARGIN_S = 0.1
# Random extra wait before campaigning so that followers rarely split the vote.
DEFAULT_ELECTION_JITTER_S = 1.0
# How long a candidate waits for votes before trying again with a higher epoch.
DEFAULT_CANDIDATE_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    lease_s: float = DEFAULT_LEASE_S
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    max_drift_rate: float = DEFAULT_MAX_DRIFT_RATE
    safety_margin_s: float = DEFAULT_SAFETY_MARGIN_S
    election_jitter_s: float = DEFAULT_ELECTION_JITTER_S
    candidate_timeout_s: float = DEFAULT_CANDIDATE_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_drift_rate < 0.5:
            raise LocalProtocolError(f"max_drift_rate must be in [0, 0.5), got {self.max_drift_rate}")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_interval_s * 2 > self.leader_lease_span_s:
            raise LocalProtocolError(
                f"heartbeat interval {self.heartbeat_interval_s}s must be > 0 and fit twice in the "
                f"leader's lease span {self.leader_lease_span_s:.3f}s"
            )
        if self.election_jitter_s < 0 or self.candidate_timeout_s <= 0:
            raise LocalProtocolError("election jitter must be >= 0 and candidate timeout > 0")

    @property
    def leader_lease_span_s(self) -> float:
        """How long after a renewal's send time the holder may act, on its own clock.

        A follower's promise lasts `lease_s` on its clock, at least lease_s/(1+rho) real seconds.
        The holder's span S on its clock lasts at most S/(1-rho) real seconds. S <= lease_s *
        (1-rho)/(1+rho) makes the holder stop first; the margin absorbs reaction delay.
        """
        rho = self.max_drift_rate
        return self.lease_s * (1.0 - rho) / (1.0 + rho) - self.safety_margin_s


class Role(str, enum.Enum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    LEADER = "leader"


@dataclass(slots=True)
class ElectionState:
    """The part of election state that must survive a crash (persist before replying)."""

    current_epoch: int = 0
    voted_for: str | None = None


@dataclass(frozen=True, slots=True)
class VoteDecision:
    granted: bool
    adopt_epoch: bool  # whether the request's epoch should become ours (never when lease-refused)
    reason: str
    silent: bool = False  # refused for a live lease: answer nothing, so the epoch does not leak


def decide_vote(
    request: VoteRequest,
    *,
    current_epoch: int,
    voted_for: str | None,
    our_last_log: tuple[int, int],
    heard_leader_at: float | None,
    leader_id: str | None,
    now: float,
    lease_s: float,
    vote_floor: tuple[int, int] | None = None,
) -> VoteDecision:
    """Pure vote decision: grant only if every safety rule allows it, and say why not otherwise.

    `vote_floor` (epoch, index), set while this node's log lacks entries it may have acknowledged
    (damage at rest): no entry it acknowledged is past it, so a candidate whose log is at least
    as up to date as the floor holds every one of them that was committed (the up-to-date rule,
    applied to the log this node had rather than the one it has)."""
    if request.epoch < current_epoch:
        return VoteDecision(False, False, f"stale epoch {request.epoch} < our epoch {current_epoch}")
    if heard_leader_at is not None and now - heard_leader_at < lease_s:
        # Refuse without adopting the epoch (Raft thesis 4.2.3): a live lease must not be
        # disturbed by a candidate that merely could not hear the holder.
        return VoteDecision(
            False,
            False,
            f"lease holder {leader_id} heard {now - heard_leader_at:.2f}s ago, within the {lease_s:.2f}s lease",
            silent=True,
        )
    adopt = request.epoch > current_epoch
    if not adopt and voted_for not in (None, request.candidate_id):
        return VoteDecision(False, False, f"already voted for {voted_for} in epoch {current_epoch}")
    candidate_last = (request.last_log_epoch, request.last_log_index)
    if candidate_last < our_last_log:
        return VoteDecision(
            False,
            adopt,
            f"candidate log (epoch {candidate_last[0]}, index {candidate_last[1]}) is behind ours "
            f"(epoch {our_last_log[0]}, index {our_last_log[1]})",
        )
    if vote_floor is not None and candidate_last < vote_floor:
        return VoteDecision(
            False,
            adopt,
            f"candidate log (epoch {candidate_last[0]}, index {candidate_last[1]}) is behind what this node may "
            f"have acknowledged before its log lost entries (epoch {vote_floor[0]}, index {vote_floor[1]})",
        )
    return VoteDecision(True, adopt, f"granted to {request.candidate_id} for epoch {request.epoch}")


def lease_expiry(
    *,
    config: ClusterConfig,
    self_id: str,
    now: float,
    renewal_sent_at: Mapping[str, float],
    span_s: float,
) -> tuple[float | None, str]:
    """Pure lease computation: the latest instant (own clock) a majority vouches for, and why.

    Each voter's newest acknowledged heartbeat send time counts; our own vote counts as `now`.
    The lease runs `span_s` past the send time that the slowest member of the best majority acked.
    """
    times = sorted(
        (now if voter == self_id else renewal_sent_at[voter])
        for voter in config.voters
        if voter == self_id or voter in renewal_sent_at
    )
    times.reverse()
    if len(times) < config.quorum:
        return None, f"renewals from {len(times)} of {len(config.voters)} voters, need {config.quorum}"
    oldest_in_majority = times[config.quorum - 1]
    return oldest_in_majority + span_s, f"renewed by {config.quorum} of {len(config.voters)} voters"


class Election:
    """One node's election and lease state machine. The coordinator node feeds it events."""

    def __init__(
        self, node_id: str, state: ElectionState, timing: LeaseTiming, rng: random.Random, now: float
    ) -> None:
        self.node_id = node_id
        self.state = state
        self.timing = timing
        self._rng = rng
        self.role = Role.FOLLOWER
        self.leader_id: str | None = None
        # After a (re)start we cannot know whom we promised what: behave as if a lease holder
        # was heard just now, so no promise given before the crash can be broken.
        self.heard_leader_at: float | None = now
        self.election_deadline = now + timing.lease_s + self._jitter()
        self.votes: set[str] = set()
        self.pre_votes: set[str] | None = None  # set while a pre-vote round is open
        self.won_at: float | None = None
        self.renewal_sent_at: dict[str, float] = {}
        self.lease_until: float | None = None
        self.last_vote_reason = ""
        self.last_step_down_reason = ""
        self.last_lease_reason = ""
        # (epoch, index) no entry this node acknowledged is past, while its log lacks some of them
        # (lost at rest): it votes only for candidates at least this up to date, and does not
        # stand itself (its own log is behind what it promised). None: its log is whole.
        self.vote_floor: tuple[int, int] | None = None

    # ------------------------------------------------------------ queries

    @property
    def epoch(self) -> int:
        return self.state.current_epoch

    def lease_active(self, now: float) -> bool:
        return self.role is Role.LEADER and self.lease_until is not None and now < self.lease_until

    def may_act_as_leader(self, now: float) -> bool:
        """Whether a message this node produced as leader may still leave it at `now`.

        True while it leads and its lease has not run out, counting the span right after winning
        (before the first acknowledgements arrive). A message queued earlier and sent later, e.g.
        after the process was paused, must not go out once this is False: a follower that receives
        it renews its promise to the old holder and refuses every candidate for another lease time.
        """
        if self.role is not Role.LEADER:
            return False
        if self.lease_until is None:
            return self.won_at is not None and now < self.won_at + self.timing.leader_lease_span_s
        return now < self.lease_until

    def _jitter(self) -> float:
        return self._rng.uniform(0.0, self.timing.election_jitter_s)

    # ------------------------------------------------------------ transitions

    def observe_epoch(self, epoch: int, now: float, source: str) -> bool:
        """Adopt a higher epoch seen anywhere; step down if we led or campaigned. True if adopted."""
        if epoch <= self.state.current_epoch:
            return False
        if self.role is not Role.FOLLOWER:
            self._step_down(now, f"saw higher epoch {epoch} from {source}")
        self.state.current_epoch = epoch
        self.state.voted_for = None
        self.leader_id = None
        return True

    def handle_vote_request(
        self, request: VoteRequest, now: float, our_last_log: tuple[int, int]
    ) -> VoteResponse | None:
        """Decide a vote (or pre-vote). None when refused for a live lease (silence: no epoch leak).

        A pre-vote answers "would you vote for me in this epoch?" with the same rules and
        changes nothing here, so a node cut off for a while cannot raise everyone's epoch.
        """
        heard_at = now if self.role is Role.LEADER else self.heard_leader_at
        decision = decide_vote(
            request,
            current_epoch=self.state.current_epoch,
            voted_for=self.state.voted_for,
            our_last_log=our_last_log,
            heard_leader_at=heard_at,
            leader_id=self.leader_id if self.role is not Role.LEADER else self.node_id,
            now=now,
            lease_s=self.timing.lease_s,
            vote_floor=self.vote_floor,
        )
        kind = "pre-vote" if request.pre_vote else "vote"
        self.last_vote_reason = f"{kind} for {request.candidate_id} epoch {request.epoch}: {decision.reason}"
        if request.pre_vote:
            if decision.silent:
                return None
            epoch = request.epoch if decision.granted else self.state.current_epoch
            return VoteResponse(epoch, self.node_id, decision.granted, decision.reason, pre_vote=True)
        if decision.adopt_epoch:
            self.observe_epoch(request.epoch, now, request.candidate_id)
        if decision.granted:
            self.state.voted_for = request.candidate_id
            # Give the candidate time to win before we campaign ourselves.
            self.election_deadline = now + self.timing.candidate_timeout_s + self._jitter()
        if decision.silent:
            return None
        return VoteResponse(self.state.current_epoch, self.node_id, decision.granted, decision.reason)

    def campaign_if_due(self, now: float, config: ClusterConfig, last_log: tuple[int, int]) -> list[VoteRequest]:
        """When our wait is over, open a pre-vote round for epoch + 1; else nothing."""
        if self.role is Role.LEADER or now < self.election_deadline:
            return []
        if self.node_id not in config.voters:
            self.election_deadline = now + self.timing.lease_s
            return []
        if self.vote_floor is not None:
            self.election_deadline = now + self.timing.lease_s
            self.last_vote_reason = (f"not standing: its log is behind what it may have acknowledged "
                                     f"(epoch {self.vote_floor[0]}, index {self.vote_floor[1]})")
            return []
        if self.heard_leader_at is not None and now - self.heard_leader_at < self.timing.lease_s:
            self.election_deadline = self.heard_leader_at + self.timing.lease_s + self._jitter()
            return []
        if self.role is Role.CANDIDATE:
            self.role = Role.FOLLOWER  # the round failed: start over from a pre-vote
        self.pre_votes = {self.node_id}
        self.election_deadline = now + self.timing.candidate_timeout_s + self._jitter()
        if config.is_majority(self.pre_votes):
            return self._campaign(now, config, last_log)
        self.last_vote_reason = f"pre-vote for epoch {self.state.current_epoch + 1}"
        return [VoteRequest(self.state.current_epoch + 1, self.node_id, last_log[0], last_log[1], pre_vote=True)]

    def _campaign(self, now: float, config: ClusterConfig, last_log: tuple[int, int]) -> list[VoteRequest]:
        """Start a real election: epoch + 1, vote for ourselves, ask the others."""
        self.pre_votes = None
        self.role = Role.CANDIDATE
        self.leader_id = None
        self.state.current_epoch += 1
        self.state.voted_for = self.node_id
        self.votes = {self.node_id}
        self.election_deadline = now + self.timing.candidate_timeout_s + self._jitter()
        self.last_vote_reason = f"campaigning for epoch {self.state.current_epoch}"
        if config.is_majority(self.votes):
            self._become_leader(now)
            return []
        return [VoteRequest(self.state.current_epoch, self.node_id, last_log[0], last_log[1])]

    def handle_vote_response(
        self, response: VoteResponse, now: float, config: ClusterConfig, last_log: tuple[int, int]
    ) -> tuple[bool, list[VoteRequest]]:
        """Count a (pre-)vote. Returns (just became leader, vote requests to send now)."""
        if response.pre_vote and response.granted:
            # A granted pre-vote carries the hypothetical epoch, never adopted.
            if self.pre_votes is None or response.epoch != self.state.current_epoch + 1:
                return False, []
            self.pre_votes.add(response.voter_id)
            if not config.is_majority(self.pre_votes):
                return False, []
            requests = self._campaign(now, config, last_log)
            return self.role is Role.LEADER, requests
        if self.observe_epoch(response.epoch, now, response.voter_id):
            return False, []
        if response.pre_vote or self.role is not Role.CANDIDATE or response.epoch != self.state.current_epoch:
            return False, []
        if not response.granted:
            return False, []
        self.votes.add(response.voter_id)
        if config.is_majority(self.votes):
            self._become_leader(now)
            return True, []
        return False, []

    def _become_leader(self, now: float) -> None:
        self.role = Role.LEADER
        self.leader_id = self.node_id
        self.won_at = now
        self.renewal_sent_at = {}
        self.lease_until = None
        self.last_lease_reason = f"won epoch {self.state.current_epoch} with votes {sorted(self.votes)}"

    def accept_leader(self, epoch: int, leader_id: str, now: float) -> tuple[bool, str]:
        """A leader's message arrived: follow it unless its epoch is stale."""
        if epoch < self.state.current_epoch:
            return False, f"stale epoch {epoch} < our epoch {self.state.current_epoch}"
        self.observe_epoch(epoch, now, leader_id)
        if self.role is Role.LEADER:
            # Two leaders in one epoch would need two majorities of votes: impossible unless broken.
            raise LocalProtocolError(f"{leader_id} claims epoch {epoch}, which we lead")
        if self.role is Role.CANDIDATE:
            self._step_down(now, f"{leader_id} won epoch {epoch}")
        self.pre_votes = None
        self.leader_id = leader_id
        self.heard_leader_at = now
        self.election_deadline = now + self.timing.lease_s + self._jitter()
        return True, f"following {leader_id} in epoch {epoch}"

    def record_renewal(self, peer: str, epoch: int, sent_at: float, now: float, config: ClusterConfig) -> None:
        """A follower acknowledged our heartbeat sent at `sent_at` (our clock): extend the lease."""
        if self.role is not Role.LEADER or epoch != self.state.current_epoch:
            return
        if sent_at > self.renewal_sent_at.get(peer, float("-inf")):
            self.renewal_sent_at[peer] = sent_at
        self.refresh_lease(now, config)

    def refresh_lease(self, now: float, config: ClusterConfig) -> None:
        until, reason = lease_expiry(
            config=config,
            self_id=self.node_id,
            now=now,
            renewal_sent_at=self.renewal_sent_at,
            span_s=self.timing.leader_lease_span_s,
        )
        self.lease_until = until
        self.last_lease_reason = reason

    def check_lease(self, now: float) -> bool:
        """Step down when the lease has run out; True if we just did."""
        if self.role is not Role.LEADER:
            return False
        if self.lease_until is None:
            assert self.won_at is not None
            if now >= self.won_at + self.timing.leader_lease_span_s:
                self._step_down(now, f"no majority acknowledged us within the lease after winning ({self.last_lease_reason})")
                return True
            return False
        if now >= self.lease_until:
            self._step_down(now, f"lease expired: lost contact with a majority ({self._renewal_ages(now)})")
            return True
        return False

    def _renewal_ages(self, now: float) -> str:
        """Operator-facing: how old each voter's newest acknowledged heartbeat is (send times)."""
        if not self.renewal_sent_at:
            return "no voter acknowledged any heartbeat"
        ages = ", ".join(f"{peer} {now - sent:.1f}s ago" for peer, sent in sorted(self.renewal_sent_at.items()))
        return f"newest acknowledged heartbeats: {ages}; a lease needs a majority within {self.timing.leader_lease_span_s:.2f}s"

    def lift_vote_floor(self, last_log: tuple[int, int]) -> bool:
        """The floor is redundant once our own log is at least as up to date (the up-to-date rule
        then refuses everything it would): lift it. A leader's later truncation of our log only
        replaces entries with ones of a higher epoch, so our log never falls below it again."""
        if self.vote_floor is None or last_log < self.vote_floor:
            return False
        self.vote_floor = None
        return True

    def step_down(self, now: float, reason: str) -> None:
        if self.role is not Role.FOLLOWER:
            self._step_down(now, reason)

    def _step_down(self, now: float, reason: str) -> None:
        self.role = Role.FOLLOWER
        self.leader_id = None
        self.votes = set()
        self.pre_votes = None
        self.lease_until = None
        self.won_at = None
        self.last_step_down_reason = reason
        self.election_deadline = now + self.timing.candidate_timeout_s + self._jitter()
