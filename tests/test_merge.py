"""Merge math: RDA, weighted mean, token weights and caps, rebasing, validation reasons, Nesterov.

The golden trajectory test at the bottom replays a fixed-seed run of several rounds (merge +
Nesterov, stale rebases, rejected contributions) and compares it with
tests/fixtures/golden_merge.npz (arrays) and golden_merge.json (reasons, digests). After an
intended change of the math, regenerate them with

    DILOCO_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_merge.py -k golden

and review the diff of the JSON (reasons and weights) before committing. A second test replays the
same inputs through a plain float64 transcription of the method (docs/MERGE.md) and checks the fixture against it,
so a fixture regenerated from wrong math fails too.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_node.config.manifest import OuterOptimizer, SyncSpec
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.global_state import FragmentHistory, GlobalState
from diloco_node.sync.merge import (
    Contribution,
    ContributionCaps,
    NormReference,
    merge_contributions,
    rda,
    rebase,
    token_weight,
    weighted_mean,
)
from diloco_node.sync import merge as merge_module
from diloco_node.sync import outer as outer_module
from diloco_node.sync.outer import nesterov_step

CAPS = ContributionCaps(max_tokens_per_step=4096, max_steps=64)
FIXTURES = Path(__file__).parent / "fixtures"


# --- RDA and weighted mean ------------------------------------------------------------------

@pytest.mark.parametrize("num_vectors", [2, 4, 8, 16])
def test_rda_keeps_the_norm_that_a_plain_mean_shrinks_by_sqrt_m(num_vectors: int) -> None:
    rng = np.random.default_rng(num_vectors)
    dim, norm = 20_000, 3.7
    vectors = []
    for _ in range(num_vectors):
        v = rng.standard_normal(dim)
        vectors.append((norm * v / np.linalg.norm(v)).astype(np.float32))
    weights = [1.0] * num_vectors
    mean_norm = float(np.linalg.norm(weighted_mean(vectors, weights).astype(np.float64)))
    rda_norm = float(np.linalg.norm(rda(vectors, weights).astype(np.float64)))
    assert abs(mean_norm - norm / math.sqrt(num_vectors)) <= 0.10 * norm / math.sqrt(num_vectors)
    assert abs(rda_norm - norm) <= 1e-5 * norm


def test_rda_radius_is_the_weighted_mean_of_norms_and_direction_the_weighted_mean_of_units() -> None:
    a = np.array([3.0, 0.0], dtype=np.float32)
    b = np.array([0.0, 1.0], dtype=np.float32)
    out = rda([a, b], [3.0, 1.0])
    radius = (3 * 3.0 + 1 * 1.0) / 4
    direction = np.array([3.0, 1.0]) / 4
    expected = radius * direction / np.linalg.norm(direction)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert out.dtype == np.float32


def test_rda_of_one_vector_is_that_vector_exactly() -> None:
    v = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    assert np.array_equal(rda([v], [2.5]), v)
    # zero-weight companions do not count
    assert np.array_equal(rda([v, 100 * v + 1, -v], [1.0, 0.0, 0.0]), v)


def test_rda_edge_cases_zero_vectors_and_cancelling_directions() -> None:
    z = np.zeros(4, dtype=np.float32)
    v = np.array([1, 2, 3, 4], dtype=np.float32)
    assert np.array_equal(rda([z, z], [1, 1]), z)
    assert np.array_equal(rda([v, -v], [1, 1]), z)  # opposite directions: no direction to go
    out = rda([v, z], [1, 1])  # unit(0) = 0: the zero vector halves the radius, keeps the direction
    np.testing.assert_allclose(out, v / 2, rtol=1e-6)


@pytest.mark.parametrize(
    ("vectors", "weights", "message"),
    [
        ([], [], "no vectors"),
        ([np.ones(2)], [1.0, 2.0], "1 vectors but 2 weights"),
        ([np.ones(2), np.ones(2)], [0.0, 0.0], "weights sum to zero"),
        ([np.ones(2), np.ones(2)], [1.0, -1.0], "finite and >= 0"),
        ([np.ones(2), np.ones(2)], [1.0, float("nan")], "finite and >= 0"),
        ([np.ones(2), np.ones(3)], [1.0, 1.0], "different shapes"),
    ],
)
def test_rda_and_mean_refuse_bad_input(vectors, weights, message) -> None:
    for fn in (rda, weighted_mean):
        with pytest.raises(ValueError, match=message):
            fn(vectors, weights)


def test_weighted_mean() -> None:
    out = weighted_mean([np.array([1.0, 0.0]), np.array([0.0, 4.0])], [3.0, 1.0])
    np.testing.assert_allclose(out, [0.75, 1.0])
    assert out.dtype == np.float32


vector_sets = st.integers(2, 6).flatmap(
    lambda m: st.tuples(
        st.lists(st.lists(st.floats(-100, 100, allow_subnormal=False, width=32), min_size=5, max_size=5),
                 min_size=m, max_size=m),
        st.lists(st.floats(0.1, 10.0), min_size=m, max_size=m),
    )
)


@settings(max_examples=100, deadline=None)
@given(data=vector_sets, scale=st.floats(0.01, 100.0), weight_scale=st.floats(0.01, 100.0), seed=st.randoms(use_true_random=False))
def test_rda_invariances(data, scale, weight_scale, seed) -> None:
    raw, weights = data
    vectors = [np.array(v, dtype=np.float32) for v in raw]
    base = rda(vectors, weights).astype(np.float64)
    tol = 1e-4 * (max(float(np.abs(base).max()), 1e-3))
    # scaling every vector scales the result (radius is homogeneous, direction invariant)
    scaled = rda([scale * v for v in vectors], weights).astype(np.float64)
    np.testing.assert_allclose(scaled, scale * base, atol=scale * tol)
    # scaling every weight changes nothing
    np.testing.assert_allclose(rda(vectors, [weight_scale * w for w in weights]), base, atol=tol)
    # order of contributions changes nothing
    order = list(range(len(vectors)))
    seed.shuffle(order)
    np.testing.assert_allclose(rda([vectors[i] for i in order], [weights[i] for i in order]), base, atol=tol)
    # the radius is the weighted mean of norms unless the directions cancel
    norms = [float(np.linalg.norm(v.astype(np.float64))) for v in vectors]
    radius = sum(w * n for w, n in zip(weights, norms)) / sum(weights)
    out_norm = float(np.linalg.norm(base))
    assert out_norm == pytest.approx(radius, rel=1e-4, abs=1e-4) or out_norm == 0.0


# --- token weights and caps -----------------------------------------------------------------

def test_caps_from_the_run_manifest() -> None:
    caps = ContributionCaps.from_sync_spec(SyncSpec(max_tokens_per_step=512, max_steps_per_contribution=40))
    assert caps == ContributionCaps(max_tokens_per_step=512, max_steps=40)
    with pytest.raises(ValueError, match="caps must be >= 1"):
        ContributionCaps(0, 3)


def test_token_weight_is_tokens_times_tokens_per_step() -> None:
    assert token_weight(1000, 10, CAPS) == pytest.approx(1000 * 100)
    assert token_weight(0, 10, CAPS) == 0.0
    # fewer tokens per step (a slower or smaller-batch learner) weighs less than proportionally
    assert token_weight(500, 10, CAPS) == pytest.approx(token_weight(1000, 10, CAPS) / 4)


def test_inflated_claims_are_capped_at_an_honest_learner_at_the_caps() -> None:
    honest_max = token_weight(CAPS.max_tokens_per_step * CAPS.max_steps, CAPS.max_steps, CAPS)
    assert honest_max == pytest.approx(CAPS.max_tokens_per_step ** 2 * CAPS.max_steps)
    assert token_weight(10**12, 1, CAPS) == pytest.approx(CAPS.max_tokens_per_step ** 2)
    assert token_weight(10**15, 10**9, CAPS) == pytest.approx(honest_max)


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(0, 10**15), steps=st.integers(1, 10**9))
def test_no_claim_outweighs_an_honest_learner_at_the_caps(tokens: int, steps: int) -> None:
    w = token_weight(tokens, steps, CAPS)
    assert 0.0 <= w <= CAPS.max_tokens_per_step ** 2 * CAPS.max_steps * (1 + 1e-12)
    honest_steps = min(steps, CAPS.max_steps)
    honest_tokens = min(tokens / steps, CAPS.max_tokens_per_step) * honest_steps
    assert w == pytest.approx(honest_tokens ** 2 / honest_steps, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize(("tokens", "steps", "message"), [(100, 0, "c_steps = 0: no inner steps"), (-1, 3, "c_tokens = -1 is negative")])
def test_token_weight_refuses_counters_that_give_no_weight(tokens, steps, message) -> None:
    with pytest.raises(ValueError, match=message):
        token_weight(tokens, steps, CAPS)


# --- rebase ---------------------------------------------------------------------------------

def test_rebase_gives_the_outer_gradient_against_the_current_version() -> None:
    rng = np.random.default_rng(1)
    base = {"w": rng.standard_normal(6).astype(np.float32)}
    now = {"w": base["w"] + rng.standard_normal(6).astype(np.float32)}
    learner = {"w": base["w"] - 0.1 * rng.standard_normal(6).astype(np.float32)}
    delta = {"w": base["w"] - learner["w"]}
    out = rebase(delta, base, now)
    np.testing.assert_allclose(out["w"], now["w"] - learner["w"], atol=1e-6)
    assert out["w"].dtype == np.float32


# --- merge_contributions --------------------------------------------------------------------

SHAPES = {"embed/embedding": (8, 4), "blocks/0/w": (4, 4), "blocks/0/b": (4,)}
EMBEDDINGS = ["embed/embedding"]


def _history_with_rounds(rounds: int, capacity: int = 3, seed: int = 0) -> FragmentHistory:
    rng = np.random.default_rng(seed)
    history = FragmentHistory(fragment=0, capacity=capacity)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    for r in range(rounds + 1):
        history.record(r, params)
        params = {n: a + np.float32(0.01) * rng.standard_normal(a.shape).astype(np.float32) for n, a in params.items()}
    return history


def _delta(seed: int, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    return {n: (scale * rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}


def _contribution(learner: str, base_round: int = 5, seed: int = 0, steps: int = 10, tokens: int = 5000,
                  fragment: int = 0, delta=None, scale: float = 0.01) -> Contribution:
    return Contribution(learner, fragment, base_round, delta if delta is not None else _delta(seed, scale), steps, tokens)


def _merge(contributions, history=None, **kwargs):
    history = history or _history_with_rounds(5)
    current = dict(history.version(history.newest_round))
    kwargs.setdefault("caps", CAPS)
    kwargs.setdefault("embedding_names", EMBEDDINGS)
    return merge_contributions(contributions, current, history, **kwargs)


def _bad(name: str, fill: float) -> dict[str, np.ndarray]:
    d = _delta(9)
    d[name] = d[name].copy()
    d[name][0] = fill
    return d


REJECTION_CASES = [
    ("non-finite", _contribution("b", delta=_bad("blocks/0/w", np.nan)), "rejected learner b: non-finite values in blocks/0/w"),
    ("inf", _contribution("b", delta=_bad("embed/embedding", np.inf)), "rejected learner b: non-finite values in embed/embedding"),
    ("zero steps", _contribution("b", steps=0), "rejected learner b: c_steps = 0: no inner steps since its base"),
    ("negative tokens", _contribution("b", tokens=-5), "rejected learner b: c_tokens = -5 is negative"),
    ("zero tokens", _contribution("b", tokens=0), "rejected learner b: weight 0 (c_tokens = 0)"),
    ("wrong fragment", _contribution("b", fragment=3), "rejected learner b: contribution for fragment 3 in a round of fragment 0"),
    ("future base", _contribution("b", base_round=9), "rejected learner b: base round 9 is ahead of the current round 5"),
    ("negative base", _contribution("b", base_round=-1), "rejected learner b: base round -1 is negative"),
    ("evicted base", _contribution("b", base_round=2), "rejected learner b: base round 2 has been evicted (history keeps rounds 3..5)"),
    ("missing tensor", _contribution("b", delta={k: v for k, v in _delta(1).items() if k != "blocks/0/b"}),
     "rejected learner b: tensor names do not match the fragment: missing blocks/0/b"),
    ("extra tensor", _contribution("b", delta={**_delta(1), "x/y": np.zeros(2, np.float32)}),
     "rejected learner b: tensor names do not match the fragment: unexpected x/y"),
    ("wrong shape", _contribution("b", delta={**_delta(1), "blocks/0/b": np.zeros(5, np.float32)}),
     "rejected learner b: blocks/0/b has shape (5,), expected (4,)"),
    ("integer dtype", _contribution("b", delta={**_delta(1), "blocks/0/b": np.zeros(4, np.int32)}),
     "rejected learner b: blocks/0/b has dtype int32, expected float32"),
]


@pytest.mark.parametrize(("case", "bad", "reason"), REJECTION_CASES, ids=[c[0] for c in REJECTION_CASES])
def test_bad_contributions_are_rejected_with_a_reason_and_the_good_one_merged(case, bad, reason) -> None:
    good = _contribution("a", seed=1)
    result = _merge([bad, good])
    assert result.rejected == (("b", reason),)
    assert [learner for learner, _ in result.accepted] == ["a"]
    assert result.outer_gradient is not None
    # with one accepted contribution (against the current round) the outer gradient is its delta
    for name, arr in good.delta.items():
        assert np.array_equal(result.outer_gradient[name], arr)
    assert "merged 1 of 2 contribution(s) for fragment 0 at round 5" in result.reason
    assert result.reason.endswith("; rejected b")


def test_norm_outlier_against_the_round_median() -> None:
    contributions = [_contribution(n, seed=i) for i, n in enumerate("abc")] + [_contribution("d", seed=3, scale=0.5)]
    result = _merge(contributions)
    (learner, reason), = result.rejected
    assert learner == "d"
    median = result.round_median_norm
    d_norm = dict(result.delta_norms)["d"]
    assert reason == (f"rejected learner d: norm {d_norm:.3g} is {d_norm / median:.1f}x the round median "
                      f"{median:.3g} (limit 10x)")
    assert [n for n, _ in result.accepted] == ["a", "b", "c"]


def test_a_zero_round_median_rejects_nobody() -> None:
    zeros = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    contributions = [_contribution(n, delta=zeros) for n in "abc"] + [_contribution("d", seed=1)]
    result = _merge(contributions)
    assert result.rejected == () and result.round_median_norm == 0.0
    assert len(result.accepted) == 4


def test_norm_outlier_with_one_contribution_uses_the_running_reference() -> None:
    huge = _contribution("solo", scale=1.0)
    # without a reference one contribution cannot be judged: accepted
    assert _merge([huge]).rejected == ()
    result = _merge([huge], reference_norm=0.05)
    (learner, reason), = result.rejected
    n = dict(result.delta_norms)["solo"]
    assert reason == f"rejected learner solo: norm {n:.3g} is {n / 0.05:.1f}x the running reference 0.05 (limit 10x)"
    assert result.outer_gradient is None
    assert result.reason == "nothing to merge for fragment 0: all 1 contribution(s) rejected"
    # two contributions: the round median would be dragged along; the reference still catches it
    result = _merge([huge, _contribution("ok", seed=2)], reference_norm=0.05)
    assert [learner for learner, _ in result.rejected] == ["solo"]


def test_a_rejected_outlier_does_not_open_the_door_for_the_next_one() -> None:
    """K = 1 rounds often have one contribution, so the running reference is the only check."""
    diverged = _contribution("solo", scale=1.0)
    n = _norm_of(diverged)
    reference = NormReference()
    reference.update(0, n / 100)  # the honest scale of this fragment
    outcomes = []
    for _ in range(8):  # the learner keeps sending deltas 100x the honest scale, alone in its rounds
        result = _merge([diverged], reference_norm=reference.get(0))
        reference.update(0, result.round_median_norm)
        outcomes.append(result.rejected != ())
    # one round can at most triple the reference, so it takes several rounds of the same scale
    # before it counts as the new normal (a liveness choice, docs/MERGE.md), never the next round
    assert outcomes == [True, True, True, False, False, False, False, False]


def test_honest_norms_growing_2_5x_per_round_are_never_rejected() -> None:
    """The other side of the bound: the reference keeps up with fast but steady growth."""
    reference = NormReference()
    for r in range(12):
        scale = 0.001 * 2.5 ** r
        result = _merge([_contribution("solo", seed=r, scale=scale)], reference_norm=reference.get(0))
        assert result.rejected == (), f"round {r}: {result.rejected}"
        reference.update(0, result.round_median_norm)


def _norm_of(c: Contribution) -> float:
    return math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in c.delta.values()))


def test_norm_reference_follows_round_medians_and_survives_snapshots() -> None:
    ref = NormReference(alpha=0.5)
    assert ref.get(0) is None
    assert ref.update(0, 2.0) == 2.0
    assert ref.update(0, 4.0) == 3.0
    assert ref.update(0, None) == 3.0
    assert ref.update(0, float("nan")) == 3.0
    other = NormReference(alpha=0.5)
    other.restore(ref.snapshot())
    assert other.get(0) == 3.0 and other.get(1) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_norm_reference_refuses_a_restored_value_that_would_disable_the_check(bad) -> None:
    # a NaN reference turns every later EMA update into NaN: the outlier check would be off for good
    ref = NormReference()
    ref.restore({0: 2.0})
    with pytest.raises(ValueError, match=f"reference norm of fragment 1 = {bad!r} must be finite and >= 0"):
        ref.restore({0: 5.0, 1: bad})
    assert ref.snapshot() == {0: 2.0}  # nothing changed


def test_stale_contributions_are_rebased_before_merging() -> None:
    history = _history_with_rounds(5)
    current = history.version(5)
    base = history.version(4)
    stale = _contribution("old", base_round=4, seed=1)
    result = _merge([stale], history=history)
    for name in SHAPES:
        expected = (current[name] - base[name]) + stale.delta[name]
        np.testing.assert_array_equal(result.outer_gradient[name], expected)
    assert "1 rebased from older rounds" in result.reason


def test_capped_claims_are_accepted_at_reduced_weight_and_reported() -> None:
    greedy = _contribution("greedy", steps=10**6, tokens=10**12, seed=1)
    honest = _contribution("honest", steps=CAPS.max_steps, tokens=CAPS.max_steps * CAPS.max_tokens_per_step, seed=2)
    result = _merge([greedy, honest])
    weights = dict(result.accepted)
    assert weights["greedy"] == pytest.approx(weights["honest"])
    assert result.capped == (("greedy", f"c_steps 1000000 capped at {CAPS.max_steps}; tokens/step 1e+06 capped at 4096"),)
    assert result.reason.endswith("; capped greedy")


def test_duplicate_learner_keeps_the_first_and_rejects_the_second() -> None:
    result = _merge([_contribution("a", seed=1), _contribution("a", seed=2)])
    assert result.rejected == (("a", "rejected learner a: duplicate contribution in this round"),)
    assert np.array_equal(result.outer_gradient["blocks/0/w"], _delta(1)["blocks/0/w"])


def test_embeddings_use_the_weighted_mean_and_other_tensors_rda() -> None:
    a, b = _contribution("a", seed=1, tokens=1000), _contribution("b", seed=2, tokens=3000)
    result = _merge([a, b])
    wa, wb = token_weight(1000, 10, CAPS), token_weight(3000, 10, CAPS)
    assert dict(result.accepted) == {"a": wa, "b": wb}
    np.testing.assert_array_equal(result.outer_gradient["embed/embedding"],
                                  weighted_mean([a.delta["embed/embedding"], b.delta["embed/embedding"]], [wa, wb]))
    np.testing.assert_array_equal(result.outer_gradient["blocks/0/w"],
                                  rda([a.delta["blocks/0/w"], b.delta["blocks/0/w"]], [wa, wb]))
    mean = _merge([a, b], method="mean", weighting="uniform")
    np.testing.assert_array_equal(mean.outer_gradient["blocks/0/w"],
                                  weighted_mean([a.delta["blocks/0/w"], b.delta["blocks/0/w"]], [1, 1]))
    assert "(mean, uniform weights)" in mean.reason


def test_result_does_not_depend_on_arrival_order() -> None:
    cs = [_contribution(n, seed=i, tokens=1000 * (i + 1)) for i, n in enumerate("dcba")]
    first, second = _merge(cs), _merge(list(reversed(cs)))
    assert first.accepted == second.accepted
    for name in SHAPES:
        assert np.array_equal(first.outer_gradient[name], second.outer_gradient[name])


def test_a_rebase_that_overflows_float32_is_rejected() -> None:
    history = FragmentHistory(fragment=0, capacity=3)
    big = {n: np.full(s, -3e38, np.float32) for n, s in SHAPES.items()}
    history.record(0, big)
    history.record(1, {n: -a for n, a in big.items()})  # the global fragment moved by 6e38 > float32 max
    current = dict(history.version(1))
    result = merge_contributions([_contribution("b", base_round=0), _contribution("a", base_round=1, seed=1)],
                                 current, history, caps=CAPS, embedding_names=EMBEDDINGS)
    assert result.rejected == (("b", "rejected learner b: non-finite values after rebasing from round 0"),)
    assert [learner for learner, _ in result.accepted] == ["a"]


def test_uniform_weighting_still_refuses_a_contribution_without_steps() -> None:
    result = _merge([_contribution("b", steps=0), _contribution("a", seed=1, tokens=0)], weighting="uniform")
    assert result.rejected == (("b", "rejected learner b: c_steps = 0: no inner steps since its base"),)
    assert result.accepted == (("a", 1.0),)  # tokens do not matter with uniform weights


def test_no_contributions_and_bad_options() -> None:
    assert _merge([]).reason == "nothing to merge for fragment 0: no contributions"
    with pytest.raises(ValueError, match="merge method 'median'"):
        _merge([], method="median")
    with pytest.raises(ValueError, match="weighting 'steps'"):
        _merge([], weighting="steps")
    with pytest.raises(ValueError, match="norm_outlier_factor = 1 must be > 1"):
        _merge([], norm_outlier_factor=1)
    with pytest.raises(TypeError, match="c_steps must be an integer"):
        Contribution("a", 0, 0, {}, 1.5, 3)  # type: ignore[arg-type]


# --- Nesterov -------------------------------------------------------------------------------

def test_nesterov_first_step_and_momentum() -> None:
    theta = np.array([1.0, -2.0], dtype=np.float32)
    grad = np.array([0.5, 0.25], dtype=np.float32)
    t1, b1 = nesterov_step(theta, np.zeros(2, np.float32), grad, lr=0.7, momentum=0.9)
    np.testing.assert_allclose(b1, grad)
    np.testing.assert_allclose(t1, theta - 0.7 * (1 + 0.9) * grad, rtol=1e-6)
    t2, b2 = nesterov_step(t1, b1, grad, lr=0.7, momentum=0.9)
    np.testing.assert_allclose(b2, 1.9 * grad, rtol=1e-6)
    np.testing.assert_allclose(t2, t1 - 0.7 * (grad + 0.9 * 1.9 * grad), rtol=1e-6)
    assert t2.dtype == b2.dtype == np.float32


def test_nesterov_is_bit_deterministic_and_refuses_shape_mismatch() -> None:
    rng = np.random.default_rng(3)
    theta, buf, grad = (rng.standard_normal(1000).astype(np.float32) for _ in range(3))
    a = nesterov_step(theta, buf, grad, 0.4, 0.9)
    b = nesterov_step(theta.copy(), buf.copy(), grad.copy(), 0.4, 0.9)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    with pytest.raises(ValueError, match="shapes differ"):
        nesterov_step(theta, buf[:3], grad, 0.4, 0.9)


# --- golden trajectory ----------------------------------------------------------------------

GOLDEN_SHAPES = {
    "embed/embedding": (32, 8),
    "blocks/0/attn/kernel": (8, 24),
    "blocks/0/mlp/kernel": (8, 32),
    "blocks/0/norm/scale": (8,),
    "head/kernel": (8, 32),
}


GOLDEN_SEED = 2024
GOLDEN_LEARNERS = ("a", "b", "c", "d")
GOLDEN_OUTER = OuterOptimizer(lr=0.7, momentum=0.9, momentum_warmup_rounds=0)  # the golden bits: a constant step
GOLDEN_CAPS = ContributionCaps(max_tokens_per_step=2048, max_steps=12)


def _golden_contributions(rng: np.random.Generator, plan, step: int, p: int, now_round: int) -> list[Contribution]:
    """One round's inputs, drawn from `rng` in a fixed order (shared with the reference replay)."""
    contributions = []
    for i, learner in enumerate(GOLDEN_LEARNERS):
        lag = (i + step) % 3  # learners b/c/d are sometimes one or two rounds behind
        base_round = max(0, now_round - lag)
        scale = 0.02 * (1 + i)
        delta = {n: (scale * rng.standard_normal(GOLDEN_SHAPES[n])).astype(np.float32)
                 for n in plan.fragments[p].names}
        steps, tokens = 6 + i, (6 + i) * 1024 * (1 + i % 2)
        if (step, p, learner) == (1, 0, "b"):
            first = sorted(delta)[0]
            delta[first][(0,) * delta[first].ndim] = np.nan
        if (step, p, learner) == (2, 1, "c"):
            delta = {n: 50 * a for n, a in delta.items()}
        if (step, p, learner) == (3, 2, "d"):
            tokens = 10**9
        if (step, p, learner) == (4, 0, "a"):
            base_round = 0  # at round 4 with history_len 3 only rounds 2..4 are kept
        contributions.append(Contribution(learner, p, base_round, delta, steps, tokens))
    return contributions


