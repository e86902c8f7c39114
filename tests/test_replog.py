"""Replicated log: consistency check, truncation, majority commit, apply order, snapshots, config changes."""

from __future__ import annotations

import random

import pytest

from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot, majorities_can_be_disjoint
from bootstrap.messages import AppendEntries, AppendResponse, ApplyEntry, Send
from bootstrap.replog import LogStore, ReplicatedLog, majority_commit_index
from wire.errors import LocalProtocolError, RemoteProtocolError

CONFIG = ClusterConfig.of(["a", "b", "c"])


def entry(epoch: int, index: int, payload: bytes = b"x") -> LogEntry:
    return LogEntry(epoch, index, EntryKind.OUTER_COMMIT, payload, fragment=0, round=index)


def fresh(node_id: str = "b") -> ReplicatedLog:
    return ReplicatedLog(node_id, LogStore(Snapshot(0, 0, CONFIG)), applied_index=0)


def append(prev_index, prev_epoch, entries, commit=0, epoch=None):
    epoch = epoch or max([e.epoch for e in entries] + [prev_epoch, 1])
    return AppendEntries(epoch, "a", prev_index, prev_epoch, tuple(entries), commit, 0.0)


def test_entries_validate_themselves():
    with pytest.raises(LocalProtocolError, match="index"):
        LogEntry(1, 0, EntryKind.NOOP)
    with pytest.raises(LocalProtocolError, match="config is carried by, and only by"):
        LogEntry(1, 1, EntryKind.MEMBERSHIP)
    with pytest.raises(RemoteProtocolError, match="has index 2, expected 1"):
        AppendEntries(1, "a", 0, 0, (entry(1, 2),), 0, 0.0)
    with pytest.raises(RemoteProtocolError, match="future epoch"):
        AppendEntries(1, "a", 0, 0, (entry(2, 1),), 0, 0.0)


def test_append_then_commit_follows_leader_and_applies_in_order_once():
    log = fresh()
    outcome = log.handle_append(append(0, 0, [entry(1, 1), entry(1, 2), entry(1, 3)], commit=2))
    assert outcome.success and outcome.match_index == 3 and outcome.reason == "appended through 3"
    assert [e.index for e in log.take_committed()] == [1, 2]
    assert log.take_committed() == []  # never twice
    log.handle_append(append(3, 1, [], commit=3))
    assert [e.index for e in log.take_committed()] == [3]


def test_a_queued_append_loses_the_entries_its_follower_acknowledged_meanwhile_and_still_fits():
    leader = fresh("a")
    leader.reset_progress(["b"])
    for index in (1, 2, 3):
        leader.append_local(1, EntryKind.OUTER_COMMIT, b"p" * 100, fragment=0, round=index)
    follower = fresh("b")
    first = leader.replication_message("b", 1, "a", 1.0)  # in flight
    leader.append_local(1, EntryKind.OUTER_COMMIT, b"q" * 100, fragment=0, round=4)
    queued = leader.replication_message("b", 1, "a", 2.0)  # built before the first one's answer
    assert [e.index for e in queued.entries] == [1, 2, 3, 4]
    outcome = follower.handle_append(first)
    assert leader.handle_append_response("b", outcome.success, outcome.match_index) is True
    leader.advance_commit(CONFIG, 1)
    trimmed = leader.without_acknowledged(queued, "b")
    assert [e.index for e in trimmed.entries] == [4]  # 1-3 are not sent a second time
    assert (trimmed.prev_index, trimmed.prev_epoch, trimmed.sent_at) == (3, 1, 2.0)
    assert trimmed.leader_commit == leader.commit_index == 3  # the newer commit index rides along
    outcome = follower.handle_append(trimmed)
    assert outcome.success and outcome.match_index == 4
    assert [e.index for e in follower.take_committed()] == [1, 2, 3]
    # Nothing acknowledged since, or a heartbeat: the message goes as built.
    assert leader.without_acknowledged(trimmed, "b") is trimmed
    heartbeat = leader.replication_message("c", 1, "a", 3.0)
    assert leader.without_acknowledged(heartbeat, "c") is heartbeat


def test_gap_is_refused_with_a_hint():
    log = fresh()
    outcome = log.handle_append(append(5, 1, [entry(1, 6)]))
    assert not outcome.success and outcome.match_index == 0
    assert outcome.reason == "missing entries: prev 5 beyond our last 0"


