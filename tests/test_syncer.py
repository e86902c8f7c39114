"""The Syncer's own bookkeeping: timing learners from their contributions, synchronous rounds'
members, the held decision, and the lease."""

from __future__ import annotations

import numpy as np

from diloco_node.config.manifest import RunManifest, SyncSpec
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.merge import Contribution
from diloco_node.sync.quorum import QuorumPolicy
from diloco_node.sync.syncer import HELD_RETRY_S, RoundRules, Syncer

from conftest import replica_with_rounds

MANIFEST = RunManifest(sync=SyncSpec(fragments=4, period=8, overlap=2, min_quorum=1))
PLAN = plan_fragments({f"t{i}": (4,) for i in range(4)}, 4, 8, 2)  # offsets 0, 2, 4, 6: slots 2 steps apart


def _c(learner: str, p: int) -> Contribution:
    return Contribution(learner, p, 0, {n: np.zeros(4, np.float32) for n in PLAN.fragments[p].names}, 8, 256)


def _slot_order() -> list[int]:
    return sorted(range(4), key=PLAN.offset)


def test_a_learner_is_timed_from_its_second_contribution_of_any_fragment() -> None:
    syncer = Syncer(MANIFEST, PLAN, [])
    first, second = _slot_order()[:2]
    steps = (PLAN.offset(second) - PLAN.offset(first)) % PLAN.period
    syncer.add(_c("a", first), 10.0)
    assert syncer.xi_step.value is None  # one contribution times nobody
    syncer.add(_c("a", second), 10.0 + 0.5 * steps)
    assert syncer.xi_step.value == 0.5


def test_a_gap_of_an_outage_is_not_a_step_time_sample() -> None:
    syncer = Syncer(MANIFEST, PLAN, [])
    order = _slot_order()
    t = 0.0
    for p in order:  # steps of 0.5 s
        syncer.add(_c("a", p), t)
        t += 0.5 * 2
    syncer.add(_c("a", order[0]), t + 100.0)  # back after 100 s down: 50x its step time
    assert syncer.xi_step.value == 0.5


def test_synchronous_rules_wait_for_every_live_member_of_the_round() -> None:
    rules = RoundRules(QuorumPolicy(1, 0.0, 0.0, 2, period_steps=8, min_round_interval_factor=0.0), "mean",
                       "uniform", synchronous=True)
    syncer = Syncer(MANIFEST, PLAN, [], rules)
    syncer.add(_c("a", 0), 1.0, members=("a", "b", "c"))
    decision = syncer.decide(0, 1.0, ["a", "b", "c"])
    assert decision is not None and not decision.merge_now
    assert decision.reason == "waiting: 1 of 3 needed contributions"
    # c is gone: the round now waits for a and b only.
    syncer.add(_c("b", 0), 2.0)
    decision = syncer.decide(0, 2.0, ["a", "b"])
    assert decision is not None and decision.merge_now and decision.reason == "merging: all 2 live learners arrived"


def test_a_due_merge_the_caller_cannot_take_is_held_with_its_reason() -> None:
    syncer = Syncer(MANIFEST, PLAN, [])
    syncer.add(_c("a", 0), 5.0)
    decision = syncer.decide(0, 5.0, ["a"], blocked="a merge of another fragment is in flight")
    assert decision is not None and not decision.merge_now and decision.wake_at == 5.0 + HELD_RETRY_S
    assert decision.reason == ("held: a merge of another fragment is in flight "
                               "(due: merging: all 1 live learner arrived)")
    assert syncer.decide(0, 5.05, ["a"]).merge_now


def test_losing_the_lease_drops_open_rounds_and_their_reasons() -> None:
    syncer = Syncer(MANIFEST, PLAN, [])
    syncer.add(_c("a", 0), 5.0)
    syncer.decide(0, 5.0, ["a", "b"])
    syncer.last_merge_at[1] = 4.0  # fragment 1 merged a second earlier
    syncer.lease_lost()
    assert syncer.rounds == {} and syncer.last_decision == {} and syncer.last_merge_at == {}
    assert syncer.waiting_contributions() == 0


