"""Run metrics from histories alone: goodput, uptime, commit gaps, failover times, lease holder.

Pure functions of parsed histories and a measurement window [t0, t1] on the shared monotonic
clock (every process on one host reads the same CLOCK_MONOTONIC; histories from several hosts
cannot be compared this way). Definitions, with the reasoning, are in docs/CHAOS.md:

- goodput = productive learner-seconds / Σ learner wall-seconds, where a learner's productive
  seconds are the `productive_s` of its `step` events minus the work a crash threw away (steps
  recorded before a restart with no commit that merged that learner in between);
- commit times: the first `commit` event per index, on any node;
- commit gaps: t0 -> first commit -> ... -> last commit -> t1;
- uptime = 1 - Σ max(0, gap - stall_after_s) / (t1 - t0): the share of time the global model kept
  advancing, allowing `stall_after_s` between commits as normal;
- failover: for each nemesis fault that took the lease holder down (kill, stop, isolate), the time
  from the fault to the next commit on any node;
- step-down: for each coordinator SIGSTOP outlived by a newer lease elsewhere, the time from
  SIGCONT to the stale holder's `lease_lost` (fencing).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diloco_node.ops.history import HistoryEvent

# Nemesis actions that take a node out of the protocol; when that node holds the lease, the run
# must fail over, and the time to the next commit is a failover time.
OUTAGE_ACTIONS = frozenset({"kill", "stop", "isolate", "partition"})


@dataclass(frozen=True, slots=True)
class CommitTime:
    index: int
    t_mono: float
    contributors: frozenset[str] | None  # None: the commit did not say (treated as everyone)


def commit_times(histories: Mapping[str, Sequence[HistoryEvent]]) -> list[CommitTime]:
    """The first commit event per index, in time order; contributors from any event that names them."""
    earliest: dict[int, float] = {}
    contributors: dict[int, frozenset[str]] = {}
    for events in histories.values():
        for e in events:
            if e.kind != "commit":
                continue
            assert e.index is not None
            if e.index not in earliest or e.t_mono < earliest[e.index]:
                earliest[e.index] = e.t_mono
            named = e.detail.get("contributors")
            if isinstance(named, list) and e.index not in contributors:
                contributors[e.index] = frozenset(str(n) for n in named)
    return sorted((CommitTime(i, t, contributors.get(i)) for i, t in earliest.items()), key=lambda c: (c.t_mono, c.index))


def commit_gaps(commits: Sequence[CommitTime], t0: float, t1: float) -> list[float]:
    """Gaps between consecutive commits inside [t0, t1], the window's edges included."""
    _check_window(t0, t1)
    points = [t0] + [c.t_mono for c in commits if t0 <= c.t_mono <= t1] + [t1]
    return [b - a for a, b in zip(points, points[1:])]


def uptime(commits: Sequence[CommitTime], t0: float, t1: float, stall_after_s: float) -> float:
    """Share of [t0, t1] during which the global model was advancing (see module docstring)."""
    if not stall_after_s >= 0:
        raise ValueError(f"stall_after_s must be >= 0, got {stall_after_s}")
    stalled = sum(max(0.0, gap - stall_after_s) for gap in commit_gaps(commits, t0, t1))
    return max(0.0, 1.0 - stalled / (t1 - t0))


def productive_seconds(
    events: Sequence[HistoryEvent], node: str, commits: Sequence[CommitTime], t0: float, t1: float
) -> tuple[float, float]:
    """(productive, lost) learner-seconds of one node's `step` events inside [t0, t1].

    Work is lost when the node restarts (a `start` event) before any commit merged it: no commit
    after the step that lists the node (or lists nobody) and precedes the restart."""
    merged_at = sorted(c.t_mono for c in commits if c.contributors is None or node in c.contributors)
    restarts = sorted(e.t_mono for e in events if e.kind == "start")
    productive = lost = 0.0
    for e in events:
        if e.kind != "step" or not t0 <= e.t_mono <= t1:
            continue
        seconds = float(e.detail["productive_s"])
        i = bisect.bisect_right(restarts, e.t_mono)
        next_restart = restarts[i] if i < len(restarts) else math.inf
        j = bisect.bisect_left(merged_at, e.t_mono)
        next_merge = merged_at[j] if j < len(merged_at) else math.inf
        if next_restart < math.inf and next_merge > next_restart:
            lost += seconds
        else:
            productive += seconds
    return productive, lost


def goodput(
    histories: Mapping[str, Sequence[HistoryEvent]],
    learner_windows: Mapping[str, tuple[float, float]],
    t0: float,
    t1: float,
) -> float:
    """Productive learner-seconds over the learner-seconds the run was owed.

    `learner_windows` maps each learner to the part of [t0, t1] it belonged to the run (a site
    that joins mid-run is owed time from its join on)."""
    _check_window(t0, t1)
    commits = commit_times(histories)
    owed = productive = 0.0
    for node, (start, end) in learner_windows.items():
        start, end = max(t0, start), min(t1, end)
        if end <= start:
            continue
        owed += end - start
        productive += productive_seconds(histories.get(node, ()), node, commits, start, end)[0]
    if owed == 0:
        raise ValueError("goodput: no learner was part of the run inside the window")
    return productive / owed


