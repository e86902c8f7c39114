"""Election and lease: the pure vote and lease decisions, and the Election state machine."""

from __future__ import annotations

import random

import pytest

from bootstrap.election import (
    Election,
    ElectionState,
    LeaseTiming,
    Role,
    decide_vote,
    lease_expiry,
)
from bootstrap.entries import ClusterConfig
from bootstrap.messages import VoteRequest, VoteResponse
from wire.errors import LocalProtocolError

CONFIG = ClusterConfig.of(["a", "b", "c"])
TIMING = LeaseTiming()


def vote(request: VoteRequest, **overrides):
    arguments = dict(current_epoch=3, voted_for=None, our_last_log=(3, 10), heard_leader_at=None,
                     leader_id=None, now=100.0, lease_s=3.0)
    arguments.update(overrides)
    return decide_vote(request, **arguments)


def test_vote_granted_to_up_to_date_candidate_in_new_epoch():
    decision = vote(VoteRequest(4, "b", 3, 10))
    assert decision.granted and decision.adopt_epoch
    assert decision.reason == "granted to b for epoch 4"


def test_vote_refused_for_stale_epoch():
    decision = vote(VoteRequest(2, "b", 3, 10))
    assert not decision.granted and not decision.adopt_epoch
    assert decision.reason == "stale epoch 2 < our epoch 3"


def test_vote_refused_silently_while_lease_holder_is_live():
    decision = vote(VoteRequest(9, "b", 9, 99), heard_leader_at=98.5, leader_id="a")
    assert not decision.granted and decision.silent and not decision.adopt_epoch
    assert decision.reason == "lease holder a heard 1.50s ago, within the 3.00s lease"


def test_vote_after_lease_time_has_passed_on_our_clock():
    assert vote(VoteRequest(4, "b", 3, 10), heard_leader_at=97.0, leader_id="a").granted


def test_one_vote_per_epoch():
    decision = vote(VoteRequest(3, "c", 3, 10), voted_for="b")
    assert not decision.granted
    assert decision.reason == "already voted for b in epoch 3"
    assert vote(VoteRequest(3, "b", 3, 10), voted_for="b").granted  # a retried request is fine


@pytest.mark.parametrize("last", [(2, 50), (3, 9)])
def test_vote_refused_to_candidate_with_older_log(last):
    decision = vote(VoteRequest(4, "b", *last))
    assert not decision.granted and decision.adopt_epoch  # the epoch still moves forward
    assert "is behind ours (epoch 3, index 10)" in decision.reason


def test_lease_expiry_needs_a_majority_and_dates_from_the_oldest_member_of_it():
    until, reason = lease_expiry(config=CONFIG, self_id="a", now=10.0, renewal_sent_at={}, span_s=2.0)
    assert until is None and reason == "renewals from 1 of 3 voters, need 2"
    until, reason = lease_expiry(config=CONFIG, self_id="a", now=10.0,
                                 renewal_sent_at={"b": 9.0, "c": 8.0}, span_s=2.0)
    assert until == 11.0 and reason == "renewed by 2 of 3 voters"


def test_leader_lease_span_is_shortened_for_drift_and_margin():
    timing = LeaseTiming(lease_s=3.0, max_drift_rate=0.01, safety_margin_s=0.1)
    assert timing.leader_lease_span_s == pytest.approx(3.0 * 0.99 / 1.01 - 0.1)
    # Worst case: leader clock slow (real span longer), follower clock fast (real promise shorter).
    assert timing.leader_lease_span_s / (1 - 0.01) < 3.0 / (1 + 0.01)


def test_timing_rejects_heartbeat_that_cannot_renew_in_time():
    with pytest.raises(LocalProtocolError, match="heartbeat interval"):
        LeaseTiming(lease_s=1.0, heartbeat_interval_s=0.8)


def make(node_id="a", now=0.0):
    return Election(node_id, ElectionState(current_epoch=1), TIMING, random.Random(1), now)


def test_no_campaign_within_lease_after_start_then_pre_vote_then_campaign():
    election = make()
    assert election.campaign_if_due(1.0, CONFIG, (1, 1)) == []
    requests = election.campaign_if_due(10.0, CONFIG, (1, 1))
    assert requests == [VoteRequest(2, "a", 1, 1, pre_vote=True)]
    assert election.role is Role.FOLLOWER and election.epoch == 1  # a pre-vote changes nothing yet
    became, requests = election.handle_vote_response(VoteResponse(2, "b", True, "ok", pre_vote=True), 10.01, CONFIG, (1, 1))
    assert not became and requests == [VoteRequest(2, "a", 1, 1)]
    assert election.role is Role.CANDIDATE and election.state.voted_for == "a" and election.epoch == 2


def test_pre_vote_changes_no_state_on_the_voter():
    voter = make("b")
    response = voter.handle_vote_request(VoteRequest(7, "a", 1, 1, pre_vote=True), 10.0, (1, 1))
    assert response == VoteResponse(7, "b", True, "granted to a for epoch 7", pre_vote=True)
    assert voter.epoch == 1 and voter.state.voted_for is None
    assert voter.last_vote_reason == "pre-vote for a epoch 7: granted to a for epoch 7"
    refused = voter.handle_vote_request(VoteRequest(7, "a", 0, 0, pre_vote=True), 10.0, (1, 1))
    assert refused is not None and not refused.granted and refused.epoch == 1


