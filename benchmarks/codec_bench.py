"""Benchmark of the tensor codecs: throughput, size ratio and error on outer-gradient-like data.

`measure_codecs()` is imported by other benchmarks; run this file for a table or `--json PATH`.
Single-threaded on purpose (the speed targets are per core): thread-count variables are pinned
before numpy loads, when this module is the first to import it.
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from wire.codecs import CODECS, decode_tensor, encode_tensor, quantize_roundtrip  # noqa: E402
from wire.codecs.container import FLAG_ZSTD, FLAGS_OFFSET  # noqa: E402

# Outer gradients are roughly Gaussian with heavy-tailed outliers; these knobs set the mixture.
OUTLIER_FRACTION = 0.03
OUTLIER_DEGREES_OF_FREEDOM = 3.0
OUTLIER_SCALE = 3.0
DELTA_SCALE = 1e-3  # typical magnitude of Θ_base − θ_local after a few hundred inner steps


def heavy_tailed_delta(num_elements: int, seed: int = 0) -> np.ndarray:
    """Gaussian values with a few percent Student-t outliers, scaled like an outer gradient."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(num_elements, dtype=np.float32)
    outliers = rng.random(num_elements) < OUTLIER_FRACTION
    values[outliers] = OUTLIER_SCALE * rng.standard_t(OUTLIER_DEGREES_OF_FREEDOM, int(outliers.sum()))
    values *= np.float32(DELTA_SCALE)
    return values


def adamw_delta(num_elements: int, seed: int = 0, inner_steps: int = 20) -> np.ndarray:
    """A real outer gradient: Θ_start − θ after a few AdamW steps of linear regression.

    The weight matrix has about `num_elements` entries (rounded to a square); each step uses a
    fresh minibatch, so the delta has Adam's sign-like bulk plus the problem's structure.
    """
    rng = np.random.default_rng(seed)
    width = max(1, int(round(num_elements**0.5)))
    batch = 32  # small: the delta's shape matters here, not the regression's accuracy
    true_weights = rng.standard_normal((width, width), dtype=np.float32) / np.float32(width**0.5)
    start = np.float32(0.02) * rng.standard_normal((width, width), dtype=np.float32)
    weights = start.copy()
    first_moment = np.zeros_like(weights)
    second_moment = np.zeros_like(weights)
    learning_rate, beta1, beta2, epsilon, weight_decay = 1e-3, 0.9, 0.95, 1e-8, 0.1
    for step in range(1, inner_steps + 1):
        inputs = rng.standard_normal((batch, width), dtype=np.float32)
        targets = inputs @ true_weights + np.float32(0.1) * rng.standard_normal((batch, width), dtype=np.float32)
        gradient = inputs.T @ (inputs @ weights - targets) * np.float32(2.0 / batch)
        first_moment = beta1 * first_moment + (1 - beta1) * gradient
        second_moment = beta2 * second_moment + (1 - beta2) * gradient * gradient
        update = (first_moment / (1 - beta1**step)) / (np.sqrt(second_moment / (1 - beta2**step)) + epsilon)
        weights -= np.float32(learning_rate) * (update + weight_decay * weights)
    return (start - weights).reshape(-1).astype(np.float32)


def sparse_union(num_elements: int, seed: int = 0, learners: int = 4) -> np.ndarray:
    """A merged outer gradient of sparse contributions: the mean of `learners` topk2-coded deltas.

    What the syncer sends down (union8's input) when every learner sends topk2: each chunk holds the
    union of the learners' top k, a few percent of its values.
    """
    total = np.zeros(num_elements, dtype=np.float32)
    for learner in range(learners):
        total += quantize_roundtrip(heavy_tailed_delta(num_elements, seed + learner), "topk2")
    return total / np.float32(learners)


DATASETS: dict[str, Callable[[int], np.ndarray]] = {
    "heavy_tailed": heavy_tailed_delta,
    "adamw_delta": adamw_delta,
    "sparse_union": sparse_union,
}


