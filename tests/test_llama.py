"""The "llama" factory: shapes, causality, rotary positions, grouped-query attention, tied
embeddings, bf16 compute, preset sizes without allocation, training, and clear config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from diloco_node.config.manifest import ModelSpec
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.learn.llama import llama, param_count

SMALL = {"vocab_size": 97, "seq_len": 16, "size": "1m", "d_model": 32, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2, "d_ff": 64}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 16)).astype(np.int32)


def _model(**overrides):
    return llama({**SMALL, **overrides}, nnx.Rngs(params=0))


def test_logits_shape_dtype_and_float32_parameters() -> None:
    model = _model()
    logits = model(TOKENS)
    assert logits.shape == (2, 16, 97) and logits.dtype == jnp.float32
    assert all(leaf.dtype == jnp.float32 for _, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_a_token_changes_no_logit_before_it() -> None:
    model = _model()
    changed = TOKENS.copy()
    changed[:, 9] = (changed[:, 9] + 1) % 97
    a, b = np.asarray(model(TOKENS)), np.asarray(model(changed))
    assert np.allclose(a[:, :9], b[:, :9], atol=1e-6) and not np.allclose(a[:, 9:], b[:, 9:])


def test_positions_come_from_rotation_not_a_table() -> None:
    model = _model()
    names = set(model_lib.flat_params(nnx.state(model, nnx.Param)))
    assert not any("pos" in name for name in names)
    # One layer: the last token attends over keys and values of single tokens, so without
    # positions its logits could not see their order, and swapping two earlier tokens would leave
    # them unchanged. Rotation sees it.
    one_layer = _model(num_layers=1)
    swapped = TOKENS.copy()
    swapped[:, [3, 6]] = swapped[:, [6, 3]]
    assert not np.allclose(np.asarray(one_layer(TOKENS))[:, -1], np.asarray(one_layer(swapped))[:, -1], atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_shapes(kv_heads: int) -> None:
    model = _model(num_kv_heads=kv_heads)
    flat = model_lib.flat_params(nnx.state(model, nnx.Param))
    head_dim = 32 // 4
    assert flat["blocks/0/attn/q/kernel"].shape == (32, 4 * head_dim)
    assert flat["blocks/0/attn/k/kernel"].shape == (32, kv_heads * head_dim)
    assert flat["blocks/0/attn/v/kernel"].shape == (32, kv_heads * head_dim)
    assert model(TOKENS).shape == (2, 16, 97)


def test_tied_embeddings_have_no_head_and_fewer_parameters() -> None:
    tied = model_lib.flat_params(nnx.state(_model(tie_embeddings=True), nnx.Param))
    untied = model_lib.flat_params(nnx.state(_model(tie_embeddings=False), nnx.Param))
    assert "lm_head/kernel" not in tied and untied["lm_head/kernel"].shape == (32, 97)
    count = lambda flat: sum(a.size for a in flat.values())  # noqa: E731
    assert count(untied) - count(tied) == 97 * 32


def test_bfloat16_compute_keeps_float32_parameters_and_close_logits() -> None:
    full = _model()
    half = _model(compute_dtype="bfloat16")
    nnx.update(half, nnx.state(full, nnx.Param))  # the same weights
    assert all(leaf.dtype == jnp.float32 for _, leaf in nnx.to_flat_state(nnx.state(half, nnx.Param)))
    a, b = np.asarray(full(TOKENS)), np.asarray(half(TOKENS))
    assert b.dtype == np.float32
    assert np.max(np.abs(a - b)) < 0.05 * (np.max(np.abs(a)) + 1e-3) and not np.array_equal(a, b)


def test_preset_sizes_counted_without_allocation() -> None:
    assert 0.5e6 <= param_count({"vocab_size": 256, "seq_len": 128, "size": "1m"}) <= 2e6
    assert 0.9e9 <= param_count({"vocab_size": 128_256, "seq_len": 2048, "size": "1b"}) <= 1.6e9


def test_a_few_adamw_steps_lower_the_loss() -> None:
    spec = ModelSpec.of("llama", **{k: v for k, v in SMALL.items()})
    graphdef, params = factory.init_params(spec, seed=0)
    tx = optax.adam(3e-3)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(model_lib.loss_fn, argnums=1)(graphdef, params, TOKENS[:, :-1], TOKENS[:, 1:])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(15):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize(("change", "message"), [
    ({"colour": "red"}, "unknown llama option(s) colour"),
    ({"num_heads": 5}, "num_heads = 5: must divide d_model = 32"),
    ({"num_kv_heads": 3}, "num_kv_heads = 3: must divide num_heads = 4"),
    ({"compute_dtype": "float16"}, "compute_dtype = 'float16'"),
    ({"size": "7b"}, "size = '7b'"),
])
def test_bad_configurations_name_the_key(change, message) -> None:
    with pytest.raises(ValueError) as error:
        _model(**change)
    assert message in str(error.value)
    # Through the model interface it is a config error naming the factory.
    with pytest.raises(factory.ModelFactoryError, match="model factory 'llama'"):
        factory.model_signature(ModelSpec.of("llama", **{**SMALL, **change}))


def test_same_seed_same_weights_and_the_embedding_is_declared() -> None:
    spec = ModelSpec.of("llama", **SMALL)
    a = model_lib.flat_params(factory.init_params(spec, 3)[1])
    b = model_lib.flat_params(factory.init_params(spec, 3)[1])
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert factory.embedding_names(spec, a) == ["embed/embedding"]
