"""The fragment round, whole: admission, contributions in, a decision with its reason, the merge and the commit.

One `Syncer` runs every round of a run, in the daemon (`daemon/rounds.py`, real clock, the lease
holder's) and in the in-process runner (`sim/runner.py`, virtual clock): the same object, the same
calls, admission included, so the parity benchmark measures the algorithm users run. Per fragment:

1. `admit(learner, p, member=...)` before a contribution's bytes are read: members only, the lease,
   in-flight limits (`sync/admission.py`); a refusal has a kind (counted for /status) and a reason.
2. `add(contribution, now, ticket=...)`: the steps cap cuts an impossible claim; a round opens at
   its first contribution; a newer contribution of the same learner replaces its older one (it
   includes those steps). A streamed contribution is held as it arrived, encoded
   (`wire.contribution_stream.EncodedDelta`); the merge decodes it tensor by tensor.
3. `step_round(p, now, live, blocked=...)`: the one call that decides a fragment's round: merge
   now (the round is taken: a `TakenRound`), wake at a time, or held, each with a reason
   (`quorum.decide_round` for K + grace + the round rate limit; "held" when the caller cannot take
   a merge now, e.g. its replica lags its own log). The caller turns wake-at into a timer.
4. `plan_commit(taken, state, ...)`: a pure function (CPU-heavy: the daemon runs it in a worker):
   rebase, validate, weigh and merge (`merge.merge_contributions`) against the reference norm the
   round was taken with, encode the outer gradient with codec_down and decode it back, so the bits
   proposed are the bits every replica applies, and build the commit payload, the digest the
   fragment will have and the fragment's next reference norm. It writes nothing.
5. `adopt(taken, plan, now)`, on the caller's loop once the commit is proposed (or the round found
   nothing to commit): the norm reference and the last merge reason move, and the next round of p
   is due a period later (rate limit). A round taken before the lease was lost or gained again is
   not adopted: a dropped round moves nothing.
6. `lease_lost()` drops open rounds; `lease_gained(norm_refs, now)` continues from the replicated
   norm references.

No I/O and no clock: callers pass `now`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from diloco_node.config.manifest import RunManifest
from diloco_node.sync.admission import Admission, Admitted, Member, Refused
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
class TakenRound:
    """A round closed for merging: everything the pure merge needs, read on the caller's loop."""

    fragment: int
    round: OpenRound
    decision_reason: str
    reference_norm: float | None = None  # the fragment's reference norm when the round was taken
    lease_term: int = 0  # the syncer's lease term it was taken in: `adopt` refuses another term's


@dataclass(frozen=True, slots=True)
class RoundStep:
    """`Syncer.step_round`'s answer: the decision with its reason, and the round when it is merged now."""

    decision: RoundDecision
    taken: TakenRound | None = None  # set exactly when decision.merge_now

    @property
    def reason(self) -> str:
        return self.decision.reason

    @property
    def wake_at(self) -> float | None:
        return self.decision.wake_at