def test_conflicting_uncommitted_suffix_is_truncated():
    log = fresh()
    log.handle_append(append(0, 0, [entry(1, 1), entry(1, 2, b"old"), entry(1, 3, b"old")], commit=1))
    outcome = log.handle_append(append(1, 1, [entry(2, 2, b"new")], epoch=2))
    assert outcome.success and log.last_index == 2 and log.entry_at(2).payload == b"new"


def test_stale_duplicate_append_does_not_truncate_newer_entries():
    log = fresh()
    log.handle_append(append(0, 0, [entry(1, 1), entry(1, 2)]))
    outcome = log.handle_append(append(0, 0, [entry(1, 1)]))  # an old, reordered copy
    assert outcome.success and log.last_index == 2


def test_overwriting_a_committed_entry_is_refused_loudly():
    log = fresh()
    log.handle_append(append(0, 0, [entry(1, 1), entry(1, 2)], commit=2))
    with pytest.raises(RemoteProtocolError, match="overwrite committed entry 2"):
        log.handle_append(append(1, 1, [entry(2, 2, b"evil")], epoch=2))


def test_mismatch_hint_skips_the_whole_conflicting_epoch_but_not_below_commit():
    log = fresh()
    log.handle_append(append(0, 0, [entry(1, 1), entry(2, 2), entry(2, 3), entry(2, 4)], commit=1, epoch=2))
    outcome = log.handle_append(append(4, 3, [], epoch=3))
    assert not outcome.success and outcome.match_index == 1
    assert outcome.reason == "entry 4 epoch 2 != leader's 3"


def test_commit_needs_a_majority_and_an_entry_of_the_current_epoch():
    epochs = {1: 1, 2: 1, 3: 2}
    args = dict(config=CONFIG, self_id="a", self_last_index=3, commit_index=0, epoch_at=epochs.get)
    index, reason = majority_commit_index(match_index={"b": 0, "c": 0}, current_epoch=2, **args)
    assert index == 0 and reason == "majority holds only up to 0"
    index, reason = majority_commit_index(match_index={"b": 2, "c": 0}, current_epoch=2, **args)
    assert index == 0 and reason == "entry 2 is from an older epoch; waiting for one of epoch 2"
    index, reason = majority_commit_index(match_index={"b": 3, "c": 0}, current_epoch=2, **args)
    assert index == 3 and reason == "entry 3 held by 2 of 3 voters"


def test_compaction_and_snapshot_install():
    leader = ReplicatedLog("a", LogStore(Snapshot(0, 0, CONFIG)), applied_index=0)
    for i in range(1, 6):
        leader.append_local(1, EntryKind.OUTER_COMMIT, b"%d" % i)
    leader.commit_index = 5
    assert len(leader.take_committed()) == 5
    snapshot = leader.compact(4, b"state@4")
    assert snapshot.last_index == 4 and leader.first_index == 5 and leader.entry_at(4) is None
    with pytest.raises(LocalProtocolError, match="only 5 applied"):
        leader.compact(6, b"")
    leader.reset_progress(["b"])
    leader.handle_append_response("b", False, 0)
    message = leader.replication_message("b", 1, "a", 0.0)
    assert message.snapshot == snapshot  # a follower behind the snapshot gets the snapshot
    follower = fresh()
    restored, reason = follower.install_snapshot(snapshot)
    assert restored and follower.applied_index == 4 and reason == "installed snapshot through 4"
    assert follower.install_snapshot(snapshot) == (False, "snapshot through 4 is not ahead of our commit 4")


def test_single_server_changes_never_allow_disjoint_majorities():
    three = ClusterConfig.of("abc")
    assert not majorities_can_be_disjoint(three, ClusterConfig.of("abcd"))
    assert not majorities_can_be_disjoint(three, ClusterConfig.of("ab"))
    assert majorities_can_be_disjoint(three, ClusterConfig.of("abcde"))  # two at once: unsafe
    assert majorities_can_be_disjoint(ClusterConfig.of("ab"), ClusterConfig.of("cd"))


def lone_leader() -> CoordinatorNode:
    node = CoordinatorNode("a", PersistentState.founding(["a"]), now=0.0, rng=random.Random(0))
    node.tick(10.0)
    assert node.is_lease_holder(10.0)
    return node


def test_one_voter_commits_alone_and_applies_exactly_once():
    node = lone_leader()
    entry_, reason, actions = node.propose(10.1, EntryKind.OUTER_COMMIT, b"delta", fragment=1, round=7)
    assert entry_ is not None and reason == f"appended {entry_.describe()}"
    applied = [a.entry for a in actions if isinstance(a, ApplyEntry)]
    assert applied == [entry_]
    assert not [a for a in node.tick(10.2) if isinstance(a, ApplyEntry)]


