"""One fragment round for the runner and the daemon: same arrivals, same decisions, payloads and learners.

The runner side is `sim/runner.py`'s own round logic (`_FragmentSync`: `_arrive`, `_evaluate_round`,
`_merge`, its event queue on the virtual clock). The daemon side is `daemon/rounds.py`'s
`RoundDriver` itself, driven with fakes: a `FakeClock`, a coordination object that holds the lease,
reports membership and commits every proposal at once into a real `Replica`, an inline executor,
and an event loop whose `call_later` only records the timers (the test fires each at the wake-at
time the syncer answered, as a real loop would). Both sides get the same scripted contributions
(same decoded deltas, same upload times: the daemon's `accept(message, transfer_s)`), the same
membership changes and a Syncer with the same options and priming (the runner knows its
learners' step times and link; what a daemon knows is an input, not a different round). One input
differs by design: the runner passes each learner's step time with its contribution (1 s here,
the primed value, so the estimate stays 1 s), the daemon infers it from the interval between a
learner's pushes of a fragment, which this script has once, at the last arrival, whose decision
(every live learner arrived) does not read it.

Asserted: identical decisions (time, fragment, action, reason, wake-at), identical commit plans
(reason and CommitPayload bytes), identical global state, and identical learner fragments after
the committed merges are applied by the runner's learner and by the daemon's `LearnerThread`
(offered with the contributors the commit payload names).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, Future
from types import SimpleNamespace

import numpy as np
import pytest

from bootstrap import messages as coord
from bootstrap.entries import LogEntry
from diloco_node.clock import FakeClock
from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.tasks import TaskSet
from diloco_node.learn import data as data_lib
from diloco_node.learn.learner_thread import LearnerThread
from diloco_node.sim import runner
from diloco_node.sync.merge import Contribution
from diloco_node.sync.replica import CommitPayload, Replica
from diloco_node.sync.syncer import Syncer
from wire import messages as wire
from wire.codecs import decode_named, encode_named

LEARNERS = ("learner-0", "learner-1", "learner-2")
WATCHED = "learner-2"  # the learner whose state is compared: absent from two merges, in the third
# (time, learner, fragment, base round, c_steps, seconds in flight) and (time, "down", learner).
# H = 8, tau = 2, K = 1, steps of 1 s: a grace window of about 0.9 s, a rate limit of 0.7 x 8 s.
SCRIPT = (
    (8.05, "learner-0", 0, 0, 8, 0.05),  # opens p0; quorum at once, grace window
    (8.06, "learner-1", 0, 0, 8, 0.06),  # joins p0; merged when the grace window ends (no learner-2)
    (10.05, "learner-2", 0, 0, 10, 0.05),  # out of phase: held for p0's next on-time round
    (12.05, "learner-0", 1, 0, 12, 0.05),  # opens p1; merged alone after its grace window
    (13.0, "down", "learner-1"),  # membership change: the held p0 round now lacks only learner-0
    (16.2, "learner-0", 0, 1, 8, 0.05),  # on time for p0: every live learner is in, merge at once
)


@pytest.fixture(scope="module")
def corpus():
    full = data_lib.load_corpus(data_lib.DataSpec())
    return data_lib.Corpus(full.train[:200_000], full.eval[:20_000], 256, "stdlib slice")


def _runner(corpus, apply: str) -> runner._FragmentSync:
    manifest = RunManifest(
        model=ModelSpec("tiny", 16),
        inner=InnerOptimizer(batch_size=2, lr_peak=3e-3, warmup_steps=2, total_steps=16),
        sync=SyncSpec(fragments=2, period=8, overlap=2, min_quorum=1, apply=apply),
    )
    config = runner.RunnerConfig(manifest, "decoupled", len(LEARNERS), 16, eval_batches=1, eval_batch_size=2)
    return runner._FragmentSync(config, runner._setup(config, corpus), None)


def _contributions(sim: runner._FragmentSync) -> list[tuple[float, Contribution, float]]:
    """The script's contributions with small random deltas, as the syncer decodes them (codec_up)."""
    rng = np.random.default_rng(7)
    sync = sim.policy.manifest.sync
    out = []
    for t, learner, p, base, c_steps, in_flight in (e for e in SCRIPT if e[1] != "down"):
        names = sim.plan.fragments[p].names
        delta = {n: (0.01 * rng.standard_normal(sim.setup.initial[n].shape)).astype(np.float32) for n in names}
        encoded = encode_named(delta, sync.codec_up)
        out.append((t, Contribution(learner, p, base, decode_named(encoded), c_steps, 16 * c_steps), in_flight))
    return out