@dataclass(frozen=True, slots=True)
class MergedRound:
    """A merge ready to be proposed (outer_gradient None: nothing acceptable, nothing to commit)."""

    fragment: int
    round: int  # the round the fragment reaches once this commits
    result: MergeResult  # its outer_gradient is dropped once encoded: `outer_gradient` is what applies
    encoded: bytes  # the outer gradient as codec_down bytes (what crosses the wire)
    outer_gradient: dict[str, np.ndarray] | None  # those bytes decoded: what every replica applies
    decision_reason: str
    norm_ref: float | None = None  # the fragment's reference norm after this round (replicated)
    merge_reason: str = ""  # "fragment p: <decision>; <merge>": what the log and /status say

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
    """Admission, open rounds per fragment, the timing estimates behind the grace window, the merge.

    Every method but `merge_round`/`plan_commit` runs on one caller thread (the event loop, the
    runner's queue); those two are pure and may run in a worker.
    """

    def __init__(self, manifest: RunManifest, plan: FragmentPlan, embedding_names: Collection[str],
                 rules: RoundRules | None = None) -> None:
        self.manifest = manifest
        self.plan = plan
        self.rules = rules or RoundRules.from_manifest(manifest)
        self.policy = self.rules.policy
        self.caps = contribution_caps(manifest)
        self.embedding_names = tuple(embedding_names)
        self.admission = Admission(plan.num_fragments, plan.period)
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
        # Counts lease changes: a round taken in an earlier term is not adopted (its merge may
        # finish in a worker after the lease was lost, or lost and gained again).
        self.lease_term = 0

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
        """Open rounds are dropped (learners resend at their next slot), and so is any round
        being merged now (`adopt` refuses it)."""
        self.lease_term += 1
        self.rounds.clear()
        self.last_merge_at.clear()
        self.last_decision.clear()

    def lease_gained(self, committed_norm_refs: Mapping[int, float], now: float) -> None:
        """Continue from the reference norms the log committed (the previous holder's), so the
        first rounds after a failover still get the norm-outlier check; steps-cap windows start now."""
        self.lease_term += 1
        self.norm_ref.restore(committed_norm_refs)
        self.admission.lease_gained(now)

    # ------------------------------------------------------------------ admission

    def admit(self, learner: str, p: int, *, member: Member | None, not_holder: str = "",
              local: bool = False) -> Admitted | Refused:
        """May `learner`'s contribution to fragment p be received now (before its bytes are read)?
        An `Admitted` holds an in-flight place until `add` (or `release` when it is dropped)."""
        return self.admission.admit(learner, p, member=member, not_holder=not_holder, local=local)

    def release(self, ticket: Admitted) -> None:
        """An admitted contribution was dropped before it was whole (idempotent)."""
        self.admission.release(ticket)

    # ------------------------------------------------------------------ the round

    def add(self, contribution: Contribution, now: float, *, transfer_s: float | None = None,
            members: Collection[str] = (), ticket: Admitted | None = None) -> str:
        """A whole contribution arrived (`transfer_s`: its upload time, when known; `ticket`: its
        admission, released here). Its steps claim is capped (`Admission.cap_claim`); returns why it
        was ("" when it was not). `members`: under synchronous rules, the learners a round opened
        by this contribution waits for."""
        if ticket is not None:
            self.admission.release(ticket)
        p = contribution.fragment
        c_steps, c_tokens, capped = self.admission.cap_claim(
            contribution.learner, p, contribution.c_steps, contribution.c_tokens, now, self.xi_step.value,
            self.caps.max_tokens_per_step)
        if capped:
            contribution = dataclasses.replace(contribution, c_steps=c_steps, c_tokens=c_tokens)
        rnd = self.rounds.get(p)
        if rnd is None:
            rnd = self.rounds[p] = OpenRound(opened_at=now, members=frozenset(members) | {contribution.learner})
        rnd.pending[contribution.learner] = (contribution, now, transfer_s)
        self._time_learner(contribution.learner, p, now)
        return capped

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
        """Merge now, wake at a time, or held; None when fragment p has no open round. The round
        stays open (`step_round` takes it when the answer is merge now).

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

    def step_round(self, p: int, now: float, live: Collection[str], *, blocked: str = "") -> RoundStep | None:
        """Decide fragment p's round (None: no open round): merge now, with the round taken for
        the merge, or wake at a time, or held, with the reason (see `decide`)."""
        decision = self.decide(p, now, live, blocked=blocked)
        if decision is None:
            return None
        if not decision.merge_now:
            return RoundStep(decision)
        rnd = self.rounds.pop(p)
        if decision.quorum_at is not None:
            # Time spent holding early contributions is the rate limit's, not the network's.
            self.xi_quorum.update(max(0.0, decision.quorum_at - rnd.opened_at - decision.held_s))
        transfers = [t for _, _, t in rnd.pending.values() if t is not None]
        if transfers:
            self.xi_sync.update(max(0.0, sum(transfers) / len(transfers)))
        return RoundStep(decision, TakenRound(p, rnd, decision.reason, self.norm_ref.get(p), self.lease_term))

    def adopt(self, taken: TakenRound, plan: CommitPlan, now: float) -> bool:
        """On the caller's loop, once `plan` was proposed (or found nothing to commit): the
        fragment's reference norm and the last merge reason move, and a proposed outer step starts
        the fragment's rate-limit period. False, and nothing moves, when the lease changed since
        the round was taken, or the merge failed."""
        if taken.lease_term != self.lease_term or plan.merged is None:
            return False
        p, merged = taken.fragment, plan.merged
        if merged.norm_ref is not None:
            self.norm_ref.set(p, merged.norm_ref)
        self.last_merge_reason = merged.merge_reason
        if plan.proposes:
            self.last_merge_at[p] = now
        return True

    def is_current(self, taken: TakenRound) -> bool:
        """The round was taken under the lease this syncer holds now (not lost since)."""
        return taken.lease_term == self.lease_term

    # ------------------------------------------------------------------ the merge (pure: may run in a worker)

    def merge_round(self, taken: TakenRound, state: GlobalState) -> MergedRound:
        """Merge, encode codec_down, decode back. Reads the syncer's fixed settings only."""
        sync = self.manifest.sync
        p, rnd = taken.fragment, taken.round
        contributions = [c for c, _, _ in rnd.pending.values()]
        # The state's own read-only arrays, not copies: an apply replaces them, never changes them.
        result = merge_contributions(
            contributions, state.fragment_params(p, copies=False), state.history(p),
            method=self.rules.method, weighting=self.rules.weighting, caps=self.caps,
            embedding_names=self.embedding_names, reference_norm=taken.reference_norm,
            contribution_norm=sync.contribution_norm)
        norm_ref = self.norm_ref.advanced(taken.reference_norm, result.round_median_norm)
        reason = f"fragment {p}: {taken.decision_reason}; {result.reason}"
        if result.outer_gradient is None:
            return MergedRound(p, state.round(p), result, b"", None, taken.decision_reason, norm_ref, reason)
        encoded = encode_named(result.outer_gradient, sync.codec_down)
        # The merge's own float32 result goes before its bytes are decoded back: what every replica
        # applies is the decoded one, and the two are never held together (docs/DAEMON.md, "Memory").
        result = dataclasses.replace(result, outer_gradient=None)
        decoded = decode_named(encoded, max_elements=self.plan.fragments[p].num_elements)
        return MergedRound(p, state.round(p) + 1, result, encoded, decoded, taken.decision_reason, norm_ref, reason)

    def plan_commit(self, taken: TakenRound, state: GlobalState,
                    digest_after: Callable[[int, Mapping[str, np.ndarray]], str] | None = None,
                    wall_time: float = 0.0) -> CommitPlan:
        """Merge a round and build what to propose: the commit payload and (when `digest_after` is
        given) the digest the fragment will have. Pure: nothing of the syncer changes until
        `adopt`.

        A merge that cannot be applied (e.g. a huge but finite merged update whose outer step
        overflows: `GlobalStateError`, a ValueError) drops the round with the reason instead of
        raising: the learners' counters keep growing and their next slots carry the steps.
        `wall_time` (the caller's unix time) is stamped on the commit for [run.stop] wall_s.
        """
        p, rnd = taken.fragment, taken.round
        try:
            merged = self.merge_round(taken, state)
            if merged.outer_gradient is None:
                return CommitPlan(p, merged, b"", "", f"fragment {p}: nothing to commit ({merged.merge_reason})")
            digest = digest_after(p, merged.outer_gradient) if digest_after is not None else ""
        except ValueError as error:
            return CommitPlan(p, None, b"", "", f"fragment {p}: merged round dropped: {error}", failed=True)
        tokens, steps = self._merged_work(rnd, merged.contributors)
        payload = CommitPayload(merged.encoded, merged.contributors, tuple(w for _, w in merged.result.accepted),
                                merged.norm_ref, tokens, steps, wall_time).encode()
        return CommitPlan(p, merged, payload, digest, merged.merge_reason)

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
