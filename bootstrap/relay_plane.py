"""One node's side of relayed payloads: commit bytes travel down a relay tree, authority does not.

The lease holder's `AppendEntries` still goes to every follower directly, but as metadata: each
entry's payload is known to the follower only by its SHA-256. The bytes are pushed once per entry
down the relay tree (`bootstrap.relay_tree`); every node that receives them keeps them (in the
daemon, its log files) and passes them to its children. A follower hands its state machine the
longest prefix of the holder's entries for which it holds bytes with the digest the holder named
(an empty prefix is a heartbeat: the lease is renewed and the commit index advances over what it
already has, so waiting for bytes never starts an election; such a partial answer goes out at
most once per `partial_every_s` per holder unless it grew, or every answer would make the holder
send the same entries again at once). The rest waits; after `timeout_s` without the bytes the
follower asks the next source up the tree (`RelayTree.fetch_sources`: parent, each ancestor,
the holder last), and again every `timeout_s`.

So a relay can delay bytes but never change them: bytes whose digest differs from the holder's
are dropped on arrival (`refused`). `docs/COORDINATION.md` ("Relayed payloads") says why this keeps
Raft's safety; the coordination simulation runs this class on every simulated node.

Sans-IO: events and `now` in, actions out; the payload store is injected.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bootstrap.entries import LogEntry
from bootstrap.messages import AppendEntries
from bootstrap.relay_tree import RelayTree
from wire.errors import LocalProtocolError

# A follower answers an append it cannot complete yet at most this often per holder, unless the
# part it can take grew: often enough to renew the holder's lease (heartbeats are 0.5 s apart by
# default), rarely enough that the holder's "send the rest at once" reaction does not loop.
DEFAULT_PARTIAL_EVERY_S = 0.25
# Seconds without a payload before a follower asks the next source up the tree.
DEFAULT_RELAY_TIMEOUT_S = 0.5
# Held-back messages per node; the holder resends anyway, so dropping the oldest loses only time.
MAX_WAITING_MESSAGES = 16
# Digests a holder remembers having pushed (32 B each, most recent first kept). An entry older than
# the last few thousand commits that is sent again goes down the tree again: extra traffic for a
# follower that far behind, never a safety question (the bytes are still checked by digest).
MAX_PUSHED_DIGESTS = 4096


def payload_digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


class PayloadStore(Protocol):
    """Where a node keeps payload bytes by digest (the daemon: spool and log files; the simulation: a dict).

    What it keeps is opaque here: bytes, or the host's handle to bytes it verified itself (a
    daemon receiving a streamed payload hashes it chunk by chunk and hands over a spool file).
    """

    def get(self, digest: bytes) -> Any | None: ...

    def put(self, digest: bytes, payload: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class Metadata:
    """An `AppendEntries` in flight without its payloads' bytes, and the tree the holder planned."""

    message: AppendEntries
    tree: RelayTree

    def digests(self) -> list[bytes]:
        return [payload_digest(e.payload_bytes()) for e in self.message.entries if e.payload_size]


@dataclass(frozen=True, slots=True)
class PayloadHop:
    """Payload bytes claimed to have `digest`; `tree` says where to pass them on (None: a fetch answer).

    `payload` is bytes, or (`on_verified`) the host's handle to bytes it already checked.
    """

    digest: bytes
    payload: Any
    tree: RelayTree | None


@dataclass(frozen=True, slots=True)
class PayloadRequest:
    requester: str
    digest: bytes


# ---------------------------------------------------------------- actions for the host


@dataclass(frozen=True, slots=True)
class SendPayload:
    to: str
    hop: PayloadHop


