"""`diloco-node train`: an in-process multi-learner run from the command line.

All learners run in this one process on a virtual clock (`diloco_node/sim/runner.py`), with progress
lines and a summary (eval loss at start and end, merges, bytes that crossed sites vs what
data-parallel would have sent). (`diloco-node demo`, the main job, runs real processes instead:
`diloco_node/testbed/demo.py`.) `train` exposes every knob: mode, scenario, learners, model size,
steps, optimizers, sync, codecs, data source, link model, and a manifest file (TOML or JSON)
whose values flags override.

Exit status: 0 on success; 2 for bad configuration or data (the message names it); 1 when the
run itself failed (non-finite loss, or the model did not improve).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import tomllib
from typing import Any

from diloco_node.config.site_data import SiteData
from diloco_node.config.manifest import (
    CODEC_NAMES,
    ConfigError,
    InnerOptimizer,
    ModelSpec,
    RunManifest,
    SyncSpec,
)

DEFAULT_STEPS = 300  # about a minute of compute on two idle cores for M = 4 tiny learners


def default_manifest(steps: int, seed: int = 0) -> RunManifest:
    """The defaults of train and the parity benchmark: the manifest's own defaults (the daemon's:
    outer lr 0.7, momentum 0.6, H = 28, P = 4, int4 both ways, RDA, token weights, chosen by
    docs/PARITY.md), changed only where the value depends on the run's length or on a CPU's size:
    a model and batch a laptop trains in minutes, the inner schedule's horizon at `steps` with a
    warm-up of a third of the run (the 600-step re-sweep), and H = 16 for smoke runs of fewer
    than 128 steps (as before the re-sweep, which measured H = 28 at 600 steps)."""
    return RunManifest(
        model=ModelSpec.of(seq_len=64, size="tiny"),
        inner=InnerOptimizer(batch_size=8, warmup_steps=steps // 3, total_steps=max(steps, 2)),
        sync=SyncSpec() if steps >= 128 else SyncSpec(period=16),
        seed=seed,
    )


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help="nominal steps per learner (token budget = learners x steps x batch x seq_len)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25, help="ticks between progress lines (0: none)")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH")
    from diloco_node.sim.runner import MODES, SCENARIOS

    parser.add_argument("--config", metavar="FILE", help="run manifest (TOML or JSON); flags below override it")
    parser.add_argument("--mode", choices=MODES, default="decoupled")
    parser.add_argument("--scenario", choices=SCENARIOS, default="uniform",
                        help="uniform | straggler (last learner 2.5x slower) | outage (last learner down mid-run)")
    parser.add_argument("--learners", type=int, default=4, help="M")
    parser.add_argument("--speeds", help="relative speeds, comma-separated (overrides the scenario's)")
    parser.add_argument("--outage", action="append", default=[], metavar="M:START:END",
                        help="learner M down from virtual second START to END (repeatable)")
    parser.add_argument("--base-step-s", type=float, default=1.0, help="virtual seconds per step at speed 1")
    parser.add_argument("--bandwidth-mbit", type=float, default=100.0, help="link bandwidth per site")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="link latency")
    model = parser.add_argument_group("model and data")
    model.add_argument("--factory", help='model factory: "bytes", "llama" or "package.module:function"')
    model.add_argument("--size", help="the factory's named size (bytes: tiny, small, medium; llama: 1m, 10m, 100m, 1b)")
    model.add_argument("--vocab-size", type=int)
    model.add_argument("--seq-len", type=int)
    model.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                       help="any other [run.model] option for the factory, e.g. num_layers=4 (repeatable)")
    model.add_argument("--data", nargs="+", metavar="PATH_OR_GLOB", help="text files/dirs/globs instead of the stdlib")
    model.add_argument("--token-file", nargs="+", metavar="PATH_OR_GLOB",
                       help="pre-tokenized token files (.bin or .npy, memory-mapped) instead of the stdlib")
    model.add_argument("--token-dtype", choices=("uint8", "uint16", "uint32"), help="id type of --token-file")
    model.add_argument("--tokenizer", metavar="TOKENIZER_JSON", help="tokenize --data with this local tokenizer.json")
    inner = parser.add_argument_group("inner optimizer (AdamW)")
    inner.add_argument("--batch-size", type=int)
    inner.add_argument("--lr", type=float, help="peak learning rate")
    inner.add_argument("--warmup", type=int, help="warm-up steps")
    inner.add_argument("--weight-decay", type=float)
    outer = parser.add_argument_group("outer optimizer (Nesterov SGD)")
    outer.add_argument("--outer-lr", type=float)
    outer.add_argument("--outer-momentum", type=float)
    sync = parser.add_argument_group("sync")
    sync.add_argument("--fragments", type=int, help="P")
    sync.add_argument("--period", type=int, help="H, in learner steps")
    sync.add_argument("--overlap", type=int, help="tau, in learner steps")
    sync.add_argument("--min-quorum", type=int, help="K (decoupled)")
    sync.add_argument("--grace-gamma", type=float)
    sync.add_argument("--grace-cap-s", type=float)
    sync.add_argument("--codec-up", choices=CODEC_NAMES)
    sync.add_argument("--codec-down", choices=CODEC_NAMES)
    sync.add_argument("--merge", choices=("rda", "mean"))
    sync.add_argument("--weighting", choices=("tokens", "uniform"))
    sync.add_argument("--apply", choices=("overwrite", "mix"))
    sync.add_argument("--mix-alpha", type=float)
    sync.add_argument("--keep-unmerged", action=argparse.BooleanOptionalAction, default=None,
                      help="a merge without a learner's contribution keeps its unsent progress "
                           "(default: the manifest's sync.keep_unmerged, off)")


def _load_manifest_file(path: str) -> RunManifest:
    try:
        with open(path, "rb") as f:
            raw_bytes = f.read()
    except OSError as exc:
        raise ConfigError(f"config file {path!r}: cannot read it ({exc.strerror or exc})") from None
    try:
        raw = json.loads(raw_bytes) if path.endswith(".json") else tomllib.loads(raw_bytes.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path!r}: not valid {'JSON' if path.endswith('.json') else 'TOML'} ({exc})") from None
    return RunManifest.from_dict(raw)


def _override(section: Any, **values: Any) -> Any:
    changes = {k: v for k, v in values.items() if v is not None}
    return dataclasses.replace(section, **changes) if changes else section


def _model_from_args(model: ModelSpec, args: argparse.Namespace) -> ModelSpec:
    """The manifest's model with the flags applied; a new factory starts from no options."""
    factory = args.factory or model.factory
    options = dict(model.options) if factory == model.factory else {}
    if args.size is not None:
        options["size"] = args.size
    for item in args.model_option:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--model-option {item!r}: expected KEY=VALUE, e.g. num_layers=4")
        try:
            options[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            options[key] = text  # a bare word is a string option
    return ModelSpec.of(factory, vocab_size=args.vocab_size or model.vocab_size,
                        seq_len=args.seq_len or model.seq_len, **options)


def build_manifest(args: argparse.Namespace) -> RunManifest:
    """The manifest of a `train` run: defaults, then the config file, then flags."""
    manifest = _load_manifest_file(args.config) if args.config else default_manifest(args.steps, args.seed)
    inner = _override(manifest.inner, batch_size=args.batch_size, lr_peak=args.lr, warmup_steps=args.warmup,
                      weight_decay=args.weight_decay)
    inner = dataclasses.replace(inner, total_steps=max(args.steps, inner.warmup_steps + 1))
    return RunManifest(
        model=_model_from_args(manifest.model, args),
        data=manifest.data,
        inner=inner,
        outer=_override(manifest.outer, lr=args.outer_lr, momentum=args.outer_momentum),
        sync=_override(manifest.sync, fragments=args.fragments, period=args.period, overlap=args.overlap,
                       min_quorum=args.min_quorum, grace_gamma=args.grace_gamma, grace_cap_s=args.grace_cap_s,
                       codec_up=args.codec_up, codec_down=args.codec_down, merge=args.merge,
                       weighting=args.weighting, apply=args.apply, mix_alpha=args.mix_alpha,
                       keep_unmerged=args.keep_unmerged),
        seed=manifest.seed if args.config else args.seed,
    )


def build_site_data(args: argparse.Namespace) -> SiteData:
    """What the in-process learners train on: the stdlib, or the flags' text or token files (as a
    site's [node.data] would name them; all M learners share it, each on its own shard)."""
    if args.data and args.token_file:
        raise ConfigError("--data and --token-file: choose one source")
    if args.token_dtype and not args.token_file:
        raise ConfigError("--token-dtype: only --token-file reads token files")
    if args.data:
        return SiteData(source="text", paths=tuple(args.data), tokenizer=args.tokenizer or "", seed=args.seed)
    if args.token_file:
        return SiteData(source="tokens", paths=tuple(args.token_file), token_dtype=args.token_dtype or "uint8",
                        tokenizer=args.tokenizer or "", seed=args.seed)
    if args.tokenizer:
        raise ConfigError("--tokenizer: tokenizes --data (or declares the tokenizer of --token-file)")
    return SiteData(seed=args.seed)


def _parse_outage(text: str):
    from diloco_node.sim.runner import Outage

    try:
        learner, start, end = text.split(":")
        return Outage(int(learner), float(start), float(end))
    except ValueError as exc:
        raise ConfigError(f"--outage {text!r}: expected LEARNER:START:END with START < END ({exc})") from None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def run(args: argparse.Namespace) -> int:
    from diloco_node.learn import data as data_lib
    from diloco_node.sim import runner

    try:
        manifest = build_manifest(args)
        speeds, outages = runner.scenario_settings(args.scenario, args.learners, args.steps, args.base_step_s)
        if args.speeds:
            try:
                speeds = tuple(float(s) for s in args.speeds.split(","))
            except ValueError:
                raise ConfigError(f"--speeds {args.speeds!r}: expected comma-separated numbers") from None
        if args.outage:
            outages = tuple(_parse_outage(o) for o in args.outage)
        link = runner.LinkModel(args.bandwidth_mbit * 1e6 / 8, args.latency_ms / 1000)
        config = runner.RunnerConfig(manifest, args.mode, args.learners, args.steps, speeds=speeds,
                                     outages=outages, base_step_s=args.base_step_s, link=link,
                                     log_every=args.log_every)
        corpus = data_lib.open_site_data(build_site_data(args), None)
    except (ConfigError, ValueError) as exc:  # DataError is a ValueError
        print(f"diloco-node {args.command}: {exc}", file=sys.stderr)
        return 2

    print(f"diloco-node {args.command}: mode {config.mode}, M = {config.num_learners} learners, "
          f"{manifest.model.factory} {manifest.model.option('size', '')} model, {config.steps} steps x {manifest.inner.batch_size}x{manifest.model.seq_len} "
          f"bytes per learner; corpus: {corpus.description} ({len(corpus.train):,} train / {len(corpus.eval):,} eval bytes)",
          flush=True)
    if config.mode != "data_parallel":
        sync = manifest.sync
        print(f"  sync: P = {sync.fragments}, H = {sync.period}, tau = {sync.overlap}, K = {sync.min_quorum}, "
              f"codecs {sync.codec_up}/{sync.codec_down}, merge {sync.merge} ({sync.weighting}), "
              f"outer lr {manifest.outer.lr} mu {manifest.outer.momentum}", flush=True)

    def progress(p: runner.Progress) -> None:
        print(f"  t={p.time_s:8.1f}s  step {p.step:5d}  loss {p.train_loss:.3f}  merges {p.merges:4d}  "
              f"bytes {_fmt_bytes(p.bytes_cross_site):>10s}  tokens {p.tokens:,}", flush=True)

    started = time.perf_counter()
    try:
        result = runner.run(config, corpus, progress)
    except (ConfigError, ValueError) as exc:
        print(f"diloco-node {args.command}: {exc}", file=sys.stderr)
        return 2
    print(f"done in {time.perf_counter() - started:.1f} s (virtual {result.virtual_s:.0f} s)")
    print(f"  eval loss: {result.eval_loss_start:.4f} at start -> {result.eval_loss:.4f} at end "
          f"({result.eval_loss / math.log(2):.3f} bits/byte)")
    print(f"  merges: {result.merges} ({result.merges_during_outage} during outages); idle fraction {result.idle_fraction:.3f}")
    dp = result.data_parallel_bytes_equivalent
    ratio = dp / max(result.bytes_cross_site, 1)
    print(f"  bytes across sites: {_fmt_bytes(result.bytes_cross_site)} (up {_fmt_bytes(result.bytes_up)}, "
          f"down {_fmt_bytes(result.bytes_down)}); data-parallel would have sent {_fmt_bytes(dp)} ({ratio:.0f}x more)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"result": result.to_dict(), "manifest": manifest.to_dict(), "mode": config.mode}, f, indent=2)
        print(f"  wrote {args.json}")
    if not math.isfinite(result.eval_loss):
        print(f"diloco-node {args.command}: failed: the final eval loss is not finite", file=sys.stderr)
        return 1
    if not result.eval_loss < result.eval_loss_start:
        print(f"diloco-node {args.command}: failed: the model did not improve "
              f"({result.eval_loss_start:.4f} -> {result.eval_loss:.4f})", file=sys.stderr)
        return 1
    return 0
