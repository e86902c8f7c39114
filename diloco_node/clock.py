"""Time, injected: the one `Clock` the daemon's parts share, and the fake clock tests drive by hand.

Every I/O-side part of the daemon reads time through a `Clock` it is handed (never `time.monotonic`
directly), and the sans-IO cores take `now` as an argument, so a test can run any part on a
`FakeClock`. Only monotonic time is used for decisions; wall time is for humans (history lines).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (not comparable across hosts)."""

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling task for `seconds` of this clock's time."""


class SystemClock:
    """The host's monotonic clock and asyncio's sleep."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock:
    """A clock that moves only when told: `advance(s)`, or a `sleep(s)` (which advances by s).

    Calling the instance returns the time, so it also serves where a plain `() -> float` is wanted.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)  # still a suspension point, as a real sleep is
