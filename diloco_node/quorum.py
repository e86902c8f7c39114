"""When to merge a fragment round: minimum quorum K plus the adaptive grace window.

The syncer waits until K learners have contributed, then keeps waiting for more for a grace
window that spends the slack the tau-step overlap leaves:

    grace = clip(gamma * (tau * xi_step - (xi_quorum + xi_sync)), 0, cap)

counted from the moment quorum was reached. xi_* are exponential moving averages (`Ema`) of
learner step time, time to reach quorum and transfer+merge time. `decide_round` is a pure
function of (now, round state, policy, estimates) that returns the decision and a human-readable
reason; it reads no clock and does no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from diloco_node.run_config import SyncSpec

# Default smoothing of the timing estimates: recent rounds dominate within about 5 samples, so
# the grace window follows a change of step time or link speed without jumping on one outlier.
DEFAULT_EMA_ALPHA = 0.2


class Ema:
    """Exponential moving average; `value` is None until the first sample, which it takes as is."""

    def __init__(self, alpha: float = DEFAULT_EMA_ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"EMA alpha = {alpha} must be in (0, 1]")
        self.alpha = alpha
        self.value: float | None = None

    def update(self, x: float) -> float:
        if not math.isfinite(x):
            raise ValueError(f"EMA sample {x!r} is not finite")
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        return self.value


@dataclass(frozen=True, slots=True)
class TimingEstimates:
    """Current estimates in seconds (None while nothing has been measured)."""

    step_s: float | None
    quorum_s: float | None
    sync_s: float | None

    def __post_init__(self) -> None:
        for name in ("step_s", "quorum_s", "sync_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"TimingEstimates.{name} = {value!r} must be None or a finite number >= 0")


@dataclass(frozen=True, slots=True)
class QuorumPolicy:
    """K (min_quorum), gamma (< 1: keep a margin of the slack), the cap in seconds, and tau in steps."""

    min_quorum: int
    grace_gamma: float
    grace_cap_s: float
    overlap_steps: int

    @classmethod
    def from_sync_spec(cls, sync: "SyncSpec") -> "QuorumPolicy":
        return cls(min_quorum=sync.min_quorum, grace_gamma=sync.grace_gamma,
                   grace_cap_s=sync.grace_cap_s, overlap_steps=sync.overlap)

    def __post_init__(self) -> None:
        if self.min_quorum < 1:
            raise ValueError(f"min_quorum K = {self.min_quorum} must be >= 1")
        if not 0.0 <= self.grace_gamma < 1.0:
            raise ValueError(f"grace_gamma = {self.grace_gamma} must be in [0, 1)")
        if not (math.isfinite(self.grace_cap_s) and self.grace_cap_s >= 0.0):
            raise ValueError(f"grace_cap_s = {self.grace_cap_s} must be a finite number >= 0")
        if self.overlap_steps < 0:
            raise ValueError(f"overlap_steps tau = {self.overlap_steps} must be >= 0")


@dataclass(frozen=True, slots=True)
class RoundDecision:
    """merge_now, or wait until wake_at (None: until the next arrival or membership change)."""

    merge_now: bool
    wake_at: float | None
    have: int
    need: int
    grace_s: float
    reason: str
    quorum_at: float | None = None  # when quorum was reached (feed now - opened_at of it to xi_quorum)


def _grace_and_why(policy: QuorumPolicy, estimates: TimingEstimates) -> tuple[float, str]:
    if estimates.step_s is None or estimates.quorum_s is None or estimates.sync_s is None:
        unknown = [n for n, v in (("step", estimates.step_s), ("quorum", estimates.quorum_s),
                                  ("sync", estimates.sync_s)) if v is None]
        return 0.0, f"no grace window until {'/'.join(unknown)} time is measured"
    slack = policy.overlap_steps * estimates.step_s - (estimates.quorum_s + estimates.sync_s)
    grace = min(max(policy.grace_gamma * slack, 0.0), policy.grace_cap_s)
    if slack <= 0.0:
        return 0.0, (f"no grace window: no slack (tau*step {policy.overlap_steps * estimates.step_s:.2f} s "
                     f"<= quorum+sync {estimates.quorum_s + estimates.sync_s:.2f} s)")
    if grace == 0.0:
        return 0.0, "no grace window (grace_gamma or grace_cap_s is 0)"
    return grace, f"grace {grace:.2f} s"


def grace_window(policy: QuorumPolicy, estimates: TimingEstimates) -> float:
    """clip(gamma * (tau * xi_step - (xi_quorum + xi_sync)), 0, cap) in seconds.

    0 while any estimate is unknown: without a measured step time there is no basis for knowing
    how much slack the overlap leaves, and waiting longer than the slack would delay learners.
    """
    return _grace_and_why(policy, estimates)[0]


def decide_round(
    now: float,
    opened_at: float,
    arrivals: Mapping[str, float],
    live_learners: int,
    policy: QuorumPolicy,
    estimates: TimingEstimates,
) -> RoundDecision:
    """Merge now, or wait (until `wake_at`, or for the next arrival when wake_at is None).

    `arrivals` maps learner -> arrival time of its contribution this round; `live_learners` is
    how many learners are currently alive (contributed or not). Rules, in order:
      1. fewer than K contributions: wait (saying so when fewer than K learners are even alive);
      2. every live learner has contributed: merge at once;
      3. quorum reached at t_q = max(opened_at, time of the K-th arrival): wait until
         t_q + grace, then merge with whoever has arrived.
    """
    if not (math.isfinite(now) and math.isfinite(opened_at)):
        raise ValueError(f"now = {now!r} and opened_at = {opened_at!r} must be finite")
    if live_learners < 0:
        raise ValueError(f"live_learners = {live_learners} must be >= 0")
    for learner, arrived_at in arrivals.items():
        if not math.isfinite(arrived_at):
            raise ValueError(f"arrival time of {learner} = {arrived_at!r} must be finite")
    need = policy.min_quorum
    have = len(arrivals)

    if have < need:
        reason = f"waiting: {have} of {need} needed contributions"
        if live_learners < need:
            reason += (f"; only {live_learners} live learner{'s' if live_learners != 1 else ''}, "
                       f"quorum K = {need} cannot be reached until more learners are live")
        return RoundDecision(False, None, have, need, 0.0, reason)

    times = sorted(arrivals.values())
    quorum_at = max(opened_at, times[need - 1])
    grace, why = _grace_and_why(policy, estimates)

    if have >= live_learners:
        if live_learners == 0:
            reason = f"merging: no live learners left to wait for ({have} contribution{'s' if have != 1 else ''})"
        elif have == live_learners:
            reason = f"merging: all {live_learners} live learner{'s' if live_learners != 1 else ''} arrived"
        else:
            reason = f"merging: all {live_learners} live learners arrived ({have} contributions)"
        return RoundDecision(True, None, have, need, grace, reason, quorum_at)

    deadline = quorum_at + grace
    missing = live_learners - have
    if now >= deadline:
        if grace == 0.0:
            reason = f"merging: quorum {need}/{need} reached with {have} of {live_learners}; {why}"
        else:
            reason = f"merging: grace window of {grace:.2f} s expired with {have} of {live_learners}"
        return RoundDecision(True, None, have, need, grace, reason, quorum_at)
    reason = (f"quorum {need}/{need} reached at t={quorum_at:.2f} ({have} of {live_learners} arrived); "
              f"waiting grace {grace:.2f} s for "
              f"{missing} more live learner{'s' if missing != 1 else ''} (until t={deadline:.2f})")
    return RoundDecision(False, deadline, have, need, grace, reason, quorum_at)
