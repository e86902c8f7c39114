"""Relayed commits in the daemon: commit payload bytes travel down a relay tree, LogAppends carry digests.

The I/O side of `bootstrap/relay_plane.py` (docs/COORDINATION.md, "Relayed payloads"):

- **As lease holder** (`[node] relay_fanout` > 0), `relayed_append` turns an outgoing
  `AppendEntries` into a wire LogAppend whose payload-bearing entries are *relayed* (SHA-256 and
  size, no bytes), and the first time an entry leaves, `PayloadRelay.outgoing` pushes its bytes to
  the tree's first level. With `relay_fanout` = 0 only payloads over `INLINE_PAYLOAD_MAX_BYTES`
  are relayed, in a star (the holder pushes to every member itself); smaller ones stay inline.
  Pushes go through one queue and worker per peer of their own, so a slow push never delays a
  heartbeat or an append.
- **Bytes travel streamed** (wire 2.3): a PayloadOpen (digest, size, tree) then PayloadChunks of
  at most 16 MiB, sent with `PeerClient.send_sequence`. A receiver (`open_stream`) checks the
  declared size against the run's bound (the largest commit its model can make), checks each
  chunk's place and size, writes it to a spool file under the node's data directory and hashes it
  off the event loop; a short stream or a wrong digest is refused (400) and its file deleted.
  Verified files are kept in a bounded store (`HeldPayloads`) until the entry is in the log
  (`settle`), and passed on to this node's children chunk by chunk from the file. A PayloadFetch
  is answered at once (200, no body) and the bytes stream back to the asker the same way, from
  the spool or the log. A 2.2 single-frame PayloadPush is still accepted.
- **As follower**, `complete` holds a relayed LogAppend (the HTTP request stays open) until every
  payload it names is here, at most `hold_s`; meanwhile a fetch loop per missing digest asks the
  next source up the tree every `timeout_s` (parent, each ancestor, the holder last:
  `RelayTree.fetch_sources`, of the last tree this holder pushed; without one, the holder). Then
  the append is answered for the prefix whose bytes are here: an empty prefix is a heartbeat
  (safe: a follower commits at most through the last entry it was given).

Why not `PayloadRelay.on_metadata`/`on_wake` on the follower side: their `Metadata` holds the
holder's message *with* its payloads (the simulation has them), while a daemon follower knows only
each payload's digest; and the daemon answers an append in the same HTTP exchange, so the wait is
the request's, not a separate delivery. The fetch loop below follows the same climb.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode
from bootstrap.entries import LogEntry, PayloadUnavailable, StoredPayload
from bootstrap.relay_plane import PayloadHop, PayloadRelay, SendPayload, payload_digest
from bootstrap.relay_tree import RelayTree, plan_relay_tree
from diloco_node.daemon import peers
from diloco_node.daemon.tasks import TaskSet
from diloco_node.sync.fragments import WIRE_OVERHEAD_BYTES, FragmentPlan
from diloco_node.transport import PeerClient, PeerRefused, PeerUnreachable
from wire import messages as wire
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.limits import MAX_RELAYED_PAYLOAD_BYTES
from wire.payload_stream import PayloadAssembler, commit_size_bound, stream_chunk_bytes

log = logging.getLogger("diloco_node.daemon")

# A follower holds a relayed append at most this long waiting for its bytes (capped at a quarter
# of the lease by the node, so a held append never costs the holder its lease).
DEFAULT_HOLD_S = 1.0
# Seconds without a payload before a follower asks the next source up the tree.
DEFAULT_TIMEOUT_S = 0.5
# A push or a fetch answer is given this long plus its size at the slowest planned link (4 Mbit/s);
# a stalled peer costs a push queue that long, never a heartbeat (fetches climb on meanwhile).
TRANSFER_DEADLINE_S = 60.0
SLOWEST_LINK_BYTES_PER_S = 512 * 1024
# With relay_fanout = 0 the holder still sends bigger payloads by digest and streams their bytes to
# every member itself (a star): one frame would not carry them, and a follower must not buffer them.
# Smaller ones stay inline in the append, as before relays existed.
INLINE_PAYLOAD_MAX_BYTES = 32 * 1024 * 1024
# ... and an append carries at most this many inline payload bytes in all (a catching-up follower is
# sent up to 16 entries at once; the rest of them go by digest), well inside the 256 MiB frame.
INLINE_APPEND_MAX_BYTES = 128 * 1024 * 1024
# Under the node's coordination directory: where streamed payloads are written as they arrive.
SPOOL_SUBDIR = "relay-spool"
# Payloads kept outside memory are hashed this much at a time.
HASH_PIECE_BYTES = 4 * 1024 * 1024
# A fetch loop stops when no append has named its digest for this long (the holder moved on).
GIVE_UP_S = 30.0
# Payload copies queued per peer for pushing; the oldest is dropped past it (the peer fetches it).
MAX_QUEUED_PUSHES = 4
# Verified payloads kept (spool files on disk; a holder's own or a 2.2 push's bytes in memory) until
# their entry is in the log (then the log holds them); past either bound the oldest goes.
MAX_HELD_PAYLOADS = 16
MAX_HELD_BYTES = 4 * 1024**3
# Digests remembered with the log position of their entry, to serve fetches from the log.
MAX_KNOWN_POSITIONS = 4096
# A fetch for bytes a relay is itself receiving or waiting for is promised, not refused: the asker
# is served when they arrive. Payloads and askers per payload promised at once (a tree's children
# and a few catching-up members; past either bound the asker gets the 404 and climbs on).
MAX_PROMISED_PAYLOADS = 16
MAX_PROMISED_ASKERS = 32
# An asker given a promise waits this many relay timeouts, plus the payload's time at the planned
# relay rate below, before it climbs to the next source: a parent still receiving the bytes is no
# stall, and climbing to the holder would cost the holder's uplink another copy; a parent that
# died after promising is routed around after that bounded wait.
PROMISE_TIMEOUTS = 4
PROMISE_BYTES_PER_S = 16 * 1024 * 1024


class SpooledPayload:
    """Verified payload bytes in a spool file; once the file is gone (its entry is in the log and
    the file was deleted), read from the log through `fallback` instead."""

    __slots__ = ("path", "size", "digest", "_fallback")

    def __init__(self, path: Path, size: int, digest: bytes,
                 fallback: Callable[[], Payload | None] = lambda: None) -> None:
        self.path, self.size, self.digest = path, size, digest
        self._fallback = fallback

    def _logged(self) -> Payload:
        payload = self._fallback()
        if payload is None:
            raise PayloadUnavailable(f"relayed payload {self.digest.hex()[:16]}..: its spool file "
                                     f"{self.path.name} is gone and the log does not hold it")
        return payload

    def read(self) -> bytes:
        try:
            with open(self.path, "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            logged = self._logged()
            return logged if isinstance(logged, bytes) else logged.read()

    def pieces(self, piece_bytes: int) -> Iterator[bytes]:
        try:
            handle = open(self.path, "rb")
        except FileNotFoundError:
            yield from payload_pieces(self._logged(), piece_bytes)
            return
        with handle:  # once open, the bytes stay readable even if the file is deleted meanwhile
            while piece := handle.read(piece_bytes):
                yield piece

    def set_fallback(self, fallback: Callable[[], Payload | None]) -> None:
        self._fallback = fallback

    def as_stored(self) -> StoredPayload:
        """A log entry's payload that the log store copies into log.bin piece by piece."""
        return StoredPayload(self.size, self.read, pieces=self.pieces, transient=True)

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"SpooledPayload({self.path.name}, {self.size} bytes)"


