"""The Syncer's decisions and their reasons: held, wake, wait, synchronous rounds, the commit payload."""

import numpy as np
import pytest

from diloco_node.config.manifest import OuterOptimizer, RunManifest, SyncSpec
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.global_state import GlobalState
from diloco_node.sync.merge import Contribution
from diloco_node.sync.replica import CommitPayload
from diloco_node.sync.syncer import HELD, MERGE, WAIT, WAKE, Syncer, SyncerOptions

INITIAL = {"w": np.arange(8, dtype=np.float32).reshape(2, 4), "b": np.ones(4, np.float32)}
PLAN = plan_fragments({n: a.shape for n, a in INITIAL.items()}, 1, 8, 2)


def _syncer(min_quorum=1, **options) -> Syncer:
    manifest = RunManifest(sync=SyncSpec(fragments=1, period=8, overlap=2, min_quorum=min_quorum))
    return Syncer(manifest, [], SyncerOptions(**options))


def _contribution(learner, value=0.01, base=0):
    return Contribution(learner, 0, base, {n: np.full(a.shape, value, np.float32) for n, a in INITIAL.items()}, 8, 128)


def test_a_due_round_is_held_with_the_callers_reason_and_stays_open():
    syncer = _syncer()
    syncer.add(_contribution("a"), now=10.0)
    held = syncer.decide(0, 10.0, {"a", "b"}, held_by="a merge of another fragment is in flight")
    assert held.action == HELD and not held.merge_now and held.wake_at is None
    assert held.reason == ("merging: quorum 1/1 reached with 1 of 2; no grace window until step/quorum/sync "
                           "time is measured; held: a merge of another fragment is in flight")
    assert syncer.last_decision[0] == held.reason  # what /status shows
    assert 0 in syncer.rounds
    with pytest.raises(ValueError, match="cannot take a round the syncer decided to held"):
        syncer.take(0, held)
    behind = syncer.decide(0, 10.1, {"a", "b"}, held_by="replica behind its own log: applied 3 of 4")
    assert behind.action == HELD and behind.reason.endswith("; held: replica behind its own log: applied 3 of 4")
    merge = syncer.decide(0, 10.2, {"a", "b"})
    assert merge.action == MERGE and merge.reason.startswith("merging: quorum 1/1 reached with 1 of 2")
    assert syncer.take(0, merge).pending["a"][1] == 10.0 and syncer.rounds == {}


def test_grace_window_answers_wake_at_and_the_caller_is_not_asked_to_hold_a_waiting_round():
    syncer = _syncer()
    syncer.prime(step_s=1.0, quorum_s=0.0, sync_s=0.2)
    syncer.add(_contribution("a"), now=5.0)
    decision = syncer.decide(0, 5.0, {"a", "b", "c"}, held_by="a merge of another fragment is in flight")
    assert decision.action == WAKE and decision.wake_at == pytest.approx(5.9)
    assert decision.reason == ("quorum 1/1 reached at t=5.00 (1 of 3 arrived); waiting grace 0.90 s for "
                               "2 more live learners (until t=5.90)")


def test_below_quorum_waits_for_arrivals_and_counts_contributors_as_live():
    syncer = _syncer(min_quorum=3)
    syncer.add(_contribution("a"), now=1.0)
    decision = syncer.decide(0, 1.0, {"b"})  # a contributed, so it is live too: 2 live learners
    assert decision.action == WAIT and decision.wake_at is None
    assert decision.reason == ("waiting: 1 of 3 needed contributions; only 2 live learners, quorum K = 3 "
                               "cannot be reached until more learners are live")
    assert syncer.decide(1, 1.0, {"b"}) is None  # no open round for fragment 1


def test_synchronous_rounds_wait_for_every_live_member_of_the_round_only():
    syncer = _syncer(synchronous=True)
    syncer.add(_contribution("a"), now=1.0, members={"a", "b"})  # c joined after the round opened
    waiting = syncer.decide(0, 1.0, {"a", "b", "c"})
    assert waiting.action == WAIT and waiting.reason == "waiting: 1 of 2 needed contributions"
    dead = syncer.decide(0, 2.0, {"a", "c"})  # b died: the round's live members have all arrived
    assert dead.action == MERGE and dead.reason == "merging: all 1 live learner arrived"
    with pytest.raises(ValueError, match="needs the live learners' names"):
        syncer.decide(0, 2.0, 3)


def test_step_time_comes_from_a_learners_pushes_and_an_absence_is_not_a_step_time():
    syncer = _syncer()
    syncer.add(_contribution("a"), now=0.0)
    syncer.add(_contribution("a"), now=8.0)  # one period of 8 steps later: 1 s per step
    assert syncer.xi_step.value == 1.0
    syncer.decide(0, 8.0, {"b"})  # a is no longer live: its last push is forgotten
    syncer.add(_contribution("a"), now=300.0)  # back after an outage: no sample from the gap
    assert syncer.xi_step.value == 1.0


def test_the_plan_carries_the_commit_payload_every_replica_decodes():
    syncer = _syncer()
    state = GlobalState(PLAN, INITIAL, OuterOptimizer())
    syncer.add(_contribution("b", 0.02), now=1.0, transfer_s=0.1)
    syncer.add(_contribution("a", 0.01), now=1.0, transfer_s=0.3)
    decision = syncer.decide(0, 1.0, {"a", "b"})
    plan = syncer.plan_commit(0, syncer.take(0, decision), state, None, decision.reason)
    assert plan.merged is not None and plan.digest == "" and not plan.failed
    payload = CommitPayload.decode(plan.payload)
    assert payload.contributors == ("a", "b") == plan.merged.contributors
    assert payload.delta == plan.merged.encoded and payload.norm_ref == plan.merged.norm_ref
    assert plan.reason.startswith("fragment 0: merging: all 2 live learners arrived; merged 2 of 2 contribution(s)")
    assert syncer.xi_sync.value == pytest.approx(0.2)  # mean upload, no link model for the download


def test_a_round_with_nothing_acceptable_plans_no_commit_and_says_why():
    syncer = _syncer()
    state = GlobalState(PLAN, INITIAL, OuterOptimizer())
    syncer.add(Contribution("a", 0, 0, {"w": np.zeros((2, 4), np.float32)}, 8, 128), now=1.0)
    decision = syncer.decide(0, 1.0, {"a"})
    plan = syncer.plan_commit(0, syncer.take(0, decision), state, None, decision.reason)
    assert plan.merged is None and plan.payload == b"" and not plan.failed
    assert plan.reason.startswith("fragment 0: nothing to commit (fragment 0: merging: all 1 live learner arrived; "
                                  "nothing to merge for fragment 0: all 1 contribution(s) rejected; rejected learner a")
