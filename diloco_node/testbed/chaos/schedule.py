"""Seeded nemesis schedules: which fault hits which node when, and for how long.

A schedule is plain data (JSON round-trip), a pure function of (seed, spec), so a failing run is
replayed by its seed. Targets are node ids, or `COORDINATOR`, which the harness resolves to the
lease holder at injection time. A `partition` names its whole minority side: the target plus
`side` (node ids; with a coordinator target, `FOLLOWER` placeholders, resolved when it fires to
live founders other than the holder). Constraints every generated schedule meets
(`check_schedule` proves them, and refuses a hand-written schedule that breaks one):

- never more than a minority of the founding voters down at once (killed, stopped, isolated, or
  on the minority side of a partition: each node of that side counts), counting a node as down
  until `recovery_s` after its fault ends (a restarted daemon still has to compile and catch up),
  so the run always keeps a live, connected majority;
- at most one fault per node at a time; a coordinator-targeted fault overlaps no other fault
  (the lease holder could be that other node);
- SIGSTOPs, isolations and partitions outlast the lease (x 1.5), so the majority must elect;
- every fault is healed `settle_s` before the end, so convergence can be checked;
- at least one coordinator kill and one coordinator SIGSTOP lasting past the lease time (and, if
  the spec asks, one coordinator partition), and one of each storage or clock fault the weights name.

Storage and clock faults (drawn only when the spec's weights name them, `STORAGE_FAULT_WEIGHTS`):
a full disk or failing I/O on one node for a while, a crash at one durable step's fsync, a file
corrupted while the node is down (or its log while it runs), and a wall-clock step of an hour with
a slow drift. The first
four count as the node being down (a node that cannot persist cannot acknowledge anything).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

COORDINATOR = "@coordinator"
# In a partition's side: one more live founder, not the lease holder, chosen when the fault fires.
FOLLOWER = "@follower"

# kill: SIGKILL, restart after duration_s. stop: SIGSTOP, SIGCONT after duration_s.
# isolate: the node cut off from every other node, both ways (a one-node partition).
# partition: the target and `side` cut off from the rest, both ways. bandwidth: the node's link
# capped at param Mbit/s. slow: the node's learner runs at `param` of its speed.
# join: a new site starts (permanent).
# disk_full / io_error: every durable write of the node fails with ENOSPC / EIO (reads too, for
# io_error) until healed. crash_at_fsync: the failpoint in `how` ("point=crash-before*1") is armed;
# the node crashes at that fsync, dropping what was not fsynced, and is restarted at the heal.
# corrupt: SIGKILL, then the file `how` names ("checkpoint:flip", "checkpoint:truncate",
# "log:truncate") is damaged at rest; restart after duration_s. "log:flip-running" flips a bit of
# log.bin while the node runs (no kill): the node finds it when it reads the record back and
# repairs its log without a restart; the heal does nothing. clock_jump: the node's wall clock
# steps by `param` seconds (and drifts) until healed; monotonic time is untouched.
ACTIONS = ("kill", "stop", "isolate", "partition", "bandwidth", "slow", "join",
           "disk_full", "io_error", "crash_at_fsync", "corrupt", "clock_jump")
STORAGE_ACTIONS = frozenset({"disk_full", "io_error", "crash_at_fsync", "corrupt"})
OUTAGES = frozenset({"kill", "stop", "isolate", "partition"}) | STORAGE_ACTIONS
# The crash points a `crash_at_fsync` is drawn from: durable steps every node takes often.
CRASH_POINTS = ("log.append=crash-before*1", "log.append=crash-after*1", "checkpoint.write=crash-before*1",
                "checkpoint.write=crash-after*1", "election.write=crash-after*1")
CORRUPTIONS = ("checkpoint:flip", "checkpoint:truncate", "log:truncate", "log:flip-running")
# Corruptions done to a running node's files (no kill, no restart).
RUNNING_CORRUPTIONS = frozenset({"log:flip-running"})
CLOCK_JUMPS_S = (3600.0, -3600.0)
DEFAULT_WEIGHTS = {"kill": 3.0, "stop": 2.0, "isolate": 2.0, "partition": 2.0, "bandwidth": 2.0, "slow": 2.0}
# What a generated schedule adds to the default weights when it asks for storage and clock faults.
STORAGE_FAULT_WEIGHTS = {"disk_full": 1.5, "io_error": 1.0, "crash_at_fsync": 2.0, "corrupt": 1.5, "clock_jump": 1.5}
# Outages that must outlast the lease (see STOP_PAST_LEASE_FACTOR).
PAST_LEASE = frozenset({"stop", "isolate", "partition"})

# A SIGSTOP or a partition must outlast the lease by this factor so that the others elect a new
# holder and the cut-off one, when back, is provably stale (the fencing promise).
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
    side: tuple[str, ...] = ()  # partition only: the others on the target's (minority) side
    how: str = ""  # crash_at_fsync: the failpoint armed; corrupt: which file and how

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ScheduleError(f"fault action {self.action!r}: expected one of {ACTIONS}")
        if not isinstance(self.side, tuple):  # from JSON: a list
            object.__setattr__(self, "side", tuple(self.side))
        if self.side and self.action != "partition":
            raise ScheduleError(f"{self.action} on {self.target}: only a partition has a side, got {list(self.side)}")
        named = [n for n in self.side if n != FOLLOWER]
        if len(set(named)) != len(named) or self.target in self.side or COORDINATOR in self.side:
            raise ScheduleError(f"partition of {self.target}: side {list(self.side)} must name other nodes, "
                                f"each once (the coordinator only as the target)")
        if FOLLOWER in self.side and self.target != COORDINATOR:
            raise ScheduleError(f"partition of {self.target}: {FOLLOWER} in the side needs the coordinator as target")
        if not self.at_s >= 0 or not self.duration_s >= 0:
            raise ScheduleError(f"{self.action} on {self.target}: at_s and duration_s must be >= 0")
        if self.action in ("bandwidth", "slow") and (self.param is None or not self.param > 0):
            raise ScheduleError(f"{self.action} on {self.target} needs param > 0")
        if self.action == "slow" and self.param is not None and self.param >= 1:
            raise ScheduleError(f"slow on {self.target}: speed fraction {self.param} must be < 1")
        if self.action == "crash_at_fsync" and self.how not in CRASH_POINTS:
            raise ScheduleError(f"crash_at_fsync on {self.target}: how {self.how!r}, expected one of {CRASH_POINTS}")
        if self.action == "corrupt" and self.how not in CORRUPTIONS:
            raise ScheduleError(f"corrupt on {self.target}: how {self.how!r}, expected one of {CORRUPTIONS}")
        if self.how and self.action not in ("crash_at_fsync", "corrupt"):
            raise ScheduleError(f"{self.action} on {self.target}: only crash_at_fsync and corrupt have a how")
        if self.action == "clock_jump" and not (self.param is not None and self.param != 0):
            raise ScheduleError(f"clock_jump on {self.target} needs param = the step in seconds (non-zero)")
        if self.action == "join" and self.target == COORDINATOR:
            raise ScheduleError("join needs a new node id, not the coordinator")

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s

    @property
    def is_outage(self) -> bool:
        return self.action in OUTAGES

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node the fault hits (a partition: its whole minority side)."""
        return (self.target, *self.side)

    @property
    def down(self) -> int:
        """How many founding voters it takes out of the majority while it lasts."""
        return len(self.nodes) if self.is_outage else 0

    def describe(self) -> str:
        target = "the coordinator" if self.target == COORDINATOR else self.target
        d = self.duration_s
        if self.action == "kill":
            what = f"SIGKILL {target}, restart after {d:.1f}s"
        elif self.action == "stop":
            what = f"SIGSTOP {target} for {d:.1f}s"
        elif self.action == "isolate":
            what = f"cut {target} off from every other node (both ways) for {d:.1f}s"
        elif self.action == "partition":
            others = ["another follower" if n == FOLLOWER else n for n in self.side]
            what = f"partition {' + '.join([target, *others])} from the rest (both ways) for {d:.1f}s"
        elif self.action == "bandwidth":
            what = f"cap {target}'s link at {self.param:g} Mbit/s for {d:.1f}s"
        elif self.action == "slow":
            what = f"slow {target} to {self.param:.0%} speed for {d:.1f}s"
        elif self.action == "disk_full":
            what = f"fill {target}'s disk (every durable write fails with ENOSPC) for {d:.1f}s"
        elif self.action == "io_error":
            what = f"fail {target}'s disk (every durable read and write fails with EIO) for {d:.1f}s"
        elif self.action == "crash_at_fsync":
            what = f"crash {target} at its next fsync of {self.how}, restart after {d:.1f}s"
        elif self.action == "corrupt" and self.how in RUNNING_CORRUPTIONS:
            what = f"damage {target}'s {self.how.replace(':', ' (')}) while it runs"
        elif self.action == "corrupt":
            what = f"SIGKILL {target}, damage its {self.how.replace(':', ' (')}), restart after {d:.1f}s"
        elif self.action == "clock_jump":
            what = f"step {target}'s wall clock by {self.param:+.0f}s (and drift it) for {d:.1f}s"
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
    coordinator_partition: bool = False  # also require a partition with the lease holder in the minority
    warmup_s: float = 10.0  # no fault before this: the cluster settles first
    settle_s: float = 15.0  # everything healed this long before the end
    recovery_s: float = 8.0  # a restarted/continued node counts as down this much longer
    kill_down_s: tuple[float, float] = (1.0, 5.0)
    degrade_s: tuple[float, float] = (5.0, 15.0)  # bandwidth and slow durations
    bandwidth_mbit: tuple[float, float] = (0.5, 5.0)
    slow_fraction: tuple[float, float] = (0.25, 0.5)
    # `partition` is drawn only where a minority can hold two nodes (5+ founders): with 3, the
    # one-node partition is `isolate` (and seeds keep the schedules they had before partitions).
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    corruptions: tuple[str, ...] = CORRUPTIONS  # what a `corrupt` fault may do (a subset of CORRUPTIONS)

    def __post_init__(self) -> None:
        if len(self.nodes) < 3:
            raise ScheduleError(f"need at least 3 founding nodes to keep a majority through faults, got {len(self.nodes)}")
        if len(set(self.nodes) | set(self.joiners)) != len(self.nodes) + len(self.joiners):
            raise ScheduleError("node ids must be unique across nodes and joiners")
        if not self.duration_s > self.warmup_s + self.settle_s:
            raise ScheduleError(f"duration {self.duration_s}s leaves no time after warmup {self.warmup_s}s and settle {self.settle_s}s")
        if not self.lease_s > 0:
            raise ScheduleError(f"lease_s must be > 0, got {self.lease_s}")
        if not self.corruptions or not set(self.corruptions) <= set(CORRUPTIONS):
            raise ScheduleError(f"corruptions {list(self.corruptions)}: expected some of {list(CORRUPTIONS)}")
        if self.faults < self.mandatory_faults:
            extra = f", one each of {', '.join(self.required_actions)}" if self.required_actions else ""
            raise ScheduleError(f"faults = {self.faults}: need >= {self.mandatory_faults - len(self.joiners)} (a coordinator "
                                f"kill and stop{' and partition' if self.coordinator_partition else ''}{extra}) "
                                f"plus one per joiner")

    @property
    def required_actions(self) -> tuple[str, ...]:
        """Storage and clock faults the weights name: each is drawn at least once."""
        return tuple(sorted(a for a in STORAGE_FAULT_WEIGHTS if a in self.weights))

    @property
    def mandatory_faults(self) -> int:
        return 2 + int(self.coordinator_partition) + len(self.joiners) + len(self.required_actions)

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
    """When the fault's nodes are available again (outages keep them busy while they recover)."""
    return fault.end_s + (spec.recovery_s if fault.is_outage else 0.0)


