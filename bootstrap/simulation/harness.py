"""Deterministic simulation of a coordination cluster running the real state machines.

A virtual clock and a heapq event queue drive 3 to 9 `CoordinatorNode`s through a network that
delays, drops, duplicates and reorders messages and partitions and heals, while nodes crash and
restart with only their persisted state, join, leave, and run clocks skewed within the drift
bound. Every random choice comes from the seed, so a failing run replays exactly. The invariant
checker runs after every event; liveness (a lease holder and fresh commits after healing, and
failover after the holder dies) is checked at the end of each schedule.

Storage is modelled as a disk that keeps only what was fsynced: each host holds the node's live
`PersistentState` (what it has written) and a durable copy (what it last fsynced). A crash throws
the live state away and restarts from the durable copy, so writes that were never synced are
really lost. The host fsyncs after each event that changed the persistent state and before it
sends anything (votes and append acknowledgements included); the `crash_at_fsync` and
`io_error` faults make one node's next write die just before or just after that fsync.

Each host's application also holds fragments (fragments.py): the `unreadable_payload` fault makes
its next outer-commit applies fail, and the stale fragment is repaired from a peer under the real
rule (bootstrap/apply_rule.py); a host that says its state is current must hold the run's state.
"""

from __future__ import annotations

import heapq
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from bootstrap.coordinator_node import CoordinatorNode, NodeOptions, PersistentState
from bootstrap.election import LeaseTiming, Role
from bootstrap.entries import EntryKind, LogEntry
from bootstrap.membership import SwimTiming
from bootstrap.messages import (
    Action,
    AppendEntries,
    AppendResponse,
    ApplyEntry,
    InstallSnapshot,
    MemberRole,
    Message,
    RestoreSnapshot,
    Send,
)
from bootstrap.simulation.checker import InvariantChecker, chain_digest
from bootstrap.simulation.fragments import FragmentModel, FragmentTruth
from bootstrap.relay_plane import FetchAnswer
from bootstrap.simulation.relays import FetchReply, Metadata, PayloadRequest, RelayItem, RelayPlane
from wire.errors import ProtocolError

NodeFactory = Callable[..., CoordinatorNode]

# Fault kinds and their relative weights during the chaos phase (fault injection by name).
FAULT_WEIGHTS: dict[str, float] = {
    "crash": 2.0,
    "crash_leader": 2.0,
    "restart": 3.0,
    "partition": 1.5,
    "isolate_leader": 1.0,
    "one_way": 1.0,
    "cut_link": 1.0,
    "heal": 2.0,
    "loss": 1.0,
    "duplicate": 0.7,
    "reorder": 0.7,
    "skew": 1.0,
    "join": 0.7,
    "leave": 0.4,
    "workload": 1.0,
    "crash_at_fsync": 2.0,  # a node's next write: crash just before or just after its fsync
    "io_error": 1.0,  # a node's next write fails: nothing it decided is sent; it reloads what it synced
    "unreadable_payload": 1.0,  # a node's next outer-commit applies cannot read their payload back
}
# A fragment repair's request and answer: a network round trip (the daemon asks at once); a
# refused or unanswered one is asked again after this.
REPAIR_RETRY_S = 0.2
# Faults that exist only when relays are on (so schedules without relays replay as before).
RELAY_FAULT_WEIGHTS: dict[str, float] = {
    "corrupt_relay": 1.0,  # a member starts altering the payload bytes it forwards
    "slow_relay": 1.0,  # the payloads sent to a member take seconds longer (its children get promises)
    "promise_then_crash": 1.0,  # the next member that promises bytes crashes right after
}
# Faults that exist only with `SimConfig.log_damage` (so schedules without it replay as before).
DAMAGE_FAULT_WEIGHTS: dict[str, float] = {
    # A node's log loses a suffix at rest (a cut file, a damaged record): it restarts with a vote
    # floor, the newest (epoch, index) it ever had durable (an upper bound of what it acknowledged).
    "cut_log": 2.0,
    # A running node finds a record of its log damaged (a payload read, a compaction): it drops that
    # entry and every later one, applied ones included, and gets them back from the lease holder
    # without a restart (daemon/coordination.py `repair_damaged_log`; the core's `lose_entries`).
    "damage_while_running": 1.0,
}
# How often a `cut_log` strikes at the worst moment instead of a random one: the lease holder and
# the fullest follower are cut off from the other nodes, and the follower's log is cut the moment
# the holder has committed an entry with it alone (before the follower learns the commit, so the
# entry is above what its application applied), and the holder crashes. The entry is then only in
# the damaged log and the dead holder's: only the vote floor keeps a lagging node from winning.
WORST_MOMENT_CUT_SHARE = 0.5
# How often the worst-moment cut looks at the holder's commit index, and how long it waits for a
# commit before it gives up (and heals the partition it made).
WORST_MOMENT_POLL_S = 0.005
WORST_MOMENT_WAIT_S = 5.0
# Extra seconds a slow relay's payloads take (a large commit on a thin link).
SLOW_RELAY_DELAYS_S = (0.5, 1.5, 4.0)


# Seconds between proposals during chaos: DiLoCo commits are sparse (one per outer step), and
# idle stretches are when a stale node still looks up to date, so they matter for safety.
WORKLOAD_INTERVALS_S = (0.3, 1.0, 4.0, 10.0)


