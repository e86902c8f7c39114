"""The outer schedules (`sync/outer_schedule.py`, the `[run.outer]` keys): the values at each
round, the run's horizon, validation, and the global state stepping with them (digest preview
equal to the apply, replicas bit-identical, each round's step the hand-computed Nesterov step).
No network."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import numpy as np
import pytest

from diloco_node.config.manifest import (ConfigError, InnerOptimizer, ModelSpec, OuterOptimizer, RunManifest, StopSpec,
                                          SyncSpec)
from diloco_node.config.settings import load_config
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.global_state import GlobalState
from diloco_node.sync.outer import nesterov_step
from diloco_node.sync.outer_schedule import _cosine, outer_lr, outer_momentum, outer_step_values

SHAPES = {"embed/embedding": (8, 4), "blocks/0/w": (4, 4), "head/kernel": (4, 8)}


def _lrs(outer: OuterOptimizer, rounds: range) -> list[float]:
    return [outer_lr(outer, r) for r in rounds]


def _momenta(outer: OuterOptimizer, rounds: range) -> list[float]:
    return [outer_momentum(outer, r) for r in rounds]


# ------------------------------------------------------------------ values at each round


def test_by_default_the_lr_is_constant_and_the_momentum_warms_up_over_five_rounds() -> None:
    outer = OuterOptimizer()
    assert (outer.lr, outer.momentum, outer.momentum_warmup_rounds) == (0.7, 0.6, 5)
    assert [outer_step_values(outer, r)[0] for r in (1, 2, 20, 10_000)] == [0.7] * 4
    assert [round(outer_step_values(outer, r)[1], 9) for r in (1, 2, 6, 20, 10_000)] == [0.0, 0.12, 0.6, 0.6, 0.6]
    # With the warm-up off, every round steps with the set values; a constant schedule needs no
    # horizon, so a bare optimizer (no manifest) steps the same.
    assert outer_step_values(OuterOptimizer(lr=0.4, momentum=0.9, momentum_warmup_rounds=0), 3) == (0.4, 0.9)


def test_momentum_warmup_ramps_from_zero_to_the_set_momentum() -> None:
    outer = OuterOptimizer(momentum=0.8, momentum_warmup_rounds=4)
    assert _momenta(outer, range(1, 8)) == [0.0, 0.8 * 0.25, 0.8 * 0.5, 0.8 * 0.75, 0.8, 0.8, 0.8]
    assert _lrs(outer, range(1, 8)) == [0.7] * 7  # the lr is not touched
    assert _momenta(OuterOptimizer(momentum=0.8, momentum_warmup_rounds=1), range(1, 4)) == [0.0, 0.8, 0.8]


def test_momentum_decay_reaches_momentum_final_at_the_horizon_and_keeps_it() -> None:
    outer = OuterOptimizer(momentum=0.6, momentum_warmup_rounds=0, momentum_decay_rounds=4, momentum_final=0.2, horizon_rounds=10)
    got = _momenta(outer, range(1, 14))
    assert got[:6] == [0.6] * 6
    np.testing.assert_allclose(got[6:9], [0.5, 0.4, 0.3], rtol=1e-12)
    assert got[9:] == [0.2] * 4  # round 10 is the horizon: exactly the final value, and after it


def test_warmup_and_decay_combine_on_a_short_horizon() -> None:
    outer = OuterOptimizer(momentum=0.6, momentum_warmup_rounds=4, momentum_decay_rounds=2, momentum_final=0.0,
                           horizon_rounds=4)
    # Round 3 is the decay's first (0.6 -> 0.3) and still in the warm-up (x 2/4).
    np.testing.assert_allclose(_momenta(outer, range(1, 6)), [0.0, 0.15, 0.15, 0.0, 0.0], atol=1e-15)


def test_linear_and_cosine_lr_reach_the_final_fraction_at_the_horizon_and_stay_there() -> None:
    for schedule in ("linear", "cosine"):
        outer = OuterOptimizer(lr=1.0, lr_schedule=schedule, lr_final_fraction=0.5, horizon_rounds=11,
                               momentum_warmup_rounds=0)
        lrs = _lrs(outer, range(1, 16))
        assert lrs[0] == 1.0, schedule
        np.testing.assert_allclose(lrs[5], 0.75, rtol=1e-12)  # round 6: half way, both schedules
        assert lrs[10:] == [0.5] * 5, schedule  # round 11 is the horizon
        assert all(a > b for a, b in zip(lrs[:10], lrs[1:11])), schedule  # strictly down to it
        assert _momenta(outer, range(1, 16)) == [0.6] * 15  # the momentum is not touched
    linear = _lrs(OuterOptimizer(lr=1.0, lr_schedule="linear", lr_final_fraction=0.5, horizon_rounds=11), range(1, 12))
    np.testing.assert_allclose(linear, [1.0 - 0.05 * i for i in range(11)], rtol=1e-12)
    cosine = _lrs(OuterOptimizer(lr=1.0, lr_schedule="cosine", lr_final_fraction=0.5, horizon_rounds=11), range(1, 12))
    np.testing.assert_allclose(cosine, [0.5 + 0.25 * (1 + math.cos(math.pi * i / 10)) for i in range(11)], rtol=1e-14)


def test_a_late_decay_holds_the_lr_then_cuts_it() -> None:
    # Covenant-72B's late cut: the full lr for the first 3/4 of the horizon, then 0.65 of it.
    step = OuterOptimizer(lr=1.0, lr_schedule="step", lr_final_fraction=0.65, lr_decay_start=0.75, horizon_rounds=21)
    assert _lrs(step, range(1, 25)) == [1.0] * 16 + [0.65] * 8  # progress (r - 1) / 20 > 0.75 from round 17
    late = OuterOptimizer(lr=1.0, lr_schedule="linear", lr_final_fraction=0.5, lr_decay_start=0.5, horizon_rounds=11)
    np.testing.assert_allclose(_lrs(late, range(1, 13)), [1.0] * 6 + [0.9, 0.8, 0.7, 0.6, 0.5, 0.5], rtol=1e-12)


def test_a_horizon_of_one_round_cuts_from_the_first_step() -> None:
    outer = OuterOptimizer(lr=0.8, lr_schedule="cosine", lr_final_fraction=0.5, horizon_rounds=1)
    assert _lrs(outer, range(1, 4)) == [0.4] * 3


def test_the_cosine_is_the_same_function_as_libm_to_the_last_bits() -> None:
    for i in range(201):
        x = math.pi * i / 200
        assert abs(_cosine(x) - math.cos(x)) < 4e-15, x


def test_round_zero_is_not_a_step() -> None:
    with pytest.raises(ValueError, match="first outer step produces round 1"):
        outer_step_values(OuterOptimizer(), 0)


# ------------------------------------------------------------------ the run's horizon


def test_the_horizon_is_the_runs_rounds_unless_set_and_moves_with_the_run() -> None:
    manifest = RunManifest(inner=InnerOptimizer(total_steps=600, warmup_steps=200), sync=SyncSpec(period=28),
                           outer=OuterOptimizer(lr_schedule="cosine"))
    assert manifest.outer_horizon_rounds() == 21 and manifest.resolved_outer().horizon == 21
    assert manifest.to_dict()["outer"]["horizon_rounds"] == 0  # derived, not written into the manifest
    # A manifest rebuilt with another period (what `parity.py --set sync.period=16` does) derives again.
    raw = manifest.to_dict()
    raw["sync"]["period"] = 16
    assert RunManifest.from_dict(raw).resolved_outer().horizon == 37
    assert dataclasses.replace(manifest, inner=InnerOptimizer(total_steps=100)).resolved_outer().horizon == 3
    # Set explicitly, it wins; a run shorter than a period has a horizon of one round.
    assert RunManifest(outer=OuterOptimizer(horizon_rounds=7)).resolved_outer().horizon == 7
    assert RunManifest(inner=InnerOptimizer(total_steps=10, warmup_steps=1)).resolved_outer().horizon == 1
    # The manifest keeps what was configured: it round-trips, and its outer optimizer is the
    # configured one (the resolved copy is what replicas step with).
    assert RunManifest.from_dict(manifest.to_dict()) == manifest
    assert manifest.outer == OuterOptimizer(lr_schedule="cosine")
    # With no horizon at all (an unbounded WSD learner), the outer horizon is unknown: 0.
    unbounded = RunManifest(inner=InnerOptimizer(schedule="wsd"), outer=OuterOptimizer(momentum_warmup_rounds=3))
    assert unbounded.outer_horizon_rounds() == 0
    # The learner's horizon from [run.stop] sets the outer one too.
    stopped = RunManifest(inner=InnerOptimizer(batch_size=8, warmup_steps=10), model=ModelSpec.of(seq_len=64),
                          stop=StopSpec(tokens=8 * 64 * 2800), sync=SyncSpec(period=28))
    assert stopped.outer_horizon_rounds() == 100


def test_a_schedule_that_needs_the_horizon_is_refused_without_one() -> None:
    plan = plan_fragments(SHAPES, 1, 4, 0)
    initial = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    for bare in (OuterOptimizer(lr_schedule="linear"), OuterOptimizer(momentum_decay_rounds=2)):
        with pytest.raises(ConfigError, match="outer.horizon_rounds = 0"):
            GlobalState(plan, initial, bare)
        GlobalState(plan, initial, dataclasses.replace(bare, horizon_rounds=5))  # explicit: fine
        GlobalState(plan, initial, RunManifest(outer=bare).resolved_outer())  # from a manifest: fine
    GlobalState(plan, initial, OuterOptimizer(momentum_warmup_rounds=3))  # the warm-up needs no horizon


def test_the_parity_benchmark_sets_every_key_with_set() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "parity.py"
    spec = importlib.util.spec_from_file_location("parity_for_outer_schedule", path)
    parity = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = parity  # its dataclasses look their module up while being defined
    spec.loader.exec_module(parity)
    manifest = parity.with_overrides(parity.benchmark_manifest(600, 0), parity.parse_overrides([
        "outer.momentum_warmup_rounds=5", "outer.momentum_decay_rounds=3", "outer.momentum_final=0.2",
        "outer.lr_schedule=step", "outer.lr_final_fraction=0.65", "outer.lr_decay_start=0", "sync.period=16"]))
    outer = manifest.resolved_outer()
    assert (outer.momentum_warmup_rounds, outer.momentum_decay_rounds, outer.momentum_final) == (5, 3, 0.2)
    assert (outer.lr_schedule, outer.lr_final_fraction, outer.lr_decay_start) == ("step", 0.65, 0.0)
    assert outer.horizon == 600 // 16  # derived from the overridden period, not the benchmark's 28
    assert parity.with_overrides(manifest, parity.parse_overrides(["outer.horizon_rounds=9"])).resolved_outer().horizon == 9


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("key, value, message", [
    ("momentum_warmup_rounds", -1, "outer.momentum_warmup_rounds = -1: must be >= 0"),
    ("momentum_decay_rounds", -2, "outer.momentum_decay_rounds = -2: must be >= 0"),
    ("momentum_final", 1.0, r"outer.momentum_final = 1.0: must be in \[0, 1\)"),
    ("momentum_final", -0.1, r"outer.momentum_final = -0.1: must be in \[0, 1\)"),
    ("lr_schedule", "exponential", "outer.lr_schedule = 'exponential': must be one of constant, linear, cosine, step"),
    ("lr_final_fraction", 1.5, r"outer.lr_final_fraction = 1.5: must be in \[0, 1\]"),
    ("lr_decay_start", 1.0, r"outer.lr_decay_start = 1.0: must be in \[0, 1\)"),
    ("horizon_rounds", -1, "outer.horizon_rounds = -1: must be >= 0"),
    ("momentum_warmup_rounds", 2.5, "outer.momentum_warmup_rounds = 2.5: must be an integer"),
    ("lr_schedule", 3, "outer.lr_schedule = 3: must be a string"),
])
def test_bad_values_are_config_errors_naming_the_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunManifest.from_dict({"outer": {key: value}})


def test_the_keys_are_node_config_keys_with_environment_variables() -> None:
    config = load_config(None, {"DILOCO_OUTER_LR_SCHEDULE": "cosine", "DILOCO_OUTER_MOMENTUM_WARMUP_ROUNDS": "5"},
                         {"run.outer.lr_final_fraction": "0.5", "run.outer.horizon_rounds": "40"})
    outer = config.run.outer
    assert (outer.lr_schedule, outer.momentum_warmup_rounds, outer.lr_final_fraction, outer.horizon) == ("cosine", 5, 0.5, 40)
    with pytest.raises(ConfigError, match=r"outer.lr_schedule = 'fast': must be one of .* from env:DILOCO_OUTER_LR_SCHEDULE"):
        load_config(None, {"DILOCO_OUTER_LR_SCHEDULE": "fast"}, {})
    with pytest.raises(ConfigError, match="run.outer.momentum_warmup_rounds = 'x' .*: must be an integer"):
        load_config(None, {"DILOCO_OUTER_MOMENTUM_WARMUP_ROUNDS": "x"}, {})


# ------------------------------------------------------------------ the global state steps with them


SCHEDULED = OuterOptimizer(lr=0.7, momentum=0.6, momentum_warmup_rounds=2, momentum_decay_rounds=2,
                           momentum_final=0.1, lr_schedule="linear", lr_final_fraction=0.5, horizon_rounds=5)


def _initial(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def _gradient(r: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + r)
    return {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}


def _state(outer: OuterOptimizer) -> GlobalState:
    return GlobalState(plan_fragments(SHAPES, 2, 4, 0), _initial(), outer)


def test_each_rounds_step_is_the_nesterov_step_with_that_rounds_values() -> None:
    state = _state(SCHEDULED)
    p = 1
    theta = state.fragment_params(p)
    buf = {n: np.zeros_like(a) for n, a in theta.items()}
    # By hand: warm-up 2 (momentum 0, 0.3, then 0.6), decay over rounds 4-5 to 0.1 (0.35, 0.1),
    # lr linear from 0.7 at round 1 to 0.35 at round 5 (0.7 x (1 - 0.5 x (r - 1) / 4)); then constant.
    by_hand = [(0.7, 0.0), (0.6125, 0.3), (0.525, 0.6), (0.4375, 0.35), (0.35, 0.1), (0.35, 0.1), (0.35, 0.1)]
    for r, (lr, mu) in enumerate(by_hand, start=1):
        assert np.float32(state.step_values(p)[0]) == np.float32(lr) and np.float32(state.step_values(p)[1]) == np.float32(mu)
        gradient = {n: g for n, g in _gradient(r).items() if n in theta}
        state.apply_outer_gradient(p, gradient)
        for name in theta:
            theta[name], buf[name] = nesterov_step(theta[name], buf[name], gradient[name], lr, mu)
        assert state.round(p) == r
        for name, got in state.fragment_params(p).items():
            assert got.tobytes() == theta[name].tobytes(), (r, name)
            assert state.momentum(p)[name].tobytes() == buf[name].tobytes(), (r, name)


def test_the_digest_preview_equals_the_apply_at_every_round_of_a_schedule() -> None:
    state = _state(SCHEDULED)
    for r in range(1, 9):
        for p in range(state.num_fragments):
            gradient = {n: g for n, g in _gradient(10 * r + p).items() if n in state.fragment_params(p)}
            preview = state.digest_after(p, gradient)
            assert state.apply_outer_gradient(p, gradient) == preview == state.fragment_digest(p), (r, p)


def test_replicas_agree_bit_for_bit_and_a_joiner_continues_the_schedule_from_its_round() -> None:
    a, b, constant = _state(SCHEDULED), _state(SCHEDULED), _state(OuterOptimizer(lr=0.7, momentum=0.6, momentum_warmup_rounds=0))
    joiner = _state(SCHEDULED)
    for r in range(1, 9):
        if r == 4:  # the joiner installs the state at round 3 and goes on from there
            for p in range(a.num_fragments):
                joiner.install_fragment(a.fragment_state(p), a.fragment_digest(p))
        for p in range(a.num_fragments):
            gradient = {n: g for n, g in _gradient(10 * r + p).items() if n in a.fragment_params(p)}
            for state in (a, b, constant) + ((joiner,) if r >= 4 else ()):
                state.apply_outer_gradient(p, gradient)
        assert a.digest() == b.digest()
        if r >= 4:
            assert joiner.digest() == a.digest()
    assert constant.digest() != a.digest()  # the schedule changed the steps


# ------------------------------------------------------------------ one source of defaults


def test_train_the_benchmark_and_the_daemon_start_from_the_same_defaults() -> None:
    from diloco_node.cli import train

    daemon = RunManifest()
    for steps in (128, 600):
        benchmark = train.default_manifest(steps)  # benchmarks/parity.py's benchmark_manifest
        assert benchmark.outer == daemon.outer and benchmark.sync == daemon.sync
        assert (benchmark.outer.lr, benchmark.outer.momentum, benchmark.sync.period) == (0.7, 0.6, 28)
    # What train changes is the run's length and a CPU-sized model and batch.
    assert train.default_manifest(64).sync == dataclasses.replace(daemon.sync, period=16)
    assert train.default_manifest(600).inner == dataclasses.replace(daemon.inner, batch_size=8, warmup_steps=200,
                                                                    total_steps=600)


def test_train_keep_unmerged_help_names_the_manifests_default() -> None:
    from diloco_node.cli import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser, "train")
    action = next(a for a in parser._actions if "--keep-unmerged" in a.option_strings)
    assert "off" in action.help and "on)" not in action.help
    assert SyncSpec().keep_unmerged is False
    assert train.build_manifest(parser.parse_args([])).sync.keep_unmerged is False
    assert train.build_manifest(parser.parse_args(["--keep-unmerged"])).sync.keep_unmerged is True
