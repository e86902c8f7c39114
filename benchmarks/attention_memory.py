"""Peak memory of one llama layer's training step, by attention implementation and remat choice.

Builds one `Block` of the llama factory abstractly (nothing allocated), then lowers and compiles
(never runs) value_and_grad of a scalar of its output with respect to its parameters and its
input, and reads XLA's memory analysis of the compiled step: `temp` is the scratch XLA plans
for activations, scores and gradients' intermediates; `peak` adds the arguments and outputs (the
layer's fp32 parameters, its input and the gradients). Figures are XLA's plan for the platform
it compiles on (this machine's CPU unless JAX finds an accelerator), not a measurement.

    python benchmarks/attention_memory.py                                  # 1b layer, 2k/4k/8k
    python benchmarks/attention_memory.py --contexts 2048 4096 --json attention_memory.json
    python benchmarks/attention_memory.py --d-model 1024 --d-ff 4096       # a narrower layer

The issue's target: with "chunked" attention the memory grows linearly with the context, while
"reference" and "xla" hold fp32 scores [B, H, L, L] (quadratic).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MIB = 1024 * 1024
# (attention, remat) rows of the table: the quadratic implementations, then the chunked one
# alone and with each block's forward recomputed in the backward pass.
DEFAULT_VARIANTS = ("reference:none", "xla:none", "reference:full", "chunked:none", "chunked:full")


def layer_step_memory(d_model: int, num_heads: int, num_kv_heads: int, d_ff: int, context: int, batch: int,
                      dtype: str, attention: str, remat: str, chunk_size: int, time_steps: int = 0) -> dict:
    """XLA's memory analysis of one Block's forward + backward at this shape and choice; with
    `time_steps`, also the step's mean wall time run on the device (meant for accelerators)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from diloco_node.learn.llama import COMPUTE_DTYPES, Block, LlamaConfig, apply_block

    cfg = LlamaConfig(vocab_size=256, seq_len=context, d_model=d_model, num_layers=16, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, d_ff=d_ff, compute_dtype=dtype)
    compute = COMPUTE_DTYPES[dtype]
    block = nnx.eval_shape(lambda: Block(cfg, compute, nnx.Rngs(params=0)))
    block.attn.attention, block.attn.chunk_size = attention, chunk_size
    graphdef, params = nnx.split(block, nnx.Param)
    x_BxLxD = jax.ShapeDtypeStruct((batch, context, d_model), compute)

    def scalar(params, x_BxLxD):
        out_BxLxD = apply_block(nnx.merge(graphdef, params), x_BxLxD, remat)
        return jnp.mean(jnp.square(out_BxLxD.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(scalar, argnums=(0, 1)))
    started = time.perf_counter()
    compiled = step.lower(params, x_BxLxD).compile()
    seconds = time.perf_counter() - started
    analysis = compiled.memory_analysis()
    temp = int(analysis.temp_size_in_bytes)
    arguments, outputs = int(analysis.argument_size_in_bytes), int(analysis.output_size_in_bytes)
    aliased = int(getattr(analysis, "alias_size_in_bytes", 0))
    row = {"context": context, "attention": attention, "remat": remat, "temp_bytes": temp,
           "argument_bytes": arguments, "output_bytes": outputs,
           "peak_bytes": temp + arguments + outputs - aliased, "compile_s": round(seconds, 2)}
    if time_steps:
        keys = iter(jax.random.split(jax.random.key(0), 1 + len(jax.tree.leaves(params))))
        real_params = jax.tree.map(lambda a: 0.02 * jax.random.normal(next(keys), a.shape, a.dtype), params)
        x = jax.random.normal(next(keys), x_BxLxD.shape, x_BxLxD.dtype)
        jax.block_until_ready(compiled(real_params, x))  # warm-up
        started = time.perf_counter()
        for _ in range(time_steps):
            out = compiled(real_params, x)
        jax.block_until_ready(out)
        row["step_ms"] = round(1000 * (time.perf_counter() - started) / time_steps, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    # The 1b preset's layer (diloco_node/learn/llama.py LLAMA_PRESETS["1b"]).
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=8192)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="compute dtype (parameters stay float32); a 1B run computes in bfloat16")
    parser.add_argument("--chunk-size", type=int, default=None, help="chunked attention's chunk (default: its own)")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), metavar="ATTENTION:REMAT")
    parser.add_argument("--time", type=int, default=0, metavar="STEPS",
                        help="also run each step STEPS times and report its mean time (on an accelerator; "
                             "on a CPU the 8k steps take minutes)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import jax

    from diloco_node.learn.attention import DEFAULT_CHUNK_SIZE

    chunk = args.chunk_size or DEFAULT_CHUNK_SIZE
    variants = [tuple(v.split(":", 1)) if ":" in v else (v, "none") for v in args.variants]
    print(f"one llama layer, d_model {args.d_model}, {args.heads} heads, {args.kv_heads} kv heads, "
          f"d_ff {args.d_ff}, batch {args.batch}, {args.dtype}, chunk {chunk}; "
          f"XLA's plan on {jax.devices()[0].platform} ({jax.devices()[0].device_kind})", flush=True)
    rows = []
    for context in args.contexts:
        for attention, remat in variants:
            rows.append(layer_step_memory(args.d_model, args.heads, args.kv_heads, args.d_ff, context, args.batch,
                                          args.dtype, attention, remat, chunk, args.time))
            timed = f", step {rows[-1]['step_ms']} ms" if args.time else ""
            print(f"  compiled {attention}/{remat} at {context} in {rows[-1]['compile_s']} s{timed}", flush=True)

    header = "| attention | remat | " + " | ".join(f"temp {c} | peak {c}" for c in args.contexts) + " |"
    print()
    print(header)
    print("|" + "---|" * (2 + 2 * len(args.contexts)))
    for attention, remat in variants:
        cells = []
        for context in args.contexts:
            row = next(r for r in rows if (r["context"], r["attention"], r["remat"]) == (context, attention, remat))
            cells += [f"{row['temp_bytes'] / MIB:,.0f}", f"{row['peak_bytes'] / MIB:,.0f}"]
        print(f"| {attention} | {remat} | " + " | ".join(cells) + " |")
    print("\n(MiB; temp: XLA's scratch; peak: temp + arguments + outputs)")
    if args.json:
        args.json.write_text(json.dumps({"platform": jax.devices()[0].platform, "d_model": args.d_model,
                                         "heads": args.heads, "kv_heads": args.kv_heads, "d_ff": args.d_ff,
                                         "batch": args.batch, "dtype": args.dtype, "chunk_size": chunk,
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
