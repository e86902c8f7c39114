"""The daemon's history recorder against a real (sans-IO) coordination core: exact events."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode, NodeOptions, PersistentState
from bootstrap.election import LeaseTiming
from bootstrap.entries import EntryKind, LogEntry
from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.daemon.history_hooks import SYNC_BARRIER_PERIODS, DaemonHistory, entry_digest
from diloco_node.sync.replica import CommitPayload
from diloco_node.ops.history import HistoryWriter, read_history
from diloco_node.clock import FakeClock

LEASE = LeaseTiming(lease_s=3.0, heartbeat_interval_s=0.5, election_jitter_s=0.0)


def recorder(tmp_path, node: str, clock: FakeClock, **kwargs) -> DaemonHistory:
    writer = HistoryWriter(tmp_path / node / "history.jsonl", node, wall_clock=clock, mono_clock=clock)
    return DaemonHistory(writer, mono_clock=clock, **kwargs)


def events(history: DaemonHistory) -> list:
    history.writer.flush_steps()
    return list(read_history(history.writer.path).events)


def kinds(history: DaemonHistory) -> list[str]:
    return [e.kind for e in events(history)]


def node(node_id: str, voters: list[str], now: float) -> CoordinatorNode:
    return CoordinatorNode(node_id, PersistentState.founding(voters), now=now, rng=random.Random(1),
                           options=NodeOptions(lease=LEASE))


def outer_payload(contributors: tuple[str, ...]) -> bytes:
    return CommitPayload(b"delta", contributors, tuple(1.0 for _ in contributors)).encode()


def test_a_single_voter_wins_appends_commits_with_contributors(tmp_path):
    clock = FakeClock()
    history = recorder(tmp_path, "n1", clock)
    core = node("n1", ["n1"], clock.now)
    history.start(core, applied_index=0)
    clock.now += 10.0  # past the start-up lease wait: a configuration of one elects itself
    core.tick(clock.now)
    history.observe(core)
    entry, why, _ = core.propose(clock.now, EntryKind.OUTER_COMMIT, outer_payload(("n1", "n2")),
                                 fragment=1, round=1, digest="d1")
    assert entry is not None, why
    history.observe(core)
    history.observe(core)  # nothing new: nothing written

    got = events(history)
    assert [(e.kind, e.epoch, e.index) for e in got] == [
        ("start", 1, 0),
        ("lease_acquired", 2, 1),  # its last index before winning: the founding entry, not its no-op
        ("append", 2, 2),  # the no-op of epoch 2
        ("commit", 2, 1), ("commit", 2, 2),
        ("append", 2, 3), ("commit", 2, 3),
    ]
    assert got[1].detail == {"votes": ["n1"]}
    assert got[2].detail == {"entry_epoch": 2, "entry_kind": "noop"}
    commit = got[-1]
    assert commit.detail["contributors"] == ["n1", "n2"]
    assert (commit.fragment, commit.round) == (1, 1)
    assert commit.entry_digest == entry_digest(entry) == got[-2].entry_digest
    assert "contributors" not in got[3].detail  # membership entry: no learners merged


def test_a_follower_records_its_vote_appends_and_commits_at_the_current_epoch(tmp_path):
    clock = FakeClock()
    history = recorder(tmp_path, "n2", clock)
    core = node("n2", ["n1", "n2", "n3"], clock.now)
    history.start(core, applied_index=0)
    clock.now += 10.0
    core.handle(coord.VoteRequest(5, "n1", 1, 1), clock.now)
    history.observe(core)
    noop = LogEntry(5, 2, EntryKind.NOOP)
    core.handle(coord.AppendEntries(5, "n1", 1, 1, (noop,), 0, clock.now), clock.now)
    history.observe(core)
    core.handle(coord.AppendEntries(5, "n1", 2, 5, (), 2, clock.now), clock.now)
    history.observe(core)

    got = events(history)
    assert [(e.kind, e.epoch, e.index) for e in got] == [
        ("start", 1, 0), ("vote", 5, None), ("append", 5, 2), ("commit", 5, 1), ("commit", 5, 2)]
    assert got[1].detail == {"for": "n1"}
    assert got[2].entry_digest == entry_digest(noop)
    assert got[3].detail["entry_epoch"] == 1  # the entry's epoch is a detail; `epoch` is the node's


def test_a_rewritten_index_is_appended_again_and_a_deposed_leader_says_so(tmp_path):
    clock = FakeClock()
    history = recorder(tmp_path, "n1", clock)
    core = node("n1", ["n1", "n2", "n3"], clock.now)
    history.start(core, applied_index=0)
    clock.now += 10.0
    pending = core.tick(clock.now)  # pre-vote, then the real vote: n2 grants both
    while pending:
        action = pending.pop(0)
        if isinstance(action, coord.Send) and isinstance(action.message, coord.VoteRequest) and action.to == "n2":
            request = action.message
            pending += core.handle(coord.VoteResponse(request.epoch, "n2", True, "ok", pre_vote=request.pre_vote),
                                   clock.now)
        history.observe(core)
    assert core.role.value == "leader"
    won_epoch = core.epoch
    # A newer leader replaces our uncommitted no-op at index 2 with its own entry.
    theirs = LogEntry(won_epoch + 1, 2, EntryKind.NOOP)
    core.handle(coord.AppendEntries(won_epoch + 1, "n3", 1, 1, (theirs,), 0, clock.now), clock.now)
    history.observe(core)

    got = events(history)
    assert [(e.kind, e.epoch, e.index) for e in got] == [
        ("start", 1, 0), ("lease_acquired", won_epoch, 1), ("append", won_epoch, 2),
        ("lease_lost", won_epoch + 1, None), ("append", won_epoch + 1, 2)]
    assert got[3].detail["holder"] == "n3"
    assert "n3" in got[3].detail["reason"]
    assert got[2].entry_digest != got[4].entry_digest == entry_digest(theirs)


@dataclass
class FakeState:
    digest_value: str = "s0"
    finite: bool = True

    def digest(self) -> str:
        return self.digest_value

    def is_finite(self) -> bool:
        return self.finite


@dataclass
class FakeReplica:
    applied_index: int = 0
    diverged: set[int] = field(default_factory=set)
    state: FakeState = field(default_factory=FakeState)


def test_applies_skip_inconsistent_stretches_and_mark_the_jump(tmp_path):
    clock = FakeClock()
    history = recorder(tmp_path, "j1", clock)
    replica = FakeReplica()
    entries = [LogEntry(1, i, EntryKind.NOOP) for i in range(1, 7)]
    for i in (1, 2):  # a joiner replaying below the index its download was served at
        replica.applied_index = i
        history.applied(entries[i - 1], replica, consistent_from=3, epoch=4)
    replica.applied_index, replica.state.digest_value = 3, "s3"
    history.applied(entries[2], replica, consistent_from=3, epoch=4)
    replica.applied_index, replica.state.digest_value = 4, "s4"
    history.applied(entries[3], replica, consistent_from=3, epoch=4)
    replica.applied_index, replica.diverged = 5, {1}  # digest mismatch: fragment 1 being refetched
    history.applied(entries[4], replica, consistent_from=3, epoch=4)
    replica.applied_index, replica.diverged, replica.state = 6, set(), FakeState("s6", finite=False)
    history.applied(entries[5], replica, consistent_from=3, epoch=4)

    got = events(history)
    assert [(e.index, e.state_digest, e.epoch) for e in got] == [(3, "s3", 4), (4, "s4", 4), (6, "s6", 4)]
    assert [e.detail.get("snapshot", False) for e in got] == [True, False, True]
    assert [e.detail["finite"] for e in got] == [True, True, False]
    assert got[0].entry_digest == entry_digest(entries[2])
    violations = check_histories({"j1": got})
    assert [v.invariant for v in violations] == ["non_finite"]  # the jumps are not apply gaps


@dataclass
class FakeLearner:
    step_seconds: float = 0.01
    c_steps: list[int] = field(default_factory=lambda: [0, 0])


def test_steps_are_batched_and_a_synchronous_learner_past_the_barrier_is_waiting(tmp_path):
    clock = FakeClock()
    history = recorder(tmp_path, "n1", clock, pace_s=0.05)
    core = node("n1", ["n1"], clock.now)

    @dataclass
    class Sync:
        min_quorum: int = 3
        period: int = 8
        overlap: int = 2

    history.start(core, 0, Sync())
    barrier = SYNC_BARRIER_PERIODS * 8 + 2
    assert history.barrier_steps == barrier
    learner = FakeLearner()
    for step in range(1, 11):  # 10 steps within the barrier, 0.1 s apart
        learner.c_steps = [step, step]
        history.learner_step(step, 2.5, step * 128, learner)
        clock.now += 0.1
    for step in range(11, 16):  # 5 steps past it: a blocking learner would be waiting
        learner.c_steps = [barrier + step, 3]
        history.learner_step(step, 2.4, step * 128, learner)
        clock.now += 0.1
    steps = [e for e in events(history) if e.kind == "step"]
    assert len(steps) == 2  # about one event per second
    assert sum(e.detail["steps"] for e in steps) == 15
    assert sum(e.detail["tokens"] for e in steps) == 14 * 128  # the first step only sets the baseline
    # The first step counts its pace (0.05 s > its 0.01 s of compute), the next nine the 0.1 s since
    # the previous one (within 2 x 0.05 s); past the barrier nothing.
    assert abs(sum(e.detail["productive_s"] for e in steps) - (0.05 + 9 * 0.1)) < 1e-9
    assert steps[-1].detail["learner_step"] == 15 and steps[-1].detail["loss"] == 2.4


def test_decoupled_learners_never_wait_and_lifecycle_events_close_the_history(tmp_path):
    clock = FakeClock()
    history = recorder(tmp_path, "n1", clock)
    core = node("n1", ["n1"], clock.now)

    @dataclass
    class Sync:
        min_quorum: int = 1
        period: int = 8
        overlap: int = 2

    history.start(core, 0, Sync())
    assert history.barrier_steps is None
    history.learner_step(1, float("nan"), 0, FakeLearner(0.02, [10_000, 10_000]))
    clock.now += 5.0  # paused (SIGSTOP) between two steps: at most twice the step counts
    history.learner_step(2, 1.5, 128, FakeLearner(0.02, [10_000, 10_000]))
    history.leave(core, "left: our removal is committed")
    history.stop(core, 7)
    history.close()
    history.learner_step(3, 1.0, 256, FakeLearner())  # a straggling learner thread: ignored
    got = list(read_history(history.writer.path).events)
    assert [e.kind for e in got] == ["start", "step", "leave", "stop"]
    assert got[1].detail["productive_s"] == pytest.approx(0.02 + 0.04) and got[1].detail["steps"] == 2
    assert got[2].detail == {"reason": "left: our removal is committed"}
    assert (got[3].index, got[3].epoch) == (7, 1)
    assert np.isfinite(got[3].t_mono)


class _Learner:
    def offer_fragment(self, p, round_, params, contributors=()) -> None:
        pass


class _Counter:
    def inc(self) -> None:
        pass


def _real_commits(replica, count: int, first_index: int, epoch: int) -> list[LogEntry]:
    """`count` outer commits alternating over both fragments, each with the digest it yields."""
    from tests.conftest import small_replica
    from wire.codecs import decode_named, encode_named

    planner = small_replica()  # a private replica that runs ahead, to plan each commit's digest
    entries = []
    for k in range(count):
        p = k % 2
        names = planner.plan.fragments[p].names
        shapes = {n: planner.state.fragment_params(p)[n].shape for n in names}
        encoded = encode_named({n: np.full(shapes[n], 0.01 * (k + 1), np.float32) for n in names}, "int8")
        payload = CommitPayload(encoded, ("n1",), (1.0,)).encode()
        digest = planner.digest_after(p, decode_named(encoded))
        entry = LogEntry(epoch, first_index + k, EntryKind.OUTER_COMMIT, payload, fragment=p,
                         round=planner.state.round(p) + 1, digest=digest)
        assert planner.apply(entry).applied
        entries.append(entry)
    return entries


def test_a_catch_up_batch_records_the_true_digest_at_every_index(tmp_path):
    """Honest history: a follower that commits N entries in one message records N applies, each
    with the state digest at THAT index (what a replica applying them one by one has)."""
    from diloco_node.daemon.state_transfer import StateKeeper
    from tests.conftest import small_replica

    clock = FakeClock()
    history = recorder(tmp_path, "n2", clock)
    core = node("n2", ["n1", "n2", "n3"], clock.now)
    replica = small_replica()
    keeper = StateKeeper(node_id="n2", replica=replica, client=None, addresses=None, executor=None, clock=clock,
                         tasks=None, history=history, leader_id=lambda: "n1", epoch=lambda: core.epoch,
                         report_error=pytest.fail, commits_applied=_Counter(), learner=_Learner())
    history.start(core, applied_index=0)
    clock.now += 10.0
    batch = tuple(_real_commits(replica, 6, first_index=2, epoch=5))
    actions = core.handle(coord.AppendEntries(5, "n1", 1, 1, batch, 7, clock.now), clock.now)
    history.observe(core)
    for action in actions:  # what CoordinationIO.dispatch does with them
        if isinstance(action, coord.ApplyEntry):
            keeper.apply(action.entry)

    applies = [e for e in events(history) if e.kind == "apply"]
    truth = small_replica()
    expected = []
    for entry in (LogEntry(1, 1, EntryKind.MEMBERSHIP, config=core.log.config_at(1)), *batch):
        truth.apply(entry)
        expected.append((entry.index, truth.state.digest()))
    assert [(e.index, e.state_digest) for e in applies] == expected
    assert len({digest for _, digest in expected[1:]}) == len(batch)  # N commits, N distinct states
    assert check_histories({"n2": events(history)}) == []
