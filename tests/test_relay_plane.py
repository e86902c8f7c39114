"""One node's relay state machines: the relay pushes once, waits with a heartbeat and never takes altered
bytes; its follower wants, wakes, climbs the tree, trusts and makes promises within bounds, and gives up,
each decision with its reason."""

from __future__ import annotations

import pytest

from bootstrap.entries import EntryKind, LogEntry
from bootstrap.messages import AppendEntries
from bootstrap.relay_plane import (
    GIVE_UP_S,
    MAX_PROMISED_ASKERS,
    MAX_PROMISED_PAYLOADS,
    MAX_RECENT_DECISIONS,
    PROMISE_BYTES_PER_S,
    PROMISE_TIMEOUTS,
    Decline,
    Deliver,
    Fetch,
    FetchAnswer,
    Metadata,
    PayloadHop,
    PayloadRelay,
    Promise,
    RelayFollower,
    Release,
    SendPayload,
    Serve,
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
    assert actions == [Deliver(append(prev=0)), WakeAt(10.5, payload_digest(b"x"))]
    # Another copy right away: no second partial answer (it would make the holder resend at once),
    # and the payload is wanted already.
    assert follower.on_metadata(metadata, now=10.1) == []
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
    actions = relay.on_payload(PayloadHop(payload_digest(b"delta"), b"delta", TREE), now=0.1)
    assert [(a.to, a.hop.payload) for a in actions if isinstance(a, SendPayload)] == [("c", b"delta"), ("d", b"delta")]
    assert [a for a in actions if isinstance(a, Deliver)] == [Deliver(message)]
    assert [a for a in actions if isinstance(a, Release)] == [Release(payload_digest(b"delta"), "the bytes are here")]
    assert relay.waiting == {} and relay.follower.wants == {}
    # The same bytes again (a fetch answer, a duplicate): kept, not forwarded twice.
    assert relay.on_payload(PayloadHop(payload_digest(b"delta"), b"delta", TREE), now=0.2) == []


def test_altered_bytes_are_refused_and_change_nothing():
    relay = PayloadRelay("a", Store())
    message = append(entry(1, b"delta"))
    relay.on_metadata(Metadata(message, TREE), now=0.0)
    assert relay.on_payload(PayloadHop(payload_digest(b"delta"), b"delta!", TREE), now=0.1) == []
    assert relay.refused == 1 and relay.store == {} and len(relay.waiting) == 1


def test_a_restart_forgets_waiting_appends_but_keeps_stored_bytes():
    store = Store()
    relay = PayloadRelay("c", store)
    relay.on_metadata(Metadata(append(entry(1, b"x")), TREE), now=0.0)
    relay.on_payload(PayloadHop(payload_digest(b"other"), b"other", TREE), now=0.1)
    relay.forget_waiting()
    assert relay.waiting == {} and store == {payload_digest(b"other"): b"other"}
    assert relay.follower.wants == {} and relay.follower.trees == {}


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
    actions = relay.on_verified(PayloadHop(payload_digest(b"delta-1"), handle, TREE), now=0.0)
    assert relay.store[payload_digest(b"delta-1")] is handle
    assert [(x.to, x.hop.payload) for x in actions] == [("c", handle), ("d", handle)]


# ---------------------------------------------------------------- the follower, by digest alone

D1, D2 = payload_digest(b"delta-1"), payload_digest(b"delta-2")


def follower(node_id: str = "c", store: Store | None = None, *, timeout_s: float = 1.0) -> RelayFollower:
    """A follower that knows TREE (a push came down it): c's sources are a, then the holder h."""
    relay = RelayFollower(node_id, Store() if store is None else store, timeout_s=timeout_s)
    relay.learn_tree(TREE)
    return relay


def fetches(actions) -> list[str]:
    return [a.to for a in actions if isinstance(a, Fetch)]


def test_a_fresh_commit_waits_one_timeout_for_its_push_a_committed_one_is_fetched_at_once():
    relay = follower()
    assert relay.want(D1, "h", 0.0, catching_up=False) == [WakeAt(1.0, D1)]
    actions = relay.want(D2, "h", 0.0, catching_up=True)
    assert fetches(actions) == ["a"] and actions[-1] == WakeAt(1.0, D2)
    assert "committed before it reached us (catching up): fetch at once: ask a (parent in h's tree)" in actions[0].reason
    assert relay.want(D1, "h", 0.5, catching_up=False) == []  # wanted again: nothing new, its give-up clock restarts
    assert relay.wants[D1].last_wanted == 0.5
    held = follower(store=Store({D1: b"delta-1"}))
    assert held.want(D1, "h", 0.0, catching_up=True) == [] and held.wants == {}  # here already


def test_a_follower_climbs_parent_each_ancestor_then_the_holder_and_stays_there():
    relay = follower("g", timeout_s=1.0)  # a fourth level: g's parent is c, then a, then the holder
    deep = plan_relay_tree("h", ["a", "b", "c", "d", "e", "f", "g"], fanout=2)
    relay.learn_tree(deep)
    assert deep.fetch_sources("g") == ("c", "a", "h")
    relay.want(D1, "h", 0.0, catching_up=False)
    asked = []
    for now in (1.0, 2.0, 3.0, 4.0):
        actions = relay.on_wake(D1, now)
        asked += fetches(actions)
        assert actions[-1] == WakeAt(now + 1.0, D1)
        for fetch in (a for a in actions if isinstance(a, Fetch)):
            relay.on_fetch_answer(fetch.to, D1, FetchAnswer.UNREACHABLE, now)  # nobody answers
    assert asked == ["c", "a", "h", "h"]
    assert relay.on_wake(D2, 5.0) == []  # nothing wanted: nothing to do
    unknown = RelayFollower("z", Store())  # no push reached it yet: the holder is its only source
    unknown.want(D1, "h", 0.0, catching_up=True)
    assert unknown.sources("h") == ("h",)


def test_a_stream_that_makes_progress_is_no_stall_and_one_that_stops_is():
    relay = follower()
    relay.want(D1, "h", 0.0, catching_up=False)
    relay.on_stream(D1, "stream-1", 4096)
    assert fetches(relay.on_wake(D1, 1.0)) == []  # moving: wait on
    relay.on_stream(D1, "stream-1", 8192)
    assert fetches(relay.on_wake(D1, 2.0)) == []
    assert fetches(relay.on_wake(D1, 3.0)) == ["a"]  # no byte since the last wake: climb
    assert "a stream of them is arriving (no stall)" in " ".join(relay.recent(3.0))


def test_an_accepted_fetch_is_trusted_for_the_promise_window_then_the_next_source_is_asked():
    relay = follower(timeout_s=1.0)
    size = 32 * 1024 * 1024  # two seconds at the planned relay rate
    relay.want(D1, "h", 0.0, catching_up=False, size=size)
    assert fetches(relay.on_wake(D1, 1.0)) == ["a"]
    relay.on_fetch_answer("a", D1, FetchAnswer.ACCEPTED, 1.1)
    window = PROMISE_TIMEOUTS * 1.0 + size / PROMISE_BYTES_PER_S
    assert relay.promise_window(size) == window == 6.0
    for now in (2.1, 4.1, 7.0):  # within 1.1 + 6.0: a parent still receiving them is no stall
        assert fetches(relay.on_wake(D1, now)) == []
    actions = relay.on_wake(D1, 7.2)
    assert fetches(actions) == ["h"] and "a's promise ran out without the bytes" in actions[0].reason
    assert relay.counts["promises_expired"] == 1


def test_a_catching_up_follower_does_not_wait_on_a_promise():
    relay = follower(timeout_s=1.0)
    assert fetches(relay.want(D1, "h", 0.0, catching_up=True)) == ["a"]
    relay.on_fetch_answer("a", D1, FetchAnswer.ACCEPTED, 0.1)
    assert fetches(relay.on_wake(D1, 1.0)) == ["h"]  # climbs on at its usual pace


def test_a_declined_or_unanswered_fetch_climbs_on_at_the_next_wake():
    relay = follower()
    relay.want(D1, "h", 0.0, catching_up=True)
    assert relay.on_fetch_answer("a", D1, FetchAnswer.DECLINED, 0.2) == []
    assert "a declined our fetch: climb on at the next wake" in relay.recent(0.2)[0]
    assert fetches(relay.on_wake(D1, 1.0)) == ["h"]


def test_one_fetch_in_flight_per_source_the_next_goes_when_it_is_answered():
    relay = follower()
    d3 = payload_digest(b"delta-3")
    assert fetches(relay.want(D1, "h", 0.0, catching_up=True)) == ["a"]
    assert fetches(relay.want(D2, "h", 0.0, catching_up=True)) == []  # queued behind D1's fetch to a
    assert fetches(relay.want(d3, "h", 0.0, catching_up=True)) == []
    assert relay.queued == {"a": [D2, d3]}
    relay.store.put(D2, b"delta-2")  # D2 came some other way meanwhile: its queued fetch is skipped
    relay.on_arrival(D2, 0.1)
    actions = relay.on_fetch_answer("a", D1, FetchAnswer.ACCEPTED, 0.2)
    assert actions == [Fetch("a", d3, "queued: a answered the fetch before")]
    assert relay.in_flight == {"a": d3} and relay.queued == {}
    assert relay.bound_violations(0.2) == []


def test_as_a_source_bytes_held_are_served_awaited_ones_promised_and_the_rest_declined():
    store = Store({D1: b"delta-1"})
    relay = follower("a", store)
    assert relay.on_fetch("c", D1, 0.0) == [Serve("c", D1, "held here")]
    assert relay.on_fetch("c", D2, 0.0) == [Decline("c", D2, "not held here, and not on its way")]
    relay.want(D2, "h", 0.0, catching_up=False)  # a fresh commit coming down the tree
    assert relay.on_fetch("c", D2, 0.1) == [Promise("c", D2, "awaiting them as a fresh commit of h: sent on arrival")]
    assert relay.on_fetch("d", D2, 0.1)[0].to == "d" and relay.promised == {D2: {"c", "d"}}
    store.put(D2, b"delta-2")
    actions = relay.on_arrival(D2, 0.3)
    assert actions == [Serve("c", D2, "promised, and the bytes arrived"), Serve("d", D2, "promised, and the bytes arrived"),
                       Release(D2, "the bytes are here")]
    assert relay.promised == {} and relay.counts["promises_kept"] == 2


def test_a_relay_catching_up_itself_promises_nothing():
    relay = follower("a")
    relay.want(D1, "h", 0.0, catching_up=True)
    assert relay.on_fetch("c", D1, 0.1) == [Decline("c", D1, "catching up on it myself: ask a node that has it")]
    relay.on_stream(D1, "s", 0)  # ... unless a stream of them is arriving
    assert isinstance(relay.on_fetch("c", D1, 0.2)[0], Promise)


def test_promises_are_bounded_in_payloads_and_askers():
    relay = follower("a")
    digests = [payload_digest(bytes([i])) for i in range(MAX_PROMISED_PAYLOADS + 1)]
    for digest in digests:
        relay.want(digest, "h", 0.0, catching_up=False)
    for digest in digests[:-1]:
        assert isinstance(relay.on_fetch("c", digest, 0.1)[0], Promise)
    assert relay.on_fetch("c", digests[-1], 0.1) == [
        Decline("c", digests[-1], f"promises for {MAX_PROMISED_PAYLOADS} payloads outstanding already")]
    for i in range(MAX_PROMISED_ASKERS - 1):
        relay.on_fetch(f"m{i}", digests[0], 0.1)
    assert len(relay.promised[digests[0]]) == MAX_PROMISED_ASKERS
    assert isinstance(relay.on_fetch("late", digests[0], 0.1)[0], Decline)
    assert isinstance(relay.on_fetch("c", digests[0], 0.1)[0], Promise)  # asking again is no new asker
    assert relay.bound_violations(0.1) == []


def test_a_promise_backed_only_by_a_stream_ends_when_the_stream_breaks_off():
    relay = follower("a")
    relay.on_stream(D1, "s", 100)
    assert isinstance(relay.on_fetch("c", D1, 0.0)[0], Promise)
    relay.on_stream_end(D1, "s", 0.5)
    assert relay.promised == {} and relay.counts["promises_ended"] == 1
    assert "promises to c ended: the stream that backed them broke off" in relay.recent(0.5)[0]
    relay.want(D2, "h", 0.0, catching_up=False)  # backed by a fresh want too: the promise stands
    relay.on_stream(D2, "t", 100)
    relay.on_fetch("c", D2, 0.0)
    relay.on_stream_end(D2, "t", 0.5)
    assert relay.promised == {D2: {"c"}}


def test_a_want_no_append_names_any_more_is_given_up_and_its_promises_end():
    relay = follower("a")
    relay.want(D1, "h", 0.0, catching_up=False)
    relay.on_fetch("c", D1, 0.1)
    relay.want(D1, "h", 10.0, catching_up=False)  # named again: the give-up clock restarts
    assert relay.on_wake(D1, GIVE_UP_S + 5.0)[-1] == WakeAt(GIVE_UP_S + 6.0, D1)
    actions = relay.on_wake(D1, GIVE_UP_S + 10.0)
    assert actions == [Release(D1, f"no append of h named them for {GIVE_UP_S:g} s: given up")]
    assert relay.wants == {} and relay.promised == {} and relay.counts["gave_up"] == 1
    assert relay.on_wake(D1, GIVE_UP_S + 11.0) == []


def test_decisions_are_kept_with_their_reasons_newest_first_and_bounded():
    relay = follower()
    relay.want(D1, "h", 0.0, catching_up=False)
    relay.on_wake(D1, 1.0)
    recent = relay.recent(3.0)
    assert recent[0].startswith("2.0s ago: fetch ") and "from a: no bytes after 1 relay timeout: ask a (parent" in recent[0]
    assert recent[1].startswith("3.0s ago: ") and "want, named by h's append: wait 1 s for the push" in recent[1]
    relay.on_fetch_answer("a", D1, FetchAnswer.ACCEPTED, 1.0)
    for now in range(2, 5):
        relay.on_wake(D1, float(now))  # the same wait each time: one line, with its latest time
    assert sum("its promise still runs" in line for line in relay.recent(5.0)) == 1
    for i in range(2 * MAX_RECENT_DECISIONS):
        relay.on_fetch("x", payload_digest(bytes([i])), 6.0)
    assert len(relay.recent(6.0)) == MAX_RECENT_DECISIONS


def test_the_bounds_the_simulation_checks_can_fail():
    relay = follower("a")
    assert relay.bound_violations(0.0) == []
    relay.promised[D1] = {"c"}  # planted: a promise nothing backs, neither awaited nor arriving
    relay.want(D2, "h", 0.0, catching_up=False)  # and never woken to give it up
    relay.queued["h"] = [D2]  # and a fetch queued behind none
    problems = relay.bound_violations(GIVE_UP_S + 10.0)
    assert any("promised while neither awaited as a fresh commit nor arriving" in p for p in problems)
    assert any("still wanted" in p for p in problems)
    assert any("a fetch from h queued while none is in flight" in p for p in problems)
