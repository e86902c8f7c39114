"""The "llama" model factory: a Llama-style decoder (RMSNorm, rotary positions, SwiGLU,
grouped-query attention, optional tied embeddings) in flax NNX.

Parameters are float32 (what the merge and the wire carry); `compute_dtype = "bfloat16"` runs the
matmuls and activations in bf16 and returns float32 logits. Named presets (`size`) go from ~1M
parameters (tests) to ~1B (a Llama-3.2-1B-like shape: configuration only on this project's CPU
machines); any key given explicitly overrides the preset's value.

Flat parameter names: "embed/embedding", "blocks/<i>/attn/{q,k,v,o}/kernel",
"blocks/<i>/mlp/{gate,up,down}/kernel", "blocks/<i>/{attn_norm,mlp_norm}/scale", "norm/scale",
and "lm_head/kernel" when the embeddings are not tied. The embedding table is the one parameter
the merge treats as an embedding (`embedding_names`).

How attention is computed (learn/attention.py) and what the blocks rematerialise are a site's
choices, not the run's: `Llama.set_execution` sets them on a built (or abstract) module; they
change memory and speed, never the parameters or the function computed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from diloco_node.config.site_devices import REMAT_CHOICES
from diloco_node.learn.attention import DEFAULT_CHUNK_SIZE, causal_attention, check_choice

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    seq_len: int
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    d_ff: int = 384
    tie_embeddings: bool = True
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    compute_dtype: str = "float32"
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"llama {name} = {value!r}: must be an integer >= 1")
        if self.d_model % self.num_heads:
            raise ValueError(f"llama num_heads = {self.num_heads}: must divide d_model = {self.d_model}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"llama num_kv_heads = {self.num_kv_heads}: must divide num_heads = {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"llama head dimension d_model / num_heads = {self.head_dim}: must be even (rotary pairs)")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"llama compute_dtype = {self.compute_dtype!r}: must be one of {', '.join(COMPUTE_DTYPES)}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
                raise ValueError(f"llama {name} = {value!r}: must be a positive number")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"llama tie_embeddings = {self.tie_embeddings!r}: must be true or false")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """From `[run.model]` options: a preset (`size`), then explicit keys; unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known - {"size"})
        if unknown:
            raise ValueError(f"unknown llama option(s) {', '.join(unknown)}; known: size, {', '.join(sorted(known))}")
        size = config.get("size", "1m")
        if size not in LLAMA_PRESETS:
            raise ValueError(f"llama size = {size!r}: must be one of {', '.join(LLAMA_PRESETS)}")
        values = {**LLAMA_PRESETS[size], **{k: v for k, v in config.items() if k != "size"}}
        if isinstance(values.get("rope_theta"), int):
            values["rope_theta"] = float(values["rope_theta"])
        return cls(**values)


# Shapes by name; vocab_size and seq_len always come from [run.model]. Parameters (tied
# embeddings, counted by `param_count`): 1m 0.82M at vocab 256 (4.9M at 32,000), 10m 14.5M and
# 100m 100M at 32,000, 1b 1.24B at 128,256 (Llama-3.2-1B's shape).
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "1m": {"d_model": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "d_ff": 384},
    "10m": {"d_model": 256, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "d_ff": 768},
    "100m": {"d_model": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4, "d_ff": 2048},
    "1b": {"d_model": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "d_ff": 8192,
           "rope_theta": 500_000.0},
}


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, the statistics in float32 whatever the compute dtype."""

    def __init__(self, width: int, eps: float) -> None:
        self.scale = nnx.Param(jnp.ones((width,), jnp.float32))
        self.eps = eps

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x32 = x_BxLxD.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x_BxLxD.dtype)


def rotary(x_BxLxHxK: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding: each (even, odd) pair of channels rotated by position * frequency."""
    length, half = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1] // 2
    frequencies_K2 = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles_LxK2 = jnp.arange(length, dtype=jnp.float32)[:, None] * frequencies_K2[None, :]
    cos = jnp.cos(angles_LxK2)[None, :, None, :]
    sin = jnp.sin(angles_LxK2)[None, :, None, :]
    x32 = x_BxLxHxK.astype(jnp.float32)
    even, odd = x32[..., 0::2], x32[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x_BxLxHxK.shape).astype(x_BxLxHxK.dtype)