def _golden_trajectory() -> tuple[dict[str, np.ndarray], dict]:
    """Six rounds per fragment over 3 fragments, 4 learners: stale bases, a NaN, an outlier, an
    evicted base, an inflated claim. Returns the arrays and a JSON-able record of every round."""
    rng = np.random.default_rng(GOLDEN_SEED)
    plan = plan_fragments(GOLDEN_SHAPES, num_fragments=3, period=6, overlap=1)
    init = {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in GOLDEN_SHAPES.items()}
    state = GlobalState(plan, init, GOLDEN_OUTER, history_len=3)
    reference = NormReference()
    caps = GOLDEN_CAPS
    embedding_names = [n for n in GOLDEN_SHAPES if n.startswith("embed")]
    arrays: dict[str, np.ndarray] = {}
    record: dict = {"rounds": []}
    for step in range(6):
        for p in range(plan.num_fragments):
            current = state.fragment_params(p)
            contributions = _golden_contributions(rng, plan, step, p, state.round(p))
            result = merge_contributions(contributions, current, state.history(p), caps=caps,
                                         embedding_names=embedding_names, reference_norm=reference.get(p))
            reference.update(p, result.round_median_norm)
            digest = state.apply_outer_gradient(p, result.outer_gradient)
            key = f"s{step}_p{p}"
            for name, arr in result.outer_gradient.items():
                arrays[f"{key}/grad/{name}"] = arr
            record["rounds"].append({"step": step, "fragment": p, "reason": result.reason,
                                     "rejected": [list(x) for x in result.rejected],
                                     "accepted": [[n, w] for n, w in result.accepted], "digest": digest})
    for name, arr in state.all_params().items():
        arrays[f"final/params/{name}"] = arr
    record["final_digest"] = state.digest()
    return arrays, record


