"""An example of bringing your own model to diloco-node: a small GRU-free, attention-free
language model (token embedding, a causal depthwise convolution mixer, an MLP, a head).

diloco-node calls `build(config, rngs)` at every site, witnesses included, with every key of
`[run.model]` except `factory` (so `vocab_size`, `seq_len` and this model's own `width`,
`depth`, `kernel`), and an `nnx.Rngs` seeded from the run's seed. The module must map int32
tokens [B, L] to logits [B, L, vocab_size] and keep its state in float32 `nnx.Param`s. See
docs/MODELS.md for the optional `loss` and `embedding_names` methods.

Make the module importable at every site, e.g. `PYTHONPATH=/opt/models` in the systemd unit
(`Environment=PYTHONPATH=/opt/models`), or install it as a package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

KNOWN = {"vocab_size", "seq_len", "width", "depth", "kernel"}


class CausalConvBlock(nnx.Module):
    """x + MLP(norm(x + causal depthwise conv(norm(x)))): mixes each position with the previous
    `kernel - 1` ones only, so no token sees the future."""

    def __init__(self, width: int, kernel: int, rngs: nnx.Rngs) -> None:
        self.kernel = kernel
        self.norm1 = nnx.RMSNorm(width, rngs=rngs)
        self.mix = nnx.Param(jax.random.normal(rngs.params(), (kernel, width)) * 0.1)
        self.norm2 = nnx.RMSNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        h_BxLxD = self.norm1(x_BxLxD)
        padded = jnp.pad(h_BxLxD, ((0, 0), (self.kernel - 1, 0), (0, 0)))  # left padding: causal
        length = x_BxLxD.shape[1]
        mixed = sum(padded[:, k:k + length] * self.mix[...][k] for k in range(self.kernel))
        x_BxLxD = x_BxLxD + mixed
        return x_BxLxD + self.down(jax.nn.gelu(self.up(self.norm2(x_BxLxD))))


class ConvLM(nnx.Module):
    def __init__(self, vocab_size: int, width: int, depth: int, kernel: int, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab_size, width, rngs=rngs)
        self.blocks = nnx.List([CausalConvBlock(width, kernel, rngs) for _ in range(depth)])
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        x_BxLxD = self.embed(tokens_BxL)
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        return self.head(self.norm(x_BxLxD))


def build(config: Mapping[str, Any], rngs: nnx.Rngs) -> ConvLM:
    """The factory named in `[run.model] factory = "my_lm:build"`."""
    unknown = set(config) - KNOWN
    if unknown:
        raise ValueError(f"unknown option(s) for my_lm: {', '.join(sorted(unknown))}")
    return ConvLM(int(config["vocab_size"]), int(config.get("width", 64)), int(config.get("depth", 2)),
                  int(config.get("kernel", 4)), rngs)
