"""The outer step's learning rate and momentum at a fragment's round: the `[run.outer]` schedules.

A pure function of the round being produced and the manifest's `OuterOptimizer`, so every replica
steps a fragment with the same two numbers and `GlobalState.digest_after` previews exactly what
`apply_outer_gradient` does. Rounds are 1-based: the step that takes fragment p from round r - 1
to round r uses `outer_step_values(outer, r)`. Only +, -, *, / on Python floats (IEEE doubles,
correctly rounded everywhere) and a fixed cosine series instead of libm's `cos`, whose last bit
may differ between C libraries: the values are bit-identical on every machine, and the step
rounds them to float32 as before (`outer.nesterov_chunks`).

- momentum warm-up (W = `momentum_warmup_rounds` > 0): the momentum is scaled by (r - 1) / W,
  so round 1 steps without momentum and round W + 1 has the full value;
- momentum decay (D = `momentum_decay_rounds` > 0, horizon N): from round N - D on the momentum
  moves linearly to `momentum_final`, reached at round N and kept after;
- learning rate: `constant`, or held until `lr_decay_start` of the horizon, then `linear` or
  `cosine` down to lr x `lr_final_fraction` at round N, or cut to it at once (`step`); kept
  after N. Progress through the horizon is (r - 1) / (N - 1): round 1 is 0, round N is 1.
"""

from __future__ import annotations

from diloco_node.config.manifest import ConfigError, OuterOptimizer

# Terms of the cosine's Taylor series: x in [0, pi], so the first term left out, pi^42 / 42!,
# is ~1e-30, far below a double's resolution.
_COSINE_TERMS = 21
_PI = 3.141592653589793


def check_schedule(outer: OuterOptimizer) -> None:
    """ConfigError when a schedule that ends at the horizon is on and no horizon is known (an
    `OuterOptimizer` made outside a manifest, with `horizon_rounds` = 0)."""
    if outer.needs_horizon and outer.horizon < 1:
        raise ConfigError("outer.horizon_rounds = 0 and no run manifest to derive it from: the outer lr schedule "
                          "and momentum decay need the horizon (set outer.horizon_rounds, or build the "
                          "optimizer from a RunManifest)")


def outer_step_values(outer: OuterOptimizer, round_: int) -> tuple[float, float]:
    """(lr, momentum) of the step that produces fragment round `round_` (1-based)."""
    if round_ < 1:
        raise ValueError(f"round {round_}: the first outer step produces round 1")
    return outer_lr(outer, round_), outer_momentum(outer, round_)


def outer_lr(outer: OuterOptimizer, round_: int) -> float:
    """The learning rate of the step that produces `round_`."""
    if outer.lr_schedule == "constant":
        return outer.lr
    start = outer.lr_decay_start
    progress = _horizon_progress(outer, round_)
    if progress <= start:
        return outer.lr
    final = outer.lr_final_fraction
    if outer.lr_schedule == "step" or progress >= 1.0:  # the horizon's value exactly, not within rounding
        return outer.lr * final
    along = (progress - start) / (1.0 - start)  # 0 -> 1 over the decay window
    if outer.lr_schedule == "linear":
        return outer.lr * (1.0 - (1.0 - final) * along)
    return outer.lr * (final + (1.0 - final) * 0.5 * (1.0 + _cosine(_PI * along)))


def outer_momentum(outer: OuterOptimizer, round_: int) -> float:
    """The momentum of the step that produces `round_`: the decay's value, scaled by the warm-up."""
    momentum = outer.momentum
    decay = outer.momentum_decay_rounds
    if decay > 0:
        check_schedule(outer)
        into_decay = round_ - (outer.horizon - decay)  # 1 at the decay's first round, D at the horizon
        if into_decay >= decay:  # the final value exactly, not within rounding
            momentum = outer.momentum_final
        elif into_decay > 0:
            momentum = momentum + (outer.momentum_final - momentum) * (into_decay / decay)
    warmup = outer.momentum_warmup_rounds
    if warmup > 0 and round_ <= warmup:
        momentum = momentum * ((round_ - 1) / warmup)
    return momentum


def _horizon_progress(outer: OuterOptimizer, round_: int) -> float:
    """Where `round_` is in the horizon N: 0 at round 1, 1 at round N and after (1 when N = 1)."""
    check_schedule(outer)
    span = outer.horizon - 1
    if span <= 0:
        return 1.0
    return min(1.0, (round_ - 1) / span)


def _cosine(x: float) -> float:
    """cos(x) for x in [0, pi] by a fixed Taylor series: the same bits on every machine."""
    term = 1.0
    total = 1.0
    x2 = x * x
    for k in range(1, _COSINE_TERMS):
        term = -term * x2 / ((2 * k - 1) * (2 * k))
        total += term
    return total