def _fits(candidate: Fault, placed: Sequence[Fault], spec: ScheduleSpec) -> bool:
    start, end = candidate.at_s, _busy_until(candidate, spec)
    overlapping = [f for f in placed if f.action != "join" and f.at_s < end and start < _busy_until(f, spec)]
    if candidate.action == "join":
        return True
    if any(set(f.nodes) & set(candidate.nodes) for f in overlapping):
        return False
    if candidate.is_outage:
        outages = [f for f in overlapping if f.is_outage]
        intervals = [(max(start, f.at_s), min(end, _busy_until(f, spec)), f.down) for f in outages]
        if candidate.down + _max_concurrent(intervals) > spec.max_down:
            return False
        if outages and (candidate.target == COORDINATOR or any(f.target == COORDINATOR for f in outages)):
            return False
    # A degraded coordinator might be the node another fault already holds: keep them apart.
    if candidate.target == COORDINATOR or any(f.target == COORDINATOR for f in overlapping):
        return not overlapping
    return True


def _max_concurrent(intervals: Sequence[tuple[float, float, int]]) -> int:
    """The largest total weight of half-open intervals [a, b) covering one instant."""
    edges = sorted([(a, w) for a, _, w in intervals] + [(b, -w) for _, b, w in intervals])
    best = current = 0
    for _, step in edges:  # at equal times removals sort first: touching intervals do not overlap
        current += step
        best = max(best, current)
    return best


