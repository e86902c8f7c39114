"""Time, injected: the one `Clock` the daemon's parts share, and the fake clock tests drive by hand.

Every I/O-side part of the daemon reads time through a `Clock` it is handed (never `time.monotonic`
directly), and the sans-IO cores take `now` as an argument, so a test can run any part on a
`FakeClock`. Monotonic time drives every local decision; wall time (`wall`) is only stamped on
what other hosts read: history lines, and a commit's planning time ([run.stop] wall_s).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (not comparable across hosts)."""

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling task for `seconds` of this clock's time."""

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        """Run `callback` (on the event loop) once this clock reads `when` or later."""

    def wall(self) -> float:
        """Unix time (comparable across hosts, within their clock skew; may jump)."""


class SystemClock:
    """The host's monotonic clock, asyncio's sleep and the running loop's timers."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), callback)

    def wall(self) -> float:
        return time.time()


class _FakeTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that moves only when told: `advance(s)`, or a `sleep(s)` (which advances by s);
    timers set with `call_at` run as `advance` passes their time.

    Calling the instance returns the time, so it also serves where a plain `() -> float` is wanted.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._timers: list[tuple[float, int, _FakeTimer, Callable[[], object]]] = []
        self._order = itertools.count()

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        """The fake clock has one timeline: its wall time reads as its monotonic time."""
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time on, running every timer that falls due on the way, in time order, each with
        the clock reading its due time."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        end = self.now + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, timer, callback = heapq.heappop(self._timers)
            self.now = max(self.now, when)
            if not timer.cancelled:
                callback()
        self.now = end

    def next_due(self) -> float | None:
        """When the earliest pending timer falls due (None when none is pending)."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        timer = _FakeTimer()
        heapq.heappush(self._timers, (when, next(self._order), timer, callback))
        return timer

    async def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)  # still a suspension point, as a real sleep is


_IMPORTED_AT = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; elsewhere, since this module was imported)."""
    try:
        fields_after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields_after_name[19])  # field 22, starttime, in clock ticks after boot
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT
