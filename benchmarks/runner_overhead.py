"""Runner overhead: the in-process runner (decoupled, uniform) against a plain jitted, vmapped loop
of the same M learners, model, batches and steps with no synchronisation at all.

Both loops step the same compiled masked M-learner program on the same prefetched batches
(`sim/batches.py`); the runner adds the virtual clock, the fragment sends (a delta read on the
device, the codec, the daemon's Syncer and Replica) and the merges (the apply rule, a row written
on the device). Each is compiled by a warm-up run first, then timed; the figures are steps per
second of the M-learner tick (one tick = M learner steps). It also reports the parameter bytes the
runner brought from the device to the host per tick against the fp32 bytes of the fragments the
algorithm read (each contribution's delta; a local fragment when the apply rule reads one), and
prints the top entries of a profile of the timed runner.

    .venv/bin/python benchmarks/runner_overhead.py --preset bytes-140k --steps 200 --json /tmp/overhead.json
    .venv/bin/python benchmarks/runner_overhead.py --preset llama-1m --steps 100
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import parity  # noqa: E402
from diloco_node.learn import data as data_lib  # noqa: E402
from diloco_node.learn.inner import StackedLearners  # noqa: E402
from diloco_node.sim import runner  # noqa: E402
from diloco_node.sim.batches import StackedBatches  # noqa: E402

DEFAULT_STEPS = 200
# The warm-up run compiles every program the timed run uses: the step, and each fragment's read,
# delta and write programs (every fragment is sent and merged within one period of steps).
WARMUP_PERIODS = 2
PROFILE_TOP = 15


def _config(preset: str, steps: int, learners: int, seed: int, global_batch: int) -> runner.RunnerConfig:
    cell = parity.Cell(preset, steps, learners, "int4/int4")
    manifest = parity.with_overrides(parity.benchmark_manifest(steps, seed), cell.cell_overrides(global_batch))
    # One small eval batch: the timed figure is the training loop's, not the evaluation's.
    return runner.RunnerConfig(manifest, "decoupled", learners, steps, eval_batches=2, eval_batch_size=1)


def _runner_loop(config: runner.RunnerConfig, corpus: data_lib.Corpus, profile: cProfile.Profile | None
                 ) -> tuple[float, runner.RunResult]:
    setup = runner._setup(config, corpus)
    sync = runner._FragmentSync(config, setup, None)
    started = time.perf_counter()
    if profile is not None:
        profile.enable()
    result = sync.run()
    if profile is not None:
        profile.disable()
    return time.perf_counter() - started, result


def _plain_loop(config: runner.RunnerConfig, corpus: data_lib.Corpus) -> float:
    setup = runner._setup(config, corpus)
    stack = StackedLearners(setup.model, runner._inner_for(config), config.num_learners, config.manifest.seed,
                            setup.initial)
    batches = StackedBatches(setup.samplers, config.manifest.inner.batch_size, config.manifest.model.seq_len)
    mask = np.ones(config.num_learners, dtype=bool)
    started = time.perf_counter()
    loss = None
    for _ in range(config.steps):
        loss = stack.step(*batches.take(mask), mask)
    jax.block_until_ready(loss)
    return time.perf_counter() - started


def measure(preset: str, steps: int, learners: int = parity.NUM_LEARNERS, seed: int = 0,
            global_batch: int | None = None, profile_top: int = PROFILE_TOP) -> dict:
    base_batch = parity.benchmark_manifest(steps, seed).inner.batch_size
    global_batch = global_batch or base_batch * parity.NUM_LEARNERS
    corpus = data_lib.stdlib_corpus(seed=seed)
    config = _config(preset, steps, learners, seed, global_batch)
    warm = _config(preset, WARMUP_PERIODS * config.manifest.sync.period, learners, seed, global_batch)
    _runner_loop(warm, corpus, None)
    _plain_loop(warm, corpus)
    plain_s = _plain_loop(config, corpus)
    profile = cProfile.Profile()
    runner_s, result = _runner_loop(config, corpus, profile)
    ticks = steps  # uniform: every learner steps on every tick
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(profile_top)
    report = {
        "preset": preset, "runner_steps_per_s": round(ticks / runner_s, 3), "plain_steps_per_s": round(ticks / plain_s, 3),
        "ratio": round(plain_s / runner_s, 3),
        "device_to_host_bytes_per_step": round(result.device_to_host_bytes / ticks, 1),
        "fragment_bytes_due_per_step": round(result.fragment_bytes_due / ticks, 1),
        "steps": steps, "learners": learners, "global_batch": global_batch, "seed": seed,
        "params": parity._param_count(config.manifest), "device": str(jax.devices()[0]), "jax": jax.__version__,
        "runner_s": round(runner_s, 2), "plain_s": round(plain_s, 2), "merges": result.merges,
    }
    return {"report": report, "profile": out.getvalue()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=parity.DEFAULT_PRESET, choices=list(parity.PRESETS))
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="ticks of the M learners (timed)")
    parser.add_argument("--learners", type=int, default=parity.NUM_LEARNERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.learners < 1:
        parser.error("--steps and --learners must be >= 1")
    measured = measure(args.preset, args.steps, args.learners, args.seed, args.global_batch)
    report = measured["report"]
    print("\n".join(line for line in measured["profile"].splitlines() if line.strip())[:6000])
    print(json.dumps(report, indent=2))
    bytes_ratio = report["device_to_host_bytes_per_step"] / max(report["fragment_bytes_due_per_step"], 1e-9)
    print(f"runner / plain loop {report['ratio']:.3f} (target >= 0.9 on the CPU); device-to-host bytes "
          f"{bytes_ratio:.2f}x the fragment bytes due (target <= 1.25x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
