"""One learner's row of the stacked learners, read, diffed and written on the device, against the
host versions (slice of the whole stack, numpy subtraction, host edit), bit for bit; and the
runner's batches drawn ahead are the ones drawn on demand."""

import numpy as np
import pytest

from diloco_node.config.manifest import InnerOptimizer, ModelSpec
from diloco_node.learn import data as data_lib
from diloco_node.learn import stacked_rows
from diloco_node.learn.inner import StackedLearners
from diloco_node.sim.batches import StackedBatches

from conftest import byte_batches

CFG = ModelSpec.of(seq_len=16, size="tiny")
INNER = InnerOptimizer(batch_size=2, lr_peak=3e-3, warmup_steps=4, total_steps=24)


def _trained_stack() -> StackedLearners:
    """Three learners whose rows differ (each stepped on its own batches)."""
    stack = StackedLearners(CFG, INNER, num_learners=3, seed=0)
    rng = np.random.default_rng(1)
    for i in range(3):
        stack.step(*byte_batches(rng, 3), np.array([True, True, i % 2 == 0]))
    return stack


def _host_rows(stack: StackedLearners, learner: int) -> dict[str, np.ndarray]:
    """The host version: the whole stacked tensor to the host, then one row of it."""
    return {name: np.array(np.asarray(stack._leaf(name)[...])[learner], dtype=np.float32) for name in stack._paths}


def test_device_rows_and_deltas_equal_the_host_versions_bit_for_bit():
    stack = _trained_stack()
    names = sorted(stack._paths)
    for m in range(3):
        host = _host_rows(stack, m)
        before = stack.device_to_host_bytes
        device = stack.get_flat(m)
        assert stack.device_to_host_bytes - before == sum(v.nbytes for v in host.values())  # one row, not M
        for name in names:
            np.testing.assert_array_equal(device[name], host[name])
        base = {n: host[n] + np.float32(0.25) * np.sin(host[n]) for n in names[:3]}  # any other fragment
        delta = stack.fragment_delta(m, base)
        assert list(delta) == names[:3]
        for n in names[:3]:
            expected = base[n] - host[n]
            assert delta[n].dtype == np.float32
            assert np.array_equal(delta[n].view(np.uint32), expected.view(np.uint32))
    assert not np.array_equal(stack.get_flat(0)[names[0]], stack.get_flat(2)[names[0]])


def test_set_flat_writes_one_row_on_the_device_and_compiles_once_per_fragment():
    stack = _trained_stack()
    fragment = ["head/kernel", "embed/embedding"]
    others = [_host_rows(stack, m) for m in range(3)]
    compiled_before = stacked_rows.set_rows._cache_size()
    for m in range(3):
        values = {n: np.full(others[m][n].shape, 0.5 + m, np.float32) for n in fragment}
        stack.set_flat(m, values)
        after = _host_rows(stack, m)
        for n in stack._paths:
            np.testing.assert_array_equal(after[n], values[n] if n in fragment else others[m][n])
        for k in range(m + 1, 3):  # rows not yet written are untouched
            assert all(np.array_equal(_host_rows(stack, k)[n], others[k][n]) for n in stack._paths)
    assert stacked_rows.set_rows._cache_size() - compiled_before <= 1  # the learner index is traced
    # The stack still trains after its buffers were donated and replaced.
    loss = stack.step(*byte_batches(np.random.default_rng(2), 3), np.ones(3, bool))
    assert np.all(np.isfinite(np.asarray(loss)))


def test_bad_names_shapes_and_learners_are_refused_and_change_nothing():
    stack = _trained_stack()
    before = _host_rows(stack, 1)
    with pytest.raises(KeyError, match="unknown parameter"):
        stack.set_flat(1, {"nope": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="shape"):
        stack.set_flat(1, {"head/kernel": np.zeros((2, 2), np.float32)})
    with pytest.raises(ValueError, match="shape"):
        stack.fragment_delta(1, {"head/kernel": np.zeros((2, 2), np.float32)})
    with pytest.raises(IndexError, match="learner 3"):
        stack.get_flat(3)
    after = _host_rows(stack, 1)
    assert all(np.array_equal(after[n], before[n]) for n in before)


def _samplers(seed: int) -> list[data_lib.BatchSampler]:
    tokens = np.arange(4000, dtype=np.int32) % 251
    return [data_lib.BatchSampler(tokens[i * 1000:(i + 1) * 1000], 2, 8, seed, i) for i in range(3)]


def test_batches_drawn_ahead_are_the_batches_drawn_on_demand_whatever_the_masks():
    masks = [[1, 1, 1], [1, 1, 1], [1, 0, 1], [0, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 1]]
    ahead = StackedBatches(_samplers(3), 2, 8, prefetch=True)
    plain = StackedBatches(_samplers(3), 2, 8, prefetch=False)
    for mask in masks:
        a_in, a_tg = ahead.take(mask)
        p_in, p_tg = plain.take(mask)
        np.testing.assert_array_equal(np.asarray(a_in), p_in)
        np.testing.assert_array_equal(np.asarray(a_tg), p_tg)
        for m, on in enumerate(mask):
            if not on:
                assert not np.asarray(a_in)[m].any()
    assert ahead.prefetch_hits == 2  # the two repeated masks were served from the batch placed ahead
