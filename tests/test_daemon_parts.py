"""The daemon's small pure parts: readiness with its reasons, the systemd status throttle, the task
set, and the injected clocks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import numpy as np
import pytest

from diloco_node.clock import FakeClock, SystemClock
from diloco_node.daemon.notify import StatusLineThrottle
from diloco_node.daemon.readiness import Readiness, ReadinessFacts, readiness
from diloco_node.daemon.tasks import TaskSet

CAUGHT_UP = ReadinessFacts(download=None, learner_compiling=False, has_voters=True, applied_index=12,
                           consistent_from=0, log_applied_index=12, commit_target=12, replacing_state=False,
                           was_ready=False, role="follower", epoch=3)


@pytest.mark.parametrize(("change", "expected"), [
    ({}, Readiness(True, True, "ready: follower, epoch 3, applied 12")),
    ({"was_ready": True}, Readiness(True, False, "ready: follower, epoch 3, applied 12")),
    ({"download": "downloading global state: 1/4 fragments, 10/40 bytes"},
     Readiness(False, False, "downloading global state: 1/4 fragments, 10/40 bytes")),
    ({"learner_compiling": True}, Readiness(False, False, "compiling the training step")),
    ({"has_voters": False}, Readiness(False, False, "waiting for the run's configuration to replicate")),
    ({"consistent_from": 15}, Readiness(False, False, "replaying the log: applied 12 of 15")),
    ({"commit_target": 20}, Readiness(False, False, "catching up: applied 12 of 20")),
    # Once ready, catching up keeps it ready (its state is always one committed state)...
    ({"was_ready": True, "commit_target": 20}, Readiness(True, False, "ready: follower, epoch 3, applied 12")),
    # ...but a snapshot install does not: the state is not one state until replayed.
    ({"was_ready": True, "replacing_state": True, "consistent_from": 15},
     Readiness(False, False, "installing a snapshot: replaying the log: applied 12 of 15")),
    # A ready node whose coordination is stalled (no lease holder heard within the lease) says so...
    ({"was_ready": True, "coordination_silent_s": 7.25, "lease_s": 3.0},
     Readiness(False, False, "coordination stalled: no lease holder heard from for 7.2 s (lease 3 s); "
                             "follower, epoch 3")),
    # ...and within the lease it is still ready.
    ({"was_ready": True, "coordination_silent_s": 2.0, "lease_s": 3.0},
     Readiness(True, False, "ready: follower, epoch 3, applied 12")),
])
def test_readiness_and_its_reason(change, expected) -> None:
    assert readiness(dataclasses.replace(CAUGHT_UP, **change)) == expected


def test_status_line_is_sent_when_its_kind_changes_else_at_most_every_interval() -> None:
    throttle = StatusLineThrottle(every_s=10.0)
    assert throttle.due("catching up: applied 1 of 9", now=0.0)
    assert not throttle.due("catching up: applied 2 of 9", now=1.0)  # numbers only
    assert throttle.due("ready: follower, epoch 1, applied 9", now=2.0)  # a new kind of state
    assert not throttle.due("ready: follower, epoch 1, applied 10", now=11.9)
    assert throttle.due("ready: follower, epoch 1, applied 11", now=12.0)


async def test_task_set_cancels_what_is_left_and_logs_failures(caplog) -> None:
    tasks = TaskSet()
    forever = tasks.spawn(asyncio.Event().wait(), name="forever")

    async def fail() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="diloco_node.daemon"):
        tasks.spawn(fail(), name="failing")
        await asyncio.sleep(0.01)
    assert "task failing failed" in caplog.text and len(tasks) == 1
    await tasks.close()
    assert forever.cancelled() and len(tasks) == 0


async def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(5.0)
    assert clock.monotonic() == clock() == 5.0
    await clock.sleep(2.5)
    clock.advance(0.5)
    assert clock.monotonic() == 8.0
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1.0)
    system = SystemClock()
    before = system.monotonic()
    await system.sleep(0.01)
    assert system.monotonic() - before >= 0.009


# ---------------------------------------------------------------------------------------------
# The evaluator: every N applied commits, one at a time, only on a consistent replica


async def test_the_evaluator_runs_every_n_commits_one_at_a_time_on_a_consistent_state() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from diloco_node.daemon.evaluation import GlobalEvaluator
    from diloco_node.ops.status import EvalStatus

    params = {"w": np.ones(3, np.float32)}
    release = asyncio.Event()
    seen: list[dict] = []
    published: list[EvalStatus] = []
    consistent = [True]
    loop = asyncio.get_running_loop()

    def loss(flat):  # runs in the evaluator's thread; waits until the test lets it finish
        seen.append({k: v.copy() for k, v in flat.items()})
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(5)
        return float(flat["w"].sum())

    tasks = TaskSet()
    evaluator = GlobalEvaluator(node_id="a", every_commits=3, loss=loss, global_params=lambda: params,
                                consistent=lambda: consistent[0], executor=ThreadPoolExecutor(1), tasks=tasks,
                                publish=published.append)
    for index in (1, 2):
        evaluator.after_apply(index)
    assert not evaluator.running  # not yet 3 commits
    evaluator.after_apply(3)
    assert evaluator.running
    params["w"][:] = 5.0  # the state moves on: the evaluation keeps its snapshot
    for index in (4, 5, 6, 7):
        evaluator.after_apply(index)  # one at a time: skipped, not queued
    release.set()
    while evaluator.running:
        await asyncio.sleep(0.01)
    assert published == [EvalStatus(3.0, 3, published[0].seconds)]
    consistent[0] = False  # mid-download: never evaluated
    evaluator.after_apply(9)
    assert not evaluator.running
    consistent[0] = True
    evaluator.after_apply(9)
    while evaluator.running:
        await asyncio.sleep(0.01)
    assert [p.commit_index for p in published] == [3, 9] and published[1].loss == 15.0
    assert len(seen) == 2
    await tasks.close()


def test_a_witness_or_a_disabled_evaluator_never_evaluates() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from diloco_node.daemon.evaluation import GlobalEvaluator

    for loss, every in ((None, 3), (lambda flat: 1.0, 0)):
        evaluator = GlobalEvaluator(node_id="w", every_commits=every, loss=loss, global_params=dict,
                                    consistent=lambda: True, executor=ThreadPoolExecutor(1), tasks=TaskSet(),
                                    publish=lambda result: None)
        evaluator.after_apply(100)
        assert not evaluator.running
