"""Relayed payloads in the coordination simulation: commit bytes travel down a relay tree, authority does not.

With relays on, the lease holder's `AppendEntries` still goes to every follower directly, but as
metadata: each entry's payload is replaced in flight by a reference to its SHA-256. The payload
bytes are pushed once per entry down the relay tree (`bootstrap.relay_tree`), hop by hop through
the same faulty network (loss, partitions, crashed relays), and some relays corrupt the bytes they
forward. A follower hands its state machine the longest prefix of the holder's entries for which
it holds bytes whose digest equals the one in the holder's message (an empty prefix is a
heartbeat: the lease is renewed and the commit index advances over what it already has, so
waiting for bytes never starts an election; such a partial answer is given at most once per
`partial_every_s` per holder unless it makes progress, or every answer would make the holder send
the same entries again at once); the rest waits, and after `relay_timeout_s` without
the bytes the follower asks its parent's parent, and so on up to the holder itself. So relays can delay a commit, never change one: the invariant checker, which
compares applied entries byte for byte, proves it over every schedule, and the broken variant
`accept_unverified` (bytes stored without checking their digest) shows that it would notice.

Payload caches survive crashes: a daemon keeps entry payloads in its log segments on disk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bootstrap.messages import AppendEntries
from bootstrap.relay_tree import RelayTree, plan_relay_tree

# A follower keeps at most this many held-back messages; the holder resends anyway, so dropping
# the oldest loses nothing but a little latency.
MAX_WAITING_MESSAGES = 16


class Simulation(Protocol):
    """What the relay plane needs of the simulation that hosts it (bootstrap/simulation/harness.py)."""

    hosts: Mapping[str, Any]
    now: float

    def relay_send(self, source: str, to: str, item: PayloadHop | FetchRequest) -> None: ...

    def relay_timer(self, delay: float, node_id: str, wait_id: int) -> None: ...

    def is_lease_holder(self, node_id: str) -> bool: ...


def payload_digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


@dataclass(frozen=True, slots=True)
class Metadata:
    """An `AppendEntries` in flight with its payloads left out, and the tree the holder planned."""

    message: AppendEntries
    tree: RelayTree

    def digests(self) -> list[bytes]:
        return [payload_digest(e.payload) for e in self.message.entries if e.payload]


@dataclass(frozen=True, slots=True)
class PayloadHop:
    """Payload bytes arriving at `to`, claimed to have digest `digest`; `tree` says where to forward them."""

    digest: bytes
    payload: bytes
    tree: RelayTree | None  # None: the answer to a fetch, not forwarded further


@dataclass(frozen=True, slots=True)
class FetchRequest:
    requester: str
    digest: bytes


@dataclass(slots=True)
class _Waiting:
    metadata: Metadata
    attempt: int = 0


@dataclass(slots=True)
class RelayPlane:
    """The payload side of replication, for one simulation."""

    fanout: int
    timeout_s: float
    verify: bool = True  # False only in the broken variant
    # A follower answers an append it cannot complete yet at most this often per holder, unless the
    # part it can take grew: enough to renew the holder's lease (heartbeats are 0.5 s apart by
    # default), few enough that the holder's "send the rest at once" reply does not loop.
    partial_every_s: float = 0.25
    last_partial: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)  # -> (time, entries)
    caches: dict[str, dict[bytes, bytes]] = field(default_factory=dict)
    corrupting: set[str] = field(default_factory=set)
    pushed: set[tuple[str, bytes]] = field(default_factory=set)  # (holder, digest) already sent into the tree
    waiting: dict[str, dict[int, _Waiting]] = field(default_factory=dict)
    next_wait_id: int = 0
    holder_sends: int = 0  # payload copies the lease holders sent (pushes and fetch answers)
    forwarded: int = 0
    refused: int = 0  # bytes whose digest did not match (a corrupting relay caught)

    # ------------------------------------------------------------ the holder's side

    def outgoing(self, sim: Simulation, source: str, message: AppendEntries) -> Metadata:
        """Called when `source` sends `message`: its own payloads known, new ones pushed, metadata out."""
        cache = self.caches.setdefault(source, {})
        for entry in message.entries:
            if entry.payload:
                cache[payload_digest(entry.payload)] = entry.payload
        tree = self._tree(sim, source)
        for entry in message.entries:
            digest = payload_digest(entry.payload) if entry.payload else b""
            if entry.payload and (source, digest) not in self.pushed:
                self.pushed.add((source, digest))
                for child in tree.children.get(source, ()):
                    self.holder_sends += 1
                    sim.relay_send(source, child, PayloadHop(digest, entry.payload, tree))
        return Metadata(message, tree)

    def _tree(self, sim: Simulation, holder: str) -> RelayTree:
        node = sim.hosts[holder].node
        assert node is not None
        members = set(node.log.config.voters) | set(node.membership.members)
        unhealthy = {m for m in members if node.membership.state_of(m) is not None
                     and node.membership.state_of(m).value != "alive"}  # type: ignore[union-attr]
        return plan_relay_tree(holder, members, self.fanout, unhealthy)

    # ------------------------------------------------------------ a follower's side

    def on_metadata(self, sim: Simulation, node_id: str, metadata: Metadata,
                    deliver: Callable[[AppendEntries], None]) -> None:
        assembled, complete = self._assemble(node_id, metadata)
        if complete:
            deliver(assembled)
            return
        key = (node_id, metadata.message.leader_id)
        last_at, last_end = self.last_partial.get(key, (float("-inf"), -1))
        end = assembled.prev_index + len(assembled.entries)
        if end > last_end or sim.now - last_at >= self.partial_every_s:
            self.last_partial[key] = (sim.now, end)
            deliver(assembled)  # what we hold now, at least the heartbeat
        waiting = self.waiting.setdefault(node_id, {})
        if len(waiting) >= MAX_WAITING_MESSAGES:
            waiting.pop(min(waiting))
        self.next_wait_id += 1
        waiting[self.next_wait_id] = _Waiting(metadata)
        sim.relay_timer(self.timeout_s, node_id, self.next_wait_id)

    def on_timer(self, sim: Simulation, node_id: str, wait_id: int) -> None:
        """No payload within the timeout: ask the next source up the tree (the holder last, then again)."""
        waiting = self.waiting.get(node_id, {}).get(wait_id)
        if waiting is None:
            return
        sources = waiting.metadata.tree.fetch_sources(node_id) if node_id in waiting.metadata.tree.parent else ()
        source = sources[min(waiting.attempt, len(sources) - 1)] if sources else waiting.metadata.tree.root
        waiting.attempt += 1
        cache = self.caches.setdefault(node_id, {})
        for digest in waiting.metadata.digests():
            if digest not in cache:
                sim.relay_send(node_id, source, FetchRequest(node_id, digest))
        sim.relay_timer(self.timeout_s, node_id, wait_id)

    def on_fetch(self, sim: Simulation, node_id: str, request: FetchRequest) -> None:
        payload = self.caches.get(node_id, {}).get(request.digest)
        if payload is None:
            return
        if sim.is_lease_holder(node_id):
            # The holder's own bytes are the authority (a Byzantine holder is outside Raft's fault
            # model); only relaying is where this simulation lets bytes be altered.
            self.holder_sends += 1
            sim.relay_send(node_id, request.requester, PayloadHop(request.digest, payload, None))
            return
        sim.relay_send(node_id, request.requester, PayloadHop(request.digest, self._as_forwarded(node_id, payload), None))

    def on_payload(self, sim: Simulation, node_id: str, hop: PayloadHop,
                   deliver: Callable[[AppendEntries], None]) -> None:
        if self.verify and payload_digest(hop.payload) != hop.digest:
            self.refused += 1  # altered on the way: dropped, and fetched again from higher up
            return
        cache = self.caches.setdefault(node_id, {})
        new = hop.digest not in cache
        cache[hop.digest] = hop.payload
        if hop.tree is not None and new:
            for child in hop.tree.children.get(node_id, ()):
                self.forwarded += 1
                sim.relay_send(node_id, child, PayloadHop(hop.digest, self._as_forwarded(node_id, hop.payload), hop.tree))
        waiting = self.waiting.get(node_id, {})
        for wait_id in sorted(waiting):
            assembled, complete = self._assemble(node_id, waiting[wait_id].metadata)
            if complete:
                del waiting[wait_id]
                deliver(assembled)

    def on_crash(self, node_id: str) -> None:
        self.waiting.pop(node_id, None)  # held-back messages are volatile; the cache is on disk

    # ------------------------------------------------------------ helpers

    def _as_forwarded(self, node_id: str, payload: bytes) -> bytes:
        if node_id in self.corrupting:
            return payload[:-1] + bytes([payload[-1] ^ 0x01]) if payload else b"\x01"
        return payload

    def _assemble(self, node_id: str, metadata: Metadata) -> tuple[AppendEntries, bool]:
        """The holder's message cut before the first entry whose bytes we lack, and whether nothing was cut.

        Any prefix is a message the holder could have sent itself (Raft's follower commits at most
        through the last entry it was given), so delivering it early is safe.
        """
        cache = self.caches.setdefault(node_id, {})
        entries = []
        for entry in metadata.message.entries:
            if entry.payload:
                held = cache.get(payload_digest(entry.payload))
                if held is None:
                    return replace(metadata.message, entries=tuple(entries)), False
                entry = replace(entry, payload=held)
            entries.append(entry)
        return replace(metadata.message, entries=tuple(entries)), True
