"""Relayed commits in the daemon: commit payload bytes travel down a relay tree, LogAppends carry digests.

The I/O side of `bootstrap/relay_plane.py` (docs/COORDINATION.md, "Relayed payloads"):

- **As lease holder** (`[node] relay_fanout` > 0), `relayed_append` turns an outgoing
  `AppendEntries` into a wire LogAppend whose payload-bearing entries are *relayed* (SHA-256 and
  size, no bytes), and the first time an entry leaves, `PayloadRelay.outgoing` pushes its bytes to
  the tree's first level. Pushes go through one queue and worker per peer of their own, so a slow
  push never delays a heartbeat or an append.
- **On every node**, a PayloadPush is checked against its digest (`PayloadRelay.on_payload`) before
  anything is kept or forwarded; verified bytes are kept in a bounded in-memory store until the
  entry is in the log (`settle`), and passed on to this node's children in the pushed tree.
  A PayloadFetch is answered from that store or from the log.
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
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode
from bootstrap.entries import LogEntry
from bootstrap.relay_plane import PayloadHop, PayloadRelay, PayloadRequest, SendPayload, payload_digest
from bootstrap.relay_tree import RelayTree, plan_relay_tree
from diloco_node.daemon import peers
from diloco_node.daemon.tasks import TaskSet
from diloco_node.transport import PeerClient, PeerRefused, PeerUnreachable
from wire import messages as wire
from wire.errors import RemoteProtocolError

log = logging.getLogger("diloco_node.daemon")

# A follower holds a relayed append at most this long waiting for its bytes (capped at a quarter
# of the lease by the node, so a held append never costs the holder its lease).
DEFAULT_HOLD_S = 1.0
# Seconds without a payload before a follower asks the next source up the tree.
DEFAULT_TIMEOUT_S = 0.5
# A push or a fetch answer may carry a 256 MiB payload over a slow link; a stalled peer costs a
# push queue this long, never a heartbeat (fetches climb on meanwhile: they do not wait for it).
TRANSFER_DEADLINE_S = 60.0
# A fetch loop stops when no append has named its digest for this long (the holder moved on).
GIVE_UP_S = 30.0
# Payload copies queued per peer for pushing; the oldest is dropped past it (the peer fetches it).
MAX_QUEUED_PUSHES = 4
# Verified payloads kept in memory until their entry is in the log (then the log holds them).
MAX_HELD_PAYLOADS = 16
MAX_HELD_BYTES = 2 * 1024**3
# Digests remembered with the log position of their entry, to serve fetches from the log.
MAX_KNOWN_POSITIONS = 4096


def entry_bytes(entry: LogEntry) -> bytes:
    """An entry's payload bytes, wherever the log keeps them (in memory, or read from the log file)."""
    return entry.payload_bytes()


class HeldPayloads:
    """The `PayloadStore` of the relay plane: verified bytes by SHA-256, in memory until the log holds them.

    Bounded by count and bytes (the oldest go first: the holder resends, a child fetches). Bytes
    whose entry is in the log are read back from the log (`settle` records where).
    """

    def __init__(self, from_log: Callable[[int, int], bytes | None], *, max_items: int = MAX_HELD_PAYLOADS,
                 max_bytes: int = MAX_HELD_BYTES) -> None:
        self._from_log = from_log  # (index, epoch) -> the log entry's bytes, or None
        self._held: OrderedDict[bytes, bytes] = OrderedDict()
        self._positions: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._max_items, self._max_bytes = max_items, max_bytes
        self.held_bytes = 0

    def get(self, digest: bytes) -> bytes | None:
        payload = self._held.get(digest)
        if payload is not None:
            return payload
        position = self._positions.get(digest)
        return self._from_log(*position) if position is not None else None

    def put(self, digest: bytes, payload: bytes) -> None:
        if digest in self._held or digest in self._positions:
            return
        self._held[digest] = payload
        self.held_bytes += len(payload)
        while self._held and (len(self._held) > self._max_items or self.held_bytes > self._max_bytes):
            _, dropped = self._held.popitem(last=False)
            self.held_bytes -= len(dropped)

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
            self.held_bytes -= len(dropped)

    def __contains__(self, digest: bytes) -> bool:
        return self.get(digest) is not None


