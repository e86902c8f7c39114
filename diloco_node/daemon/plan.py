"""Every timing, limit and pool size the daemon uses, named, derived from the config by one pure function.

`plan_from(config)` is the only place a daemon timing is computed from a setting (the lease, the
heartbeat, the checkpoint interval, the relay fan-out, the cluster's heartbeat timeout): the parts
receive the plan's figures in their constructors, and tests assert on the plan instead of copying
its formulas. Fixed protocol constants that no setting moves (a chunk's deadline, the join's
backoff) stay named in the module that uses them (join.py, rounds.py, identity.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from bootstrap.relay_plane import DEFAULT_RELAY_TIMEOUT_S
from diloco_node.config.settings import ConfigError, NodeConfig
from diloco_node.daemon.loop_monitor import DEFAULT_TICK_S as LOOP_LAG_TICK_S
from diloco_node.transport import ClientOptions
from wire.limits import DEFAULT_LIMITS, Limits

# Coordination timer resolution: heartbeats are every 0.5 s and leases 3 s by default, so 50 ms
# of timer slack is small against both.
COORDINATION_TICK_S = 0.05
# Coordination messages (votes, appends, probes) give up after this; the next tick retries.
# Long enough for a log append of a few MB on a slow WAN link, short against a lease.
COORDINATION_DEADLINE_S = 2.5
# How long a stopping site waits for its learner to reach a step boundary and end, and how long
# after a failure (the learner may be stuck in a collective; the process exits anyway).
LEARNER_STOP_WAIT_S = 60.0
LEARNER_ABORT_WAIT_S = 30.0
# Seconds of environment variable DILOCO_X_MIN_STEP_S: a stand-in for a slower device in tests
# and benchmarks (the learner's step takes at least this long).
MIN_STEP_ENV = "DILOCO_X_MIN_STEP_S"
# Worker threads beside the learner's own. Codecs, merges and hashing release the GIL: two is
# enough on a small host, more only competes with JAX for cores.
CODEC_THREADS = 2
# Blocking I/O and waits (spool files, DNS lookups, joining the learner thread): cheap threads
# that mostly sleep. A relayed commit streams to each of `relay_fanout` children at once, each
# reading its spool file here, so the pool grows with the fan-out.
IO_BASE_THREADS = 4


@dataclass(frozen=True, slots=True)
class DaemonPlan:
    """The daemon's timings (seconds), limits and thread pools, each derived once from [node]."""

    # -- coordination
    lease_s: float
    """`lease_timeout_s`: a lease lives this long without a majority's acknowledgement."""
    heartbeat_interval_s: float
    """`heartbeat_interval_s`: the lease holder renews its lease this often."""
    leave_timeout_s: float
    """How long a leaving site waits for its removal to commit: three leases, at least 3 s."""
    coordination_tick_s: float
    """The coordination core's timer: 50 ms of slack, small against heartbeats and leases."""
    coordination_deadline_s: float
    """A vote, append or probe gives up after this (a few MB on a slow link); the next tick retries."""
    evict_wait_s: float
    """`POST /evict` waits this long (two leases) for the eviction entry to commit."""
    completion_linger_s: float
    """A completed run's member stays this long (two leases) so followers learn the final commit."""
    # -- relayed commits (daemon/relays.py)
    relay_fanout: int
    """`relay_fanout`: children each relayed payload is pushed to (0: relays off)."""
    relay_hold_s: float
    """A relayed append waits this long for its bytes before fetching them: a quarter lease, at most 1 s."""
    relay_timeout_s: float
    """One fetch of a relayed payload up the tree gives up after this: half the hold, at most 0.5 s."""
    # -- periodic work on the loop
    status_refresh_s: float
    """/status figures that need the coordination core are refreshed this often."""
    member_refresh_s: float
    """A refreshed address book is trusted this long before members are asked again."""
    tls_reload_check_s: float
    """TLS files are checked for changes this often (a renewal is planned days ahead)."""
    checkpoint_interval_s: float
    """`checkpoint_interval_s`: seconds between periodic checkpoints."""
    loop_lag_tick_s: float
    """The event-loop lag probe sleeps this long and measures how late it woke."""
    # -- the learner
    min_step_interval_s: float
    """DILOCO_X_MIN_STEP_S: the learner's shortest step (0: as fast as it computes)."""
    learner_stop_wait_s: float
    """A clean stop waits this long for the learner thread to end."""
    learner_abort_wait_s: float
    """A failed start or a crash waits this long for the learner thread to end."""
    cluster_check_s: float
    """A multi-host site's learner is checked this often: 0.25 s, at least twice per stall warning."""
    cluster_stall_warn_s: float
    """A step stuck this long (a quarter of `cluster.heartbeat_timeout_s`) is logged with its suspect."""
    # -- the transport
    client_options: ClientOptions
    """`connect_timeout_s` and `source_address`: each TCP connect of the peer client."""
    limits: Limits
    """The wire's bounds, with `read_timeout_s` as the silence tolerated on an open stream."""
    http_body_max_bytes: int
    """aiohttp's own body limit for the operator routes (peer frames are bounded by `limits`)."""
    # -- thread pools (daemon/pools.py; the learner's JAX thread apart)
    codec_threads: int
    """Codecs, merges, digests of big payloads, fragments serialized for peers."""
    disk_threads: int
    """Checkpoints and log compaction: megabytes written and fsynced, never queued behind a merge."""
    eval_threads: int
    """The global model's held-out loss, one evaluation at a time."""
    setup_threads: int
    """Start-up: sealing the manifest, building the site's model, compiling the learner's step and
    the MFU cost analysis (two, so the cost analysis never delays the learner's compile)."""
    io_threads: int
    """Blocking I/O and waits; also asyncio's default executor (spool files, DNS lookups)."""

    def pools(self) -> dict[str, int]:
        """Each named pool's size, by name (docs/DAEMON.md lists the same)."""
        return {"codec": self.codec_threads, "disk": self.disk_threads, "eval": self.eval_threads,
                "setup": self.setup_threads, "io": self.io_threads}