def test_golden_trajectory() -> None:
    arrays, record = _golden_trajectory()
    npz_path, json_path = FIXTURES / "golden_merge.npz", FIXTURES / "golden_merge.json"
    if os.environ.get("DILOCO_REGEN_GOLDEN") == "1":
        FIXTURES.mkdir(parents=True, exist_ok=True)
        np.savez(npz_path, **arrays)
        json_path.write_text(json.dumps(record, indent=1) + "\n")
    golden = np.load(npz_path)
    expected = json.loads(json_path.read_text())
    assert sorted(golden.files) == sorted(arrays)
    for name in golden.files:
        # the merge is deterministic (numpy reductions, no BLAS), so this is exact in practice;
        # the small tolerance only keeps the array diff readable when the math really changed
        np.testing.assert_allclose(arrays[name], golden[name], rtol=1e-6, atol=1e-7, err_msg=name)
    reasons = [(r["step"], r["fragment"], r["reason"], r["rejected"]) for r in record["rounds"]]
    assert reasons == [(r["step"], r["fragment"], r["reason"], r["rejected"]) for r in expected["rounds"]]
    for got, want in zip(record["rounds"], expected["rounds"]):
        assert [n for n, _ in got["accepted"]] == [n for n, _ in want["accepted"]]
        assert [w for _, w in got["accepted"]] == pytest.approx([w for _, w in want["accepted"]], rel=1e-12)
    # the trajectory exercises what it claims to
    rejected = " | ".join(reason for r in record["rounds"] for _, reason in r["rejected"])
    assert "non-finite values" in rejected and "x the " in rejected and "has been evicted" in rejected
    assert any("rebased from older rounds" in r["reason"] for r in record["rounds"])
    assert any("capped d" in r["reason"] for r in record["rounds"])
    if record["final_digest"] != expected["final_digest"]:
        pytest.fail("arrays match within tolerance but the state digest differs: the trajectory is "
                    "no longer bit-identical; regenerate only after checking why (see module docstring)")


