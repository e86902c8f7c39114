"""Time, injected: the one `Clock` the daemon's parts share, and the fake clock tests drive by hand.

Every I/O-side part of the daemon reads time through a `Clock` it is handed (never `time.monotonic`
directly), and the sans-IO cores take `now` as an argument, so a test can run any part on a
`FakeClock`. Only monotonic time is used for decisions; wall time is for humans (history lines).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
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
