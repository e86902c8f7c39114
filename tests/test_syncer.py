"""The Syncer's own bookkeeping: timing learners from their contributions, synchronous rounds'
members, the held decision, and the lease."""

from __future__ import annotations

import numpy as np

from diloco_node.config.manifest import RunManifest, SyncSpec
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.merge import Contribution
from diloco_node.sync.quorum import QuorumPolicy
from diloco_node.sync.syncer import HELD_RETRY_S, RoundRules, Syncer

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
    syncer.note_proposed(1, 4.0)
    syncer.lease_lost()
    assert syncer.rounds == {} and syncer.last_decision == {} and syncer.last_merge_at == {}
    assert syncer.waiting_contributions() == 0
