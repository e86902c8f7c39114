"""The byte transformer: named sizes, flat parameter names, and that training lowers the loss."""

import numpy as np
import pytest
from flax import nnx

from diloco_node.learn import model as model_lib
from diloco_node.sync.fragments import is_embedding
from diloco_node.learn.inner import InnerLearner
from diloco_node.config.manifest import InnerOptimizer, ModelSpec
from diloco_node.learn import factory


def _abstract_param_count(size: str) -> int:
    abstract = nnx.eval_shape(lambda: model_lib.init_model(model_lib.model_config(size), 0))
    _, params = nnx.split(abstract, nnx.Param)
    return model_lib.count_params(params)


def test_named_sizes_have_the_promised_parameter_counts():
    tiny, small = _abstract_param_count("tiny"), _abstract_param_count("small")
    assert 50_000 < tiny < 300_000  # well under 1M
    assert 5_000_000 <= small <= 10_000_000
    assert _abstract_param_count("medium") > small


def test_unknown_size_is_a_clear_error():
    with pytest.raises(ValueError, match="huge"):
        model_lib.model_config("huge")


def test_flat_params_are_float32_named_by_path_with_embeddings_identifiable():
    _, params = model_lib.split_model(model_lib.init_model(model_lib.model_config("tiny", 16), 0))
    flat = model_lib.flat_params(params)
    assert "blocks/0/attn/qkv/kernel" in flat and "head/kernel" in flat
    assert all(a.dtype == np.float32 for a in flat.values())
    embeddings = sorted(n for n in flat if is_embedding(n))
    assert embeddings == ["embed/embedding", "pos_embed/embedding"]
    assert sum(a.size for a in flat.values()) == model_lib.count_params(params)


def test_load_flat_params_round_trips_and_rejects_bad_names_and_shapes():
    _, params = model_lib.split_model(model_lib.init_model(model_lib.model_config("tiny", 16), 0))
    flat = model_lib.flat_params(params)
    changed = {"head/kernel": flat["head/kernel"] + 1.0}
    new = model_lib.flat_params(model_lib.load_flat_params(params, changed))
    np.testing.assert_array_equal(new["head/kernel"], flat["head/kernel"] + 1.0)
    np.testing.assert_array_equal(new["embed/embedding"], flat["embed/embedding"])
    with pytest.raises(KeyError, match="nope"):
        model_lib.load_flat_params(params, {"nope/kernel": flat["head/kernel"]})
    with pytest.raises(ValueError, match="head/kernel"):
        model_lib.load_flat_params(params, {"head/kernel": np.zeros((3, 3), np.float32)})


def test_same_seed_same_parameters_and_loss_is_near_log_vocab_at_init():
    cfg = model_lib.model_config("tiny", 16)
    a = model_lib.flat_params(model_lib.split_model(model_lib.init_model(cfg, 7))[1])
    b = model_lib.flat_params(model_lib.split_model(model_lib.init_model(cfg, 7))[1])
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    graphdef, params = model_lib.split_model(model_lib.init_model(cfg, 7))
    tokens = np.random.default_rng(0).integers(0, 256, (4, 16)).astype(np.int32)
    loss = float(model_lib.loss_fn(graphdef, params, tokens, tokens))
    assert abs(loss - np.log(256)) < 1.0  # near-uniform predictions at init


def test_loss_decreases_over_a_few_steps():
    spec = ModelSpec.of(seq_len=16)
    learner = InnerLearner(spec, InnerOptimizer(batch_size=4, lr_peak=1e-2, warmup_steps=2, total_steps=20), seed=0)
    text = np.frombuffer(b"def add(a, b):\n    return a + b\n" * 4, dtype=np.uint8).astype(np.int32)
    inputs = np.stack([text[i:i + 16] for i in range(4)])
    targets = np.stack([text[i + 1:i + 17] for i in range(4)])
    losses = [float(learner.step(inputs, targets)) for _ in range(12)]
    assert losses[-1] < losses[0] - 1.0
    evaluate = factory.eval_fn(spec)
    assert float(evaluate(learner.params, inputs[None], targets[None])) < losses[0]
