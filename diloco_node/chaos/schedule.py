"""Seeded nemesis schedules: which fault hits which node when, and for how long.

A schedule is plain data (JSON round-trip), a pure function of (seed, spec), so a failing run is
replayed by its seed. Targets are node ids, or `COORDINATOR`, which the harness resolves to the
lease holder at injection time. Constraints every generated schedule meets (`check_schedule`
proves them, and refuses a hand-written schedule that breaks one):

- never more than a minority of the founding voters down at once (killed, stopped or isolated),
  counting a node as down until `recovery_s` after its fault ends (a restarted daemon still has to
  compile and catch up), so the run always keeps a live majority;
- at most one fault per node at a time; a coordinator-targeted outage overlaps no other outage
  (the lease holder could be that other node);
- every fault is healed `settle_s` before the end, so convergence can be checked;
- at least one coordinator kill and one coordinator SIGSTOP lasting past the lease time.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

COORDINATOR = "@coordinator"

# kill: SIGKILL, restart after duration_s. stop: SIGSTOP, SIGCONT after duration_s.
# isolate: the node's inbound link blackholed. bandwidth: the node's link capped at param Mbit/s.
# slow: the node's learner runs at `param` of its speed. join: a new site starts (permanent).
ACTIONS = ("kill", "stop", "isolate", "bandwidth", "slow", "join")
OUTAGES = frozenset({"kill", "stop", "isolate"})

# A SIGSTOP must outlast the lease by this factor so that the others elect a new holder and the
# stopped one, when continued, is provably stale (the fencing promise).
STOP_PAST_LEASE_FACTOR = 1.5


class ScheduleError(ValueError):
    """A schedule cannot be built from this spec, or a given schedule breaks a constraint."""


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # seconds after the schedule starts
    action: str
    target: str  # a node id or COORDINATOR
    duration_s: float = 0.0  # until healed; 0 for join (permanent)
    param: float | None = None  # Mbit/s for bandwidth, speed fraction for slow

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ScheduleError(f"fault action {self.action!r}: expected one of {ACTIONS}")
        if not self.at_s >= 0 or not self.duration_s >= 0:
            raise ScheduleError(f"{self.action} on {self.target}: at_s and duration_s must be >= 0")
        if self.action in ("bandwidth", "slow") and (self.param is None or not self.param > 0):
            raise ScheduleError(f"{self.action} on {self.target} needs param > 0")
        if self.action == "slow" and self.param is not None and self.param >= 1:
            raise ScheduleError(f"slow on {self.target}: speed fraction {self.param} must be < 1")
        if self.action == "join" and self.target == COORDINATOR:
            raise ScheduleError("join needs a new node id, not the coordinator")

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s

    @property
    def is_outage(self) -> bool:
        return self.action in OUTAGES

    def describe(self) -> str:
        target = "the coordinator" if self.target == COORDINATOR else self.target
        d = self.duration_s
        if self.action == "kill":
            what = f"SIGKILL {target}, restart after {d:.1f}s"
        elif self.action == "stop":
            what = f"SIGSTOP {target} for {d:.1f}s"
        elif self.action == "isolate":
            what = f"cut {target}'s inbound link for {d:.1f}s"
        elif self.action == "bandwidth":
            what = f"cap {target}'s link at {self.param:g} Mbit/s for {d:.1f}s"
        elif self.action == "slow":
            what = f"slow {target} to {self.param:.0%} speed for {d:.1f}s"
        else:
            what = f"start new site {target}"
        return f"t+{self.at_s:.1f}s {what}"


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What a generated schedule must fit. Times in seconds from the schedule's start."""

    nodes: tuple[str, ...]  # founding voters
    duration_s: float
    lease_s: float
    faults: int  # total, the mandatory ones included
    learners: tuple[str, ...] | None = None  # nodes that train (default: all); `slow` targets these
    joiners: tuple[str, ...] = ()  # new sites that join mid-run, one `join` each
    warmup_s: float = 10.0  # no fault before this: the cluster settles first
    settle_s: float = 15.0  # everything healed this long before the end
    recovery_s: float = 8.0  # a restarted/continued node counts as down this much longer
    kill_down_s: tuple[float, float] = (1.0, 5.0)
    degrade_s: tuple[float, float] = (5.0, 15.0)  # bandwidth and slow durations
    bandwidth_mbit: tuple[float, float] = (0.5, 5.0)
    slow_fraction: tuple[float, float] = (0.25, 0.5)
    weights: Mapping[str, float] = field(default_factory=lambda: {
        "kill": 3.0, "stop": 2.0, "isolate": 2.0, "bandwidth": 2.0, "slow": 2.0,
    })

    def __post_init__(self) -> None:
        if len(self.nodes) < 3:
            raise ScheduleError(f"need at least 3 founding nodes to keep a majority through faults, got {len(self.nodes)}")
        if len(set(self.nodes) | set(self.joiners)) != len(self.nodes) + len(self.joiners):
            raise ScheduleError("node ids must be unique across nodes and joiners")
        if not self.duration_s > self.warmup_s + self.settle_s:
            raise ScheduleError(f"duration {self.duration_s}s leaves no time after warmup {self.warmup_s}s and settle {self.settle_s}s")
        if not self.lease_s > 0:
            raise ScheduleError(f"lease_s must be > 0, got {self.lease_s}")
        if self.faults < 2 + len(self.joiners):
            raise ScheduleError(f"faults = {self.faults}: need >= 2 (a coordinator kill and stop) plus one per joiner")

    @property
    def learner_nodes(self) -> tuple[str, ...]:
        return self.nodes if self.learners is None else self.learners

    @property
    def max_down(self) -> int:
        """The largest minority of the founding voters."""
        return (len(self.nodes) - 1) // 2


