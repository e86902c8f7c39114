"""Event-loop lag: how late the daemon's one asyncio loop runs what is due.

Every coordination promise rides on this loop answering on time: a holder whose loop stalls for
longer than the lease loses it, and a follower whose loop stalls misses heartbeats and campaigns.
Such stalls (a blocking call that slipped onto the loop, GC, a starved CPU) are invisible in the
protocol's own reasons, so the daemon measures them: a task sleeps a fixed tick and records how
much later than asked it woke. The worst lag of the current window and of the previous one are
reported (`/status`, `/metrics`), and a lag above `warn_after_s` is logged with what it risks.

`LagWindow` is the clock-free bookkeeping (tested directly); `watch_loop_lag` is the task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from diloco_node.clock import Clock

log = logging.getLogger("diloco_node.daemon")

# 50 ms ticks resolve stalls well below the 0.5 s heartbeat at a negligible cost (20 wake-ups/s).
DEFAULT_TICK_S = 0.05
# Report the worst lag per 10 s window: long enough to catch a stall, short enough to be current.
DEFAULT_WINDOW_S = 10.0
# A stall of a third of the default 3 s lease already eats into failover margins: worth a line.
DEFAULT_WARN_AFTER_S = 1.0


@dataclass(slots=True)
class LagWindow:
    """Worst lag in the current window and the last completed one; total stalls seen."""

    window_s: float = DEFAULT_WINDOW_S
    warn_after_s: float = DEFAULT_WARN_AFTER_S
    window_started: float | None = None
    current_max_s: float = 0.0
    previous_max_s: float = 0.0
    stalls: int = 0  # lags above warn_after_s since start

    def __post_init__(self) -> None:
        if not self.window_s > 0 or not self.warn_after_s > 0:
            raise ValueError(f"window_s and warn_after_s must be > 0, got {self.window_s}, {self.warn_after_s}")

    def record(self, lag_s: float, now: float) -> bool:
        """Add one measurement taken at `now`; True when it is a stall worth reporting."""
        if self.window_started is None:
            self.window_started = now
        elif now - self.window_started >= self.window_s:
            self.previous_max_s, self.current_max_s = self.current_max_s, 0.0
            self.window_started = now
        lag_s = max(0.0, lag_s)
        self.current_max_s = max(self.current_max_s, lag_s)
        stalled = lag_s >= self.warn_after_s
        if stalled:
            self.stalls += 1
        return stalled

    @property
    def worst_recent_s(self) -> float:
        """The worst lag over the last one to two windows."""
        return max(self.current_max_s, self.previous_max_s)


async def watch_loop_lag(window: LagWindow, node_id: str, clock: Clock, tick_s: float = DEFAULT_TICK_S,
                         on_sample: Callable[[float], None] | None = None) -> None:
    """Run until cancelled: sleep `tick_s` on `clock` (the host's, for a lag that means anything),
    record how late the wake-up was."""
    if not tick_s > 0:
        raise ValueError(f"tick_s must be > 0, got {tick_s}")
    while True:
        asked = clock.monotonic()
        await clock.sleep(tick_s)
        now = clock.monotonic()
        lag = now - asked - tick_s
        if window.record(lag, now):
            log.warning("%s: event loop stalled %.2f s (heartbeats, votes and acknowledgements were late by as "
                        "much; a stall near the lease time costs the lease or starts an election)", node_id, lag)
        if on_sample is not None:
            on_sample(window.worst_recent_s)