def _spy(syncer: Syncer) -> tuple[list, list]:
    """Record every decision and every commit plan the syncer makes (the calls go through)."""
    decisions, plans = [], []
    decide, plan_commit = syncer.decide, syncer.plan_commit

    def spy_decide(p, now, live, held_by=""):
        d = decide(p, now, live, held_by)
        if d is not None:
            decisions.append((round(now, 9), p, d.action, d.reason, d.wake_at))
        return d

    def spy_plan(*args):
        plan = plan_commit(*args)
        plans.append((plan.reason, plan.payload))
        return plan

    syncer.decide, syncer.plan_commit = spy_decide, spy_plan
    return decisions, plans


def _run_runner(sim: runner._FragmentSync, contributions) -> None:
    for t, contribution, in_flight in contributions:
        sim._push(t, runner._ARRIVE, (contribution, t - in_flight))
    for t, _, learner in (e for e in SCRIPT if e[1] == "down"):
        sim._push(t, runner._DOWN, LEARNERS.index(learner))
    sim._drain()


class _InlineExecutor(Executor):
    def submit(self, fn, /, *args, **kwargs):
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


class _Coordination:
    """Holds the lease; every proposal commits at once into the replica (a one-node log)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.membership = SimpleNamespace(members={
            name: SimpleNamespace(role=coord.MemberRole.LEARNER, state=coord.MemberState.ALIVE) for name in LEARNERS})
        self.election = SimpleNamespace(leader_id="holder")
        self.committed: list[tuple[int, int, dict[str, np.ndarray], tuple[str, ...]]] = []

    def is_lease_holder(self, now: float) -> bool:
        return True

    def propose(self, now, kind, payload, *, fragment, round, digest):
        entry = LogEntry(1, len(self.committed) + 1, kind, payload, fragment=fragment, round=round, digest=digest)
        outcome = self.replica.apply(entry)
        assert outcome.applied, outcome.reason
        self.committed.append((fragment, round, self.replica.state.fragment_params(fragment),
                               CommitPayload.decode(payload).contributors))
        return entry, "", []


class _Count:
    def inc(self, amount: float = 1.0) -> None:
        pass


async def _run_daemon(driver: RoundDriver, clock: FakeClock, coordination: _Coordination, decisions: list,
                      contributions, codec: str) -> None:
    loop = asyncio.get_running_loop()
    timers: list[tuple[float, int]] = []  # (fire at, fragment), one per fragment as the driver keeps

    def record_timer(delay, callback, p):
        wake_at = next(d[4] for d in reversed(decisions) if d[1] == p)  # the answer behind this timer
        timers[:] = [(at, q) for at, q in timers if q != p] + [(wake_at, p)]
        return SimpleNamespace(cancel=lambda: None)

    loop.call_later = record_timer
    script = [(t, "arrive", (c, in_flight)) for t, c, in_flight in contributions]
    script += [(t, "down", learner) for t, _, learner in (e for e in SCRIPT if e[1] == "down")]
    script.sort(key=lambda e: e[0])
    while script or timers:
        timers.sort()
        if timers and (not script or timers[0][0] < script[0][0]):
            at, p = timers.pop(0)
            clock.advance(at - clock.now)
            driver.evaluate(p)
        else:
            at, kind, what = script.pop(0)
            clock.advance(at - clock.now)
            if kind == "arrive":
                c, in_flight = what
                message = wire.FragmentContribution(c.fragment, 0, c.base_round, c.c_steps, c.c_tokens, codec,
                                                    c.learner, encode_named(c.delta, "fp32", zstd_level=None))
                await driver.accept(message, transfer_s=in_flight)
            else:
                coordination.membership.members[what].state = coord.MemberState.DEAD
                driver.lease_check()  # what the node runs after every coordination step
        while len(driver.tasks):  # the merge task: inline executor, so a few loop turns
            await asyncio.sleep(0)


def _daemon(sim: runner._FragmentSync, clock: FakeClock):
    syncer = Syncer(sim.policy.manifest, sim.syncer.embedding_names, sim.syncer.options)
    syncer.prime(step_s=1.0, quorum_s=0.0, sync_s=sim.syncer.xi_sync.value)
    replica = Replica(sim.plan, sim.setup.initial, sim.config.manifest.outer)
    coordination = _Coordination(replica)
    errors: list[str] = []
    driver = RoundDriver(
        node_id="holder", manifest=sim.policy.manifest, plan=sim.plan, syncer=syncer, replica=replica,
        coordination=coordination, addresses=None, client=None, executor=_InlineExecutor(), clock=clock,
        tasks=TaskSet(), dispatch=lambda actions: None, replica_behind=lambda: "", report_error=errors.append,
        contributions_sent=_Count(), merges_proposed=_Count())
    return driver, coordination, errors


def _unsent_progress(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: (v + np.float32(0.25)).astype(np.float32) for n, v in params.items()}


@pytest.mark.parametrize("apply", ["overwrite", "rebase"])
def test_runner_and_daemon_make_the_same_rounds_payloads_and_learner_states(corpus, apply):
    sim = _runner(corpus, apply)
    contributions = _contributions(sim)
    # The watched learner has 5 unsent steps on every fragment before the merges come in.
    watched = sim.learners[LEARNERS.index(WATCHED)]
    sim.stack.set_flat(watched.index, _unsent_progress(sim.setup.initial))
    watched.c_steps, watched.c_tokens = [5, 5], [80, 80]
    clock = FakeClock(start=0.0)
    driver, coordination, errors = _daemon(sim, clock)  # primed as the runner's syncer is now
    runner_decisions, runner_plans = _spy(sim.syncer)
    _run_runner(sim, contributions)

    daemon_decisions, daemon_plans = _spy(driver.syncer)
    asyncio.run(_run_daemon(driver, clock, coordination, daemon_decisions, contributions,
                            sim.policy.manifest.sync.codec_up))

    assert errors == []
    assert daemon_decisions == runner_decisions
    actions = [(t, p, action) for t, p, action, _, _ in runner_decisions if action == "merge"]
    assert [(p, round(t, 2)) for t, p, _ in actions] == [(0, 9.0), (1, 13.0), (0, 16.2)]
    held = [(round(t, 2), reason) for t, _, _, reason, _ in runner_decisions if reason.startswith("holding")]
    limit = ("at most one round per 0.7 x 8 x 1 s = 5.6 s, 1 early contribution held for the next on-time "
             "ones (until t=17.00 at the latest)")
    assert held == [(10.05, f"holding: this fragment merged 1.1 s ago; {limit}"),
                    (13.0, f"holding: this fragment merged 4.0 s ago; {limit}")]
    assert runner_decisions[-1][3] == "merging: all 2 live learners arrived, including 1 early contribution"
    assert daemon_plans == runner_plans and len(runner_plans) == 3
    assert [c for _, _, _, c in coordination.committed] == [("learner-0", "learner-1"), ("learner-0",),
                                                            ("learner-0", "learner-2")]
    assert driver.replica.state.digest() == sim.global_state.digest()

    # The runner's learner applies its inbox; the daemon's learner thread is offered each commit.
    sim._apply_inbox(watched, float("inf"))
    learner = LearnerThread(node_id=WATCHED, cfg=sim.setup.cfg, manifest=sim.policy.manifest, plan=sim.plan,
                            corpus=corpus, global_params=sim.setup.initial, global_rounds=[0, 0],
                            on_contribution=lambda due: None, on_progress=lambda *a: None)
    learner._write_params(_unsent_progress(sim.setup.initial))
    learner.c_steps, learner.c_tokens = [5, 5], [80, 80]
    for p, round_, params, contributors in coordination.committed:
        learner.offer_fragment(p, round_, params, contributors)
        learner._boundary()
    names = list(sim.setup.initial)
    runner_local, daemon_local = sim.stack.get_flat(watched.index, names), learner._read_params(names)
    for name in names:
        np.testing.assert_array_equal(daemon_local[name], runner_local[name], err_msg=name)
    assert (learner.c_steps, learner.c_tokens) == (watched.c_steps, watched.c_tokens)
    assert learner.base_rounds == watched.base_round == [2, 1]
    # Under rebase, p1's lone merge lacked the watched learner: its unsent steps stay counted.
    assert watched.c_steps == ([0, 0] if apply == "overwrite" else [0, 5])


def _learner(sim: runner._FragmentSync, corpus) -> LearnerThread:
    learner = LearnerThread(node_id=WATCHED, cfg=sim.setup.cfg, manifest=sim.policy.manifest, plan=sim.plan,
                            corpus=corpus, global_params=sim.setup.initial, global_rounds=[0, 0],
                            on_contribution=lambda due: None, on_progress=lambda *a: None)
    learner._write_params(_unsent_progress(sim.setup.initial))
    learner.c_steps, learner.c_tokens = [5, 5], [80, 80]
    return learner


def test_collapsed_offers_apply_with_the_union_of_their_contributors(corpus):
    """Offers not taken before a boundary collapse into the newest round: the learner's work is in
    the result when it is in any of them (no rebase: its progress would count twice), and a
    fragment of unknown contributors (a download) is taken as is."""
    sim = _runner(corpus, "rebase")
    names = sim.plan.fragments[0].names
    base = {n: sim.setup.initial[n] for n in names}
    theta1 = {n: (v + np.float32(1.0)).astype(np.float32) for n, v in base.items()}
    theta2 = {n: (v + np.float32(3.0)).astype(np.float32) for n, v in base.items()}

    mine_then_other = _learner(sim, corpus)
    mine_then_other.offer_fragment(0, 1, theta1, [WATCHED])
    mine_then_other.offer_fragment(0, 2, theta2, ["learner-0"])
    mine_then_other._boundary()
    after = mine_then_other._read_params(names)
    for n in names:
        np.testing.assert_array_equal(after[n], theta2[n])
    assert (mine_then_other.c_steps[0], mine_then_other.base_rounds[0]) == (0, 2)

    others_only = _learner(sim, corpus)
    others_only.offer_fragment(0, 2, theta2, ["learner-1"])
    others_only.offer_fragment(0, 1, theta1, ["learner-0"])  # an older round offered late
    others_only._boundary()
    after = others_only._read_params(names)
    for n in names:  # local + (theta2 - base) = base + 0.25 + 3
        np.testing.assert_allclose(after[n], base[n] + np.float32(3.25), rtol=0, atol=1e-5)
    assert (others_only.c_steps[0], others_only.c_tokens[0], others_only.base_rounds[0]) == (5, 80, 2)

    downloaded = _learner(sim, corpus)
    downloaded.offer_fragment(0, 1, theta1, ["learner-0"])
    downloaded.offer_fragment(0, 2, theta2)  # contributors unknown: a downloaded fragment
    downloaded._boundary()
    after = downloaded._read_params(names)
    for n in names:
        np.testing.assert_array_equal(after[n], theta2[n])
    assert downloaded.c_steps[0] == 0
