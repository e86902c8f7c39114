"""Causal grouped-query attention for the llama factory, by a site's choice of implementation.

One responsibility: `causal_attention(q, k, v, implementation=...)` computes the same function,
softmax(q k^T / sqrt(K)) v with a causal mask, by one of `ATTENTION_CHOICES`; the choices differ
in memory and speed only (`[node.mesh] attention`, so sites of one run may differ):

- "reference": the einsum over fp32 scores [B, G, R, L, L]; the ground truth of the tests.
- "xla": `jax.nn.dot_product_attention(implementation="xla")`; it too builds [L, L] scores.
- "cudnn": cuDNN's fused flash attention (NVIDIA GPUs, bf16/fp16 inputs only).
- "chunked": pure JAX, queries and keys in chunks with an online softmax, a flash-style custom
  backward; it never builds [L, L] scores, so its memory grows linearly with the context.
- "auto": one of the above, chosen at trace time by `resolve_attention`.

Rotary positions are applied by the caller. H query heads read G key/value heads (H % G == 0):
query head h reads kv head h // (H / G), as the llama model has always grouped them.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from diloco_node.config.site_devices import ATTENTION_CHOICES

# Query and key chunk of "chunked". Its working set per step is B * H * CHUNK^2 fp32 scores
# (32 MiB at 32 heads, B = 1), small next to the [L, L] scores it replaces from L = 2048 on,
# yet large enough that each step's matmuls keep an accelerator's units busy.
DEFAULT_CHUNK_SIZE = 512

# "auto" picks "chunked" over "xla" from this context length on, where no fused kernel exists:
# below it XLA's [L, L] fp32 scores (16 MiB per head at 2048) are cheap and its single pair of
# large matmuls is faster than a loop over chunks; from it on the scores grow quadratically
# (at 8192: 8 GiB per layer for 32 heads) and dominate a layer's memory.
CHUNKED_MIN_SEQ_LEN = 2048

# cuDNN's flash attention takes head dimensions that are multiples of 8, up to 128 on every
# supported GPU generation; "auto" does not pick it for other shapes.
CUDNN_MAX_HEAD_DIM = 128
CUDNN_HEAD_DIM_MULTIPLE = 8

# Masked scores in "chunked": finite, so that (masked - running max) never becomes inf - inf;
# 0.7 of the fp32 maximum leaves room to subtract any real score without overflowing.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_choice(attention: str) -> str:
    """`attention` if it is one of ATTENTION_CHOICES, else a ValueError naming them."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention = {attention!r}: must be one of {', '.join(ATTENTION_CHOICES)}")
    return attention


def resolve_attention(choice: str, platform: str, dtype: Any, seq_len: int, head_dim: int | None = None) -> str:
    """The implementation that `choice` means on `platform` ("cpu", "gpu", "tpu") for inputs of
    `dtype` and context `seq_len`: a concrete choice is itself; "auto" is "cudnn" on a GPU with
    bf16/fp16 inputs (and a head dimension cuDNN takes, when given), else "chunked" from
    CHUNKED_MIN_SEQ_LEN on, else "xla"."""
    check_choice(choice)
    if choice != "auto":
        return choice
    cudnn_head = head_dim is None or (head_dim % CUDNN_HEAD_DIM_MULTIPLE == 0 and head_dim <= CUDNN_MAX_HEAD_DIM)
    if platform == "gpu" and jnp.dtype(dtype) in _HALF_DTYPES and cudnn_head:
        return "cudnn"
    if seq_len >= CHUNKED_MIN_SEQ_LEN:
        return "chunked"
    return "xla"


