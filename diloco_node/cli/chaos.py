"""`diloco-node chaos`: run a seeded chaos schedule against local sites and print the JSON report.

    diloco-node chaos --seed 3 --duration 60 --faults 4            # real daemons, both modes
    diloco-node chaos --scenario learner-down --duration 300       # the goodput comparison
    diloco-node chaos --schedule-only --seed 3 --duration 600 --faults 24
    diloco-node chaos --storage-faults --corruptions log:truncate ...  # disks, fsyncs, damage at rest, clocks
    diloco-node chaos --nodes 5 --coordinator-partition ...       # the lease holder in a cut-off minority
    diloco-node chaos --check RUN_DIR                              # re-check a run's histories
    diloco-node chaos --standin ...                                # stand-in nodes: tests the engine only

Exit status: 0 when the checker found no violation, 1 when it found some (or, with --strict, a
target was missed), 2 when the run could not be carried out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from diloco_node.testbed.chaos.harness import (
    MODES,
    SCENARIOS,
    ChaosConfig,
    DaemonLauncher,
    HarnessError,
    StandinLauncher,
    build_schedule,
    run_chaos,
    standin_config,
)
from diloco_node.testbed.chaos.schedule import CORRUPTIONS, ScheduleError


def add_arguments(parser: argparse.ArgumentParser, name: str = "chaos") -> None:
    parser.add_argument("--seed", type=int, default=0, help="nemesis seed (the same seed replays the same schedule)")
    parser.add_argument("--nodes", type=int, default=3, help="founding sites (>= 3)")
    parser.add_argument("--joiners", type=int, default=0, help="sites that join mid-run")
    parser.add_argument("--duration", type=float, default=60.0, help="schedule length in seconds")
    parser.add_argument("--faults", type=int, default=4, help="faults in the schedule (incl. a coordinator kill and stop)")
    parser.add_argument("--lease", type=float, default=3.0, help="lease time in seconds (lease_timeout_s)")
    parser.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval in seconds")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds without faults at the start")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds without faults at the end")
    parser.add_argument("--recovery", type=float, default=8.0, help="a restarted node counts as down this much longer")
    parser.add_argument("--scenario", choices=SCENARIOS, default="random",
                        help="random nemesis, or one learner down a third of the time (goodput comparison)")
    parser.add_argument("--coordinator-partition", action="store_true",
                        help="the random schedule must also cut the lease holder off with a minority (both ways)")
    parser.add_argument("--storage-faults", action="store_true",
                        help="the random schedule also draws disk, fsync, corruption and clock faults (as the soak does)")
    parser.add_argument("--corruptions", default=",".join(CORRUPTIONS),
                        help=f"what a corrupt fault may do, comma-separated (default: all of {','.join(CORRUPTIONS)})")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: decoupled, synchronous")
    parser.add_argument("--workdir", type=Path, default=None, help="where histories and logs go (default: a new temp dir)")
    parser.add_argument("--config-template", type=Path, default=None, help="node TOML to use instead of the built-in tiny run")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds for the cluster to become ready")
    parser.add_argument("--standin", action="store_true", help="stand-in nodes instead of the daemon (engine self-test)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any target is missed, not only on violations")
    parser.add_argument("--schedule-only", action="store_true", help="print the schedule and exit")
    parser.add_argument("--check", type=Path, metavar="RUN_DIR", default=None,
                        help="only run the checker over the histories under RUN_DIR")


def run(args: argparse.Namespace) -> int:
    if args.check is not None:
        return _check_only(args.check)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="diloco-chaos-"))
    try:
        config = ChaosConfig(
            workdir=workdir, seed=args.seed, nodes=args.nodes, joiners=args.joiners, duration_s=args.duration,
            faults=args.faults, lease_s=args.lease, heartbeat_s=args.heartbeat, scenario=args.scenario,
            coordinator_partition=args.coordinator_partition, storage_faults=args.storage_faults,
            corruptions=tuple(c.strip() for c in args.corruptions.split(",") if c.strip()),
            modes=modes, warmup_s=args.warmup, settle_s=args.settle, recovery_s=args.recovery,
            ready_timeout_s=args.ready_timeout,
        )
        if args.standin:
            config = standin_config(config)
        schedule = build_schedule(config)
        if args.schedule_only:
            print(schedule.to_json())
            return 0
        print(f"chaos: {len(schedule.faults)} faults, modes {', '.join(modes)}, histories under {workdir}", file=sys.stderr)
        for line in schedule.describe():
            print(f"  {line}", file=sys.stderr)
        launcher = StandinLauncher() if args.standin else DaemonLauncher(args.config_template)
        report = run_chaos(config, launcher, schedule)
    except (HarnessError, ScheduleError) as exc:
        print(f"diloco-node chaos: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    for name, target in report["targets"].items():
        print(f"  {'ok  ' if target['ok'] else 'MISS'} {name}: {target['value']} (target {target['target']})", file=sys.stderr)
    missed = not all(t["ok"] for t in report["targets"].values())
    return 1 if report["violations"] or (args.strict and missed) else 0


def _check_only(run_dir: Path) -> int:
    from diloco_node.testbed.chaos.checker import check_histories
    from diloco_node.ops.history import HistoryFormatError, find_history_files, load_histories

    paths = find_history_files(run_dir)
    if not paths:
        print(f"diloco-node chaos: no history.jsonl under {run_dir}", file=sys.stderr)
        return 2
    # A run directory holds one subdirectory per mode; each is its own cluster.
    groups: dict[Path, list[Path]] = {}
    for path in paths:
        mode_dir = next((p for p in path.parents if p.name in MODES), run_dir)
        groups.setdefault(mode_dir, []).append(path)
    found = 0
    try:
        for mode_dir, group in sorted(groups.items()):
            violations = check_histories(load_histories(group))
            found += len(violations)
            print(f"{mode_dir}: {len(group)} histories, {len(violations)} violation(s)")
            for v in violations:
                print(f"  {v}")
    except HistoryFormatError as exc:
        print(f"diloco-node chaos: {exc}", file=sys.stderr)
        return 2
    return 1 if found else 0