def _dense(d_in: int, d_out: int, std: float, dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, param_dtype=jnp.float32, dtype=dtype,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


class Attention(nnx.Module):
    """Causal grouped-query attention: num_kv_heads key/value heads shared by num_heads queries."""

    def __init__(self, cfg: LlamaConfig, dtype: Any, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # residual branches scaled by depth
        self.q = _dense(cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.init_std, dtype, rngs)
        self.k = _dense(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, cfg.init_std, dtype, rngs)
        self.v = _dense(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, cfg.init_std, dtype, rngs)
        self.o = _dense(cfg.num_heads * cfg.head_dim, cfg.d_model, out_std, dtype, rngs)
        # Site execution choices (`Llama.set_execution`): static, so they travel in the GraphDef.
        self.attention = "auto"
        self.chunk_size = DEFAULT_CHUNK_SIZE

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        cfg = self.cfg
        B, L, _ = x_BxLxD.shape
        H, G, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_BxLxHxK = rotary(self.q(x_BxLxD).reshape(B, L, H, K), cfg.rope_theta)
        k_BxLxGxK = rotary(self.k(x_BxLxD).reshape(B, L, G, K), cfg.rope_theta)
        v_BxLxGxK = self.v(x_BxLxD).reshape(B, L, G, K)
        out_BxLxHxK = causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation=self.attention,
                                       chunk_size=self.chunk_size)
        return self.o(out_BxLxHxK.reshape(B, L, H * K))


class SwiGLU(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype: Any, rngs: nnx.Rngs) -> None:
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.gate = _dense(cfg.d_model, cfg.d_ff, cfg.init_std, dtype, rngs)
        self.up = _dense(cfg.d_model, cfg.d_ff, cfg.init_std, dtype, rngs)
        self.down = _dense(cfg.d_ff, cfg.d_model, out_std, dtype, rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x_BxLxD)) * self.up(x_BxLxD))


class Block(nnx.Module):
    """Pre-norm: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, dtype: Any, rngs: nnx.Rngs) -> None:
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, dtype, rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD))
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))


# What `jax.checkpoint` may keep of a block's forward for the backward pass, by `remat` choice:
# "full" keeps nothing but the block's input (everything recomputed); "dots" keeps the outputs
# of matmuls without batch dimensions (the projections and MLP), recomputing norms, rotary,
# activations and attention's batched score products.
_REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def apply_block(block: Block, x_BxLxD: jax.Array, remat: str = "none") -> jax.Array:
    """`block(x)`, rematerialised in the backward pass as `remat` (one of REMAT_CHOICES) says."""
    if remat == "none":
        return block(x_BxLxD)
    if remat not in _REMAT_POLICIES:
        raise ValueError(f"remat = {remat!r}: must be one of {', '.join(REMAT_CHOICES)}")
    return nnx.remat(lambda b, x: b(x), policy=_REMAT_POLICIES[remat])(block, x_BxLxD)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        dtype = COMPUTE_DTYPES[cfg.compute_dtype]
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=jnp.float32, dtype=dtype,
                               embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = _dense(cfg.d_model, cfg.vocab_size, cfg.init_std, dtype, rngs)
        # Site execution choices: plain attributes, static in `nnx.split`'s GraphDef, so a step
        # jitted from the graphdef computes with them; no parameter depends on them.
        self.attention = "auto"
        self.remat = "none"

    def set_execution(self, attention: str = "auto", remat: str = "none", *,
                      chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        """This site's way of computing the same model (`[node.mesh] attention` and `remat`):
        `attention` one of ATTENTION_CHOICES (learn/attention.py), `remat` one of REMAT_CHOICES
        ("full": each block's forward recomputed in the backward pass; "dots": only matmul
        outputs kept). Parameters are untouched; works on an abstract (`nnx.eval_shape`) module."""
        check_choice(attention)
        if remat not in REMAT_CHOICES:
            raise ValueError(f"remat = {remat!r}: must be one of {', '.join(REMAT_CHOICES)}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"attention chunk_size = {chunk_size!r}: must be an integer >= 1")
        self.attention, self.remat = attention, remat
        for block in self.blocks:
            block.attn.attention, block.attn.chunk_size = attention, chunk_size

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        x_BxLxD = self.embed(tokens_BxL)
        for block in self.blocks:
            x_BxLxD = apply_block(block, x_BxLxD, self.remat)
        x_BxLxD = self.norm(x_BxLxD)
        if self.cfg.tie_embeddings:
            logits_BxLxV = self.embed.attend(x_BxLxD)
        else:
            logits_BxLxV = self.lm_head(x_BxLxD)
        return logits_BxLxV.astype(jnp.float32)

    def embedding_names(self) -> list[str]:
        return ["embed/embedding"]


def llama(config: Mapping[str, Any], rngs: nnx.Rngs) -> Llama:
    """The "llama" factory: `[run.model]` options (see `LlamaConfig`, `LLAMA_PRESETS`)."""
    return Llama(LlamaConfig.from_dict(config), rngs)


def param_count(config: Mapping[str, Any]) -> int:
    """Parameters of the configured model, counted without allocating them."""
    abstract = nnx.eval_shape(lambda: llama(config, nnx.Rngs(params=0)))
    return sum(math.prod(leaf.shape) for _, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
