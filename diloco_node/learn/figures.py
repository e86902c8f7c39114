"""The learner's figures per step window: tokens/s, step time, gradient norm and learning rate.

`FigureWindow` is fed by the training thread after every step and closes a window every
`FIGURES_WINDOW_S` seconds (at least one step); each closed window is one frozen `StepFigures`,
which the node reads from the learner (`LearnerThread.figures`) and turns into /status, /metrics,
the history and the trackers. MFU is not here: it needs the site's devices and the model's FLOPs
(learn/flops.py), which the node knows.

Nothing here waits on the device: the gradient norm handed in is a step that is already done
(the thread's loss fetch of the previous step has waited for it), and the learning rate is the
schedule evaluated on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# Long enough that tokens/s and step time average out the host/device jitter of single steps (and
# that the one gradient-norm fetch per window costs nothing measurable); short enough that a
# change shows on the live page (2.5 s samples) and in the trackers within seconds.
FIGURES_WINDOW_S = 2.0


@dataclass(frozen=True, slots=True)
class StepFigures:
    """One window of training: steps `first_step`..`step`, `seconds` of wall time.

    `tokens_per_s` and `step_time_s` are wall-clock over the window (boundary work and any pacing
    included: what the run gets); `grad_norm` is the global norm of the batch gradient before
    clipping of step `grad_norm_step` (the latest finished step; None until one finished or when
    it was not finite); `lr` is the inner learning rate of step `step`'s update.
    """

    step: int
    first_step: int
    seconds: float
    tokens: int
    tokens_per_s: float
    step_time_s: float
    grad_norm: float | None
    grad_norm_step: int
    lr: float | None

    def __post_init__(self) -> None:
        if self.step < self.first_step or self.first_step < 1:
            raise ValueError(f"step figures: steps {self.first_step}..{self.step}: must be 1 <= first <= last")
        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"step figures: seconds = {self.seconds}: must be a finite number > 0")
        if self.tokens < 0:
            raise ValueError(f"step figures: tokens = {self.tokens}: must be >= 0")

    @property
    def steps(self) -> int:
        return self.step - self.first_step + 1


class FigureWindow:
    """Accumulates steps into windows; `step(...)` returns the window it closed, else None.

    `started` is the time the window's first step began (the previous window's end, or the first
    step's start); the caller passes the same clock's readings (time.perf_counter in the thread).
    """

    def __init__(self, window_s: float = FIGURES_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"figures window {window_s} s: must be > 0")
        self.window_s = window_s
        self._started: float | None = None
        self._first_step = 0
        self._tokens = 0

    def begin(self, now: float) -> None:
        """The first step (or the first after a pause the caller does not want counted) starts now."""
        self._started, self._tokens, self._first_step = now, 0, 0

    def step(self, step: int, tokens: int, now: float, grad_norm: Callable[[], tuple[float | None, int]],
             lr: Callable[[int], float | None]) -> StepFigures | None:
        """Step `step` (its `tokens`) ended at `now`. `grad_norm()` and `lr(step)` are called only
        when a window closes (they may cost a device fetch or a schedule evaluation)."""
        if self._started is None:
            self._started = now
        if self._first_step == 0:
            self._first_step = step
        self._tokens += tokens
        seconds = now - self._started
        if seconds < self.window_s or seconds <= 0:
            return None
        norm, norm_step = grad_norm()
        steps = step - self._first_step + 1
        figures = StepFigures(step=step, first_step=self._first_step, seconds=seconds, tokens=self._tokens,
                              tokens_per_s=self._tokens / seconds, step_time_s=seconds / steps,
                              grad_norm=norm if norm is not None and math.isfinite(norm) else None,
                              grad_norm_step=norm_step, lr=lr(step))
        self._started, self._first_step, self._tokens = now, 0, 0
        return figures
