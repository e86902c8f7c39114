"""Parity benchmark: every sync mode against data-parallel at equal total tokens, over seeds, learner
counts, budgets, codecs and model sizes (stdlib corpus, the daemon's own round code).

For each (mode, scenario) it reports eval_loss of the final global model (with its standard error
over the eval set's batches), bytes_cross_site (uplink + downlink payload bytes actually encoded),
idle_fraction (learner time blocked on others), merges and wall_s (real seconds of the simulated
run). The learners run in one process on a virtual clock (diloco_node/sim/runner.py); see
docs/PARITY.md for the accounting. Every gap to data-parallel is computed within a seed (the same
data order, initialisation and eval set), then reported as the mean and range over seeds.

    .venv/bin/python benchmarks/parity.py --json /tmp/parity.json        # full run: 2 seeds, 3 scenarios
    .venv/bin/python benchmarks/parity.py --quick                        # smoke run
    .venv/bin/python benchmarks/parity.py --modes decoupled --scenarios uniform --set outer.lr=0.9
    .venv/bin/python benchmarks/parity.py --scenarios uniform --learners 1,2,4,8    # M sweep, fixed global batch
    .venv/bin/python benchmarks/parity.py --scenarios uniform --steps 600,1400     # budget sweep
    .venv/bin/python benchmarks/parity.py --scenarios uniform --codecs int4/int4,fp32/fp32,int4/fp32
    .venv/bin/python benchmarks/parity.py --scenarios uniform --presets llama-1m --dp-lrs 0.003,0.006
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable

# Two cores: one XLA intra-op pool per process is enough; set before JAX starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from diloco_node.learn import data as data_lib  # noqa: E402
from diloco_node.learn import factory  # noqa: E402
from diloco_node.learn import model as model_lib  # noqa: E402
from diloco_node.sim import runner  # noqa: E402
from diloco_node.config.manifest import ConfigError, RunManifest  # noqa: E402
from diloco_node.config.presets import expand_preset  # noqa: E402
from diloco_node.cli.train import default_manifest  # noqa: E402

NUM_LEARNERS = 4
FULL_STEPS = 600  # nominal steps per learner
QUICK_STEPS = 64
DEFAULT_SEEDS = (0, 1)
# Held-out windows scored at the end of every run: 64 batches of 32 windows (131,072 bytes at
# seq_len 64), evenly spaced over the seed's eval files; its standard error is in every row.
EVAL_BATCHES = 64
EVAL_BATCH_SIZE = 32

# Model sizes, as [run.model] overrides of the benchmark's manifest. Parameter counts at the byte
# vocabulary (256): bytes-140k 140,544; llama-1m 0.82M; llama-6m 6.36M; llama-25m 25.3M.
PRESETS: dict[str, dict[str, object]] = {
    "bytes-140k": {},
    "llama-1m": {"factory": "llama", "size": "1m"},
    "llama-6m": {"factory": "llama", "size": "10m"},
    "llama-25m": {"factory": "llama", "size": "10m", "d_model": 512, "num_heads": 8, "num_kv_heads": 4,
                  "d_ff": 1536},
}
DEFAULT_PRESET = "bytes-140k"
FRAGMENT_MODES = tuple(m for m in runner.MODES if m != "data_parallel")


def parse_overrides(items: list[str]) -> dict[str, dict[str, object]]:
    """`section.key=value` strings -> {section: {key: value}}; values are parsed as JSON when they
    can be (numbers, true/false), otherwise kept as strings (codec and merge names)."""
    out: dict[str, dict[str, object]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        section, dot, key = name.strip().partition(".")
        if not sep or not dot or not section or not key:
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. outer.lr=0.9")
        try:
            value: object = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out.setdefault(section, {})[key] = value
    return out


def merged_overrides(*layers: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    """Later layers win, key by key."""
    out: dict[str, dict[str, object]] = {}
    for layer in layers:
        for section, values in layer.items():
            out.setdefault(section, {}).update(values)
    return out


def with_overrides(manifest: RunManifest, overrides: dict[str, dict[str, object]]) -> RunManifest:
    """The manifest with `overrides` applied, validated like a config file (unknown keys are errors)."""
    if not overrides:
        return manifest
    try:  # --set sync.preset=NAME: the preset's keys, under any key set explicitly
        overrides = expand_preset(overrides)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    raw = manifest.to_dict()
    for section, values in overrides.items():
        if not isinstance(raw.get(section), dict):
            raise ConfigError(f"override section {section!r}: must be one of "
                              + ", ".join(k for k, v in raw.items() if isinstance(v, dict)))
        raw[section].update(values)
    return RunManifest.from_dict(raw)


def benchmark_manifest(steps: int, seed: int) -> RunManifest:
    """train's default manifest, which carries the re-swept warm-up (a third of the run) and
    H = 28 (docs/PARITY.md, "Re-sweep at 600 steps (lecun head)"). Every mode, data_parallel
    included, gets the same inner schedule, so the baseline is a fair one."""
    return default_manifest(steps, seed)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of the sweep: everything a row depends on except the seed, scenario and mode."""

    preset: str
    steps: int
    learners: int
    codecs: str  # "up/down", e.g. "int4/int4"

    def cell_overrides(self, global_batch: int) -> dict[str, dict[str, object]]:
        up, _, down = self.codecs.partition("/")
        layer: dict[str, dict[str, object]] = {"inner": {"batch_size": global_batch // self.learners},
                                               "sync": {"codec_up": up, "codec_down": down}}
        if PRESETS[self.preset]:
            layer["model"] = dict(PRESETS[self.preset])
        return layer


def _row(result: runner.RunResult, *, mode: str, scenario: str, seed: int, cell: Cell, manifest: RunManifest,
         params: int) -> dict:
    return {
        "mode": mode, "scenario": scenario, "eval_loss": round(result.eval_loss, 4),
        "bytes_cross_site": result.bytes_cross_site, "bytes_up": result.bytes_up, "idle_fraction": round(result.idle_fraction, 4),
        "merges": result.merges, "wall_s": round(result.wall_s, 1),
        "merges_during_outage": result.merges_during_outage, "tokens": result.tokens,
        "virtual_s": round(result.virtual_s, 1), "eval_loss_start": round(result.eval_loss_start, 4),
        "eval_loss_stderr": round(result.eval_loss_stderr, 4), "seed": seed, "preset": cell.preset,
        "params": params, "steps_per_learner": cell.steps, "num_learners": cell.learners,
        "batch_per_learner": manifest.inner.batch_size,
        "codecs": "" if mode == "data_parallel" else cell.codecs, "inner_lr": manifest.inner.lr_peak,
        "optimizer": manifest.inner.optimizer,
        "eval_batch_losses": [round(x, 5) for x in result.eval_batch_losses],
        # Per merged round of a sparse uplink (sim/sparse_diagnostics.py); empty for dense codecs.
        "sparse_rounds": result.sparse_rounds,
    }


def _param_count(manifest: RunManifest) -> int:
    """Parameters of the manifest's model, from its abstract shapes (no weights are initialised)."""
    _, abstract = factory.abstract_model(factory.recipe(manifest.model))
    return sum(int(math.prod(shape)) for shape in model_lib.param_shapes(abstract).values())


def run_all(steps: int | Iterable[int], modes: list[str], scenarios: list[str], seed: int | Iterable[int],
            verbose: bool = True,
            min_round_interval_factor: float = runner.DEFAULT_MIN_ROUND_INTERVAL_FACTOR,
            overrides: dict[str, dict[str, object]] | None = None,
            dp_overrides: dict[str, dict[str, object]] | None = None, *,
            learners: Iterable[int] = (NUM_LEARNERS,), codecs: Iterable[str] = ("",),
            presets: Iterable[str] = (DEFAULT_PRESET,), dp_lrs: Iterable[float] = (),
            global_batch: int | None = None, eval_batches: int = EVAL_BATCHES,
            corpora: dict[int, data_lib.Corpus] | None = None, topk2: tuple[int, int] | None = None) -> dict:
    """Every (preset, steps, learners, codecs) cell x seed x scenario x mode.

    `overrides` change the manifest of the fragment modes (diloco, streaming, decoupled),
    `dp_overrides` that of data_parallel, so a learner-side setting never moves the baseline.
    The cell's own settings (per-learner batch = global batch / M, codecs, model) come first and
    explicit overrides win. data_parallel does not depend on the codecs, so it runs once per cell
    without them; `dp_lrs` adds data_parallel rows at other inner peak learning rates (uniform
    runs of the same cells), which the summary uses for the gap to data-parallel at its best rate.
    An empty codec ("") keeps the manifest's codecs. `corpora` gives each seed's corpus (default:
    the standard library's files, split by the seed). `topk2` = (k, C) sends a topk2 uplink's top k of
    every C values instead of the codec's 64 of 4,096 (a measurement: the manifest has no key for it).
    """
    steps_list = [steps] if isinstance(steps, int) else list(steps)
    seeds = [seed] if isinstance(seed, int) else list(seed)
    learners, codecs, presets, dp_lrs = list(learners), list(codecs), list(presets), list(dp_lrs)
    for preset in presets:
        if preset not in PRESETS:
            raise ConfigError(f"preset {preset!r}: must be one of {', '.join(PRESETS)}")
    base_batch = benchmark_manifest(steps_list[0], seeds[0]).inner.batch_size
    global_batch = global_batch or base_batch * NUM_LEARNERS
    for m in learners:
        if m < 1 or global_batch % m:
            raise ConfigError(f"learners = {m}: must divide the global batch of {global_batch} windows")
    results = []
    param_counts: dict[str, int] = {}
    # One corpus per seed (its held-out split depends on the seed), read once for every cell.
    corpora = corpora if corpora is not None else {s: data_lib.stdlib_corpus(seed=s) for s in seeds}
    for preset in presets:
        for n_steps in steps_list:
            for m in learners:
                for codec_index, codec in enumerate(codecs):
                    cell = Cell(preset, n_steps, m, codec or _manifest_codecs(n_steps, seeds[0]))
                    for s in seeds:
                        corpus = corpora[s]
                        base = with_overrides(benchmark_manifest(n_steps, s), cell.cell_overrides(global_batch))
                        manifest = with_overrides(base, overrides or {})
                        dp_manifest = with_overrides(base, dp_overrides or {})
                        if preset not in param_counts:
                            param_counts[preset] = _param_count(manifest)
                        for scenario in scenarios:
                            speeds, outages = runner.scenario_settings(scenario, m, n_steps)
                            for mode in modes:
                                if mode == "data_parallel":
                                    if codec_index:
                                        continue  # data-parallel moves raw fp32 whatever the codecs
                                    lrs = [None] + ([lr for lr in dp_lrs if lr != dp_manifest.inner.lr_peak]
                                                    if scenario == "uniform" else [])
                                else:
                                    lrs = [None]
                                for lr in lrs:
                                    chosen = dp_manifest if mode == "data_parallel" else manifest
                                    if lr is not None:
                                        chosen = with_overrides(chosen, {"inner": {"lr_peak": lr}})
                                    config = runner.RunnerConfig(
                                        chosen, mode, m, n_steps, speeds=speeds, outages=outages,
                                        min_round_interval_factor=min_round_interval_factor,
                                        eval_batches=eval_batches, eval_batch_size=EVAL_BATCH_SIZE,
                                        topk2=None if mode == "data_parallel" else topk2)
                                    result = runner.run(config, corpus)
                                    row = _row(result, mode=mode, scenario=scenario, seed=s, cell=cell,
                                               manifest=chosen, params=param_counts[preset])
                                    row["dp_lr_sweep"] = lr is not None
                                    row["topk2"] = "" if config.topk2 is None else "{}/{}".format(*config.topk2)
                                    results.append(row)
                                    if verbose:
                                        print(_row_line(row), flush=True)
    first = benchmark_manifest(steps_list[0], seeds[0])
    config = {"num_learners": learners[0] if len(learners) == 1 else learners, "steps_per_learner":
              steps_list[0] if len(steps_list) == 1 else steps_list, "seed": seeds[0], "seeds": seeds,
              "learners": learners, "steps": steps_list, "codecs": [c or _manifest_codecs(steps_list[0], seeds[0])
                                                                    for c in codecs],
              "presets": presets, "dp_lrs": dp_lrs, "global_batch": global_batch,
              "eval_windows": eval_batches * EVAL_BATCH_SIZE, "manifest": with_overrides(first, overrides or {}).to_dict(),
              "data_parallel_manifest": with_overrides(first, dp_overrides or {}).to_dict(), "base_step_s": 1.0,
              "link": dataclasses.asdict(runner.LinkModel()), "straggler_slowdown": runner.STRAGGLER_SLOWDOWN,
              "corpus": corpora[seeds[0]].description, "min_round_interval_factor": min_round_interval_factor,
              "param_counts": param_counts, "topk2": "" if topk2 is None else "{}/{}".format(*topk2)}
    report = {"results": results, "config": config}
    report["gaps"] = gaps(report)
    return report


def _manifest_codecs(steps: int, seed: int) -> str:
    sync = benchmark_manifest(steps, seed).sync
    return f"{sync.codec_up}/{sync.codec_down}"


def _row_line(row: dict) -> str:
    lr = f" lr {row['inner_lr']:g}" if row.get("dp_lr_sweep") else ""
    k = f" k/C {row['topk2']}" if row.get("topk2") else ""
    return (f"{row['preset']:10s} steps {row['steps_per_learner']:5d} M {row['num_learners']} seed {row['seed']} "
            f"{row['scenario']:9s} {row['mode']:13s}{lr} {row['codecs']:10s}{k} eval_loss {row['eval_loss']:.4f}"
            f"±{row['eval_loss_stderr']:.4f}  bytes {row['bytes_cross_site']:>13,d}  idle {row['idle_fraction']:.3f}  "
            f"merges {row['merges']:5d} (outage {row['merges_during_outage']})  wall {row['wall_s']:.1f}s")


def paired_gap_stderr(losses: list[float], baseline: list[float]) -> float:
    """Standard error of the gap mean(losses) / mean(baseline) - 1 that comes from the eval set
    alone: both models scored on the same batches, so the batch-to-batch difference in difficulty
    cancels and only the spread of the per-batch differences counts (0 when either is missing)."""
    if len(losses) != len(baseline) or len(losses) < 2:
        return 0.0
    diffs = [a - b for a, b in zip(losses, baseline)]
    return statistics.stdev(diffs) / len(diffs) ** 0.5 / statistics.fmean(baseline)


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 5), "min": round(min(values), 5), "max": round(max(values), 5)}


