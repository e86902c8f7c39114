"""The fragment round, sans-IO: contributions in, merge-now / wake-at / held out, the merge and its commit payload.

One implementation for every caller: `sim/runner.py` drives it on its virtual clock and
`daemon/rounds.py` (the lease holder) on the real one; the daemon only turns wake-at answers into
timers and a plan into a log proposal. A round of fragment p opens at its first contribution;
`quorum.decide_round` says merge now or wait, with a reason; `merge.merge_contributions` rebases,
validates, weighs and merges; the merged outer gradient is encoded with codec_down and decoded
back, so the bits in the commit payload (`replica.CommitPayload`, built here) are the bits every
replica and learner applies.

What differs between run modes is an input, not a second implementation:
- `SyncerOptions.synchronous` (DiLoCo / Streaming DiLoCo baselines): K = every live member of the
  round (the learners live and on the schedule when it opened, passed by the caller with the
  first contribution), no grace window, no rate limit;
- merge method and weighting come from the manifest the caller passes (plain mean, uniform
  weights for the baselines);
- timing estimates: a caller that knows a learner's step time passes it with the contribution
  (the runner does), else it is inferred from the interval between the learner's pushes of the
  fragment (one period of its steps; the daemon); `prime` seeds the estimates before the first
  round; upload times passed with contributions plus `download_s` (a link model, when the caller
  has one) give the sync time.

No I/O and no clock: callers pass `now`; the daemon runs `plan_commit` in its thread pool.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from diloco_node.config.manifest import RunManifest
from diloco_node.sync.global_state import GlobalState
from diloco_node.sync.merge import (
    Contribution,
    ContributionCaps,
    MergeResult,
    NormReference,
    merge_contributions,
)
from diloco_node.sync.quorum import (
    DEFAULT_MIN_ROUND_INTERVAL_FACTOR,
    Ema,
    QuorumPolicy,
    RoundDecision,
    TimingEstimates,
    decide_round,
)
from diloco_node.sync.replica import CommitPayload
from wire.codecs import decode_named, encode_named

# Syncer decisions (SyncerDecision.action).
MERGE = "merge"  # take the round (`Syncer.take`) and merge it now
WAKE = "wake"  # look again at `wake_at` (grace window, held early contributions)
WAIT = "wait"  # nothing to do until the next arrival or membership change
HELD = "held"  # the round is due, but the caller said it cannot merge now (its `held_by`)


@dataclass(frozen=True, slots=True)
class SyncerOptions:
    """How a run mode's rounds differ; the defaults are the decoupled daemon's."""

    # K = every live member of the round, no grace window, no rate limit (DiLoCo, Streaming DiLoCo).
    synchronous: bool = False
    # rho of the per-fragment round rate limit (quorum.py); 0 disables it.
    min_round_interval_factor: float = DEFAULT_MIN_ROUND_INTERVAL_FACTOR
    # Seconds to broadcast n merged bytes, when the caller has a link model (the runner does);
    # None: the download is not estimated (counted as 0 in the sync time).
    download_s: Callable[[int], float] | None = None


@dataclass(slots=True)
class OpenRound:
    opened_at: float
    pending: dict[str, tuple[Contribution, float]] = field(default_factory=dict)  # learner -> (c, arrived)
    members: frozenset[str] = frozenset()  # synchronous mode: the learners this round waits for
    upload_s: dict[str, float] = field(default_factory=dict)  # learner -> measured upload seconds


@dataclass(frozen=True, slots=True)
class SyncerDecision:
    """What the caller does with fragment p's open round now, and why (shown in /status)."""

    action: str  # MERGE, WAKE, WAIT or HELD
    reason: str
    wake_at: float | None = None  # WAKE: when to look again
    quorum: RoundDecision | None = None  # the quorum rule's answer behind it

    @property
    def merge_now(self) -> bool:
        return self.action == MERGE


@dataclass(frozen=True, slots=True)
class MergedRound:
    """A merge ready to be proposed (outer_gradient None: nothing acceptable, nothing to commit)."""

    fragment: int
    round: int  # the round the fragment reaches once this commits
    result: MergeResult
    encoded: bytes
    outer_gradient: dict[str, np.ndarray] | None  # the decoded codec_down bits every replica applies
    decision_reason: str
    norm_ref: float | None = None  # the fragment's reference norm after this round (replicated)

    @property
    def contributors(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.result.accepted)


@dataclass(frozen=True, slots=True)
class CommitPlan:
    """What the lease holder proposes for one round, or why nothing is (`merged` None)."""

    fragment: int
    merged: MergedRound | None
    digest: str  # the fragment digest after applying ("" when the caller asked for none)
    reason: str
    failed: bool = False  # the merge could not be applied (an error worth showing), not just empty
    payload: bytes = b""  # the OUTER_COMMIT entry's payload (CommitPayload bytes), when merged