def test_membership_changes_one_at_a_time():
    node = lone_leader()
    added, reason, actions = node.propose_config_change(10.1, add="b")
    assert added is not None and node.log.config.voters == {"a", "b"}
    assert any(isinstance(a, Send) and a.to == "b" for a in actions)
    again, reason, _ = node.propose_config_change(10.1, add="c")
    assert again is None and reason == f"configuration change at index {added.index} not committed yet"
    node.handle(AppendResponse(node.epoch, "b", True, added.index, 10.1, "ok"), 10.2)
    assert node.log.commit_index == added.index
    third, reason, _ = node.propose_config_change(10.3, add="c")
    assert third is not None and node.log.config.voters == {"a", "b", "c"}


def test_proposals_refused_without_the_lease():
    node = CoordinatorNode("a", PersistentState.founding(["a", "b", "c"]), now=0.0, rng=random.Random(0))
    entry_, reason, actions = node.propose(1.0, EntryKind.OUTER_COMMIT, b"x")
    assert entry_ is None and actions == [] and reason == "not the lease holder (role follower, epoch 1)"


def run_pair(nodes: dict[str, CoordinatorNode], until: float, pending: list[Send], now: float = 10.0) -> float:
    """A perfect zero-latency network and 100 ms ticks."""
    while now < until:
        while pending:
            send = pending.pop(0)
            pending += [a for a in nodes[send.to].handle(send.message, now) if isinstance(a, Send)]
        for node in nodes.values():
            pending += [a for a in node.tick(now) if isinstance(a, Send)]
        now += 0.1
    return now


def test_joiner_through_bootstrap_peer_becomes_a_voter_then_leaves_gracefully():
    leader = lone_leader()
    joiner = CoordinatorNode("b", PersistentState.joining(), now=10.0, rng=random.Random(1))
    nodes = {"a": leader, "b": joiner}
    now = run_pair(nodes, 14.0, list(joiner.start_join(["a"], 10.0)))
    assert leader.log.committed_config.voters == {"a", "b"}
    assert joiner.log.committed_config.voters == {"a", "b"} and joiner.log.applied_index == leader.log.applied_index
    assert leader.status(now)["reasons"]["membership"].startswith("proposed #")
    run_pair(nodes, now + 3.0, list(joiner.leave(now)), now)
    assert joiner.left and joiner.status(now)["reasons"]["membership"] == "left: our removal is committed"
    assert leader.log.committed_config.voters == {"a"}


def test_a_follower_that_lost_acknowledged_entries_is_sent_them_again_at_once():
    """A follower whose log.bin was cut at rest rejects the next append with its shorter end:
    the holder believes it and resends from there, instead of waiting for a snapshot."""
    leader = fresh("a")
    leader.reset_progress(["b"])
    for index in range(1, 7):
        leader.append_local(1, EntryKind.OUTER_COMMIT, b"p", fragment=0, round=index)
    follower = fresh("b")
    outcome = follower.handle_append(leader.replication_message("b", 1, "a", 1.0))
    assert leader.handle_append_response("b", outcome.success, outcome.match_index) is False
    assert leader.match_index["b"] == 6
    cut = fresh("b")  # the same follower after a restart with its log cut back to entry 3
    everything = leader.replication_message("b", 1, "a", 2.0)
    assert everything.prev_index == 6 and not everything.entries  # a heartbeat: b holds them all
    first_three = AppendEntries(**{**{f: getattr(everything, f) for f in everything.__dataclass_fields__},
                                   "prev_index": 0, "prev_epoch": 0,
                                   "entries": tuple(leader.entry_at(i) for i in (1, 2, 3))})
    assert cut.handle_append(first_three).success and cut.last_index == 3
    leader.append_local(1, EntryKind.OUTER_COMMIT, b"p", fragment=0, round=7)
    rejected = cut.handle_append(leader.replication_message("b", 1, "a", 3.0))
    assert not rejected.success and rejected.match_index == 3
    assert leader.handle_append_response("b", False, rejected.match_index) is True
    assert leader.match_index["b"] == 3
    resent = leader.replication_message("b", 1, "a", 4.0)
    assert [e.index for e in resent.entries] == [4, 5, 6, 7]
    assert cut.handle_append(resent).success and cut.last_index == 7
