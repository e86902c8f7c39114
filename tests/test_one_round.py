"""One algorithm: the runner's round logic and the daemon's round logic, fed the same scripted
arrivals, make identical merge decisions, identical commit payloads and identical learner states.

- Runner side: `sim.runner.VirtualRounds` (what every runner mode drives on its virtual clock),
  with the rules `runner.round_rules` builds for the decoupled mode.
- Daemon side: `daemon.rounds.RoundDriver` (what a lease holder runs), on a `FakeClock` whose
  timers are the driver's wake-ups, with an in-line executor and a stand-in coordination core
  whose `propose` commits at once (the log itself is tested elsewhere).
- Learners: the runner's learners apply merges with `sync.apply.apply_merge`; the daemon's
  `LearnerThread` takes the same merges through `offer_fragment` + `take_offers`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from types import SimpleNamespace

import numpy as np
import pytest

from bootstrap import messages as coord
from bootstrap.entries import EntryKind, LogEntry
from diloco_node.clock import FakeClock
from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.daemon.peers import AddressBook
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.tasks import TaskSet
from diloco_node.learn import data as data_lib
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.learn.learner_thread import LearnerThread
from diloco_node.sim import runner
from diloco_node.sync.apply import ApplyRule, FragmentCounters, apply_merge
from diloco_node.sync.fragments import is_embedding, plan_fragments
from diloco_node.sync.merge import Contribution
from diloco_node.sync.replica import CommitPayload, Replica
from diloco_node.sync.syncer import Syncer
from wire.codecs import CODECS_BY_ID, decode_named, encode_named
from wire.contribution_stream import contribution_chunks, open_for

from conftest import InlineExecutor, NullCounter

LEARNERS = ("a", "b", "c")
MANIFEST = RunManifest(model=ModelSpec.of(seq_len=16),
                       inner=InnerOptimizer(batch_size=2, warmup_steps=2, total_steps=64),
                       sync=SyncSpec(fragments=2, period=8, overlap=2, min_quorum=2, grace_gamma=0.5,
                                     grace_cap_s=5.0))
PRIMED = {"step_s": 1.0, "quorum_s": 0.0, "sync_s": 0.2}
START = 1000.0
# (time after START, learner, fragment, c_steps): two learners reach quorum K = 2 and the grace
# window waits for the third; the third misses it; the next round of fragment 0 comes a period
# later, and a push right after a merge is held by the round rate limit. c's claim of 160 steps
# 5.7 s after its previous contribution to fragment 0 is cut by the steps cap on both sides.
SCRIPT = (
    (0.0, "a", 0, 8), (0.3, "b", 0, 8), (1.0, "a", 1, 8), (1.2, "c", 1, 8), (2.5, "c", 0, 8),
    (8.0, "a", 0, 8), (8.1, "b", 0, 8), (8.2, "c", 0, 160), (9.0, "b", 1, 8), (12.0, "b", 1, 4),
)
TRANSFER_S = 0.1


@pytest.fixture(scope="module")
def initial() -> dict[str, np.ndarray]:
    _, params = factory.init_params(MANIFEST.model, 0)
    return model_lib.flat_params(params)


def _plan(initial):
    sync = MANIFEST.sync
    return plan_fragments({n: a.shape for n, a in initial.items()}, sync.fragments, sync.period, sync.overlap)


def _delta(initial, plan, learner: str, p: int, t: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([LEARNERS.index(learner), p, int(t * 10)])
    return {n: (0.01 * rng.standard_normal(initial[n].shape)).astype(np.float32) for n in plan.fragments[p].names}


def _contribution(initial, plan, learner: str, p: int, c_steps: int, t: float) -> tuple[Contribution, bytes]:
    # Both sides receive what crossed the wire: the int4 payload, decoded.
    payload = encode_named(_delta(initial, plan, learner, p, t), MANIFEST.sync.codec_up)
    return Contribution(learner, p, 0, decode_named(payload), c_steps, c_steps * 32), payload


def run_runner_side(initial) -> tuple[list[tuple[float, int, str, bytes]], dict[int, str], str]:
    plan = _plan(initial)
    config = runner.RunnerConfig(MANIFEST, "decoupled", len(LEARNERS), 64)
    rules = runner.round_rules(config, plan.period)
    syncer = Syncer(MANIFEST, plan, [n for n in initial if is_embedding(n)], rules)
    syncer.prime(**PRIMED)
    rounds = runner.VirtualRounds(syncer, Replica(plan, initial, MANIFEST.outer), start=START)
    merges: list[tuple[float, int, str, bytes]] = []
    wakes: list[tuple[float, int]] = []

    def handle(outcome, p: int, t: float) -> None:
        if outcome is None:
            return
        if outcome.plan is not None and outcome.plan.proposes:
            merges.append((t, p, outcome.plan.reason, outcome.plan.payload))
        elif outcome.decision.wake_at is not None:
            wakes.append((outcome.decision.wake_at, p))

    for offset, learner, p, c_steps in SCRIPT:
        t = START + offset
        while wakes and min(wakes)[0] <= t:  # the virtual clock's wake-ups due before this arrival
            wake_at, q = min(wakes)
            wakes.remove((wake_at, q))
            handle(rounds.evaluate(q, wake_at, LEARNERS), q, wake_at)
        contribution, _ = _contribution(initial, plan, learner, p, c_steps, offset)
        handle(rounds.arrive(contribution, t, transfer_s=TRANSFER_S, members=LEARNERS, live=LEARNERS), p, t)
    while wakes:
        wake_at, q = min(wakes)
        wakes.remove((wake_at, q))
        handle(rounds.evaluate(q, wake_at, LEARNERS), q, wake_at)
    return merges, dict(syncer.last_decision), syncer.admission.counts.last_reason


async def run_daemon_side(initial) -> tuple[list[tuple[float, int, str, bytes]], dict[int, str], str]:
    plan = _plan(initial)
    clock = FakeClock(START)
    replica = Replica(plan, initial, MANIFEST.outer)
    syncer = Syncer(MANIFEST, plan, [n for n in initial if is_embedding(n)])
    syncer.prime(**PRIMED)
    merges: list[tuple[float, int, str, bytes]] = []
    index = iter(range(1, 1000))

    def propose(now, kind, payload, *, fragment, round, digest):  # commits at once
        entry = LogEntry(1, next(index), kind, payload, fragment=fragment, round=round, digest=digest)
        assert replica.apply(entry).applied
        return entry, "", []

    adopt = syncer.adopt

    def adopt_and_record(taken, plan, now):  # the driver adopts a round once it is proposed
        if plan.proposes:
            merges.append((now, taken.fragment, plan.reason, plan.payload))
        return adopt(taken, plan, now)

    syncer.adopt = adopt_and_record

    members = {name: SimpleNamespace(role=coord.MemberRole.LEARNER, state=coord.MemberState.ALIVE)
               for name in LEARNERS}
    core = SimpleNamespace(is_lease_holder=lambda now: True, propose=propose,
                           election=SimpleNamespace(leader_id="a"), membership=SimpleNamespace(members=members))
    tasks = TaskSet()
    windows: list[str] = []  # the replica holds its applies from each merge's start to its end
    driver = RoundDriver(node_id="a", manifest=MANIFEST, plan=plan, syncer=syncer, replica=replica,
                         coordination=core, addresses=AddressBook(), client=None, executor=InlineExecutor(),
                         clock=clock, tasks=tasks, dispatch=lambda actions: None, replica_behind=lambda proposal=None: "",
                         report_error=pytest.fail, contributions_sent=NullCounter(), merges_proposed=NullCounter(),
                         merge_window=(lambda: windows.append("start"), lambda: windows.append("end")))
    driver.lease_check()  # the lease from START on, as the runner's syncer has it

    async def settle() -> None:
        while len(tasks):  # merge tasks: their executor work is in-line, they end in a few loop turns
            await asyncio.sleep(0)

    async def advance_to(t: float) -> None:
        """Run the driver's wake-ups due by t, each merge finishing before time moves on (the
        runner's merges take no virtual time either)."""
        while (due := clock.next_due()) is not None and due <= t:
            clock.advance(due - clock.monotonic())
            await settle()
        clock.advance(t - clock.monotonic())

    for offset, learner, p, c_steps in SCRIPT:
        await advance_to(START + offset)
        # The daemon receives it streamed, chunk by chunk, and keeps it encoded (wire 2.1).
        delta = _delta(initial, plan, learner, p, offset)
        head = open_for({n: a.shape for n, a in delta.items()}, fragment=p, base_index=0, base_round=0,
                        c_steps=c_steps, c_tokens=c_steps * 32, codec=MANIFEST.sync.codec_up, learner_id=learner,
                        stream=bytes(16))
        # Admitted by the syncer (members, the steps cap) as the runner's are, with the link's transfer time.
        receiving = driver.receive_contribution(head, transfer_s=TRANSFER_S)
        for chunk in contribution_chunks(head, delta):
            await receiving.part(chunk)
        await receiving.finish()
        await settle()
    await advance_to(START + 60.0)
    await tasks.close()
    assert windows == ["start", "end"] * len(merges)
    return merges, dict(syncer.last_decision), syncer.admission.counts.last_reason


