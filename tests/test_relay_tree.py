"""The relay tree planner: bounded fan-out, every member reached, unhealthy members never relay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from bootstrap.relay_tree import MAX_FANOUT, plan_relay_tree, worst_case_fetch_delay
from wire.errors import LocalProtocolError

node_ids = st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=0, max_size=40, unique=True)


@settings(max_examples=300, deadline=None)
@given(node_ids, st.integers(1, 4), st.data())
def test_every_follower_is_reached_once_and_nobody_sends_more_than_the_fanout(ids, fanout, data):
    root, followers = "root", [i for i in ids if i != "root"]
    unhealthy = data.draw(st.sets(st.sampled_from(followers))) if followers else set()
    healthy = [f for f in followers if f not in unhealthy]
    tree = plan_relay_tree(root, followers, fanout, unhealthy)

    assert set(tree.parent) == set(followers)
    received = [kid for kids in tree.children.values() for kid in kids]
    assert sorted(received) == sorted(followers)  # each exactly once
    for member in followers:
        assert tree.fetch_sources(member)[-1] == root  # the root is always the last resort
    # Fan-out holds for everyone, the root included.
    assert all(len(kids) <= fanout for kids in tree.children.values())
    # An unhealthy member relays only when the root and every healthy member are full.
    if any(tree.children[m] for m in unhealthy):
        assert all(len(tree.children[n]) == fanout for n in [root, *healthy])
    # The healthy part is as shallow as the fan-out allows (a complete fanout-ary tree).
    if healthy:
        deepest_healthy = max(tree.depth(m) for m in healthy)
        assert deepest_healthy == _complete_tree_height(len(healthy), fanout)


def _complete_tree_height(n: int, fanout: int) -> int:
    """Levels below the root needed to place n nodes breadth-first with `fanout` children each."""
    height, level, placed = 0, 1, 0
    while placed < n:
        level *= fanout
        placed += level
        height += 1
    return height


def test_sixteen_sites_at_fanout_two_the_holder_sends_two_copies_and_the_last_is_four_hops_away():
    followers = [f"site-{i:02d}" for i in range(1, 16)]
    tree = plan_relay_tree("site-00", followers, fanout=2)
    assert tree.sends_of("site-00") == 2
    assert tree.height == 4  # 2 + 4 + 8 followers fill three levels, the 15th starts the fourth
    assert tree.children["site-00"] == ("site-01", "site-02")
    assert tree.fetch_sources("site-07") == ("site-03", "site-01", "site-00")


def test_a_suspected_relay_is_moved_to_a_leaf_and_its_old_children_get_a_healthy_parent():
    followers = ["b", "c", "d", "e", "f"]
    before = plan_relay_tree("a", followers, fanout=2)
    assert before.children["b"] == ("d", "e")
    after = plan_relay_tree("a", followers, fanout=2, unhealthy={"b"})
    assert after.children["b"] == ()
    assert after.parent["d"] != "b" and after.parent["e"] != "b"
    assert after.sends_of("a") == 2
    assert after.describe() == "a -> [c, d]; c -> [e, f]; d -> [b]"


def test_too_many_unhealthy_members_relay_rather_than_break_the_fanout():
    tree = plan_relay_tree("a", ["b", "c", "d", "e"], fanout=1, unhealthy={"c", "d"})
    assert tree.describe() == "a -> [b]; b -> [e]; c -> [d]; e -> [c]"
    assert tree.fetch_sources("d") == ("c", "e", "b", "a")


def test_the_same_inputs_give_the_same_tree_on_every_node():
    order_one = plan_relay_tree("a", ["e", "c", "b", "d"], 2, unhealthy=["c"])
    order_two = plan_relay_tree("a", ["d", "b", "c", "e"], 2, unhealthy=("c",))
    assert order_one == order_two
    assert order_one.describe() == "a -> [b, d]; b -> [e, c]"


def test_the_holder_listed_among_followers_is_not_its_own_child():
    tree = plan_relay_tree("a", ["a", "b"], 2)
    assert tree.children["a"] == ("b",) and "a" not in tree.parent


def test_worst_case_delay_is_one_timeout_per_ancestor_below_the_root():
    tree = plan_relay_tree("r", [f"n{i}" for i in range(7)], fanout=2)
    deepest = max(tree.parent, key=tree.depth)
    assert tree.depth(deepest) == 3
    assert worst_case_fetch_delay(tree, deepest, 2.0) == pytest.approx(4.0)
    assert worst_case_fetch_delay(tree, "n0", 2.0) == 0.0


@pytest.mark.parametrize(("root", "fanout", "why"), [
    ("", 2, "root must be a non-empty node id"),
    ("a", 0, "fan-out must be an int in"),
    ("a", MAX_FANOUT + 1, "fan-out must be an int in"),
    ("a", 2.0, "fan-out must be an int in"),
])
def test_bad_plans_are_refused_with_the_reason(root, fanout, why):
    with pytest.raises(LocalProtocolError, match=why):
        plan_relay_tree(root, ["b"], fanout)


def test_asking_about_a_stranger_names_it():
    tree = plan_relay_tree("a", ["b"], 2)
    with pytest.raises(LocalProtocolError, match="'zz' is not in the relay tree rooted at 'a'"):
        tree.fetch_sources("zz")
