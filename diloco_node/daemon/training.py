"""The learner seen from the event loop: the slot it fills, what its progress reports, a lost host.

- `LearnerSlot`: the site's learner once training started (empty before, and always on a
  witness); the state keeper offers it every applied fragment, /livez asks it whether training
  runs.
- `LearnerReports`: called in the learner's thread after every step; the step's figures go to
  /status, /metrics, the history and the trackers (all thread-safe), with MFU once the site's
  FLOPs are resolved.
- `watch_cluster_learner`: a multi-host site cannot train on without one of its hosts; the watch
  returns the failure's reason, and names a suspect first when a step hangs instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from diloco_node.clock import Clock, SystemClock
from diloco_node.config.site_devices import ClusterSpec
from diloco_node.daemon.history_hooks import DaemonHistory
from diloco_node.daemon.learner_figures import SiteFlops
from diloco_node.daemon.metrics import DaemonSeries
from diloco_node.learn.cluster import failure_reason
from diloco_node.learn.learner_thread import LearnerThread
from diloco_node.learn.synthetic_learner import SyntheticLearner
from diloco_node.ops import tracking as tracking_lib
from diloco_node.ops.liveness import Liveness, StepPace, liveness
from diloco_node.ops.status import StatusBuilder
from diloco_node.ops.tracking import Tracking

log = logging.getLogger("diloco_node.daemon")

Learner = LearnerThread | SyntheticLearner
# The learner stamps its steps on the host's monotonic clock (learn/learner_thread.py), whatever
# clock the node was given, so a stalled step is measured on the same one.
HOST_CLOCK = SystemClock()


class LearnerSlot:
    def __init__(self) -> None:
        self.learner: Learner | None = None

    def fill(self, learner: Learner) -> None:
        self.learner = learner

    def offer_fragment(self, p: int, round_: int, params: Mapping[str, np.ndarray],
                       contributors: Sequence[str] = ()) -> None:
        """A fragment applied, downloaded or repaired; nothing to do before training starts."""
        if self.learner is not None:
            self.learner.offer_fragment(p, round_, params, contributors)  # type: ignore[arg-type]

    def tracked_step(self) -> int:
        """The trackers' x axis: the learner's step (0 on a witness or before training)."""
        return int(self.learner.steps) if self.learner is not None else 0

    def live(self, now: float, pace: StepPace) -> Liveness:
        learner = self.learner
        return liveness(now=now, learner_error=learner.error if learner is not None else None,
                        training=learner is not None and not learner.stop_requested, pace=pace)


class LearnerReports:
    """What each learner step reports. `site_flops` (MFU's inputs) arrives once resolved, off the
    loop, after the site's model is built; None until then and on a site without a training learner."""

    def __init__(self, *, node_id: str, slot: LearnerSlot, status: StatusBuilder, series: DaemonSeries, history: DaemonHistory,
                 tracking: Tracking, pace: StepPace, clock: Clock) -> None:
        self.node_id = node_id
        self.slot = slot
        self.status = status
        self.series = series
        self.history = history
        self.tracking = tracking
        self.pace = pace  # the learner's step interval: a stalled learner fails /livez
        self.clock = clock
        self.site_flops: SiteFlops | None = None
        self._counted_seconds = (0.0, 0.0)  # learner compute and sync seconds already in the counters
        self._figures_seen: Any = None  # the learner's last StepFigures already reported

    async def resolve_site_flops(self, model: Any, devices: Any, peak_tflops: float | None,
                                 executor: Executor) -> None:
        """MFU's inputs, in `executor` (a user's model is compiled for XLA's cost analysis)."""
        loop = asyncio.get_running_loop()
        self.site_flops = site_flops = await loop.run_in_executor(
            executor, lambda: SiteFlops.resolve(model, devices, peak_tflops))
        log.info("%s: %s", self.node_id, site_flops.describe())

    def on_progress(self, step: int, loss: float, tokens: int) -> None:
        """Called in the learner thread after every step."""
        now = self.clock.monotonic()
        self.pace.step(now)
        self.status.record_learner(step=step, loss=loss, tokens=tokens, now=now)
        learner = self.slot.learner
        window = self._learner_window(learner)
        if learner is not None:
            # The learner keeps cumulative seconds; the counters take what was added since.
            compute, sync = learner.compute_seconds_total, learner.sync_seconds_total
            self.series.learner_compute_seconds.inc(max(0.0, compute - self._counted_seconds[0]))
            self.series.learner_sync_seconds.inc(max(0.0, sync - self._counted_seconds[1]))
            self._counted_seconds = (compute, sync)
            self.series.step_seconds.observe(learner.step_seconds)
        self.history.learner_step(step, loss, tokens, learner, figures=window)
        if window is not None:
            self.tracking.log(step, {"learner/loss": loss, "learner/tokens": tokens,
                                     **{f"learner/{name}": value for name, value in window.items()}})

    def _learner_window(self, learner: Any) -> dict[str, float | None] | None:
        """The figures of a step window the learner closed since the last call (None: none), with
        MFU; published on /status (the gauges follow) and returned for the history."""
        figures = getattr(learner, "figures", None)  # the synthetic learner has none
        if figures is None or figures is self._figures_seen:
            return None
        self._figures_seen = figures
        site_flops = self.site_flops
        mfu = site_flops.mfu(figures.tokens_per_s) if site_flops is not None else None
        self.status.set_learner_figures(step_time_s=figures.step_time_s, mfu=mfu, grad_norm=figures.grad_norm,
                                        lr=figures.lr)
        return {"tokens_per_s": figures.tokens_per_s, "step_time_s": figures.step_time_s, "mfu": mfu,
                "grad_norm": figures.grad_norm, "lr": figures.lr}

    def track_evaluation(self, result: Any) -> None:
        """An evaluation's losses to the trackers, at the learner's step."""
        scalars = {"eval/loss": result.loss} | {tracking_lib.eval_set_scalar(name): figure.loss
                                                 for name, figure in result.sets.items()}
        self.tracking.log(self.slot.tracked_step(), scalars)


async def watch_cluster_learner(slot: LearnerSlot, *, node_id: str, cluster: ClusterSpec, check_s: float, stall_warn_s: float,
                                clock: Clock, status: StatusBuilder, executor: Executor) -> str:
    """Until the learner fails: then why (a lost host, in `executor`: it may ask JAX).

    A multi-host site cannot train on without one of its hosts (its JAX cluster is broken for
    good), so the node ends the process on this answer: /livez fails at once, and the daemon exits
    1 so the unit's Restart=on-failure brings the site back.

    A collective can also hang instead of failing (a killed host's broken connection is not always
    noticed); then JAX aborts the process when the lost host's heartbeats are overdue.
    `stall_warn_s` (a quarter of that time) into one step we say so first, so our log names the
    host before JAX's abort (which came 7.6-9 s after a kill with a 10 s timeout, on loopback). A
    step that is merely long only costs one warning.
    """
    first_steps, warned = None, False
    while slot.learner is None or slot.learner.error is None:
        await clock.sleep(check_s)
        learner = slot.learner
        if learner is None or warned:
            continue
        if first_steps is None:  # a stall counts only once the learner has trained
            first_steps = learner.steps
        stalled_s = HOST_CLOCK.monotonic() - learner.last_step_at
        if learner.steps > first_steps and stalled_s > stall_warn_s and learner.is_alive():
            warned = True
            # Not the coordination service's liveness query: it can block, and this line must
            # come before JAX's abort. On two processes the suspect is the other one.
            who = "process 1" if cluster.num_processes == 2 else "another of the site's processes"
            message = (f"{node_id}: the learner has waited {stalled_s:.1f} s in one step: the site's JAX "
                       f"cluster may have lost {who}; JAX stops the site when a host misses its heartbeats "
                       f"for cluster.heartbeat_timeout_s = {cluster.heartbeat_timeout_s} s")
            log.warning("%s", message)
            status.record_error(message, clock.monotonic())
    error = slot.learner.error
    return await asyncio.get_running_loop().run_in_executor(executor, failure_reason, error)
