"""Feeding the node's status document: members, bytes, quorum, fragments, digest, log, relays, loop lag, storage.

The document itself (schema, /status, /metrics rendering) is ops/status.py; this module reads the
daemon's parts every refresh and writes what changed into the builder. The global state's digest
hashes the whole state, so it is recomputed only when the state changed.
"""

from __future__ import annotations

from typing import Any

from bootstrap import messages as coord
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.coordination_store import CoordinationStore
from diloco_node.daemon.loop_monitor import LagWindow
from diloco_node.daemon.lost_entries import barrier_help
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.state_transfer import StateKeeper
from diloco_node.sync.admission import AdmissionCounts
from diloco_node.ops.status import (
    AdmissionStatus,
    EvictedStatus,
    FragmentStatus,
    MemberStatus,
    QuorumStatus,
    RelayStatus,
    StatusBuilder,
)
from diloco_node.ops.storage_health import STORAGE
from diloco_node.transport import PeerClient, PeerServer

# The quorum reason shown on /status is cut to this many characters (one line per fragment).
MAX_QUORUM_REASON_CHARS = 400


class StatusFeed:
    def __init__(self, *, status: StatusBuilder, coordination: CoordinationIO, keeper: StateKeeper,
                 rounds: RoundDriver, store: CoordinationStore, client: PeerClient, server: PeerServer,
                 loop_lag: LagWindow) -> None:
        self.status = status
        self.coordination = coordination
        self.keeper = keeper
        self.rounds = rounds
        self.store = store
        self.client = client
        self.server = server
        self.loop_lag = loop_lag
        self._bytes_reported = (0, 0)  # transport byte totals already added to the status document
        self._digest_cache: tuple[Any, str] = (None, "")

    def refresh(self, now: float) -> None:
        core = self.coordination.core
        replica = self.keeper.replica
        holder = core.election.leader_id
        voters = core.log.config.voters
        members = []
        for node_id, record in sorted(core.membership.members.items()):
            heard = self.coordination.last_ok.get(node_id) if node_id != core.node_id else None
            members.append(MemberStatus(node_id=node_id, url=self.coordination.addresses.url(node_id) or record.address,
                                        status_url=self.coordination.addresses.status_url(node_id),
                                        role=record.role.value, alive=record.state is coord.MemberState.ALIVE,
                                        voter=node_id in voters,
                                        last_seen_s=None if heard is None else round(now - heard, 3)))
        sent = self.client.counters.total_sent + self.server.counters.total_sent
        received = self.client.counters.total_received + self.server.counters.total_received
        self.status.add_bytes(sent=sent - self._bytes_reported[0], received=received - self._bytes_reported[1])
        self._bytes_reported = (sent, received)
        quorum = QuorumStatus()
        if core.is_lease_holder(now):
            syncer = self.rounds.syncer
            quorum = QuorumStatus(have=syncer.waiting_contributions(), need=syncer.policy.min_quorum,
                                  reason=self.rounds.quorum_reason()[:MAX_QUORUM_REASON_CHARS])
        self.status.set_coordination(
            epoch=core.epoch, coordinator=holder if holder else None,
            # No digest for a state that is not the run's at this index (a stale fragment): "" until repaired.
            commit_index=replica.applied_index, state_digest=self.state_digest() if self.keeper.state_consistent() else "",
            members=members, quorum=quorum,
            fragments=[FragmentStatus(p, r) for p, r in enumerate(replica.state.rounds())])
        self.status.set_admission(admission_status(self.rounds.syncer.admission.counts))
        self.status.set_evicted([EvictedStatus(r.node_id, r.index, r.reason) for r in replica.evictions.records()])
        self.status.set_log(first_index=self.store.log_first_index, size_bytes=self.store.log_bytes)
        self.status.set_loop_lag(worst_s=self.loop_lag.worst_recent_s, stalls=self.loop_lag.stalls)
        self.status.set_relays(relay_status(self.coordination.relays.status()))
        self.status.set_outer_gradients(self.rounds.outer_gradient_bytes.status())
        coordination = self.coordination
        self.status.set_storage({**STORAGE.to_status(), "vote_barrier": coordination.vote_barrier,
                                 "log_repair": coordination.log_repair,
                                 "vote_barrier_help": barrier_help(coordination.node_id, coordination.core.log.config.voters,
                                                                   self.store.damaged_after, coordination.vote_barrier)})

    def state_digest(self) -> str:
        """The global state's digest, recomputed only when the state changed (it hashes the whole
        state: ~1 MB for the tiny model, every refresh otherwise)."""
        replica = self.keeper.replica
        key = (replica.applied_index, replica.state.rounds(), self.keeper.repairs_done)
        if self.keeper.download is not None:  # fragments change under a download: never cached
            self._digest_cache = (None, replica.state.digest())
        elif self._digest_cache[0] != key:
            self._digest_cache = (key, replica.state.digest())
        return self._digest_cache[1]


def admission_status(counts: AdmissionCounts) -> AdmissionStatus:
    """The /status `admission` object from the syncer's admission counters (sync/admission.py)."""
    return AdmissionStatus(**counts.refused, capped=counts.capped,
                           last_reason=counts.last_reason[:MAX_QUORUM_REASON_CHARS])


def relay_status(counts: dict[str, Any]) -> RelayStatus:
    """The /status `relays` object from `RelayIO.status()` (its other keys are for logs and tests)."""
    return RelayStatus(**{name: int(counts.get(name, 0)) for name in RelayStatus.__dataclass_fields__
                          if name != "decisions"}, decisions=tuple(counts.get("decisions", ())))