def _draw(rng: random.Random, action: str, target: str, spec: ScheduleSpec) -> Fault:
    if action == "kill":
        return Fault(0.0, action, target, _uniform(rng, spec.kill_down_s))
    if action == "stop":
        low = spec.lease_s * STOP_PAST_LEASE_FACTOR
        return Fault(0.0, action, target, _uniform(rng, (low, low + spec.lease_s)))
    if action in ("isolate", "partition"):
        low = spec.lease_s * STOP_PAST_LEASE_FACTOR
        duration = _uniform(rng, (low, low + 2 * spec.lease_s))
        if action == "isolate":
            return Fault(0.0, action, target, duration)
        size = rng.randint(1, spec.max_down)
        if target == COORDINATOR:
            side = (FOLLOWER,) * (size - 1)
        else:
            side = tuple(rng.sample(sorted(set(spec.nodes) - {target}), size - 1))
        return Fault(0.0, action, target, duration, side=side)
    if action == "bandwidth":
        return Fault(0.0, action, target, _uniform(rng, spec.degrade_s), _uniform(rng, spec.bandwidth_mbit))
    if action == "slow":
        return Fault(0.0, action, target, _uniform(rng, spec.degrade_s), _uniform(rng, spec.slow_fraction))
    if action in ("disk_full", "io_error"):
        return Fault(0.0, action, target, _uniform(rng, spec.degrade_s))
    if action == "crash_at_fsync":
        low, high = spec.kill_down_s
        return Fault(0.0, action, target, _uniform(rng, (low + 2.0, high + 2.0)), how=rng.choice(CRASH_POINTS))
    if action == "corrupt":
        return Fault(0.0, action, target, _uniform(rng, spec.kill_down_s), how=rng.choice(spec.corruptions))
    if action == "clock_jump":
        return Fault(0.0, action, target, _uniform(rng, spec.degrade_s), rng.choice(CLOCK_JUMPS_S))
    return Fault(0.0, "join", target)


