"""Discrete-event model of a failing accelerator fleet: goodput and uptime per training strategy.

One responsibility: given a fleet (chips grouped into slices, per-chip interruption rate, repair,
reconfiguration and restart times, optional speed heterogeneity and transient slowdowns) and a
strategy, simulate virtual time (nothing ever sleeps) and report

    goodput = productive chip-seconds / (chips x wall time)
    uptime  = share of wall time during which the global model advances.

Strategies
    dp          non-elastic data-parallel: one job on all chips; any slice failure stalls it for a
                restart (a hot spare slice is swapped in, the job restarts from its checkpoint).
    elastic_dp  one elastic job: a slice failure pauses it for a downscale reconfiguration, after
                which it trains on fewer chips; a repaired slice triggers an upscale reconfiguration.
    decoupled   M independent elastic learners of N/M chips; the global model advances while at
                least K learners are TRAINING.

Only slice counts are tracked, never individual chips: failures are a Poisson process with rate
healthy_chips / MTBI, repairs are exponential with a mean repair time (so the state of a job is a
handful of integers). The results depend only on dimensionless products such as N*D/MTBI, which
is why a million-chip fleet costs a few tens of thousands of events. Seeded and deterministic.
The calibration of the default parameters is documented in docs/GOODPUT.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

SECONDS_PER_YEAR = 365.0 * 24 * 3600

# --- Defaults (calibration in docs/GOODPUT.md) ------------------------------------------------
# The paper's setting: one interruption per chip-year.
DEFAULT_MTBI_CHIP_S = SECONDS_PER_YEAR
# One TPU v6e pod. Only the product slice_chips x repair_s is identified by the elastic curve.
DEFAULT_SLICE_CHIPS = 256
# Mean repair time of a failed slice (drain, swap or reboot, health check). Fitted together with
# the slice size to the elastic curve's ~4% loss that does not grow with fleet size.
DEFAULT_REPAIR_S = 5400.0
# Elastic reconfiguration pauses (re-shard to the new mesh, recompile). Fitted to the curve's slope.
DEFAULT_DOWNSCALE_S = 9.5
DEFAULT_UPSCALE_S = 9.5
# Non-elastic restart: swap in a spare slice, reload the checkpoint, recompile, redo lost steps.
# Fitted to the single dp point (27% at 1.2M chips); not a prediction.
DEFAULT_RESTART_S = 70.0
# Statistical budget: the horizon is this many expected fleet-wide failures. 20k keeps the
# standard error of goodput well under a point and the default sweep within seconds.
DEFAULT_EXPECTED_FAILURES = 20_000
# Refuse runs beyond this many expected fleet-wide failures: about ten minutes of one core, so a
# typo in --expected-failures or --wall-time-s fails fast instead of running for hours.
MAX_EXPECTED_FAILURES = 5_000_000
# The same guard for everything the event loop draws, over the warm-up and the horizon: failures
# and repairs (2 per failure), transient slowdowns and their ends (2 per onset). A slowdown rate or
# repair time off by orders of magnitude would otherwise run for hours while the failure count
# looks harmless. 12M: the failure limit's 10M events plus room for the warm-up, about a minute
# of one core (~180k events/s measured).
MAX_EXPECTED_EVENTS = 12_000_000
# Warm-up before accounting starts, in mean repair/reconfiguration times, so the job state is
# close to stationary when measurement begins.
WARMUP_TIME_CONSTANTS = 3.0

DEFAULT_FLEET_SIZES: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
DEFAULT_LEARNER_COUNTS: tuple[int, ...] = (2, 4, 8, 16)
STRATEGIES = ("dp", "elastic_dp", "decoupled")

# The paper's reported goodput in percent (Decoupled DiLoCo, arXiv 2604.21428): the elastic
# data-parallel curve the defaults are calibrated to, and the comparison points at 1.2M chips
# (decoupled with K = 1). Shared by the plot and the benchmark's check.
PAPER_FLEET_SIZE = 1_200_000
PAPER_ELASTIC_GOODPUT = dict(zip(DEFAULT_FLEET_SIZES, (88.0, 82.0, 70.0, 58.0, 40.0), strict=True))
PAPER_DP_GOODPUT_AT_1_2M = 27.0
PAPER_DECOUPLED_GOODPUT_AT_1_2M = {2: 70.0, 4: 82.0, 8: 88.0, 16: 93.0}  # by learner count M

# Random numbers are drawn in blocks: one numpy call per block instead of one per event.
_DRAW_BLOCK = 4096


@dataclass(frozen=True, slots=True)
class FleetParams:
    """Every physical assumption of the model, validated on construction."""

    mtbi_chip_s: float = DEFAULT_MTBI_CHIP_S
    slice_chips: int = DEFAULT_SLICE_CHIPS
    repair_s: float = DEFAULT_REPAIR_S
    downscale_s: float = DEFAULT_DOWNSCALE_S
    upscale_s: float = DEFAULT_UPSCALE_S
    restart_s: float = DEFAULT_RESTART_S
    # Static heterogeneity: learner i of M runs at 1 - spread * i / (M - 1); a synchronous job
    # spanning every site runs at the slowest speed, 1 - spread.
    speed_spread: float = 0.0
    # Transient slowdowns: each slice independently becomes slow at this rate (per second), stays
    # slow for an exponential time with the given mean, and a synchronous job with any slow slice
    # runs at slowdown_factor of its speed.
    slowdown_rate_per_slice: float = 0.0
    slowdown_mean_s: float = 60.0
    slowdown_factor: float = 0.5
    expected_failures: int = DEFAULT_EXPECTED_FAILURES
    # A fixed measured wall time instead of one derived from expected_failures (e.g. for a
    # fleet that never fails).
    wall_time_s: float | None = None

    def __post_init__(self) -> None:
        positive = {
            "mtbi_chip_s": self.mtbi_chip_s,
            "slice_chips": self.slice_chips,
            "repair_s": self.repair_s,
            "slowdown_mean_s": self.slowdown_mean_s,
            "expected_failures": self.expected_failures,
        }
        for name, value in positive.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        non_negative = {
            "downscale_s": self.downscale_s,
            "upscale_s": self.upscale_s,
            "restart_s": self.restart_s,
            "slowdown_rate_per_slice": self.slowdown_rate_per_slice,
        }
        for name, value in non_negative.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
        if self.wall_time_s is not None and not (
            isinstance(self.wall_time_s, int | float) and math.isfinite(self.wall_time_s)
            and self.wall_time_s > 0
        ):
            raise ValueError(f"wall_time_s must be a positive finite number, got {self.wall_time_s!r}")
        if not 0 <= self.speed_spread < 1:
            raise ValueError(f"speed_spread must be in [0, 1), got {self.speed_spread!r}")
        if not 0 < self.slowdown_factor <= 1:
            raise ValueError(f"slowdown_factor must be in (0, 1], got {self.slowdown_factor!r}")

    def horizon_s(self, chips: int) -> float:
        """Measured wall time: long enough for `expected_failures` fleet-wide failures."""
        if self.wall_time_s is not None:
            return float(self.wall_time_s)
        return self.expected_failures * self.mtbi_chip_s / chips

    def expected_events(self, chips: int) -> float:
        """Upper estimate of the events one fleet run draws (warm-up included), for MAX_EXPECTED_EVENTS."""
        simulated_s = self.warmup_s() + self.horizon_s(chips)
        failures = simulated_s * chips / self.mtbi_chip_s
        slowdowns = simulated_s * (chips / self.slice_chips) * self.slowdown_rate_per_slice
        return 2 * failures + 2 * slowdowns

    def warmup_s(self) -> float:
        longest = max(self.repair_s, self.downscale_s, self.upscale_s, self.restart_s)
        if self.slowdown_rate_per_slice > 0:
            longest = max(longest, self.slowdown_mean_s)
        return WARMUP_TIME_CONSTANTS * longest


@dataclass(slots=True)
class JobResult:
    """What one job (a dp job, an elastic job or one learner) did inside [0, horizon)."""

    chips: int
    horizon_s: float
    productive_chip_s: float
    # Disjoint, sorted intervals during which the job was TRAINING on at least one slice.
    up_intervals: list[tuple[float, float]]
    failures: int
    pauses: int
    # (time, event, healthy slices after it); only filled when recording was asked for.
    events: list[tuple[float, str, int]] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.productive_chip_s / (self.chips * self.horizon_s)

    @property
    def uptime(self) -> float:
        return sum(end - start for start, end in self.up_intervals) / self.horizon_s


@dataclass(frozen=True, slots=True)
class FleetResult:
    strategy: str
    fleet_size: int  # chips asked for
    chips: int  # chips simulated (whole slices per learner)
    learners: int
    quorum: int
    goodput: float
    uptime: float
    failures: int
    pauses: int
    horizon_s: float
    reason: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class _Draws:
    """Block-drawn exponentials and uniforms from one seeded generator."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._exp = rng.standard_exponential(_DRAW_BLOCK)
        self._uni = rng.random(_DRAW_BLOCK)
        self._i = 0

    def pair(self) -> tuple[float, float]:
        if self._i == _DRAW_BLOCK:
            self._exp = self._rng.standard_exponential(_DRAW_BLOCK)
            self._uni = self._rng.random(_DRAW_BLOCK)
            self._i = 0
        i = self._i
        self._i = i + 1
        return float(self._exp[i]), float(self._uni[i])


