"""Benchmark: random fault schedules against the coordination protocol, in deterministic simulation.

Runs N seeds (each a random cluster of 3..9 nodes and a mix of crash, restart, partition, loss,
duplication, reordering, clock skew, join and leave, and storage faults: a crash just before or
after a node's fsync, whose un-fsynced writes are then really lost, and a failed write), checks every safety invariant after every
event and liveness at the end, and reports violations and failover time (virtual seconds from
the lease holder's death to the next commit under a healthy majority).

    .venv/bin/python benchmarks/coordination.py --seeds 10000 --json coordination.json
    .venv/bin/python benchmarks/coordination.py --seeds 200 --broken vote_without_log_check
    .venv/bin/python benchmarks/coordination.py --seeds 2000 --relays 2   # payloads down a relay tree
    .venv/bin/python benchmarks/coordination.py --seeds 200 --relays 2 --broken relay_accept_unverified
    .venv/bin/python benchmarks/coordination.py --seeds 500 --broken ack_before_fsync
    .venv/bin/python benchmarks/coordination.py --seeds 2000 --log-damage   # logs damaged: vote floors

Any failing seed replays exactly: `--first-seed S --seeds 1 --verbose`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bootstrap.coordinator_node import CoordinatorNode  # noqa: E402
from bootstrap.simulation import SimConfig, SimResult, run_seed  # noqa: E402
from bootstrap.simulation.broken import BROKEN_SIM_SETTINGS, BROKEN_VARIANTS  # noqa: E402
from bootstrap.simulation.harness import DEFAULT_CHAOS_S  # noqa: E402

# Broken variants of the relay plane are settings of the simulation, not node classes.
BROKEN_RELAY_VARIANTS = {"relay_accept_unverified": {"relay_verify": False}}


def percentile(sorted_values: list[float], fraction: float) -> float | None:
    if not sorted_values:
        return None
    rank = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[rank]


def _run(job: tuple[int, SimConfig, str | None]) -> SimResult:
    seed, config, broken = job
    factory = BROKEN_VARIANTS.get(broken, CoordinatorNode) if broken else CoordinatorNode
    return run_seed(seed, config, factory)


class _Serial:
    """The in-process stand-in for a pool, so one code path serves --jobs 1."""

    def __enter__(self) -> _Serial:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def imap(self, function, items, chunksize: int = 1):  # noqa: ARG002 - same signature as Pool.imap
        return map(function, items)


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in counts:
        for name, value in one.items():
            total[name] = total.get(name, 0) + value
    return dict(sorted(total.items()))


def summarize(results: list[SimResult], args: argparse.Namespace, config: SimConfig, wall_s: float) -> dict:
    failing = [r for r in results if r.violations]
    failovers = sorted(r.failover_s for r in results if r.failover_s is not None)
    return {
        "seeds": len(results),
        "seeds_requested": args.seeds,
        "first_seed": args.first_seed,
        "broken_variant": args.broken,
        "violations": len(failing),
        "failing_seeds": [r.seed for r in failing],
        "first_violations": {str(r.seed): r.violations[0] for r in failing[:20]},
        "failover_virtual_s": {
            "p50": percentile(failovers, 0.50),
            "p99": percentile(failovers, 0.99),
            "max": failovers[-1] if failovers else None,
            "measured": len(failovers),
        },
        "lease_s": config.lease.lease_s,
        "leader_lease_span_s": round(config.lease.leader_lease_span_s, 4),
        "max_drift_rate": config.lease.max_drift_rate,
        "chaos_virtual_s": config.chaos_s,
        "log_damage": config.log_damage,
        "virtual_s_total": round(sum(r.virtual_s for r in results), 1),
        "events_total": sum(r.events for r in results),
        "outer_commits_total": sum(r.commits for r in results),
        # Armed storage faults that struck a write: crashes just before (the write's un-fsynced
        # state is lost) or just after its fsync, and failed writes (the node reloads from disk).
        "storage_faults_struck": {kind: sum(1 for r in results for f in r.faults if f.endswith(f"{kind} its fsync"))
                                  for kind in ("crash before", "crash after", "io error")},
        "relay_fanout": config.relay_fanout,
        "relay_holder_sends_per_commit": (round(sum(r.relay_holder_sends for r in results)
                                                / max(1, sum(r.commits for r in results)), 3)
                                          if config.relay_fanout else None),
        "relay_altered_payloads_refused": sum(r.relay_refused for r in results),
        # What the relay followers decided (bootstrap/relay_plane.py, RelayFollower), summed over
        # every node of every schedule: fetches (catching-up ones among them), promises made, kept,
        # ended and run out, wants given up, and relays crashed right after promising.
        "relay_decisions": _summed(r.relay_counts for r in results) if config.relay_fanout else None,
        "wall_s": round(wall_s, 1),
        "jobs": args.jobs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000, help="number of schedules to run")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--chaos-s", type=float, default=DEFAULT_CHAOS_S, help="virtual seconds of faults per schedule")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (the machine may be shared)")
    parser.add_argument("--broken", choices=sorted([*BROKEN_VARIANTS, *BROKEN_RELAY_VARIANTS, *BROKEN_SIM_SETTINGS]),
                        help="run a deliberately broken variant")
    parser.add_argument("--relays", type=int, default=0, metavar="FANOUT",
                        help="commit payloads travel down a relay tree of this fan-out (0: the holder sends all)")
    parser.add_argument("--log-damage", action="store_true",
                        help="schedules also cut a node's log at rest and damage a running node's log (the vote "
                             "floor, bootstrap/election.py)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--verbose", action="store_true", help="print each failing seed's faults and violations")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")

    if args.broken in BROKEN_RELAY_VARIANTS and not args.relays:
        parser.error(f"--broken {args.broken} needs --relays FANOUT")
    if args.relays < 0:
        parser.error("--relays must be >= 0")
    config = SimConfig(chaos_s=args.chaos_s, relay_fanout=args.relays, log_damage=args.log_damage,
                       **BROKEN_RELAY_VARIANTS.get(args.broken or "", {}),
                       **BROKEN_SIM_SETTINGS.get(args.broken or "", {}))  # type: ignore[arg-type]
    jobs = [(seed, config, args.broken) for seed in range(args.first_seed, args.first_seed + args.seeds)]
    started = time.perf_counter()
    results: list[SimResult] = []
    with multiprocessing.Pool(args.jobs) if args.jobs > 1 else _Serial() as pool:
        for result in pool.imap(_run, jobs, chunksize=16):
            results.append(result)
            if len(results) % 500 == 0 and len(results) < len(jobs):
                # Long runs on a shared machine: a partial summary survives an interruption.
                partial = summarize(results, args, config, time.perf_counter() - started)
                print(f"{len(results)} seeds, {partial['violations']} failing, {partial['wall_s']}s",
                      file=sys.stderr, flush=True)
                if args.json:
                    args.json.write_text(json.dumps(partial, indent=2) + "\n")
    summary = summarize(results, args, config, time.perf_counter() - started)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.verbose:
        for result in (r for r in results if r.violations):
            print(f"\nseed {result.seed} ({result.nodes} nodes):", *result.faults, *result.violations, sep="\n  ")
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
