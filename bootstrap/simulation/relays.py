"""Relayed payloads in the coordination simulation: every simulated node runs the real `PayloadRelay`.

With relays on, the lease holder's `AppendEntries` travels as metadata and the payload bytes go
down the relay tree hop by hop (`bootstrap/relay_plane.py`), through the same faulty network as
every other message: loss, partitions, cut links, crashed relays. One fault exists only here,
`corrupt_relay`: a member alters every payload it forwards or serves as a relay (never the
holder's own bytes: a Byzantine holder is outside Raft's fault model). The invariant checker
compares applied entries byte for byte, so the runs show that relays can delay commits, never
change them; the broken variant `relay_verify=False` (bytes stored without checking their digest)
shows that the checker would notice.

Payload stores survive crashes (a daemon keeps entry payloads in its log files); held-back
appends do not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from bootstrap.messages import AppendEntries, MemberState
from bootstrap.relay_plane import (
    Deliver,
    Metadata,
    PayloadHop,
    PayloadRelay,
    PayloadRequest,
    RelayAction,
    SendPayload,
    SendRequest,
    WakeAt,
)
from bootstrap.relay_tree import RelayTree, plan_relay_tree

__all__ = ["Metadata", "PayloadHop", "PayloadRequest", "RelayPlane"]


class Simulation(Protocol):
    """What the relay plane needs of the simulation that hosts it (bootstrap/simulation/harness.py)."""

    hosts: Mapping[str, Any]
    now: float

    def relay_send(self, source: str, to: str, item: PayloadHop | PayloadRequest) -> None: ...

    def relay_timer(self, delay: float, node_id: str, wait_id: int) -> None: ...

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
    relays: dict[str, PayloadRelay] = field(default_factory=dict)
    corrupting: set[str] = field(default_factory=set)
    holder_sends: int = 0  # payload copies sent by the lease holder (pushes and fetch answers)
    forwarded: int = 0  # payload copies sent by everyone else

    @property
    def refused(self) -> int:
        return sum(relay.refused for relay in self.relays.values())

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

    def on_timer(self, sim: Simulation, node_id: str, wait_id: int) -> None:
        self._run(sim, node_id, self.relay(node_id).on_wake(wait_id, sim.now), deliver=None)

    def on_fetch(self, sim: Simulation, node_id: str, request: PayloadRequest) -> None:
        self._run(sim, node_id, self.relay(node_id).on_request(request), deliver=None)

    def on_payload(self, sim: Simulation, node_id: str, hop: PayloadHop,
                   deliver: Callable[[AppendEntries], None]) -> None:
        self._run(sim, node_id, self.relay(node_id).on_payload(hop), deliver)

    def on_crash(self, node_id: str) -> None:
        if node_id in self.relays:
            self.relays[node_id].forget_waiting()

    # ------------------------------------------------------------ helpers

    def _tree(self, sim: Simulation, holder: str) -> RelayTree:
        """The holder's own view: voters and known members, minus what its failure detector doubts."""
        node = sim.hosts[holder].node
        assert node is not None
        members = set(node.log.config.voters) | set(node.membership.members)
        unhealthy = {m for m in members if node.membership.state_of(m) not in (None, MemberState.ALIVE)}
        return plan_relay_tree(holder, members, self.fanout, unhealthy)

    def _run(self, sim: Simulation, node_id: str, actions: Iterable[RelayAction],
             deliver: Callable[[AppendEntries], None] | None) -> None:
        for action in actions:
            if isinstance(action, SendPayload):
                hop = action.hop
                if sim.is_lease_holder(node_id):
                    self.holder_sends += 1
                else:
                    self.forwarded += 1
                    if node_id in self.corrupting:
                        altered = hop.payload[:-1] + bytes([hop.payload[-1] ^ 0x01]) if hop.payload else b"\x01"
                        hop = PayloadHop(hop.digest, altered, hop.tree)
                sim.relay_send(node_id, action.to, hop)
            elif isinstance(action, SendRequest):
                sim.relay_send(node_id, action.to, action.request)
            elif isinstance(action, WakeAt):
                sim.relay_timer(max(0.0, action.at - sim.now), node_id, action.wait_id)
            elif isinstance(action, Deliver):
                assert deliver is not None, "only appends and payload arrivals deliver"
                deliver(action.message)