def learner_rng(seed: int, learner_index: int) -> np.random.Generator:
    """Learner i's random stream; elastic_dp and dp use stream 0, so M = 1 replays elastic_dp."""
    return np.random.default_rng(np.random.SeedSequence([seed, learner_index]))


def simulate_job(
    n_slices: int,
    *,
    elastic: bool,
    params: FleetParams,
    horizon_s: float,
    rng: np.random.Generator,
    speed: float = 1.0,
    record_events: bool = False,
) -> JobResult:
    """Simulate one synchronous job on `n_slices` slices from -warm-up to `horizon_s`.

    Elastic: TRAINING on the slices that were healthy when the last reconfiguration finished;
    a failure or a repair during TRAINING starts a reconfiguration pause (downscale or upscale),
    and changes that happen during a pause are adopted when it ends (no extra pause).
    Non-elastic: TRAINING on all slices; a failure stalls the job for `restart_s` (a spare slice
    replaces the failed one, so repair time does not gate it); failures during a stall are
    handled by the same restart.
    """
    if n_slices < 1:
        raise ValueError(f"a job needs at least one slice, got {n_slices}")
    chips_per_slice = params.slice_chips
    fail_rate_per_slice = chips_per_slice / params.mtbi_chip_s
    repair_rate = 1.0 / params.repair_s
    slow_rate = params.slowdown_rate_per_slice
    slow_end_rate = 1.0 / params.slowdown_mean_s
    draws = _Draws(rng)

    if elastic:
        # Start from the stationary share of slices under repair (independent slices, M/M/inf).
        p_down = fail_rate_per_slice / (fail_rate_per_slice + repair_rate)
        healthy = n_slices - int(rng.binomial(n_slices, p_down))
    else:
        healthy = n_slices  # spares keep the job whole; repairs happen off the job
    slow = int(rng.binomial(n_slices, slow_rate / (slow_rate + slow_end_rate))) if slow_rate else 0

    active = healthy  # slices in the current mesh
    paused = False
    pause_end = math.inf
    now = -params.warmup_s()
    productive = 0.0
    failures = 0
    pauses = 0
    up_intervals: list[tuple[float, float]] = []
    up_since: float | None = 0.0 if active > 0 else None
    events: list[tuple[float, str, int]] = []

    def job_speed() -> float:
        return speed * (params.slowdown_factor if slow else 1.0)

    while True:
        lam_fail = (healthy if elastic else n_slices) * fail_rate_per_slice
        lam_repair = (n_slices - healthy) * repair_rate if elastic else 0.0
        lam_slow = (n_slices - slow) * slow_rate
        lam_recover = slow * slow_end_rate
        total = lam_fail + lam_repair + lam_slow + lam_recover
        exp_draw, uniform = draws.pair()
        next_event = now + exp_draw / total if total > 0 else math.inf
        boundary = min(pause_end, horizon_s)

        if next_event >= boundary:
            # A pause ends (or the horizon arrives) before the drawn event; the draw is discarded,
            # which is exact because every event process here is memoryless.
            if pause_end > horizon_s:
                if not paused:
                    productive += active * chips_per_slice * job_speed() * (horizon_s - max(now, 0.0))
                break
            now = pause_end
            paused = False
            pause_end = math.inf
            active = healthy if elastic else n_slices
            if active > 0:
                up_since = max(now, 0.0)
            if record_events:
                events.append((now, "resume", healthy))
            continue

        if not paused and next_event > 0:
            productive += active * chips_per_slice * job_speed() * (next_event - max(now, 0.0))
        now = next_event
        pick = uniform * total
        if pick < lam_fail:
            kind = "failure"
            if now >= 0:
                failures += 1
            if elastic:
                healthy -= 1
            trigger = True
            pause_s = params.downscale_s if elastic else params.restart_s
        elif pick < lam_fail + lam_repair:
            kind = "repair"
            healthy += 1
            trigger = True
            pause_s = params.upscale_s
        elif pick < lam_fail + lam_repair + lam_slow:
            kind, trigger, pause_s = "slowdown", False, 0.0
            slow += 1
        else:
            kind, trigger, pause_s = "recovery", False, 0.0
            slow -= 1
        if record_events:
            events.append((now, kind, healthy))
        if trigger and not paused:
            paused = True
            pause_end = now + pause_s
            if now >= 0:
                pauses += 1
            if up_since is not None and now > up_since:
                up_intervals.append((up_since, now))
            up_since = None
            if record_events:
                events.append((now, "pause", healthy))

    if up_since is not None and horizon_s > up_since:
        up_intervals.append((up_since, horizon_s))
    return JobResult(
        chips=n_slices * chips_per_slice,
        horizon_s=horizon_s,
        productive_chip_s=productive,
        up_intervals=up_intervals,
        failures=failures,
        pauses=pauses,
        events=events,
    )


