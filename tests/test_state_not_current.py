"""A replica that could not apply a committed entry is not current until a copy that includes it is in.

The state keeper (daemon/state_transfer.py) with a real replica and history: entry 3's payload
cannot be read back (as after log.read EIO). From then on nothing reads the state as the run's
(no apply recorded, no fragment served, no learner offer, not ready) until a copy of the stale
fragment served as of index 3 or later is installed; a copy from before it is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from bootstrap.entries import EntryKind, LogEntry, PayloadUnavailable, StoredPayload
from diloco_node.daemon.readiness import ReadinessFacts, readiness
from diloco_node.daemon.state_transfer import StateKeeper
from tests.conftest import small_replica
from tests.test_daemon_history import FakeClock, _real_commits, events, recorder
from wire import messages as wire
from wire.errors import RemoteProtocolError


class _Learner:
    def __init__(self) -> None:
        self.offers: list[int] = []

    def offer_fragment(self, p, round_, params, contributors=()) -> None:
        self.offers.append(p)


class _Tasks:
    def __init__(self) -> None:
        self.spawned: list[str] = []

    def spawn(self, coroutine, name: str = "") -> None:
        coroutine.close()  # the repair's download is not what this test is about
        self.spawned.append(name)


class _Counter:
    def inc(self) -> None:
        pass


def _unreadable(entry: LogEntry) -> LogEntry:
    def gone() -> bytes:
        raise PayloadUnavailable(f"entry {entry.index}: Input/output error (failpoint log.read)")
    return dataclasses.replace(entry, payload=StoredPayload(entry.payload_size, gone))


def _facts(keeper: StateKeeper) -> ReadinessFacts:
    applied = keeper.replica.applied_index
    return ReadinessFacts(download=None, learner_compiling=False, has_voters=True, applied_index=applied,
                          consistent_from=keeper.consistent_from, log_applied_index=applied, commit_target=applied,
                          replacing_state=keeper.replacing_state(), was_ready=True, role="follower", epoch=5,
                          not_current=keeper.current_reason())


def test_a_fragment_stale_since_an_unreadable_entry_takes_the_whole_state_out_of_service(tmp_path):
    clock = FakeClock()
    history = recorder(tmp_path, "n2", clock)
    replica, learner, tasks = small_replica(), _Learner(), _Tasks()
    keeper = StateKeeper(node_id="n2", replica=replica, client=None, addresses=None, executor=None, clock=clock,
                         tasks=tasks, history=history, leader_id=lambda: "n1", epoch=lambda: 5,
                         report_error=lambda message: None, commits_applied=_Counter(), learner=learner)
    history.started = True
    commits = _real_commits(replica, 5, first_index=1, epoch=5)  # fragments 0, 1, 0, 1, 0 at 1..5
    keeper.apply(commits[0])
    keeper.apply(commits[1])
    assert keeper.state_consistent() and learner.offers == [0, 1]
    truth = small_replica()  # the run's state, applied entry by entry
    for entry in commits[:3]:
        truth.apply(entry)

    keeper.apply(_unreadable(commits[2]))  # index 3, fragment 0: its payload is gone
    assert tasks.spawned == ["repair-0"]
    assert "fragment 0 stale since index 3" in keeper.current_reason()
    keeper.apply(commits[3])  # index 4, fragment 1: applied, but the state is still not the run's
    keeper.apply(commits[4])  # index 5, fragment 0 again: the floor rises
    assert keeper.stale.floor(0) == 5
    assert [e.index for e in events(history) if e.kind == "apply"] == [1, 2]  # no digest for 3, 4, 5
    assert learner.offers == [0, 1]  # the learner took nothing from the state meanwhile
    verdict = readiness(_facts(keeper))
    assert not verdict.ready and verdict.reason.startswith("state not current: fragment 0 stale since index 5")
    with pytest.raises(RemoteProtocolError) as refused:  # nothing is served, not even fragment 1
        asyncio.run(keeper.on_snapshot_request(wire.SnapshotRequest(1, 0, 1024)))
    assert refused.value.status_hint == 503 and "not current" in str(refused.value)

    # A peer that has not applied index 5 yet serves a copy from before it: refused.
    accepted, why = keeper.stale.offer(0, 4)
    assert not accepted and "behind index 5" in why
    for entry in commits[3:]:
        truth.apply(entry)
    accepted, _ = keeper.stale.offer(0, 5)  # the copy as of 5: installed (as join.py does on yes)
    assert accepted
    replica.install_fragment_bytes(0, truth.fragment_bytes(0)[1])
    keeper._unoffered.add(0)  # what the repair task does once the copy is in
    keeper._offer_pending()
    assert keeper.state_consistent() and replica.state.digest() == truth.state.digest()
    assert sorted(learner.offers[2:]) == [0, 1]  # offered once it is current


def test_a_chunk_is_labelled_with_the_index_its_bytes_are_current_at(tmp_path):
    """A fragment read in a worker while the loop applies a commit to it: answered 503 (ask again),
    never labelled with the index after the commit its bytes lack (the race the I/O-error
    cluster test caught: a repair took bytes from before index 186 labelled 186)."""
    from concurrent.futures import ThreadPoolExecutor

    replica = small_replica()
    commits = _real_commits(replica, 3, first_index=1, epoch=5)  # fragments 0, 1, 0
    with ThreadPoolExecutor(1) as executor:
        keeper = StateKeeper(node_id="n1", replica=replica, client=None, addresses=None, executor=executor,
                             clock=FakeClock(), tasks=_Tasks(), history=recorder(tmp_path, "n1", FakeClock()),
                             leader_id=lambda: "n1", epoch=lambda: 5, report_error=lambda message: None,
                             commits_applied=_Counter(), learner=_Learner())
        keeper.apply(commits[0])
        keeper.apply(commits[1])
        chunk = asyncio.run(keeper.on_snapshot_request(wire.SnapshotRequest(0, 0, 1 << 20)))
        assert chunk.commit_index == 2
        read = keeper.served.read

        def read_then_apply(*args):  # the loop applies index 3 (fragment 0) while the bytes are read
            out = read(*args)
            replica.apply(commits[2])
            return out

        keeper.served.read = read_then_apply  # type: ignore[method-assign]
        with pytest.raises(RemoteProtocolError) as moved:
            asyncio.run(keeper.on_snapshot_request(wire.SnapshotRequest(0, 0, 1 << 20)))
        assert moved.value.status_hint == 503 and "moved on while it was read" in str(moved.value)


def test_the_checkpoint_written_at_stop_while_not_current_is_never_replayed_onto_nor_exported(tmp_path):
    """The stop path writes its checkpoint whatever the state (its learner matters), the way
    parts.py `stop` does: with the keeper's `current_reason`. A restart then installs the global state
    from peers as of its index, or replays the log from an older checkpoint written while the state
    was current, never from this one (it would claim the state current at index 5); and an export
    reads the older one. Before, the checkpoint said nothing and a restart replayed onto it."""
    from concurrent.futures import ThreadPoolExecutor

    from bootstrap.coordinator_node import PersistentState
    from bootstrap.entries import ClusterConfig, Snapshot
    from bootstrap.replog import LogStore
    from diloco_node.daemon.persistence import Checkpointer
    from diloco_node.ops.checkpoint import CheckpointStore
    from diloco_node.ops.export import ExportError, _newest_verified_checkpoint

    clock = FakeClock()
    replica, tasks = small_replica(), _Tasks()
    keeper = StateKeeper(node_id="n2", replica=replica, client=None, addresses=None, executor=None, clock=clock,
                         tasks=tasks, history=recorder(tmp_path, "n2", clock), leader_id=lambda: "n1",
                         epoch=lambda: 5, report_error=lambda message: None, commits_applied=_Counter(),
                         learner=_Learner())
    commits = _real_commits(replica, 5, first_index=1, epoch=5)
    truth = small_replica()
    for entry in commits:
        truth.apply(entry)
    log_after_stop = PersistentState.founding(["n1", "n2", "n3"])
    log_after_stop.log = LogStore(Snapshot(0, 0, ClusterConfig()), list(commits))

    def restart(checkpoints: CheckpointStore, has_peers: bool = True):
        fresh = small_replica()
        checkpointer = Checkpointer(node_id="n2", checkpoints=checkpoints, store=None, replica=fresh,  # type: ignore[arg-type]
                                    disk_executor=None, retain_entries=256, report_error=lambda _: None)  # type: ignore[arg-type]
        plan, _ = checkpointer.restore(log_after_stop, has_peers=has_peers)
        return plan, fresh

    with CheckpointStore(tmp_path / "checkpoints") as checkpoints, ThreadPoolExecutor(1) as disk:
        checkpointer = Checkpointer(node_id="n2", checkpoints=checkpoints, store=None, replica=replica,  # type: ignore[arg-type]
                                    disk_executor=disk, retain_entries=256, report_error=lambda _: None)
        keeper.apply(commits[0])
        keeper.apply(commits[1])
        asyncio.run(checkpointer.checkpoint(None, not_current=keeper.current_reason()))  # current: a normal one
        keeper.apply(_unreadable(commits[2]))
        keeper.apply(commits[3])
        keeper.apply(commits[4])
        assert keeper.current_reason().startswith("fragment 0 stale since index 5")
        asyncio.run(checkpointer.checkpoint(None, not_current=keeper.current_reason()))  # the one at stop
        assert checkpoints.load_latest().checkpoint.meta["state_not_current"].startswith("fragment 0 stale")

        plan, restored = restart(checkpoints)  # the log holds 1..5 and an older current checkpoint at 2
        assert (plan.applied_index, plan.install_floor, plan.fallback_checkpoint) == (2, 0, 2)
        assert "written while the global state was not current (fragment 0 stale since index 5" in plan.reason
        for entry in commits[2:]:  # the replay from it reaches the run's state
            restored.apply(entry)
        assert restored.state.digest() == truth.state.digest()

        checkpoint, skipped = _newest_verified_checkpoint(tmp_path / "checkpoints")
        assert checkpoint.meta["applied_index"] == 2  # the export is of the older one, and says why
        assert "not current (fragment 0 stale since index 5" in skipped[0]

        checkpoints.path_for(1).unlink()
        plan, _ = restart(checkpoints)  # no older checkpoint: the state is installed from peers
        assert (plan.applied_index, plan.install_floor) == (5, 5) and "installing the global state from peers" in plan.reason
        reinstalling = StateKeeper(node_id="n2", replica=small_replica(), client=None, addresses=None, executor=None,
                                   clock=clock, tasks=_Tasks(), history=recorder(tmp_path / "r", "n2", clock),
                                   leader_id=lambda: "n1", epoch=lambda: 5, report_error=lambda message: None,
                                   commits_applied=_Counter(), learner=_Learner())
        reinstalling.plan_install(plan.install_floor)
        reinstalling.start_install(plan.install_floor)  # what the node does once coordination runs
        assert not readiness(_facts(reinstalling)).ready  # not current until the download is in

        plan, restored = restart(checkpoints, has_peers=False)  # alone, on an uncompacted log
        assert (plan.applied_index, plan.initial_state) == (0, True)
        for entry in commits:
            restored.apply(entry)
        assert restored.state.digest() == truth.state.digest()
        with pytest.raises(ExportError, match="not current"):
            _newest_verified_checkpoint(tmp_path / "checkpoints")


def test_an_entry_that_does_not_follow_the_applied_index_takes_the_state_out_of_service_at_once(tmp_path):
    """Issue 32, item 4 ("a gap"): entries that never reached the state (a hand-over lost them) are
    noticed at the next entry, not at each fragment's next commit: every fragment is stale from it,
    every fragment is fetched, nothing is recorded or offered meanwhile; an entry handed over a
    second time is not applied again (applied exactly once)."""
    clock = FakeClock()
    history = recorder(tmp_path, "n2", clock)
    replica, learner, tasks, errors = small_replica(), _Learner(), _Tasks(), []
    keeper = StateKeeper(node_id="n2", replica=replica, client=None, addresses=None, executor=None, clock=clock,
                         tasks=tasks, history=history, leader_id=lambda: "n1", epoch=lambda: 5,
                         report_error=errors.append, commits_applied=_Counter(), learner=learner)
    history.started = True
    commits = _real_commits(replica, 4, first_index=1, epoch=5)  # fragments 0, 1, 0, 1 at 1..4
    keeper.apply(commits[0])
    keeper.apply(commits[0])  # handed over again: ignored, the state is not touched
    assert replica.applied_index == 1 and errors == ["entry 1 handed over again (applied 1); ignored"]
    keeper.apply(commits[2])  # index 3: index 2 (fragment 1) never reached the state
    assert sorted(tasks.spawned) == ["repair-0", "repair-1"]
    assert keeper.current_reason().startswith("fragment 0 stale since index 3: entries 2..2 never reached the state")
    assert "state not current: entries 2..2 never reached the state (applied 1)" in errors[-1]
    assert [e.index for e in events(history) if e.kind == "apply"] == [1]
    assert learner.offers == [0] and not readiness(_facts(keeper)).ready


def test_applies_wait_while_the_holder_merges_and_follow_in_order(tmp_path):
    """The lease holder's merge and an apply never hold their fp32 copies of a fragment at once
    (daemon/memory_bound.py): entries handed over during a merge are applied, in order, when it
    ends; one a snapshot install covers meanwhile is dropped, not applied twice."""
    clock = FakeClock()
    replica, learner = small_replica(), _Learner()
    keeper = StateKeeper(node_id="n1", replica=replica, client=None, addresses=None, executor=None, clock=clock,
                         tasks=_Tasks(), history=recorder(tmp_path, "n1", clock), leader_id=lambda: "n1",
                         epoch=lambda: 5, report_error=lambda message: None, commits_applied=_Counter(),
                         learner=learner)
    commits = _real_commits(replica, 4, first_index=1, epoch=5)  # fragments 0, 1, 0, 1
    truth = small_replica()
    for entry in commits:
        truth.apply(entry)
    keeper.apply(commits[0])
    keeper.defer_applies()
    keeper.apply(commits[1])
    keeper.apply(commits[2])
    assert replica.applied_index == 1 and learner.offers == [0]  # nothing moved under the merge
    keeper.resume_applies()
    assert replica.applied_index == 3 and learner.offers == [0, 1, 0]
    keeper.apply(commits[3])  # no merge: at once
    assert replica.applied_index == 4
    assert all(replica.fragment_bytes(p) == truth.fragment_bytes(p) for p in (0, 1))
    # An entry deferred and meanwhile covered by the state (a download reached past it) is skipped,
    # not reported as handed over twice.
    errors: list[str] = []
    keeper.report_error = errors.append
    keeper.defer_applies()
    keeper.apply(commits[3])
    keeper.resume_applies()
    assert replica.applied_index == 4 and errors == []