def test_non_voter_never_campaigns():
    election = make("z")
    assert election.campaign_if_due(100.0, CONFIG, (1, 1)) == []
    assert election.role is Role.FOLLOWER


def win(election: Election, now: float = 10.0) -> None:
    election.campaign_if_due(now, CONFIG, (1, 1))
    election.handle_vote_response(VoteResponse(2, "b", True, "ok", pre_vote=True), now, CONFIG, (1, 1))
    became, _ = election.handle_vote_response(VoteResponse(2, "b", True, "ok"), now + 0.01, CONFIG, (1, 1))
    assert became


def test_majority_of_votes_makes_leader_but_lease_starts_with_first_renewal():
    election = make()
    win(election)
    assert election.role is Role.LEADER and not election.lease_active(10.02)
    election.record_renewal("b", 2, sent_at=10.05, now=10.1, config=CONFIG)
    assert election.lease_active(10.1)
    assert election.lease_until == pytest.approx(10.05 + TIMING.leader_lease_span_s)


def test_step_down_when_renewals_stop():
    election = make()
    win(election)
    election.record_renewal("b", 2, sent_at=10.05, now=10.1, config=CONFIG)
    assert not election.check_lease(11.0)
    assert election.check_lease(10.05 + TIMING.leader_lease_span_s + 0.01)
    assert election.role is Role.FOLLOWER
    assert election.last_step_down_reason.startswith("lease expired: lost contact with a majority")
    assert "newest acknowledged heartbeats: b 2.9s ago" in election.last_step_down_reason


def test_a_paused_holder_may_not_send_as_leader_once_its_lease_has_run_out():
    """A holder paused past its lease (SIGSTOP) must not let queued leader messages out before
    its ticker notices: each one would renew a follower's promise to it for another lease."""
    election = make()
    assert not election.may_act_as_leader(9.0)  # a follower never sends leader messages
    win(election)
    span = TIMING.leader_lease_span_s
    assert election.may_act_as_leader(10.02)  # just won, no acknowledgement yet
    assert not election.may_act_as_leader(10.01 + span + 0.01)  # never acknowledged
    election.record_renewal("b", 2, sent_at=10.05, now=10.1, config=CONFIG)
    assert election.may_act_as_leader(10.05 + span - 0.01)
    paused_until = 10.05 + span + 1.5
    assert not election.may_act_as_leader(paused_until)
    assert election.role is Role.LEADER  # a pure query: stepping down is check_lease's job
    assert election.check_lease(paused_until) and not election.may_act_as_leader(paused_until)


def test_step_down_on_higher_epoch():
    election = make()
    win(election)
    assert election.observe_epoch(7, 11.0, "c")
    assert election.role is Role.FOLLOWER and election.epoch == 7 and election.state.voted_for is None
    assert election.last_step_down_reason == "saw higher epoch 7 from c"


def test_leader_ignores_vote_requests_and_keeps_epoch():
    election = make()
    win(election)
    assert election.handle_vote_request(VoteRequest(5, "c", 9, 9), 10.5, (2, 2)) is None
    assert election.epoch == 2 and election.role is Role.LEADER
    assert "lease holder a heard 0.00s ago" in election.last_vote_reason


def test_follower_refuses_stale_leader():
    election = make()
    election.observe_epoch(5, 1.0, "c")
    accepted, reason = election.accept_leader(4, "b", 2.0)
    assert not accepted and reason == "stale epoch 4 < our epoch 5"
    accepted, reason = election.accept_leader(5, "c", 2.0)
    assert accepted and reason == "following c in epoch 5" and election.heard_leader_at == 2.0


def test_epoch_never_decreases():
    election = make()
    election.observe_epoch(5, 1.0, "c")
    assert not election.observe_epoch(3, 2.0, "b")
    assert election.epoch == 5


def test_a_vote_floor_refuses_candidates_behind_what_the_node_may_have_acknowledged():
    """Its log cut back to (3, 6), the node had (3, 10) durable: only candidates at least that far."""
    floor = (3, 10)
    behind = vote(VoteRequest(4, "b", 3, 8), our_last_log=(3, 6), vote_floor=floor)
    assert not behind.granted and behind.adopt_epoch
    assert "behind what this node may have acknowledged before its log lost entries (epoch 3, index 10)" in behind.reason
    assert vote(VoteRequest(4, "b", 3, 10), our_last_log=(3, 6), vote_floor=floor).granted
    assert vote(VoteRequest(4, "b", 4, 7), our_last_log=(3, 6), vote_floor=floor).granted  # a newer epoch's log
    assert vote(VoteRequest(4, "b", 3, 8), our_last_log=(3, 6)).granted  # without the floor: by its own log


def test_a_node_with_a_vote_floor_does_not_stand_until_its_log_is_back():
    election = Election("a", ElectionState(3, None), TIMING, random.Random(0), now=0.0)
    election.vote_floor = (3, 10)
    assert election.campaign_if_due(100.0, CONFIG, (3, 6)) == []
    assert "not standing" in election.last_vote_reason and election.role is Role.FOLLOWER
    assert not election.lift_vote_floor((3, 9)) and election.vote_floor == (3, 10)
    assert election.lift_vote_floor((4, 7)) and election.vote_floor is None
    assert election.campaign_if_due(200.0, CONFIG, (4, 7))  # it stands again (a pre-vote round)