def lease_holder_at(histories: Mapping[str, Sequence[HistoryEvent]], t: float) -> str | None:
    """The node that most recently acquired the lease (highest epoch) before `t` and has not
    since recorded losing it, stopping or restarting; None if no one holds it."""
    best: HistoryEvent | None = None
    for events in histories.values():
        for e in events:
            if e.kind == "lease_acquired" and e.t_mono <= t and (best is None or (e.epoch or 0) > (best.epoch or 0)):
                best = e
    if best is None:
        return None
    for e in histories.get(best.node, ()):
        if best.t_mono < e.t_mono <= t and e.kind in ("lease_lost", "stop", "start", "leave"):
            return None
    return best.node


def failover_times(
    histories: Mapping[str, Sequence[HistoryEvent]], t1: float | None = None
) -> tuple[list[float], int]:
    """(failover times in seconds, how many coordinator outages saw no commit before t1).

    A coordinator outage is a nemesis `fault` event with detail.action in OUTAGE_ACTIONS and
    detail.coordinator true (the harness resolves the lease holder when it injects)."""
    commits = commit_times(histories)
    times = [c.t_mono for c in commits]
    failovers: list[float] = []
    unrecovered = 0
    for events in histories.values():
        for e in events:
            if e.kind != "fault" or e.detail.get("action") not in OUTAGE_ACTIONS or not e.detail.get("coordinator"):
                continue
            i = bisect.bisect_right(times, e.t_mono)
            if i < len(times) and (t1 is None or times[i] <= t1):
                failovers.append(times[i] - e.t_mono)
            else:
                unrecovered += 1
    return sorted(failovers), unrecovered


def step_down_times(histories: Mapping[str, Sequence[HistoryEvent]]) -> tuple[list[float], int]:
    """(seconds from SIGCONT to `lease_lost`, how many stale holders never stepped down) for each
    coordinator SIGSTOP during which another node acquired a newer lease (the fencing promise:
    a continued stale holder must find out and step down)."""
    events = [e for evs in histories.values() for e in evs]
    continued = {e.detail.get("fault"): e.t_mono for e in events if e.kind == "heal" and e.detail.get("action") == "stop"}
    times: list[float] = []
    never = 0
    for fault in events:
        if fault.kind != "fault" or fault.detail.get("action") != "stop" or not fault.detail.get("coordinator"):
            continue
        node, t_stop = fault.detail.get("target"), fault.t_mono
        t_cont = continued.get(fault.detail.get("fault"))
        if not isinstance(node, str) or t_cont is None:
            continue
        own = histories.get(node, ())
        held = max((e.epoch or 0 for e in own if e.kind == "lease_acquired" and e.t_mono <= t_stop), default=0)
        superseded = any(e.kind == "lease_acquired" and e.node != node and (e.epoch or 0) > held
                         and t_stop <= e.t_mono <= t_cont for e in events)
        if not superseded:
            continue
        # A stopped process writes nothing, so whatever it wrote after the SIGSTOP came after the
        # SIGCONT, even when it beat the harness's `heal` line to the clock (then it took 0 s).
        lost = next((e.t_mono for e in own if e.t_mono > t_stop and e.kind in ("lease_lost", "start")), None)
        if lost is None:
            never += 1
        else:
            times.append(max(0.0, lost - t_cont))
    return sorted(times), never


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class ModeMetrics:
    """The numbers of one run (one mode) that the chaos report shows."""

    goodput: float
    uptime: float
    max_commit_gap_s: float
    failover_s: list[float]
    unrecovered_failovers: int
    commits: int
    lost_learner_s: float
    window_s: float
    step_down_s: list[float] = dataclasses.field(default_factory=list)
    never_stepped_down: int = 0

    def to_report(self) -> dict[str, object]:
        return {
            "goodput": round(self.goodput, 4),
            "uptime": round(self.uptime, 4),
            "max_commit_gap_s": round(self.max_commit_gap_s, 3),
            "failover_s": {
                "p50": _rounded(percentile(self.failover_s, 50)),
                "p99": _rounded(percentile(self.failover_s, 99)),
                "all": [round(x, 3) for x in self.failover_s],
                "unrecovered": self.unrecovered_failovers,
            },
            "commits": self.commits,
            "lost_learner_s": round(self.lost_learner_s, 3),
            "window_s": round(self.window_s, 3),
            "stale_leader_step_down_s": {"all": [round(x, 3) for x in self.step_down_s],
                                         "never": self.never_stepped_down},
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def measure(
    histories: Mapping[str, Sequence[HistoryEvent]],
    learner_windows: Mapping[str, tuple[float, float]],
    t0: float,
    t1: float,
    stall_after_s: float,
) -> ModeMetrics:
    """All of the report's numbers for one run."""
    commits = commit_times(histories)
    gaps = commit_gaps(commits, t0, t1)
    failovers, unrecovered = failover_times(histories, t1)
    step_down = step_down_times(histories)
    lost = 0.0
    for node, (start, end) in learner_windows.items():
        lost += productive_seconds(histories.get(node, ()), node, commits, max(t0, start), min(t1, end))[1]
    return ModeMetrics(
        goodput=goodput(histories, learner_windows, t0, t1),
        uptime=uptime(commits, t0, t1, stall_after_s),
        max_commit_gap_s=max(gaps),
        failover_s=failovers,
        unrecovered_failovers=unrecovered,
        commits=sum(1 for c in commits if t0 <= c.t_mono <= t1),
        lost_learner_s=lost,
        window_s=t1 - t0,
        step_down_s=step_down[0],
        never_stepped_down=step_down[1],
    )


def _check_window(t0: float, t1: float) -> None:
    if not t1 > t0:
        raise ValueError(f"measurement window must have t1 > t0, got [{t0}, {t1}]")
