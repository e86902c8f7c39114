"""The byte-level decoder-only transformer (flax NNX) and its pure loss/eval functions.

Sizes are named (`MODEL_SIZES`): `tiny` for tests and the toy benchmark (~140k parameters),
`small` (~6M) and `medium` (~25M) for real runs. Tokens are raw bytes (vocabulary 256), so any
text or pre-tokenized uint8 stream trains without a tokenizer.

Parameters cross module boundaries as a flat `dict[str, np.ndarray]` keyed by the parameter path
joined with "/" (e.g. "blocks/0/attn/qkv/kernel"); `flat_params` / `load_flat_params` convert.
Token and position embeddings live under "embed/..." and "pos_embed/..." so the merge code can
tell them apart.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB_SIZE = 256  # bytes


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the transformer. `seq_len` bounds the positional embedding."""

    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    seq_len: int = 128
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model = {self.d_model} is not divisible by num_heads = {self.num_heads}")
        for name in ("d_model", "num_layers", "num_heads", "d_ff", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 1")


# Named sizes. tiny: fast enough for M = 4 learners on two CPU cores; small/medium for real runs.
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=64, num_layers=2, num_heads=4, d_ff=256),
    "small": ModelConfig(d_model=256, num_layers=8, num_heads=8, d_ff=1024),
    "medium": ModelConfig(d_model=512, num_layers=8, num_heads=8, d_ff=2048),
}


def model_config(size: str, seq_len: int = 128) -> ModelConfig:
    """The named size with the given context length; a clear error for an unknown name."""
    if size not in MODEL_SIZES:
        raise ValueError(f"model size {size!r}: must be one of {', '.join(MODEL_SIZES)}")
    base = MODEL_SIZES[size]
    return ModelConfig(base.d_model, base.num_layers, base.num_heads, base.d_ff, seq_len, base.vocab_size)


class Attention(nnx.Module):
    """Causal multi-head self-attention with one fused qkv projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.num_heads = cfg.num_heads
        self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, use_bias=False, param_dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(cfg.d_model, cfg.d_model, use_bias=False, param_dtype=jnp.float32, rngs=rngs,
                              kernel_init=nnx.initializers.normal(0.02 / np.sqrt(2 * cfg.num_layers)))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        B, L, D = x_BxLxD.shape
        H = self.num_heads
        qkv_BxLx3D = self.qkv(x_BxLxD)
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = jnp.split(qkv_BxLx3D.reshape(B, L, 3 * H, D // H), 3, axis=2)
        scores_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k_BxLxHxK) / np.sqrt(D // H).astype(np.float32)
        causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
        scores_BxHxLxL = jnp.where(causal_LxL, scores_BxHxLxL, jnp.finfo(jnp.float32).min)
        weights_BxHxLxL = jax.nn.softmax(scores_BxHxLxL, axis=-1)
        out_BxLxHxK = jnp.einsum("bhlm,bmhk->blhk", weights_BxHxLxL, v_BxLxHxK)
        return self.out(out_BxLxHxK.reshape(B, L, D))


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, param_dtype=jnp.float32, rngs=rngs)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, param_dtype=jnp.float32, rngs=rngs,
                               kernel_init=nnx.initializers.normal(0.02 / np.sqrt(2 * cfg.num_layers)))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x_BxLxD)))


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.d_model, param_dtype=jnp.float32, rngs=rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, param_dtype=jnp.float32, rngs=rngs)
        self.mlp = Mlp(cfg, rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.ln1(x_BxLxD))
        return x_BxLxD + self.mlp(self.ln2(x_BxLxD))


class Transformer(nnx.Module):
    """Decoder-only byte transformer: token + learned position embeddings, N blocks, untied head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        embed_init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=jnp.float32, embedding_init=embed_init, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, param_dtype=jnp.float32, embedding_init=embed_init, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, param_dtype=jnp.float32, rngs=rngs)
        # Default (lecun) head init: a 0.02-std head measured 12% worse eval loss after 600 tiny steps.
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        L = tokens_BxL.shape[1]
        x_BxLxD = self.embed(tokens_BxL) + self.pos_embed(jnp.arange(L))[None]
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        return self.head(self.ln_f(x_BxLxD))  # logits_BxLxV


