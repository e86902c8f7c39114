"""Sharded start-up, measured: XLA's per-device memory analysis of the learner's compiled
initialisation (parameters, then AdamW moments) on a site mesh, against the model's whole size.

    .venv/bin/python benchmarks/sharded_startup.py --host-devices 4 --fsdp 4            # llama 100m
    .venv/bin/python benchmarks/sharded_startup.py --host-devices 4 --fsdp 4 --size 1b --vocab-size 128256

Only compiles (lower + compile, nothing runs), so even the 1b preset is cheap on a CPU. Per
device, `output` is what the initialiser leaves on the device (its shard of every tensor) and
`temp` its working memory while it runs; a start-up that materialised the whole model on one
device would show an output or a temp of the whole model's size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host-devices", type=int, default=4, help="CPU devices to force (0: the real devices)")
    parser.add_argument("--fsdp", type=int, default=4)
    parser.add_argument("--size", default="100m", help="llama preset")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


ARGS = _parse()
if ARGS.host_devices:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.host_devices}"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from diloco_node.config.manifest import InnerOptimizer, ModelSpec  # noqa: E402
from diloco_node.learn import factory  # noqa: E402
from diloco_node.learn.inner import make_optimizer  # noqa: E402
from diloco_node.learn.mesh import MeshShape, build_site_mesh  # noqa: E402
from wire.limits import MiB  # noqa: E402


def main() -> None:
    model = ModelSpec.of("llama", vocab_size=ARGS.vocab_size, seq_len=ARGS.seq_len, size=ARGS.size)
    mesh = build_site_mesh(MeshShape(data=-1, fsdp=ARGS.fsdp))
    _, abstract = factory.abstract_model(model)
    param_bytes = sum(int(np.prod(leaf.shape)) * 4 for leaf in jax.tree.leaves(abstract))
    shardings = mesh.tree_shardings(abstract)
    params = factory.sharded_init_fn(model, 0, shardings).lower().compile().memory_analysis()
    tx = make_optimizer(InnerOptimizer(batch_size=mesh.device_count))
    opt_abstract = jax.eval_shape(tx.init, abstract)
    opt_init = jax.jit(tx.init, in_shardings=(shardings,), out_shardings=mesh.tree_shardings(opt_abstract))
    opt = opt_init.lower(abstract).compile().memory_analysis()
    opt_bytes = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(opt_abstract))
    rows = [("parameters", param_bytes, params), ("AdamW moments", opt_bytes, opt)]
    print(f"llama {ARGS.size}, vocab {ARGS.vocab_size}: {param_bytes / 4 / 1e6:.1f}M parameters on "
          f"{mesh.device_count} {jax.devices()[0].platform} devices, mesh {mesh.describe()['mesh']}")
    print(f"{'initialiser':<15}{'whole MiB':>11}{'output/device':>15}{'ratio':>8}{'temp/device':>13}")
    out = []
    for name, whole, analysis in rows:
        print(f"{name:<15}{whole / MiB:>11.1f}{analysis.output_size_in_bytes / MiB:>15.1f}"
              f"{analysis.output_size_in_bytes / whole:>8.3f}{analysis.temp_size_in_bytes / MiB:>13.1f}")
        out.append({"initialiser": name, "whole_bytes": whole, "output_bytes_per_device": analysis.output_size_in_bytes,
                    "temp_bytes_per_device": analysis.temp_size_in_bytes,
                    "argument_bytes_per_device": analysis.argument_size_in_bytes})
    if ARGS.json:
        ARGS.json.write_text(json.dumps({"size": ARGS.size, "mesh": mesh.describe(), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
