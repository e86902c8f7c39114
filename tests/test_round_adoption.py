"""The lease holder's merge runs in the codec pool and writes nothing; the round is adopted on the
event loop once proposed (issue 22). Before, `Syncer.merge_round` moved the norm reference and the
last merge reason from the pool's thread while the loop could lose the lease, and the reference
moved for rounds dropped afterwards. Here a `RoundDriver` with a pool that holds each merge until
the test releases it, and a stand-in coordination core whose lease and proposals the test controls.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, Future
from types import SimpleNamespace

import numpy as np

from bootstrap import messages as coord
from bootstrap.entries import LogEntry
from diloco_node.clock import FakeClock
from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.daemon.peers import AddressBook
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.tasks import TaskSet
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.replica import Replica
from diloco_node.sync.syncer import Syncer
from wire import messages as wire
from wire.codecs import encode_named

from conftest import NullCounter

MANIFEST = RunManifest(model=ModelSpec.of(seq_len=16),
                       inner=InnerOptimizer(batch_size=2, warmup_steps=2, total_steps=64),
                       sync=SyncSpec(fragments=2, period=8, overlap=2, min_quorum=2, codec_up="fp32"))
SHAPES = {"layer0/w": (8, 8), "layer1/w": (8, 8)}
LEARNERS = ("a", "b")
REFERENCE = 5.0  # the committed norm reference of fragment 0 when the lease is gained


class HeldPool(Executor):
    """Runs decodes at once; a merge (`Syncer.plan_commit`) waits until the test releases it."""

    def __init__(self) -> None:
        self.merges: list[tuple[Future, object]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        future: Future = Future()
        if getattr(fn, "__name__", "") == "plan_commit":
            self.merges.append((future, lambda: fn(*args, **kwargs)))
        else:
            future.set_result(fn(*args, **kwargs))
        return future

    def finish_merges(self) -> None:
        for future, work in self.merges:
            future.set_result(work())
        self.merges.clear()


def _driver(proposals: list, accept_proposals: bool = True, merge_rule=None):
    plan = plan_fragments(SHAPES, 2, 8, 2)
    replica = Replica(plan, {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}, MANIFEST.outer)
    replica.norm_refs = {0: REFERENCE}
    syncer = Syncer(MANIFEST, plan, [])
    clock = FakeClock(1000.0)
    lease = {"held": True}
    index = iter(range(1, 100))

    def propose(now, kind, payload, *, fragment, round, digest):
        proposals.append(fragment)
        if not accept_proposals:
            return None, "not the leader in this epoch", []
        entry = LogEntry(1, next(index), kind, payload, fragment=fragment, round=round, digest=digest)
        assert replica.apply(entry).applied
        return entry, "", []

    members = {n: SimpleNamespace(role=coord.MemberRole.LEARNER, state=coord.MemberState.ALIVE) for n in LEARNERS}
    core = SimpleNamespace(is_lease_holder=lambda now: lease["held"], propose=propose,
                           election=SimpleNamespace(leader_id="a"), membership=SimpleNamespace(members=members))
    pool, tasks, errors = HeldPool(), TaskSet(), []
    # `merge_rule(replica)`: the state keeper's rule on this replica (none: never blocked).
    behind = merge_rule(replica) if merge_rule is not None else (lambda proposal=None: "")
    driver = RoundDriver(node_id="a", manifest=MANIFEST, plan=plan, syncer=syncer, replica=replica,
                         coordination=core, addresses=AddressBook(), client=None, executor=pool, clock=clock,
                         tasks=tasks, dispatch=lambda actions: None, replica_behind=behind,
                         report_error=errors.append, contributions_sent=NullCounter(), merges_proposed=NullCounter())
    driver.lease_check()
    return driver, syncer, pool, tasks, lease, errors


async def _merge_in_the_pool(driver: RoundDriver, pool: HeldPool) -> None:
    """Both learners contribute to fragment 0 (K = 2): the merge starts and waits in the pool."""
    names = driver.plan.fragments[0].names
    for learner in LEARNERS:
        payload = encode_named({n: np.full(SHAPES[n], 0.5, np.float32) for n in names}, "fp32")
        await driver.on_contribution(wire.FragmentContribution(0, 0, 0, 8, 8 * 32, "fp32", learner, payload))
    while not pool.merges:
        await asyncio.sleep(0)


async def _finish(pool: HeldPool, tasks: TaskSet) -> None:
    """The merges come back from the pool and their tasks run to their end (none is cancelled)."""
    pool.finish_merges()
    while len(tasks):
        await asyncio.sleep(0)


def _state(syncer: Syncer) -> tuple:
    return (syncer.norm_ref.snapshot(), syncer.last_merge_reason, dict(syncer.last_merge_at), dict(syncer.rounds),
            dict(syncer.last_decision))


async def test_a_merge_finishing_in_the_pool_after_the_lease_was_lost_changes_no_syncer_state() -> None:
    proposals: list[int] = []
    driver, syncer, pool, tasks, lease, errors = _driver(proposals)
    await _merge_in_the_pool(driver, pool)
    assert driver.merging and syncer.rounds == {}  # the round was taken for the merge
    lease["held"] = False
    driver.lease_check()  # the event loop loses the lease while the merge runs
    after_loss = _state(syncer)
    assert after_loss[0] == {0: REFERENCE}
    await _finish(pool, tasks)
    assert _state(syncer) == after_loss  # norm refs, last reason, rate limit, open rounds: untouched
    assert proposals == [] and errors == [] and not driver.merging


async def test_a_round_whose_proposal_is_refused_does_not_move_the_norm_reference() -> None:
    proposals: list[int] = []
    driver, syncer, pool, tasks, _, errors = _driver(proposals, accept_proposals=False)
    await _merge_in_the_pool(driver, pool)
    before = _state(syncer)
    await _finish(pool, tasks)
    assert proposals == [0] and errors == ["fragment 0 merge not proposed: not the leader in this epoch"]
    assert _state(syncer) == before and syncer.norm_ref.get(0) == REFERENCE


async def test_a_proposed_round_is_adopted_on_the_loop() -> None:
    proposals: list[int] = []
    driver, syncer, pool, tasks, _, errors = _driver(proposals)
    await _merge_in_the_pool(driver, pool)
    assert syncer.norm_ref.get(0) == REFERENCE and syncer.last_merge_reason == ""
    await _finish(pool, tasks)
    assert proposals == [0] and errors == []
    assert syncer.norm_ref.get(0) == driver.replica.norm_refs[0] != REFERENCE  # what the commit carried
    assert syncer.last_merge_at == {0: 1000.0} and syncer.last_merge_reason.startswith("fragment 0: merging")


async def test_a_round_merged_while_its_fragment_went_stale_is_not_proposed(tmp_path) -> None:
    """While the pool merges fragment 0's round 1, a commit of that fragment's round 1 is applied
    here and cannot be (its payload unreadable, as with log.read EIO): the replica's round for 0 stays
    at 0, so round 1 still looks like the next one, but the fragment is stale. The proposal asks the
    state keeper's rule (`StateKeeper.merge_blocker`, the one that held the merge back before it
    began) and is dropped; before, the driver checked the replica's round alone and proposed round 1 a
    second time, merged on a state that was not the run's."""
    from bootstrap.entries import EntryKind
    from diloco_node.daemon.state_transfer import StateKeeper
    from tests.test_daemon_history import FakeClock as HistoryClock, recorder
    from tests.test_state_not_current import _Counter, _Learner, _Tasks, _unreadable

    keepers: list[StateKeeper] = []

    def keeper_rule(replica):
        clock = HistoryClock()
        keeper = StateKeeper(node_id="a", replica=replica, client=None, addresses=None, executor=None, clock=clock,
                             tasks=_Tasks(), history=recorder(tmp_path, "a", clock), leader_id=lambda: "a",
                             epoch=lambda: 1, report_error=lambda message: None, commits_applied=_Counter(),
                             learner=_Learner())
        keepers.append(keeper)
        return lambda proposal=None: keeper.merge_blocker(replica.applied_index, replica.applied_index, proposal)

    proposals: list[int] = []
    driver, syncer, pool, tasks, _, errors = _driver(proposals, merge_rule=keeper_rule)
    await _merge_in_the_pool(driver, pool)
    committed = LogEntry(1, 1, EntryKind.OUTER_COMMIT, b"unreadable here", fragment=0, round=1, digest="d")
    keepers[0].apply(_unreadable(committed))
    assert driver.replica.state.round(0) == 0 and "fragment 0 stale since index 1" in keepers[0].current_reason()
    await _finish(pool, tasks)
    assert proposals == []
    assert errors == ["fragment 0 round 1 dropped: state not current: fragment 0 stale since index 1: fragment 0 "
                      "round 1 could not be applied: entry 1: Input/output error (failpoint log.read)"]
