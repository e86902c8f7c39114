"""Failure streaks per peer in the transport's log: one line when a peer starts failing, one line
with the count when it answers again, nothing for the failures in between.

A peer that is down is tried every heartbeat by every outbox; a line per refused or failed request
buried the log during an outage (and said nothing the first line did not). The per-request detail
stays on /status (`counters.py`: refusals and the recent errors per peer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

# Streaks tracked at most: a run's members (the wire allows 1024) plus the few addresses a node
# sends to. Past it, a failure of an untracked peer is logged on its own line, as before streaks.
MAX_STREAKS = 1024 + 64


@dataclass(slots=True)
class _Streak:
    started: float
    failures: int
    last: str


class FailureStreaks:
    """Consecutive failures per peer, logged as `what` (e.g. "send to", "refused"); `ended` says
    how a streak ends (e.g. "answered again", "accepted again")."""

    def __init__(self, logger: logging.Logger, what: str, ended: str, *,
                 clock: Callable[[], float] = time.monotonic, max_streaks: int = MAX_STREAKS) -> None:
        self._log = logger
        self._what = what
        self._ended = ended
        self._clock = clock
        self._max = max_streaks
        self._streaks: dict[str, _Streak] = {}

    def failing(self, peer: str) -> int:
        """Failures in `peer`'s current streak (0: none)."""
        streak = self._streaks.get(peer)
        return 0 if streak is None else streak.failures

    def failed(self, peer: str, reason: str) -> None:
        streak = self._streaks.get(peer)
        if streak is not None:
            streak.failures += 1
            streak.last = reason
            return
        if len(self._streaks) >= self._max:
            self._log.info("%s %s: %s", self._what, peer, reason)
            return
        self._streaks[peer] = _Streak(self._clock(), 1, reason)
        self._log.info("%s %s: %s (failing; counted until %s)", self._what, peer, reason, self._ended)

    def succeeded(self, peer: str) -> None:
        streak = self._streaks.pop(peer, None) if self._streaks else None
        if streak is not None:
            self._log.info("%s %s: %s after %d failure(s) over %.1f s (last: %s)", self._what, peer,
                           self._ended, streak.failures, self._clock() - streak.started, streak.last)