def holder_tree(core: CoordinatorNode, fanout: int) -> RelayTree:
    """The lease holder's relay tree: voters and known members, minus evicted ones; what SWIM doubts goes last."""
    members = {m for m in set(core.log.config.voters) | set(core.membership.members)
               if m != core.node_id and not core.is_evicted(m)
               and core.membership.state_of(m) is not coord.MemberState.LEFT}
    unhealthy = {m for m in members if (state := core.membership.state_of(m)) is not None
                 and state is not coord.MemberState.ALIVE}
    return plan_relay_tree(core.node_id, members, fanout, unhealthy)


def tree_from_wire(push: wire.PayloadPush) -> RelayTree | None:
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


class RelayIO:
    """One node's relayed-payload I/O: pushes out, pushes and fetches in, appends held until their bytes come."""

    def __init__(self, *, node_id: str, fanout: int, client: PeerClient, url_of: Callable[[str], str | None],
                 from_log: Callable[[int, int], bytes | None], tasks: TaskSet,
                 monotonic: Callable[[], float], hold_s: float = DEFAULT_HOLD_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not hold_s > 0 or not timeout_s > 0:
            raise ValueError(f"relay hold_s and timeout_s must be > 0, got {hold_s!r}, {timeout_s!r}")
        self.node_id = node_id
        self.fanout = fanout  # 0: this node, as lease holder, sends payloads inside its appends
        self.client = client
        self.url_of = url_of
        self.tasks = tasks
        self.monotonic = monotonic
        self.hold_s = hold_s
        self.store = HeldPayloads(from_log)
        self.relay = PayloadRelay(node_id, self.store, timeout_s=timeout_s)
        self.trees: dict[str, RelayTree] = {}  # holder -> the last tree it pushed to us
        self._digests: OrderedDict[tuple[int, int], tuple[bytes, int]] = OrderedDict()  # (index, epoch) -> digest, size
        self._queues: dict[str, _PushQueue] = {}
        self._missing: dict[bytes, _Missing] = {}
        # One fetch in flight per source: a catching-up follower wants many payloads at once, and
        # a peer admits only a few streams from one member (the rest would be refused, 429).
        self._fetch_slots: dict[str, asyncio.Semaphore] = {}
        self._fetching: set[tuple[str, bytes]] = set()
        # What this node did (read by tests; not on /status yet): copies pushed as the root,
        # copies forwarded as a relay, fetch answers served, fetches sent, pushes refused.
        self.counts = {"pushed": 0, "forwarded": 0, "served": 0, "fetched": 0, "refused": 0}

    # ------------------------------------------------------------------ as lease holder

    def digest_of(self, entry: LogEntry, payload: bytes | None = None) -> tuple[bytes, int]:
        """SHA-256 and size of an entry's payload (`payload`: its bytes, when already read), computed
        once per (index, epoch): an entry never changes."""
        key = (entry.index, entry.epoch)
        known = self._digests.get(key)
        if known is None:
            payload = entry_bytes(entry) if payload is None else payload
            known = self._digests[key] = (payload_digest(payload), len(payload))
            while len(self._digests) > MAX_KNOWN_POSITIONS:
                self._digests.popitem(last=False)
        return known

    def relayed_append(self, message: coord.AppendEntries, tree: RelayTree, *, leader_commit: int) -> wire.LogAppend:
        """The wire form of the holder's append with payloads by digest; new payloads start down the tree."""
        fresh = []
        described = []
        for entry in message.entries:
            if entry.payload_size == 0:
                described.append(peers.entry_to_wire(entry))
                continue
            # A payload stored in the log file is read once: for its digest and, if new, its push.
            payload = None if (entry.index, entry.epoch) in self._digests else entry_bytes(entry)
            digest, size = self.digest_of(entry, payload)
            described.append(peers.relayed_entry_to_wire(entry, digest, size))
            if digest not in self.relay.pushed:
                fresh.append(replace(entry, payload=entry_bytes(entry) if payload is None else payload))
        for entry in fresh:
            # One entry at a time (the relay plane pushes what it was not given before), so the
            # plane hashes each payload once, not every time an append is sent to some follower.
            _, actions = self.relay.outgoing(replace(message, prev_index=entry.index - 1, entries=(entry,)), tree)
            self._perform(actions, as_root=True)
            self.store.settle(self.digest_of(entry)[0], entry.index, entry.epoch)
        return wire.LogAppend(message.epoch, message.leader_id, message.prev_index, message.prev_epoch,
                              tuple(described), leader_commit)

    # ------------------------------------------------------------------ pushes and fetches in

    def on_push(self, push: wire.PayloadPush, sender: str) -> None:
        """Bytes from `sender`: kept and forwarded if their SHA-256 is `push.digest`, else refused (400)."""
        tree = tree_from_wire(push)
        if tree is not None and tree.root != self.node_id:
            self.trees[tree.root] = tree
        if tree is not None and tree.root == self.node_id:
            tree = None  # our own payload pushed back to us: keep, never forward
        refused = self.relay.refused
        actions = self.relay.on_payload(PayloadHop(push.digest, push.payload, tree))
        if self.relay.refused != refused:
            self.counts["refused"] += 1
            raise RemoteProtocolError(f"PayloadPush from {sender}: the bytes do not have SHA-256 "
                                      f"{push.digest.hex()[:16]}..; nothing kept", 400)
        self._perform(actions, as_root=False)
        missing = self._missing.get(push.digest)
        if missing is not None:
            missing.arrived.set()

    def on_fetch(self, fetch: wire.PayloadFetch, requester: str) -> wire.PayloadPush:
        """The bytes with `fetch.digest`, as a PayloadPush without a tree; 404 when this node has none."""
        actions = self.relay.on_request(PayloadRequest(requester, fetch.digest))
        if not actions:
            raise RemoteProtocolError(f"{self.node_id} holds no payload {fetch.digest.hex()[:16]}..", 404)
        self.counts["served"] += 1
        hop = actions[0].hop  # type: ignore[union-attr]
        return wire.PayloadPush(hop.digest, "", {}, hop.payload)

    # ------------------------------------------------------------------ as follower

    async def complete(self, message: wire.LogAppend) -> wire.LogAppend:
        """A relayed append with its bytes filled in: the longest prefix whose bytes are here after at most hold_s."""
        wanted = {e.payload_sha256: e.index <= message.leader_commit for e in message.entries
                  if e.relayed and e.payload_sha256 not in self.store}
        if wanted:
            now = self.monotonic()
            events = [self._want(digest, message.leader, now, urgent).arrived for digest, urgent in wanted.items()]
            waits = [asyncio.ensure_future(event.wait()) for event in events]
            try:
                await asyncio.wait(waits, timeout=self.hold_s, return_when=asyncio.ALL_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        entries = []
        for entry in message.entries:
            if entry.relayed:
                payload = self.store.get(entry.payload_sha256)
                if payload is None:
                    break
                entry = wire.LogEntry(entry.index, entry.epoch, entry.kind, entry.metadata, payload)
            entries.append(entry)
        return replace(message, entries=tuple(entries))

    def settle(self, message: wire.LogAppend) -> None:
        """After the core took `message`: bytes of relayed entries now in the log are served from there."""
        for entry in message.entries:
            if entry.relayed:
                self.store.settle(entry.payload_sha256, entry.index, entry.epoch)
                missing = self._missing.pop(entry.payload_sha256, None)
                if missing is not None:
                    missing.arrived.set()

    def _want(self, digest: bytes, holder: str, now: float, urgent: bool) -> _Missing:
        missing = self._missing.get(digest)
        if missing is None:
            missing = self._missing[digest] = _Missing(holder, now, urgent)
            self.tasks.spawn(self._fetch_loop(digest, missing), name=f"relay-fetch-{digest.hex()[:8]}")
        missing.holder, missing.last_wanted = holder, now
        return missing

    async def _fetch_loop(self, digest: bytes, missing: _Missing) -> None:
        """Every timeout without the bytes, ask the next source up the tree (the holder last, then again)."""
        attempt = 0
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
                if url is None or hop.tree is None:
                    continue
                push = wire.PayloadPush(hop.digest, hop.tree.root, dict(hop.tree.parent), hop.payload)
                try:
                    await self.client.send(url, push, peer=peer, deadline_s=TRANSFER_DEADLINE_S)
                except (PeerRefused, PeerUnreachable) as error:
                    log.info("payload push to %s failed (it will fetch): %s", peer, error)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one bad exchange must not stop the worker
                    log.exception("payload push to %s failed", peer)