async def test_runner_and_daemon_make_the_same_decisions_and_commit_payloads(initial) -> None:
    ours, our_last, our_cap = run_runner_side(initial)
    theirs, their_last, their_cap = await run_daemon_side(initial)
    assert our_cap == their_cap and our_cap.startswith("c claims 160 steps for fragment 0; ")
    assert len(ours) == 3  # the script exercises grace, a late straggler and the rate limit
    assert [(round(t, 9), p, reason) for t, p, reason, _ in ours] == \
        [(round(t, 9), p, reason) for t, p, reason, _ in theirs]
    assert [payload for *_, payload in ours] == [payload for *_, payload in theirs]
    reasons = " | ".join(reason for _, _, reason, _ in ours)
    assert re.search(r"grace window of \d\.\d\d s expired with 2 of 3", reasons) and "including 1 early contribution" in reasons
    # The last round of fragment 1 (one learner, K = 2) is still open, for the same reason on both sides.
    assert our_last == their_last and our_last[1].startswith("waiting: 1 of 2 needed contributions")


async def test_with_topk2_up_and_union8_down_both_sides_commit_the_same_bits_and_replicas_agree(
        initial, monkeypatch) -> None:
    """The sparse codecs: a contribution streamed in chunks (daemon) and one encoded whole (runner)
    decode to the same values, the merged outer gradient travels as union8, and every replica that
    applies the commits reaches the same digest."""
    import sys

    sparse = dataclasses.replace(MANIFEST, sync=dataclasses.replace(MANIFEST.sync, codec_up="topk2",
                                                                      codec_down="union8"))
    monkeypatch.setattr(sys.modules[__name__], "MANIFEST", sparse)
    ours, _, _ = run_runner_side(initial)
    theirs, _, _ = await run_daemon_side(initial)
    assert len(ours) == 3 and [payload for *_, payload in ours] == [payload for *_, payload in theirs]
    plan = _plan(initial)
    replicas = [Replica(plan, initial, sparse.outer) for _ in range(2)]
    for index, (_, p, _, payload) in enumerate(ours, start=1):
        for replica in replicas:
            assert replica.apply(LogEntry(1, index, EntryKind.OUTER_COMMIT, payload, fragment=p,
                                          round=replica.state.round(p) + 1)).applied
    assert replicas[0].state.digest() == replicas[1].state.digest()
    assert replicas[0].state.digest() != Replica(plan, initial, sparse.outer).state.digest()
    assert all(CODECS_BY_ID[CommitPayload.decode(payload).delta[5]].name == "union8" for *_, payload in ours)


