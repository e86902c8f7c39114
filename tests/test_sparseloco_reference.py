"""The independent SparseLoCo reference (benchmarks/sparseloco_reference.py): its compressor."""

import numpy as np

from benchmarks.sparseloco_reference import top_k_two_level


def test_each_whole_chunk_keeps_its_k_largest_as_sign_and_one_of_two_levels_and_the_tail_as_it_is():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(2 * 256 + 10).astype(np.float32)
    q = top_k_two_level(x, k=8, chunk=256)
    for c in range(2):
        chunk, sent = x[c * 256:(c + 1) * 256], q[c * 256:(c + 1) * 256]
        kept = np.flatnonzero(sent)
        assert set(kept) == set(np.argsort(-np.abs(chunk))[:8])
        assert np.all(np.sign(sent[kept]) == np.sign(chunk[kept]))
        levels = np.unique(np.abs(sent[kept]))
        mags = np.sort(np.abs(chunk[kept]))
        assert np.allclose(levels, [mags[:4].mean(), mags[4:].mean()])
    assert np.array_equal(q[512:], x[512:])


def test_error_feedback_with_beta_one_delivers_all_the_mass_over_rounds():
    rng = np.random.default_rng(1)
    delta = rng.standard_normal(256).astype(np.float32)
    e = np.zeros_like(delta)
    arrived = np.zeros_like(delta)
    for _ in range(64):
        x = e + delta
        q = top_k_two_level(x, k=8, chunk=256)
        e = x - q
        arrived += q
    # what arrived plus what is still owed is every delta sent
    assert np.allclose(arrived + e, 64 * delta, rtol=1e-4, atol=1e-3)