BYTE_MODEL_KEYS = ("size", "d_model", "num_layers", "num_heads", "d_ff", "vocab_size", "seq_len")


def byte_transformer(config: Mapping[str, Any], rngs: nnx.Rngs) -> Transformer:
    """The "bytes" model factory: a named `size` (tiny, small, medium; default tiny) whose
    d_model, num_layers, num_heads and d_ff may each be overridden, with the run's vocab_size
    and seq_len."""
    unknown = sorted(set(config) - set(BYTE_MODEL_KEYS))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for the bytes model; known: {', '.join(BYTE_MODEL_KEYS)}")
    base = model_config(str(config.get("size", "tiny")))
    shape = {key: config[key] for key in ("d_model", "num_layers", "num_heads", "d_ff") if key in config}
    cfg = dataclasses.replace(base, seq_len=int(config["seq_len"]), vocab_size=int(config["vocab_size"]), **shape)
    return Transformer(cfg, rngs)


def init_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A freshly initialised model; the same seed gives the same parameters bit for bit."""
    return Transformer(cfg, nnx.Rngs(params=seed))


def split_model(model: Transformer) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) for pure functions; the model has only nnx.Param state."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, inputs_BxL: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """The module's own `loss(inputs, targets)` when it has one, else the mean next-token
    cross-entropy (nats per token) of its logits. Pure: usable under jit, grad and vmap."""
    model = nnx.merge(graphdef, params)
    own_loss = getattr(model, "loss", None)
    if callable(own_loss):
        return own_loss(inputs_BxL, targets_BxL)
    logits_BxLxV = model(inputs_BxL)
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    nll_BxL = -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.mean(nll_BxL)


@functools.lru_cache(maxsize=16)
def eval_fn_for(cfg: ModelConfig):
    """`make_eval_fn` for a model shape, built once per process so its compilation is reused."""
    graphdef, _ = split_model(init_model(cfg, 0))
    return make_eval_fn(graphdef)


def make_eval_fn(graphdef: nnx.GraphDef):
    """A jitted `eval(params, inputs_NxBxL, targets_NxBxL) -> mean loss` over N fixed batches."""

    @jax.jit
    def evaluate(params: nnx.State, inputs_NxBxL: jax.Array, targets_NxBxL: jax.Array) -> jax.Array:
        losses_N = jax.lax.map(lambda batch: loss_fn(graphdef, params, batch[0], batch[1]),
                               (inputs_NxBxL, targets_NxBxL))
        return jnp.mean(losses_N)

    return evaluate


def path_name(path: tuple) -> str:
    """A parameter's flat name, e.g. "blocks/0/attn/qkv/kernel", from its NNX state path."""
    return "/".join(str(part) for part in path)


def flat_params(params: nnx.State) -> dict[str, np.ndarray]:
    """Flat `{"a/b/kernel": float32 array}` host copies of the parameters."""
    return {path_name(path): np.asarray(leaf, dtype=np.float32).copy()
            for path, leaf in nnx.to_flat_state(params)}


def param_shapes(params: nnx.State) -> dict[str, tuple[int, ...]]:
    return {path_name(path): tuple(leaf.shape) for path, leaf in nnx.to_flat_state(params)}


def load_flat_params(params: nnx.State, flat: Mapping[str, np.ndarray]) -> nnx.State:
    """A new State like `params` with the named tensors replaced; unknown names or shapes are errors."""
    by_name = {path_name(path): path for path, _ in nnx.to_flat_state(params)}
    unknown = sorted(set(flat) - set(by_name))
    if unknown:
        raise KeyError(f"unknown parameter name(s): {', '.join(unknown[:5])}")
    pure = nnx.to_pure_dict(params)
    for name, value in flat.items():
        node = pure
        path = by_name[name]
        for part in path[:-1]:
            node = node[part]
        old = node[path[-1]]
        if tuple(old.shape) != tuple(np.shape(value)):
            raise ValueError(f"parameter {name}: shape {np.shape(value)} != expected {tuple(old.shape)}")
        node[path[-1]] = jnp.asarray(value, dtype=jnp.float32)
    new = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(new, pure)
    return new


def count_params(params: nnx.State) -> int:
    return int(sum(int(np.prod(leaf.shape)) for _, leaf in nnx.to_flat_state(params)))