def test_runner_rules_for_decoupled_are_the_manifests(initial) -> None:
    config = runner.RunnerConfig(MANIFEST, "decoupled", 3, 64)
    assert runner.round_rules(config, MANIFEST.sync.period) == Syncer(MANIFEST, _plan(initial), []).rules


@pytest.mark.parametrize("keep_unmerged", [False, True])
def test_runner_learner_and_daemon_learner_thread_take_a_merge_alike(initial, keep_unmerged: bool) -> None:
    """The same merged fragment, contributors and counters: the runner's rule and the training
    thread's boundary give the same local model and counters (with and without our contribution,
    under both settings of the rule)."""
    manifest = dataclasses.replace(MANIFEST, sync=dataclasses.replace(MANIFEST.sync, keep_unmerged=keep_unmerged))
    plan = _plan(initial)
    corpus = data_lib.Corpus(np.arange(4096, dtype=np.uint8) % 251, np.arange(512, dtype=np.uint8), 256, "bytes")
    p = 1
    names = plan.fragments[p].names
    merged = {n: initial[n] + np.float32(0.5) for n in names}
    for contributors in (("b",), ("a", "b")):
        thread = LearnerThread(node_id="a", manifest=manifest, plan=plan,
                               corpus=corpus, global_params=initial, global_rounds=[0, 0],
                               on_contribution=lambda due: None, on_progress=lambda *a: None)
        drift = {n: initial[n] - np.float32(0.25) for n in names}  # the learner's unsent progress
        local = {**initial, **drift}
        thread.restore(_snapshot(thread, local))
        thread.offer_fragment(p, 1, merged, contributors)
        thread.take_offers()
        state = thread.request_state().result(timeout=10)
        expected, counters = apply_merge(drift, {n: initial[n] for n in names}, merged, contributors,
                                         FragmentCounters(6, 192), learner="a",
                                         rule=ApplyRule.from_sync_spec(manifest.sync))
        for n in names:
            np.testing.assert_array_equal(state.params[n], expected[n])
        assert (state.c_steps[p], state.c_tokens[p]) == (counters.c_steps, counters.c_tokens)
        assert state.base_rounds[p] == 1


