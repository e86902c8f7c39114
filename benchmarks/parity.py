"""Parity benchmark: every sync mode in three scenarios at equal total tokens (M = 4, stdlib corpus).

For each (mode, scenario) it reports eval_loss of the final global model, bytes_cross_site
(uplink + downlink payload bytes actually encoded), idle_fraction (learner time blocked on
others), merges and wall_s (real seconds of the simulated run). The learners run in one process
on a virtual clock (diloco_node/sim/runner.py); see docs/PARITY.md for the accounting.

    .venv/bin/python benchmarks/parity.py --json /tmp/parity.json        # full run
    .venv/bin/python benchmarks/parity.py --quick                        # smoke run
    .venv/bin/python benchmarks/parity.py --modes decoupled --scenarios uniform --set outer.lr=0.9
    .venv/bin/python benchmarks/parity.py --model factory=llama --model size=1m --model d_model=64 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

# Two cores: one XLA intra-op pool per process is enough; set before JAX starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diloco_node.learn import data as data_lib  # noqa: E402
from diloco_node.sim import runner  # noqa: E402
from diloco_node.config.manifest import ConfigError, RunManifest  # noqa: E402
from diloco_node.cli.train import default_manifest  # noqa: E402

NUM_LEARNERS = 4
FULL_STEPS = 600  # nominal steps per learner
QUICK_STEPS = 64


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


def with_overrides(manifest: RunManifest, overrides: dict[str, dict[str, object]]) -> RunManifest:
    """The manifest with `overrides` applied, validated like a config file (unknown keys are errors)."""
    if not overrides:
        return manifest
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


def run_all(steps: int, modes: list[str], scenarios: list[str], seed: int, verbose: bool = True,
            min_round_interval_factor: float = runner.DEFAULT_MIN_ROUND_INTERVAL_FACTOR,
            overrides: dict[str, dict[str, object]] | None = None,
            dp_overrides: dict[str, dict[str, object]] | None = None) -> dict:
    """`overrides` change the manifest of the fragment modes (diloco, streaming, decoupled),
    `dp_overrides` that of data_parallel, so a learner-side setting never moves the baseline."""
    corpus = data_lib.stdlib_corpus(seed=seed)
    base = benchmark_manifest(steps, seed)
    manifest = with_overrides(base, overrides or {})
    dp_manifest = with_overrides(base, dp_overrides or {})
    results = []
    for scenario in scenarios:
        speeds, outages = runner.scenario_settings(scenario, NUM_LEARNERS, steps)
        for mode in modes:
            config = runner.RunnerConfig(dp_manifest if mode == "data_parallel" else manifest, mode,
                                         NUM_LEARNERS, steps, speeds=speeds, outages=outages,
                                         min_round_interval_factor=min_round_interval_factor)
            result = runner.run(config, corpus)
            row = {
                "mode": mode, "scenario": scenario, "eval_loss": round(result.eval_loss, 4),
                "bytes_cross_site": result.bytes_cross_site, "idle_fraction": round(result.idle_fraction, 4),
                "merges": result.merges, "wall_s": round(result.wall_s, 1),
                "merges_during_outage": result.merges_during_outage, "tokens": result.tokens,
                "virtual_s": round(result.virtual_s, 1), "eval_loss_start": round(result.eval_loss_start, 4),
            }
            results.append(row)
            if verbose:
                print(f"{scenario:9s} {mode:13s} eval_loss {row['eval_loss']:.4f}  bytes {row['bytes_cross_site']:>13,d}  "
                      f"idle {row['idle_fraction']:.3f}  merges {row['merges']:5d} (outage {row['merges_during_outage']})  "
                      f"wall {row['wall_s']:.1f}s", flush=True)
    config = {"num_learners": NUM_LEARNERS, "steps_per_learner": steps, "seed": seed,
              "manifest": manifest.to_dict(), "data_parallel_manifest": dp_manifest.to_dict(), "base_step_s": 1.0,
              "link": dataclasses.asdict(runner.LinkModel()), "straggler_slowdown": runner.STRAGGLER_SLOWDOWN,
              "corpus": corpus.description, "min_round_interval_factor": min_round_interval_factor}
    return {"results": results, "config": config}


def summary(report: dict) -> list[str]:
    """The targets, checked against the measured rows (a line each)."""
    rows = {(r["mode"], r["scenario"]): r for r in report["results"]}
    lines = []

    def get(mode, scenario):
        return rows.get((mode, scenario))

    dp, dec = get("data_parallel", "uniform"), get("decoupled", "uniform")
    if dp and dec:
        gap = dec["eval_loss"] / dp["eval_loss"] - 1
        ratio = dp["bytes_cross_site"] / max(dec["bytes_cross_site"], 1)
        lines.append(f"uniform: decoupled vs data_parallel loss gap {gap:+.1%} (target <= 3%), "
                     f"bytes {ratio:.0f}x fewer (target >= 200x)")
    dil, dec_s = get("diloco", "straggler"), get("decoupled", "straggler")
    if dil and dec_s:
        gap = dec_s["eval_loss"] / dil["eval_loss"] - 1
        lines.append(f"straggler: idle decoupled {dec_s['idle_fraction']:.3f} (target <= 0.05), diloco "
                     f"{dil['idle_fraction']:.3f} (target >= 0.3); decoupled vs diloco loss {gap:+.1%} (target <= 2%)")
    dec_o = get("decoupled", "outage")
    if dec_o and dec:
        gap = dec_o["eval_loss"] / dec["eval_loss"] - 1
        lines.append(f"outage: decoupled merges during the outage {dec_o['merges_during_outage']} (target > 0), "
                     f"loss vs its uniform {gap:+.1%} (target <= 3%)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help=f"smoke run ({QUICK_STEPS} steps per learner)")
    parser.add_argument("--steps", type=int, default=None, help="nominal steps per learner")
    parser.add_argument("--modes", default=",".join(runner.MODES))
    parser.add_argument("--scenarios", default=",".join(runner.SCENARIOS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-round-interval-factor", type=float, default=runner.DEFAULT_MIN_ROUND_INTERVAL_FACTOR,
                        help="decoupled: rho of the per-fragment round rate limit (0 disables it)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                        help="override a manifest value of the fragment modes, e.g. outer.lr=0.9 (repeatable)")
    parser.add_argument("--dp-set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="dp_overrides",
                        help="override a manifest value of data_parallel only, e.g. inner.lr_peak=0.006")
    parser.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                        help="a [run.model] key for EVERY mode, e.g. --model factory=llama --model d_model=64")
    args = parser.parse_args(argv)
    args.overrides = [f"model.{item}" for item in args.model] + args.overrides
    args.dp_overrides = [f"model.{item}" for item in args.model] + args.dp_overrides
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    try:
        overrides, dp_overrides = parse_overrides(args.overrides), parse_overrides(args.dp_overrides)
        default_manifest_checked = benchmark_manifest(steps, args.seed)
        with_overrides(default_manifest_checked, overrides)
        with_overrides(default_manifest_checked, dp_overrides)
    except ConfigError as exc:
        parser.error(str(exc))
    started = time.perf_counter()
    report = run_all(steps, args.modes.split(","), args.scenarios.split(","), args.seed,
                     min_round_interval_factor=args.min_round_interval_factor,
                     overrides=overrides, dp_overrides=dp_overrides)
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
