"""Time, injected: the one `Clock` the daemon's parts share, and the fake clock tests drive by hand.

Every I/O-side part of the daemon reads time through a `Clock` it is handed (never `time.monotonic`
directly), and the sans-IO cores take `now` as an argument, so a test can run any part on a
`FakeClock`. Monotonic time drives every local decision; wall time (`wall`) is only stamped on
what other hosts read: history lines, and a commit's planning time ([run.stop] wall_s).

For chaos runs the wall clock of one process can be skewed (`set_wall_skew`: a step of so many
seconds plus a drift rate), as NTP stepping or a bad oscillator would; the monotonic clock is
left alone, which is what shows that no lease, timeout or quorum decision depends on wall time.
The loopback operator route `POST /debug/clock` (ops/debug_routes.py) sets it, only in a daemon
started with failpoints allowed.
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


class WallSkew:
    """How far this process's wall clock is from the host's: `offset_s`, plus `drift_rate` seconds
    per second since `since_mono`. Zero in production; changed only by `set_wall_skew`."""

    def __init__(self) -> None:
        self.offset_s = 0.0
        self.drift_rate = 0.0
        self.since_mono = 0.0

    def at(self, mono: float) -> float:
        return self.offset_s + self.drift_rate * (mono - self.since_mono)

    def describe(self) -> dict[str, float]:
        return {"offset_s": self.offset_s, "drift_rate": self.drift_rate}


# Largest skew `set_wall_skew` accepts: a day of step, 10 % of drift (a test or chaos run asks
# for an hour and a few hundred ppm; anything beyond is a typo).
MAX_WALL_OFFSET_S = 86_400.0
MAX_WALL_DRIFT_RATE = 0.1

_wall_skew = WallSkew()


def set_wall_skew(offset_s: float, drift_rate: float = 0.0) -> dict[str, float]:
    """Skew every `SystemClock.wall()` of this process from now on (ValueError when out of range);
    (0, 0) restores the host's clock. The drift accumulates from this call on, on top of the
    step. Returns the skew in force."""
    if not (abs(offset_s) <= MAX_WALL_OFFSET_S):
        raise ValueError(f"wall clock offset must be within +-{MAX_WALL_OFFSET_S:g} s, got {offset_s}")
    if not (abs(drift_rate) <= MAX_WALL_DRIFT_RATE):
        raise ValueError(f"wall clock drift rate must be within +-{MAX_WALL_DRIFT_RATE:g}, got {drift_rate}")
    _wall_skew.since_mono = time.monotonic()
    _wall_skew.offset_s = float(offset_s)
    _wall_skew.drift_rate = float(drift_rate)
    return _wall_skew.describe()


def wall_skew() -> dict[str, float]:
    """The skew in force (zeros unless a test or chaos run set one)."""
    return _wall_skew.describe()


class SystemClock:
    """The host's monotonic clock, asyncio's sleep and the running loop's timers."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), callback)

    def wall(self) -> float:
        return time.time() + _wall_skew.at(time.monotonic())


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
        self.wall_skew = WallSkew()  # `jump_wall` and `drift_wall` move the wall time alone
        self._timers: list[tuple[float, int, _FakeTimer, Callable[[], object]]] = []
        self._order = itertools.count()

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        """The fake clock's wall time reads as its monotonic time, unless `jump_wall` or
        `drift_wall` moved it (as NTP stepping or a drifting oscillator moves a host's)."""
        return self.now + self.wall_skew.at(self.now)

    def jump_wall(self, seconds: float) -> None:
        """Step the wall time by `seconds` (either way); monotonic time does not move."""
        self.wall_skew.offset_s += seconds

    def drift_wall(self, rate: float) -> None:
        """From now on the wall time gains `rate` seconds per second (negative: loses them)."""
        self.wall_skew.offset_s = self.wall_skew.at(self.now)
        self.wall_skew.since_mono = self.now
        self.wall_skew.drift_rate = rate

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