# --- counters and tensors straight from the network -------------------------------------------

def test_counters_beyond_the_float_range_are_capped_not_a_crash() -> None:
    # c_tokens / c_steps would overflow a float; the claim is simply capped like any inflated one
    assert token_weight(10**400, 1, CAPS) == CAPS.max_tokens_per_step ** 2
    result = _merge([_contribution("b", steps=1, tokens=10**400), _contribution("a", seed=1)])
    assert result.rejected == ()
    assert dict(result.accepted)["b"] == CAPS.max_tokens_per_step ** 2
    assert dict(result.capped)["b"] == "tokens/step > 1.8e+308 capped at 4096"


def test_numpy_integer_counters_are_exact_python_ints() -> None:
    # int64 arithmetic would wrap (max_tokens_per_step * c_steps) and misreport the cap
    c = _contribution("b", steps=np.int64(2**62), tokens=np.int64(2**62))
    assert type(c.c_steps) is int and type(c.c_tokens) is int
    result = _merge([c])
    assert result.capped == (("b", f"c_steps {2**62} capped at {CAPS.max_steps}"),)


@pytest.mark.parametrize(
    ("delta", "reason"),
    [
        ({**_delta(1), "blocks/0/b": [[1.0], [1.0, 2.0]]}, "blocks/0/b is not a numeric array"),
        ({**_delta(1), "blocks/0/b": np.full(4, 1e300)}, "blocks/0/b has values beyond the float32 range"),
        ({**_delta(1), 7: np.zeros(4, np.float32), "z": np.zeros(1, np.float32)},
         "tensor names do not match the fragment: unexpected 7, z"),
    ],
    ids=["ragged", "float64 overflow", "non-string name"],
)
def test_malformed_tensors_are_rejections_not_exceptions(delta, reason) -> None:
    with np.errstate(all="raise"):  # no silent overflow on the way to the reason either
        result = _merge([_contribution("b", delta=delta), _contribution("a", seed=1)])
    assert result.rejected == (("b", f"rejected learner b: {reason}"),)
    assert [learner for learner, _ in result.accepted] == ["a"]