def gaps(report: dict) -> list[dict]:
    """Each fragment mode's loss gap to data-parallel, computed within each seed, then spread over
    seeds: against data-parallel at the learners' own settings (`gap`) and, where data-parallel
    was swept (`--dp-lrs`), against data-parallel at the peak rate with the lowest mean loss over
    the seeds (`gap_vs_best_dp`), as the literature compares. Bytes: how many times fewer than
    data-parallel moved for the same tokens."""
    rows = report["results"]
    out = []
    dp_main = {(r["preset"], r["steps_per_learner"], r["num_learners"], r["scenario"], r["seed"]): r
               for r in rows if r["mode"] == "data_parallel" and not r.get("dp_lr_sweep")}
    dp_by_lr: dict[tuple, dict[float, dict[int, float]]] = {}
    for r in rows:
        if r["mode"] == "data_parallel" and r["scenario"] == "uniform":
            key = (r["preset"], r["steps_per_learner"], r["num_learners"])
            dp_by_lr.setdefault(key, {}).setdefault(r["inner_lr"], {})[r["seed"]] = r["eval_loss"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["mode"] != "data_parallel":
            key = (r["preset"], r["steps_per_learner"], r["num_learners"], r["codecs"], r["scenario"], r["mode"])
            groups.setdefault(key, []).append(r)
    for (preset, steps, m, codecs, scenario, mode), members in groups.items():
        pairs = [(r, dp_main.get((preset, steps, m, scenario, r["seed"]))) for r in members]
        pairs = [(r, dp) for r, dp in pairs if dp is not None]
        if not pairs:
            continue
        entry = {"preset": preset, "steps_per_learner": steps, "num_learners": m, "codecs": codecs,
                 "scenario": scenario, "mode": mode, "seeds": [r["seed"] for r, _ in pairs],
                 "eval_loss": _spread([r["eval_loss"] for r, _ in pairs]),
                 "data_parallel_eval_loss": _spread([dp["eval_loss"] for _, dp in pairs]),
                 "gap": _spread([r["eval_loss"] / dp["eval_loss"] - 1 for r, dp in pairs]),
                 "gap_eval_stderr": round(statistics.fmean(
                     paired_gap_stderr(r.get("eval_batch_losses", []), dp.get("eval_batch_losses", []))
                     for r, dp in pairs), 5),
                 "bytes_ratio": _spread([dp["bytes_cross_site"] / max(r["bytes_cross_site"], 1) for r, dp in pairs])}
        swept = dp_by_lr.get((preset, steps, m), {})
        seeds = set(entry["seeds"])
        complete = {lr: by_seed for lr, by_seed in swept.items() if seeds <= set(by_seed)}
        if len(complete) > 1 and scenario == "uniform":
            best_lr = min(complete, key=lambda lr: statistics.fmean(complete[lr][s] for s in seeds))
            entry["best_dp_lr"] = best_lr
            entry["gap_vs_best_dp"] = _spread([r["eval_loss"] / complete[best_lr][r["seed"]] - 1 for r, _ in pairs])
        out.append(entry)
    return out


def _mean_of(report: dict, mode: str, scenario: str, key: str, **where) -> float | None:
    values = [r[key] for r in report["results"] if r["mode"] == mode and r["scenario"] == scenario
              and not r.get("dp_lr_sweep") and all(r[k] == v for k, v in where.items())]
    return statistics.fmean(values) if values else None


def summary(report: dict) -> list[str]:
    """The gaps table, then the targets checked against the measured rows (a line each)."""
    lines = []
    for g in report.get("gaps") or gaps(report):
        best = (f"  vs best dp (lr {g['best_dp_lr']:g}) {g['gap_vs_best_dp']['mean']:+.1%}"
                f" [{g['gap_vs_best_dp']['min']:+.1%}, {g['gap_vs_best_dp']['max']:+.1%}]") if "best_dp_lr" in g else ""
        lines.append(f"{g['preset']:10s} steps {g['steps_per_learner']:5d} M {g['num_learners']} {g['codecs']:10s} "
                     f"{g['scenario']:9s} {g['mode']:10s} gap {g['gap']['mean']:+.1%} [{g['gap']['min']:+.1%}, "
                     f"{g['gap']['max']:+.1%}] (eval noise ±{g['gap_eval_stderr']:.2%}) over seeds {g['seeds']}  bytes {g['bytes_ratio']['mean']:.0f}x fewer{best}")
    cells = {(r["preset"], r["steps_per_learner"], r["num_learners"], r["codecs"]) for r in report["results"]
             if r["mode"] != "data_parallel"}
    for preset, steps, m, codecs in sorted(cells):
        where = {"preset": preset, "steps_per_learner": steps, "num_learners": m}
        tag = f"[{preset}, {steps} steps, M {m}, {codecs}]"
        sparse = codecs.startswith("topk2")  # issue 24's targets for the sparse uplink
        dp_bytes = _mean_of(report, "data_parallel", "uniform", "bytes_cross_site", **where)
        dp = _mean_of(report, "data_parallel", "uniform", "eval_loss", **where)
        dec = _mean_of(report, "decoupled", "uniform", "eval_loss", codecs=codecs, **where)
        if dp and dec:
            dec_bytes = _mean_of(report, "decoupled", "uniform", "bytes_cross_site", codecs=codecs, **where)
            target = "<= +4.5% at 600 steps, <= +3% at ~1,400" if m > 1 else "<= 0 (M = 1 no worse than data-parallel)"
            lines.append(f"{tag} uniform: decoupled vs data_parallel loss gap {dec / dp - 1:+.1%} (mean over seeds; "
                         f"target {target}), bytes {dp_bytes / max(dec_bytes, 1):.0f}x fewer "
                         f"(target >= {'1,000' if sparse else '200'}x)")
        dil = _mean_of(report, "diloco", "straggler", "eval_loss", codecs=codecs, **where)
        dec_s = _mean_of(report, "decoupled", "straggler", "eval_loss", codecs=codecs, **where)
        if dil and dec_s:
            idle_dec = _mean_of(report, "decoupled", "straggler", "idle_fraction", codecs=codecs, **where)
            idle_dil = _mean_of(report, "diloco", "straggler", "idle_fraction", codecs=codecs, **where)
            lines.append(f"{tag} straggler: idle decoupled {idle_dec:.3f} (target <= 0.05), diloco {idle_dil:.3f} "
                         f"(target >= 0.3); decoupled vs diloco loss {dec_s / dil - 1:+.1%} (target <= 2%)")
        dec_s_bytes = _mean_of(report, "decoupled", "straggler", "bytes_cross_site", codecs=codecs, **where)
        if dp_bytes and dec_s_bytes:
            lines.append(f"{tag} straggler: decoupled bytes {dp_bytes / max(dec_s_bytes, 1):.0f}x fewer than "
                         f"data_parallel uniform (target >= {'700' if sparse else '200'}x)")
        dec_o = _mean_of(report, "decoupled", "outage", "eval_loss", codecs=codecs, **where)
        if dec_o and dec:
            during = _mean_of(report, "decoupled", "outage", "merges_during_outage", codecs=codecs, **where)
            lines.append(f"{tag} outage: decoupled merges during the outage {during:.0f} (target > 0), "
                         f"loss vs its uniform {dec_o / dec - 1:+.1%} (target <= 3%)")
    return lines


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _topk2(text: str) -> tuple[int, int]:
    """--topk2 K/C -> (k, C); the runner checks the values against the codec."""
    k, _, chunk = text.partition("/")
    try:
        return int(k), int(chunk)
    except ValueError:
        raise ConfigError(f"--topk2 {text!r}: expected K/C, e.g. 32/4096") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help=f"smoke run ({QUICK_STEPS} steps per learner, one seed)")
    parser.add_argument("--steps", default=None, help=f"nominal steps per learner, comma-separated for a budget "
                                                      f"sweep (default {FULL_STEPS})")
    parser.add_argument("--modes", default=",".join(runner.MODES))
    parser.add_argument("--scenarios", default=",".join(runner.SCENARIOS))
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", default=None, help="comma-separated seeds (default "
                                                     f"{','.join(map(str, DEFAULT_SEEDS))}); gaps are taken within a seed")
    seeds.add_argument("--seed", type=int, default=None, help="one seed")
    parser.add_argument("--learners", default=str(NUM_LEARNERS),
                        help="comma-separated M (learners), at a fixed global batch, e.g. 1,2,4,8")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="windows per step summed over the learners (default: 4 x the manifest's batch)")
    parser.add_argument("--codecs", default="", help="comma-separated up/down codec pairs of the fragment modes, "
                                                     "e.g. int4/int4,fp32/fp32,int4/fp32 (default: the manifest's)")
    parser.add_argument("--presets", default=DEFAULT_PRESET, help=f"comma-separated model sizes: {', '.join(PRESETS)}")
    parser.add_argument("--dp-lrs", default="", help="extra inner peak rates for data_parallel (uniform), for the "
                                                     "gap against data-parallel at its best rate, e.g. 0.0045,0.006")
    parser.add_argument("--eval-batches", type=int, default=EVAL_BATCHES,
                        help=f"held-out batches of {EVAL_BATCH_SIZE} windows scored at the end of each run")
    parser.add_argument("--min-round-interval-factor", type=float, default=runner.DEFAULT_MIN_ROUND_INTERVAL_FACTOR,
                        help="decoupled: rho of the per-fragment round rate limit (0 disables it)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                        help="override a manifest value of the fragment modes, e.g. outer.lr=0.9 (repeatable)")
    parser.add_argument("--dp-set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="dp_overrides",
                        help="override a manifest value of data_parallel only, e.g. inner.lr_peak=0.006")
    parser.add_argument("--topk2", default=None, metavar="K/C",
                        help="a topk2 uplink sends the top K of every C values (default: the codec's 64/4096); "
                             "a measurement knob, the daemon always sends the codec's default")
    parser.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                        help="a [run.model] key for EVERY mode, e.g. --model factory=llama --model d_model=64")
    args = parser.parse_args(argv)
    args.overrides = [f"model.{item}" for item in args.model] + args.overrides
    args.dp_overrides = [f"model.{item}" for item in args.model] + args.dp_overrides
    try:
        steps = _ints(args.steps) if args.steps else [QUICK_STEPS if args.quick else FULL_STEPS]
        if args.seed is not None:
            seed_list = [args.seed]
        elif args.seeds:
            seed_list = _ints(args.seeds)
        else:
            seed_list = [0] if args.quick else list(DEFAULT_SEEDS)
        learners, dp_lrs = _ints(args.learners), _floats(args.dp_lrs)
        codecs = [c.strip() for c in args.codecs.split(",") if c.strip()] or [""]
        for codec in filter(None, codecs):
            up, slash, down = codec.partition("/")
            if not (slash and up and down):
                raise ConfigError(f"codecs {codec!r}: expected UP/DOWN, e.g. int4/int4")
        presets = [p.strip() for p in args.presets.split(",") if p.strip()]
        if not steps or not seed_list or not learners or not presets or min(steps) < 1:
            raise ConfigError("--steps, --seeds, --learners and --presets each need at least one value (steps >= 1)")
        overrides, dp_overrides = parse_overrides(args.overrides), parse_overrides(args.dp_overrides)
        topk2 = _topk2(args.topk2) if args.topk2 else None
        default_manifest_checked = benchmark_manifest(steps[0], seed_list[0])
        with_overrides(default_manifest_checked, overrides)
        with_overrides(default_manifest_checked, dp_overrides)
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    started = time.perf_counter()
    try:
        report = run_all(steps, args.modes.split(","), args.scenarios.split(","), seed_list,
                         min_round_interval_factor=args.min_round_interval_factor,
                         overrides=overrides, dp_overrides=dp_overrides, learners=learners, codecs=codecs,
                         presets=presets, dp_lrs=dp_lrs, global_batch=args.global_batch,
                         eval_batches=args.eval_batches, topk2=topk2)
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    report["config"]["total_wall_s"] = round(time.perf_counter() - started, 1)
    for line in summary(report):
        print(line)
    print(f"total wall time {report['config']['total_wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