def quorum_uptime(jobs: Sequence[JobResult], quorum: int, horizon_s: float) -> float:
    """Share of [0, horizon) during which at least `quorum` of the jobs are TRAINING."""
    if not 1 <= quorum <= len(jobs):
        raise ValueError(f"quorum must be in [1, {len(jobs)}], got {quorum}")
    starts = [s for job in jobs for s, _ in job.up_intervals]
    ends = [e for job in jobs for _, e in job.up_intervals]
    if not starts:
        return 0.0
    times = np.concatenate([np.asarray(starts), np.asarray(ends)])
    deltas = np.concatenate([np.ones(len(starts)), -np.ones(len(ends))])
    # At equal times process ends before starts, so touching intervals never overcount.
    order = np.lexsort((deltas, times))
    times, deltas = times[order], deltas[order]
    running = np.cumsum(deltas)
    spans = np.diff(np.append(times, horizon_s))
    return float(np.sum(spans[running >= quorum]) / horizon_s)


def slices_for(chips: int, learners: int, slice_chips: int) -> int:
    """Slices per learner for a fleet of `chips` split into `learners` (at least one slice)."""
    return max(1, round(chips / (learners * slice_chips)))


def learner_speeds(learners: int, spread: float) -> list[float]:
    """Static speed per learner; one learner spanning every site runs at the slowest speed."""
    if learners == 1:
        return [1.0 - spread]
    return [1.0 - spread * i / (learners - 1) for i in range(learners)]