# A payload as the relay I/O handles it: bytes (small, or a 2.2 push), a spool file, or the log's
# own reference to an entry's bytes in log.bin. Only `payload_pieces` reads the last two.
Payload = bytes | SpooledPayload | StoredPayload


def payload_size(payload: Payload) -> int:
    return len(payload) if isinstance(payload, bytes) else payload.size


def payload_pieces(payload: Payload, piece_bytes: int) -> Iterator[bytes]:
    """The payload's bytes in order, at most `piece_bytes` at a time (one piece in memory)."""
    if isinstance(payload, bytes):
        for offset in range(0, len(payload), piece_bytes):
            yield payload[offset:offset + piece_bytes]
        return
    yield from payload.pieces(piece_bytes)


def hash_payload(payload: Payload) -> tuple[bytes, int]:
    """SHA-256 and size, read a piece at a time (a stored record's CRC is checked by the end)."""
    hasher = hashlib.sha256()
    size = 0
    for piece in payload_pieces(payload, HASH_PIECE_BYTES):
        hasher.update(piece)
        size += len(piece)
    return hasher.digest(), size


def entry_payload(payload: Payload) -> Payload:
    """`payload` as a new log entry's payload: a reference into log.bin (another entry's record)
    becomes transient, so the log store writes the bytes into the new entry's own record."""
    if isinstance(payload, StoredPayload) and not payload.transient:
        return StoredPayload(payload.size, payload.read, pieces=payload.pieces, transient=True)
    return payload