def _shortest(fault: Fault, spec: ScheduleSpec) -> Fault:
    shortest = {
        "kill": spec.kill_down_s[0],
        "stop": spec.lease_s * STOP_PAST_LEASE_FACTOR,
        "isolate": spec.lease_s * STOP_PAST_LEASE_FACTOR,
        "partition": spec.lease_s * STOP_PAST_LEASE_FACTOR,
        "bandwidth": spec.degrade_s[0],
        "slow": spec.degrade_s[0],
        "join": 0.0,
        "disk_full": spec.degrade_s[0],
        "io_error": spec.degrade_s[0],
        "crash_at_fsync": spec.kill_down_s[0] + 2.0,
        "corrupt": spec.kill_down_s[0],
        "clock_jump": spec.degrade_s[0],
    }[fault.action]
    return replace(fault, duration_s=round(shortest, 2))


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
    if spec.coordinator_partition:
        plan.append(("partition", COORDINATOR))
    plan += [("join", j) for j in spec.joiners]
    plan += [(action, rng.choice(spec.nodes)) for action in spec.required_actions]
    actions = sorted(a for a in spec.weights if a != "partition" or spec.max_down >= 2)
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
        placed.append(replace(drawn, at_s=start))
    schedule = Schedule(seed, spec.duration_s, tuple(sorted(placed, key=lambda f: f.at_s)))
    problems = check_schedule(schedule, spec)
    assert not problems, problems  # generation and checking are written independently
    return schedule


def _earliest_fit(fault: Fault, nominal: float, last_heal: float, placed: Sequence[Fault],
                  spec: ScheduleSpec) -> float | None:
    """Slide the fault later from `nominal` (0.25 s steps) until it fits, or None."""
    start = round(nominal, 2)  # the value stored, so checking later sees the same numbers
    while start + fault.duration_s <= last_heal:
        candidate = replace(fault, at_s=start)
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
    founders = set(spec.nodes) | {COORDINATOR}
    for f in schedule.faults:
        if f.target not in known:
            problems.append(f"{f.describe()}: unknown target {f.target}")
        if f.action == "partition" and not set(f.nodes) <= founders | {FOLLOWER}:
            problems.append(f"{f.describe()}: a partition's minority is made of founders, not {sorted(set(f.nodes) - founders - {FOLLOWER})}")
        if f.end_s > last_heal:
            problems.append(f"{f.describe()}: healed at t+{f.end_s:.1f}s, after t+{last_heal:.1f}s (settle {spec.settle_s}s)")
        if f.at_s < spec.warmup_s:
            problems.append(f"{f.describe()}: before the warm-up ends at t+{spec.warmup_s:.1f}s")
        if f.action in PAST_LEASE and f.duration_s < spec.lease_s * STOP_PAST_LEASE_FACTOR:
            problems.append(f"{f.describe()}: shorter than {STOP_PAST_LEASE_FACTOR} x lease ({spec.lease_s}s)")
    for i, f in enumerate(schedule.faults):
        if f.action != "join" and not _fits(f, schedule.faults[:i] + schedule.faults[i + 1:], spec):
            problems.append(f"{f.describe()}: overlaps another fault on the same node or takes down a majority")
    if require_coordinator_faults:
        for action in ("kill", "stop") + (("partition",) if spec.coordinator_partition else ()):
            if not any(f.action == action and f.target == COORDINATOR for f in schedule.faults):
                problems.append(f"no coordinator {action}")
        for action in spec.required_actions:
            if not any(f.action == action for f in schedule.faults):
                problems.append(f"no {action} (its weight asks for one)")
    return problems
