"""bootstrap/apply_rule.py: a stale fragment's floor, the copies it refuses, and when the state is current."""

from __future__ import annotations

from bootstrap.apply_rule import StaleFragments


def test_a_copy_behind_the_floor_is_refused_and_the_state_stays_not_current():
    stale = StaleFragments()
    assert stale.current(10) == (True, "")
    stale.mark(1, 11, "payload unreadable")
    assert stale.floor(1) == 11 and stale.floor(0) == 0
    current, why = stale.current(11)
    assert not current and "fragment 1 stale since index 11: payload unreadable" in why
    accepted, why = stale.offer(1, 10)  # the peer: it had not heard of commit 11 yet
    assert not accepted and "behind index 11" in why
    assert not stale.current(12)[0]


def test_every_later_entry_that_cannot_be_applied_raises_the_floor():
    stale = StaleFragments()
    stale.mark(0, 5, "payload unreadable")
    stale.mark(0, 9, "a commit arrived while it is stale")
    assert stale.floor(0) == 9
    assert not stale.offer(0, 8)[0]
    assert stale.offer(0, 9)[0]
    assert stale.current(9) == (True, "")


def test_a_copy_ahead_of_the_replica_is_current_only_once_the_replica_reaches_it():
    stale = StaleFragments()
    stale.mark(2, 20, "digest disagrees")
    assert stale.offer(2, 25)[0]
    current, why = stale.current(22)
    assert not current and "ahead of applied index 22" in why
    assert stale.current(25) == (True, "")


def test_the_broken_variant_takes_any_copy():
    stale = StaleFragments(enforce_floor=False)
    stale.mark(1, 11, "payload unreadable")
    assert stale.offer(1, 3)[0] and stale.current(11)[0]


def test_entries_that_never_reached_the_state_make_every_fragment_stale_from_the_next_one():
    stale = StaleFragments()
    assert stale.gap(10, 11, 3) == "" and stale.current(11) == (True, "")
    reason = stale.gap(10, 14, 3)  # 11..13 were handed over to nobody
    assert reason == "entries 11..13 never reached the state (applied 10)"
    assert [stale.floor(p) for p in range(3)] == [14, 14, 14]
    current, why = stale.current(14)
    assert not current and why.startswith("fragment 0 stale since index 14: entries 11..13 never reached")
    assert not stale.offer(0, 13)[0]  # a copy must include the entry that revealed the gap
    for p in range(3):
        assert stale.offer(p, 14)[0]
    assert stale.current(14) == (True, "")
