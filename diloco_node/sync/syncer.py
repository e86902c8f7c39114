"""The fragment round, whole: contributions in, a decision with its reason, the merge and the commit.

One `Syncer` runs every round of a run, in the daemon (`daemon/rounds.py`, real clock, the lease
holder's) and in the in-process runner (`sim/runner.py`, virtual clock): the same object, the same
calls, so the parity benchmark measures the algorithm users run. Per fragment:

1. `add(contribution, now)`: a round opens at its first contribution; a newer contribution of the
   same learner replaces its older one (it includes those steps). A streamed contribution is held
   as it arrived, encoded (`wire.contribution_stream.EncodedDelta`); the merge decodes it tensor by
   tensor, so waiting contributions cost their encoded size, not their fp32 size.
2. `decide(p, now, live, blocked=...)`: merge now, wake at a time, or held, each with a reason
   (`quorum.decide_round` for K + grace + the round rate limit; "held" when the caller cannot take
   a merge now, e.g. its replica lags its own log). The caller turns wake-at into a timer.
3. `take(p, decision)`, then `plan_commit(...)` (CPU-heavy: run it in a worker): rebase, validate,
   weigh and merge (`merge.merge_contributions`), encode the outer gradient with codec_down and
   decode it back, so the bits proposed are the bits every replica applies, and build the commit
   payload and the digest the fragment will have.
4. `note_proposed(p, now)`: the next round of p is due a period later (rate limit).
5. `lease_lost()` drops open rounds; `lease_gained(norm_refs)` continues from the replicated
   norm references.

No I/O and no clock: callers pass `now`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from diloco_node.config.manifest import RunManifest
from diloco_node.sync.fragments import FragmentPlan
from diloco_node.sync.global_state import GlobalState
from diloco_node.sync.merge import Contribution, ContributionCaps, MergeResult, NormReference, merge_contributions
from diloco_node.sync.quorum import Ema, QuorumPolicy, RoundDecision, TimingEstimates, decide_round
from diloco_node.sync.replica import CommitPayload
from wire.codecs import decode_named, encode_named

# A learner's interval between two of its contributions longer than this many times its own
# step-time estimate is not a step-time sample: the learner was down or missed slots (an outage
# would otherwise inflate its estimate for many rounds).
MAX_STEP_SAMPLE_FACTOR = 4.0
# A merge the caller cannot take now (`blocked`) is looked at again this much later: what blocks it
# (a merge in flight, a replica applying its own log) clears within a coordination tick or two.
HELD_RETRY_S = 0.05


def contribution_caps(manifest: RunManifest) -> ContributionCaps:
    """What a learner may claim: at most the tokens one inner step of this run's manifest trains on
    (batch x context; the [sync] cap is only an upper bound on that), and [sync]'s steps cap.
    A claim of 2^40 tokens once weighed 1.8e8 times a real learner under the [sync] cap alone."""
    sync = manifest.sync
    per_step = manifest.inner.batch_size * manifest.model.seq_len
    return ContributionCaps(max_tokens_per_step=min(sync.max_tokens_per_step, per_step),
                            max_steps=sync.max_steps_per_contribution)


@dataclass(frozen=True, slots=True)
class RoundRules:
    """How this run's rounds are formed and merged.

    `synchronous`: K is every member of the round that is still live (synchronous DiLoCo and
    Streaming DiLoCo, the baselines), where a round's members are the learners the caller names
    when the round opens. Otherwise K, grace and the rate limit come from `policy`.
    """

    policy: QuorumPolicy
    method: str = "rda"
    weighting: str = "tokens"
    synchronous: bool = False

    @classmethod
    def from_manifest(cls, manifest: RunManifest) -> RoundRules:
        sync = manifest.sync
        return cls(QuorumPolicy.from_sync_spec(sync), sync.merge, sync.weighting)


@dataclass(slots=True)
class OpenRound:
    opened_at: float
    members: frozenset[str] = frozenset()  # synchronous rules: who the round waits for
    # learner -> (contribution, arrival time, transfer seconds if known)
    pending: dict[str, tuple[Contribution, float, float | None]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MergedRound:
    """A merge ready to be proposed (outer_gradient None: nothing acceptable, nothing to commit)."""

    fragment: int
    round: int  # the round the fragment reaches once this commits
    result: MergeResult
    encoded: bytes  # the outer gradient as codec_down bytes (what crosses the wire)
    outer_gradient: dict[str, np.ndarray] | None  # those bytes decoded: what every replica applies
    decision_reason: str
    norm_ref: float | None = None  # the fragment's reference norm after this round (replicated)

    @property
    def contributors(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.result.accepted)


@dataclass(frozen=True, slots=True)
class CommitPlan:
    """What to propose for one round (`payload`, the log entry's bytes), or why nothing is."""

    fragment: int
    merged: MergedRound | None
    payload: bytes
    digest: str  # the fragment's digest after the commit ("" when the caller asked for none)
    reason: str
    failed: bool = False  # the merge could not be applied (an error worth showing), not just empty

    @property
    def proposes(self) -> bool:
        """An outer step to propose (else nothing acceptable arrived, or the merge failed)."""
        return bool(self.payload)


class Syncer:
    """Open rounds per fragment, the timing estimates behind the grace window, and the merge."""

    def __init__(self, manifest: RunManifest, plan: FragmentPlan, embedding_names: Collection[str],
                 rules: RoundRules | None = None) -> None:
        self.manifest = manifest
        self.plan = plan
        self.rules = rules or RoundRules.from_manifest(manifest)
        self.policy = self.rules.policy
        self.caps = contribution_caps(manifest)
        self.embedding_names = tuple(embedding_names)
        self.norm_ref = NormReference()
        self.rounds: dict[int, OpenRound] = {}
        # xi_step: an EMA over arrivals of the arriving learner's own step time, primed before any
        # learner has been timed. A learner is timed by the interval between two consecutive
        # contributions over the steps between their slots (H / P steps apart, any fragments), so
        # from its second contribution on. Weighted by arrivals, a straggler pulls xi_step up a
        # little: measured (docs/PARITY.md), that margin is what keeps a straggler's push inside
        # the rate limit's window, so it joins the next on-time round instead of merging alone.
        self.xi_step, self.xi_quorum, self.xi_sync = Ema(), Ema(), Ema()
        self._learner_step: dict[str, Ema] = {}
        self._last_arrival: dict[str, tuple[float, int]] = {}  # learner -> (arrival time, fragment)
        self.last_decision: dict[int, str] = {}
        self.last_merge_reason = ""
        # When each fragment last had an outer step proposed: rounds of one fragment are limited
        # to about one per period, so a straggler's out-of-phase push is held for the next round
        # instead of taking a full outer step alone (docs/MERGE.md, "round rate limit").
        self.last_merge_at: dict[int, float] = {}

    @property
    def period_steps(self) -> int:
        return self.policy.period_steps or self.manifest.sync.period

    # ------------------------------------------------------------------ estimates and lease

    def prime(self, *, step_s: float | None = None, quorum_s: float | None = None,
              sync_s: float | None = None) -> None:
        """Timing estimates known before the first round (a step time, a link probe)."""
        for ema, value in ((self.xi_step, step_s), (self.xi_quorum, quorum_s), (self.xi_sync, sync_s)):
            if value is not None:
                ema.update(value)

    def lease_lost(self) -> None:
        """Open rounds are dropped (learners resend at their next slot)."""
        self.rounds.clear()
        self.last_merge_at.clear()
        self.last_decision.clear()

    def lease_gained(self, committed_norm_refs: Mapping[int, float]) -> None:
        """Continue from the reference norms the log committed (the previous holder's), so the
        first rounds after a failover still get the norm-outlier check."""
        self.norm_ref.restore(committed_norm_refs)

    # ------------------------------------------------------------------ the round

    def add(self, contribution: Contribution, now: float, *, transfer_s: float | None = None,
            members: Collection[str] = ()) -> None:
        """A contribution arrived (`transfer_s`: its upload time, when known). `members`: under
        synchronous rules, the learners a round opened by this contribution waits for."""
        p = contribution.fragment
        rnd = self.rounds.get(p)
        if rnd is None:
            rnd = self.rounds[p] = OpenRound(opened_at=now, members=frozenset(members) | {contribution.learner})
        rnd.pending[contribution.learner] = (contribution, now, transfer_s)
        self._time_learner(contribution.learner, p, now)

    def _time_learner(self, learner: str, p: int, now: float) -> None:
        previous = self._last_arrival.get(learner)
        self._last_arrival[learner] = (now, p)
        own = self._learner_step.setdefault(learner, Ema())
        if previous is not None and now > previous[0]:
            then, q = previous
            steps = (self.plan.offset(p) - self.plan.offset(q)) % self.plan.period or self.plan.period
            sample = (now - then) / steps
            if own.value is None or sample <= MAX_STEP_SAMPLE_FACTOR * own.value:
                own.update(sample)
        if own.value is not None:
            self.xi_step.update(own.value)

    def decide(self, p: int, now: float, live: Collection[str], *, blocked: str = "") -> RoundDecision | None:
        """Merge now, wake at a time, or held; None when fragment p has no open round.

        `live`: the learners currently alive (contributed or not). `blocked`: why the caller cannot
        take a merge now ("" when it can); a merge that is due is then held with that reason.
        """
        rnd = self.rounds.get(p)
        if rnd is None:
            return None
        arrivals = {name: at for name, (_, at, _) in rnd.pending.items()}
        live_or_arrived = set(live) | set(arrivals)
        if self.rules.synchronous:
            waiting_for = rnd.members & live_or_arrived
            policy = QuorumPolicy(max(1, len(waiting_for)), 0.0, 0.0, self.policy.overlap_steps,
                                  min_round_interval_factor=0.0)
            live_count = len(waiting_for)
        else:
            policy, live_count = self.policy, len(live_or_arrived)
        estimates = TimingEstimates(self.xi_step.value, self.xi_quorum.value, self.xi_sync.value)
        decision = decide_round(now, rnd.opened_at, arrivals, live_count, policy, estimates,
                                last_merge_at=self.last_merge_at.get(p))
        if decision.merge_now and blocked:
            decision = RoundDecision(False, now + HELD_RETRY_S, decision.have, decision.need, decision.grace_s,
                                     f"held: {blocked} (due: {decision.reason})", decision.quorum_at,
                                     decision.held_s)
        self.last_decision[p] = decision.reason
        return decision

    def take(self, p: int, decision: RoundDecision) -> OpenRound:
        """Close fragment p's round for merging; the round's timings feed the estimates."""
        rnd = self.rounds.pop(p)
        if decision.quorum_at is not None:
            # Time spent holding early contributions is the rate limit's, not the network's.
            self.xi_quorum.update(max(0.0, decision.quorum_at - rnd.opened_at - decision.held_s))
        transfers = [t for _, _, t in rnd.pending.values() if t is not None]
        if transfers:
            self.xi_sync.update(max(0.0, sum(transfers) / len(transfers)))
        return rnd

    def note_proposed(self, p: int, now: float) -> None:
        """An outer step for fragment p was proposed: the next round of p is due a period later."""
        self.last_merge_at[p] = now

    # ------------------------------------------------------------------ the merge (in a worker)

    def merge_round(self, p: int, rnd: OpenRound, state: GlobalState, decision_reason: str) -> MergedRound:
        """Merge, encode codec_down, decode back."""
        sync = self.manifest.sync
        contributions = [c for c, _, _ in rnd.pending.values()]
        # The state's own read-only arrays, not copies: an apply replaces them, never changes them.
        result = merge_contributions(
            contributions, state.fragment_params(p, copies=False), state.history(p),
            method=self.rules.method, weighting=self.rules.weighting, caps=self.caps,
            embedding_names=self.embedding_names, reference_norm=self.norm_ref.get(p))
        self.norm_ref.update(p, result.round_median_norm)
        self.last_merge_reason = f"fragment {p}: {decision_reason}; {result.reason}"
        if result.outer_gradient is None:
            return MergedRound(p, state.round(p), result, b"", None, decision_reason)
        encoded = encode_named(result.outer_gradient, sync.codec_down)
        decoded = decode_named(encoded, max_elements=self.plan.fragments[p].num_elements)
        return MergedRound(p, state.round(p) + 1, result, encoded, decoded, decision_reason,
                           self.norm_ref.get(p))

    def plan_commit(self, p: int, rnd: OpenRound, state: GlobalState,
                    digest_after: Callable[[int, Mapping[str, np.ndarray]], str] | None,
                    decision_reason: str, wall_time: float = 0.0) -> CommitPlan:
        """Merge a round and build what to propose: the commit payload and (when `digest_after` is
        given) the digest the fragment will have.

        A merge that cannot be applied (e.g. a huge but finite merged update whose outer step
        overflows: `GlobalStateError`, a ValueError) drops the round with the reason instead of
        raising: the learners' counters keep growing and their next slots carry the steps.
        `wall_time` (the caller's unix time) is stamped on the commit for [run.stop] wall_s.
        """
        try:
            merged = self.merge_round(p, rnd, state, decision_reason)
            if merged.outer_gradient is None:
                return CommitPlan(p, merged, b"", "", f"fragment {p}: nothing to commit ({self.last_merge_reason})")
            digest = digest_after(p, merged.outer_gradient) if digest_after is not None else ""
        except ValueError as error:
            return CommitPlan(p, None, b"", "", f"fragment {p}: merged round dropped: {error}", failed=True)
        tokens, steps = self._merged_work(rnd, merged.contributors)
        payload = CommitPayload(merged.encoded, merged.contributors, tuple(w for _, w in merged.result.accepted),
                                merged.norm_ref, tokens, steps, wall_time).encode()
        return CommitPlan(p, merged, payload, digest, self.last_merge_reason)

    def _merged_work(self, rnd: OpenRound, accepted: tuple[str, ...]) -> tuple[int, int]:
        """(tokens, inner steps) the accepted contributions bring, each claim capped as the merge
        weights cap it: what counts towards [run.stop], so one member cannot end a run by claiming."""
        tokens = steps = 0
        for name in accepted:
            contribution = rnd.pending[name][0]
            claimed_steps = min(contribution.c_steps, self.caps.max_steps)
            steps += claimed_steps
            tokens += min(contribution.c_tokens, claimed_steps * self.caps.max_tokens_per_step)
        return tokens, steps

    # ------------------------------------------------------------------ for /status

    def waiting_contributions(self) -> int:
        return sum(len(r.pending) for r in self.rounds.values())
