"""Relayed payloads in the coordination simulation: every simulated node runs the real `PayloadRelay`
and its `RelayFollower`, the same follower the daemon runs.

With relays on, the lease holder's `AppendEntries` travels as metadata and the payload bytes go
down the relay tree hop by hop (`bootstrap/relay_plane.py`), through the same faulty network as
every other message: loss, partitions, cut links, crashed relays. A follower learns a holder's tree
only from the pushes that reach it, as a daemon does. Fetches are exchanges, as over HTTP: the
source answers each one (accepted: served or promised; declined), and an exchange lost on either
leg reads as unreachable after `relay_fetch_deadline_s`, while a fetch to a crashed node is refused
at once. Faults that exist only here:
- `corrupt_relay`: a member alters every payload it forwards or serves as a relay (never the
  holder's own bytes: a Byzantine holder is outside Raft's fault model);
- `slow_relay`: the payloads sent to a member take seconds longer (a large commit on a thin link),
  so its children ask it while it still awaits them, and are promised them;
- `promise_then_crash`: the next member that promises bytes to an asker crashes right after (a
  relay that promises and dies); its askers must climb on once the promise runs out.
Restarted nodes catch up on committed entries: their fetches go out at once and they promise nothing.

The invariant checker compares applied entries byte for byte, so the runs show that relays can
delay commits, never change them; the broken variant `relay_verify=False` (bytes stored without
checking their digest) shows that the checker would notice. After every relay event the
follower's own bounds are checked too (`RelayFollower.bound_violations`: promise tables, give-up,
one fetch per source).

Payload stores survive crashes (a daemon keeps entry payloads in its log files); held-back
appends and the follower's state do not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from bootstrap.messages import AppendEntries, MemberState
from bootstrap.relay_plane import (
    Deliver,
    Fetch,
    FetchAnswer,
    Metadata,
    PayloadHop,
    PayloadRelay,
    PayloadRequest,
    Promise,
    RelayAction,
    SendPayload,
    Serve,
    WakeAt,
)
from bootstrap.relay_tree import RelayTree, plan_relay_tree

__all__ = ["FetchReply", "Metadata", "PayloadHop", "PayloadRequest", "RelayPlane"]


@dataclass(frozen=True, slots=True)
class FetchReply:
    """What became of `source`'s answer to a fetch, as the asker sees it (an HTTP status, or none)."""

    source: str
    digest: bytes
    answer: FetchAnswer


RelayItem = PayloadHop | PayloadRequest | FetchReply


class Simulation(Protocol):
    """What the relay plane needs of the simulation that hosts it (bootstrap/simulation/harness.py)."""

    hosts: Mapping[str, Any]
    now: float

    def relay_send(self, source: str, to: str, item: RelayItem, extra_delay: float = 0.0) -> bool: ...

    def relay_later(self, delay: float, node_id: str, item: RelayItem) -> None: ...

    def relay_timer(self, delay: float, node_id: str, digest: bytes) -> None: ...

    def is_lease_holder(self, node_id: str) -> bool: ...


@dataclass(slots=True)
class _DictStore:
    payloads: dict[bytes, bytes] = field(default_factory=dict)

    def get(self, digest: bytes) -> bytes | None:
        return self.payloads.get(digest)

    def put(self, digest: bytes, payload: bytes) -> None:
        self.payloads[digest] = payload


