"""Chaos benchmarks: the long soak and the goodput comparison, against real daemons.

    python benchmarks/chaos.py soak      # 10 minutes, >= 20 faults incl. coordinator kills and
                                         # SIGSTOPs, one site joining, and one at least of each
                                         # storage and clock fault (full disk, I/O errors, a crash
                                         # at a fsync, a file damaged at rest, a wall-clock jump),
                                         # decoupled and synchronous
    python benchmarks/chaos.py goodput   # one learner down a third of the time: decoupled
                                         # goodput >= 0.85, synchronous <= 0.6
    python benchmarks/chaos.py all
Options: --seed N, --duration S (override), --relays FANOUT (every daemon relays commits down a
tree of that fan-out), --standin (engine self-test with stand-in nodes; its figures say nothing
about the daemon), --out FILE (the JSON reports), --without-storage-faults (the soak as before
storage and clock faults existed), --corruptions (which damage a `corrupt` fault may do),
--codecs UP/DOWN (the run's outer-gradient codecs, e.g. topk2/union8; default the run's default).

Heavy: the soak runs every mode for the full duration (about 25 minutes for both). Run it once,
alone, and say in any figure you quote whether the machine was shared.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from diloco_node.config.manifest import CODEC_NAMES
from diloco_node.testbed.chaos.harness import (
    DAEMON_CONFIG,
    ChaosConfig,
    DaemonLauncher,
    StandinLauncher,
    run_chaos,
    standin_config,
)
from diloco_node.testbed.chaos.schedule import CORRUPTIONS

PRESETS = {
    # The soak: 10 minutes, >= 20 faults, the coordinator included, a site joining.
    "soak": dict(duration_s=600.0, faults=24, joiners=1, scenario="random", storage_faults=True),
    # The goodput comparison: one learner killed for a third of the window, nothing else.
    "goodput": dict(duration_s=300.0, faults=2, joiners=0, scenario="learner-down"),
}


def _codecs(parser: argparse.ArgumentParser, text: str | None) -> tuple[str, str] | None:
    if text is None:
        return None
    up, slash, down = text.partition("/")
    if not slash or up not in CODEC_NAMES or down not in CODEC_NAMES:
        parser.error(f"--codecs must be UP/DOWN with each one of {', '.join(CODEC_NAMES)}; got {text!r}")
    return up, down


def _config_template(directory: Path, seed: int, codecs: tuple[str, str]) -> Path:
    """The harness's daemon config with the run's codecs set ([run.sync] is its last table)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "daemon-template.toml"
    path.write_text(DAEMON_CONFIG.format(seed=seed) + f'codec_up = "{codecs[0]}"\ncodec_down = "{codecs[1]}"\n')
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=(*PRESETS, "all"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=None)
    parser.add_argument("--lease", type=float, default=3.0)
    parser.add_argument("--standin", action="store_true")
    parser.add_argument("--relays", type=int, default=0, metavar="FANOUT",
                        help="every daemon relays commits with this fan-out ([node] relay_fanout; 0: off)")
    parser.add_argument("--without-storage-faults", action="store_true",
                        help="the soak draws no disk, fsync, corruption or clock faults")
    parser.add_argument("--corruptions", default=",".join(CORRUPTIONS),
                        help=f"what a corrupt fault may do, comma-separated (default: all of {','.join(CORRUPTIONS)})")
    parser.add_argument("--codecs", default=None, metavar="UP/DOWN",
                        help="the run's codec_up/codec_down for the daemons, e.g. topk2/union8")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    codecs = _codecs(parser, args.codecs)
    if codecs and args.standin:
        parser.error("--codecs needs real daemons (not --standin)")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="diloco-chaos-bench-"))
    reports = {}
    for name in (PRESETS if args.what == "all" else [args.what]):
        preset = dict(PRESETS[name])
        if args.duration is not None:
            preset["duration_s"] = args.duration
        if args.without_storage_faults:
            preset["storage_faults"] = False
        preset["corruptions"] = tuple(filter(None, args.corruptions.split(",")))
        config = ChaosConfig(workdir=workdir / name, seed=args.seed, lease_s=args.lease, **preset)
        if args.standin:
            config = standin_config(config)
        if args.standin and args.relays:
            parser.error("--relays needs real daemons (not --standin)")
        extra = (f"relay_fanout={args.relays}",) if args.relays else ()
        template = _config_template(workdir / name, args.seed, codecs) if codecs else None
        launcher = StandinLauncher() if args.standin else DaemonLauncher(template, extra_settings=extra)
        started = time.monotonic()
        print(f"{name}: {config.duration_s:.0f}s per mode, histories under {config.workdir}", file=sys.stderr)
        report = run_chaos(config, launcher)
        report["bench_wall_s"] = round(time.monotonic() - started, 1)
        reports[name] = report
        summary = {mode: {k: report[mode][k] for k in ("goodput", "uptime", "max_commit_gap_s", "failover_s",
                                                       "nodes_dead_at_end")}
                   for mode in config.modes}
        print(json.dumps({"what": name, "nodes": report["nodes"], "faults": report["faults"],
                          "violations": report["violations"], **summary}, indent=2))
        for target, result in report["targets"].items():
            first = f"; first: {result['first']}" if result.get("first") else ""
            print(f"  {'ok  ' if result['ok'] else 'MISS'} {target}: {result['value']} (target {result['target']}){first}")
    if args.out is not None:
        args.out.write_text(json.dumps(reports, indent=2) + "\n")
    return 1 if any(r["violations"] for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
