"""One node's relay state machine: pushes once, waits with a heartbeat, climbs the tree, never takes altered bytes."""

from __future__ import annotations

import pytest

from bootstrap.entries import EntryKind, LogEntry
from bootstrap.messages import AppendEntries
from bootstrap.relay_plane import (
    Deliver,
    Metadata,
    PayloadHop,
    PayloadRelay,
    PayloadRequest,
    SendPayload,
    SendRequest,
    WakeAt,
    payload_digest,
    sends_of,
)
from bootstrap.relay_tree import plan_relay_tree
from wire.errors import LocalProtocolError

TREE = plan_relay_tree("h", ["a", "b", "c", "d", "e", "f"], fanout=2)  # h -> a, b; a -> c, d; b -> e, f


class Store(dict):
    def put(self, digest: bytes, payload: bytes) -> None:
        self[digest] = payload


def entry(index: int, payload: bytes = b"", kind: EntryKind = EntryKind.OUTER_COMMIT) -> LogEntry:
    return LogEntry(1, index, kind, payload, fragment=0, round=index, digest=f"d{index}")


def append(*entries: LogEntry, prev: int = 0) -> AppendEntries:
    return AppendEntries(epoch=1, leader_id="h", prev_index=prev, prev_epoch=1 if prev else 0,
                         entries=tuple(entries), leader_commit=prev, sent_at=0.0)


def test_the_holder_pushes_each_payload_once_to_its_children_and_keeps_it():
    holder = PayloadRelay("h", Store())
    message = append(entry(1, b"delta-1"), entry(2, kind=EntryKind.NOOP))
    metadata, actions = holder.outgoing(message, TREE)
    assert metadata == Metadata(message, TREE)
    assert [(a.to, a.hop.payload) for a in actions] == [("a", b"delta-1"), ("b", b"delta-1")]
    assert holder.store[payload_digest(b"delta-1")] == b"delta-1"
    _, again = holder.outgoing(message, TREE)  # a resend of the same entries: metadata only
    assert again == [] and sends_of(actions) == 2


def test_a_follower_without_the_bytes_answers_a_heartbeat_then_waits():
    follower = PayloadRelay("c", Store())
    metadata = Metadata(append(entry(1, b"x"), prev=0), TREE)
    actions = follower.on_metadata(metadata, now=10.0)
    assert actions == [Deliver(append(prev=0)), WakeAt(10.5, 1)]
    # Another copy right away: no second partial answer (it would make the holder resend at once).
    assert follower.on_metadata(metadata, now=10.1) == [WakeAt(10.6, 2)]
    # After partial_every_s the heartbeat goes out again, so the holder's lease stays renewed.
    assert follower.on_metadata(metadata, now=10.3)[0] == Deliver(append(prev=0))


def test_only_the_prefix_whose_bytes_are_held_is_delivered_early():
    store = Store()
    store.put(payload_digest(b"one"), b"one")
    follower = PayloadRelay("c", store)
    metadata = Metadata(append(entry(1, b"one"), entry(2, b"two"), entry(3, b"three")), TREE)
    first = follower.on_metadata(metadata, now=0.0)[0]
    assert isinstance(first, Deliver) and [e.index for e in first.message.entries] == [1]


def test_arriving_bytes_are_passed_down_the_tree_and_complete_the_waiting_append():
    relay = PayloadRelay("a", Store())
    message = append(entry(1, b"delta"))
    relay.on_metadata(Metadata(message, TREE), now=0.0)
    actions = relay.on_payload(PayloadHop(payload_digest(b"delta"), b"delta", TREE))
    assert [(a.to, a.hop.payload) for a in actions if isinstance(a, SendPayload)] == [("c", b"delta"), ("d", b"delta")]
    assert [a for a in actions if isinstance(a, Deliver)] == [Deliver(message)]
    assert relay.waiting == {}
    # The same bytes again (a fetch answer, a duplicate): kept, not forwarded twice.
    assert relay.on_payload(PayloadHop(payload_digest(b"delta"), b"delta", TREE)) == []