@dataclass(frozen=True, slots=True)
class SendRequest:
    to: str
    request: PayloadRequest


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand this (possibly shortened) append to the node's coordination core."""

    message: AppendEntries


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Call `on_wake(wait_id, now)` at local time `at`."""

    at: float
    wait_id: int


RelayAction = SendPayload | SendRequest | Deliver | WakeAt


@dataclass(slots=True)
class _Waiting:
    metadata: Metadata
    attempt: int = 0


@dataclass(slots=True)
class PayloadRelay:
    """A node's relay state: what it has pushed, which appends wait for bytes, when it last answered partly."""

    node_id: str
    store: PayloadStore
    timeout_s: float = DEFAULT_RELAY_TIMEOUT_S
    partial_every_s: float = DEFAULT_PARTIAL_EVERY_S
    verify: bool = True  # False only in the simulation's deliberately broken variant
    # Digests this node sent into a tree as holder, oldest first, at most MAX_PUSHED_DIGESTS.
    pushed: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    waiting: dict[int, _Waiting] = field(default_factory=dict)
    last_partial: dict[str, tuple[float, int]] = field(default_factory=dict)  # holder -> (time, end index)
    next_wait_id: int = 0
    refused: int = 0  # payloads dropped because their bytes did not match the digest

    def __post_init__(self) -> None:
        for name in ("timeout_s", "partial_every_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise LocalProtocolError(f"relay {name} must be > 0 seconds, got {value!r}")

    # ------------------------------------------------------------ as lease holder

    def outgoing(self, message: AppendEntries, tree: RelayTree,
                 digest_of: Callable[[LogEntry], bytes] | None = None) -> tuple[Metadata, list[RelayAction]]:
        """An append about to leave the holder: its bytes kept, new ones pushed to the tree's first level.

        `digest_of`: the host's digest of an entry's payload (computed once, reading it a piece at
        a time); the payload is then kept and pushed as the entry holds it (bytes, or the host's
        reference to them). Without it, the bytes are read and hashed here.
        """
        if tree.root != self.node_id:
            raise LocalProtocolError(f"{self.node_id} sends appends down a tree rooted at {tree.root}")
        actions: list[RelayAction] = []
        for entry in message.entries:
            if not entry.payload_size:
                continue
            if digest_of is None:
                payload: Any = entry.payload_bytes()  # read from the log file when it is stored there
                digest = payload_digest(payload)
            else:
                payload, digest = entry.payload, digest_of(entry)
            self.store.put(digest, payload)
            if digest not in self.pushed:
                self.mark_pushed(digest)
                actions += [SendPayload(child, PayloadHop(digest, payload, tree))
                            for child in tree.children.get(self.node_id, ())]
        return Metadata(message, tree), actions

    def mark_pushed(self, digest: bytes) -> None:
        """Remember that `digest` went down a tree (forgetting the oldest past MAX_PUSHED_DIGESTS)."""
        self.pushed[digest] = None
        self.pushed.move_to_end(digest)
        while len(self.pushed) > MAX_PUSHED_DIGESTS:
            self.pushed.popitem(last=False)

    # ------------------------------------------------------------ as follower

    def on_metadata(self, metadata: Metadata, now: float) -> list[RelayAction]:
        assembled, complete = self._assemble(metadata)
        if complete:
            return [Deliver(assembled)]
        actions: list[RelayAction] = []
        holder = metadata.message.leader_id
        last_at, last_end = self.last_partial.get(holder, (float("-inf"), -1))
        end = assembled.prev_index + len(assembled.entries)
        if end > last_end or now - last_at >= self.partial_every_s:
            self.last_partial[holder] = (now, end)
            actions.append(Deliver(assembled))  # what we hold now, at least the heartbeat
        if len(self.waiting) >= MAX_WAITING_MESSAGES:
            self.waiting.pop(min(self.waiting))
        self.next_wait_id += 1
        self.waiting[self.next_wait_id] = _Waiting(metadata)
        actions.append(WakeAt(now + self.timeout_s, self.next_wait_id))
        return actions

    def on_wake(self, wait_id: int, now: float) -> list[RelayAction]:
        """No bytes within the timeout: ask the next source up the tree (the holder last, then again)."""
        waiting = self.waiting.get(wait_id)
        if waiting is None:
            return []
        tree = waiting.metadata.tree
        sources = tree.fetch_sources(self.node_id) if self.node_id in tree.parent else ()
        source = sources[min(waiting.attempt, len(sources) - 1)] if sources else tree.root
        waiting.attempt += 1
        actions: list[RelayAction] = [SendRequest(source, PayloadRequest(self.node_id, digest))
                                      for digest in waiting.metadata.digests() if self.store.get(digest) is None]
        actions.append(WakeAt(now + self.timeout_s, wait_id))
        return actions

    def on_request(self, request: PayloadRequest) -> list[RelayAction]:
        payload = self.store.get(request.digest)
        if payload is None:
            return []
        return [SendPayload(request.requester, PayloadHop(request.digest, payload, None))]

    def on_payload(self, hop: PayloadHop) -> list[RelayAction]:
        if self.verify and payload_digest(hop.payload) != hop.digest:
            self.refused += 1  # altered on the way: dropped, and fetched again from higher up
            return []
        return self.on_verified(hop)

    def on_verified(self, hop: PayloadHop) -> list[RelayAction]:
        """Bytes the host already checked against `hop.digest` (hashed while they streamed in)."""
        new = self.store.get(hop.digest) is None
        self.store.put(hop.digest, hop.payload)
        actions: list[RelayAction] = []
        if hop.tree is not None and new:
            actions += [SendPayload(child, hop) for child in hop.tree.children.get(self.node_id, ())]
        for wait_id in sorted(self.waiting):
            assembled, complete = self._assemble(self.waiting[wait_id].metadata)
            if complete:
                del self.waiting[wait_id]
                actions.append(Deliver(assembled))
        return actions

    def forget_waiting(self) -> None:
        """A restart: held-back appends are volatile (the holder resends); stored bytes are not."""
        self.waiting.clear()
        self.last_partial.clear()

    # ------------------------------------------------------------ helpers

    def _assemble(self, metadata: Metadata) -> tuple[AppendEntries, bool]:
        """The holder's append cut before the first entry whose bytes we lack, and whether nothing was cut.

        Any prefix is an append the holder could have sent itself (a follower commits at most
        through the last entry it was given), so delivering it early is safe.
        """
        entries = []
        for entry in metadata.message.entries:
            if entry.payload_size:
                held = self.store.get(payload_digest(entry.payload_bytes()))
                if held is None:
                    return replace(metadata.message, entries=tuple(entries)), False
                entry = replace(entry, payload=held)
            entries.append(entry)
        return replace(metadata.message, entries=tuple(entries)), True


def sends_of(actions: Iterable[RelayAction]) -> int:
    """How many payload copies these actions send (what a holder's uplink carries)."""
    return sum(1 for action in actions if isinstance(action, SendPayload))