def test_the_holders_commit_and_the_apply_hold_few_copies_of_a_one_tensor_fragment(monkeypatch) -> None:
    """The lease holder's plan_commit (merge with a rebased stale contribution, codec_down encode
    and decode, the digest preview) and a replica's apply, measured with tracemalloc against the
    fp32 size T of the fragment's one tensor (a large model's embedding table is such a fragment):
    the merge holds its float32 result and one block, codec_down's encoder its work copy beside it,
    never fragment-sized float64 arrays or step temporaries (before: 7.3T to merge, 3T to preview;
    then 3.3T with the merge's float64 direction)."""
    import tracemalloc

    from diloco_node.sync import merge

    from bootstrap.entries import EntryKind, LogEntry
    from diloco_node.sync.syncer import OpenRound, TakenRound

    shapes = {"embed/embedding": (2048, 1024)}  # 2M values, T = 8 MiB
    tensor_bytes = 4 * 2048 * 1024
    manifest = RunManifest(sync=SyncSpec(fragments=1, period=2, overlap=0, min_quorum=1))
    rng = np.random.default_rng(0)
    plan, replica = replica_with_rounds(shapes, rng)  # two rounds to rebase from
    pending = {}
    for learner, lag in (("a", 0), ("b", 2)):
        delta = {n: (1e-3 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}
        pending[learner] = (Contribution(learner, 0, replica.state.round(0) - lag, delta, 8, 8 * 64), 0.0, None)
    syncer = Syncer(manifest, plan, [])  # no embedding names: RDA, the merge with the most temporaries
    monkeypatch.setattr(merge, "MERGE_BLOCK_ELEMENTS", 1 << 16)  # T is 32 blocks, as the embedding at 1B is 16

    tracemalloc.start()
    try:
        plan_ = syncer.plan_commit(TakenRound(0, OpenRound(0.0, pending=pending), "due"), replica.state,
                                   replica.digest_after)
        _, commit_peak = tracemalloc.get_traced_memory()
        reason = plan_.reason
        entry = LogEntry(1, 1, EntryKind.OUTER_COMMIT, plan_.payload, fragment=0, round=replica.state.round(0) + 1,
                         digest=plan_.digest)
        del plan_
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        outcome = replica.apply(entry)
        _, apply_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert outcome.applied and not outcome.diverged, outcome.reason  # the preview's digest is the apply's
    assert "1 rebased" in reason
    # the merge's result (1T) and codec_down's encoder beside it (its work copy 1T, codes and bytes)
    assert commit_peak < 2.6 * tensor_bytes, f"plan_commit peak {commit_peak / tensor_bytes:.2f} T"
    # the decoded gradient (1T) and the new parameters and momentum (2T)
    assert apply_peak - base < 3.5 * tensor_bytes, f"apply peak {(apply_peak - base) / tensor_bytes:.2f} T"


# ------------------------------------------------------------------ the merge is pure; adopt moves the syncer


def _norm_round(syncer: Syncer, state, scale: float, now: float):
    """Two contributions of norm ~`scale` to fragment 0, merged now: (taken, plan), nothing adopted."""
    for learner in ("a", "b"):
        delta = {n: np.full(4, scale, np.float32) for n in PLAN.fragments[0].names}
        syncer.add(Contribution(learner, 0, 0, delta, 8, 256), now)
    step = syncer.step_round(0, now, ["a", "b"])
    assert step is not None and step.taken is not None, step
    return step.taken, syncer.plan_commit(step.taken, state)


def _syncer_state(syncer: Syncer) -> tuple:
    return (syncer.norm_ref.snapshot(), syncer.last_merge_reason, dict(syncer.last_merge_at),
            {p: dict(r.pending) for p, r in syncer.rounds.items()}, dict(syncer.last_decision))


def test_a_merge_computed_while_the_lease_is_lost_changes_no_syncer_state() -> None:
    """The former race: the merge ran on the codec pool and wrote the norm reference and the last
    reason from there while the event loop could lose the lease. Now the merge writes nothing, and
    a round taken under a lease that is gone is not adopted."""
    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.sync.global_state import GlobalState

    state = GlobalState(PLAN, {n: np.zeros(4, np.float32) for n in PLAN.names}, OuterOptimizer())
    syncer = Syncer(MANIFEST, PLAN, [])
    syncer.lease_gained({0: 1.0}, 0.0)
    before = _syncer_state(syncer)
    taken, plan = _norm_round(syncer, state, 2.0, 1.0)  # as on the pool: plan_commit in a worker
    assert plan.proposes and plan.merged is not None and plan.merged.norm_ref not in (None, 1.0)
    assert syncer.norm_ref.snapshot() == {0: 1.0} and syncer.last_merge_reason == before[1]  # the merge wrote nothing
    syncer.lease_lost()  # the event loop, while the merge was in the pool
    after_loss = _syncer_state(syncer)
    assert not syncer.adopt(taken, plan, 2.0)
    assert _syncer_state(syncer) == after_loss and after_loss[0] == {0: 1.0}
    # Lost and gained again before the merge came back: still another lease's round.
    taken, plan = _norm_round(syncer, state, 2.0, 3.0)
    syncer.lease_lost()
    syncer.lease_gained({0: 1.0}, 4.0)
    regained = _syncer_state(syncer)
    assert not syncer.adopt(taken, plan, 5.0) and _syncer_state(syncer) == regained


def test_only_an_adopted_round_moves_the_norm_reference_and_the_rate_limit() -> None:
    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.sync.global_state import GlobalState

    state = GlobalState(PLAN, {n: np.zeros(4, np.float32) for n in PLAN.names}, OuterOptimizer())
    syncer = Syncer(MANIFEST, PLAN, [])
    syncer.lease_gained({0: 1.0}, 0.0)
    _norm_round(syncer, state, 2.0, 1.0)  # dropped (e.g. the proposal was refused): never adopted
    assert syncer.norm_ref.get(0) == 1.0 and syncer.last_merge_at == {}
    taken, plan = _norm_round(syncer, state, 2.0, 2.0)
    assert plan.merged is not None
    assert plan.merged.norm_ref == syncer.norm_ref.advanced(1.0, plan.merged.result.round_median_norm)
    assert syncer.adopt(taken, plan, 2.5)
    assert syncer.norm_ref.get(0) == plan.merged.norm_ref != 1.0
    assert syncer.last_merge_at == {0: 2.5} and syncer.last_merge_reason == plan.reason