@dataclass(slots=True)
class RelayPlane:
    """The payload side of replication for one simulation: one `PayloadRelay` per node."""

    fanout: int
    timeout_s: float
    verify: bool = True  # False only in the broken variant
    fetch_deadline_s: float = 10.0  # a fetch exchange lost on the way reads as unreachable after this
    relays: dict[str, PayloadRelay] = field(default_factory=dict)
    corrupting: set[str] = field(default_factory=set)
    slow: dict[str, float] = field(default_factory=dict)  # member -> extra seconds its payloads take
    crash_next_promiser: bool = False  # armed by the `promise_then_crash` fault
    holder_sends: int = 0  # payload copies sent by the lease holder (pushes and fetch answers)
    forwarded: int = 0  # payload copies sent by everyone else
    promisers_crashed: int = 0

    @property
    def refused(self) -> int:
        return sum(relay.refused for relay in self.relays.values())

    def counts(self) -> dict[str, int]:
        """The followers' decision counts, summed over every node (crashed ones included)."""
        total: Counter[str] = Counter()
        for relay in self.relays.values():
            total.update(relay.follower.counts)
        return {**dict(sorted(total.items())), "promisers_crashed": self.promisers_crashed}

    def relay(self, node_id: str) -> PayloadRelay:
        if node_id not in self.relays:
            self.relays[node_id] = PayloadRelay(node_id, _DictStore(), timeout_s=self.timeout_s, verify=self.verify)
        return self.relays[node_id]

    # ------------------------------------------------------------ events from the harness

    def outgoing(self, sim: Simulation, source: str, message: AppendEntries) -> Metadata:
        metadata, actions = self.relay(source).outgoing(message, self._tree(sim, source))
        self._run(sim, source, actions, deliver=None)
        return metadata

    def on_metadata(self, sim: Simulation, node_id: str, metadata: Metadata,
                    deliver: Callable[[AppendEntries], None]) -> None:
        self._run(sim, node_id, self.relay(node_id).on_metadata(metadata, sim.now), deliver)

    def on_timer(self, sim: Simulation, node_id: str, digest: bytes) -> None:
        self._run(sim, node_id, self.relay(node_id).on_wake(digest, sim.now), deliver=None)

    def on_fetch(self, sim: Simulation, node_id: str, request: PayloadRequest) -> bool:
        """A fetch reaches `node_id`: answered (accepted or declined), then served or promised.
        True when it promised."""
        actions = self.relay(node_id).on_request(request, sim.now)
        accepted = any(isinstance(action, (Serve, Promise)) for action in actions)
        reply = FetchReply(node_id, request.digest, FetchAnswer.ACCEPTED if accepted else FetchAnswer.DECLINED)
        if not sim.relay_send(node_id, request.requester, reply):
            sim.relay_later(self.fetch_deadline_s, request.requester,
                            FetchReply(node_id, request.digest, FetchAnswer.UNREACHABLE))
        self._run(sim, node_id, actions, deliver=None)
        return any(isinstance(action, Promise) for action in actions)

    def on_fetch_reply(self, sim: Simulation, node_id: str, reply: FetchReply) -> None:
        self._run(sim, node_id, self.relay(node_id).on_fetch_answer(reply.source, reply.digest, reply.answer,
                                                                     sim.now), deliver=None)

    def on_payload(self, sim: Simulation, node_id: str, hop: PayloadHop,
                   deliver: Callable[[AppendEntries], None]) -> None:
        self._run(sim, node_id, self.relay(node_id).on_payload(hop, sim.now), deliver)

    def on_crash(self, node_id: str) -> None:
        if node_id in self.relays:
            self.relays[node_id].forget_waiting()

    def bound_violations(self, node_id: str, now: float) -> list[str]:
        return [f"relay {node_id}: {problem}" for problem in self.relay(node_id).follower.bound_violations(now)]

    # ------------------------------------------------------------ helpers

    def _tree(self, sim: Simulation, holder: str) -> RelayTree:
        """The holder's own view: voters and known members, minus what its failure detector doubts."""
        node = sim.hosts[holder].node
        assert node is not None
        members = set(node.log.config.voters) | set(node.membership.members)
        unhealthy = {m for m in members if node.membership.state_of(m) not in (None, MemberState.ALIVE)}
        return plan_relay_tree(holder, members, self.fanout, unhealthy)

    def _send_payload(self, sim: Simulation, node_id: str, to: str, hop: PayloadHop) -> None:
        if sim.is_lease_holder(node_id):
            self.holder_sends += 1
        else:
            self.forwarded += 1
            if node_id in self.corrupting:
                altered = hop.payload[:-1] + bytes([hop.payload[-1] ^ 0x01]) if hop.payload else b"\x01"
                hop = PayloadHop(hop.digest, altered, hop.tree)
        sim.relay_send(node_id, to, hop, self.slow.get(to, 0.0))

    def _run(self, sim: Simulation, node_id: str, actions: Iterable[RelayAction],
             deliver: Callable[[AppendEntries], None] | None) -> None:
        relay = self.relay(node_id)
        for action in actions:
            if isinstance(action, SendPayload):
                self._send_payload(sim, node_id, action.to, action.hop)
            elif isinstance(action, Serve):
                payload = relay.store.get(action.digest)
                if payload is not None:
                    self._send_payload(sim, node_id, action.to, PayloadHop(action.digest, payload, None))
            elif isinstance(action, Fetch):
                if not sim.relay_send(node_id, action.to, PayloadRequest(node_id, action.digest)):
                    sim.relay_later(self.fetch_deadline_s, node_id,
                                    FetchReply(action.to, action.digest, FetchAnswer.UNREACHABLE))
            elif isinstance(action, WakeAt):
                sim.relay_timer(max(0.0, action.at - sim.now), node_id, action.digest)
            elif isinstance(action, Deliver):
                assert deliver is not None, "only appends and payload arrivals deliver"
                deliver(action.message)
            # Promise and Decline answered the fetch (on_fetch); Release: the simulation's held
            # appends are delivered by the arrival itself.