@dataclass(frozen=True, slots=True)
class Schedule:
    seed: int
    duration_s: float
    faults: tuple[Fault, ...]

    def to_dict(self) -> dict[str, object]:
        return {"seed": self.seed, "duration_s": self.duration_s, "faults": [asdict(f) for f in self.faults]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> Schedule:
        try:
            faults = tuple(Fault(**f) for f in raw["faults"])  # type: ignore[arg-type, union-attr]
            return cls(seed=int(raw["seed"]), duration_s=float(raw["duration_s"]), faults=faults)  # type: ignore[arg-type]
        except (KeyError, TypeError) as exc:
            raise ScheduleError(f"schedule: {exc}") from None

    def describe(self) -> list[str]:
        return [f.describe() for f in self.faults]


def _uniform(rng: random.Random, bounds: tuple[float, float]) -> float:
    return round(rng.uniform(*bounds), 2)


def _busy_until(fault: Fault, spec: ScheduleSpec) -> float:
    """When the fault's node is available again (outages keep it busy while it recovers)."""
    return fault.end_s + (spec.recovery_s if fault.is_outage else 0.0)


def _fits(candidate: Fault, placed: Sequence[Fault], spec: ScheduleSpec) -> bool:
    start, end = candidate.at_s, _busy_until(candidate, spec)
    overlapping = [f for f in placed if f.action != "join" and f.at_s < end and start < _busy_until(f, spec)]
    if candidate.action == "join":
        return True
    if any(f.target == candidate.target for f in overlapping):
        return False
    if candidate.is_outage:
        outages = [f for f in overlapping if f.is_outage]
        intervals = [(max(start, f.at_s), min(end, _busy_until(f, spec))) for f in outages]
        if 1 + _max_concurrent(intervals) > spec.max_down:
            return False
        if outages and (candidate.target == COORDINATOR or any(f.target == COORDINATOR for f in outages)):
            return False
    # A degraded coordinator might be the node another fault already holds: keep them apart.
    if candidate.target == COORDINATOR or any(f.target == COORDINATOR for f in overlapping):
        return not overlapping
    return True


def _max_concurrent(intervals: Sequence[tuple[float, float]]) -> int:
    """The most half-open intervals [a, b) covering one instant."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = current = 0
    for _, step in edges:  # at equal times -1 sorts first: touching intervals do not overlap
        current += step
        best = max(best, current)
    return best


def _draw(rng: random.Random, action: str, target: str, spec: ScheduleSpec) -> Fault:
    if action == "kill":
        return Fault(0.0, action, target, _uniform(rng, spec.kill_down_s))
    if action == "stop":
        low = spec.lease_s * STOP_PAST_LEASE_FACTOR
        return Fault(0.0, action, target, _uniform(rng, (low, low + spec.lease_s)))
    if action == "isolate":
        low = spec.lease_s * STOP_PAST_LEASE_FACTOR
        return Fault(0.0, action, target, _uniform(rng, (low, low + 2 * spec.lease_s)))
    if action == "bandwidth":
        return Fault(0.0, action, target, _uniform(rng, spec.degrade_s), _uniform(rng, spec.bandwidth_mbit))
    if action == "slow":
        return Fault(0.0, action, target, _uniform(rng, spec.degrade_s), _uniform(rng, spec.slow_fraction))
    return Fault(0.0, "join", target)


def _shortest(fault: Fault, spec: ScheduleSpec) -> Fault:
    shortest = {
        "kill": spec.kill_down_s[0],
        "stop": spec.lease_s * STOP_PAST_LEASE_FACTOR,
        "isolate": spec.lease_s * STOP_PAST_LEASE_FACTOR,
        "bandwidth": spec.degrade_s[0],
        "slow": spec.degrade_s[0],
        "join": 0.0,
    }[fault.action]
    return Fault(fault.at_s, fault.action, fault.target, round(shortest, 2), fault.param)


# A tight spec (short run, long lease) may not fit every random draw; further draws from the
# same seed are tried before giving up, so the result is still a function of (seed, spec).
GENERATE_ATTEMPTS = 50


def generate(seed: int, spec: ScheduleSpec) -> Schedule:
    """A schedule of `spec.faults` faults spread over the usable window, deterministic per seed."""
    error: ScheduleError | None = None
    for attempt in range(GENERATE_ATTEMPTS):
        try:
            return _generate_once(seed, attempt, spec)
        except ScheduleError as exc:
            error = exc
    assert error is not None
    raise ScheduleError(f"{error} (after {GENERATE_ATTEMPTS} draws)")


def _generate_once(seed: int, attempt: int, spec: ScheduleSpec) -> Schedule:
    rng = random.Random(seed * 1000 + attempt)
    plan: list[tuple[str, str]] = [("kill", COORDINATOR), ("stop", COORDINATOR)]
    plan += [("join", j) for j in spec.joiners]
    actions = sorted(spec.weights)
    weights = [spec.weights[a] for a in actions]
    while len(plan) < spec.faults:
        action = rng.choices(actions, weights)[0]
        pool = spec.learner_nodes if action == "slow" else spec.nodes
        target = COORDINATOR if action in OUTAGES and rng.random() < 0.25 else rng.choice(pool)
        plan.append((action, target))
    rng.shuffle(plan)

    last_heal = spec.duration_s - spec.settle_s
    spacing = (last_heal - spec.warmup_s) / len(plan)
    placed: list[Fault] = []
    # Each fault keeps its shuffled time slot k, but the coordinator faults (which overlap
    # nothing) and joins are placed first, while the timeline is still empty.
    order = sorted(range(len(plan)), key=lambda k: plan[k][1] != COORDINATOR and plan[k][0] != "join")
    jitter = [rng.uniform(0, spacing / 2) for _ in plan]
    for k in order:
        action, target = plan[k]
        drawn = _draw(rng, action, target, spec)
        nominal = spec.warmup_s + k * spacing + jitter[k]
        start = _earliest_fit(drawn, nominal, last_heal, placed, spec)
        if start is None:  # pushed past the end by earlier faults: take the first free gap
            start = _earliest_fit(drawn, spec.warmup_s, last_heal, placed, spec)
        if start is None:  # still no room: the shortest fault of its kind
            drawn = _shortest(drawn, spec)
            start = _earliest_fit(drawn, spec.warmup_s, last_heal, placed, spec)
        if start is None:
            raise ScheduleError(
                f"seed {seed}: cannot fit fault {k + 1} of {len(plan)} ({drawn.action} on {drawn.target}, "
                f"{drawn.duration_s}s) before t+{last_heal:.0f}s with at most {spec.max_down} node(s) down; "
                f"lengthen the run or ask for fewer faults"
            )
        placed.append(Fault(start, drawn.action, drawn.target, drawn.duration_s, drawn.param))
    schedule = Schedule(seed, spec.duration_s, tuple(sorted(placed, key=lambda f: f.at_s)))
    problems = check_schedule(schedule, spec)
    assert not problems, problems  # generation and checking are written independently
    return schedule


def _earliest_fit(fault: Fault, nominal: float, last_heal: float, placed: Sequence[Fault],
                  spec: ScheduleSpec) -> float | None:
    """Slide the fault later from `nominal` (0.25 s steps) until it fits, or None."""
    start = round(nominal, 2)  # the value stored, so checking later sees the same numbers
    while start + fault.duration_s <= last_heal:
        candidate = Fault(start, fault.action, fault.target, fault.duration_s, fault.param)
        if _fits(candidate, placed, spec):
            return start
        start = round(start + 0.25, 2)
    return None


def one_learner_down(seed: int, spec: ScheduleSpec, down_fraction: float = 1 / 3, outages: int = 2) -> Schedule:
    """The goodput comparison: one learner (not the first node) killed for `down_fraction` of the
    whole run, in `outages` equal pieces spread evenly over the usable window; nothing else."""
    if not 0 < down_fraction < 1 or outages < 1:
        raise ScheduleError(f"down_fraction must be in (0, 1) and outages >= 1, got {down_fraction}, {outages}")
    rng = random.Random(seed)
    target = rng.choice(spec.learner_nodes[1:] or spec.learner_nodes)
    usable = spec.duration_s - spec.settle_s - spec.warmup_s
    down = spec.duration_s * down_fraction / outages
    slot = usable / outages
    if down > slot:
        raise ScheduleError(
            f"{down_fraction:.0%} of {spec.duration_s:.0f}s down in {outages} outage(s) does not fit the "
            f"{usable:.0f}s between warm-up and settle; shorten them or lengthen the run")
    faults = tuple(Fault(round(spec.warmup_s + i * slot + (slot - down) / 2, 2), "kill", target, round(down, 2))
                   for i in range(outages))
    return Schedule(seed, spec.duration_s, faults)


def check_schedule(schedule: Schedule, spec: ScheduleSpec, require_coordinator_faults: bool = True) -> list[str]:
    """Every constraint the schedule breaks, as sentences (empty: it is fine)."""
    problems = []
    last_heal = spec.duration_s - spec.settle_s
    known = set(spec.nodes) | set(spec.joiners) | {COORDINATOR}
    for f in schedule.faults:
        if f.target not in known:
            problems.append(f"{f.describe()}: unknown target {f.target}")
        if f.end_s > last_heal:
            problems.append(f"{f.describe()}: healed at t+{f.end_s:.1f}s, after t+{last_heal:.1f}s (settle {spec.settle_s}s)")
        if f.at_s < spec.warmup_s:
            problems.append(f"{f.describe()}: before the warm-up ends at t+{spec.warmup_s:.1f}s")
        if f.action == "stop" and f.duration_s < spec.lease_s * STOP_PAST_LEASE_FACTOR:
            problems.append(f"{f.describe()}: shorter than {STOP_PAST_LEASE_FACTOR} x lease ({spec.lease_s}s)")
    for i, f in enumerate(schedule.faults):
        if f.action != "join" and not _fits(f, schedule.faults[:i] + schedule.faults[i + 1:], spec):
            problems.append(f"{f.describe()}: overlaps another fault on the same node or takes down a majority")
    if require_coordinator_faults:
        for action in ("kill", "stop"):
            if not any(f.action == action and f.target == COORDINATOR for f in schedule.faults):
                problems.append(f"no coordinator {action}")
    return problems