def simulate_fleet(
    strategy: str,
    chips: int,
    params: FleetParams,
    *,
    learners: int = 1,
    quorum: int = 1,
    seed: int = 0,
) -> FleetResult:
    """Goodput and uptime of one strategy on a fleet of `chips` chips."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not (isinstance(chips, int) and chips > 0):
        raise ValueError(f"chips must be a positive integer, got {chips!r}")
    if strategy != "decoupled":
        learners, quorum = 1, 1
    if not (isinstance(learners, int) and learners >= 1):
        raise ValueError(f"learners (M) must be a positive integer, got {learners!r}")
    if not 1 <= quorum <= learners:
        raise ValueError(f"quorum (K) must be in [1, M={learners}], got {quorum!r}")

    horizon = params.horizon_s(chips)
    expected = horizon * chips / params.mtbi_chip_s
    if expected > MAX_EXPECTED_FAILURES:
        raise ValueError(
            f"{expected:.3g} expected failures exceed the limit of {MAX_EXPECTED_FAILURES:,}: "
            "lower expected_failures or wall_time_s"
        )
    events = params.expected_events(chips)
    if events > MAX_EXPECTED_EVENTS:
        raise ValueError(
            f"{events:.3g} expected events (failures, repairs and slowdowns, warm-up included) exceed "
            f"the limit of {MAX_EXPECTED_EVENTS:,}: check slowdown_rate_per_slice and the repair, "
            "reconfiguration and restart times"
        )
    n_slices = slices_for(chips, learners, params.slice_chips)
    speeds = learner_speeds(learners, params.speed_spread)
    jobs = [
        simulate_job(
            n_slices,
            elastic=strategy != "dp",
            params=params,
            horizon_s=horizon,
            rng=learner_rng(seed, index),
            speed=speeds[index],
        )
        for index in range(learners)
    ]
    simulated_chips = sum(job.chips for job in jobs)
    goodput = sum(job.productive_chip_s for job in jobs) / (simulated_chips * horizon)
    uptime = quorum_uptime(jobs, quorum, horizon)
    failures = sum(job.failures for job in jobs)
    pauses = sum(job.pauses for job in jobs)
    if strategy == "dp":
        reason = (
            f"non-elastic: {failures} failures each stall all {simulated_chips} chips for a "
            f"{params.restart_s:g} s restart"
        )
    elif strategy == "elastic_dp":
        reason = (
            f"elastic: {pauses} reconfiguration pauses of ~{params.downscale_s:g}/"
            f"{params.upscale_s:g} s stall all {simulated_chips} chips"
        )
    else:
        reason = (
            f"decoupled: {learners} learners of {n_slices * params.slice_chips} chips pause "
            f"independently ({pauses} pauses); model advances while >= {quorum} train"
        )
    return FleetResult(
        strategy=strategy,
        fleet_size=chips,
        chips=simulated_chips,
        learners=learners,
        quorum=quorum,
        goodput=goodput,
        uptime=uptime,
        failures=failures,
        pauses=pauses,
        horizon_s=horizon,
        reason=reason,
    )


def run_sweep(
    params: FleetParams,
    *,
    fleet_sizes: Iterable[int] = DEFAULT_FLEET_SIZES,
    learner_counts: Iterable[int] = DEFAULT_LEARNER_COUNTS,
    strategies: Iterable[str] = STRATEGIES,
    quorum: int = 1,
    seed: int = 0,
) -> list[FleetResult]:
    """Every strategy at every fleet size; decoupled at every M (quorum clipped to M)."""
    results: list[FleetResult] = []
    wanted = list(strategies)
    unknown = sorted(set(wanted) - set(STRATEGIES))
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    counts = list(learner_counts)
    for chips in fleet_sizes:
        for strategy in wanted:
            if strategy == "decoupled":
                for m in counts:
                    results.append(
                        simulate_fleet(
                            strategy, chips, params, learners=m, quorum=min(quorum, m), seed=seed
                        )
                    )
            else:
                results.append(simulate_fleet(strategy, chips, params, seed=seed))
    return results


def paper_goodput(result: FleetResult) -> float | None:
    """The paper's goodput (percent) for this strategy and fleet size, None where it gives none."""
    if result.strategy == "elastic_dp":
        return PAPER_ELASTIC_GOODPUT.get(result.fleet_size)
    if result.fleet_size != PAPER_FLEET_SIZE:
        return None
    if result.strategy == "dp":
        return PAPER_DP_GOODPUT_AT_1_2M
    return PAPER_DECOUPLED_GOODPUT_AT_1_2M.get(result.learners)


def label(result: FleetResult) -> str:
    if result.strategy == "decoupled":
        return f"decoupled M={result.learners} K={result.quorum}"
    return result.strategy


def format_table(results: Sequence[FleetResult]) -> str:
    """Goodput (uptime) in percent: one row per strategy, one column per fleet size."""
    sizes = sorted({r.fleet_size for r in results})
    rows: dict[str, dict[int, FleetResult]] = {}
    for r in results:
        rows.setdefault(label(r), {})[r.fleet_size] = r
    header = f"{'strategy':<22}" + "".join(f"{short_size(c):>15}" for c in sizes)
    lines = ["goodput % (uptime %)", header]
    for name, by_size in rows.items():
        cells = []
        for c in sizes:
            r = by_size.get(c)
            cells.append(f"{100 * r.goodput:6.1f} ({100 * r.uptime:5.1f})" if r else " " * 15)
        lines.append(f"{name:<22}" + "".join(f"{cell:>15}" for cell in cells))
    return "\n".join(lines)


def short_size(chips: int) -> str:
    return f"{chips / 1e6:.2f}M" if chips >= 1_000_000 else f"{chips / 1e3:.0f}k"