def plan_from(cfg: NodeConfig, environ: Mapping[str, str] | None = None) -> DaemonPlan:
    """The plan for a site's [node] settings (and, in tests and benchmarks, DILOCO_X_MIN_STEP_S)."""
    lease = cfg.lease_timeout_s
    relay_hold_s = min(1.0, lease / 4)
    cluster_stall_warn_s = cfg.cluster.heartbeat_timeout_s / 4
    min_step = (environ or {}).get(MIN_STEP_ENV, "")
    try:
        min_step_interval_s = float(min_step) if min_step else 0.0
    except ValueError:
        raise ConfigError(f"{MIN_STEP_ENV} = {min_step!r}: must be a number of seconds") from None
    return DaemonPlan(
        lease_s=lease,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        leave_timeout_s=max(3.0, 3 * lease),
        coordination_tick_s=COORDINATION_TICK_S,
        coordination_deadline_s=COORDINATION_DEADLINE_S,
        evict_wait_s=2 * lease,
        completion_linger_s=2 * lease,
        relay_fanout=cfg.relay_fanout,
        relay_hold_s=relay_hold_s,
        relay_timeout_s=relay_timeout_for(relay_hold_s),
        status_refresh_s=0.25,
        member_refresh_s=5.0,
        tls_reload_check_s=5.0,
        checkpoint_interval_s=cfg.checkpoint_interval_s,
        loop_lag_tick_s=LOOP_LAG_TICK_S,
        min_step_interval_s=min_step_interval_s,
        learner_stop_wait_s=LEARNER_STOP_WAIT_S,
        learner_abort_wait_s=LEARNER_ABORT_WAIT_S,
        cluster_check_s=min(0.25, cluster_stall_warn_s / 2),
        cluster_stall_warn_s=cluster_stall_warn_s,
        client_options=ClientOptions(connect_timeout_s=cfg.connect_timeout_s, source_address=cfg.source_address),
        limits=dataclasses.replace(DEFAULT_LIMITS, read_timeout_s=cfg.read_timeout_s),
        http_body_max_bytes=1024 ** 2,
        codec_threads=CODEC_THREADS,
        disk_threads=1,
        eval_threads=1,
        setup_threads=2,
        io_threads=IO_BASE_THREADS + cfg.relay_fanout,
    )


def relay_timeout_for(hold_s: float) -> float:
    """One fetch of a relayed payload gives up after half the append's hold, at most the relay
    plane's own bound (`DEFAULT_RELAY_TIMEOUT_S`, 0.5 s)."""
    return min(hold_s / 2, DEFAULT_RELAY_TIMEOUT_S)
