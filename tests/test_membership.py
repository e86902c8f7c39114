"""Membership: bootstrap join, SWIM probes (direct and indirect), suspicion, refutation, death, leave."""

from __future__ import annotations

import random

import pytest

from bootstrap.membership import Membership, SwimTiming
from bootstrap.messages import (
    JoinReply,
    JoinRequest,
    MemberRecord,
    MemberRole,
    MemberState,
    Ping,
    PingAck,
    PingRequest,
    Send,
)
from wire.errors import LocalProtocolError, RemoteProtocolError

TIMING = SwimTiming(probe_interval_s=1.0, probe_timeout_s=0.4, indirect_probes=3, suspect_timeout_s=5.0)


def member(node_id: str, role: MemberRole = MemberRole.LEARNER) -> Membership:
    return Membership(node_id, f"10.0.0.{node_id}:7000", role, 1, random.Random(node_id), 0.0, TIMING)


def deliver(sends: list[Send], nodes: dict[str, Membership], now: float, drop_to: set[str] = frozenset()) -> None:
    """Deliver messages breadth-first until quiet (a perfect network, except for `drop_to`)."""
    queue = list(sends)
    while queue:
        send = queue.pop(0)
        if send.to in nodes and send.to not in drop_to:
            queue += nodes[send.to].handle(send.message, now)


def cluster(*ids: str) -> dict[str, Membership]:
    nodes = {node_id: member(node_id) for node_id in ids}
    for node_id in ids[1:]:
        deliver(nodes[node_id].start_join([ids[0]], 0.0), nodes, 0.0)
    for _ in range(5):  # let gossip spread the joins
        for node in nodes.values():
            deliver(node.tick(_ + 1.0), nodes, _ + 1.0)
    return nodes


def test_join_through_bootstrap_peer_learns_everyone():
    nodes = {"1": member("1"), "2": member("2", MemberRole.WITNESS)}
    sends = nodes["2"].start_join(["1"], 0.0)
    assert sends == [Send("1", JoinRequest(nodes["2"].members["2"]))]
    assert not nodes["2"].joined
    deliver(sends, nodes, 0.0)
    assert nodes["2"].joined and nodes["2"].last_reason == "joined: welcome, 2 members"
    assert nodes["1"].record("2").role is MemberRole.WITNESS
    assert nodes["2"].alive_ids() == ["1", "2"]


def test_join_retries_through_the_next_bootstrap_peer():
    node = member("9")
    first = node.start_join(["1", "2"], 0.0)
    assert first[0].to == "1"
    assert not [s for s in node.tick(1.0) if isinstance(s.message, JoinRequest)]  # not yet
    retry = [s for s in node.tick(2.5) if isinstance(s.message, JoinRequest)]
    assert [s.to for s in retry] == ["2"]


def test_join_needs_a_peer_other_than_ourselves():
    with pytest.raises(LocalProtocolError, match="no bootstrap peer"):
        member("1").start_join(["1"], 0.0)


def test_gossip_spreads_membership():
    nodes = cluster("1", "2", "3", "4")
    for node in nodes.values():
        assert node.alive_ids() == ["1", "2", "3", "4"]


def run_probe_cycle(nodes: dict[str, Membership], prober: str, start: float, drop_to: set[str]) -> list[Send]:
    """Tick the prober through one interval; returns everything it sent."""
    sent: list[Send] = []
    for step in range(12):
        now = start + step * 0.1
        sends = nodes[prober].tick(now)
        sent += sends
        deliver(sends, nodes, now, drop_to)
    return sent


def test_indirect_probe_saves_a_member_behind_a_bad_direct_link():
    nodes = cluster("1", "2", "3", "4", "5")
    prober = nodes["1"]
    prober.probe_next("2", at=10.0)
    # Drop the direct ping 1 -> 2 only: helpers still reach 2.
    sent: list[Send] = []
    for step in range(12):
        now = 10.0 + step * 0.1
        sends = prober.tick(now)
        sent += sends
        for send in sends:
            if isinstance(send.message, Ping) and send.to == "2":
                continue
            deliver([send], nodes, now)
    assert any(isinstance(s.message, PingRequest) for s in sent)
    assert prober.state_of("2") is MemberState.ALIVE