def test_a_delta_that_is_not_a_mapping_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match="Contribution.delta must be a mapping"):
        Contribution("a", 0, 0, [np.zeros(2)], 1, 3)  # type: ignore[arg-type]


def _reference_replay(accepted_per_round: list[list[str]]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[list[float]]]:
    """The method (as docs/MERGE.md states it) in plain float64, independent of merge.py and global_state.py:
    Delta_m = (Theta_now - Theta_base) + delta; w = c_tokens^2 / c_steps after the caps; RDA, or the
    weighted mean for embeddings; b <- mu b + Delta, Theta <- Theta - lr (Delta + mu b). It is fed
    the golden run's inputs and, round by round, the learners the golden run accepted (which
    contributions to reject is policy, tested above; this checks the arithmetic)."""
    rng = np.random.default_rng(GOLDEN_SEED)
    plan = plan_fragments(GOLDEN_SHAPES, num_fragments=3, period=6, overlap=1)
    theta = {n: (0.1 * rng.standard_normal(s)).astype(np.float32).astype(np.float64) for n, s in GOLDEN_SHAPES.items()}
    init = {n: a.copy() for n, a in theta.items()}
    momentum = {n: np.zeros_like(a) for n, a in theta.items()}
    versions = {p: [{n: theta[n].copy() for n in f.names}] for p, f in enumerate(plan.fragments)}  # by round
    weights_per_round: list[list[float]] = []
    rounds = iter(accepted_per_round)
    for step in range(6):
        for p, fragment in enumerate(plan.fragments):
            contributions = _golden_contributions(rng, plan, step, p, len(versions[p]) - 1)
            accepted_names = next(rounds)
            accepted = [c for c in contributions if c.learner in accepted_names]
            weights = []
            for c in accepted:
                tokens_per_step = min(c.c_tokens / c.c_steps, GOLDEN_CAPS.max_tokens_per_step)
                steps = min(c.c_steps, GOLDEN_CAPS.max_steps)
                tokens = tokens_per_step * steps
                weights.append(tokens * tokens / steps)
            weights_per_round.append(weights)
            w = np.array(weights)
            for name in fragment.names:
                base = [versions[p][c.base_round][name] for c in accepted]
                outer = [(theta[name] - b) + c.delta[name].astype(np.float64) for c, b in zip(accepted, base)]
                if name.startswith("embed"):
                    delta = sum(wi * v for wi, v in zip(w, outer)) / w.sum()
                else:
                    norms = [np.sqrt(np.sum(v * v)) for v in outer]
                    radius = sum(wi * n for wi, n in zip(w, norms)) / w.sum()
                    direction = sum(wi * v / n for wi, v, n in zip(w, outer, norms)) / w.sum()
                    delta = radius * direction / np.sqrt(np.sum(direction * direction))
                momentum[name] = GOLDEN_OUTER.momentum * momentum[name] + delta
                theta[name] = theta[name] - GOLDEN_OUTER.lr * (delta + GOLDEN_OUTER.momentum * momentum[name])
            versions[p].append({n: theta[n].copy() for n in fragment.names})
    return init, theta, weights_per_round


