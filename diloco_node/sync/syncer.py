"""The lease holder's syncer: collect contributions per fragment, decide with quorum + grace, merge.

Mirrors `runner._FragmentSync` (the in-process reference) on a real clock: a round of fragment p
opens at its first contribution, `quorum.decide_round` says merge now or wake at a time, and
`merge.merge_contributions` rebases, validates, weighs and merges. The merged outer gradient is
encoded with codec_down and decoded back here, so the bits proposed in the log entry are the
bits every replica (this one included) applies.

No I/O and no clock: the node passes `now` and runs `merge_round` in its thread pool.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from diloco_node.sync.global_state import GlobalState
from diloco_node.sync.merge import Contribution, ContributionCaps, MergeResult, NormReference, merge_contributions
from diloco_node.sync.quorum import Ema, QuorumPolicy, RoundDecision, TimingEstimates, decide_round
from diloco_node.config.manifest import RunManifest
from wire.codecs import decode_named, encode_named


@dataclass(slots=True)
class OpenRound:
    opened_at: float
    pending: dict[str, tuple[Contribution, float]] = field(default_factory=dict)  # learner -> (c, arrived)


@dataclass(frozen=True, slots=True)
class MergedRound:
    """A merge ready to be proposed (outer_gradient None: nothing acceptable, nothing to commit)."""

    fragment: int
    round: int  # the round the fragment reaches once this commits
    result: MergeResult
    encoded: bytes
    outer_gradient: dict[str, np.ndarray] | None
    decision_reason: str
    norm_ref: float | None = None  # the fragment's reference norm after this round (replicated)


@dataclass(frozen=True, slots=True)
class CommitPlan:
    """What the lease holder proposes for one round, or why nothing is (`merged` None)."""

    fragment: int
    merged: MergedRound | None
    digest: str
    reason: str
    failed: bool = False  # the merge could not be applied (an error worth showing), not just empty


class Syncer:
    """Per-fragment open rounds and the timing estimates behind the grace window."""

    def __init__(self, manifest: RunManifest, embedding_names: Collection[str]) -> None:
        sync = manifest.sync
        self.manifest = manifest
        self.policy = QuorumPolicy.from_sync_spec(sync)
        self.caps = ContributionCaps.from_sync_spec(sync)
        self.embedding_names = tuple(embedding_names)
        self.norm_ref = NormReference()
        self.rounds: dict[int, OpenRound] = {}
        self.xi_step, self.xi_quorum, self.xi_sync = Ema(), Ema(), Ema()
        self._last_arrival: dict[tuple[str, int], tuple[float, int]] = {}  # (learner, p) -> (time, c_steps)
        self.last_decision: dict[int, str] = {}
        self.last_merge_reason = ""
        # When each fragment last had an outer step proposed: rounds of one fragment are limited
        # to about one per period, so a straggler's out-of-phase push is held for the next round
        # instead of taking a full outer step alone (docs/MERGE.md, "round rate limit").
        self.last_merge_at: dict[int, float] = {}

    def reset(self) -> None:
        """Lease lost: open rounds are dropped (learners resend at their next slot)."""
        self.rounds.clear()
        self.last_merge_at.clear()

    def adopt_norm_references(self, committed: Mapping[int, float]) -> None:
        """Lease won: continue from the reference norms the log committed (the previous holder's),
        so the first rounds after a failover still get the norm-outlier check."""
        self.norm_ref.restore(committed)

    def note_proposed(self, p: int, now: float) -> None:
        """An outer step for fragment p was proposed: the next round of p is due a period later."""
        self.last_merge_at[p] = now

    def add(self, contribution: Contribution, now: float, transfer_s: float | None = None) -> None:
        """A contribution arrived; a newer one from the same learner replaces its older one."""
        p = contribution.fragment
        rnd = self.rounds.get(p)
        if rnd is None:
            rnd = self.rounds[p] = OpenRound(opened_at=now)
        rnd.pending[contribution.learner] = (contribution, now)
        key = (contribution.learner, p)
        previous = self._last_arrival.get(key)
        if previous is not None and contribution.c_steps > 0:
            then, _ = previous
            # Time between this learner's slots for p over the steps it made: its step time.
            period = self.manifest.sync.period
            if now > then:
                self.xi_step.update((now - then) / period)
        self._last_arrival[key] = (now, contribution.c_steps)
        if transfer_s is not None:
            self.xi_sync.update(max(0.0, transfer_s))

    def decide(self, p: int, now: float, live_learners: int) -> RoundDecision | None:
        rnd = self.rounds.get(p)
        if rnd is None:
            return None
        arrivals = {name: at for name, (_, at) in rnd.pending.items()}
        estimates = TimingEstimates(self.xi_step.value, self.xi_quorum.value, self.xi_sync.value)
        decision = decide_round(now, rnd.opened_at, arrivals, live_learners, self.policy, estimates,
                                last_merge_at=self.last_merge_at.get(p))
        self.last_decision[p] = decision.reason
        return decision

    def take(self, p: int, decision: RoundDecision) -> OpenRound:
        rnd = self.rounds.pop(p)
        if decision.quorum_at is not None:
            # Time spent holding early contributions is the rate limit's, not the network's.
            self.xi_quorum.update(max(0.0, decision.quorum_at - rnd.opened_at - decision.held_s))
        return rnd

    def merge_round(self, p: int, rnd: OpenRound, state: GlobalState, decision_reason: str) -> MergedRound:
        """The CPU-heavy part (run in the thread pool): merge, encode codec_down, decode back."""
        sync = self.manifest.sync
        contributions = [c for c, _ in rnd.pending.values()]
        result = merge_contributions(
            contributions, state.fragment_params(p), state.history(p),
            method=sync.merge, weighting=sync.weighting, caps=self.caps,
            embedding_names=self.embedding_names, reference_norm=self.norm_ref.get(p))
        self.norm_ref.update(p, result.round_median_norm)
        self.last_merge_reason = f"fragment {p}: {decision_reason}; {result.reason}"
        if result.outer_gradient is None:
            return MergedRound(p, state.round(p), result, b"", None, decision_reason)
        encoded = encode_named(result.outer_gradient, sync.codec_down)
        return MergedRound(p, state.round(p) + 1, result, encoded, decode_named(encoded), decision_reason,
                           self.norm_ref.get(p))

    def plan_commit(self, p: int, rnd: OpenRound, state: GlobalState,
                    digest_after: Callable[[int, Mapping[str, np.ndarray]], str],
                    decision_reason: str) -> CommitPlan:
        """Merge a round and compute the digest the fragment will have (run in the thread pool).

        A merge that cannot be applied (e.g. a huge but finite merged update whose outer step
        overflows: `GlobalStateError`, a ValueError) drops the round with the reason instead of
        raising: the learners' counters keep growing and their next slots carry the steps.
        """
        try:
            merged = self.merge_round(p, rnd, state, decision_reason)
            if merged.outer_gradient is None:
                return CommitPlan(p, None, "", f"fragment {p}: nothing to commit ({self.last_merge_reason})")
            digest = digest_after(p, merged.outer_gradient)
        except ValueError as error:
            return CommitPlan(p, None, "", f"fragment {p}: merged round dropped: {error}", failed=True)
        return CommitPlan(p, merged, digest, self.last_merge_reason)