class HeldPayloads:
    """The `PayloadStore` of the relay plane: verified payloads by SHA-256 until the log holds them.

    A payload is a `SpooledPayload` (a streamed one, on disk), the log's reference to an entry's
    bytes (the holder's own while it pushes them), or bytes (small ones, a 2.2 single-frame push).
    Bounded by count and bytes (the oldest go first, their spool files deleted: the holder
    resends, a child fetches). Once an entry is in the log its spool file is deleted and its bytes
    are read back from the log (`settle` records where).
    """

    def __init__(self, from_log: Callable[[int, int], Payload | None], *, max_items: int = MAX_HELD_PAYLOADS,
                 max_bytes: int = MAX_HELD_BYTES) -> None:
        # (index, epoch) -> the log entry's payload as the log keeps it (bytes, or its reference
        # into log.bin: nothing read), or None when the log no longer holds that entry
        self._from_log = from_log
        self._held: OrderedDict[bytes, Payload] = OrderedDict()
        self._positions: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._max_items, self._max_bytes = max_items, max_bytes
        self.held_bytes = 0

    def get(self, digest: bytes) -> Payload | None:
        """The payload with this digest, kept here or in the log (a reference: nothing is read)."""
        payload = self._held.get(digest)
        if payload is not None:
            return payload
        position = self._positions.get(digest)
        return self._from_log(*position) if position is not None else None

    def held(self, digest: bytes) -> Payload | None:
        """The payload if kept here (not read back from the log)."""
        return self._held.get(digest)

    def put(self, digest: bytes, payload: Payload) -> None:
        if digest in self._held or digest in self._positions:
            if isinstance(payload, SpooledPayload) and self._held.get(digest) is not payload:
                payload.delete()  # a second copy of bytes already here
            return
        self._held[digest] = payload
        self.held_bytes += payload_size(payload)
        while self._held and (len(self._held) > self._max_items or self.held_bytes > self._max_bytes):
            _, dropped = self._held.popitem(last=False)
            self._drop(dropped)

    def _drop(self, payload: Payload) -> None:
        self.held_bytes -= payload_size(payload)
        if isinstance(payload, SpooledPayload):
            payload.delete()

    def settle(self, digest: bytes, index: int, epoch: int) -> None:
        """The entry (index, epoch) with these bytes is in the log: serve it from there from now on."""
        if self._from_log(index, epoch) is None:
            return
        self._positions[digest] = (index, epoch)
        self._positions.move_to_end(digest)
        while len(self._positions) > MAX_KNOWN_POSITIONS:
            self._positions.popitem(last=False)
        dropped = self._held.pop(digest, None)
        if dropped is not None:
            self._drop(dropped)

    def clear(self) -> None:
        """Forget (and delete) everything kept: the node stops."""
        while self._held:
            self._drop(self._held.popitem()[1])

    @property
    def spooled(self) -> int:
        return sum(1 for payload in self._held.values() if isinstance(payload, SpooledPayload))

    def __contains__(self, digest: bytes) -> bool:
        return self.get(digest) is not None

    def __len__(self) -> int:
        """Payloads kept here (not counting those read back from the log)."""
        return len(self._held)


def run_payload_bound(plan: FragmentPlan, shapes: Mapping[str, Sequence[int]], codec_down: str) -> int:
    """The most bytes a relayed payload of this run may declare: the largest fragment's commit in
    `codec_down` (docs/WIRE.md, "Streamed relayed payloads"), from the model's shapes alone."""
    return commit_size_bound(({name: shapes[name] for name in fragment.names} for fragment in plan.fragments),
                             codec_down, overhead_bytes=WIRE_OVERHEAD_BYTES)


def _tree_members(core: CoordinatorNode) -> set[str]:
    return {m for m in set(core.log.config.voters) | set(core.membership.members)
            if m != core.node_id and not core.is_evicted(m)
            and core.membership.state_of(m) is not coord.MemberState.LEFT}


def holder_tree(core: CoordinatorNode, fanout: int) -> RelayTree:
    """The lease holder's relay tree: voters and known members, minus evicted ones; what SWIM doubts goes last.
    Fan-out 0 (relays off): a star, the holder sends to every member itself."""
    members = _tree_members(core)
    if fanout == 0:
        return star_tree(core.node_id, members)
    unhealthy = {m for m in members if (state := core.membership.state_of(m)) is not None
                 and state is not coord.MemberState.ALIVE}
    return plan_relay_tree(core.node_id, members, fanout, unhealthy)


def star_tree(root: str, members: set[str]) -> RelayTree:
    """Every member's parent is `root` (it goes out as no tree: nobody passes the bytes on)."""
    ordered = tuple(sorted(members))
    return RelayTree(root=root, fanout=max(1, len(ordered)), parent={m: root for m in ordered},
                     children={root: ordered, **{m: () for m in ordered}})


def tree_from_wire(push: wire.PayloadPush | wire.PayloadOpen) -> RelayTree | None:
    """The tree a push names (already checked by the wire layer), or None for a fetch answer."""
    if not push.root:
        return None
    children: dict[str, list[str]] = {push.root: []}
    for child, parent in sorted(push.parent.items()):
        children.setdefault(parent, []).append(child)
        children.setdefault(child, [])
    fanout = max((len(kids) for kids in children.values()), default=1) or 1
    return RelayTree(root=push.root, fanout=fanout, parent=dict(push.parent),
                     children={node: tuple(kids) for node, kids in children.items()})