def test_altered_bytes_are_refused_and_change_nothing():
    relay = PayloadRelay("a", Store())
    message = append(entry(1, b"delta"))
    relay.on_metadata(Metadata(message, TREE), now=0.0)
    assert relay.on_payload(PayloadHop(payload_digest(b"delta"), b"delta!", TREE)) == []
    assert relay.refused == 1 and relay.store == {} and len(relay.waiting) == 1


def test_a_follower_climbs_the_tree_for_missing_bytes_and_ends_at_the_holder():
    relay = PayloadRelay("c", Store(), timeout_s=1.0)
    relay.on_metadata(Metadata(append(entry(1, b"delta")), TREE), now=0.0)
    asked = []
    for now in (1.0, 2.0, 3.0, 4.0):
        actions = relay.on_wake(1, now)
        asked += [a.to for a in actions if isinstance(a, SendRequest)]
        assert actions[-1] == WakeAt(now + 1.0, 1)
    assert asked == ["a", "h", "h", "h"]  # parent, then the holder (c's only ancestors)
    assert relay.on_wake(99, 5.0) == []  # no such wait: nothing to do


def test_requests_are_answered_from_the_store_only():
    relay = PayloadRelay("a", Store({payload_digest(b"p"): b"p"}))
    answer = relay.on_request(PayloadRequest("c", payload_digest(b"p")))
    assert answer == [SendPayload("c", PayloadHop(payload_digest(b"p"), b"p", None))]
    assert relay.on_request(PayloadRequest("c", payload_digest(b"unknown"))) == []


def test_a_restart_forgets_waiting_appends_but_keeps_stored_bytes():
    store = Store()
    relay = PayloadRelay("c", store)
    relay.on_metadata(Metadata(append(entry(1, b"x")), TREE), now=0.0)
    relay.on_payload(PayloadHop(payload_digest(b"other"), b"other", None))
    relay.forget_waiting()
    assert relay.waiting == {} and store == {payload_digest(b"other"): b"other"}


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"timeout_s": 0}, "relay timeout_s must be > 0"),
    ({"partial_every_s": -1}, "relay partial_every_s must be > 0"),
])
def test_bad_settings_are_refused(kwargs, why):
    with pytest.raises(LocalProtocolError, match=why):
        PayloadRelay("a", Store(), **kwargs)


def test_only_the_root_of_the_tree_sends_appends_down_it():
    with pytest.raises(LocalProtocolError, match="a sends appends down a tree rooted at h"):
        PayloadRelay("a", Store()).outgoing(append(entry(1, b"x")), TREE)


def test_the_holders_set_of_pushed_digests_is_bounded_and_forgets_the_oldest():
    from bootstrap.relay_plane import MAX_PUSHED_DIGESTS

    holder = PayloadRelay("h", Store())
    first = payload_digest(b"delta-1")
    holder.outgoing(append(entry(1, b"delta-1")), TREE)
    for index in range(2, MAX_PUSHED_DIGESTS + 2):
        holder.mark_pushed(index.to_bytes(32, "big"))
    assert len(holder.pushed) == MAX_PUSHED_DIGESTS  # 32 B each: ~128 KiB, whatever the run's length
    assert first not in holder.pushed and (MAX_PUSHED_DIGESTS + 1).to_bytes(32, "big") in holder.pushed
    # A forgotten entry sent again goes down the tree again: traffic, never a wrong byte.
    _, actions = holder.outgoing(append(entry(1, b"delta-1")), TREE)
    assert [a.to for a in actions] == ["a", "b"] and len(holder.pushed) == MAX_PUSHED_DIGESTS


def test_bytes_the_host_verified_while_they_streamed_are_kept_and_passed_on_without_rehashing():
    relay = PayloadRelay("a", Store())
    handle = object()  # the host's spool file: opaque to the relay plane
    actions = relay.on_verified(PayloadHop(payload_digest(b"delta-1"), handle, TREE))
    assert relay.store[payload_digest(b"delta-1")] is handle
    assert [(x.to, x.hop.payload) for x in actions] == [("c", handle), ("d", handle)]
