"""A site's device mesh: axis sizes, the layout rule and the global batch (the same loss curve on
1 and 4 devices, in a subprocess with 4 forced host devices:
tests/integration/test_mesh_processes.py)."""

import jax
import numpy as np
import pytest

from diloco_node.config.manifest import ConfigError, InnerOptimizer, ModelSpec
from diloco_node.learn.inner import InnerLearner
from diloco_node.learn.mesh import MeshShape, build_site_mesh

SPEC = ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1, d_model=64, d_ff=128)


def test_axis_sizes_resolve_against_the_device_count():
    assert MeshShape().resolve(8) == (8, 1)
    assert MeshShape(data=-1, fsdp=4).resolve(8) == (2, 4)
    assert MeshShape(data=2, fsdp=-1).resolve(8) == (2, 4)
    assert MeshShape(data=1, fsdp=1).resolve(1) == (1, 1)


@pytest.mark.parametrize("shape, devices, message", [
    (dict(data=-1, fsdp=3), 4, "mesh.fsdp = 3: does not divide this site's 4 device(s)"),
    (dict(data=2, fsdp=1), 4, "mesh.data = 2 x mesh.fsdp = 1 = 2 devices, but this site has 4"),
])
def test_axis_sizes_that_do_not_fit_the_devices_are_refused_by_name(shape, devices, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MeshShape(**shape).resolve(devices)


@pytest.mark.parametrize("shape, message", [
    (dict(data=-1, fsdp=-1), "both -1"),
    (dict(data=0), "mesh.data = 0"),
    (dict(fsdp=2.0), "mesh.fsdp = 2.0"),
    (dict(microbatches=0), "mesh.microbatches = 0"),
])
def test_bad_mesh_settings_are_refused_by_name(shape, message):
    with pytest.raises(ConfigError, match=message):
        MeshShape(**shape)


def test_layout_rule_shards_the_largest_divisible_dimension_and_replicates_small_tensors():
    mesh = build_site_mesh(MeshShape(data=1, fsdp=2), jax.devices()[:2], min_sharded_elements=64)
    assert mesh.sharded_dim((16, 64)) == 1  # the largest dimension
    assert mesh.sharded_dim((64, 64)) == 0  # a tie: the first
    assert mesh.sharded_dim((63, 33)) is None  # nothing divides: replicated
    assert mesh.sharded_dim((8, 4)) is None  # below the size floor: replicated
    assert mesh.sharded_dim(()) is None  # AdamW's step count
    assert str(mesh.param_sharding((16, 64)).spec) == str(jax.sharding.PartitionSpec(None, "fsdp"))
    assert mesh.describe() == {"platform": "cpu", "count": 2, "processes": 1, "mesh": {"data": 1, "fsdp": 2},
                               "kind": "cpu", "attention": "auto", "remat": "none"}
    data_only = build_site_mesh(MeshShape(), jax.devices()[:2], min_sharded_elements=1)
    assert data_only.sharded_dim((16, 64)) is None  # fsdp = 1: everything replicated


def test_the_global_batch_must_split_over_devices_and_microbatches():
    mesh = build_site_mesh(MeshShape(microbatches=2), jax.devices()[:2])
    mesh.check_batch(8)
    with pytest.raises(ConfigError, match=r"inner.batch_size = 6: must be divisible by this site's 2 device\(s\) "
                                          r"x mesh.microbatches = 2 \(= 4\)"):
        mesh.check_batch(6)  # a learner checks it before building anything (tests/test_site_devices.py)


def test_parameters_and_moments_keep_their_layout_and_a_written_tensor_does_not_recompile():
    mesh = build_site_mesh(MeshShape(data=1, fsdp=2), jax.devices()[:2], min_sharded_elements=1)
    learner = InnerLearner(SPEC, InnerOptimizer(batch_size=4, warmup_steps=1, total_steps=10), 0, site_mesh=mesh)
    tokens = np.random.default_rng(0).integers(0, 256, (4, 17)).astype(np.int32)
    learner.step(tokens[:, :-1], tokens[:, 1:])
    before = {id(leaf): leaf.sharding for leaf in jax.tree.leaves(learner.params)}
    assert any(not s.is_fully_replicated for s in before.values())  # fsdp really shards something
    learner.set_flat({"blocks/0/mlp/up/kernel": np.ones((64, 128), np.float32)})
    learner.step(tokens[:, :-1], tokens[:, 1:])
    for leaf in jax.tree.leaves(learner.params) + jax.tree.leaves(learner.opt_state):
        assert leaf.sharding == mesh.param_sharding(leaf.shape)
    assert learner.compiled_variants() == 1