def test_golden_fixture_agrees_with_a_plain_float64_reference_of_the_algorithm() -> None:
    """Guards the fixture itself: regenerating it from wrong math would fail here."""
    golden = np.load(FIXTURES / "golden_merge.npz")
    expected = json.loads((FIXTURES / "golden_merge.json").read_text())
    accepted = [[learner for learner, _ in r["accepted"]] for r in expected["rounds"]]
    assert all(accepted) and any(len(a) < len(GOLDEN_LEARNERS) for a in accepted)
    init, theta, weights = _reference_replay(accepted)
    for got, want in zip(weights, expected["rounds"]):
        assert got == pytest.approx([w for _, w in want["accepted"]], rel=1e-12)
    for name, arr in theta.items():
        final = golden[f"final/params/{name}"].astype(np.float64)
        error = np.abs(final - arr).max()
        assert error <= 1e-6, f"{name}: golden fixture is {error:.2g} away from the reference"
        # the outer steps moved every tensor by far more than that tolerance: the check has teeth
        assert np.abs(final - init[name]).max() > 1e-2, name


def _full(shape, fill, dtype):
    with np.errstate(all="ignore"):  # NaN or 1e300 into an integer or float16 array is part of the garbage
        return np.full(shape, fill, dtype=dtype)


_garbage_arrays = st.one_of(
    st.builds(_full, st.sampled_from([(8, 4), (4, 4), (4,), (5,), (), (0,)]),
              st.sampled_from([0.0, -1e-3, 1.0, 3.4e38, np.nan, np.inf, 1e300, 5]),
              st.sampled_from([np.float32, np.float64, np.float16, np.int32, np.complex64, object])),
    st.sampled_from([[[1.0], [1.0, 2.0]], "abc", None, [1, 2, 3, 4]]),
)
_garbage_ints = st.sampled_from([0, 1, 10, -1, 2**63 - 1, 10**30, 10**400, -(10**400)])
# Mostly well-formed deltas with a few tensors replaced or added, so garbage reaches every check.
_garbage_deltas = st.builds(
    lambda seed, replaced: {**_delta(seed), **replaced},
    st.integers(0, 3),
    st.dictionaries(st.sampled_from([*SHAPES, "x"]), _garbage_arrays, max_size=2),
)


@settings(max_examples=100, deadline=None)
@given(
    garbage=st.lists(st.tuples(st.sampled_from("bcd"), st.sampled_from([0, 0, 0, 1, -1]),
                               st.sampled_from([5, 5, 4, 0, -1, 9, 2**63 - 1, 10**400]),
                               _garbage_deltas, _garbage_ints, _garbage_ints), max_size=4),
)
def test_any_peer_garbage_gives_a_result_never_an_exception(garbage) -> None:
    contributions = [Contribution(*fields) for fields in garbage] + [_contribution("a", seed=1)]
    with np.errstate(all="raise"):  # not even a silent overflow on the way
        result = _merge(contributions)
    assert len(result.accepted) + len(result.rejected) == len(contributions)
    assert all(reason.startswith(f"rejected learner {learner}: ") for learner, reason in result.rejected)
    if "a" in dict(result.accepted):
        for name, shape in SHAPES.items():
            merged = result.outer_gradient[name]
            assert merged.shape == shape and merged.dtype == np.float32 and np.all(np.isfinite(merged))
    else:  # only as a norm outlier against tiny but well-formed garbage deltas
        assert "x the round median" in dict(result.rejected)["a"]


