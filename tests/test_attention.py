"""Attention implementations and rematerialisation of the llama factory: every implementation
that runs on CPU computes the reference attention (values and gradients, fp32 and bf16, with and
without grouped queries, contexts the chunk divides and does not); "auto" resolves by its table;
the site's choices reach a whole model through `set_execution` and the GraphDef and change
neither its parameters, its logits nor its gradients; bad names are clear errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diloco_node.config.site_devices import ATTENTION_CHOICES, REMAT_CHOICES
from diloco_node.learn import model as model_lib
from diloco_node.learn.attention import CHUNKED_MIN_SEQ_LEN, causal_attention, resolve_attention
from diloco_node.learn.llama import llama

# The implementations compared with the reference on CPU ("auto" resolves to one of them: its
# table is tested on its own, and whole models run it below). The chunk size matters to
# "chunked" only, so "xla" runs one shape.
CPU_CHOICES = ("xla", "chunked")
# bf16 keeps 8 bits of mantissa: outputs of magnitude ~1 differ by a few bf16 ulps (2^-8 each)
# between implementations that round the scores and weights at different points.
BF16_ATOL = 3e-2
FP32_ATOL = 1e-5


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size"))
def _attend(q, k, v, implementation, chunk_size):
    return causal_attention(q, k, v, implementation=implementation, chunk_size=chunk_size)


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size"))
def _grads(q, k, v, implementation, chunk_size):
    # A nonlinear scalar, so that every output position gets a different cotangent.
    def scalar(q, k, v):
        out = causal_attention(q, k, v, implementation=implementation, chunk_size=chunk_size)
        return jnp.sum(jnp.sin(out.astype(jnp.float32) * 3.0))
    return jax.grad(scalar, argnums=(0, 1, 2))(q, k, v)


def _qkv(length: int, heads: int, kv_heads: int, dtype=jnp.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape_q, shape_kv = (2, length, heads, 8), (2, length, kv_heads, 8)
    return tuple(jnp.asarray(rng.normal(size=s) * 2.0, dtype) for s in (shape_q, shape_kv, shape_kv))


# (length, chunk): the chunk divides the length (3 chunks), does not (4 chunks, the last padded),
# and exceeds it (one chunk of the whole context).
SHAPES = [(12, 4), (13, 4), (6, 16)]


CASES = [("chunked", length, chunk) for length, chunk in SHAPES] + [("xla",) + SHAPES[1]]


@pytest.mark.parametrize("implementation,length,chunk", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (4, 1)])
def test_every_cpu_implementation_equals_the_reference_fp32(implementation, heads, kv_heads, length, chunk) -> None:
    q, k, v = _qkv(length, heads, kv_heads)
    expected = np.asarray(_attend(q, k, v, "reference", chunk))
    got = _attend(q, k, v, implementation, chunk)
    assert got.shape == (2, length, heads, 8) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("implementation", CPU_CHOICES)
def test_every_cpu_implementation_equals_the_reference_bf16(implementation, heads, kv_heads) -> None:
    q, k, v = _qkv(13, heads, kv_heads, jnp.bfloat16)
    # Ground truth in fp32 from the same bf16 values: every implementation's own rounding counts.
    expected = np.asarray(_attend(*(x.astype(jnp.float32) for x in (q, k, v)), "reference", 4))
    got = _attend(q, k, v, implementation, 4)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), expected, atol=BF16_ATOL, rtol=0)


@pytest.mark.parametrize("implementation,length,chunk", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_gradients_equal_the_references(implementation, heads, kv_heads, length, chunk) -> None:
    q, k, v = _qkv(length, heads, kv_heads, seed=1)
    expected = _grads(q, k, v, "reference", chunk)
    got = _grads(q, k, v, implementation, chunk)
    for name, g, e in zip("qkv", got, expected):
        assert float(jnp.max(jnp.abs(e))) > 1e-2, f"d{name} is too small to test anything"
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-4, rtol=1e-4, err_msg=f"d{name}")


def test_chunked_gradients_bf16() -> None:
    q, k, v = _qkv(13, 4, 2, jnp.bfloat16, seed=2)
    expected = _grads(*(x.astype(jnp.float32) for x in (q, k, v)), "reference", 4)
    got = _grads(q, k, v, "chunked", 4)
    for name, g, e in zip("qkv", got, expected):
        assert g.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(e)))
        # Gradients pass through two more bf16 roundings (p and dS) than values: 5% of their range.
        assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - e))) < 0.05 * scale, f"d{name}"


def test_chunked_is_causal_and_ignores_padding() -> None:
    # Changing the last position (the one a padded chunk holds) changes no earlier output.
    q, k, v = _qkv(13, 4, 2)
    k2, v2 = k.at[:, 12].add(5.0), v.at[:, 12].add(5.0)
    a, b = np.asarray(_attend(q, k, v, "chunked", 4)), np.asarray(_attend(q, k2, v2, "chunked", 4))
    assert np.array_equal(a[:, :12], b[:, :12]) and not np.allclose(a[:, 12], b[:, 12])


def test_resolve_attention_table() -> None:
    long, short = CHUNKED_MIN_SEQ_LEN, CHUNKED_MIN_SEQ_LEN - 1
    table = [
        (("auto", "gpu", jnp.bfloat16, short), "cudnn"),
        (("auto", "gpu", jnp.float16, long), "cudnn"),
        (("auto", "gpu", jnp.float32, short), "xla"),
        (("auto", "gpu", jnp.float32, long), "chunked"),
        (("auto", "cpu", jnp.bfloat16, short), "xla"),
        (("auto", "cpu", jnp.bfloat16, long), "chunked"),
        (("auto", "cpu", jnp.float32, long), "chunked"),
        (("auto", "tpu", jnp.bfloat16, short), "xla"),
        (("auto", "tpu", jnp.bfloat16, long), "chunked"),
    ]
    table += [((choice, "cpu", jnp.float32, 16), choice) for choice in ATTENTION_CHOICES if choice != "auto"]
    for args, expected in table:
        assert resolve_attention(*args) == expected, args
    # A head dimension cuDNN does not take keeps "auto" off it.
    assert resolve_attention("auto", "gpu", jnp.bfloat16, short, head_dim=12) == "xla"
    assert resolve_attention("auto", "gpu", jnp.bfloat16, short, head_dim=256) == "xla"
    assert resolve_attention("auto", "gpu", jnp.bfloat16, short, head_dim=64) == "cudnn"


def test_cudnn_on_this_machine_is_a_clear_error() -> None:
    q, k, v = _qkv(8, 4, 2)
    with pytest.raises(ValueError, match="cudnn.*bfloat16"):
        causal_attention(q, k, v, implementation="cudnn")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs an NVIDIA GPU.*xla"):
            causal_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), implementation="cudnn")


def test_bad_attention_name_names_the_valid_ones() -> None:
    q, k, v = _qkv(8, 4, 2)
    with pytest.raises(ValueError, match="flash.*auto, xla, cudnn, chunked, reference"):
        causal_attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="auto, xla, cudnn, chunked, reference"):
        resolve_attention("flash", "cpu", jnp.float32, 8)


# ---- the whole model ----------------------------------------------------------------------

# One layer keeps each compilation short; the gradients still flow through every kind of module.
TINY = {"vocab_size": 61, "seq_len": 12, "size": "1m", "d_model": 32, "num_layers": 1, "num_heads": 4,
        "num_kv_heads": 2, "d_ff": 48}
TOKENS = np.random.default_rng(3).integers(0, 61, (2, 13)).astype(np.int32)
INPUTS, TARGETS = TOKENS[:, :-1], TOKENS[:, 1:]


@functools.lru_cache(maxsize=None)
def _loss_and_grads(tie: bool, attention: str = "auto", remat: str = "none", chunk_size: int = 5):
    """(logits, loss, flat gradients) of the tiny model with these site choices; one compilation."""
    module = llama({**TINY, "tie_embeddings": tie}, nnx.Rngs(params=0))
    module.set_execution(attention, remat, chunk_size=chunk_size)
    graphdef, params = nnx.split(module, nnx.Param)

    def loss_and_logits(p):
        return model_lib.loss_fn(graphdef, p, INPUTS, TARGETS), nnx.merge(graphdef, p)(INPUTS)

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_and_logits, has_aux=True))(params)
    return np.asarray(logits), float(loss), model_lib.flat_params(grads)


@pytest.fixture(scope="module")
def reference_model_results():
    """The reference results, compiled once for the module (in set-up, not in each test's time)."""
    return {tie: _loss_and_grads(tie, "reference") for tie in (True, False)}


# Each whole-model case compiles a model forward and backward (seconds on two cores): the default
# suite runs every attention choice once and both head tyings, the other pairings run under `slow`.
_SLOW = pytest.mark.slow


# chunk 5 over 12 positions: three chunks, the last padded.
@pytest.mark.parametrize("attention,tie", [
    ("xla", False), ("chunked", True), ("auto", False),
    pytest.param("xla", True, marks=_SLOW), pytest.param("chunked", False, marks=_SLOW),
    pytest.param("auto", True, marks=_SLOW),
])
def test_model_logits_and_gradients_equal_across_attention_choices(attention: str, tie: bool,
                                                                    reference_model_results) -> None:
    logits_ref, loss_ref, grads_ref = reference_model_results[tie]
    assert ("lm_head/kernel" in grads_ref) != tie
    logits, loss, grads = _loss_and_grads(tie, attention)
    np.testing.assert_allclose(logits, logits_ref, atol=1e-5, rtol=0)
    assert abs(loss - loss_ref) < 1e-6
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        np.testing.assert_allclose(grads[name], grads_ref[name], atol=1e-6, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("attention,tie,remat", [
    ("chunked", True, "dots"), ("reference", False, "full"),
    pytest.param("chunked", True, "full", marks=_SLOW), pytest.param("reference", False, "dots", marks=_SLOW),
])
def test_remat_choices_give_equal_losses_and_gradients(attention: str, tie: bool, remat: str,
                                                       reference_model_results) -> None:
    if attention == "reference":
        _, loss_ref, grads_ref = reference_model_results[tie]
    else:
        _, loss_ref, grads_ref = _loss_and_grads(tie, attention, "none")
    assert max(float(np.max(np.abs(g))) for g in grads_ref.values()) > 1e-3
    _, loss, grads = _loss_and_grads(tie, attention, remat)
    assert abs(loss - loss_ref) < 1e-6
    for name in grads_ref:
        np.testing.assert_allclose(grads[name], grads_ref[name], atol=1e-6, rtol=1e-4, err_msg=name)


def test_remat_changes_what_the_backward_pass_keeps() -> None:
    # Not only equal results: the backward pass really recomputes (more ops in the jaxpr).
    module = llama({**TINY, "num_layers": 1}, nnx.Rngs(params=0))
    sizes = {}
    for remat in REMAT_CHOICES:
        module.set_execution("reference", remat)
        graphdef, params = nnx.split(module, nnx.Param)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: model_lib.loss_fn(graphdef, p, INPUTS, TARGETS)))(params)
        sizes[remat] = str(jaxpr).count("checkpoint") + str(jaxpr).count("remat")
    assert sizes["none"] == 0 and sizes["full"] > 0 and sizes["dots"] > 0


