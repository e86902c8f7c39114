"""Who is in the run and who is alive: bootstrap join, member records and SWIM failure detection.

Each node probes one member per probe interval; if no ack arrives within the probe timeout it
asks up to `indirect_probes` other members to probe for it (when there are enough members);
still no ack by the end of the interval marks the target SUSPECT, and an unrefuted suspicion
becomes DEAD after `suspect_timeout_s`. A member refutes a suspicion of itself by raising its
incarnation. Updates ride piggybacked on pings and acks. Joining takes one JoinRequest to any
member (the bootstrap peer); leaving announces LEFT. This layer only observes; the voting
configuration changes through the replicated log (see coordinator_node). No I/O, no clock.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bootstrap.messages import (
    JoinReply,
    JoinRequest,
    MemberRecord,
    MemberRole,
    MemberState,
    Message,
    Ping,
    PingAck,
    PingRequest,
    Send,
)
from wire.errors import LocalProtocolError

# One probe per second per node keeps the load O(1) per node whatever the run size.
DEFAULT_PROBE_INTERVAL_S = 1.0
# Direct ack expected within this; WAN round trips are well under it.
DEFAULT_PROBE_TIMEOUT_S = 0.4
# Helpers asked for an indirect probe: SWIM's k; 3 already makes a lossy link rarely decisive.
DEFAULT_INDIRECT_PROBES = 3
# Time a suspect has to refute before being declared dead: several probe intervals, so one
# bad second of packet loss never kills a member.
DEFAULT_SUSPECT_TIMEOUT_S = 5.0
# Each update is piggybacked about lambda * log2(n+1) times (SWIM's dissemination bound).
DEFAULT_RETRANSMIT_MULTIPLIER = 3
# Records per message: bounds message size whatever the churn.
DEFAULT_MAX_PIGGYBACK = 8
# Random extra records per message, beyond pending rumours (anti-entropy, see _piggyback).
DEFAULT_ANTI_ENTROPY_RECORDS = 2
# Re-send a join request (to the next bootstrap peer) if no reply arrives within this.
DEFAULT_JOIN_RETRY_S = 2.0


@dataclass(frozen=True, slots=True)
class SwimTiming:
    probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    indirect_probes: int = DEFAULT_INDIRECT_PROBES
    suspect_timeout_s: float = DEFAULT_SUSPECT_TIMEOUT_S
    retransmit_multiplier: int = DEFAULT_RETRANSMIT_MULTIPLIER
    max_piggyback: int = DEFAULT_MAX_PIGGYBACK
    join_retry_s: float = DEFAULT_JOIN_RETRY_S

    def __post_init__(self) -> None:
        if not 0 < self.probe_timeout_s < self.probe_interval_s:
            raise LocalProtocolError("probe timeout must be > 0 and shorter than the probe interval")
        if self.indirect_probes < 0 or self.max_piggyback < 1 or self.retransmit_multiplier < 1:
            raise LocalProtocolError("indirect_probes >= 0, max_piggyback >= 1, retransmit_multiplier >= 1")


@dataclass(slots=True)
class _Probe:
    target: str
    seq: int
    started_at: float
    indirect_sent: bool = False
    acked: bool = False


class Membership:
    """One node's view of the membership and its failure detector."""

    def __init__(
        self,
        node_id: str,
        address: str,
        role: MemberRole,
        incarnation: int,
        rng: random.Random,
        now: float,
        timing: SwimTiming | None = None,
    ) -> None:
        self.node_id = node_id
        self.timing = timing or SwimTiming()
        self._rng = rng
        self.members: dict[str, MemberRecord] = {
            node_id: MemberRecord(node_id, address, role, incarnation, MemberState.ALIVE)
        }
        self.changed_at: dict[str, float] = {node_id: now}
        # node id -> piggyback transmissions left for its record; ours first, so a restart's new
        # incarnation spreads even before anyone asks.
        self._pending: dict[str, int] = {node_id: self._retransmissions()}
        self._probe_order: list[str] = []
        self._probe: _Probe | None = None
        self._next_probe_at = now + rng.uniform(0.0, self.timing.probe_interval_s)
        self._seq = 0
        self._bootstrap: list[str] = []
        self._join_sent_at: float | None = None
        self.joined = True  # a founding member needs no join; start_join clears this
        self.leaving = False
        self.last_reason = "started"

    # ------------------------------------------------------------ queries

    @property
    def incarnation(self) -> int:
        return self.members[self.node_id].incarnation

    def record(self, node_id: str) -> MemberRecord | None:
        return self.members.get(node_id)

    def state_of(self, node_id: str) -> MemberState | None:
        record = self.members.get(node_id)
        return record.state if record else None

    def alive_ids(self) -> list[str]:
        return sorted(n for n, r in self.members.items() if r.state in (MemberState.ALIVE, MemberState.SUSPECT))

    # ------------------------------------------------------------ operator-level events

    def start_join(self, bootstrap_peers: list[str], now: float) -> list[Send]:
        """Join through any of these peers; retried on the next one until a reply arrives."""
        self._bootstrap = [peer for peer in bootstrap_peers if peer != self.node_id]
        if not self._bootstrap:
            raise LocalProtocolError("no bootstrap peer other than ourselves to join through")
        self.joined = False
        return self._send_join(now)

    def _send_join(self, now: float) -> list[Send]:
        peer = self._bootstrap[0]
        self._bootstrap.append(self._bootstrap.pop(0))  # rotate: the next retry tries another peer
        self._join_sent_at = now
        self.last_reason = f"joining through {peer}"
        return [Send(peer, JoinRequest(self.members[self.node_id]))]

    def learn(self, node_id: str, now: float) -> None:
        """Add a member known from elsewhere (the replicated configuration) if we have no record."""
        if node_id not in self.members:
            self.members[node_id] = MemberRecord(node_id, "", MemberRole.LEARNER, 0, MemberState.ALIVE)
            self.changed_at[node_id] = now

    def leave(self, now: float) -> list[Send]:
        """Announce a graceful leave to every member we believe alive."""
        self.leaving = True
        self._set(self.members[self.node_id], MemberState.LEFT, now)
        update = (self.members[self.node_id],)
        self._seq += 1
        return [Send(peer, Ping(self._seq, self.node_id, update)) for peer in self.alive_ids() if peer != self.node_id]

    # ------------------------------------------------------------ messages

    def handle(self, message: Message, now: float) -> list[Send]:
        if isinstance(message, JoinRequest):
            if not self.joined and len(self.members) == 1:
                # Two nodes that are both still joining must not welcome each other into an
                # island of their own: the requester retries with its next bootstrap peer.
                return [Send(message.member.node_id, JoinReply(False, f"{self.node_id} has not joined a run yet", ()))]
            self._merge(message.member, now)
            members = tuple(self.members[n] for n in sorted(self.members))
            return [Send(message.member.node_id, JoinReply(True, f"welcome, {len(members)} members", members))]
        if isinstance(message, JoinReply):
            if message.accepted:
                for record in message.members:
                    self._merge(record, now)
                self.joined = True
                self.last_reason = f"joined: {message.reason}"
            else:
                self.last_reason = f"join refused: {message.reason}"
            return []
        if isinstance(message, Ping):
            self._merge_all(message.updates, now)
            if self.leaving:
                return []
            updates = self._piggyback() + self._verdict_about(message.sender_id)
            ack = PingAck(message.seq, self.node_id, self.node_id, updates, message.on_behalf_of)
            return [Send(message.sender_id, ack)]
        if isinstance(message, PingRequest):
            self._merge_all(message.updates, now)
            if self.leaving:
                return []
            ping = Ping(message.seq, self.node_id, self._piggyback(), on_behalf_of=message.sender_id)
            return [Send(message.target_id, ping)]
        if isinstance(message, PingAck):
            self._merge_all(message.updates, now)
            if message.on_behalf_of and message.on_behalf_of != self.node_id:
                relay = PingAck(message.seq, self.node_id, message.target_id, self._piggyback())
                return [Send(message.on_behalf_of, relay)]
            probe = self._probe
            if probe and probe.seq == message.seq and probe.target == message.target_id:
                probe.acked = True
            return []
        raise LocalProtocolError(f"membership cannot handle {type(message).__name__}")

    # ------------------------------------------------------------ time

    def tick(self, now: float) -> list[Send]:
        sends: list[Send] = []
        if not self.joined and self._join_sent_at is not None and now - self._join_sent_at >= self.timing.join_retry_s:
            sends += self._send_join(now)
        if self.leaving:
            return sends
        for node_id, record in sorted(self.members.items()):
            if record.state is MemberState.SUSPECT and now - self.changed_at[node_id] >= self.timing.suspect_timeout_s:
                self._set(record, MemberState.DEAD, now)
                self.last_reason = f"{node_id} declared dead: suspected for {self.timing.suspect_timeout_s:.1f}s without refuting"
        probe = self._probe
        if probe and not probe.acked:
            if not probe.indirect_sent and now - probe.started_at >= self.timing.probe_timeout_s:
                probe.indirect_sent = True
                sends += self._indirect_probes(probe)
            if now - probe.started_at >= self.timing.probe_interval_s:
                record = self.members.get(probe.target)
                if record and record.state is MemberState.ALIVE:
                    self._set(record, MemberState.SUSPECT, now)
                    self.last_reason = f"{probe.target} suspected: no direct or indirect ack within {self.timing.probe_interval_s:.1f}s"
                self._probe = None
        if now >= self._next_probe_at and (self._probe is None or self._probe.acked):
            self._next_probe_at = now + self.timing.probe_interval_s
            target = self._next_target()
            if target is not None:
                self._seq += 1
                self._probe = _Probe(target, self._seq, now)
                updates = self._piggyback() + self._verdict_about(target)
                sends.append(Send(target, Ping(self._seq, self.node_id, updates)))
        return sends

    def probe_next(self, node_id: str, at: float) -> None:
        """Make `node_id` the next member probed, at time `at` (the round-robin then carries on)."""
        self._probe_order.append(node_id)  # the order is consumed from its end
        self._next_probe_at = at

    def _indirect_probes(self, probe: _Probe) -> list[Send]:
        helpers = [n for n in self.alive_ids() if n not in (self.node_id, probe.target)
                   and self.members[n].state is MemberState.ALIVE]
        self._rng.shuffle(helpers)
        request = PingRequest(probe.seq, self.node_id, probe.target, self._piggyback())
        return [Send(helper, request) for helper in helpers[: self.timing.indirect_probes]]

    def _next_target(self) -> str | None:
        # Round-robin over a shuffled list (SWIM 4.3): every member is probed within n intervals.
        # Members held dead are probed too, carrying the verdict, so a member wrongly declared
        # dead (say after a partition) learns it and refutes instead of staying out forever.
        while self._probe_order:
            candidate = self._probe_order.pop()
            record = self.members.get(candidate)
            if record and record.state is not MemberState.LEFT:
                return candidate
        self._probe_order = sorted(n for n, r in self.members.items()
                                   if n != self.node_id and r.state is not MemberState.LEFT)
        self._rng.shuffle(self._probe_order)
        return self._probe_order.pop() if self._probe_order else None

    # ------------------------------------------------------------ records and gossip

    def _set(self, record: MemberRecord, state: MemberState, now: float, incarnation: int | None = None) -> None:
        updated = MemberRecord(record.node_id, record.address, record.role,
                               record.incarnation if incarnation is None else incarnation, state)
        self.members[record.node_id] = updated
        self.changed_at[record.node_id] = now
        self._pending[record.node_id] = self._retransmissions()

    def _merge_all(self, records: tuple[MemberRecord, ...], now: float) -> None:
        for record in records:
            self._merge(record, now)

    def _merge(self, record: MemberRecord, now: float) -> None:
        if record.node_id == self.node_id:
            mine = self.members[self.node_id]
            if self.leaving or record.state is MemberState.ALIVE:
                return
            if record.incarnation >= mine.incarnation:
                # Refute: only we may raise our incarnation, and a higher one overrides any rumour.
                self._set(mine, MemberState.ALIVE, now, incarnation=record.incarnation + 1)
                self.last_reason = f"refuted {record.state.value} rumour at incarnation {record.incarnation}"
            else:
                self._pending[self.node_id] = self._retransmissions()  # an old rumour: re-announce
            return
        current = self.members.get(record.node_id)
        if current is None or record.supersedes(current):
            self.members[record.node_id] = record
            self.changed_at[record.node_id] = now
            self._pending[record.node_id] = self._retransmissions()

    def _verdict_about(self, sender: str) -> tuple[MemberRecord, ...]:
        """Tell a member we hold suspect or dead so it can refute: nobody probes the dead."""
        record = self.members.get(sender)
        if record is not None and record.state in (MemberState.SUSPECT, MemberState.DEAD):
            return (record,)
        return ()

    def _retransmissions(self) -> int:
        return self.timing.retransmit_multiplier * max(1, math.ceil(math.log2(len(self.members) + 1)))

    def _piggyback(self) -> tuple[MemberRecord, ...]:
        chosen = sorted(self._pending.items(), key=lambda item: (-item[1], item[0]))[: self.timing.max_piggyback]
        for node_id, left in chosen:
            if left <= 1:
                del self._pending[node_id]
            else:
                self._pending[node_id] = left - 1
        records = [self.members[node_id] for node_id, _ in chosen]
        # Anti-entropy: a couple of random records ride along too, so a rumour whose
        # retransmissions ran out during a partition still reaches everyone eventually.
        spare = sorted(n for n in self.members if n not in self._pending and all(n != c for c, _ in chosen))
        for node_id in self._rng.sample(spare, min(DEFAULT_ANTI_ENTROPY_RECORDS, len(spare),
                                                   self.timing.max_piggyback - len(records))):
            records.append(self.members[node_id])
        return tuple(records)
