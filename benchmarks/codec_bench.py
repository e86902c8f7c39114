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
from wire.codecs import CODECS, decode_tensor, encode_tensor  # noqa: E402
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


DATASETS: dict[str, Callable[[int], np.ndarray]] = {
    "heavy_tailed": heavy_tailed_delta,
    "adamw_delta": adamw_delta,
}


def _best_seconds(action: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Fastest of `repeats` runs (the least disturbed by other processes on a shared machine)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = action()
        best = min(best, time.perf_counter() - start)
    return best, result


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
    `rel_l2_error` is ||err|| / ||x||.
    """
    values = DATASETS[dataset](num_elements)
    input_megabytes = values.size * 4 / 1e6
    norm, absmax = float(np.linalg.norm(values)), float(np.abs(values).max())
    results = []
    for name in codecs:
        encode_seconds, encoded = _best_seconds(lambda: encode_tensor(values, name, zstd_level=zstd_level), repeats)
        decode_seconds, decoded = _best_seconds(lambda: decode_tensor(encoded), repeats)
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
                "max_rel_error": float(np.abs(error).max()) / absmax,
                "rel_l2_error": float(np.linalg.norm(error)) / norm,
            }
        )
    return results


def _format_table(rows: list[dict]) -> str:
    header = (
        f"{'dataset':<13}{'codec':<6}{'B/value':>9}{'ratio':>8}{'enc MB/s':>10}{'dec MB/s':>10}"
        f"{'max rel err':>13}{'rel L2 err':>12}  zstd"
    )
    lines = [header]
    for row in rows:
        lines.append(
            f"{row['dataset']:<13}{row['codec']:<6}{row['bytes_per_value']:>9.4f}{row['ratio']:>8.2f}"
            f"{row['encode_MBps']:>10.0f}{row['decode_MBps']:>10.0f}{row['max_rel_error']:>13.2e}"
            f"{row['rel_l2_error']:>12.2e}  {'yes' if row['zstd_used'] else 'no'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-elements", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--zstd-level", type=int, default=1)
    parser.add_argument("--dataset", choices=[*DATASETS, "all"], default="all")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    datasets = list(DATASETS) if args.dataset == "all" else [args.dataset]
    rows = []
    for dataset in datasets:
        rows += measure_codecs(args.num_elements, args.repeats, dataset=dataset, zstd_level=args.zstd_level)
    print(_format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