def test_choices_travel_in_the_graphdef_and_leave_parameters_unchanged() -> None:
    module = llama(TINY, nnx.Rngs(params=0))
    assert (module.attention, module.remat) == ("auto", "none")
    before = model_lib.flat_params(nnx.state(module, nnx.Param))
    module.set_execution("chunked", "full")
    graphdef, params = nnx.split(module, nnx.Param)
    after = model_lib.flat_params(params)
    assert before.keys() == after.keys() and all(np.array_equal(before[n], after[n]) for n in before)
    default_graphdef, _ = nnx.split(llama(TINY, nnx.Rngs(params=0)), nnx.Param)
    assert graphdef != default_graphdef  # the choice is part of the structure a step is jitted from
    merged = nnx.merge(graphdef, params)
    assert (merged.attention, merged.remat) == ("chunked", "full")
    assert all(block.attn.attention == "chunked" for block in merged.blocks)


def test_set_execution_on_an_abstract_module() -> None:
    abstract = nnx.eval_shape(lambda: llama(TINY, nnx.Rngs(params=0)))
    abstract.set_execution("xla", "dots")
    graphdef, params = nnx.split(abstract, nnx.Param)
    merged = nnx.merge(graphdef, params)
    assert (merged.attention, merged.remat, merged.blocks[0].attn.attention) == ("xla", "dots", "xla")
    out = jax.eval_shape(lambda p: nnx.merge(graphdef, p)(INPUTS), params)
    assert out.shape == (2, 12, 61)


def test_set_execution_refuses_bad_names() -> None:
    module = llama(TINY, nnx.Rngs(params=0))
    with pytest.raises(ValueError, match="attention = 'flash'.*auto, xla, cudnn, chunked, reference"):
        module.set_execution("flash")
    with pytest.raises(ValueError, match="remat = 'some'.*none, full, dots"):
        module.set_execution("xla", "some")
    assert (module.attention, module.remat) == ("auto", "none")  # a refused choice changes nothing
