"""Sharded start-up (`[node.mesh] fsdp`): a learner's parameters and AdamW moments are created in
the mesh's layout, so each device holds only its shard and no device ever holds the whole model,
and training from there gives the losses of a learner started on one device."""

import jax
import numpy as np
from flax import nnx

from diloco_node.config.manifest import InnerOptimizer, ModelSpec
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.learn.inner import InnerLearner
from diloco_node.learn.mesh import MeshShape, build_site_mesh

MODEL = ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=2, d_model=64, d_ff=128)
INNER = InnerOptimizer(batch_size=4, lr_peak=1e-2, warmup_steps=1, total_steps=100)


def _mesh():
    return build_site_mesh(MeshShape(data=1, fsdp=2), jax.devices()[:2], min_sharded_elements=1)


def _batches(count: int):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 256, (count, 4, 17)).astype(np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def test_each_device_holds_only_its_shard_of_every_parameter_and_moment_after_start_up():
    mesh = _mesh()
    learner = InnerLearner(MODEL, INNER, seed=0, site_mesh=mesh)
    sharded = 0
    for tree in (learner.params, learner.opt_state):
        for leaf in jax.tree.leaves(tree):
            if leaf.ndim == 0:
                continue
            dim = mesh.sharded_dim(leaf.shape)
            assert dim is not None  # every tensor of this model divides by 2
            expected = list(leaf.shape)
            expected[dim] //= 2
            shards = leaf.addressable_shards
            assert sorted(s.device.id for s in shards) == [0, 1]
            assert all(tuple(s.data.shape) == tuple(expected) for s in shards)
            sharded += 1
    assert sharded >= 3 * 2 * 10  # parameters, first and second moments of every tensor


def test_the_compiled_initialisation_outputs_a_shard_per_device_not_the_model():
    """XLA's memory analysis of the initialiser: each device's output is half the parameters."""
    mesh = _mesh()
    _, abstract = factory.abstract_model(MODEL)
    whole = sum(int(np.prod(leaf.shape)) * 4 for leaf in jax.tree.leaves(abstract))
    init = factory.sharded_init_fn(MODEL, 0, mesh.tree_shardings(abstract))
    analysis = init.lower().compile().memory_analysis()
    leaves = len(jax.tree.leaves(abstract))
    # Half of every tensor, plus the output tuple's table of buffer pointers (8 bytes a leaf).
    assert whole // 2 <= analysis.output_size_in_bytes <= whole // 2 + 8 * leaves
    # Its working memory (random bits and their transform) is per shard too: half of what the
    # same initialiser needs when every device holds whole tensors.
    whole_layout = build_site_mesh(MeshShape(data=2, fsdp=1), jax.devices()[:2], min_sharded_elements=1)
    unsharded = factory.sharded_init_fn(MODEL, 0, whole_layout.tree_shardings(abstract)).lower().compile()
    assert analysis.temp_size_in_bytes <= 0.55 * unsharded.memory_analysis().temp_size_in_bytes


def test_training_from_a_sharded_start_gives_the_losses_of_a_one_device_start():
    sharded = InnerLearner(MODEL, INNER, seed=0, site_mesh=_mesh())
    values = sharded.get_flat()
    single = InnerLearner(MODEL, INNER, seed=0, initial=values)
    # The same seed, initialised as one program: the eager values up to float rounding.
    eager = model_lib.flat_params(factory.init_params(MODEL, 0)[1])
    assert all(np.allclose(values[n], eager[n], rtol=1e-6, atol=1e-7) for n in eager)
    for x, y in _batches(4):
        a, b = float(sharded.step(x, y)), float(single.step(x, y))
        assert np.isclose(a, b, rtol=1e-5), (a, b)
    after_sharded, after_single = sharded.get_flat(), single.get_flat()
    assert all(np.allclose(after_sharded[n], after_single[n], rtol=1e-4, atol=1e-6) for n in after_single)


def test_given_initial_values_are_placed_on_their_shards_without_initialising_a_model():
    values = model_lib.flat_params(factory.init_params(MODEL, 7)[1])
    learner = InnerLearner(MODEL, INNER, seed=0, initial=values, site_mesh=_mesh())
    got = learner.get_flat()
    assert all(np.array_equal(got[n], values[n]) for n in values)
    leaf = jax.tree.leaves(learner.params)[0]
    assert len(leaf.addressable_shards) == 2 and leaf.addressable_shards[0].data.shape != leaf.shape
    missing = dict(values)
    missing.pop(next(iter(missing)))
    try:
        InnerLearner(MODEL, INNER, seed=0, initial=missing, site_mesh=_mesh())
    except KeyError as error:
        assert "initial values missing" in str(error)
    else:
        raise AssertionError("an incomplete initial state was accepted")


def test_the_execution_choices_travel_in_the_graphdef_without_changing_the_parameters():
    plain = factory.execution_graphdef(MODEL)
    assert plain is factory.graphdef_of(MODEL)
    _, abstract = factory.abstract_model(MODEL)
    other = factory.execution_graphdef(MODEL, "reference", "full")
    merged = nnx.merge(other, abstract)
    assert model_lib.param_shapes(nnx.state(merged, nnx.Param)) == model_lib.param_shapes(abstract)
