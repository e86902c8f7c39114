"""Relayed commits in the daemon: commit payload bytes travel down a relay tree, LogAppends carry digests.

The I/O side of `bootstrap/relay_plane.py` (docs/COORDINATION.md, "Relayed payloads"). Every
decision about bytes this node lacks or is asked for (what to want, when to wake, whom to fetch
from, what a fetch answer means, what to promise, when to give up) is the plane's `RelayFollower`,
the class the coordination simulation runs; this module only performs its actions, and the bytes
themselves are `relay_spool.py`'s.

- **As lease holder** (`[node] relay_fanout` > 0), `relayed_append` turns an outgoing
  `AppendEntries` into a wire LogAppend whose payload-bearing entries are *relayed* (BLAKE3 digest and
  size, no bytes), and the first time an entry leaves, `PayloadRelay.outgoing` pushes its bytes to
  the tree's first level. With `relay_fanout` = 0 only payloads over `INLINE_PAYLOAD_MAX_BYTES`
  are relayed, in a star (the holder pushes to every member itself); smaller ones stay inline.
  Pushes go through one queue and worker per peer of their own, so a slow push never delays a
  heartbeat or an append.
- **Bytes travel streamed** (wire 2.3): a PayloadOpen (digest, size, tree) then PayloadChunks of
  at most 16 MiB, sent with `PeerClient.send_sequence` and received into a spool file
  (`relay_spool.PayloadReceiver`), checked against the run's bound (the largest commit its model
  can make) and the digest. A PayloadFetch is answered at once: 200 with no body when the plane
  serves or promises the bytes (they then stream back to the asker the same way), 404 when it
  declines. A 2.2 single-frame PayloadPush is still accepted.
- **As follower**, `complete` holds a relayed LogAppend (the HTTP request stays open) until every
  payload it names is here, at most `hold_s`, having told the plane it wants them; the plane's
  `Fetch` actions become PayloadFetches, its `WakeAt`s timers on the injected `Clock`, its
  `Release`s the end of the hold. Then the append is answered for the prefix whose bytes are here:
  an empty prefix is a heartbeat (safe: a follower commits at most through the last entry it was
  given).

The plane's latest decisions, with their reasons, are on /status (`relays.decisions`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode
from bootstrap.entries import LogEntry, PayloadUnavailable, StoredPayload
from bootstrap.relay_plane import (
    DEFAULT_RELAY_TIMEOUT_S,
    Decline,
    Fetch,
    FetchAnswer,
    PayloadHop,
    PayloadRelay,
    Promise,
    Release,
    SendPayload,
    Serve,
    WakeAt,
    payload_digest,
)
from bootstrap.relay_tree import RelayTree, plan_relay_tree
from diloco_node.clock import Clock, Timer
from diloco_node.daemon import peers
from diloco_node.daemon.relay_spool import (
    HeldPayloads,
    Payload,
    PayloadReceiver,
    SpooledPayload,
    SpoolDirectory,
    entry_payload,
    hash_payload,
    payload_frames,
    payload_size,
)
from diloco_node.daemon.tasks import TaskSet
from diloco_node.sync.fragments import WIRE_OVERHEAD_BYTES, FragmentPlan
from diloco_node.transport import PeerClient, PeerRefused, PeerUnreachable
from wire import messages as wire
from wire.errors import RemoteProtocolError
from wire.limits import MAX_RELAYED_PAYLOAD_BYTES
from wire.payload_stream import PayloadAssembler, commit_size_bound, stream_chunk_bytes

log = logging.getLogger("diloco_node.daemon")

# A follower holds a relayed append at most this long waiting for its bytes (capped at a quarter
# of the lease by the node, so a held append never costs the holder its lease).
DEFAULT_HOLD_S = 1.0
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
# Digests of the holder's entries remembered by (index, epoch), so each payload is hashed once.
MAX_KNOWN_DIGESTS = 4096
# Payload copies queued per peer for pushing; the oldest is dropped past it (the peer fetches it).
MAX_QUEUED_PUSHES = 4
# Decisions of the relay plane shown on /status (newest first).
STATUS_DECISIONS = 8


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


class RelayIO:
    """One node's relayed-payload I/O: pushes out, pushes and fetches in, appends held until their bytes
    come; what to fetch, promise or give up is decided by `follower` (bootstrap/relay_plane.py)."""

    def __init__(self, *, node_id: str, fanout: int, client: PeerClient, url_of: Callable[[str], str | None],
                 from_log: Callable[[int, int], Payload | None], tasks: TaskSet, clock: Clock,
                 spool_dir: Path | None, hold_s: float = DEFAULT_HOLD_S, timeout_s: float = DEFAULT_RELAY_TIMEOUT_S,
                 max_payload_bytes: int = MAX_RELAYED_PAYLOAD_BYTES,
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
        self.clock = clock
        self.hold_s = hold_s
        # The most bytes a peer's PayloadOpen may declare: the largest commit the run's model can make.
        self.max_payload_bytes = max_payload_bytes
        self.chunk_bytes = stream_chunk_bytes()
        self.spool = SpoolDirectory(spool_dir)
        self.store = HeldPayloads(from_log)
        self._from_log = from_log
        self.relay = PayloadRelay(node_id, self.store, timeout_s=timeout_s)
        self.follower = self.relay.follower
        self._digests: OrderedDict[tuple[int, int], tuple[bytes, int]] = OrderedDict()  # (index, epoch) -> digest, size
        self._queues: dict[str, _PushQueue] = {}
        self._held_for: dict[bytes, asyncio.Event] = {}  # digests held appends wait for, set on Release
        self._wakes: dict[bytes, Timer] = {}  # the follower's pending WakeAt, by digest
        # What this node did (/status "relays", /metrics diloco_relay_*): copies pushed as the root,
        # copies forwarded as a relay, fetch answers served, fetches sent, streams refused; and the
        # payload bytes of copies pushed and forwarded (served answers count as forwarded bytes).
        self.counts = {"pushed": 0, "forwarded": 0, "served": 0, "fetched": 0, "refused": 0,
                       "promised": 0, "pushed_bytes": 0, "forwarded_bytes": 0}

    def status(self) -> dict[str, Any]:
        """The relay part of /status: the counters, what is held now, the plane's latest decisions."""
        return {**self.counts, "fanout": self.fanout, "held": len(self.store), "spooled": self.store.spooled,
                "held_bytes": self.store.held_bytes, "max_payload_bytes": self.max_payload_bytes,
                "decisions": self.follower.recent(self.clock.monotonic())[:STATUS_DECISIONS]}

    @property
    def spool_dir(self) -> Path:
        return self.spool.path

    def close(self) -> None:
        """The node stops: delete what the spool holds (the log has what it needs), stop the wakes."""
        for timer in self._wakes.values():
            timer.cancel()
        self._wakes.clear()
        self.store.clear()
        self.spool.close()

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
        """BLAKE3 digest and size of an entry's payload, computed once per (index, epoch) (an entry never
        changes), read a piece at a time; `prepare` computes them off the event loop beforehand."""
        key = (entry.index, entry.epoch)
        known = self._digests.get(key)
        if known is None:
            known = self._remember(key, hash_payload(entry.payload))
        return known

    def _remember(self, key: tuple[int, int], digest: tuple[bytes, int]) -> tuple[bytes, int]:
        self._digests[key] = digest
        while len(self._digests) > MAX_KNOWN_DIGESTS:
            self._digests.popitem(last=False)
        return digest

    async def prepare(self, entries: Sequence[LogEntry]) -> None:
        """Hash, in a worker thread, the payloads of `entries` that will go by digest and were not
        hashed yet (a commit of a large model is a second or more of hashing: not on the event loop)."""
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

    def open_stream(self, head: wire.PayloadOpen, sender: str) -> PayloadReceiver:
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
        stream = object()  # this stream, to the follower (which counts its progress)

        def ended(refused: bool) -> None:
            self.counts["refused"] += refused
            self.follower.on_stream_end(head.digest, stream, self.clock.monotonic())

        return PayloadReceiver(assembler, sender, self.spool.new_file(head.digest),
                               progress=lambda received: self.follower.on_stream(head.digest, stream, received),
                               accept=lambda payload: self.accept(head, payload, sender), ended=ended)

    def accept(self, head: wire.PayloadOpen | wire.PayloadPush, payload: Payload, sender: str) -> None:
        """Verified bytes from `sender`: kept, passed on down the tree they came with, promised askers
        served, held appends released."""
        tree = tree_from_wire(head)
        if tree is not None and tree.root == self.node_id:
            tree = None  # our own payload pushed back to us: keep, never forward
        actions = self.relay.on_verified(PayloadHop(head.digest, payload, tree), self.clock.monotonic())
        if isinstance(payload, SpooledPayload) and self.store.held(head.digest) is not payload:
            payload.delete()  # already had it (or it was dropped at once by the bounds)
        self._perform(actions)

    def on_push(self, push: wire.PayloadPush, sender: str) -> None:
        """A 2.2 single-frame push: kept and forwarded if its digest is `push.digest`, else refused (400)."""
        if payload_digest(push.payload) != push.digest:
            self.counts["refused"] += 1
            self.relay.refused += 1
            raise RemoteProtocolError(f"PayloadPush from {sender}: the bytes do not have BLAKE3 digest "
                                      f"{push.digest.hex()[:16]}..; nothing kept", 400)
        self.accept(push, push.payload, sender)

    def on_fetch(self, fetch: wire.PayloadFetch, requester: str) -> None:
        """Answered at once as the plane decides: the bytes stream to `requester` now (served) or when
        they arrive here (promised); declined, 404."""
        actions = self.follower.on_fetch(requester, fetch.digest, self.clock.monotonic())
        self._perform(actions)
        for action in actions:
            if isinstance(action, Decline):
                raise RemoteProtocolError(f"{self.node_id} holds no payload {fetch.digest.hex()[:16]}..: "
                                          f"{action.reason}", 404)

    # ------------------------------------------------------------------ as follower

    async def complete(self, message: wire.LogAppend) -> tuple[wire.LogAppend, dict[int, StoredPayload | bytes]]:
        """The longest prefix of a relayed append whose bytes are here after at most hold_s.

        Returns the prefix with each relayed entry's bytes left out (an empty payload) and the
        payloads by entry index: a spooled one as a `StoredPayload` the log store copies into
        log.bin piece by piece, so the bytes never sit in memory whole.
        """
        wanted = {e.payload_digest: (e.index <= message.leader_commit, e.payload_size) for e in message.entries
                  if e.relayed and e.payload_digest not in self.store}
        if wanted:
            now = self.clock.monotonic()
            events = []
            for digest, (committed, size) in wanted.items():
                event = self._held_for.setdefault(digest, asyncio.Event())
                self._perform(self.follower.want(digest, message.leader, now, catching_up=committed, size=size))
                if digest not in self.follower.wants:  # nothing to wait for after all
                    self._release(digest)
                events.append(event)
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
                payload = self.store.get(entry.payload_digest)
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
        """After the core took `message`: bytes of relayed entries now in the log are served from
        there, and count as arrived (promised askers served from the log, waiters released)."""
        now = self.clock.monotonic()
        for entry in message.entries:
            if entry.relayed and self.store.settle(entry.payload_digest, entry.index, entry.epoch):
                self._perform(self.follower.on_arrival(entry.payload_digest, now))

    # ------------------------------------------------------------------ the plane's actions performed

    def _perform(self, actions: Sequence[Any], *, as_root: bool = False) -> None:
        for action in actions:
            if isinstance(action, SendPayload):
                self.counts["pushed" if as_root else "forwarded"] += 1
                self._enqueue(action.to, action.hop)
            elif isinstance(action, Serve):
                payload = self.store.get(action.digest)
                if payload is not None:
                    self.counts["served"] += 1
                    self._enqueue(action.to, PayloadHop(action.digest, payload, None))
            elif isinstance(action, Fetch):
                self.tasks.spawn(self._fetch(action.to, action.digest), name=f"relay-fetch-from-{action.to}")
            elif isinstance(action, WakeAt):
                self._wake_at(action.at, action.digest)
            elif isinstance(action, Release):
                self._release(action.digest)
            elif isinstance(action, Promise):
                self.counts["promised"] += 1
            # Decline: on_fetch answers 404.

    def _wake_at(self, at: float, digest: bytes) -> None:
        earlier = self._wakes.pop(digest, None)
        if earlier is not None:
            earlier.cancel()
        self._wakes[digest] = self.clock.call_at(at, lambda: self._wake(digest))

    def _wake(self, digest: bytes) -> None:
        self._wakes.pop(digest, None)
        self._perform(self.follower.on_wake(digest, self.clock.monotonic()))

    def _release(self, digest: bytes) -> None:
        """The held appends waiting for `digest` stop waiting (here now, or given up)."""
        event = self._held_for.pop(digest, None)
        if event is not None:
            event.set()
        timer = self._wakes.pop(digest, None)
        if timer is not None:
            timer.cancel()

    async def _fetch(self, source: str, digest: bytes) -> None:
        """One PayloadFetch; what became of it goes back to the follower (which frees the source for
        the next fetch queued for it)."""
        url = self.url_of(source)
        if url is None:
            answer = FetchAnswer.UNREACHABLE  # no address known (yet)
        else:
            self.counts["fetched"] += 1
            try:
                replies = await self.client.send(url, wire.PayloadFetch(digest), peer=source,
                                                 deadline_s=TRANSFER_DEADLINE_S)
            except PeerRefused as error:
                log.debug("payload fetch from %s: %s", source, error)
                answer = FetchAnswer.DECLINED
            except PeerUnreachable as error:
                log.debug("payload fetch from %s: %s", source, error)
                answer = FetchAnswer.UNREACHABLE
            else:
                answer = FetchAnswer.ACCEPTED
                # Wire 2.3: no reply, the bytes stream back (open_stream). A 2.2 source answers with them.
                for reply in replies:
                    if isinstance(reply, wire.PayloadPush) and reply.digest == digest and not reply.root:
                        try:
                            self.on_push(reply, source)
                        except RemoteProtocolError as error:
                            log.warning("%s", error)
        self._perform(self.follower.on_fetch_answer(source, digest, answer, self.clock.monotonic()))

    # ------------------------------------------------------------------ pushes out

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
        await self.client.send_sequence(url, payload_frames(head, hop.payload), peer=peer,
                                        deadline_s=TRANSFER_DEADLINE_S + size / SLOWEST_LINK_BYTES_PER_S)
        self.counts["pushed_bytes" if tree is not None and tree.root == self.node_id else "forwarded_bytes"] += size