@dataclass(slots=True)
class _PushQueue:
    pending: list[PayloadHop] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class _Missing:
    """A payload some append waits for: who the holder is, when it was last wanted, when it came."""

    holder: str
    last_wanted: float
    # Already committed when first wanted: its push went out long ago (this node was down or
    # still starting), so waiting a relay timeout for it is pointless: fetch at once.
    urgent: bool = False
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    size: int = 0  # the payload's declared size (0: not known)
    # Until then a source that answered our fetch is sending the bytes, or will when it has them.
    promised_until: float = 0.0


class RelayIO:
    """One node's relayed-payload I/O: pushes out, pushes and fetches in, appends held until their bytes come."""

    def __init__(self, *, node_id: str, fanout: int, client: PeerClient, url_of: Callable[[str], str | None],
                 from_log: Callable[[int, int], Payload | None], tasks: TaskSet,
                 monotonic: Callable[[], float], spool_dir: Path | None, hold_s: float = DEFAULT_HOLD_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_payload_bytes: int = MAX_RELAYED_PAYLOAD_BYTES,
                 inline_max_bytes: int = INLINE_PAYLOAD_MAX_BYTES) -> None:
        if not hold_s > 0 or not timeout_s > 0:
            raise ValueError(f"relay hold_s and timeout_s must be > 0, got {hold_s!r}, {timeout_s!r}")
        self.node_id = node_id
        # 0: as lease holder, payloads up to inline_max_bytes go inside the appends, bigger ones
        # by digest with their bytes streamed to every member (a star).
        self.fanout = fanout
        self.inline_max_bytes = inline_max_bytes
        self.client = client
        self.url_of = url_of
        self.tasks = tasks
        self.monotonic = monotonic
        self.hold_s = hold_s
        # The most bytes a peer's PayloadOpen may declare: the largest commit the run's model can make.
        self.max_payload_bytes = max_payload_bytes
        self.chunk_bytes = stream_chunk_bytes()
        # Where streamed payloads are written (None: a temporary directory, made when first needed
        # and removed at close; for nodes without a data directory, i.e. tests).
        self._own_spool = spool_dir is None
        self._spool_dir = None if spool_dir is None else Path(spool_dir)
        if self._spool_dir is not None and self._spool_dir.exists():
            for leftover in self._spool_dir.iterdir():  # a previous run's: unverified or no longer needed
                leftover.unlink(missing_ok=True)
        self.store = HeldPayloads(from_log)
        self._from_log = from_log
        self.relay = PayloadRelay(node_id, self.store, timeout_s=timeout_s)
        self.trees: dict[str, RelayTree] = {}  # holder -> the last tree it pushed to us
        self._digests: OrderedDict[tuple[int, int], tuple[bytes, int]] = OrderedDict()  # (index, epoch) -> digest, size
        self._queues: dict[str, _PushQueue] = {}
        self._missing: dict[bytes, _Missing] = {}
        self._incoming: dict[bytes, set[_PayloadReceiver]] = {}  # streams arriving now, by digest
        self._spool_serial = 0
        # One fetch in flight per source: a catching-up follower wants many payloads at once, and
        # a peer admits only a few streams from one member (the rest would be refused, 429).
        self._fetch_slots: dict[str, asyncio.Semaphore] = {}
        self._fetching: set[tuple[str, bytes]] = set()
        self._promised: dict[bytes, set[str]] = {}  # digest -> askers to serve when its bytes come
        # What this node did (/status "relays", /metrics diloco_relay_*): copies pushed as the root,
        # copies forwarded as a relay, fetch answers served, fetches sent, streams refused; and the
        # payload bytes of copies pushed and forwarded (served answers count as forwarded bytes).
        self.counts = {"pushed": 0, "forwarded": 0, "served": 0, "fetched": 0, "refused": 0,
                       "promised": 0, "pushed_bytes": 0, "forwarded_bytes": 0}

    def status(self) -> dict[str, Any]:
        """The relay part of /status: the counters and what is held now."""
        return {**self.counts, "fanout": self.fanout, "held": len(self.store), "spooled": self.store.spooled,
                "held_bytes": self.store.held_bytes, "max_payload_bytes": self.max_payload_bytes}

    @property
    def spool_dir(self) -> Path:
        if self._spool_dir is None:
            self._spool_dir = Path(tempfile.mkdtemp(prefix="diloco-relay-spool-"))
        self._spool_dir.mkdir(parents=True, exist_ok=True)
        return self._spool_dir

    def close(self) -> None:
        """The node stops: delete what the spool holds (the log has what it needs)."""
        self.store.clear()
        if self._own_spool and self._spool_dir is not None:
            shutil.rmtree(self._spool_dir, ignore_errors=True)

    # ------------------------------------------------------------------ as lease holder

    def relayed_entries(self, entries: Sequence[LogEntry]) -> set[int]:
        """Indices of the entries whose payloads this node, as holder, sends by digest (the rest inline):
        every payload with relays on; with them off, those over `inline_max_bytes`, and those that
        would take the append's inline bytes past INLINE_APPEND_MAX_BYTES."""
        relayed: set[int] = set()
        inline = 0
        for entry in entries:
            size = entry.payload_size
            if size == 0:
                continue
            if self.fanout > 0 or size > self.inline_max_bytes or inline + size > INLINE_APPEND_MAX_BYTES:
                relayed.add(entry.index)
            else:
                inline += size
        return relayed

    def digest_of(self, entry: LogEntry) -> tuple[bytes, int]:
        """SHA-256 and size of an entry's payload, computed once per (index, epoch) (an entry never
        changes), read a piece at a time; `prepare` computes them off the event loop beforehand."""
        key = (entry.index, entry.epoch)
        known = self._digests.get(key)
        if known is None:
            known = self._remember(key, hash_payload(entry.payload))
        return known

    def _remember(self, key: tuple[int, int], digest: tuple[bytes, int]) -> tuple[bytes, int]:
        self._digests[key] = digest
        while len(self._digests) > MAX_KNOWN_POSITIONS:
            self._digests.popitem(last=False)
        return digest

    async def prepare(self, entries: Sequence[LogEntry]) -> None:
        """Hash, in a worker thread, the payloads of `entries` that will go by digest and were not
        hashed yet (a commit of a large model is a second or more of SHA-256: not on the event loop)."""
        relayed = self.relayed_entries(entries)
        for entry in entries:
            key = (entry.index, entry.epoch)
            if entry.index in relayed and key not in self._digests:
                self._remember(key, await asyncio.to_thread(hash_payload, entry.payload))

    def relayed_append(self, message: coord.AppendEntries, tree: RelayTree, *, leader_commit: int) -> wire.LogAppend:
        """The wire form of the holder's append with payloads by digest; new payloads start down the tree.

        The payloads are not read here: new ones are pushed as the log's references to them and
        streamed from log.bin a chunk at a time."""
        fresh = []
        described = []
        relayed = self.relayed_entries(message.entries)
        for entry in message.entries:
            if entry.index not in relayed:
                described.append(peers.entry_to_wire(entry))
                continue
            digest, size = self.digest_of(entry)
            described.append(peers.relayed_entry_to_wire(entry, digest, size))
            if digest not in self.relay.pushed:
                fresh.append(entry)
        for entry in fresh:
            # One entry at a time (the relay plane pushes what it was not given before), so the
            # plane hashes each payload once, not every time an append is sent to some follower.
            _, actions = self.relay.outgoing(replace(message, prev_index=entry.index - 1, entries=(entry,)), tree,
                                             digest_of=lambda e: self.digest_of(e)[0])
            self._perform(actions, as_root=True)
            self.store.settle(self.digest_of(entry)[0], entry.index, entry.epoch)
        return wire.LogAppend(message.epoch, message.leader_id, message.prev_index, message.prev_epoch,
                              tuple(described), leader_commit)

    # ------------------------------------------------------------------ pushes and fetches in

    def open_stream(self, head: wire.PayloadOpen, sender: str) -> _PayloadReceiver:
        """A streamed payload from `sender` begins: its receiver (the transport's SequenceConsumer).
        Refused at once (413) when it declares more than the run's largest commit, and (409, not
        counted as a refusal) when these bytes are here already: a push racing a fetch answer, or
        a resend, costs a round trip instead of the whole payload."""
        try:
            assembler = PayloadAssembler(head, self.max_payload_bytes)
        except RemoteProtocolError:
            self.counts["refused"] += 1
            raise
        if head.digest in self.store:
            raise RemoteProtocolError(f"{self.node_id} already holds payload {head.digest.hex()[:16]}..", 409)
        self._spool_serial += 1
        path = self.spool_dir / f"{head.digest.hex()[:16]}-{self._spool_serial}.part"
        return _PayloadReceiver(self, assembler, sender, path)

    def accept(self, head: wire.PayloadOpen | wire.PayloadPush, payload: Payload, sender: str) -> None:
        """Verified bytes from `sender`: kept, passed on down the tree they came with, waiters woken."""
        tree = tree_from_wire(head)
        if tree is not None and tree.root != self.node_id:
            self.trees[tree.root] = tree
        if tree is not None and tree.root == self.node_id:
            tree = None  # our own payload pushed back to us: keep, never forward
        actions = self.relay.on_verified(PayloadHop(head.digest, payload, tree))
        if isinstance(payload, SpooledPayload) and self.store.held(head.digest) is not payload:
            payload.delete()  # already had it (or it was dropped at once by the bounds)
        self._perform(actions, as_root=False)
        self._serve_promised(head.digest)
        missing = self._missing.get(head.digest)
        if missing is not None:
            missing.arrived.set()

    def on_push(self, push: wire.PayloadPush, sender: str) -> None:
        """A 2.2 single-frame push: kept and forwarded if its SHA-256 is `push.digest`, else refused (400)."""
        if payload_digest(push.payload) != push.digest:
            self.counts["refused"] += 1
            self.relay.refused += 1
            raise RemoteProtocolError(f"PayloadPush from {sender}: the bytes do not have SHA-256 "
                                      f"{push.digest.hex()[:16]}..; nothing kept", 400)
        self.accept(push, push.payload, sender)

    def on_fetch(self, fetch: wire.PayloadFetch, requester: str) -> None:
        """Answered at once; the bytes with `fetch.digest` then stream to `requester`: now, or when
        they arrive here if this node is receiving or awaiting them itself (a promise). 404 otherwise."""
        payload = self.store.get(fetch.digest)
        if payload is None:
            if self._promise(fetch.digest, requester):
                return
            raise RemoteProtocolError(f"{self.node_id} holds no payload {fetch.digest.hex()[:16]}..", 404)
        self.counts["served"] += 1
        self._enqueue(requester, PayloadHop(fetch.digest, payload, None))

    def _promise(self, digest: bytes, requester: str) -> bool:
        """Promise `requester` the bytes of `digest` if they are on their way here (within bounds):
        a stream of them is arriving, or this node awaits them as a fresh commit coming down the
        tree. Not when it is catching up itself (the entry was committed before it asked): the
        asker is better served by climbing on to a node that has them."""
        missing = self._missing.get(digest)
        if not self._incoming.get(digest) and (missing is None or missing.urgent):
            return False
        askers = self._promised.get(digest)
        if askers is None:
            if len(self._promised) >= MAX_PROMISED_PAYLOADS:
                return False
            askers = self._promised[digest] = set()
        if requester not in askers and len(askers) >= MAX_PROMISED_ASKERS:
            return False
        askers.add(requester)
        self.counts["promised"] += 1
        return True

    def _serve_promised(self, digest: bytes) -> None:
        """The bytes of `digest` are here (or will not come): stream them to those promised them."""
        askers = self._promised.pop(digest, ())
        payload = self.store.get(digest) if askers else None
        if payload is None:
            return  # not here after all: the askers' promises run out and they climb on
        for asker in sorted(askers):
            self.counts["served"] += 1
            self._enqueue(asker, PayloadHop(digest, payload, None))

    # ------------------------------------------------------------------ as follower

    async def complete(self, message: wire.LogAppend) -> tuple[wire.LogAppend, dict[int, StoredPayload | bytes]]:
        """The longest prefix of a relayed append whose bytes are here after at most hold_s.

        Returns the prefix with each relayed entry's bytes left out (an empty payload) and the
        payloads by entry index: a spooled one as a `StoredPayload` the log store copies into
        log.bin piece by piece, so the bytes never sit in memory whole.
        """
        wanted = {e.payload_sha256: (e.index <= message.leader_commit, e.payload_size) for e in message.entries
                  if e.relayed and e.payload_sha256 not in self.store}
        if wanted:
            now = self.monotonic()
            events = [self._want(digest, message.leader, now, urgent, size).arrived
                      for digest, (urgent, size) in wanted.items()]
            waits = [asyncio.ensure_future(event.wait()) for event in events]
            try:
                await asyncio.wait(waits, timeout=self.hold_s, return_when=asyncio.ALL_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        entries = []
        payloads: dict[int, StoredPayload | bytes] = {}
        for entry in message.entries:
            if entry.relayed:
                payload = self.store.get(entry.payload_sha256)
                if payload is None:
                    break
                if isinstance(payload, SpooledPayload):
                    # Once this entry is in the log and the file deleted, readers still holding it
                    # (a forward under way, the entry being applied) read the log instead.
                    payload.set_fallback(lambda i=entry.index, e=entry.epoch: self._from_log(i, e))
                    payloads[entry.index] = payload.as_stored()
                else:
                    payloads[entry.index] = entry_payload(payload)
                entry = wire.LogEntry(entry.index, entry.epoch, entry.kind, entry.metadata, b"")
            entries.append(entry)
        return replace(message, entries=tuple(entries)), payloads

    def settle(self, message: wire.LogAppend) -> None:
        """After the core took `message`: bytes of relayed entries now in the log are served from there."""
        for entry in message.entries:
            if entry.relayed:
                self.store.settle(entry.payload_sha256, entry.index, entry.epoch)
                missing = self._missing.pop(entry.payload_sha256, None)
                if missing is not None:
                    missing.arrived.set()

    def _want(self, digest: bytes, holder: str, now: float, urgent: bool, size: int = 0) -> _Missing:
        missing = self._missing.get(digest)
        if missing is None:
            missing = self._missing[digest] = _Missing(holder, now, urgent, size=size)
            self.tasks.spawn(self._fetch_loop(digest, missing), name=f"relay-fetch-{digest.hex()[:8]}")
        missing.holder, missing.last_wanted = holder, now
        return missing

    def _progress(self, digest: bytes) -> int:
        """Bytes received so far by the streams of `digest` arriving now (a moving stream is no stall)."""
        return sum(receiver.assembler.received for receiver in self._incoming.get(digest, ()))

    async def _fetch_loop(self, digest: bytes, missing: _Missing) -> None:
        """Every timeout without the bytes, ask the next source up the tree (the holder last, then again).
        A timeout in which a stream of these bytes made progress does not count."""
        attempt = 0
        seen = -1
        try:
            while not missing.arrived.is_set() and self.monotonic() - missing.last_wanted < GIVE_UP_S:
                if attempt > 0 or not missing.urgent:
                    try:
                        await asyncio.wait_for(missing.arrived.wait(), self.relay.timeout_s)
                        break
                    except TimeoutError:
                        pass
                if digest in self.store:
                    break
                progress = self._progress(digest)
                if progress > seen and self._incoming.get(digest):
                    seen = progress
                    continue
                if self.monotonic() < missing.promised_until:
                    continue  # the last source asked is sending them, or will once it has them
                tree = self.trees.get(missing.holder)
                sources = (tree.fetch_sources(self.node_id) if tree is not None and self.node_id in tree.parent
                           else ()) or (missing.holder,)
                source = sources[min(attempt, len(sources) - 1)]
                attempt += 1
                # Not awaited here: a stalled source must not stop the climb to the next one.
                if (source, digest) not in self._fetching:
                    self._fetching.add((source, digest))
                    self.tasks.spawn(self._fetch_from(source, digest), name=f"relay-fetch-from-{source}")
        finally:
            if self._missing.get(digest) is missing:
                del self._missing[digest]
            missing.arrived.set()  # a holder still waiting gives up now rather than at its hold time
            self._serve_promised(digest)  # here now (a settled entry), or never: promises end either way

    async def _fetch_from(self, source: str, digest: bytes) -> None:
        try:
            slot = self._fetch_slots.setdefault(source, asyncio.Semaphore(1))
            async with slot:
                url = self.url_of(source)
                if url is None or digest in self.store:
                    return
                self.counts["fetched"] += 1
                replies = await self.client.send(url, wire.PayloadFetch(digest), peer=source,
                                                 deadline_s=TRANSFER_DEADLINE_S)
        except (PeerRefused, PeerUnreachable) as error:
            log.debug("payload fetch from %s: %s", source, error)
            return
        finally:
            self._fetching.discard((source, digest))
        missing = self._missing.get(digest)
        # Accepted: the bytes stream back now, or once the source has them. A catching-up asker
        # (committed entries) does not wait on a promise: it climbs on at its usual pace.
        if missing is not None and not replies and not missing.urgent:
            missing.promised_until = self.monotonic() + (PROMISE_TIMEOUTS * self.relay.timeout_s
                                                         + missing.size / PROMISE_BYTES_PER_S)
        # Wire 2.3: no reply, the bytes stream back (open_stream). A 2.2 source answers with them.
        for reply in replies:
            if isinstance(reply, wire.PayloadPush) and reply.digest == digest and not reply.root:
                try:
                    self.on_push(reply, source)
                except RemoteProtocolError as error:
                    log.warning("%s", error)

    # ------------------------------------------------------------------ pushes out

    def _perform(self, actions: list[Any], *, as_root: bool) -> None:
        for action in actions:
            if isinstance(action, SendPayload):
                self.counts["pushed" if as_root else "forwarded"] += 1
                self._enqueue(action.to, action.hop)

    def _enqueue(self, peer: str, hop: PayloadHop) -> None:
        if peer == self.node_id:
            return
        queue = self._queues.get(peer)
        if queue is None:
            queue = self._queues[peer] = _PushQueue()
            self.tasks.spawn(self._push_worker(peer, queue), name=f"relay-push-{peer}")
        queue.pending.append(hop)
        del queue.pending[:-MAX_QUEUED_PUSHES]
        queue.wake.set()

    async def _push_worker(self, peer: str, queue: _PushQueue) -> None:
        while True:
            await queue.wake.wait()
            queue.wake.clear()
            while queue.pending:
                hop = queue.pending.pop(0)
                url = self.url_of(peer)
                if url is None:
                    continue
                try:
                    await self._stream_to(url, peer, hop)
                except PeerRefused as error:
                    if error.status == 409:  # it had the bytes already
                        log.debug("payload push to %s not needed: %s", peer, error)
                    else:
                        log.info("payload push to %s refused (it will fetch): %s", peer, error)
                except PeerUnreachable as error:
                    log.info("payload push to %s failed (it will fetch): %s", peer, error)
                except PayloadUnavailable as error:  # its entry left the log (truncated, compacted)
                    log.info("payload push to %s dropped: %s", peer, error)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one bad exchange must not stop the worker
                    log.exception("payload push to %s failed", peer)

    async def _stream_to(self, url: str, peer: str, hop: PayloadHop) -> None:
        """Stream `hop`'s bytes to `peer`: a PayloadOpen naming the tree, then chunks read one at a time.

        A tree in which no member passes the bytes on (a star) goes out as no tree: the receiver
        keeps them, as it would a fetch answer, and a star of any size fits the wire's fan-out bound.
        """
        tree = hop.tree
        if tree is None or all(not tree.children.get(member) for member in tree.parent):
            root, parent = "", {}
        else:
            root, parent = tree.root, dict(tree.parent)
        size = payload_size(hop.payload)
        head = wire.PayloadOpen(os.urandom(wire.STREAM_ID_BYTES), hop.digest, size, self.chunk_bytes, root, parent)
        await self.client.send_sequence(url, _stream_frames(head, hop.payload), peer=peer,
                                        deadline_s=TRANSFER_DEADLINE_S + size / SLOWEST_LINK_BYTES_PER_S)
        self.counts["pushed_bytes" if tree is not None and tree.root == self.node_id else "forwarded_bytes"] += size


async def _stream_frames(head: wire.PayloadOpen, payload: Payload) -> AsyncIterator[wire.Message]:
    """The open, then each chunk, read one at a time in a worker thread (a spool file, log.bin)."""
    yield head
    pieces = payload_pieces(payload, head.chunk_bytes)
    buffer = bytearray()
    offset = 0
    try:
        while True:
            piece = await asyncio.to_thread(next, pieces, None)
            if piece is None:
                break
            if not buffer and (len(piece) == head.chunk_bytes or offset + len(piece) == head.size) \
                    and len(piece) <= head.chunk_bytes:
                yield wire.PayloadChunk(head.stream, offset, bytes(piece))  # the usual case: no copy
                offset += len(piece)
                continue
            buffer += piece
            while len(buffer) >= head.chunk_bytes or (buffer and offset + len(buffer) == head.size):
                chunk = bytes(buffer[:head.chunk_bytes])
                del buffer[:head.chunk_bytes]
                yield wire.PayloadChunk(head.stream, offset, chunk)
                offset += len(chunk)
    finally:
        pieces.close()
    if offset != head.size or buffer:
        raise LocalProtocolError(f"payload {head.digest.hex()[:16]}.. gave {offset + len(buffer)} bytes, "
                                 f"declared {head.size}")


class _PayloadReceiver:
    """One streamed payload arriving (the transport's SequenceConsumer): checked chunk by chunk,
    spooled to a file and hashed in a worker thread; kept only if whole and of the declared digest."""

    def __init__(self, io: RelayIO, assembler: PayloadAssembler, sender: str, path: Path) -> None:
        self.io, self.assembler, self.sender, self.path = io, assembler, sender, path
        self._hasher = hashlib.sha256()
        self._file: BinaryIO | None = None
        self._done = False
        io._incoming.setdefault(assembler.head.digest, set()).add(self)

    @property
    def max_remaining_bytes(self) -> int:
        return self.assembler.max_remaining_bytes

    @property
    def frames_left(self) -> int:
        return self.assembler.frames_left

    async def part(self, message: wire.Message) -> None:
        if not isinstance(message, wire.PayloadChunk):
            raise RemoteProtocolError(f"a PayloadOpen body continues with PayloadChunks, got {type(message).__name__}")
        self.assembler.check(message)
        await asyncio.to_thread(self._write, message.payload)

    def _write(self, data: bytes) -> None:
        if self._file is None:
            self._file = open(self.path, "wb")
        self._file.write(data)
        self._hasher.update(data)

    async def finish(self) -> None:
        await asyncio.to_thread(self._close)
        try:
            self.assembler.finish(self._hasher.digest())
        except RemoteProtocolError:
            self._discard()
            self.io.counts["refused"] += 1
            raise
        self._forget()
        head = self.assembler.head
        self.io.accept(head, SpooledPayload(self.path, head.size, head.digest), self.sender)
        return None

    async def abort(self, reason: str) -> None:
        await asyncio.to_thread(self._close)
        self._discard()
        log.info("payload stream from %s dropped: %s", self.sender, reason)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _discard(self) -> None:
        self._forget()
        self.path.unlink(missing_ok=True)

    def _forget(self) -> None:
        if not self._done:
            self._done = True
            receivers = self.io._incoming.get(self.assembler.head.digest)
            if receivers is not None:
                receivers.discard(self)
                if not receivers:
                    del self.io._incoming[self.assembler.head.digest]
