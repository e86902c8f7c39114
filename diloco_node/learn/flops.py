"""Model FLOPs and MFU: training FLOPs per token of a run's model, peak FLOP/s per device kind.

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B) is

    MFU = tokens/s x training FLOPs per token / (devices x peak FLOP/s of one device)

where the FLOPs are the model's own (forward + backward, no rematerialisation, no optimizer),
whatever the implementation actually executes.

Convention for the built-in "llama" factory (analytic, from its shape):

    flops_per_token = 6 N + 12 L H d_head T

- N: the parameters that take part in a matmul per token: q, k, v, o, gate, up, down of every
  layer and the output projection (`lm_head`, or the tied embedding used as one). The embedding
  *lookup* is a gather, not a matmul: a tied table counts once (as the output projection), an
  untied embedding table not at all. Norm scales are elementwise: not counted.
- 12 L H d_head T: attention's score (Q K^T) and value (A V) matmuls: forward 2 x 2 x T x d_head
  x H per layer per token, x 3 for training, T the sequence length. Causal attention is counted
  FULL (the T x T product, not the half below the diagonal): the convention of PaLM appendix B,
  MaxText (`calculate_tflops_training_per_device`, non-causal) and torchtitan
  (`get_num_flop_per_token`: 6N + 12 l h q t), so figures compare with theirs; it is also what the
  built-in llama executes (a full T x T einsum, masked afterwards).

For any other factory ("bytes", a user's own) the count is XLA's: the cost analysis of the
compiled forward + backward of the model's loss on one abstract batch, divided by its tokens;
computed once per model per process. XLA counts every floating-point op (softmax, norms,
elementwise), so it reads somewhat above the analytic count of the same model (see
tests/test_flops.py for the measured gap).

Peak figures are vendor datasheet dense bf16 (no 2:4 sparsity) per device; `None` where the
device is a CPU or unknown: MFU is then not reported rather than invented (`[node.mesh]
peak_tflops` sets it for any device).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from diloco_node.config.manifest import ModelSpec
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.learn.llama import LlamaConfig

# Peak dense bf16 FLOP/s of one device, matched as a case-insensitive substring of
# `jax.devices()[0].device_kind`, FIRST match wins: so the more specific names ("H100 PCIe",
# "v5 lite") come before the ones they contain ("H100", "v5"). Vendor datasheet figures, dense
# (the datasheets' headline numbers are with 2:4 sparsity, twice these).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),        # NVIDIA H100 PCIe datasheet: 1,513 TFLOPS sparse bf16
    ("H100 NVL", 835e12),         # NVIDIA H100 NVL datasheet: 1,671 TFLOPS sparse bf16
    ("H100", 989e12),             # H100 SXM (device kind "NVIDIA H100 80GB HBM3"): 1,979 sparse
    ("GH200", 989e12),            # Grace Hopper: the H100 SXM's tensor cores
    ("H200", 989e12),             # NVIDIA H200 SXM datasheet: 1,979 TFLOPS sparse bf16
    ("A100", 312e12),             # NVIDIA A100 SXM and PCIe datasheets: 312 dense bf16
    ("L40S", 362e12),             # NVIDIA L40S datasheet: 733 sparse bf16
    ("L4", 121e12),               # NVIDIA L4 datasheet: 242 TFLOPS sparse bf16
    ("A10G", 70e12),              # AWS's A10 variant: no NVIDIA datasheet; the commonly quoted
                                  # dense tensor figure (unverified here: set peak_tflops if known)
    ("A10", 125e12),              # NVIDIA A10 datasheet: 250 sparse bf16
    ("TPU v4", 275e12),           # Google Cloud TPU v4: 275 bf16 per chip
    ("TPU v5 lite", 197e12),      # TPU v5e (device kind "TPU v5 lite"): 197 bf16 per chip
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),          # TPU v5p: 459 bf16 per chip
    ("TPU v5", 459e12),           # v5p reports "TPU v5"
    ("TPU v6 lite", 918e12),      # Trillium / v6e (device kind "TPU v6 lite"): 918 bf16 per chip
    ("TPU v6e", 918e12),
)

# The abstract batch XLA's cost analysis compiles: one sequence of the model's full context.
# Every op scales with the batch (a matmul's flops, an elementwise op's), so one row measures
# per-token costs and compiles fastest; attention's T x T terms need the full seq_len.
COST_ANALYSIS_BATCH = 1


def llama_flops_per_token(config: LlamaConfig) -> float:
    """6 N + 12 L H d_head T for the built-in llama (module docstring: what N counts and why)."""
    d, K, H, G, F, V = config.d_model, config.head_dim, config.num_heads, config.num_kv_heads, config.d_ff, config.vocab_size
    attention = d * H * K + 2 * d * G * K + H * K * d      # q, k, v, o
    mlp = 3 * d * F                                          # gate, up, down
    output = d * V                                           # lm_head or the tied embedding, once
    matmul_params = config.num_layers * (attention + mlp) + output
    attention_scores = 12 * config.num_layers * H * K * config.seq_len
    return float(6 * matmul_params + attention_scores)


def xla_flops_per_token(spec: ModelSpec, batch_size: int = COST_ANALYSIS_BATCH) -> float:
    """XLA's count: the compiled forward + backward of the model's loss on an abstract batch of
    `batch_size` x seq_len tokens (nothing allocated, nothing run), divided by its tokens."""
    return _xla_flops_per_token(factory.recipe(spec), batch_size)


@functools.lru_cache(maxsize=16)
def _xla_flops_per_token(spec: ModelSpec, batch_size: int) -> float:
    graphdef, abstract = factory.abstract_model(spec)
    tokens = jax.ShapeDtypeStruct((batch_size, spec.seq_len), jnp.int32)
    grad = jax.value_and_grad(model_lib.loss_fn, argnums=1)
    compiled = jax.jit(functools.partial(grad, graphdef)).lower(abstract, tokens, tokens).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per computation
        analysis = analysis[0] if analysis else {}
    flops = float((analysis or {}).get("flops", 0.0))
    if not math.isfinite(flops) or flops <= 0:
        raise RuntimeError(f"model factory {spec.factory!r}: XLA's cost analysis reports no flops "
                           f"({flops!r}) on this backend; MFU cannot be computed for this model")
    return flops / (batch_size * spec.seq_len)


def flops_per_token(spec: ModelSpec) -> float:
    """Training FLOPs per token (forward + backward) of the run's model: analytic for "llama",
    XLA's cost analysis (cached) for every other factory."""
    if spec.factory == "llama":
        return llama_flops_per_token(LlamaConfig.from_dict(spec.factory_config()))
    return xla_flops_per_token(spec)


def peak_flops_per_device(device_kind: str, override_tflops: float = 0.0) -> float | None:
    """Peak dense bf16 FLOP/s of one device: `override_tflops` x 1e12 when > 0 (`[node.mesh]
    peak_tflops`), else the table's first match on `device_kind`; None for a CPU or a device the
    table does not know (MFU is then not reported)."""
    if override_tflops and override_tflops > 0:
        return float(override_tflops) * 1e12
    kind = device_kind.lower()
    if not kind or "cpu" in kind:
        return None
    for name, peak in PEAK_BF16_FLOPS:
        if name.lower() in kind:
            return peak
    return None


def mfu(tokens_per_s: float, flops_per_token: float | None, device_count: int,
        peak_per_device: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (can read above 1 only if the peak is wrong); None when a
    figure it needs is unknown or not positive."""
    if (flops_per_token is None or peak_per_device is None or device_count < 1 or peak_per_device <= 0
            or flops_per_token <= 0 or not math.isfinite(tokens_per_s) or tokens_per_s < 0):
        return None
    return tokens_per_s * flops_per_token / (device_count * peak_per_device)
