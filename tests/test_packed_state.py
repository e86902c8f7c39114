"""The learner's state packed into a few buffers: leaves read and written in place, and the step
over packed buffers equal to the step over its leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from diloco_node.config.manifest import InnerOptimizer, ModelSpec
from diloco_node.learn import factory
from diloco_node.learn import inner as inner_lib
from diloco_node.learn.inner import InnerLearner
from diloco_node.learn.packed_state import make_packing, packing_of

from conftest import byte_batches

LLAMA = ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=2, d_model=64, d_ff=128)
ADAMW = InnerOptimizer(batch_size=2, lr_peak=3e-3, warmup_steps=2, total_steps=40)


def test_leaves_are_packed_by_dtype_and_read_and_written_by_index():
    rng = np.random.default_rng(0)
    leaves = [jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), jnp.asarray(7, jnp.int32),
              jnp.asarray(rng.normal(size=(5,)), jnp.float32), jnp.asarray([1, 2], jnp.int32)]
    packing = make_packing([x.shape for x in leaves], [x.dtype for x in leaves], None)
    assert packing.num_buffers == packing.num_packed == 2  # one float32 buffer, one int32
    buffers = packing.pack(leaves)
    assert [b.shape for b in buffers] == [(17,), (3,)]
    for got, want in zip(packing.unpack(buffers), leaves):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(packing.read(buffers, [2])[0], leaves[2])
    new = jnp.full((5,), 9.0, jnp.float32)
    written = packing.write(buffers, {2: new, 3: jnp.asarray([5, 6], jnp.int32)})
    assert buffers[0].is_deleted()  # donated: the write happened in place
    after = packing.unpack(written)
    np.testing.assert_array_equal(after[2], new)
    np.testing.assert_array_equal(after[3], [5, 6])
    np.testing.assert_array_equal(after[0], leaves[0])  # the others are untouched
    assert not new.is_deleted()  # the value stays the caller's


def test_a_state_over_the_limit_is_left_as_its_leaves():
    leaves = [jnp.zeros((4, 4), jnp.float32), jnp.ones((2,), jnp.float32)]
    packing = make_packing([x.shape for x in leaves], [x.dtype for x in leaves], None, max_bytes=16)
    assert packing.num_packed == 0 and packing.num_buffers == 2
    buffers = packing.pack(leaves)
    np.testing.assert_array_equal(packing.unpack(buffers)[1], leaves[1])
    written = packing.write(buffers, {0: jnp.full((4, 4), 2.0)})
    np.testing.assert_array_equal(packing.unpack(written)[0], np.full((4, 4), 2.0))


def test_the_step_over_packed_buffers_equals_the_step_over_the_leaves_bit_for_bit():
    """AdamW: same parameters and optimizer state after several steps, to the bit (the packed step
    slices and concatenates; the arithmetic is the leaves' own)."""
    model = factory.recipe(LLAMA)
    learner = InnerLearner(model, ADAMW, seed=0)
    assert learner._param_packing.num_buffers == 1 and learner._opt_packing.num_buffers <= 2
    _, abstract = factory.abstract_model(model)
    tx = inner_lib._optimizer(model, ADAMW)
    loose = (packing_of(abstract, max_bytes=0), packing_of(jax.eval_shape(tx.init, abstract), max_bytes=0))
    reference = jax.jit(inner_lib._over_buffers(inner_lib._train_step_fn(factory.graphdef_of(model), tx),
                                                *inner_lib._state_defs(model, ADAMW), *loose), donate_argnums=(0, 1))
    params, opt = learner.param_leaves, learner.opt_leaves
    rng = np.random.default_rng(1)
    for _ in range(6):
        inputs, targets = (a[0] for a in byte_batches(rng, 1))
        loss = learner.step(inputs, targets)
        params, opt, reference_loss, _ = reference(params, opt, inputs, targets)
        assert float(loss) == float(reference_loss)
    for got, want in zip(learner.param_leaves + learner.opt_leaves, params + opt):
        np.testing.assert_array_equal(got, want)
    assert learner.compiled_variants() == 1