def test_unreachable_member_is_suspected_then_declared_dead():
    nodes = cluster("1", "2", "3")
    prober = nodes["1"]
    prober.probe_next("3", at=10.0)
    run_probe_cycle(nodes, "1", 10.0, drop_to={"3"})
    assert prober.state_of("3") is MemberState.SUSPECT
    assert prober.last_reason == "3 suspected: no direct or indirect ack within 1.0s"
    prober.tick(16.5)
    assert prober.state_of("3") is MemberState.DEAD
    assert prober.last_reason == "3 declared dead: suspected for 5.0s without refuting"


def test_no_indirect_probes_without_enough_members():
    nodes = cluster("1", "2")
    nodes["1"].probe_next("2", at=10.0)
    sent = run_probe_cycle(nodes, "1", 10.0, drop_to={"2"})
    assert not any(isinstance(s.message, PingRequest) for s in sent)
    assert nodes["1"].state_of("2") is MemberState.SUSPECT


def test_suspected_member_refutes_with_higher_incarnation():
    node = member("2")
    rumour = MemberRecord("2", "x", MemberRole.LEARNER, 1, MemberState.SUSPECT)
    replies = node.handle(Ping(7, "1", (rumour,)), 3.0)
    assert node.incarnation == 2 and node.last_reason == "refuted suspect rumour at incarnation 1"
    ack = replies[0].message
    assert isinstance(ack, PingAck) and any(r.node_id == "2" and r.incarnation == 2 for r in ack.updates)


def test_alive_with_higher_incarnation_overrides_dead_but_stale_alive_does_not():
    node = member("1")
    dead = MemberRecord("2", "", MemberRole.LEARNER, 3, MemberState.DEAD)
    node.handle(Ping(1, "3", (dead,)), 0.0)
    node.handle(Ping(2, "3", (MemberRecord("2", "", MemberRole.LEARNER, 3, MemberState.ALIVE),)), 0.0)
    assert node.state_of("2") is MemberState.DEAD
    node.handle(Ping(3, "3", (MemberRecord("2", "", MemberRole.LEARNER, 4, MemberState.ALIVE),)), 0.0)
    assert node.state_of("2") is MemberState.ALIVE


def test_graceful_leave_is_announced_to_everyone():
    nodes = cluster("1", "2", "3")
    sends = nodes["3"].leave(20.0)
    assert sorted(s.to for s in sends) == ["1", "2"]
    deliver(sends, nodes, 20.0)
    assert nodes["1"].state_of("3") is MemberState.LEFT and nodes["2"].state_of("3") is MemberState.LEFT
    assert nodes["3"].handle(Ping(1, "1", ()), 21.0) == []  # a leaver answers nothing


def test_bad_records_are_rejected_with_a_clear_error():
    with pytest.raises(RemoteProtocolError, match="unknown member role"):
        MemberRecord("1", "", "trainer", 1, MemberState.ALIVE)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError, match="incarnation"):
        MemberRecord("1", "", MemberRole.LEARNER, -1, MemberState.ALIVE)


def test_join_reply_lists_members_in_a_fixed_order():
    nodes = cluster("1", "2", "3")
    reply = nodes["1"].handle(JoinRequest(MemberRecord("4", "", MemberRole.WITNESS, 1, MemberState.ALIVE)), 30.0)
    message = reply[0].message
    assert isinstance(message, JoinReply) and message.accepted
    assert [r.node_id for r in message.members] == ["1", "2", "3", "4"]


def test_two_joining_nodes_do_not_form_an_island():
    first, second = member("4"), member("5")
    first.start_join(["5"], 0.0)
    second.start_join(["4"], 0.0)
    reply = second.handle(JoinRequest(first.members["4"]), 0.1)
    assert reply == [Send("4", JoinReply(False, "5 has not joined a run yet", ()))]
    first.handle(reply[0].message, 0.1)
    assert not first.joined and first.last_reason == "join refused: 5 has not joined a run yet"
