"""The merge on sparse contributions (top-k uplinks): the support-normalised mean, and the norm-outlier
check still refusing a x1e6 contribution when contributions are sparse."""

from __future__ import annotations

import numpy as np
import pytest

from diloco_node.sync.global_state import FragmentHistory
from diloco_node.sync.merge import Contribution, ContributionCaps, merge_contributions, support_mean, weighted_mean

CAPS = ContributionCaps(max_tokens_per_step=4096, max_steps=64)
SHAPES = {"blocks/0/w": (64, 128), "embed/embedding": (256, 16)}


def test_support_mean_averages_each_coordinate_over_the_contributions_that_sent_it() -> None:
    a = np.array([2.0, 0.0, 4.0, 0.0], np.float32)
    b = np.array([0.0, 6.0, 8.0, 0.0], np.float32)
    out = support_mean([a, b], [1.0, 3.0])
    # one sender keeps its value, both: their weighted mean, none: 0
    np.testing.assert_allclose(out, [2.0, 6.0, (1 * 4 + 3 * 8) / 4, 0.0], rtol=1e-6)
    assert out.dtype == np.float32
    # the token-weighted mean shrinks each lone coordinate by the weight of those who did not send it
    np.testing.assert_allclose(weighted_mean([a, b], [1.0, 3.0]), [0.5, 4.5, 7.0, 0.0], rtol=1e-6)
    dense = [np.array([1.0, 2.0], np.float32), np.array([3.0, -4.0], np.float32)]
    np.testing.assert_allclose(support_mean(dense, [1.0, 1.0]), weighted_mean(dense, [1.0, 1.0]), rtol=1e-6)
    with pytest.raises(ValueError, match="weights sum to zero"):
        support_mean(dense, [0.0, 0.0])


def _history() -> FragmentHistory:
    history = FragmentHistory(fragment=0, capacity=3)
    rng = np.random.default_rng(0)
    history.record(0, {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()})
    return history


def _sparse_delta(seed: int, keep: int = 64, chunk: int = 4096, scale: float = 0.01) -> dict[str, np.ndarray]:
    """A top-k-like delta: per chunk of `chunk` values, `keep` random coordinates nonzero."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in SHAPES.items():
        flat = np.zeros(int(np.prod(shape)), np.float32)
        for start in range(0, flat.size, chunk):
            size = min(chunk, flat.size - start)
            where = start + rng.choice(size, size=min(keep, size), replace=False)
            flat[where] = scale * rng.standard_normal(where.size)
        out[name] = flat.reshape(shape)
    return out


def _merge(contributions, method):
    history = _history()
    return merge_contributions(contributions, dict(history.version(0)), history, method=method, caps=CAPS,
                               embedding_names=("embed/embedding",))


@pytest.mark.parametrize("method", ["rda", "mean", "support_mean"])
def test_a_sparse_contribution_scaled_1e6_is_still_refused_as_a_norm_outlier(method) -> None:
    honest = [Contribution(name, 0, 0, _sparse_delta(i), 10, 5000) for i, name in enumerate("abc")]
    huge = Contribution("d", 0, 0, {n: np.float32(1e6) * v for n, v in _sparse_delta(3).items()}, 10, 5000)
    result = _merge(honest + [huge], method)
    assert [learner for learner, _ in result.rejected] == ["d"]
    assert "the round median" in result.rejected[0][1]
    assert [learner for learner, _ in result.accepted] == ["a", "b", "c"]


def test_the_support_mean_merge_keeps_lone_coordinates_that_the_mean_shrinks() -> None:
    contributions = [Contribution(name, 0, 0, _sparse_delta(i), 10, 5000) for i, name in enumerate("abc")]
    support = _merge(contributions, "support_mean").outer_gradient
    mean = _merge(contributions, "mean").outer_gradient
    assert support is not None and mean is not None
    for name in SHAPES:
        lone = sum((c.delta[name] != 0).astype(int) for c in contributions) == 1
        np.testing.assert_allclose(support[name][lone], 3 * mean[name][lone], rtol=1e-5)
        assert np.count_nonzero(support[name]) == np.count_nonzero(mean[name])  # the same union of supports
