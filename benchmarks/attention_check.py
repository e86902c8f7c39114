"""Attention on this host's accelerator: every `[node.mesh] attention` choice against the
reference, values and gradients, in bf16; then a tiny bf16 llama's loss and gradients with each
attention and remat choice. Meant for a GPU (cuDNN's fused attention cannot run on a CPU, where
tests/test_attention.py covers the rest); prints one line per case, FAILED with the error when a
choice cannot run here.

    python benchmarks/attention_check.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from diloco_node.learn import model as model_lib  # noqa: E402
from diloco_node.learn.attention import causal_attention, resolve_attention  # noqa: E402
from diloco_node.learn.llama import llama  # noqa: E402

TINY = {"vocab_size": 61, "seq_len": 128, "size": "1m", "d_model": 128, "num_layers": 2, "num_heads": 2,
        "num_kv_heads": 1, "d_ff": 256, "compute_dtype": "bfloat16"}


def attention_cases(rng: np.random.Generator) -> int:
    failures = 0
    for length, heads, kv_heads in [(256, 8, 2), (200, 8, 8)]:
        shapes = [(2, length, heads, 64), (2, length, kv_heads, 64), (2, length, kv_heads, 64)]
        q, k, v = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in shapes)

        def run(implementation, q, k, v):
            def attend(q, k, v):
                return causal_attention(q, k, v, implementation=implementation, chunk_size=64)

            out = jax.jit(attend)(q, k, v)
            grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(3 * attend(q, k, v).astype(jnp.float32))),
                                     argnums=(0, 1, 2)))(q, k, v)
            return out.astype(jnp.float32), [g.astype(jnp.float32) for g in grads]

        out_ref, grads_ref = run("reference", *(x.astype(jnp.float32) for x in (q, k, v)))
        for implementation in ["reference", "xla", "cudnn", "chunked", "auto"]:
            try:
                out, grads = run(implementation, q, k, v)
                errors = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(grads, grads_ref)]
                print(f"L={length} H={heads} G={kv_heads} {implementation:<9} max |out - fp32 reference| "
                      f"{float(jnp.max(jnp.abs(out - out_ref))):.4f}, gradient errors (relative to max) "
                      + ", ".join(f"{e:.4f}" for e in errors), flush=True)
            except Exception as error:  # reported, the next choice still runs
                failures += 1
                print(f"L={length} H={heads} G={kv_heads} {implementation:<9} FAILED {type(error).__name__}: "
                      f"{str(error)[:400]}", flush=True)
    return failures


def model_cases(rng: np.random.Generator) -> int:
    failures = 0
    tokens = rng.integers(0, TINY["vocab_size"], (2, TINY["seq_len"] + 1)).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    reference = None
    for attention, remat in [("reference", "none"), ("xla", "none"), ("cudnn", "none"), ("chunked", "none"),
                             ("cudnn", "full"), ("cudnn", "dots"), ("auto", "none")]:
        try:
            module = llama(TINY, nnx.Rngs(params=0))
            module.set_execution(attention, remat, chunk_size=32)
            graphdef, params = nnx.split(module, nnx.Param)
            loss, grads = jax.jit(jax.value_and_grad(lambda p: model_lib.loss_fn(graphdef, p, inputs, targets)))(params)
            flat = model_lib.flat_params(grads)
            if reference is None:
                reference = (float(loss), flat)
            error = max(float(np.max(np.abs(flat[n] - reference[1][n])) / np.max(np.abs(reference[1][n])))
                        for n in flat)
            print(f"model attention={attention:<9} remat={remat:<4} loss {float(loss):.5f} "
                  f"(|d| {abs(float(loss) - reference[0]):.5f}), max gradient error {error:.4f}", flush=True)
        except Exception as error:
            failures += 1
            print(f"model attention={attention} remat={remat} FAILED {type(error).__name__}: {str(error)[:400]}",
                  flush=True)
    return failures


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(f"jax {jax.__version__}, flax {flax.__version__}, {jax.devices()}", flush=True)
    print("auto resolves to", resolve_attention("auto", jax.default_backend(), jnp.bfloat16, 256, 64), "at L = 256")
    rng = np.random.default_rng(0)
    failures = attention_cases(rng) + model_cases(rng)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
