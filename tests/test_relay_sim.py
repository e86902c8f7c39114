"""Relayed payloads in the coordination simulation: safety over many schedules with the relay follower's
promise scenarios in them, a relay that promises and dies, a relay catching up, and the checker sees a
relay that cheats."""

from __future__ import annotations

from collections import Counter

from bootstrap.simulation import SimConfig, Simulation, run_seed

RELAY_SEEDS = 150  # 2000 in benchmarks/coordination.py --relays 2
RELAY_CONFIG = SimConfig(chaos_s=12.0, warmup_s=4.0, relay_fanout=2)


def test_relayed_payloads_keep_every_invariant_and_recover():
    failures, failovers, refused, holder_sends, commits = [], 0, 0, 0, 0
    decisions: Counter[str] = Counter()
    for seed in range(RELAY_SEEDS):
        result = run_seed(seed, RELAY_CONFIG)
        decisions.update(result.relay_counts)
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
    # The follower's rules all ran: relays promised bytes they awaited and kept those promises,
    # relays died right after promising and their askers' promises ran out, restarted members
    # caught up on committed entries.
    for happened in ("promised", "promises_kept", "promisers_crashed", "promises_expired", "catch_up_fetches",
                     "declined"):
        assert decisions[happened] > 0, (happened, decisions)


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


def quiet_cluster(seed: int = 5) -> tuple[Simulation, str, str, tuple[str, ...]]:
    """Seven nodes, no faults, a commit every 0.3 s, run 6 s: (simulation, holder, its first relay,
    that relay's children)."""
    simulation = Simulation(seed, SimConfig(min_nodes=7, max_nodes=7, chaos_s=0.0, faults=(), relay_fanout=2,
                                            measure_failover=False))
    simulation.set_workload(0.3)
    simulation.run_until(6.0)
    holder = simulation.current_lease_holder()
    assert holder is not None and simulation.relays is not None
    tree = simulation.relays._tree(simulation, holder)
    relay = tree.children[holder][0]
    return simulation, holder, relay, tree.children[relay]


def test_a_relay_that_promises_and_dies_is_routed_around_once_its_promise_runs_out():
    simulation, holder, relay, children = quiet_cluster()
    relays = simulation.relays
    assert relays is not None and children
    relays.slow[relay] = 4.0  # its bytes come late: its children ask it first and are promised them
    relays.crash_next_promiser = True
    simulation.run_until(20.0)
    assert simulation.checker.violations == []
    assert relays.promisers_crashed == 1 and simulation.hosts[relay].node is None
    assert any(f"{relay} promised" in fault and "crashed" in fault for fault in simulation.faults_applied)
    assert sum(relays.relays[child].follower.counts["promises_expired"] for child in children) >= 1
    # Every live member applied within a few commits of the holder: the dead relay cost its subtree
    # a bounded wait, not the run.
    committed = simulation.hosts[holder].node.log.commit_index
    assert all(committed - host.applied_index <= 3 for host in simulation.hosts.values() if host.node is not None)


def test_a_restarted_relay_catches_up_fetching_committed_payloads_at_once():
    simulation, holder, relay, children = quiet_cluster(6)
    relays = simulation.relays
    assert relays is not None
    simulation.crash(relay)
    simulation.run_until(12.0)
    before = dict(relays.relays[relay].follower.counts)
    simulation._start(simulation.hosts[relay], join=True)
    simulation.run_until(26.0)
    assert simulation.checker.violations == []
    counts = relays.relays[relay].follower.counts
    assert counts["catch_up_fetches"] > before["catch_up_fetches"]
    committed = simulation.hosts[holder].node.log.commit_index
    assert committed - simulation.hosts[relay].applied_index <= 3


def test_relays_off_replays_the_schedules_of_before():
    # The relay fault is drawn only when relays are on: a schedule without relays is unchanged.
    plain = run_seed(11, SimConfig(chaos_s=12.0, warmup_s=4.0))
    assert not any("corrupt relay" in f for f in plain.faults)
    assert plain.relay_holder_sends == 0