# ------------------------------------------------------------------ contributions kept encoded


def _encoded(delta: dict[str, np.ndarray], max_chunk_elements: int = 1 << 22, codec: str = "int8"):
    """What the lease holder keeps of a streamed contribution (wire 2.1): its chunks, encoded."""
    from wire.contribution_stream import ContributionAssembler, contribution_chunks, open_for
    from wire.limits import Limits

    limits = Limits(max_chunk_elements=max_chunk_elements)
    shapes = {n: a.shape for n, a in delta.items()}
    head = open_for(shapes, fragment=0, base_index=0, base_round=0, c_steps=1, c_tokens=1, codec=codec,
                    learner_id="x", stream=bytes(16), limits=limits)
    assembler = ContributionAssembler(head, shapes, limits)
    for chunk in contribution_chunks(head, delta):
        assembler.add(chunk)
    return assembler.finish()


def test_encoded_contributions_merge_to_the_same_bits_as_their_decoded_values() -> None:
    encoded = {name: _encoded(_delta(seed)) for seed, name in enumerate("abcd")}
    decoded = {name: {n: e[n] for n in e} for name, e in encoded.items()}
    bases = {"a": 5, "b": 5, "c": 4, "d": 3}  # two stale ones: rebased tensor by tensor
    for method in ("rda", "mean"):
        kept = _merge([_contribution(n, bases[n], delta=encoded[n]) for n in "abcd"], method=method)
        plain = _merge([_contribution(n, bases[n], delta=decoded[n]) for n in "abcd"], method=method)
        assert kept.reason == plain.reason and kept.delta_norms == plain.delta_norms
        assert kept.outer_gradient is not None and plain.outer_gradient is not None
        for name in SHAPES:
            assert kept.outer_gradient[name].tobytes() == plain.outer_gradient[name].tobytes()
    # a norm outlier is judged on the norms measured on arrival, with the same reason
    loud = _encoded(_delta(7, scale=1.0))
    result = _merge([_contribution(n, delta=encoded[n]) for n in "abc"] + [_contribution("z", delta=loud)])
    plain = _merge([_contribution(n, delta=decoded[n]) for n in "abc"] + [_contribution("z", delta=dict(loud))])
    assert [learner for learner, _ in result.rejected] == ["z"] and "x the round median" in result.rejected[0][1]
    assert result.rejected == plain.rejected


def test_a_tensor_cut_into_chunks_has_the_norm_of_its_values() -> None:
    rng = np.random.default_rng(3)
    delta = {"w": rng.standard_normal((40, 50)).astype(np.float32), "b": rng.standard_normal(300).astype(np.float32)}
    whole, chunked = _encoded(delta), _encoded(delta, max_chunk_elements=300)  # 256 values: two int8 blocks
    for name in delta:
        assert np.array_equal(whole[name], chunked[name])  # chunks are whole blocks: same quantization
        assert chunked.tensor_norms[name] == pytest.approx(whole.tensor_norms[name], rel=1e-12)