def causal_attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, *,
                     implementation: str = "auto", chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
    """Causal attention of H query heads over G key/value heads; out [B, L, H, K] in q's dtype.

    `implementation` is one of ATTENTION_CHOICES ("auto" resolves here, at trace time, from the
    default backend); `chunk_size` is used by "chunked" only.
    """
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    if k_BxLxGxK.shape != (B, L, G, K) or v_BxLxGxK.shape != (B, L, G, K) or H % G:
        raise ValueError(f"attention shapes: q {q_BxLxHxK.shape}, k {k_BxLxGxK.shape}, v {v_BxLxGxK.shape}; "
                         "expected q [B, L, H, K] and k, v [B, L, G, K] with G dividing H")
    if not (k_BxLxGxK.dtype == v_BxLxGxK.dtype == q_BxLxHxK.dtype):
        raise ValueError(f"attention dtypes differ: q {q_BxLxHxK.dtype}, k {k_BxLxGxK.dtype}, v {v_BxLxGxK.dtype}")
    chosen = resolve_attention(implementation, jax.default_backend(), q_BxLxHxK.dtype, L, K)
    if chosen == "reference":
        return _reference(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    if chosen == "xla":
        return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True, implementation="xla")
    if chosen == "cudnn":
        _check_cudnn(q_BxLxHxK.dtype)
        return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True,
                                            implementation="cudnn")
    return _chunked(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, chunk_size)


def _check_cudnn(dtype: Any) -> None:
    """A clear error before XLA would fail deep inside the cuDNN custom call."""
    if jnp.dtype(dtype) not in _HALF_DTYPES:
        raise ValueError(f"attention = 'cudnn' needs bfloat16 or float16 inputs, got {jnp.dtype(dtype)}: set the "
                         "model's compute_dtype = \"bfloat16\", or choose one of "
                         f"{', '.join(c for c in ATTENTION_CHOICES if c != 'cudnn')}")
    platform = jax.default_backend()
    if platform != "gpu":
        raise ValueError(f"attention = 'cudnn' needs an NVIDIA GPU, but JAX runs on {platform!r}: choose one of "
                         f"{', '.join(c for c in ATTENTION_CHOICES if c != 'cudnn')}")


