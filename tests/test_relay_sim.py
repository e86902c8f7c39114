"""Relayed payloads in the coordination simulation: safety over many schedules, and the checker sees a relay that cheats."""

from __future__ import annotations

from bootstrap.simulation import SimConfig, Simulation, run_seed

RELAY_SEEDS = 150  # 2000 in benchmarks/coordination.py --relays 2
RELAY_CONFIG = SimConfig(chaos_s=12.0, warmup_s=4.0, relay_fanout=2)


def test_relayed_payloads_keep_every_invariant_and_recover():
    failures, failovers, refused, holder_sends, commits = [], 0, 0, 0, 0
    for seed in range(RELAY_SEEDS):
        result = run_seed(seed, RELAY_CONFIG)
        if result.violations:
            failures.append(f"seed {seed}: {result.violations[0]} (replay: benchmarks/coordination.py "
                            f"--relays 2 --chaos-s 12 --first-seed {seed} --seeds 1 --verbose)")
        failovers += result.failover_s is not None
        refused += result.relay_refused
        holder_sends += result.relay_holder_sends
        commits += result.commits
    assert not failures, "\n".join(failures[:10])
    assert failovers >= RELAY_SEEDS * 0.9  # liveness: relays delay commits, never stop them
    assert refused > 0  # corrupting relays did alter bytes, and every altered copy was caught
    assert commits > 0 and holder_sends > 0


def test_a_follower_that_stores_relayed_bytes_unchecked_is_caught():
    broken = SimConfig(chaos_s=12.0, warmup_s=4.0, relay_fanout=2, relay_verify=False)
    for seed in range(RELAY_SEEDS):
        violations = run_seed(seed, broken).violations
        if any("committed differently" in v for v in violations):
            return
    raise AssertionError(f"unverified relayed payloads survived {RELAY_SEEDS} seeds: the checker cannot see them")


def test_without_faults_the_holder_sends_each_payload_fanout_times():
    simulation = Simulation(5, SimConfig(min_nodes=7, max_nodes=7, chaos_s=0.0, faults=(), relay_fanout=2,
                                         measure_failover=False))
    simulation.set_workload(0.3)
    simulation.run_until(20.0)
    assert simulation.checker.violations == []
    relays = simulation.relays
    assert relays is not None and simulation.commits >= 10
    # Every outer commit and membership payload goes from the holder to its 2 children, and
    # nobody had to fetch from it: 6 followers, 2 copies.
    pushed_payloads = len(set().union(*(relay.pushed for relay in relays.relays.values())))
    assert relays.holder_sends == 2 * pushed_payloads
    assert relays.forwarded == 4 * pushed_payloads  # the two relays each pass it on to 2
    assert relays.refused == 0


def test_relays_off_replays_the_schedules_of_before():
    # The relay fault is drawn only when relays are on: a schedule without relays is unchanged.
    plain = run_seed(11, SimConfig(chaos_s=12.0, warmup_s=4.0))
    assert not any("corrupt relay" in f for f in plain.faults)
    assert plain.relay_holder_sends == 0
