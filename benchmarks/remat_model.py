"""Remat on the whole model: step time and peak device memory of the site's training step by
`[node.mesh] remat` (none, dots, full) at one context.

    .venv/bin/python benchmarks/remat_model.py --size 1b --seq-len 8192 --batch-size 1 --json remat.json
    .venv/bin/python benchmarks/remat_model.py --size 1m --vocab-size 256 --seq-len 256 --steps 3   # CPU, tiny

Each choice runs in its own process (a device's peak memory counter only grows), on every device
JAX finds, with the model in bf16 compute: `InnerLearner.step` timed over `--steps` steps after a
warm-up, the device's `peak_bytes_in_use` where the backend reports it (accelerators; `null` on
the CPU), and XLA's plan for the compiled step (arguments, outputs and temporaries) everywhere.
A choice that runs out of device memory is reported as such, and the next one still runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHOICES = ("none", "dots", "full")
CHOICE_TIMEOUT_S = 600  # one choice's compile and steps; the device script sets its own limit around all


def measure(args: argparse.Namespace) -> dict:
    """One remat choice, in this process."""
    import jax
    import numpy as np

    from diloco_node.config.manifest import InnerOptimizer, ModelSpec
    from diloco_node.config.site_devices import MeshShape
    from diloco_node.learn.inner import InnerLearner
    from diloco_node.learn.mesh import build_site_mesh

    model = ModelSpec.of("llama", vocab_size=args.vocab_size, seq_len=args.seq_len, size=args.size,
                         compute_dtype="bfloat16")
    inner = InnerOptimizer(batch_size=args.batch_size, warmup_steps=10, total_steps=10_000)
    mesh = build_site_mesh(MeshShape(attention=args.attention, remat=args.remat))
    learner = InnerLearner(model, inner, 0, site_mesh=mesh)
    tokens = np.random.default_rng(0).integers(0, args.vocab_size, (args.batch_size, args.seq_len), dtype=np.int32)
    batch = mesh.put_batch(tokens)
    plan = learner.lower_step(batch, batch).compile().memory_analysis()
    planned = None if plan is None else int(plan.argument_size_in_bytes + plan.output_size_in_bytes
                                            + plan.temp_size_in_bytes - plan.alias_size_in_bytes)
    jax.block_until_ready(learner.step(tokens, tokens))
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = learner.step(tokens, tokens)
    jax.block_until_ready(loss)
    step_s = (time.perf_counter() - started) / args.steps
    stats = jax.devices()[0].memory_stats() or {}
    return {"remat": args.remat, "step_s": step_s, "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "xla_planned_bytes": planned, "device": str(jax.devices()[0]), "devices": len(jax.devices()),
            "loss": float(loss)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1b")
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--choices", nargs="+", default=list(CHOICES))
    parser.add_argument("--remat", help=argparse.SUPPRESS)  # one choice, in a child process
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.remat is not None:
        print(json.dumps(measure(args)))
        return 0
    rows = []
    for choice in args.choices:
        command = [sys.executable, __file__, "--remat", choice] + [
            f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
            if key in ("size", "vocab_size", "seq_len", "batch_size", "steps", "attention")]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CHOICE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rows.append({"remat": choice, "error": f"over {CHOICE_TIMEOUT_S} s"})
            continue
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            rows.append(json.loads(lines[-1]))
        else:
            why = "out of device memory" if "RESOURCE_EXHAUSTED" in done.stderr else done.stderr.strip()[-400:]
            rows.append({"remat": choice, "error": why})
        row = rows[-1]
        print(f"remat {choice}: " + (f"error: {row['error']}" if "error" in row else
              f"{1e3 * row['step_s']:.1f} ms/step, peak {row['peak_bytes_in_use']} B in use, XLA plan "
              f"{row['xla_planned_bytes']} B"), flush=True)
    report = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
              "size": args.size, "seq_len": args.seq_len, "batch_size": args.batch_size, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
