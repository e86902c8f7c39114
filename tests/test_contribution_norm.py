"""Median-norm scaling (`sync.contribution_norm = "median"`): the factors, and the merge that uses
them (each outer gradient brought to the median norm of the round's accepted ones, rebased ones
measured after rebasing), against the same arithmetic written out in numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diloco_node.config import manifest as manifest_module
from diloco_node.config.manifest import ConfigError, SyncSpec
from diloco_node.sync import contribution_norm as norm_module
from diloco_node.sync.contribution_norm import median_nonzero_norm, median_norm_factors
from diloco_node.sync.global_state import FragmentHistory
from diloco_node.sync.merge import Contribution, ContributionCaps, merge_contributions

CAPS = ContributionCaps(max_tokens_per_step=4096, max_steps=64)
NAME = "blocks/0/w"


def test_factors_bring_every_nonzero_norm_to_the_median_of_the_nonzero_ones() -> None:
    assert median_norm_factors([1.0, 2.0, 4.0]) == [2.0, 1.0, 0.5]
    assert median_norm_factors([3.0]) == [1.0]  # one contributor: itself, exactly
    assert median_norm_factors([0.0, 2.0, 4.0]) == [1.0, 1.5, 0.75]  # a zero votes for nothing, stays zero
    assert median_norm_factors([0.0, 0.0]) == [1.0, 1.0] and median_nonzero_norm([0.0, 0.0]) == 0.0
    assert median_norm_factors([]) == []
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite and >= 0"):
            median_norm_factors([1.0, bad])


def test_the_key_is_checked_and_names_the_same_choices_as_the_merge() -> None:
    assert SyncSpec().contribution_norm == "none"
    assert manifest_module.CONTRIBUTION_NORMS == norm_module.CONTRIBUTION_NORMS
    with pytest.raises(ConfigError, match="sync.contribution_norm"):
        SyncSpec(contribution_norm="max")
    with pytest.raises(ValueError, match="contribution_norm 'max'"):
        merge_contributions([], {NAME: np.zeros(4, np.float32)}, _history({NAME: np.zeros(4, np.float32)}),
                            caps=CAPS, embedding_names=(), contribution_norm="max")


def _history(*versions: dict[str, np.ndarray]) -> FragmentHistory:
    history = FragmentHistory(fragment=0, capacity=4)
    for round_, params in enumerate(versions):
        history.record(round_, params)
    return history


def _merge(contributions: list[Contribution], history: FragmentHistory, current: dict[str, np.ndarray],
           how: str, method: str = "mean") -> np.ndarray:
    result = merge_contributions(contributions, current, history, method=method, weighting="uniform",
                                 caps=CAPS, embedding_names=(), contribution_norm=how)
    assert result.outer_gradient is not None, result.reason
    return result.outer_gradient[NAME]


@pytest.mark.parametrize("method", ["mean", "rda", "support_mean"])
def test_the_merge_scales_each_outer_gradient_to_the_median_norm_first(method: str) -> None:
    rng = np.random.default_rng(0)
    dim = 64
    then = rng.standard_normal(dim).astype(np.float32)
    now = (then + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    history = _history({NAME: then}, {NAME: now})
    deltas = [(s * rng.standard_normal(dim)).astype(np.float32) for s in (1.0, 2.0, 5.0)]
    deltas[2][::3] = 0.0  # a sparse-ish one, so support_mean's supports differ
    zero = np.zeros(dim, np.float32)
    contributions = [Contribution("a", 0, 1, {NAME: deltas[0]}, 4, 256),
                     Contribution("b", 0, 1, {NAME: deltas[1]}, 4, 256),
                     Contribution("c", 0, 0, {NAME: deltas[2]}, 4, 256),  # stale: rebased from round 0
                     Contribution("d", 0, 1, {NAME: zero}, 4, 256)]  # sent nothing: stays zero, no vote
    current = {NAME: now}
    outers = [deltas[0].astype(np.float64), deltas[1].astype(np.float64),
              (now.astype(np.float32) - then + deltas[2]).astype(np.float32).astype(np.float64), zero.astype(np.float64)]
    norms = [float(np.linalg.norm(v)) for v in outers]
    median = float(np.median(norms[:3]))
    scaled = [v * (median / n) if n > 0 else v for v, n in zip(outers, norms)]

    sent = [d.copy() for d in deltas]
    got = _merge(contributions, history, current, "median", method).astype(np.float64)
    for d, before in zip(deltas, sent):
        np.testing.assert_array_equal(d, before)  # the scaling never writes into what was sent
    plain = _merge(contributions, history, current, "none", method).astype(np.float64)
    if method == "mean":
        expected = sum(scaled) / 4
    elif method == "support_mean":
        support = sum((v != 0).astype(np.float64) for v in scaled)
        expected = np.divide(sum(scaled), support, out=np.zeros(dim), where=support > 0)
    else:  # RDA of equal-norm vectors (and one zero): radius = mean norm, direction of the mean of units
        units = [v / np.linalg.norm(v) if np.linalg.norm(v) > 0 else v for v in scaled]
        direction = sum(units) / 4
        expected = (3 * median / 4) * direction / np.linalg.norm(direction)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)
    assert not np.allclose(got, plain, rtol=1e-3)  # the scaling changed the merge


def test_one_contributor_or_equal_norms_merge_bit_for_bit_as_without_scaling() -> None:
    rng = np.random.default_rng(1)
    now = rng.standard_normal(32).astype(np.float32)
    history, current = _history({NAME: now}), {NAME: now}
    alone = [Contribution("a", 0, 0, {NAME: rng.standard_normal(32).astype(np.float32)}, 4, 256)]
    assert _merge(alone, history, current, "median").tobytes() == _merge(alone, history, current, "none").tobytes()
    v = rng.standard_normal(32).astype(np.float32)
    same = [Contribution("a", 0, 0, {NAME: v}, 4, 256), Contribution("b", 0, 0, {NAME: -v}, 4, 256),
            Contribution("c", 0, 0, {NAME: v[::-1].copy()}, 4, 256)]
    assert _merge(same, history, current, "median").tobytes() == _merge(same, history, current, "none").tobytes()


def test_the_syncer_merges_with_the_manifests_contribution_norm() -> None:
    from diloco_node.config.manifest import OuterOptimizer, RunManifest
    from diloco_node.sync.fragments import plan_fragments
    from diloco_node.sync.global_state import GlobalState
    from diloco_node.sync.syncer import Syncer

    def merged(how: str) -> tuple[np.ndarray, str]:
        manifest = RunManifest(sync=SyncSpec(fragments=1, period=4, overlap=0, min_quorum=1, codec_down="fp32",
                                             merge="mean", contribution_norm=how))
        plan = plan_fragments({NAME: (8,)}, 1, 4, 0)
        state = GlobalState(plan, {NAME: np.zeros(8, np.float32)}, OuterOptimizer())
        syncer = Syncer(manifest, plan, [])
        for learner, scale in (("a", 1.0), ("b", 2.0), ("c", 8.0)):
            syncer.add(Contribution(learner, 0, 0, {NAME: np.full(8, scale, np.float32)}, 4, 256), now=0.0)
        step = syncer.step_round(0, 0.0, ["a", "b", "c"])
        assert step is not None and step.taken is not None
        out = syncer.merge_round(step.taken, state)
        assert out.outer_gradient is not None
        return out.outer_gradient[NAME], out.merge_reason

    plain, _ = merged("none")
    scaled, reason = merged("median")
    np.testing.assert_array_equal(plain, np.full(8, 11.0 / 3, np.float32))
    np.testing.assert_array_equal(scaled, np.full(8, 2.0, np.float32))  # all three brought to the median, 2
    assert "scaled to the median norm 5.66" in reason  # |(2, ..., 2)| over 8 values
