"""The quality ladder: data-parallel against decoupled DiLoCo (M = 4, the manifest's defaults, int4
both ways) at equal tokens, for a list of model sizes at a stated number of tokens per parameter;
`--recipe sparseloco` adds the sparse recipe's decoupled row (topk2 up, union8 down, the
`sparseloco` preset) beside a rung's int4 rows, as a run of its own.

Each rung runs `benchmarks/parity.py`'s cells (the same runner, Syncer, apply rule and codecs) for
one preset and merges its rows into one JSON file, so a driver script can run every rung as its
own process under its own time limit and still get one file:

    {"command", "device", "jax", "tokens_per_param", "seq_len", "compute_dtype", "seed",
     "rows": [{preset, params, tokens, mode, recipe, eval_loss, eval_loss_stderr, bytes, steps, global_batch}],
     "gaps": [{preset, params, tokens, recipe, gap, bytes_ratio}]}

gap = decoupled eval loss / data-parallel eval loss - 1 (same seed, data and eval set), one per
decoupled recipe; bytes_ratio = data-parallel bytes / decoupled bytes. Steps per learner are
ceil(tokens_per_param * params / (global_batch * seq_len)).

    .venv/bin/python benchmarks/quality_ladder.py --presets llama-6m --tokens-per-param 10 \\
        --global-batch 128 --json benchmarks/results/accelerator/DATE/quality.json     # on a GPU
    .venv/bin/python benchmarks/quality_ladder.py --presets llama-1m --tokens-per-param 0.05 \\
        --seq-len 64 --global-batch 8 --eval-batches 2 --json /tmp/quality.json        # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import parity  # noqa: E402  (sets JAX_PLATFORMS=cpu unless the caller chose a platform)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from diloco_node.config.manifest import ConfigError  # noqa: E402
from diloco_node.learn import data as data_lib  # noqa: E402

MODES = ["data_parallel", "decoupled"]
CODECS = "int4/int4"
# Each recipe's modes, codecs and manifest overrides. The sparse recipe runs decoupled only: its
# gap is taken against the rung's data-parallel row, already in the file.
RECIPES = {"int4": (MODES, CODECS, {}),
           "sparseloco": (["decoupled"], "topk2/union8", {"sync": {"preset": "sparseloco"}})}
LEARNERS = 4
# The literature compares at Chinchilla-like budgets; below 10 tokens per parameter a gap mostly
# measures how far from converged both sides are, so the ladder refuses less unless told it is a smoke run.
MIN_TOKENS_PER_PARAM = 10.0


def steps_for(params: int, tokens_per_param: float, global_batch: int, seq_len: int) -> int:
    return max(1, math.ceil(tokens_per_param * params / (global_batch * seq_len)))


def save_corpus(path: str, seed: int) -> None:
    """This machine's standard-library corpus (train and eval split by `seed`) as one compressed
    file, so another machine (the accelerator's) trains and evaluates on the same bytes."""
    corpus = data_lib.stdlib_corpus(seed=seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez_compressed(path, train=np.asarray(corpus.train, np.uint8), eval=np.asarray(corpus.eval, np.uint8),
                        seed=seed, description=corpus.description)


def load_corpus(path: str, seed: int) -> data_lib.Corpus:
    with np.load(path) as saved:
        if int(saved["seed"]) != seed:
            raise ConfigError(f"corpus {path}: split for seed {int(saved['seed'])}, not {seed}")
        return data_lib.Corpus(saved["train"].astype(np.int32), saved["eval"].astype(np.int32), 256,
                               f"{saved['description']} (saved to {os.path.basename(path)})")


def rung(preset: str, *, tokens_per_param: float, global_batch: int, seq_len: int, compute_dtype: str,
         seed: int, eval_batches: int, corpus: data_lib.Corpus | None = None, recipe: str = "int4") -> list[dict]:
    """One preset's rows for one recipe: data-parallel and decoupled (int4), or the sparse
    recipe's decoupled row, at the same tokens."""
    modes, codecs, recipe_overrides = RECIPES[recipe]
    model = {"seq_len": seq_len}
    if parity.PRESETS[preset].get("factory") == "llama":
        model["compute_dtype"] = compute_dtype
    overrides = {"model": model}
    sized = parity.with_overrides(
        parity.benchmark_manifest(1000, seed),
        parity.merged_overrides(parity.Cell(preset, 1000, LEARNERS, CODECS).cell_overrides(global_batch), overrides))
    params = parity._param_count(sized)
    steps = steps_for(params, tokens_per_param, global_batch, seq_len)
    report = parity.run_all(steps, modes, ["uniform"], seed, overrides=parity.merged_overrides(overrides, recipe_overrides),
                            dp_overrides=overrides, learners=[LEARNERS], codecs=[codecs], presets=[preset],
                            global_batch=global_batch, eval_batches=eval_batches,
                            corpora=None if corpus is None else {seed: corpus})
    return [{"preset": preset, "params": params, "tokens": r["tokens"], "mode": r["mode"],
             "recipe": "" if r["mode"] == "data_parallel" else recipe,
             "eval_loss": r["eval_loss"], "eval_loss_stderr": r["eval_loss_stderr"], "bytes": r["bytes_cross_site"],
             "steps": steps, "global_batch": global_batch, "wall_s": r["wall_s"]} for r in report["results"]]


def ladder_gaps(rows: list[dict]) -> list[dict]:
    out = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        dp = next((r for r in rows if r["preset"] == preset and r["mode"] == "data_parallel"), None)
        for dec in (r for r in rows if r["preset"] == preset and r["mode"] == "decoupled"):
            if dp:
                out.append({"preset": preset, "params": dec["params"], "tokens": dec["tokens"],
                            "recipe": dec.get("recipe", "int4"),  # rows written before recipes were int4
                            "gap": round(dec["eval_loss"] / dp["eval_loss"] - 1, 5),
                            "bytes_ratio": round(dp["bytes"] / max(dec["bytes"], 1), 1)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="", help=f"comma-separated: {', '.join(parity.PRESETS)}")
    parser.add_argument("--tokens-per-param", type=float, default=MIN_TOKENS_PER_PARAM)
    parser.add_argument("--smoke", action="store_true", help=f"allow fewer than {MIN_TOKENS_PER_PARAM:g} tokens per "
                                                             "parameter (a run that proves the script works)")
    parser.add_argument("--global-batch", type=int, default=128, help="windows per step over the M learners")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--compute-dtype", default="bfloat16", help="llama presets' compute dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--corpus", metavar="NPZ", help="a corpus written by --save-corpus (default: this "
                                                         "machine's standard library)")
    parser.add_argument("--save-corpus", metavar="NPZ", help="write this machine's corpus for --seed to NPZ and exit")
    parser.add_argument("--json", metavar="PATH", help="rows are merged into PATH (created if absent)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="int4",
                        help="int4: data-parallel and decoupled int4 rows; sparseloco: the sparse recipe's decoupled "
                             "row, its gap against the data-parallel row already in --json")
    args = parser.parse_args(argv)
    if args.save_corpus:
        save_corpus(args.save_corpus, args.seed)
        print(f"wrote {args.save_corpus}")
        return 0
    if not args.json or not args.presets:
        parser.error("--presets and --json are required")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in presets if p not in parity.PRESETS]
    if unknown or not presets:
        parser.error(f"--presets {args.presets!r}: each must be one of {', '.join(parity.PRESETS)}")
    if args.tokens_per_param < MIN_TOKENS_PER_PARAM and not args.smoke:
        parser.error(f"--tokens-per-param {args.tokens_per_param:g} < {MIN_TOKENS_PER_PARAM:g}: pass --smoke for a "
                     "run that only proves the script works")
    if args.global_batch % LEARNERS or args.global_batch < LEARNERS:
        parser.error(f"--global-batch {args.global_batch}: must be a positive multiple of {LEARNERS}")
    doc: dict = {"rows": []}
    if os.path.exists(args.json):
        with open(args.json) as f:
            doc = json.load(f)
    settings = {"tokens_per_param": args.tokens_per_param, "seq_len": args.seq_len,
                "compute_dtype": args.compute_dtype, "seed": args.seed, "learners": LEARNERS, "codecs": CODECS}
    if doc.get("settings", settings) != settings:
        parser.error(f"{args.json} holds a ladder with other settings {doc['settings']}; write to a new file")
    commands = doc.get("commands", [])
    commands.append(shlex.join([os.path.relpath(sys.argv[0]) if argv is None else "quality_ladder.py",
                                *(sys.argv[1:] if argv is None else argv)]))
    doc.update({"commands": commands, "device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
                "jax": jax.__version__, "settings": settings})
    try:
        corpus = load_corpus(args.corpus, args.seed) if args.corpus else None
    except (OSError, KeyError, ValueError) as exc:
        parser.error(f"--corpus {args.corpus}: {exc}")
    doc["corpus"] = (corpus or data_lib.stdlib_corpus(seed=args.seed)).description
    for preset in presets:
        started = time.perf_counter()
        try:
            rows = rung(preset, tokens_per_param=args.tokens_per_param, global_batch=args.global_batch,
                        seq_len=args.seq_len, compute_dtype=args.compute_dtype, seed=args.seed,
                        eval_batches=args.eval_batches, corpus=corpus, recipe=args.recipe)
        except ConfigError as exc:
            parser.error(str(exc))
        replaced = {(r["mode"], r["recipe"]) for r in rows}  # a rerun replaces its own rows, keeps the others
        doc["rows"] = [r for r in doc["rows"] if r["preset"] != preset
                       or (r["mode"], r.get("recipe", "" if r["mode"] == "data_parallel" else "int4")) not in replaced] + rows
        doc["gaps"] = ladder_gaps(doc["rows"])
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:  # after every rung: a later rung's time limit loses nothing
            json.dump(doc, f, indent=2)
        print(f"{preset}: {len(rows)} rows in {time.perf_counter() - started:.0f} s; gaps {doc['gaps']}", flush=True)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
