"""When to merge a fragment round: minimum quorum K plus the adaptive grace window.

The syncer waits until K learners have contributed, then keeps waiting for more for a grace
window that spends the slack the tau-step overlap leaves:

    grace = clip(gamma * (tau * xi_step - (xi_quorum + xi_sync)), 0, cap)

counted from the moment quorum was reached. xi_* are exponential moving averages (`Ema`) of
learner step time, time to reach quorum and transfer+merge time. `decide_round` is a pure
function of (now, round state, policy, estimates) that returns the decision and a human-readable
reason; it reads no clock and does no I/O.

Rounds of one fragment are also rate-limited to the fragment's period: a contribution arriving
sooner than rho * H * xi_step after the fragment's last merge (a straggler's, out of phase with
the others) is held and merged with the next on-time contributions, instead of taking an outer
step of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from diloco_node.config.manifest import SyncSpec

# Default smoothing of the timing estimates: recent rounds dominate within about 5 samples, so
# the grace window follows a change of step time or link speed without jumping on one outlier.
DEFAULT_EMA_ALPHA = 0.2

# rho: a contribution arriving less than rho * H * xi_step after its fragment's last merge is
# "early" (out of phase with the fragment's schedule, e.g. a straggler's) and is held for the next
# on-time contributions. 0.7 leaves a margin of 30% of a period for on-time contributions, whose
# step-time estimate xi_step can be inflated by a slower learner's samples (up to ~1.3x in the
# parity benchmark's straggler scenario: 0.7 x 1.3 < 1), so the fast learners' rounds are not
# held, while a contribution landing in the first 70% of the period waits. Measured (parity,
# straggler, 300 steps): 0.5 -> +1.4% vs synchronous DiLoCo, 0.7 -> -0.7%; no limit: +4.6%.
# 0 disables the limit (synchronous modes: K = M already aligns rounds).
DEFAULT_MIN_ROUND_INTERVAL_FACTOR = 0.7


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
    """K (min_quorum), gamma (< 1: keep a margin of the slack), the cap in seconds, tau in steps,
    and the per-fragment rate limit: rho (min_round_interval_factor) and H (period_steps).

    The rate limit applies only when rho > 0, H > 0, the step time is measured and the caller
    passes the fragment's last merge time; period_steps = 0 (the default) disables it.
    """

    min_quorum: int
    grace_gamma: float
    grace_cap_s: float
    overlap_steps: int
    period_steps: int = 0
    min_round_interval_factor: float = DEFAULT_MIN_ROUND_INTERVAL_FACTOR

    @classmethod
    def from_sync_spec(cls, sync: "SyncSpec") -> "QuorumPolicy":
        return cls(min_quorum=sync.min_quorum, grace_gamma=sync.grace_gamma,
                   grace_cap_s=sync.grace_cap_s, overlap_steps=sync.overlap, period_steps=sync.period)

    def __post_init__(self) -> None:
        if self.min_quorum < 1:
            raise ValueError(f"min_quorum K = {self.min_quorum} must be >= 1")
        if not 0.0 <= self.grace_gamma < 1.0:
            raise ValueError(f"grace_gamma = {self.grace_gamma} must be in [0, 1)")
        if not (math.isfinite(self.grace_cap_s) and self.grace_cap_s >= 0.0):
            raise ValueError(f"grace_cap_s = {self.grace_cap_s} must be a finite number >= 0")
        if self.overlap_steps < 0:
            raise ValueError(f"overlap_steps tau = {self.overlap_steps} must be >= 0")
        if self.period_steps < 0:
            raise ValueError(f"period_steps H = {self.period_steps} must be >= 0")
        if not 0.0 <= self.min_round_interval_factor <= 1.0:
            raise ValueError(f"min_round_interval_factor rho = {self.min_round_interval_factor} must be in [0, 1]")

    def min_round_interval(self, step_s: float | None) -> float:
        """rho * H * xi_step in seconds; 0 (no limit) when disabled or the step time is unknown."""
        if step_s is None or self.period_steps == 0:
            return 0.0
        return self.min_round_interval_factor * self.period_steps * step_s


@dataclass(frozen=True, slots=True)
class RoundDecision:
    """merge_now, or wait until wake_at (None: until the next arrival or membership change)."""

    merge_now: bool
    wake_at: float | None
    have: int
    need: int
    grace_s: float
    reason: str
    quorum_at: float | None = None  # when quorum was reached (feed quorum_at - opened_at - held_s to xi_quorum)
    held_s: float = 0.0  # how much later quorum counted because early contributions were held


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
    last_merge_at: float | None = None,
) -> RoundDecision:
    """Merge now, or wait (until `wake_at`, or for the next arrival when wake_at is None).

    `arrivals` maps learner -> arrival time of its contribution this round; `live_learners` is
    how many learners are currently alive (contributed or not); `last_merge_at` is when this
    fragment last took an outer step (None: never, or the caller does not rate-limit).

    Rate limit (when `policy.min_round_interval(xi_step)` = rho * H * xi_step > 0 and
    last_merge_at is known): a contribution that arrived before last_merge_at + that interval is
    *early*. It is held: it does not count toward quorum until the fragment's next expected round
    at last_merge_at + H * xi_step, so it merges with the next on-time contributions, or alone at
    that time if none come (liveness). Rules, in order:
      1. fewer than K contributions: wait (saying so when fewer than K learners are even alive);
      2. every live learner has contributed: merge at once (held or not: nobody else will come);
      3. quorum counts at t_q = max(opened_at, K-th counted arrival): before t_q (only when early
         contributions are held) hold; otherwise wait until t_q + grace, then merge with whoever
         has arrived.
    """
    if not (math.isfinite(now) and math.isfinite(opened_at)):
        raise ValueError(f"now = {now!r} and opened_at = {opened_at!r} must be finite")
    if last_merge_at is not None and not math.isfinite(last_merge_at):
        raise ValueError(f"last_merge_at = {last_merge_at!r} must be None or finite")
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

    grace, why = _grace_and_why(policy, estimates)

    interval = policy.min_round_interval(estimates.step_s)
    counted = dict(arrivals)
    early: list[str] = []
    hold_note = ""
    if interval > 0.0 and last_merge_at is not None and estimates.step_s is not None:
        early_before = last_merge_at + interval
        next_round_at = last_merge_at + policy.period_steps * estimates.step_s
        early = [m for m, at in arrivals.items() if at < early_before]
        for m in early:
            counted[m] = max(arrivals[m], next_round_at)
        if early:
            hold_note = (f"this fragment merged {now - last_merge_at:.1f} s ago; at most one round per "
                         f"{policy.min_round_interval_factor:g} x {policy.period_steps} x {estimates.step_s:.3g} s"
                         f" = {interval:.1f} s, {len(early)} early contribution{'s' if len(early) != 1 else ''} "
                         f"held for the next on-time ones")
    if have >= live_learners:
        if live_learners == 0:
            reason = f"merging: no live learners left to wait for ({have} contribution{'s' if have != 1 else ''})"
        elif have == live_learners:
            reason = f"merging: all {live_learners} live learner{'s' if live_learners != 1 else ''} arrived"
        else:
            reason = f"merging: all {live_learners} live learners arrived ({have} contributions)"
        if early:
            reason += f", including {len(early)} early contribution{'s' if len(early) != 1 else ''}"
        quorum_at = max(opened_at, sorted(arrivals.values())[need - 1])
        return RoundDecision(True, None, have, need, grace, reason, quorum_at)

    raw_quorum_at = max(opened_at, sorted(arrivals.values())[need - 1])
    quorum_at = max(opened_at, sorted(counted.values())[need - 1])
    held_s = quorum_at - raw_quorum_at

    if held_s > 0.0 and now < quorum_at:
        reason = f"holding: {hold_note} (until t={quorum_at:.2f} at the latest)"
        return RoundDecision(False, quorum_at, have, need, grace, reason, quorum_at, held_s)

    deadline = quorum_at + grace
    missing = live_learners - have
    if now >= deadline:
        if grace == 0.0:
            reason = f"merging: quorum {need}/{need} reached with {have} of {live_learners}; {why}"
        else:
            reason = f"merging: grace window of {grace:.2f} s expired with {have} of {live_learners}"
        if held_s > 0.0:
            reason += f" (early contributions held {held_s:.2f} s)"
        return RoundDecision(True, None, have, need, grace, reason, quorum_at, held_s)
    reason = (f"quorum {need}/{need} reached at t={quorum_at:.2f} ({have} of {live_learners} arrived); "
              f"waiting grace {grace:.2f} s for "
              f"{missing} more live learner{'s' if missing != 1 else ''} (until t={deadline:.2f})")
    return RoundDecision(False, deadline, have, need, grace, reason, quorum_at, held_s)