class Syncer:
    """Per-fragment open rounds, the timing estimates behind the grace window, the merge."""

    def __init__(self, manifest: RunManifest, embedding_names: Collection[str],
                 options: SyncerOptions = SyncerOptions()) -> None:
        sync = manifest.sync
        self.manifest = manifest
        self.options = options
        self.policy = QuorumPolicy(min_quorum=sync.min_quorum, grace_gamma=sync.grace_gamma,
                                   grace_cap_s=sync.grace_cap_s, overlap_steps=sync.overlap,
                                   period_steps=sync.period,
                                   min_round_interval_factor=options.min_round_interval_factor)
        self.caps = ContributionCaps.from_sync_spec(sync)
        self.embedding_names = tuple(embedding_names)
        self.norm_ref = NormReference()
        self.rounds: dict[int, OpenRound] = {}
        self.xi_step, self.xi_quorum, self.xi_sync = Ema(), Ema(), Ema()
        self._last_arrival: dict[tuple[str, int], float] = {}  # (learner, p) -> time
        self.last_decision: dict[int, str] = {}
        self.last_merge_reason = ""
        # When each fragment last had an outer step proposed: rounds of one fragment are limited
        # to about one per period, so a straggler's out-of-phase push is held for the next round
        # instead of taking a full outer step alone (docs/MERGE.md, "round rate limit").
        self.last_merge_at: dict[int, float] = {}

    # ------------------------------------------------------------------ inputs

    def prime(self, *, step_s: float, quorum_s: float, sync_s: float) -> None:
        """Seed the timing estimates from what the caller knows before the first round (learner
        step times from progress reports, the sync time from a link probe)."""
        self.xi_step.update(step_s)
        self.xi_quorum.update(quorum_s)
        self.xi_sync.update(sync_s)

    def add(self, contribution: Contribution, now: float, transfer_s: float | None = None, *,
            step_s: float | None = None, members: Collection[str] = ()) -> None:
        """A contribution arrived; a newer one from the same learner replaces its older one (it
        includes its steps).

        transfer_s: its upload time when known; step_s: the learner's step time when known;
        members: who a round opened by this contribution waits for in synchronous mode (the
        contributor is added)."""
        p = contribution.fragment
        rnd = self.rounds.get(p)
        if rnd is None:
            rnd = self.rounds[p] = OpenRound(opened_at=now, members=frozenset(members) | {contribution.learner})
        rnd.pending[contribution.learner] = (contribution, now)
        if transfer_s is not None:
            rnd.upload_s[contribution.learner] = max(0.0, transfer_s)
        else:
            rnd.upload_s.pop(contribution.learner, None)
        key = (contribution.learner, p)
        then = self._last_arrival.get(key)
        if step_s is not None:
            # Known from the start: the straggler's first push already counts. Measured in the
            # parity benchmark's straggler scenario, inferring it instead (no sample before a
            # learner's second push) made rounds lock into a worse phase: 1.978 vs 1.854.
            self.xi_step.update(step_s)
        elif then is not None and contribution.c_steps > 0 and now > then:
            # Time between this learner's slots for p over the period's steps: its step time.
            self.xi_step.update((now - then) / self.manifest.sync.period)
        self._last_arrival[key] = now

    def note_proposed(self, p: int, now: float) -> None:
        """An outer step for fragment p was proposed: the next round of p is due a period later."""
        self.last_merge_at[p] = now

    # ------------------------------------------------------------------ lease

    def reset(self) -> None:
        """Lease lost: open rounds are dropped (learners resend at their next slot)."""
        self.rounds.clear()
        self.last_merge_at.clear()

    def adopt_norm_references(self, committed: Mapping[int, float]) -> None:
        """Lease won: continue from the reference norms the log committed (the previous holder's),
        so the first rounds after a failover still get the norm-outlier check."""
        self.norm_ref.restore(committed)

    # ------------------------------------------------------------------ decisions

    def decide(self, p: int, now: float, live_learners: int | Collection[str],
               held_by: str = "") -> SyncerDecision | None:
        """Merge now, wake at a time, wait, or hold; None when fragment p has no open round.

        live_learners: the names of the learners alive now (contributors are counted live as
        well), or just how many there are (a decoupled caller without names). A learner missing
        from the names has its last push forgotten, so the gap of an outage is not taken for a
        step time when it pushes again. held_by: why the
        caller cannot merge now ("" if it can), e.g. a merge in flight or a replica behind its
        log; a due round is then HELD with that reason, and the caller asks again later.
        """
        rnd = self.rounds.get(p)
        if rnd is None:
            return None
        arrivals = {name: at for name, (_, at) in rnd.pending.items()}
        estimates = TimingEstimates(self.xi_step.value, self.xi_quorum.value, self.xi_sync.value)
        if isinstance(live_learners, int):
            if self.options.synchronous:
                raise ValueError("a synchronous syncer needs the live learners' names, not a count")
            live_count = live_learners
        else:
            live = set(live_learners)
            for key in [key for key in self._last_arrival if key[0] not in live]:
                del self._last_arrival[key]
            live_count = len(rnd.members & live | set(arrivals)) if self.options.synchronous \
                else len(live | set(arrivals))
        if self.options.synchronous:
            # K = M already aligns rounds: no grace window and no rate limit.
            policy = QuorumPolicy(max(1, live_count), 0.0, 0.0, self.policy.overlap_steps,
                                  min_round_interval_factor=0.0)
        else:
            policy = self.policy
        quorum = decide_round(now, rnd.opened_at, arrivals, live_count, policy, estimates,
                              last_merge_at=self.last_merge_at.get(p))
        if quorum.merge_now and held_by:
            decision = SyncerDecision(HELD, f"{quorum.reason}; held: {held_by}", None, quorum)
        elif quorum.merge_now:
            decision = SyncerDecision(MERGE, quorum.reason, None, quorum)
        elif quorum.wake_at is not None:
            decision = SyncerDecision(WAKE, quorum.reason, quorum.wake_at, quorum)
        else:
            decision = SyncerDecision(WAIT, quorum.reason, None, quorum)
        self.last_decision[p] = decision.reason
        return decision

    def take(self, p: int, decision: SyncerDecision) -> OpenRound:
        """Close fragment p's round for a MERGE decision (the caller then runs `plan_commit`)."""
        if decision.action != MERGE:
            raise ValueError(f"fragment {p}: cannot take a round the syncer decided to {decision.action}")
        rnd = self.rounds.pop(p)
        quorum = decision.quorum
        if quorum is not None and quorum.quorum_at is not None:
            # Time spent holding early contributions is the rate limit's, not the network's.
            self.xi_quorum.update(max(0.0, quorum.quorum_at - rnd.opened_at - quorum.held_s))
        return rnd

    # ------------------------------------------------------------------ the merge

    def merge_round(self, p: int, rnd: OpenRound, state: GlobalState, decision_reason: str) -> MergedRound:
        """The CPU-heavy part: merge, encode codec_down, decode back; updates the norm reference
        and the sync-time estimate (known upload times plus the modelled download)."""
        sync = self.manifest.sync
        contributions = [c for c, _ in rnd.pending.values()]
        result = merge_contributions(
            contributions, state.fragment_params(p), state.history(p),
            method=sync.merge, weighting=sync.weighting, caps=self.caps,
            embedding_names=self.embedding_names, reference_norm=self.norm_ref.get(p))
        self.norm_ref.update(p, result.round_median_norm)
        self.last_merge_reason = (f"fragment {p}: {decision_reason}; {result.reason}"
                                  + "".join(f"; {why}" for _, why in result.rejected))
        encoded = b"" if result.outer_gradient is None else encode_named(result.outer_gradient, sync.codec_down)
        if rnd.upload_s:
            download = self.options.download_s(len(encoded)) if self.options.download_s else 0.0
            self.xi_sync.update(float(np.mean(list(rnd.upload_s.values()))) + download)
        if result.outer_gradient is None:
            return MergedRound(p, state.round(p), result, b"", None, decision_reason)
        return MergedRound(p, state.round(p) + 1, result, encoded, decode_named(encoded), decision_reason,
                           self.norm_ref.get(p))

    def plan_commit(self, p: int, rnd: OpenRound, state: GlobalState,
                    digest_after: Callable[[int, Mapping[str, np.ndarray]], str] | None,
                    decision_reason: str) -> CommitPlan:
        """Merge a round and build its commit: payload bytes and, when `digest_after` is given,
        the digest the fragment will have.

        A merge that cannot be applied (e.g. a huge but finite merged update whose outer step
        overflows: `GlobalStateError`, a ValueError) drops the round with the reason instead of
        raising: the learners' counters keep growing and their next slots carry the steps.
        """
        try:
            merged = self.merge_round(p, rnd, state, decision_reason)
            if merged.outer_gradient is None:
                return CommitPlan(p, None, "", f"fragment {p}: nothing to commit ({self.last_merge_reason})")
            digest = digest_after(p, merged.outer_gradient) if digest_after is not None else ""
        except ValueError as error:
            return CommitPlan(p, None, "", f"fragment {p}: merged round dropped: {error}", failed=True)
        payload = CommitPayload(merged.encoded, merged.contributors,
                                tuple(w for _, w in merged.result.accepted), merged.norm_ref).encode()
        return CommitPlan(p, merged, digest, self.last_merge_reason, payload=payload)
