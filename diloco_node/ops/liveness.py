"""Is this node alive, and why not: one pure decision over how the training thread keeps pace.

`/livez` and the systemd watchdog both ask `liveness()`. A crashed learner is caught by its error;
a hung one (a wedged device, a deadlock in the step) by the time since its last step, measured
against an exponential moving average of its own step interval: no step for `STALL_FACTOR` times
the expected interval (and at least `MIN_STALL_S`) is a stall. Before `WARMUP_STEPS` steps there
is no expectation yet (the first steps after compiling run slower), so a stall cannot be declared.
`StepPace` is fed from the training thread and read from the event loop, hence its lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# A step interval that grows twentyfold is no longer a slow step: boundaries that merge
# fragments or copy a checkpoint cost a few step times, a device that stops answering never ends.
STALL_FACTOR = 20.0
# ... and never under a minute: tiny CPU steps (milliseconds) times 20 would call a garbage
# collection pause or a disk flush a hang, and a watchdog restart costs far more than a minute.
MIN_STALL_S = 60.0
# Steps before the average is trusted: the first ones after compiling warm caches and allocators.
WARMUP_STEPS = 3
# Weight of the newest interval in the average: about the last ten steps count.
EMA_WEIGHT = 0.1


@dataclass(frozen=True, slots=True)
class Liveness:
    alive: bool
    reason: str  # shown by /livez and logged when the watchdog stops pinging


ALIVE = Liveness(True, "ok")


class StepPace:
    """The learner's step interval (EMA) and when it last stepped, on the node's monotonic clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.last_step_at: float | None = None
        self.interval_ema_s: float | None = None

    def step(self, now: float) -> None:
        with self._lock:
            if self.last_step_at is not None:
                interval = now - self.last_step_at
                ema = self.interval_ema_s
                self.interval_ema_s = interval if ema is None else ema + EMA_WEIGHT * (interval - ema)
            self.last_step_at = now
            self.steps += 1

    def snapshot(self) -> tuple[int, float | None, float | None]:
        with self._lock:
            return self.steps, self.last_step_at, self.interval_ema_s


def stall_after_s(interval_ema_s: float, factor: float = STALL_FACTOR, floor_s: float = MIN_STALL_S) -> float:
    return max(floor_s, factor * interval_ema_s)


def liveness(*, now: float, learner_error: BaseException | None, training: bool, pace: StepPace | None,
             factor: float = STALL_FACTOR, floor_s: float = MIN_STALL_S) -> Liveness:
    """`training`: a learner thread was started and not asked to stop (a witness, a learner still
    compiling, or one stopping at the end of the run has no pace to keep)."""
    if learner_error is not None:
        return Liveness(False, f"learner thread failed: {type(learner_error).__name__}: {learner_error}")
    if not training or pace is None:
        return ALIVE
    steps, last_step_at, ema = pace.snapshot()
    if steps < WARMUP_STEPS or last_step_at is None or ema is None:
        return ALIVE
    silent_s = now - last_step_at
    limit_s = stall_after_s(ema, factor, floor_s)
    if silent_s > limit_s:
        return Liveness(False, f"learner stalled: no step for {silent_s:.1f} s (expected every {ema:.3g} s; "
                               f"stalled after {limit_s:.1f} s)")
    return ALIVE
