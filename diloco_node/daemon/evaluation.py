"""Evaluating the global model on this site's held-out data, every N applied commits.

What is held out: the slice of the training data (`eval_fraction`, reported as set "held_out"),
or, when the site names separate eval sets (`[node.data.eval.NAME]`), each of those, scored
separately on the same fixed windows every time (so a set's figure compares across evaluations
and across sites that name the same files).

The global parameters are copied on the event loop (a few milliseconds of memcpy) and evaluated
in the daemon's `eval` pool (pools.py), never on the training thread: a learner keeps stepping while the
evaluation runs, and at most one evaluation is in flight (a slow one skips intervals rather than
queueing them). Results go to `/status` (`evaluation`: the held-out slice's `loss`, and
`sets`), `/metrics` (`diloco_eval_loss{set=...}`), the history (one `eval` event per set) and
the trackers (`eval/loss`, `eval/<NAME>/loss`). Witnesses have no data and do not evaluate.

Only a replica that is one consistent global state is evaluated (not mid-download), so every
figure is the loss of a model that existed at that commit index.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from concurrent.futures import Executor

import numpy as np

from diloco_node.config.manifest import RunManifest
from diloco_node.daemon.history_hooks import DaemonHistory
from diloco_node.daemon.metrics import DaemonSeries
from diloco_node.daemon.tasks import TaskSet
from diloco_node.learn import data as data_lib
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.config.site_data import HELD_OUT_SET
from diloco_node.ops.status import EvalSetStatus, EvalStatus, StatusBuilder
from diloco_node.sync.replica import Replica

log = logging.getLogger("diloco_node.daemon")


class HeldOutLoss:
    """The jitted loss of flat global parameters on a fixed set of eval windows (built lazily, in
    the evaluation thread, so start-up does not wait for its compilation)."""

    def __init__(self, manifest: RunManifest, eval_tokens: np.ndarray, batches: int) -> None:
        self.manifest = manifest
        self.inputs, self.targets = data_lib.eval_batches(eval_tokens, batches, manifest.inner.batch_size,
                                                          manifest.model.seq_len)
        self._template = None

    def __call__(self, flat: Mapping[str, np.ndarray]) -> float:
        if self._template is None:
            self._template = factory.init_params(self.manifest.model, self.manifest.seed)[1]
        params = model_lib.load_flat_params(self._template, flat)
        return float(factory.eval_fn(factory.recipe(self.manifest.model))(params, self.inputs, self.targets))


class EvalSetsLoss:
    """The jitted loss of flat global parameters on each named token stream (the held-out slice
    as "held_out", the eval sets by name): `batches` fixed batches of windows evenly spaced over
    each stream (`data_lib.eval_batches`, never random). Returns {name: (loss, predicted tokens)}."""

    def __init__(self, manifest: RunManifest, streams: Mapping[str, np.ndarray], batches: int) -> None:
        self.sets = {name: HeldOutLoss(manifest, stream, batches) for name, stream in streams.items()}

    def __call__(self, flat: Mapping[str, np.ndarray]) -> dict[str, tuple[float, int]]:
        return {name: (loss(flat), int(loss.targets.size)) for name, loss in self.sets.items()}


class GlobalEvaluator:
    """Decides when to evaluate (`after_apply`) and publishes what it measured."""

    @classmethod
    def for_site(cls, *, node_id: str, manifest: RunManifest, eval_tokens: np.ndarray | None, every_commits: int,
                 batches: int, replica: Replica, consistent: Callable[[], bool], tasks: TaskSet, executor: Executor,
                 status: StatusBuilder, series: DaemonSeries, history: DaemonHistory,
                 also: Callable[[EvalStatus], None] = lambda result: None,
                 eval_sets: Sequence[tuple[str, np.ndarray]] = ()) -> GlobalEvaluator:
        """The node's evaluator, evaluating in `executor` (the eval pool). `eval_tokens` is the
        held-out slice (None or empty: none, e.g. beside eval sets), `eval_sets` the named sets."""
        streams = {name: stream for name, stream in eval_sets}
        if eval_tokens is not None and len(eval_tokens):
            streams = {HELD_OUT_SET: eval_tokens} | streams
        loss = EvalSetsLoss(manifest, streams, batches) if streams and every_commits > 0 else None

        def publish(result: EvalStatus) -> None:
            status.set_evaluation(result)
            for name, figure in result.figures():
                if figure is not None:
                    series.eval_loss.set(figure, set=name)
            series.eval_commit_index.set(result.commit_index)
            for name, figure in result.figures():
                history.evaluated(result.commit_index, figure, result.seconds, set_name=name)
            also(result)  # the experiment trackers (ops/tracking.py)

        return cls(node_id=node_id, every_commits=every_commits, loss=loss, global_params=replica.state.all_params,
                   consistent=consistent, executor=executor, tasks=tasks, publish=publish)

    def __init__(self, *, node_id: str, every_commits: int, loss: Callable[[Mapping[str, np.ndarray]], Any] | None,
                 global_params: Callable[[], Mapping[str, np.ndarray]], consistent: Callable[[], bool],
                 executor: Executor, tasks: TaskSet, publish: Callable[[EvalStatus], None]) -> None:
        self.node_id = node_id
        self.every_commits = every_commits
        self.loss = loss  # None: nothing to evaluate on (a witness) or evaluation switched off
        self.global_params = global_params
        self.consistent = consistent
        self.executor = executor
        self.tasks = tasks
        self.publish = publish
        self.last_started_at = 0  # applied index of the last evaluation started
        self.running = False
        self.latest = EvalStatus()

    def after_apply(self, applied_index: int) -> None:
        """Called on the event loop after each applied commit."""
        if self.loss is None or self.every_commits <= 0 or self.running:
            return
        if applied_index - self.last_started_at < self.every_commits or not self.consistent():
            return
        snapshot = {name: np.array(array, copy=True) for name, array in self.global_params().items()}
        self.last_started_at = applied_index
        self.running = True
        self.tasks.spawn(self._evaluate(snapshot, applied_index), name="evaluate")

    async def _evaluate(self, snapshot: Mapping[str, np.ndarray], index: int) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            assert self.loss is not None
            value = await loop.run_in_executor(self.executor, self.loss, snapshot)
        except Exception as error:  # an evaluation failure is reported, never fatal to the node
            log.warning("%s: evaluation at commit %d failed: %s: %s", self.node_id, index, type(error).__name__, error)
            return
        finally:
            self.running = False
        seconds = time.perf_counter() - started
        # `loss` gives the held-out slice's figure (a float) or every set's ({name: (loss, tokens)}).
        per_set = dict(value) if isinstance(value, Mapping) else {HELD_OUT_SET: (value, 0)}
        held_out = per_set.pop(HELD_OUT_SET, (None, 0))[0]
        self.latest = EvalStatus(_finite(held_out), index, round(seconds, 3),
                                 {name: EvalSetStatus(_finite(loss), int(tokens)) for name, (loss, tokens) in per_set.items()})
        figures = ", ".join(f"{name} {figure:.4f}" if figure is not None else f"{name} not finite"
                            for name, figure in self.latest.figures())
        log.info("%s: global model eval loss %s at commit %d (%.1f s)", self.node_id, figures, index, seconds)
        self.publish(self.latest)


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