def test_the_merge_holds_one_fragment_of_fp32_not_one_per_contribution() -> None:
    import tracemalloc

    shapes = {f"blocks/{i}/w": (512, 512) for i in range(8)}  # 2M parameters, 8 MiB of fp32
    fragment_bytes = sum(4 * math.prod(s) for s in shapes.values())
    rng = np.random.default_rng(0)
    current = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    history = FragmentHistory(fragment=0, capacity=2)
    history.record(0, current)
    contributions = []
    for k in range(8):
        delta = {n: (0.01 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}
        contributions.append(Contribution(f"l{k}", 0, 0, _encoded(delta), 10, 5000))
        del delta
    tracemalloc.start()
    try:
        result = merge_contributions(contributions, current, history, caps=CAPS, embedding_names=[])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.outer_gradient is not None and len(result.accepted) == 8
    # the result (1x), one tensor's float64 accumulator and the vector in hand: far below K = 8 copies
    assert peak < 2 * fragment_bytes, f"peak {peak / fragment_bytes:.2f} x the fragment's fp32"


# --- chunked arithmetic: the same bits as the whole-array expressions -------------------------


def _whole_norm64(x: np.ndarray) -> float:
    """The norm as the merge computed it on whole arrays (a float64 copy and its squares)."""
    flat = np.asarray(x, dtype=np.float64).ravel()
    return math.sqrt(float(np.add.reduce(flat * flat)))


def _whole_rda(vectors: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """RDA as whole-array numpy expressions (fragment-sized float64 temporaries)."""
    w = np.asarray(weights, dtype=np.float64)
    radius, direction = 0.0, np.zeros(vectors[0].shape, dtype=np.float64)
    for wi, v in zip(w, vectors):
        v64 = np.array(v, dtype=np.float64)
        n = _whole_norm64(v64)
        radius += wi * n
        if n > 0.0:
            direction += v64 * (wi / n)
    radius /= float(w.sum())
    direction /= float(w.sum())
    return (direction * (radius / _whole_norm64(direction))).astype(np.float32)


@pytest.mark.parametrize("size", [0, 1, 7, 127, 128, 129, 1000, (1 << 16) - 1, 1 << 16, (1 << 16) + 1,
                                  3 * (1 << 16) + 5, 1_000_003])
def test_chunked_norm_is_the_whole_array_norm(size: int) -> None:
    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * np.exp(3 * rng.standard_normal(size))).astype(np.float32)
    assert merge_module._norm64(x) == _whole_norm64(x)


def test_chunked_rda_mean_and_rebase_are_the_whole_array_bits() -> None:
    # 300,001 values: several chunks and a ragged last one; three vectors of different scales
    rng = np.random.default_rng(7)
    shape = (300_001,)
    vectors = [(s * rng.standard_normal(shape)).astype(np.float32) for s in (0.01, 0.02, 0.5)]
    weights = [1.0, 3.5, 0.25]
    assert rda(vectors, weights).tobytes() == _whole_rda(vectors, weights).tobytes()
    w = np.asarray(weights)
    mean = (sum(np.asarray(v, np.float64) * wi for v, wi in zip(vectors, w)) / w.sum()).astype(np.float32)
    assert weighted_mean(vectors, weights).tobytes() == mean.tobytes()
    now, base = {"t": vectors[0]}, {"t": vectors[1]}
    expected = np.add(np.subtract(vectors[0], vectors[1], dtype=np.float32), vectors[2], dtype=np.float32)
    assert rebase({"t": vectors[2]}, base, now)["t"].tobytes() == expected.tobytes()


def test_golden_trajectory_is_the_same_bits_with_the_smallest_chunks(monkeypatch) -> None:
    # Chunks of 128 (the smallest numpy's pairwise split allows) cut every golden tensor; the
    # trajectory (merged gradients, applied steps, digests) must not change by a bit.
    default_arrays, default_record = _golden_trajectory()
    monkeypatch.setattr(merge_module, "CHUNK_ELEMENTS", 128)
    monkeypatch.setattr(merge_module, "MERGE_BLOCK_ELEMENTS", 200)  # blocks cut across the norm's leaves
    monkeypatch.setattr(outer_module, "STEP_CHUNK_ELEMENTS", 128)
    arrays, record = _golden_trajectory()
    assert record == default_record
    assert record["final_digest"] == json.loads((FIXTURES / "golden_merge.json").read_text())["final_digest"]
    for name, arr in default_arrays.items():
        assert arrays[name].tobytes() == arr.tobytes(), name


def test_a_round_that_moved_together_is_judged_by_its_median_not_the_lagging_reference() -> None:
    """Muon's first rounds: every learner's delta 20x the running reference at once. That is a
    change of scale (the round's own median shows it), not four outliers: all accepted."""
    honest = [_contribution(n, seed=i, scale=1.0) for i, n in enumerate("abcd")]
    reference = _norm_of(honest[0]) / 20
    result = _merge(honest, reference_norm=reference)
    assert result.rejected == () and len(result.accepted) == 4
    # A lone outlier in such a round is still caught by the round median.
    result = _merge(honest[:3] + [_contribution("x", seed=9, scale=1e6)], reference_norm=reference)
    assert [learner for learner, _ in result.rejected] == ["x"]


def test_two_colluding_outliers_of_four_cannot_lift_the_reference_check() -> None:
    """The lower middle norm decides whether the scale changed: with two honest learners at the
    reference's scale and two at 1e6x, it is an honest norm, so the reference still applies."""
    honest = [_contribution(n, seed=i, scale=0.001) for i, n in enumerate("ab")]
    liars = [_contribution(n, seed=5 + i, scale=1e3) for i, n in enumerate("yz")]
    result = _merge(honest + liars, reference_norm=_norm_of(honest[0]))
    assert sorted(learner for learner, _ in result.rejected) == ["y", "z"]
    assert [n for n, _ in result.accepted] == ["a", "b"]


def _whole_support_mean(vectors: list[np.ndarray], weights: list[float]) -> np.ndarray:
    acc = np.zeros(vectors[0].shape, dtype=np.float64)
    support = np.zeros(vectors[0].shape, dtype=np.float64)
    for v, w in zip(vectors, weights):
        acc += np.asarray(v, np.float64) * w
        support += np.where(v != 0, w, 0.0)
    np.divide(acc, support, out=acc, where=support > 0)
    return acc.astype(np.float32)


def _whole_merge(result, contributions, current, history, method: str) -> dict[str, np.ndarray]:
    """The merge of the accepted contributions as whole-array expressions: each delta decoded
    whole, rebased whole, and folded with fragment-sized float64 arrays (the merge before it
    went block by block across contributions)."""
    by_name = {c.learner: c for c in contributions}
    accepted = [(by_name[learner], w) for learner, w in result.accepted]
    out = {}
    for name in sorted(current):
        vectors = []
        for c, _ in accepted:
            d = np.asarray(c.delta[name], dtype=np.float32)
            if c.base_round != history.newest_round:
                d = rebase({name: d}, history.version(c.base_round), current)[name]
            vectors.append(d)
        weights = [w for _, w in accepted]
        if method == "support_mean":
            out[name] = _whole_support_mean(vectors, weights)
        elif method == "rda" and name not in EMBEDDINGS:  # RDA of one vector is that vector, exactly
            out[name] = vectors[0] if len(vectors) == 1 else _whole_rda(vectors, weights)
        else:
            w = np.asarray(weights)
            out[name] = (sum(np.asarray(v, np.float64) * wi for v, wi in zip(vectors, w)) / w.sum()).astype(np.float32)
    return out


@pytest.mark.parametrize("codec", [None, "fp32", "bf16", "int8", "int4", "e3m0", "topk2", "union8"])
def test_the_merge_block_by_block_is_the_whole_array_merge_for_every_codec(monkeypatch, codec) -> None:
    """Random rounds (stale contributions rebased, sparse values, 1 to 5 learners), every merge
    method and weighting, contributions kept encoded with every codec (None: plain arrays), blocks
    and streamed chunks that cut tensors anywhere: the same bits as the whole-array merge."""
    rng = np.random.default_rng(sum(map(ord, codec or "plain")))
    shapes = {"embed/embedding": (97, 33), "blocks/0/w": (1001,), "blocks/0/b": (3,), "blocks/0/z": (0,)}
    current = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    history = FragmentHistory(fragment=0, capacity=4)
    history.record(0, current)
    for r in (1, 2):
        current = {n: (a + 0.01 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in current.items()}
        history.record(r, current)
    monkeypatch.setattr(merge_module, "CHUNK_ELEMENTS", 128)
    # blocks that cut every tensor; and (plain arrays, int4: the default codec) one block per tensor
    for block in (200, 4096) if codec in (None, "int4") else (200,):
        monkeypatch.setattr(merge_module, "MERGE_BLOCK_ELEMENTS", block)
        contributions = []
        for k in range(int(rng.integers(1, 6))):
            delta = {n: (0.01 * rng.standard_normal(s) * (rng.random(s) < 0.7)).astype(np.float32)
                     for n, s in shapes.items()}
            if codec is not None:
                delta = _encoded(delta, int(rng.choice([128, 320, 4096])), codec)
            contributions.append(Contribution(f"l{k}", 0, int(rng.integers(0, 3)), delta,
                                              int(rng.integers(1, 20)), int(rng.integers(1, 5000))))
        for method in ("rda", "mean", "support_mean"):
            for weighting in ("tokens", "uniform"):
                result = merge_contributions(contributions, current, history, method=method, weighting=weighting,
                                             caps=CAPS, embedding_names=EMBEDDINGS)
                assert result.outer_gradient is not None, result.reason
                expected = _whole_merge(result, contributions, current, history, method)
                for name in shapes:
                    assert result.outer_gradient[name].tobytes() == expected[name].tobytes(), (block, method, name)