def _snapshot(thread: LearnerThread, params: dict[str, np.ndarray]):
    """A checkpointed learner state with these weights and 6 unsent steps on every fragment."""
    state = thread.request_state().result(timeout=10)
    return type(state)(state.step, state.tokens, params, state.opt_leaves, state.base_rounds,
                       [6] * len(state.c_steps), [192] * len(state.c_tokens))


def test_a_restored_learner_thread_resumes_its_batch_sampler(initial) -> None:
    """The sampler's position travels in the learner's checkpoint: a restarted site draws the
    batches it had not drawn yet, not the first ones again."""
    from diloco_node.learn.learner_thread import learner_index, snapshot_from_checkpoint, snapshot_meta_and_arrays

    plan = _plan(initial)
    corpus = data_lib.Corpus(np.arange(4096, dtype=np.uint8) % 251, np.arange(512, dtype=np.uint8), 256, "bytes")

    def thread() -> LearnerThread:
        return LearnerThread(node_id="a", manifest=MANIFEST, plan=plan, corpus=corpus, global_params=initial,
                             global_rounds=[0, 0], on_contribution=lambda due: None, on_progress=lambda *a: None)

    first = thread()
    first.compile()  # compiling draws no batch
    fresh = first.request_state().result(timeout=10).sampler
    sampler = data_lib.BatchSampler(corpus.train, MANIFEST.inner.batch_size, MANIFEST.model.seq_len, MANIFEST.seed,
                                    learner_index("a"))
    assert fresh == sampler.state()
    for _ in range(4):
        sampler.next()
    moved = sampler.state()
    expected = sampler.next()
    snap = first.request_state().result(timeout=10)
    meta, arrays = snapshot_meta_and_arrays(dataclasses.replace(snap, sampler=moved))
    restarted = thread()
    restarted.restore(snapshot_from_checkpoint(meta, arrays))
    assert restarted.request_state().result(timeout=10).sampler == moved
    resumed = data_lib.BatchSampler(corpus.train, MANIFEST.inner.batch_size, MANIFEST.model.seq_len, MANIFEST.seed,
                                    learner_index("a"))
    resumed.restore(restarted.request_state().result(timeout=10).sampler)
    assert np.array_equal(resumed.next()[0], expected[0])