def _reference(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array) -> jax.Array:
    """The llama model's original attention: fp32 scores [B, G, R, L, L], masked, softmaxed."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    # Each group of R = H / G query heads reads one key/value head.
    q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
    scores_BxGxRxLxL = jnp.einsum("blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxLxGxK).astype(jnp.float32)
    scores_BxGxRxLxL = scores_BxGxRxLxL / math.sqrt(K)
    causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
    scores_BxGxRxLxL = jnp.where(causal_LxL, scores_BxGxRxLxL, jnp.finfo(jnp.float32).min)
    weights_BxGxRxLxL = jax.nn.softmax(scores_BxGxRxLxL, axis=-1).astype(v_BxLxGxK.dtype)
    out_BxLxGxRxK = jnp.einsum("bgrlm,bmgk->blgrk", weights_BxGxRxLxL, v_BxLxGxK)
    return out_BxLxGxRxK.reshape(B, L, H, K)


# ---- "chunked": flash-style attention in pure JAX ------------------------------------------
#
# Queries are split into chunks of C; for query chunk i an online softmax (running max m,
# running sum l, running weighted values acc, all fp32) runs over key chunks j = 0..i only: the
# chunks above the diagonal are skipped, not masked, so the work is about half of the full
# [L, L] product. The loop bound depends on i, so these loops are while loops, which JAX cannot
# differentiate: the backward pass is our own (custom_vjp), recomputing each chunk's scores from
# the saved log-sum-exp as FlashAttention-2 does. Forward and backward keep O(L) state plus one
# [B, H, C, C] block of scores: memory linear in L.
#
# A context L that the chunk does not divide is padded at the end to a multiple of C. Padded
# keys come after every real query, so the causal mask hides them; padded queries' outputs are
# cut off, so their gradients are zero. A context shorter than the chunk is one chunk of L.


def _chunked(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, chunk_size: int) -> jax.Array:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"attention chunk_size = {chunk_size!r}: must be an integer >= 1")
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    chunk = min(chunk_size, L)
    padded = -(-L // chunk) * chunk
    pad = ((0, 0), (0, padded - L), (0, 0), (0, 0))
    q_BxPxGxRxK = jnp.pad(q_BxLxHxK, pad).reshape(B, padded, G, H // G, K)
    out_BxPxGxRxK = _flash(q_BxPxGxRxK, jnp.pad(k_BxLxGxK, pad), jnp.pad(v_BxLxGxK, pad), chunk)
    return out_BxPxGxRxK.reshape(B, padded, H, K)[:, :L]


def _scores(q_BxCxGxRxK: jax.Array, k_BxCxGxK: jax.Array, i: jax.Array, j: jax.Array, chunk: int) -> jax.Array:
    """Scaled fp32 scores of query chunk i against key chunk j, keys after their query masked."""
    scale = 1.0 / math.sqrt(q_BxCxGxRxK.shape[-1])
    s_BxGxRxCxC = jnp.einsum("bqgrk,bcgk->bgrqc", q_BxCxGxRxK, k_BxCxGxK,
                             preferred_element_type=jnp.float32) * scale
    q_pos_Cx1 = i * chunk + jnp.arange(chunk)[:, None]
    k_pos_1xC = j * chunk + jnp.arange(chunk)[None, :]
    return jnp.where(k_pos_1xC <= q_pos_Cx1, s_BxGxRxCxC, _MASK_VALUE)


def _slice(x: jax.Array, index: jax.Array, chunk: int, axis: int = 1) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, index * chunk, chunk, axis=axis)


def _flash_forward(q_BxPxGxRxK: jax.Array, k_BxPxGxK: jax.Array, v_BxPxGxK: jax.Array,
                   chunk: int) -> tuple[jax.Array, jax.Array]:
    """(out [B, P, G, R, K] in q's dtype, log-sum-exp [B, G, R, P] fp32)."""
    B, P, G, R, K = q_BxPxGxRxK.shape
    n = P // chunk

    def query_chunk(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        q_i = _slice(q_BxPxGxRxK, i, chunk)

        def key_chunk(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
            m_BxGxRxC, l_BxGxRxC, acc_BxGxRxCxK = carry
            s_BxGxRxCxC = _scores(q_i, _slice(k_BxPxGxK, j, chunk), i, j, chunk)
            m_new = jnp.maximum(m_BxGxRxC, jnp.max(s_BxGxRxCxC, axis=-1))
            rescale = jnp.exp(m_BxGxRxC - m_new)
            p_BxGxRxCxC = jnp.exp(s_BxGxRxCxC - m_new[..., None])
            pv_BxGxRxCxK = jnp.einsum("bgrqc,bcgk->bgrqk", p_BxGxRxCxC.astype(v_BxPxGxK.dtype),
                                      _slice(v_BxPxGxK, j, chunk), preferred_element_type=jnp.float32)
            return (m_new, l_BxGxRxC * rescale + jnp.sum(p_BxGxRxCxC, axis=-1),
                    acc_BxGxRxCxK * rescale[..., None] + pv_BxGxRxCxK)

        init = (jnp.full((B, G, R, chunk), _MASK_VALUE, jnp.float32), jnp.zeros((B, G, R, chunk), jnp.float32),
                jnp.zeros((B, G, R, chunk, K), jnp.float32))
        # Key chunks 0..i: every query row sees key 0 in chunk 0, so l > 0 and m is a real score.
        m_BxGxRxC, l_BxGxRxC, acc_BxGxRxCxK = lax.fori_loop(0, i + 1, key_chunk, init)
        out_BxGxRxCxK = acc_BxGxRxCxK / l_BxGxRxC[..., None]
        return (jnp.transpose(out_BxGxRxCxK, (0, 3, 1, 2, 4)).astype(q_BxPxGxRxK.dtype),
                m_BxGxRxC + jnp.log(l_BxGxRxC))

    out_NxBxCxGxRxK, lse_NxBxGxRxC = lax.map(query_chunk, jnp.arange(n))
    out_BxPxGxRxK = jnp.moveaxis(out_NxBxCxGxRxK, 0, 1).reshape(B, P, G, R, K)
    lse_BxGxRxP = jnp.transpose(lse_NxBxGxRxC, (1, 2, 3, 0, 4)).reshape(B, G, R, P)
    return out_BxPxGxRxK, lse_BxGxRxP


def _flash_fwd_rule(q_BxPxGxRxK, k_BxPxGxK, v_BxPxGxK, chunk):
    out_BxPxGxRxK, lse_BxGxRxP = _flash_forward(q_BxPxGxRxK, k_BxPxGxK, v_BxPxGxK, chunk)
    return out_BxPxGxRxK, (q_BxPxGxRxK, k_BxPxGxK, v_BxPxGxK, out_BxPxGxRxK, lse_BxGxRxP)


def _flash_bwd_rule(chunk, residuals, dout_BxPxGxRxK):
    q_BxPxGxRxK, k_BxPxGxK, v_BxPxGxK, out_BxPxGxRxK, lse_BxGxRxP = residuals
    B, P, G, R, K = q_BxPxGxRxK.shape
    n = P // chunk
    scale = 1.0 / math.sqrt(K)
    # D = rowsum(dO * O): the softmax's backward term, one number per query row.
    delta_BxGxRxP = jnp.einsum("bpgrk,bpgrk->bgrp", dout_BxPxGxRxK.astype(jnp.float32),
                               out_BxPxGxRxK.astype(jnp.float32))
    dout_BxPxGxRxK = dout_BxPxGxRxK.astype(q_BxPxGxRxK.dtype)

    def query_chunk(i: jax.Array, grads: tuple[jax.Array, jax.Array, jax.Array]):
        q_i, do_i = _slice(q_BxPxGxRxK, i, chunk), _slice(dout_BxPxGxRxK, i, chunk)
        lse_i, delta_i = _slice(lse_BxGxRxP, i, chunk, axis=3), _slice(delta_BxGxRxP, i, chunk, axis=3)

        def key_chunk(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array, jax.Array]):
            dq_i, dq_all, dk_BxPxGxK, dv_BxPxGxK = carry
            k_j, v_j = _slice(k_BxPxGxK, j, chunk), _slice(v_BxPxGxK, j, chunk)
            p_BxGxRxCxC = jnp.exp(_scores(q_i, k_j, i, j, chunk) - lse_i[..., None])
            dv_j = jnp.einsum("bgrqc,bqgrk->bcgk", p_BxGxRxCxC.astype(do_i.dtype), do_i,
                              preferred_element_type=jnp.float32)
            dp_BxGxRxCxC = jnp.einsum("bqgrk,bcgk->bgrqc", do_i, v_j, preferred_element_type=jnp.float32)
            ds_BxGxRxCxC = (p_BxGxRxCxC * (dp_BxGxRxCxC - delta_i[..., None]) * scale).astype(q_i.dtype)
            dq_i = dq_i + jnp.einsum("bgrqc,bcgk->bqgrk", ds_BxGxRxCxC, k_j, preferred_element_type=jnp.float32)
            dk_j = jnp.einsum("bgrqc,bqgrk->bcgk", ds_BxGxRxCxC, q_i, preferred_element_type=jnp.float32)
            dk_BxPxGxK = lax.dynamic_update_slice_in_dim(dk_BxPxGxK, _slice(dk_BxPxGxK, j, chunk) + dk_j,
                                                         j * chunk, axis=1)
            dv_BxPxGxK = lax.dynamic_update_slice_in_dim(dv_BxPxGxK, _slice(dv_BxPxGxK, j, chunk) + dv_j,
                                                         j * chunk, axis=1)
            return dq_i, dq_all, dk_BxPxGxK, dv_BxPxGxK

        dq_all, dk_BxPxGxK, dv_BxPxGxK = grads
        dq_i = jnp.zeros((B, chunk, G, R, K), jnp.float32)
        dq_i, dq_all, dk_BxPxGxK, dv_BxPxGxK = lax.fori_loop(0, i + 1, key_chunk,
                                                             (dq_i, dq_all, dk_BxPxGxK, dv_BxPxGxK))
        return lax.dynamic_update_slice_in_dim(dq_all, dq_i, i * chunk, axis=1), dk_BxPxGxK, dv_BxPxGxK

    zeros_kv = jnp.zeros((B, P, G, K), jnp.float32)
    dq, dk, dv = lax.fori_loop(0, n, query_chunk, (jnp.zeros((B, P, G, R, K), jnp.float32), zeros_kv, zeros_kv))
    return dq.astype(q_BxPxGxRxK.dtype), dk.astype(k_BxPxGxK.dtype), dv.astype(v_BxPxGxK.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BxPxGxRxK: jax.Array, k_BxPxGxK: jax.Array, v_BxPxGxK: jax.Array, chunk: int) -> jax.Array:
    """Chunked causal attention on padded [B, P, G, R, K] queries; gradients by `_flash_bwd_rule`."""
    return _flash_forward(q_BxPxGxRxK, k_BxPxGxK, v_BxPxGxK, chunk)[0]


_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)