def _best_seconds(action: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """Fastest wall and CPU (process) seconds of `repeats` runs (the least disturbed by other
    processes on a shared machine: there CPU time is the fairer per-core figure)."""
    best_wall, best_cpu, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = action()
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
        best_wall = min(best_wall, time.perf_counter() - start)
    return best_wall, best_cpu, result


def measure_codecs(
    num_elements: int = 1 << 24,
    repeats: int = 3,
    *,
    codecs: Sequence[str] = tuple(CODECS),
    dataset: str = "heavy_tailed",
    zstd_level: int = 1,
) -> list[dict]:
    """Measure every codec on one generated tensor; one dict per codec.

    Throughput is megabytes of float32 input (4 bytes per value) per second, best of `repeats`;
    `ratio` is float32 bytes / encoded bytes; `max_rel_error` is max|err| / max|x| and
    `rel_l2_error` is ||err|| / ||x||. `*_cpu_MBps` divide by process time instead of wall time.
    """
    values = DATASETS[dataset](num_elements)
    input_megabytes = values.size * 4 / 1e6
    norm, absmax = float(np.linalg.norm(values)), float(np.abs(values).max())
    results = []
    for name in codecs:
        encode_seconds, encode_cpu, encoded = _best_seconds(
            lambda: encode_tensor(values, name, zstd_level=zstd_level), repeats)
        decode_seconds, decode_cpu, decoded = _best_seconds(lambda: decode_tensor(encoded), repeats)
        error = decoded - values
        results.append(
            {
                "codec": name,
                "dataset": dataset,
                "num_elements": int(values.size),
                "block_size": CODECS[name].default_block_size,
                "zstd_level": zstd_level,
                "zstd_used": bool(encoded[FLAGS_OFFSET] & FLAG_ZSTD),
                "encoded_bytes": len(encoded),
                "bytes_per_value": len(encoded) / values.size,
                "ratio": values.size * 4 / len(encoded),
                "encode_MBps": input_megabytes / encode_seconds,
                "decode_MBps": input_megabytes / decode_seconds,
                "encode_cpu_MBps": input_megabytes / encode_cpu,
                "decode_cpu_MBps": input_megabytes / decode_cpu,
                "max_rel_error": float(np.abs(error).max()) / absmax,
                "rel_l2_error": float(np.linalg.norm(error)) / norm,
            }
        )
    return results


def _format_table(rows: list[dict]) -> str:
    header = (
        f"{'dataset':<13}{'codec':<7}{'B/value':>9}{'ratio':>8}{'enc MB/s':>10}{'dec MB/s':>10}"
        f"{'enc cpu':>9}{'dec cpu':>9}{'max rel err':>13}{'rel L2 err':>12}  zstd"
    )
    lines = [header]
    for row in rows:
        lines.append(
            f"{row['dataset']:<13}{row['codec']:<7}{row['bytes_per_value']:>9.4f}{row['ratio']:>8.2f}"
            f"{row['encode_MBps']:>10.0f}{row['decode_MBps']:>10.0f}{row['encode_cpu_MBps']:>9.0f}"
            f"{row['decode_cpu_MBps']:>9.0f}{row['max_rel_error']:>13.2e}"
            f"{row['rel_l2_error']:>12.2e}  {'yes' if row['zstd_used'] else 'no'}"
        )
    return "\n".join(lines)


def measure_union_crossover(
    num_elements: int = 1 << 22, densities: Sequence[float] = (0.01, 0.03, 0.06, 0.1, 0.2, 0.3, 0.35, 0.4, 0.5),
    zstd_level: int = 1,
) -> list[dict]:
    """union8 against dense int4 on heavy-tailed values of which a fraction `density` is nonzero.

    union8 picks sparse or dense per chunk by raw bits; this shows where that lands after zstd,
    and what each costs in error. `sparse_chunks` is the fraction of chunks union8 sent sparse.
    """
    from wire.codecs.container import _parse
    rows = []
    for density in densities:
        values = heavy_tailed_delta(num_elements)
        values[np.random.default_rng(1).random(num_elements) >= density] = 0.0
        norm = float(np.linalg.norm(values))
        row: dict = {"density": density}
        for name in ("union8", "int4"):
            encoded = encode_tensor(values, name, zstd_level=zstd_level)
            error = decode_tensor(encoded) - values
            row[f"{name}_bytes_per_value"] = len(encoded) / num_elements
            row[f"{name}_rel_l2_error"] = float(np.linalg.norm(error)) / norm
        raw = encode_tensor(values, "union8", zstd_level=None)
        _, block, entries, payload, _ = _parse(raw, num_elements, 0)
        chunks = -(-num_elements // block)
        table = np.frombuffer(bytes(payload[1 : 1 + 4 * chunks]), dtype="<u4")
        row["sparse_chunks"] = float((table != 0xFFFFFFFF).mean())
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-elements", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--zstd-level", type=int, default=1)
    parser.add_argument("--dataset", choices=[*DATASETS, "all"], default="all")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codecs (default: all)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--crossover", action="store_true",
                        help="also print union8 against int4 over nonzero densities (where union8 turns dense)")
    args = parser.parse_args(argv)
    datasets = list(DATASETS) if args.dataset == "all" else [args.dataset]
    rows = []
    for dataset in datasets:
        rows += measure_codecs(args.num_elements, args.repeats, codecs=args.codecs.split(","), dataset=dataset,
                               zstd_level=args.zstd_level)
    print(_format_table(rows))
    if args.crossover:
        print(f"\n{'density':>8}{'union8 B/v':>12}{'union8 err':>12}{'int4 B/v':>10}{'int4 err':>10}{'sparse chunks':>15}")
        for row in measure_union_crossover(min(args.num_elements, 1 << 22), zstd_level=args.zstd_level):
            print(f"{row['density']:>8.2f}{row['union8_bytes_per_value']:>12.4f}{row['union8_rel_l2_error']:>12.2e}"
                  f"{row['int4_bytes_per_value']:>10.4f}{row['int4_rel_l2_error']:>10.2e}{row['sparse_chunks']:>15.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