# Virtual seconds of faults per schedule in the benchmark (CI runs shorter schedules).
DEFAULT_CHAOS_S = 30.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One schedule's shape. Defaults are the benchmark's; CI uses shorter chaos."""

    min_nodes: int = 3
    max_nodes: int = 9
    warmup_s: float = 5.0
    chaos_s: float = DEFAULT_CHAOS_S
    mean_fault_gap_s: float = 1.5
    liveness_bound_s: float = 30.0  # after healing: a lease holder and a fresh commit within this
    tick_interval_s: float = 0.1
    # After healing, the syncer has a backlog of contributions: it proposes this often, so the
    # failover figure measures the protocol rather than the workload's own period.
    workload_interval_s: float = 0.25
    compaction_every: int = 8  # small so that snapshot installs happen often
    base_delay_s: float = 0.01
    jitter_s: float = 0.02
    lease: LeaseTiming = field(default_factory=LeaseTiming)
    swim: SwimTiming = field(default_factory=SwimTiming)
    remove_dead_after_s: float = 6.0  # short so membership changes happen within a schedule
    measure_failover: bool = True
    faults: tuple[str, ...] = tuple(FAULT_WEIGHTS)
    # Relayed payloads (bootstrap/simulation/relays.py): 0 = off, the holder sends every byte.
    relay_fanout: int = 0
    relay_timeout_s: float = 0.5  # a follower without a payload this long asks the next source up
    relay_verify: bool = True  # False only for the broken variant that stores bytes unchecked
    # A payload fetch lost on either leg reads as unreachable after this (the transport's connect
    # timeout); a fetch to a crashed node is refused at once.
    relay_fetch_deadline_s: float = 10.0
    # False only for the broken variant that acknowledges before its fsync: it sends first and
    # syncs lazily, once per tick, so a crash can lose a vote or an entry it acknowledged.
    fsync_before_ack: bool = True
    # False only for the broken variant that installs a repaired fragment from a peer that has not
    # applied the entry the fragment is stale since (the held apply is skipped).
    repair_floor: bool = True
    # Logs damaged at rest (DAMAGE_FAULT_WEIGHTS): the vote floor of election.py under test.
    log_damage: bool = False


@dataclass(slots=True)
class SimResult:
    seed: int
    nodes: int
    violations: list[str]
    failover_s: float | None
    virtual_s: float
    events: int
    commits: int
    trace_digest: int
    faults: list[str]
    relay_holder_sends: int = 0  # payload copies sent by lease holders (relays on)
    relay_refused: int = 0  # altered payloads caught by their digest (relays on)
    relay_counts: dict[str, int] = field(default_factory=dict)  # the followers' decisions (relays on)


@dataclass(slots=True)
class _Host:
    """A simulated machine: durable state, application state, clock, and the running node if any."""

    node_id: str
    persistent: PersistentState
    role: MemberRole
    clock_rate: float = 1.0
    anchor_real: float = 0.0
    anchor_local: float = 0.0
    applied_index: int = 0  # the application's durable state: applied through here ...
    digest: bytes = b""  # ... with this state digest
    node: CoordinatorNode | None = None
    generation: int = 0
    left: bool = False
    durable: PersistentState | None = None  # what the disk holds: `persistent` as of the last fsync
    # An armed storage fault for the node's next write: "crash before", "crash after" (the fsync)
    # or "io error" (the write fails; the node reloads what it had synced).
    fault_at_fsync: str | None = None
    fragments: FragmentModel | None = None  # the application's fragments (fragments.py), set at start
    # The newest (epoch, index) its disk ever held: nothing it acknowledged is past it. After its
    # log lost entries at rest, the floor its node votes above until its log is back there.
    durable_bound: tuple[int, int] = (0, 0)
    vote_floor: tuple[int, int] | None = None

    def fsync(self) -> None:
        self.durable = copy_persistent(self.persistent)
        self.durable_bound = max(self.durable_bound, last_of(self.durable))

    def has_unsynced_writes(self) -> bool:
        durable = self.durable
        return durable is None or not (
            durable.election == self.persistent.election and durable.incarnation == self.persistent.incarnation
            and durable.log.snapshot == self.persistent.log.snapshot
            and durable.log.entries == self.persistent.log.entries)

    def lose_unsynced_writes(self) -> None:
        """A crash: the live state is gone, the disk has what was fsynced and nothing more."""
        if self.durable is not None:
            self.persistent = copy_persistent(self.durable)

    def local(self, real: float) -> float:
        return self.anchor_local + self.clock_rate * (real - self.anchor_real)

    def set_rate(self, real: float, rate: float) -> None:
        self.anchor_local = self.local(real)
        self.anchor_real = real
        self.clock_rate = rate


def last_of(state: PersistentState) -> tuple[int, int]:
    """(epoch, index) of the last entry a persisted log holds (its snapshot's when it holds none)."""
    log = state.log
    if log.entries:
        return log.entries[-1].epoch, log.entries[-1].index
    return log.snapshot.last_epoch, log.snapshot.last_index


def copy_persistent(state: PersistentState) -> PersistentState:
    """An independent copy (entries and snapshots are immutable, the containers are not)."""
    return replace(state, election=replace(state.election), log=replace(state.log, entries=list(state.log.entries)))


_TICK, _DELIVER, _FAULT, _WORKLOAD, _RELAY, _RELAY_TIMER, _REPAIR = 0, 1, 2, 3, 4, 5, 6
_CUT_AFTER_COMMIT = "cut_log after commit"  # the worst-moment cut's follow-up fault (never drawn)


class Simulation:
    def __init__(self, seed: int, config: SimConfig | None = None, node_factory: NodeFactory = CoordinatorNode) -> None:
        self.seed = seed
        self.config = config or SimConfig()
        self.node_factory = node_factory
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, int, object, object]] = []
        self._seq = 0
        self.hosts: dict[str, _Host] = {}
        self.leaders: dict[str, CoordinatorNode] = {}
        self.groups: dict[str, int] = {}
        self.one_way: set[tuple[str, str]] = set()  # (source, destination) links that drop
        self.workload_interval = self.rng.choice(WORKLOAD_INTERVALS_S)
        self._workload_generation = 0  # bumped to cancel the pending proposal when the rate changes
        self.loss = 0.0
        self.duplicate = 0.0
        self.jitter = self.config.jitter_s
        self.events = 0
        self.commits = 0
        self.trace = 0
        self.faults_applied: list[str] = []
        self.stopped = False
        # A worst-moment log cut in progress: (follower, holder, holder's commit index when it began,
        # when it gives up).
        self._pending_cut: tuple[str, str, int, float] | None = None
        self.round = 0
        self.last_commit: tuple[float, int] | None = None  # (time, epoch) of the newest outer commit
        self.options = NodeOptions(lease=self.config.lease, swim=self.config.swim,
                                   remove_dead_after_s=self.config.remove_dead_after_s)
        count = self.rng.randint(self.config.min_nodes, self.config.max_nodes)
        founders = [f"n{i}" for i in range(count)]
        self.checker = InvariantChecker()
        self.fragment_truth = FragmentTruth()
        self.repairs = {"installed": 0, "refused": 0}  # repair copies offered to stale fragments
        self.relays = (RelayPlane(self.config.relay_fanout, self.config.relay_timeout_s, self.config.relay_verify,
                                  self.config.relay_fetch_deadline_s)
                       if self.config.relay_fanout else None)
        for node_id in founders:
            role = MemberRole.WITNESS if self.rng.random() < 0.25 else MemberRole.LEARNER
            self.hosts[node_id] = _Host(node_id, PersistentState.founding(founders), role)
            self._skew(self.hosts[node_id])
            self._start(self.hosts[node_id], join=False)

    # ------------------------------------------------------------ public

    def run(self) -> SimResult:
        cfg = self.config
        self._schedule(self.workload_interval, _WORKLOAD, self._workload_generation, None)
        self.run_until(cfg.warmup_s)
        t = cfg.warmup_s
        weights = FAULT_WEIGHTS | RELAY_FAULT_WEIGHTS | DAMAGE_FAULT_WEIGHTS
        faults = tuple(f for f in cfg.faults if f not in RELAY_FAULT_WEIGHTS or self.relays is not None)
        if self.relays is not None:
            faults += tuple(f for f in RELAY_FAULT_WEIGHTS if f not in faults)
        if cfg.log_damage:
            faults += tuple(f for f in DAMAGE_FAULT_WEIGHTS if f not in faults)
        while True:
            t += self.rng.expovariate(1.0 / cfg.mean_fault_gap_s)
            if t >= cfg.warmup_s + cfg.chaos_s:
                break
            self._schedule(t, _FAULT, self.rng.choices(faults, [weights[f] for f in faults])[0], None)
        self.run_until(cfg.warmup_s + cfg.chaos_s)
        failover = None
        if not self.stopped:
            self.heal_everything()
            failover = self._check_liveness()
        return SimResult(self.seed, len(self.hosts), list(self.checker.violations), failover, self.now,
                         self.events, self.commits, self.trace, self.faults_applied,
                         self.relays.holder_sends if self.relays else 0, self.relays.refused if self.relays else 0,
                         self.relays.counts() if self.relays else {})

    def run_until(self, deadline: float, stop: Callable[[], bool] | None = None) -> bool:
        """Process events up to `deadline`; True as soon as `stop()` holds after an event."""
        while self._queue and self._queue[0][0] <= deadline and not self.stopped:
            time, _, kind, a, b = heapq.heappop(self._queue)
            self.now = time
            self.events += 1
            self.trace = zlib.crc32(f"{time:.6f}{kind}{a if kind != _DELIVER else ''}".encode(), self.trace)
            if kind == _TICK:
                self._on_tick(a, b)  # type: ignore[arg-type]
            elif kind == _DELIVER:
                self._on_deliver(a, b)  # type: ignore[arg-type]
            elif kind == _FAULT:
                self.inject(a)  # type: ignore[arg-type]
            elif kind == _RELAY:
                self._on_relay(a, b)  # type: ignore[arg-type]
            elif kind == _RELAY_TIMER:
                self._on_relay_timer(a, b)  # type: ignore[arg-type]
            elif kind == _REPAIR:
                self._on_repair(a, b)  # type: ignore[arg-type]
            elif a == self._workload_generation:
                self._on_workload()
            if stop is not None and stop():
                return True
        if not self.stopped:
            self.now = max(self.now, deadline)
        return stop is not None and stop()

    # ------------------------------------------------------------ faults by name

    def inject(self, fault: str) -> None:
        alive = [h for h in self._sorted_hosts() if h.node is not None]
        crashed = [h for h in self._sorted_hosts() if h.node is None and not h.left]
        leader = self.current_lease_holder()
        note = fault
        if fault == "crash" and alive:
            victim = self.rng.choice(alive)
            self.crash(victim.node_id)
            note = f"crash {victim.node_id}"
        elif fault == "crash_leader" and leader is not None:
            self.crash(leader)
            note = f"crash leader {leader}"
        elif fault == "restart" and crashed:
            host = self.rng.choice(crashed)
            self._skew(host)
            self._start(host, join=True)
            note = f"restart {host.node_id}"
        elif fault == "partition" and len(alive) > 1:
            ids = [h.node_id for h in self._sorted_hosts()]
            self.rng.shuffle(ids)
            cut = self.rng.randint(1, len(ids) - 1)
            self.groups = {node_id: (0 if i < cut else 1) for i, node_id in enumerate(ids)}
            note = f"partition {sorted(ids[:cut])} | {sorted(ids[cut:])}"
        elif fault == "isolate_leader" and leader is not None:
            self.groups = {h.node_id: (1 if h.node_id == leader else 0) for h in self._sorted_hosts()}
            note = f"isolate leader {leader}"
        elif fault == "one_way" and len(alive) > 1:
            source, destination = self.rng.sample([h.node_id for h in alive], 2)
            if leader is not None and self.rng.random() < 0.5:
                source = leader
                destination = self.rng.choice([h.node_id for h in alive if h.node_id != leader] or [destination])
            self.one_way.add((source, destination))
            note = f"one-way loss {source} -> {destination}"
        elif fault == "cut_link" and len(alive) > 2:
            # A partial partition: two nodes cannot talk, both still reach everyone else.
            first, second = self.rng.sample([h.node_id for h in alive], 2)
            if leader is not None and first != leader:
                second = leader  # the interesting case: the lease holder loses one follower
            self.one_way |= {(first, second), (second, first)}
            note = f"cut link {first} <-> {second}"
        elif fault == "workload":
            self.set_workload(self.rng.choice(WORKLOAD_INTERVALS_S))
            note = f"workload every {self.workload_interval}s"
        elif fault == "heal":
            self.groups = {}
            self.one_way = set()
            if self.relays is not None:
                self.relays.slow.clear()
        elif fault == "loss":
            self.loss = self.rng.choice([0.0, 0.05, 0.2, 0.4])
            note = f"loss {self.loss}"
        elif fault == "duplicate":
            self.duplicate = self.rng.choice([0.0, 0.05, 0.2])
            note = f"duplicate {self.duplicate}"
        elif fault == "reorder":
            self.jitter = self.rng.choice([self.config.jitter_s, 0.2, 0.6])
            note = f"reorder jitter {self.jitter}"
        elif fault == "skew" and alive:
            host = self.rng.choice(alive)
            self._skew(host)
            note = f"skew {host.node_id} rate {host.clock_rate:.4f}"
        elif fault == "join" and len(self.hosts) < self.config.max_nodes:
            node_id = f"n{len(self.hosts)}"
            role = MemberRole.WITNESS if self.rng.random() < 0.25 else MemberRole.LEARNER
            host = _Host(node_id, PersistentState.joining(), role)
            self.hosts[node_id] = host
            self._skew(host)
            self._start(host, join=True)
            note = f"join {node_id}"
        elif fault == "corrupt_relay" and self.relays is not None and alive:
            host = self.rng.choice(alive)
            self.relays.corrupting.add(host.node_id)
            note = f"corrupt relay {host.node_id}"
        elif fault == "slow_relay" and self.relays is not None and alive:
            host = self.rng.choice(alive)
            self.relays.slow[host.node_id] = self.rng.choice(SLOW_RELAY_DELAYS_S)
            note = f"slow relay {host.node_id}: payloads to it take {self.relays.slow[host.node_id]}s longer"
        elif fault == "promise_then_crash" and self.relays is not None:
            self.relays.crash_next_promiser = True
            note = "the next relay to promise bytes crashes"
        elif fault == "crash_at_fsync" and alive:
            host = self.rng.choice(alive)
            if leader is not None and self.rng.random() < 0.5:
                host = self.hosts[leader]
            host.fault_at_fsync = self.rng.choice(("crash before", "crash after"))
            note = f"{host.node_id}: {host.fault_at_fsync} the fsync of its next write"
        elif fault == "io_error" and alive:
            host = self.rng.choice(alive)
            host.fault_at_fsync = "io error"
            note = f"{host.node_id}: its next write fails"
        elif fault == "unreadable_payload" and alive:
            host = self.rng.choice(alive)
            if leader is not None and self.rng.random() < 0.5:
                host = self.hosts[leader]  # the case: the holder applies first, its peers lag
            assert host.fragments is not None
            host.fragments.unreadable = self.rng.choice((1, 2))
            note = f"{host.node_id}: its next {host.fragments.unreadable} outer-commit payload(s) unreadable"
        elif fault in ("cut_log", "damage_while_running") and self.config.log_damage and alive and (
                self._pending_cut is None and not any(self._lacks_entries(h) for h in self.hosts.values())):
            # One damaged log at a time: damage at rest on a majority at once loses committed
            # entries for good, and no vote rule can then keep both safety and liveness.
            note = self._cut_log(alive, leader) if fault == "cut_log" else self._damage_while_running(alive, leader)
        elif fault == _CUT_AFTER_COMMIT and self._pending_cut is not None:
            note = self._cut_after_commit()
            if note is None:
                return
        elif fault == "leave" and len(alive) > 3:
            host = self.rng.choice(alive)
            self._dispatch(host, lambda node, local: node.leave(local))
            note = f"leave {host.node_id}"
        else:
            return
        self.faults_applied.append(f"{self.now:.2f} {note}")

    def _cut_log(self, alive: list[_Host], leader: str | None) -> str:
        """A follower (the one holding most, often: the likely member of a commit's majority) crashes
        and its log loses a suffix at rest; half the time the lease holder crashes too, so the
        next one is elected while the damaged node's log is short. Or, WORST_MOMENT_CUT_SHARE of
        the time, the cut waits for its worst moment (`_cut_after_commit`)."""
        followers = [h for h in alive if h.node_id != leader] or alive
        if leader is not None and len(followers) >= 2 and self.rng.random() < WORST_MOMENT_CUT_SHARE:
            host = max(followers, key=lambda h: (last_of(h.persistent), h.node_id))
            holder = self.hosts[leader].node
            assert holder is not None
            self.groups = {h.node_id: (0 if h.node_id in (leader, host.node_id) else 1) for h in self._sorted_hosts()}
            self._pending_cut = (host.node_id, leader, holder.log.commit_index, self.now + WORST_MOMENT_WAIT_S)
            self._schedule(self.now + WORST_MOMENT_POLL_S, _FAULT, _CUT_AFTER_COMMIT, None)
            return f"cut off all but {leader} and {host.node_id}: {host.node_id}'s log is cut at the next commit"
        if self.rng.random() < 0.5:
            host = max(followers, key=lambda h: (last_of(h.persistent), h.node_id))
        else:
            host = self.rng.choice(followers)
        self.crash(host.node_id)
        durable = host.persistent  # what the disk holds, now that the node is down
        lost = sum(1 for e in durable.log.entries if e.index > max(host.applied_index, durable.log.snapshot.last_index))
        self.cut_log_at_rest(host.node_id, len(durable.log.entries) - lost + self.rng.randint(0, max(0, lost - 1)))
        note = f"cut log of {host.node_id} at rest to index {last_of(durable)[1]} (floor {host.vote_floor})"
        if leader is not None and leader != host.node_id and self.rng.random() < 0.5:
            self.crash(leader)
            note += f", crash leader {leader}"
        return note

    @staticmethod
    def _lacks_entries(host: _Host) -> bool:
        """Whether `host`'s log is still short of entries it lost (its vote floor not yet lifted)."""
        if host.vote_floor is None:
            return False
        return host.node is None or host.node.election.vote_floor is not None

    def _damage_while_running(self, alive: list[_Host], leader: str | None) -> str:
        """A running node (the lease holder half the time) finds a record of its log damaged: the
        entry and all after it are dropped (applied and committed ones too: their bytes are gone),
        what is left is its disk, and it votes only above the newest entry it held until the lease
        holder has sent them back. No crash: the daemon repairs this while it runs."""
        host = self.hosts[leader] if leader is not None and self.rng.random() < 0.5 else self.rng.choice(alive)
        node = host.node
        assert node is not None
        if node.log.last_index < node.log.first_index:
            return f"{host.node_id}: a damaged record found while running, but its log holds no entry"
        index = self.rng.randint(node.log.first_index, node.log.last_index)
        dropped = node.lose_entries(index, host.local(self.now), host.durable_bound)
        self.leaders.pop(host.node_id, None)
        host.fsync()  # the good prefix is what its disk holds now
        if last_of(host.persistent) < host.durable_bound:
            host.vote_floor = host.durable_bound
        return (f"{host.node_id} found its log damaged at {index} while running: {dropped} entries dropped "
                f"(applied through {host.applied_index}, floor {host.vote_floor})")

    def _cut_after_commit(self) -> str | None:
        """The worst-moment cut: once the holder committed past where it began, the follower crashes,
        its log loses every entry its application has not applied, the holder crashes, the follower
        restarts and the partition heals. None while it still waits."""
        assert self._pending_cut is not None
        follower, holder, commit, give_up_at = self._pending_cut
        leader = self.hosts[holder].node
        if leader is not None and self.hosts[follower].node is not None and self.now < give_up_at:
            if leader.log.commit_index <= commit:
                self._schedule(self.now + WORST_MOMENT_POLL_S, _FAULT, _CUT_AFTER_COMMIT, None)
                return None
            self._pending_cut, self.groups = None, {}
            self.crash(follower)
            self.cut_log_at_rest(follower, 0)
            self.crash(holder)
            self._start(self.hosts[follower], join=True)
            return (f"cut log of {follower} at rest to index {last_of(self.hosts[follower].persistent)[1]} "
                    f"(floor {self.hosts[follower].vote_floor}) after {holder} committed {leader.log.commit_index}, "
                    f"crash leader {holder}")
        self._pending_cut, self.groups = None, {}
        return f"no commit by {holder} with {follower}: the worst-moment cut gives up"

    def cut_log_at_rest(self, node_id: str, keep: int) -> None:
        """A crashed node's disk keeps only its log's first `keep` entries (never one its application
        applied: a log cut below those is the restart plan's case, not the vote's); its next start
        has a vote floor while its log is behind the newest it ever held."""
        host = self.hosts[node_id]
        assert host.node is None, "damage at rest: the node is down"
        log = host.persistent.log
        applied = sum(1 for e in log.entries if e.index <= max(host.applied_index, log.snapshot.last_index))
        log.entries = log.entries[:max(keep, applied)]
        host.fsync()
        if last_of(host.persistent) < host.durable_bound:
            host.vote_floor = host.durable_bound

    def crash(self, node_id: str) -> None:
        host = self.hosts[node_id]
        host.node = None
        host.generation += 1
        host.fault_at_fsync = None
        host.lose_unsynced_writes()
        self.leaders.pop(node_id, None)
        if self.relays is not None:
            self.relays.on_crash(node_id)

    def heal_everything(self) -> None:
        """End of chaos: a clean network and every crashed (not departed) node restarted."""
        self.groups = {}
        self.one_way = set()
        self._pending_cut = None  # a worst-moment cut still waiting is called off, not struck after the heal
        if self.relays is not None:
            self.relays.slow.clear()
            self.relays.crash_next_promiser = False
        self.set_workload(self.config.workload_interval_s)
        self.loss = self.duplicate = 0.0
        self.jitter = self.config.jitter_s
        for host in self._sorted_hosts():
            host.fault_at_fsync = None
            if host.node is None and not host.left:
                self._start(host, join=True)
        self.faults_applied.append(f"{self.now:.2f} heal everything")

    def current_lease_holder(self) -> str | None:
        for node_id in sorted(self.leaders):
            host = self.hosts[node_id]
            if host.node is not None and host.node.is_lease_holder(host.local(self.now)):
                return node_id
        return None

    # ------------------------------------------------------------ liveness

    def _check_liveness(self) -> float | None:
        cfg = self.config
        healed_at = self.now
        committed = self.checker.latest_committed_config()
        live = [h.node_id for h in self.hosts.values() if h.node is not None and not h.node.leaving]
        if not committed.is_majority(live):
            # The schedule destroyed the majority for good (voters left, or are about to leave,
            # before their removal committed): no protocol can commit, so liveness is not owed.
            self.faults_applied.append(f"{self.now:.2f} no live majority of {committed.describe()}: liveness not checked")
            return None
        fresh = lambda: self.last_commit is not None and self.last_commit[0] > healed_at  # noqa: E731
        if not self.run_until(healed_at + cfg.liveness_bound_s, fresh):
            self.checker.violations.append(
                f"t={self.now:.3f}s liveness: no commit within {cfg.liveness_bound_s}s of healing the network")
            return None
        if not cfg.measure_failover:
            return None
        if not self.run_until(self.now + cfg.liveness_bound_s, self._stable_for_failover):
            if self._enough_members_for_failover():
                self.checker.violations.append(
                    f"t={self.now:.3f}s liveness: configuration did not settle on the live members")
            return None
        victim = self.current_lease_holder()
        assert victim is not None
        killed_at, old_epoch = self.now, self.hosts[victim].node.epoch  # type: ignore[union-attr]
        self.crash(victim)
        self.faults_applied.append(f"{self.now:.2f} failover probe: crash leader {victim}")
        resumed = lambda: self.last_commit is not None and self.last_commit[1] > old_epoch  # noqa: E731
        if not self.run_until(killed_at + cfg.liveness_bound_s, resumed):
            self.checker.violations.append(
                f"t={self.now:.3f}s liveness: no commit within {cfg.liveness_bound_s}s after the lease holder died")
            return None
        assert self.last_commit is not None
        return self.last_commit[0] - killed_at

    def _enough_members_for_failover(self) -> bool:
        return sum(1 for h in self.hosts.values() if not h.left) >= 3

    def _stable_for_failover(self) -> bool:
        """A holder whose committed configuration is exactly the live members (three or more), none leaving."""
        holder = self.current_lease_holder()
        if holder is None:
            return False
        node = self.hosts[holder].node
        assert node is not None
        voters = node.log.committed_config.voters
        running = [h.node for h in self.hosts.values() if h.node is not None]
        if any(n.leaving for n in running):
            return False  # a leaver about to go would take the majority with it
        live = {n.node_id for n in running}
        return len(voters) >= 3 and voters == live and node.log.config.voters == voters

    # ------------------------------------------------------------ nodes

    def _sorted_hosts(self) -> list[_Host]:
        return [self.hosts[k] for k in sorted(self.hosts)]

    def _skew(self, host: _Host) -> None:
        bound = self.config.lease.max_drift_rate
        host.set_rate(self.now, 1.0 + self.rng.uniform(-bound, bound))

    def _start(self, host: _Host, *, join: bool) -> None:
        host.generation += 1
        if host.fragments is None:
            host.fragments = FragmentModel.new(self.config.repair_floor)
        index = int(host.node_id[1:])
        rng = random.Random(self.seed * 1_000_003 + index * 10_007 + host.generation)
        snapshot = host.persistent.log.snapshot
        if host.applied_index < snapshot.last_index:
            # It crashed after its log adopted a lease holder's snapshot (fsynced) but before the
            # application restored it: restore it now, as the daemon does at start (its restart
            # plan downloads the state as of the snapshot's index from peers).
            self.checker.on_restore(self.now, host.node_id, snapshot)
            host.digest, host.applied_index = snapshot.state, snapshot.last_index
            host.fragments.restore(self.fragment_truth, snapshot.last_index)
        if host.vote_floor is not None and last_of(host.persistent) >= host.vote_floor:
            host.vote_floor = None  # its log is back where it was: nothing left to guard
        last = last_of(host.persistent)[1]
        if host.applied_index > last:
            # Its log lost applied entries while running and it restarts before they came back: the
            # daemon's restart plan (a checkpoint past the log's end) installs the run's state as of
            # the log's end from peers, and replays from there.
            host.applied_index = last
            host.digest = snapshot.state if last == snapshot.last_index else self.checker.truth_digest[last]
            self.checker.state_installed(host.node_id, last)
            host.fragments.restore(self.fragment_truth, last)
        try:
            host.node = self.node_factory(
                host.node_id,
                host.persistent,
                now=host.local(self.now),
                rng=rng,
                applied_index=host.applied_index,
                role=host.role,
                address=f"sim://{host.node_id}",
                options=self.options,
                **({"vote_floor": host.vote_floor} if host.vote_floor is not None else {}),
            )
        except ProtocolError as error:  # e.g. the application applied entries the disk lost
            self.checker.violations.append(f"t={self.now:.3f}s {host.node_id} cannot restart from its disk: {error}")
            self.stopped = True
            return
        host.fsync()  # the raised incarnation is written at start, before the node says anything
        self._schedule(self.now + self.rng.uniform(0.0, self.config.tick_interval_s), _TICK, host.node_id, host.generation)
        if join:
            peers = [h for h in sorted(self.hosts) if h != host.node_id]
            self.rng.shuffle(peers)
            self._dispatch(host, lambda node, local: node.start_join(peers, local))

    def _on_tick(self, node_id: str, generation: int) -> None:
        host = self.hosts[node_id]
        if host.node is None or host.generation != generation:
            return
        if not self.config.fsync_before_ack:
            host.fsync()  # the broken variant's lazy flush, once per tick
        self._dispatch(host, lambda node, local: node.tick(local))
        self._schedule(self.now + self.config.tick_interval_s, _TICK, node_id, generation)

    def _on_deliver(self, node_id: str, message: Message | Metadata) -> None:
        host = self.hosts[node_id]
        if host.node is None:
            return
        if isinstance(message, Metadata):
            assert self.relays is not None
            self.relays.on_metadata(self, node_id, message, lambda assembled: self._handle(host, assembled))
            self._check_relay(node_id)
            return
        self._handle(host, message)

    def _handle(self, host: _Host, message: Message) -> None:
        if host.node is not None:
            self._dispatch(host, lambda node, local: node.handle(message, local), message)

    def _on_relay(self, node_id: str, item: RelayItem) -> None:
        host = self.hosts[node_id]
        if self.relays is None:
            return
        if host.node is None:  # a crashed relay forwards nothing; a fetch to it is refused at once
            if isinstance(item, PayloadRequest):
                self.relay_later(self.config.base_delay_s, item.requester,
                                 FetchReply(node_id, item.digest, FetchAnswer.UNREACHABLE))
            return
        if isinstance(item, PayloadRequest):
            promised = self.relays.on_fetch(self, node_id, item)
            if promised and self.relays.crash_next_promiser:
                self.relays.crash_next_promiser = False
                self.relays.promisers_crashed += 1
                self.faults_applied.append(f"{self.now:.2f} {node_id} promised {item.requester} bytes and crashed")
                self.crash(node_id)
                return
        elif isinstance(item, FetchReply):
            self.relays.on_fetch_reply(self, node_id, item)
        else:
            self.relays.on_payload(self, node_id, item, lambda assembled: self._handle(host, assembled))
        self._check_relay(node_id)

    def _on_relay_timer(self, node_id: str, wake: tuple[int, bytes]) -> None:
        host = self.hosts[node_id]
        generation, digest = wake
        if self.relays is not None and host.node is not None and host.generation == generation:
            self.relays.on_timer(self, node_id, digest)
            self._check_relay(node_id)

    def _check_relay(self, node_id: str) -> None:
        """The relay follower's own bounds hold after each of its events."""
        assert self.relays is not None
        for problem in self.relays.bound_violations(node_id, self.now):
            self.checker.violations.append(f"t={self.now:.3f}s {problem}")
        if self.checker.violations:
            self.stopped = True

    def relay_send(self, source: str, to: str, item: RelayItem, extra_delay: float = 0.0) -> bool:
        """Payload-plane traffic: the same partitions, cut links and loss as every other message.
        False when the network dropped it."""
        if not self._link_passes(source, to):
            return False
        delay = self.config.base_delay_s + self.rng.expovariate(1.0 / self.jitter) + extra_delay
        self._schedule(self.now + delay, _RELAY, to, item)
        return True

    def relay_later(self, delay: float, node_id: str, item: RelayItem) -> None:
        """What `node_id`'s own transport tells it after `delay` (a fetch that got no answer)."""
        self._schedule(self.now + delay, _RELAY, node_id, item)

    def relay_timer(self, delay: float, node_id: str, digest: bytes) -> None:
        self._schedule(self.now + delay, _RELAY_TIMER, node_id, (self.hosts[node_id].generation, digest))

    def is_lease_holder(self, node_id: str) -> bool:
        return self.current_lease_holder() == node_id

    def set_workload(self, interval_s: float) -> None:
        """Change the proposal period now: the pending proposal of the old period is dropped."""
        self.workload_interval = interval_s
        self._workload_generation += 1
        self._schedule(self.now + interval_s, _WORKLOAD, self._workload_generation, None)

    def _on_workload(self) -> None:
        self._schedule(self.now + self.workload_interval, _WORKLOAD, self._workload_generation, None)
        holder = self.current_lease_holder()
        if holder is None:
            return
        self.round += 1
        payload = f"seed {self.seed} round {self.round}".encode()
        self._dispatch(self.hosts[holder], lambda node, local: node.propose(
            local, EntryKind.OUTER_COMMIT, payload, fragment=self.round % 4, round=self.round, digest=f"d{self.round}")[2])

    def _dispatch(self, host: _Host, step: Callable[[CoordinatorNode, float], list[Action]], message: Message | None = None) -> None:
        node = host.node
        assert node is not None
        local = host.local(self.now)
        epoch_before, commit_before = node.epoch, node.log.commit_index
        try:
            actions = step(node, local)
        except (ProtocolError, AssertionError) as error:
            self.checker.violations.append(f"t={self.now:.3f}s {host.node_id} raised {type(error).__name__}: {error}")
            self.stopped = True
            return
        if self.config.fsync_before_ack and not self._fsync_before_acting(host):
            return
        if node.log.commit_index > commit_before:
            self.checker.on_commit_advance(self.now, node, commit_before)
            if node.role is Role.LEADER:
                self._note_commits(node, commit_before)
        for action in actions:
            if isinstance(action, Send):
                self._send(host.node_id, action)
                response = action.message
                if (isinstance(response, AppendResponse) and response.success
                        and isinstance(message, (AppendEntries, InstallSnapshot))):
                    self.checker.on_append_accepted(self.now, host.node_id, message.epoch, epoch_before)
            elif isinstance(action, ApplyEntry):
                host.digest = chain_digest(host.digest, action.entry)
                host.applied_index = action.entry.index
                self.checker.on_apply(self.now, host.node_id, action.entry, host.digest)
                self._apply_fragments(host, action.entry)
            elif isinstance(action, RestoreSnapshot):
                self.checker.on_restore(self.now, host.node_id, action.snapshot)
                host.digest = action.snapshot.state
                host.applied_index = action.snapshot.last_index
                assert host.fragments is not None
                host.fragments.restore(self.fragment_truth, action.snapshot.last_index)
        if (host.applied_index - node.log.store.snapshot.last_index >= self.config.compaction_every
                and host.applied_index <= node.log.last_index):  # (not while entries it applied are lost)
            node.compact(host.applied_index, host.digest)
            if self.config.fsync_before_ack:
                host.fsync()
        if not self.config.fsync_before_ack and host.fault_at_fsync is not None and host.has_unsynced_writes():
            # The broken variant has already sent its acknowledgements: now the write is lost.
            self.faults_applied.append(f"{self.now:.2f} {host.node_id} {host.fault_at_fsync} its fsync (acks already sent)")
            self.crash(host.node_id)
            return
        if node.role is Role.LEADER:
            self.leaders[host.node_id] = node
        else:
            self.leaders.pop(host.node_id, None)
        self.checker.after_event(self.now, node, list(self.leaders.values()), lambda n: self.hosts[n].local(self.now))
        if node.left:
            host.left = True
            self.crash(host.node_id)
        if self.checker.violations:
            self.stopped = True

    def _fsync_before_acting(self, host: _Host) -> bool:
        """Persist what the event wrote before any of its actions happen. False when an armed
        storage fault struck instead: the node is down (or reloaded) and nothing it decided in
        this event reached anyone, as on a real disk where the reply waits for the fsync."""
        if not host.has_unsynced_writes():
            return True
        fault = host.fault_at_fsync
        if fault is None:
            host.fsync()
            return True
        if fault == "crash after":
            host.fsync()
        self.faults_applied.append(f"{self.now:.2f} {host.node_id} {fault} its fsync")
        self.crash(host.node_id)
        if fault == "io error":
            self._start(host, join=True)  # the daemon drops its state and reloads it from disk
        return False

    # ------------------------------------------------------------ fragments (fragments.py)

    def _apply_fragments(self, host: _Host, entry: LogEntry) -> None:
        model = host.fragments
        assert model is not None
        self.fragment_truth.learn(entry)
        stale = model.apply(entry)
        if stale is not None and stale not in model.repairing:
            model.repairing.add(stale)
            self._schedule(self.now + self._round_trip(), _REPAIR, host.node_id, stale)
        self._check_fragments(host)

    def _check_fragments(self, host: _Host) -> None:
        assert host.fragments is not None
        problem = self.fragment_truth.check(host.node_id, host.fragments, host.applied_index)
        if problem is not None:
            self.checker.violations.append(f"t={self.now:.3f}s {problem}")
            self.stopped = True

    def _round_trip(self) -> float:
        return 2 * self.config.base_delay_s + self.rng.expovariate(1.0 / self.jitter)

    def _on_repair(self, node_id: str, fragment: int) -> None:
        """A repair's answer arrives: a random reachable peer's copy, installed if the rule allows."""
        host = self.hosts[node_id]
        model = host.fragments
        assert model is not None
        if fragment not in model.stale.floors:
            model.repairing.discard(fragment)
            return
        peers = [h for h in self._sorted_hosts()
                 if h is not host and h.node is not None and self._link_passes(node_id, h.node_id)]
        if host.node is not None and peers:
            peer = self.rng.choice(peers)
            assert peer.fragments is not None
            offer = peer.fragments.serve(fragment, peer.applied_index)
            if offer is not None and model.install(fragment, *offer):
                self.repairs["installed"] += 1
                model.repairing.discard(fragment)
                self._check_fragments(host)
                return
            self.repairs["refused"] += offer is not None
        self._schedule(self.now + REPAIR_RETRY_S + self._round_trip(), _REPAIR, node_id, fragment)

    def _note_commits(self, node: CoordinatorNode, commit_before: int) -> None:
        for index in range(commit_before + 1, node.log.commit_index + 1):
            entry = node.log.entry_at(index)
            if entry is not None and entry.kind is EntryKind.OUTER_COMMIT:
                self.commits += 1
                self.last_commit = (self.now, node.epoch)

    # ------------------------------------------------------------ network

    def _link_passes(self, source: str, to: str) -> bool:
        if self.groups and self.groups.get(source, 0) != self.groups.get(to, 0):
            return False
        if to not in self.hosts or (source, to) in self.one_way:
            return False
        return not (self.loss and self.rng.random() < self.loss)

    def _send(self, source: str, send: Send) -> None:
        if not self._link_passes(source, send.to):
            return
        message: Message | Metadata = send.message
        if self.relays is not None and isinstance(message, AppendEntries) and any(e.payload for e in message.entries):
            message = self.relays.outgoing(self, source, message)  # metadata direct, bytes down the tree
        copies = 2 if self.duplicate and self.rng.random() < self.duplicate else 1
        for _ in range(copies):
            delay = self.config.base_delay_s + self.rng.expovariate(1.0 / self.jitter)
            self._schedule(self.now + delay, _DELIVER, send.to, message)

    def _schedule(self, time: float, kind: int, a: object, b: object) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (time, self._seq, kind, a, b))


def run_seed(seed: int, config: SimConfig | None = None, node_factory: NodeFactory = CoordinatorNode) -> SimResult:
    """Run one schedule; the same seed (and config, factory) always gives the same result."""
    return Simulation(seed, config, node_factory).run()
