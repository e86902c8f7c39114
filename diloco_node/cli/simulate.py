"""`diloco-node simulate`: run the fleet goodput model and write its table, JSON and plot.

The model itself lives in diloco_node.sim.fleetsim; this module only parses options, writes files and
draws the optional matplotlib figure. It imports neither JAX nor matplotlib at module load.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from diloco_node.sim import fleetsim
from diloco_node.sim.fleetsim import FleetParams, FleetResult


def add_arguments(parser: argparse.ArgumentParser, name: str = "simulate") -> None:
    d = FleetParams()
    parser.add_argument("--chips", type=int, nargs="+", default=list(fleetsim.DEFAULT_FLEET_SIZES),
                        help="fleet sizes in chips (default: %(default)s)")
    parser.add_argument("--strategies", nargs="+", default=list(fleetsim.STRATEGIES),
                        choices=fleetsim.STRATEGIES, help="strategies to simulate (default: all)")
    parser.add_argument("--learners", "-M", type=int, nargs="+",
                        default=list(fleetsim.DEFAULT_LEARNER_COUNTS),
                        help="learner counts M for decoupled (default: %(default)s)")
    parser.add_argument("--quorum", "-K", type=int, default=1,
                        help="minimum quorum K for decoupled uptime, clipped to M (default: 1)")
    parser.add_argument("--mtbi-years", type=float, default=d.mtbi_chip_s / fleetsim.SECONDS_PER_YEAR,
                        help="mean time between interruptions per chip, in years (default: 1)")
    parser.add_argument("--slice-chips", type=int, default=d.slice_chips,
                        help="chips per slice, the unit that fails and is repaired (default: %(default)s)")
    parser.add_argument("--repair-s", type=float, default=d.repair_s,
                        help="mean repair time of a failed slice in seconds (default: %(default)s)")
    parser.add_argument("--downscale-s", type=float, default=d.downscale_s,
                        help="elastic downscale pause in seconds (default: %(default)s)")
    parser.add_argument("--upscale-s", type=float, default=d.upscale_s,
                        help="elastic upscale pause in seconds (default: %(default)s)")
    parser.add_argument("--restart-s", type=float, default=d.restart_s,
                        help="non-elastic restart cost in seconds (default: %(default)s)")
    parser.add_argument("--speed-spread", type=float, default=d.speed_spread,
                        help="static heterogeneity: learner speeds spread over [1-s, 1] (default: 0)")
    parser.add_argument("--slowdown-rate", type=float, default=d.slowdown_rate_per_slice,
                        help="transient slowdowns per slice per second (default: 0)")
    parser.add_argument("--slowdown-mean-s", type=float, default=d.slowdown_mean_s,
                        help="mean duration of a transient slowdown (default: %(default)s)")
    parser.add_argument("--slowdown-factor", type=float, default=d.slowdown_factor,
                        help="speed of a job while one of its slices is slow (default: %(default)s)")
    parser.add_argument("--expected-failures", type=int, default=d.expected_failures,
                        help="simulated horizon in expected fleet-wide failures (default: %(default)s)")
    parser.add_argument("--wall-time-s", type=float, default=None,
                        help="fixed simulated wall time instead of --expected-failures")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="directory for the JSON results and the PNG plot, created if missing "
                             f"(default: a new {OUT_PARENT}/simulate-<UTC time>/ under the current directory)")
    parser.add_argument("--json", default=None,
                        help=f"where to write the JSON results instead of DIR/{JSON_NAME}; '-' for stdout")
    parser.add_argument("--plot", default=None,
                        help=f"where to write the PNG plot instead of DIR/{PLOT_NAME}; 'none' to skip")


# Results go to a directory of their own, never loose into the current directory, and a second run
# does not overwrite the first: the default is a fresh, timestamped directory under runs/.
OUT_PARENT = "runs"
JSON_NAME = "fleetsim-goodput.json"
PLOT_NAME = "fleetsim-goodput.png"


def output_paths(args: argparse.Namespace, now: float | None = None) -> tuple[str, str]:
    """(json, plot) targets: explicit --json/--plot win (as given, relative to the current
    directory); the rest go into --out, by default runs/simulate-<UTC time>/."""
    out = args.out
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
        out = str(Path(OUT_PARENT) / f"simulate-{stamp}")
    json_target = args.json if args.json is not None else str(Path(out) / JSON_NAME)
    plot_target = args.plot if args.plot is not None else str(Path(out) / PLOT_NAME)
    return json_target, plot_target


def params_from_args(args: argparse.Namespace) -> FleetParams:
    if not args.mtbi_years > 0:
        raise ValueError(f"--mtbi-years must be positive, got {args.mtbi_years}")
    return FleetParams(
        mtbi_chip_s=args.mtbi_years * fleetsim.SECONDS_PER_YEAR,
        slice_chips=args.slice_chips,
        repair_s=args.repair_s,
        downscale_s=args.downscale_s,
        upscale_s=args.upscale_s,
        restart_s=args.restart_s,
        speed_spread=args.speed_spread,
        slowdown_rate_per_slice=args.slowdown_rate,
        slowdown_mean_s=args.slowdown_mean_s,
        slowdown_factor=args.slowdown_factor,
        expected_failures=args.expected_failures,
        wall_time_s=args.wall_time_s,
    )


def run(args: argparse.Namespace) -> int:
    try:
        params = params_from_args(args)
        for chips in args.chips:
            if chips <= 0:
                raise ValueError(f"--chips must be positive, got {chips}")
        for m in args.learners:
            if m <= 0:
                raise ValueError(f"--learners must be positive, got {m}")
        if args.quorum <= 0:
            raise ValueError(f"--quorum must be positive, got {args.quorum}")
        started = time.perf_counter()
        results = fleetsim.run_sweep(
            params,
            fleet_sizes=args.chips,
            learner_counts=args.learners,
            strategies=args.strategies,
            quorum=args.quorum,
            seed=args.seed,
        )
        elapsed = time.perf_counter() - started
    except ValueError as exc:
        print(f"diloco-node simulate: error: {exc}", file=sys.stderr)
        return 2

    report = {
        "params": asdict(params),
        "seed": args.seed,
        "wall_time_s": round(elapsed, 3),
        "results": [r.to_dict() for r in results],
    }
    json_target, plot_target = output_paths(args)
    text_out = sys.stderr if json_target == "-" else sys.stdout
    print(fleetsim.format_table(results), file=text_out)
    print(f"simulated {len(results)} configurations in {elapsed:.2f} s", file=text_out)
    if json_target == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    target = json_target
    try:  # the table is already out; an unwritable path is the user's to fix, not a traceback
        if json_target != "-":
            Path(json_target).parent.mkdir(parents=True, exist_ok=True)
            Path(json_target).write_text(json.dumps(report, indent=1) + "\n")
            print(f"wrote {json_target}", file=text_out)
        if plot_target.lower() != "none":
            target = plot_target
            print(write_plot(results, Path(plot_target), params), file=text_out)
    except OSError as exc:
        print(f"diloco-node simulate: error: cannot write {target}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def write_plot(results: Sequence[FleetResult], path: Path, params: FleetParams) -> str:
    """Draw goodput and uptime against fleet size; returns a line saying what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'diloco-node[plot]')"

    series: dict[str, list[FleetResult]] = {}
    for r in results:
        series.setdefault(fleetsim.label(r), []).append(r)
    fig, (ax_good, ax_up) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, rows in series.items():
        rows = sorted(rows, key=lambda r: r.fleet_size)
        xs = [r.fleet_size for r in rows]
        (line,) = ax_good.plot(xs, [100 * r.goodput for r in rows], marker="o", label=name)
        ax_up.plot(xs, [100 * r.uptime for r in rows], marker="o", color=line.get_color(), label=name)
        marks = [(r.fleet_size, paper) for r in rows if (paper := fleetsim.paper_goodput(r)) is not None]
        if marks:
            ax_good.scatter([n for n, _ in marks], [v for _, v in marks], marker="x", s=70,
                            color=line.get_color(), zorder=5)
    mtbi_years = params.mtbi_chip_s / fleetsim.SECONDS_PER_YEAR
    ax_good.set_title(f"Goodput (x = paper), MTBI {mtbi_years:g} chip-year")
    ax_up.set_title("Uptime: share of time the global model advances")
    sizes = sorted({r.fleet_size for r in results})
    for ax in (ax_good, ax_up):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [fleetsim.short_size(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("fleet size (chips)")
        ax.set_ylabel("%")
        ax.set_ylim(0, 102)
        ax.grid(True, which="both", alpha=0.3)
    ax_good.legend(fontsize=8, loc="lower left")
    fig.text(0.5, 0.005,
             f"slice {params.slice_chips} chips, repair {params.repair_s:g} s, reconfiguration "
             f"{params.downscale_s:g}/{params.upscale_s:g} s, dp restart {params.restart_s:g} s",
             ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
