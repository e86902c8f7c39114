"""The coordination core's I/O: persist, then send; one outbox per peer; replies and peer requests in.

`CoordinatorNode` (bootstrap/) is sans-IO: it takes messages and `now` and returns actions. This
module is the only place that performs them: after every call into the core the durable state is
synced to disk *before* any resulting message leaves (coordination_store.py); `Send` actions go to a
per-peer outbox drained by one worker task; `ApplyEntry` and `RestoreSnapshot` go to the state
keeper (state_transfer.py). It also answers the coordination part of the peer API (votes,
appends, heartbeats, leaves, joins, relayed payloads), drives the core's timer, and carries out an
operator's eviction as the lease holder (`evict`; the register is sync/evictions.py). Nothing is
sent to an evicted site.

When the disk refuses a write (full, failing), nothing that depends on it leaves: no reply (a peer
gets 503 "cannot persist"), no message, no applied entry (held until a sync succeeds); a lease
holder steps down; the ticker keeps running and retries with backoff on the clock, so the node
recovers on its own once writes succeed again. After its log was found damaged at rest
(coordination_store.py) the node does not stand, and votes only for a candidate whose log is at
least as up to date as its vote floor (the newest entry its log held: the core's `vote_floor`),
until its own log is back there; with no floor known (a floor file lost too) it does not vote at
all until a lease holder has given it back every entry it may have acknowledged.

Relayed commits (relays.py): with `relay_fanout` > 0 this node, as lease holder, sends appends
with payloads by digest and the bytes down a relay tree; with 0, only payloads over
`relays.INLINE_PAYLOAD_MAX_BYTES`, their bytes streamed to every member directly (a star). Every
node answers relayed appends, streamed payloads and fetches whatever its own setting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.election import Role
from bootstrap.entries import EntryKind, LogEntry, PayloadUnavailable, Snapshot
from diloco_node.clock import Clock
from diloco_node.config.manifest import RunManifest
from diloco_node.daemon import peers
from diloco_node.daemon.coordination_store import CoordinationStore, CoordinationStoreError, PayloadDamaged
from diloco_node.daemon.history_hooks import DaemonHistory
from diloco_node.daemon.lost_entries import barrier_help
from diloco_node.daemon.plan import COORDINATION_DEADLINE_S, COORDINATION_TICK_S, relay_timeout_for
from diloco_node.daemon.relays import DEFAULT_HOLD_S, RelayIO, holder_tree
from diloco_node.daemon.tasks import TaskSet
from diloco_node.sync.evictions import EvictionError, EvictionRecord, encode_payload
from diloco_node.transport import PeerClient, PeerRefused, PeerUnreachable
from wire import messages as wire
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.limits import MAX_RELAYED_PAYLOAD_BYTES

log = logging.getLogger("diloco_node.daemon")

# While the coordination state cannot be persisted the ticker retries after one tick, doubling up
# to this: a full disk is retried often enough to recover within a second or two of space coming
# back, without a failing write every tick.
STORAGE_RETRY_MAX_S = 2.0


@dataclass(slots=True)
class _Outbox:
    pending: list[Any] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    payload_unreadable: bool = False  # the last delivery failed reading a payload back


class CoordinationIO:
    """Wires one `CoordinatorNode` to the disk, the peers and the clock."""

    def __init__(self, *, core: CoordinatorNode, persistent: PersistentState, store: CoordinationStore,
                 history: DaemonHistory, client: PeerClient, addresses: peers.AddressBook, clock: Clock,
                 tasks: TaskSet, on_apply: Callable[[LogEntry], None],
                 on_restore_snapshot: Callable[[Snapshot], None], after_step: Callable[[], None],
                 remember_member: Callable[[str, str, str], None], report_error: Callable[[str], None],
                 relay_fanout: int = 0, relay_hold_s: float = DEFAULT_HOLD_S,
                 relay_timeout_s: float = relay_timeout_for(DEFAULT_HOLD_S),
                 relay_max_payload_bytes: int = MAX_RELAYED_PAYLOAD_BYTES, relay_spool_dir: Path | None = None,
                 tick_s: float = COORDINATION_TICK_S, deadline_s: float = COORDINATION_DEADLINE_S) -> None:
        """The timings come from the daemon's plan (plan.py): `tick_s` the core's timer,
        `deadline_s` each coordination message, `relay_hold_s` and `relay_timeout_s` relayed appends."""
        self.core = core
        self.node_id = core.node_id
        self.persistent = persistent
        self.store = store
        self.history = history
        self.client = client
        self.addresses = addresses
        self.clock = clock
        self.tasks = tasks
        self.on_apply = on_apply
        self.on_restore_snapshot = on_restore_snapshot
        self.after_step = after_step  # after every step of the core (the round driver's lease check)
        self.remember_member = remember_member  # (node id, url, role): learn and persist an address
        self.report_error = report_error
        self.tick_s = tick_s
        self.deadline_s = deadline_s
        self.frozen = False  # set while stopping: no message is handled, no entry applied
        self.leader_commit = 0  # highest commit index a lease holder told us
        self.last_ok: dict[str, float] = {}  # peer -> last successful exchange (monotonic)
        self._outboxes: dict[str, _Outbox] = {}
        # Persisting: the last failure (None while writes succeed), the ticker's retry interval,
        # and the applies / snapshot restores computed meanwhile, performed after the next sync.
        self.storage_error: str | None = None
        self._storage_retry_s = tick_s
        self._held: list[coord.Action] = []
        # Why this node does not stand, nor vote freely, yet: its log was damaged at rest and lost
        # entries after `store.damaged_after` that it may have acknowledged (None: it votes). With a
        # floor known, the core votes above it (`_narrow`); without, no vote at all.
        self.vote_barrier: str | None = None
        # The last repair of log.bin while running (`repair_damaged_log`), for /status; None: none.
        self.log_repair: dict[str, Any] | None = None
        self._repair_failing = False
        floor = store.floor.loaded if store.damaged_after is not None else None
        self._narrow = floor is not None
        if floor is not None:
            core.election.vote_floor = floor
            core.election.lift_vote_floor(core.log.last_log)
            self.vote_barrier = (f"{store.damage_reason}: it lost the entries after {store.damaged_after}; it votes "
                                 f"only for a candidate whose log is at least as up to date as (epoch {floor[0]}, "
                                 f"index {floor[1]}), the newest its log held, and does not stand, until its log "
                                 "is back there")
        elif store.damaged_after is not None:
            self.vote_barrier = (f"{store.damage_reason}: no vote until a lease holder has given back the entries "
                                 f"after {store.damaged_after} (no vote floor known)")
        if self.vote_barrier is not None:
            log.warning("%s: %s", self.node_id, self.vote_barrier)
            advice = barrier_help(self.node_id, core.log.config.voters, store.damaged_after, self.vote_barrier)
            if advice is not None and advice["lone_voter"]:  # no one else can end it: say what can
                log.warning("%s: %s", self.node_id, advice["what_to_do"])
        # Relayed payloads: as holder only when relay_fanout > 0; as follower and relay always.
        self.relays = RelayIO(node_id=self.node_id, fanout=relay_fanout, client=client, url_of=self.url_of,
                              from_log=self._log_payload, tasks=tasks, clock=clock,
                              spool_dir=relay_spool_dir, hold_s=relay_hold_s,
                              timeout_s=relay_timeout_s, max_payload_bytes=relay_max_payload_bytes)

    def url_of(self, peer: str) -> str | None:
        url = self.addresses.url(peer)
        if url is None:
            record = self.core.membership.record(peer)
            url = record.address if record is not None and record.address else None
        return url

    def _log_payload(self, index: int, epoch: int) -> Any:
        """Entry (index, epoch)'s payload as the log keeps it (bytes, or a reference into log.bin:
        nothing read), or None when the log no longer holds it (a reader of a reference whose record
        was compacted or damaged since gets PayloadUnavailable; a fetcher then asks another source)."""
        entry = self.core.log.entry_at(index)
        if entry is None or entry.epoch != epoch:
            return None
        return entry.payload

    # ------------------------------------------------------------------ core steps

    async def ticker(self) -> None:
        """The core's timer, for the life of the node: a step that fails (the disk refuses the
        state) is retried with backoff instead of ending the task."""
        failed_step = False
        while True:
            try:
                self.repair_damaged_log()
                self.dispatch(self.core.tick(self.clock.monotonic()))
                self.after_step()
                failed_step = False
            except Exception as error:  # never die: a node without its ticker never recovers
                if not failed_step:
                    log.exception("%s: coordination step failed; retrying", self.node_id)
                    self.report_error(f"coordination step failed: {type(error).__name__}: {error}")
                failed_step = True
            if self.storage_error is None and not failed_step:
                self._storage_retry_s = self.tick_s
                await self.clock.sleep(self.tick_s)
            else:
                await self.clock.sleep(self._storage_retry_s)
                self._storage_retry_s = min(self._storage_retry_s * 2, max(STORAGE_RETRY_MAX_S, self.tick_s))

    def repair_damaged_log(self) -> None:
        """A record of log.bin failed its check while running (read for a send, an apply, a
        compaction): the file is quarantined and its good prefix kept, the entries after it leave
        the log in memory (the applied state keeps them, nothing is applied twice), and the lease
        holder sends them again, as after a restart. Meanwhile the node does not lead or stand, and
        votes only above its vote floor (with none known, not at all)."""
        if self.store.damage_found is None:
            return
        held = self.core.log.last_log
        try:
            last = self.store.repair_damage()
        except (OSError, CoordinationStoreError) as error:  # an OSError: the next tick tries again
            if not isinstance(error, OSError):
                self.store.damage_found = None  # (a damaged header: the next start refuses and says so)
            if not self._repair_failing:  # one warning per failure streak, not one per tick
                log.warning("%s cannot repair its damaged log.bin now: %s", self.node_id, error)
                self.report_error(f"cannot repair the damaged log.bin: {error}")
            self._repair_failing = True
            return
        self._repair_failing = False
        if last is None:
            return
        floor = self.store.floor.value
        dropped = self.core.lose_entries(last + 1, self.clock.monotonic(), floor)
        self._narrow = floor is not None
        self.vote_barrier = (f"{self.store.damage_reason}, found while running: it lost the entries after {last}; "
                             + (f"it votes only for a candidate whose log is at least as up to date as (epoch "
                                f"{floor[0]}, index {floor[1]}), the newest its log held, and does not stand, until "
                                "its log is back there" if floor is not None else "no vote until a lease holder has "
                                "given them back (no vote floor known)"))
        self.log_repair = {"lost_after": last, "dropped": dropped, "held": list(held), "refilled": False,
                           "reason": self.store.damage_reason}
        log.warning("%s: log repaired while running: %d entries after %d dropped, fetched again from the lease "
                    "holder; %s", self.node_id, dropped, last, self.vote_barrier)
        self.report_error(f"log.bin damaged while running; entries after {last} fetched again")

    def handle(self, message: coord.Message) -> list[coord.Action]:
        return self.core.handle(message, self.clock.monotonic())

    def dispatch(self, actions: list[coord.Action], *, reply_to: str | None = None,
                 reply_type: type | None = None) -> coord.Message | None:
        """Persist, then perform actions; returns (not sends) the reply to `reply_to` if asked for one.

        When the state cannot be persisted nothing is performed: messages are dropped (the core
        sends again), applies held for the next successful sync, and a request with a reply gets
        503 (RemoteProtocolError): no acknowledgement of anything the disk does not hold."""
        try:
            self.store.sync(self.persistent)
        except Exception as error:
            # Whatever the failure, the applies the core handed over are held, never dropped: the
            # core counts them applied, so a lost one would leave the replica without that entry.
            self._persist_failed(error, actions)
            if not isinstance(error, (OSError, CoordinationStoreError)):
                raise
            if reply_to is not None:
                raise RemoteProtocolError(f"{self.node_id} cannot persist its coordination state ({error}); "
                                          "nothing is acknowledged until it can", 503) from None
            return None
        self._persisted()
        self.history.observe(self.core)  # after the sync: the history never claims more than the disk
        reply = None
        if self.frozen:
            return None
        if self._held:
            actions, self._held = [*self._held, *actions], []
        for action in actions:
            if isinstance(action, coord.Send):
                if (reply_to is not None and reply is None and action.to == reply_to
                        and reply_type is not None and isinstance(action.message, reply_type)):
                    reply = action.message
                else:
                    self.send(action.to, action.message)
            elif isinstance(action, coord.ApplyEntry):
                self.on_apply(action.entry)
            elif isinstance(action, coord.RestoreSnapshot):
                self.on_restore_snapshot(action.snapshot)
        return reply

    def _persist_failed(self, error: Exception, actions: list[coord.Action]) -> None:
        """The disk refused the state: hold what must still happen, step down, say so once."""
        self._held.extend(a for a in actions if isinstance(a, (coord.ApplyEntry, coord.RestoreSnapshot)))
        first = self.storage_error is None
        self.storage_error = f"{type(error).__name__}: {error}"
        if self.core.role is Role.LEADER:
            # A holder that cannot persist its log cannot replicate it (nothing leaves before the
            # sync): it gives the lease up now rather than let it run out while rounds wait on it.
            self.core.election.step_down(self.clock.monotonic(), f"cannot persist the log: {self.storage_error}")
            log.warning("%s steps down from the lease: cannot persist its log (%s)", self.node_id, error)
        if first:  # one warning per failure streak, not one per tick
            log.warning("%s cannot persist its coordination state (%s): nothing is acknowledged or sent until a "
                        "write succeeds; retrying", self.node_id, error)
            self.report_error(f"cannot persist the coordination state: {self.storage_error}")

    def _persisted(self) -> None:
        if self.storage_error is not None:
            log.warning("%s persists its coordination state again (after: %s)", self.node_id, self.storage_error)
            self.storage_error = None
            self._storage_retry_s = self.tick_s
        if self.vote_barrier is not None:
            self._check_vote_barrier()

    def _check_vote_barrier(self) -> None:
        """Lift the barrier once this log is as up to date as its floor (the core lifted it), or,
        with no floor known, once a lease holder of the current epoch has committed one of its own
        entries past the damage and this log holds it: the holder's log holds every entry committed
        before its epoch's first (Raft's leader completeness), so ours now does too."""
        replog, election = self.core.log, self.core.election
        if self._narrow:
            if election.vote_floor is None:
                log.warning("%s votes again (and may stand): its log is back to (epoch %d, index %d), its vote floor",
                            self.node_id, *replog.last_log)
                self._barrier_lifted()
            return
        floor = self.store.damaged_after or 0
        commit = replog.commit_index
        if (election.leader_id not in (None, self.node_id) and commit > floor and commit <= replog.last_index
                and replog.epoch_at(commit) == self.core.epoch):
            log.warning("%s votes again: its log holds the entries through %d from lease holder %s", self.node_id,
                        commit, election.leader_id)
            self._barrier_lifted()

    def _barrier_lifted(self) -> None:
        self.vote_barrier = None
        self.store.damaged_after = None
        if self.log_repair is not None:
            self.log_repair["refilled"] = True

    def dispatch_dropping_replies(self, actions: list[coord.Action]) -> None:
        self.dispatch([a for a in actions if not (isinstance(a, coord.Send) and isinstance(a.message, coord.PingAck))])

    # ------------------------------------------------------------------ messages out

    def send(self, to: str, message: coord.Message) -> None:
        if to == self.node_id or self.core.is_evicted(to):
            return
        if self.vote_barrier is not None and not self._narrow and isinstance(message, coord.VoteRequest):
            return  # it does not stand either: its own vote would be one it may not give
        outbox = self._outboxes.get(to)
        if outbox is None:
            outbox = self._outboxes[to] = _Outbox()
            self.tasks.spawn(self._peer_worker(to, outbox), name=f"outbox-{to}")
        if isinstance(message, (coord.AppendEntries, coord.InstallSnapshot)):
            # A newer replication message supersedes a queued older one (same leader state, later).
            outbox.pending = [m for m in outbox.pending
                              if not isinstance(m, (coord.AppendEntries, coord.InstallSnapshot))]
        outbox.pending.append(message)
        outbox.wake.set()

    async def _peer_worker(self, peer: str, outbox: _Outbox) -> None:
        while True:
            await outbox.wake.wait()
            outbox.wake.clear()
            batch, outbox.pending = outbox.pending, []
            for message in batch:
                try:
                    await self._deliver(peer, message)
                    outbox.payload_unreadable = False
                except asyncio.CancelledError:
                    raise
                except PayloadUnavailable as error:
                    # log.bin could not give an entry's bytes back (a failing read, a damaged
                    # record: `log.read` on /status); the core sends again. Said once per streak.
                    if not outbox.payload_unreadable:
                        log.warning("%s: cannot send %s to %s: %s", self.node_id, type(message).__name__, peer, error)
                    outbox.payload_unreadable = True
                    if isinstance(error, PayloadDamaged) and self.core.role is Role.LEADER:
                        # Its copy of a committed entry is damaged: a holder that cannot replicate
                        # it would stall every follower behind it; another voter has a good copy.
                        self.core.election.step_down(self.clock.monotonic(), f"its log is damaged: {error}")
                        log.warning("%s steps down from the lease: %s", self.node_id, error)
                except Exception as error:  # one bad exchange must not stop the worker
                    log.exception("delivery of %s to %s failed: %s", type(message).__name__, peer, error)

    async def _deliver(self, peer: str, message: coord.Message) -> None:
        url = self.url_of(peer)
        if url is None:
            return  # learned from a configuration entry before its address: the member refresh fixes it
        if isinstance(message, coord.AppendEntries) and message.epoch == self.core.epoch:
            # Queued behind the previous append to this peer, whose acknowledgement may have
            # covered these entries meanwhile: sent as built, a heartbeat queued during a large
            # append would carry its inline payloads a second time.
            message = self.core.log.without_acknowledged(message, peer)
        relayed = isinstance(message, coord.AppendEntries) and bool(self.relays.relayed_entries(message.entries))
        if relayed:
            # New payloads are hashed off the event loop (a large commit takes a second or more),
            # before the lease check below: the message leaves only if the lease outlived it.
            await self.relays.prepare(message.entries)  # type: ignore[union-attr]  # (an AppendEntries)
        if (isinstance(message, (coord.AppendEntries, coord.InstallSnapshot))
                and not (message.epoch == self.core.epoch
                         and self.core.election.may_act_as_leader(self.clock.monotonic()))):
            # Queued while we led, but our lease ran out before it could leave (the process was
            # paused, or the link stalled): a follower would take it as the holder being alive and
            # refuse every candidate for another lease time. Dropping a message is always safe.
            return
        out: wire.Message | None
        if relayed:
            # Metadata to every follower as before; the bytes once per entry down the relay tree
            # (relays off: the big ones only, streamed to every follower by the holder itself).
            out = self.relays.relayed_append(message, holder_tree(self.core, self.relays.fanout),
                                             leader_commit=message.leader_commit)
        else:
            out = peers.to_wire(message, epoch=self.core.epoch, commit_index=self.core.log.commit_index,
                                last_index=self.core.log.last_index)
        if out is None:
            return
        try:
            replies = await self.client.send(url, out, peer=peer, deadline_s=self.deadline_s)
        except PeerRefused as error:
            if error.status not in (503,):
                self.report_error(f"{peer} refused {type(out).__name__}: {error.status} {error.reason}")
            return
        except PeerUnreachable:
            return
        self.last_ok[peer] = self.clock.monotonic()
        for reply in replies:
            self._on_reply(peer, message, reply)

    def _on_reply(self, peer: str, request: coord.Message, reply: wire.Message) -> None:
        try:
            if isinstance(reply, wire.VoteReply) and reply.voter == peer:
                self.dispatch(self.handle(peers.vote_response_from_wire(reply)))
            elif (isinstance(reply, wire.LogAck) and reply.follower == peer
                  and isinstance(request, (coord.AppendEntries, coord.InstallSnapshot))):
                self.dispatch(self.handle(peers.append_response_from_wire(reply, request.sent_at)))
            elif isinstance(reply, wire.HeartbeatAck) and reply.follower == peer and isinstance(request, coord.Ping):
                self.revive(peer)
                self.dispatch(self.handle(coord.PingAck(request.seq, peer, peer, ())))
            else:
                self.report_error(f"unexpected {type(reply).__name__} from {peer} in answer to {type(request).__name__}")
        except (RemoteProtocolError, LocalProtocolError) as error:
            self.report_error(f"bad reply from {peer}: {error}")
        self.after_step()

    def revive(self, peer: str, role: coord.MemberRole | None = None, *, even_if_left: bool = False) -> None:
        current = self.core.membership.record(peer)
        if current is not None and current.state is coord.MemberState.LEFT and not even_if_left:
            return
        url = self.addresses.url(peer) or (current.address if current else "")
        role = role or (current.role if current else coord.MemberRole.LEARNER)
        record = peers.revived_record(current, peer, url, role)
        if record is not None:
            self.dispatch_dropping_replies(self.handle(coord.Ping(0, peer, (record,))))

    # ------------------------------------------------------------------ peer requests in

    def check_open(self) -> None:
        if self.frozen:
            raise RemoteProtocolError(f"{self.node_id} is stopping", 503)

    def same_sender(self, claimed: str, peer: Any, what: str) -> None:
        """A message names its sender; it must be the member whose key signed the frame."""
        if claimed != peer.node_id:
            raise RemoteProtocolError(f"{what} names {claimed!r} but is signed by {peer.node_id!r}", 400)
        self.last_ok[peer.node_id] = self.clock.monotonic()

    async def on_vote_request(self, message: wire.VoteRequest, peer: Any) -> wire.Message | None:
        self.check_open()
        self.same_sender(message.candidate, peer, "VoteRequest")
        if self.vote_barrier is not None and not self._narrow:  # (with a floor, the core decides)
            raise RemoteProtocolError(f"{self.node_id} does not vote yet: {self.vote_barrier}", 503)
        reply = self.dispatch(self.handle(peers.vote_request_from_wire(message)), reply_to=peer.node_id,
                              reply_type=coord.VoteResponse)
        self.after_step()
        return peers.to_wire(reply, epoch=0, commit_index=0, last_index=0) if reply is not None else None

    async def on_log_append(self, message: wire.LogAppend, peer: Any) -> wire.Message | None:
        self.check_open()
        self.same_sender(message.leader, peer, "LogAppend")
        relayed = message if any(entry.relayed for entry in message.entries) else None
        payloads: dict[int, Any] = {}
        if relayed is not None:
            # Held until the bytes come down the tree (at most the hold time), then the prefix
            # whose bytes are here is taken: possibly none, which is a heartbeat.
            message, payloads = await self.relays.complete(relayed)
            self.check_open()
        try:
            append = peers.append_from_wire(message)
            if payloads and isinstance(append, coord.AppendEntries):
                # Spooled bytes go to log.bin from their file, piece by piece (coordination_store.py).
                append = replace(append, entries=tuple(
                    replace(entry, payload=payloads[entry.index]) if entry.index in payloads else entry
                    for entry in append.entries))
            actions = self.handle(append)
        except LocalProtocolError as error:
            # The core refuses what cannot happen between honest members (a second leader in the
            # epoch we lead): the peer's violation, answered 409 with the reason, not a 500.
            raise RemoteProtocolError(f"LogAppend from {peer.node_id} refused: {error}", 409) from None
        self.leader_commit = max(self.leader_commit, message.leader_commit)
        reply = self.dispatch(actions, reply_to=peer.node_id, reply_type=coord.AppendResponse)
        if relayed is not None:
            self.relays.settle(relayed)  # the entries it names that are now in the log
        self.after_step()
        if reply is None:
            return None
        return peers.to_wire(reply, epoch=self.core.epoch, commit_index=0, last_index=0)

    async def on_payload_push(self, message: wire.PayloadPush, peer: Any) -> None:
        """Relayed payload bytes: kept and passed on when their SHA-256 matches (relays.py)."""
        self.check_open()
        self._refuse_evicted(peer.node_id, "PayloadPush")
        self.relays.on_push(message, peer.node_id)

    async def on_payload_fetch(self, message: wire.PayloadFetch, peer: Any) -> None:
        """Answered at once (or 404); the bytes stream back to the asker (relays.py)."""
        self.check_open()
        self._refuse_evicted(peer.node_id, "PayloadFetch")
        self.relays.on_fetch(message, peer.node_id)

    async def open_payload_stream(self, head: wire.PayloadOpen, peer: Any) -> Any:
        """A streamed relayed payload begins: its receiver spools, hashes and checks it (relays.py)."""
        self.check_open()
        self._refuse_evicted(peer.node_id, "PayloadOpen")
        return self.relays.open_stream(head, peer.node_id)

    def _refuse_evicted(self, node_id: str, what: str) -> None:
        if self.core.is_evicted(node_id):
            raise RemoteProtocolError(f"{what} from {node_id}: evicted from this run", 403)

    async def on_heartbeat(self, message: wire.Heartbeat, peer: Any) -> wire.Message | None:
        self.check_open()
        self.same_sender(message.leader, peer, "Heartbeat")
        self.revive(peer.node_id)
        reply = self.dispatch(self.handle(coord.Ping(message.seq, peer.node_id, ())), reply_to=peer.node_id,
                              reply_type=coord.PingAck)
        if reply is None:
            return None
        return peers.to_wire(reply, epoch=self.core.epoch, commit_index=self.core.log.commit_index,
                                  last_index=self.core.log.last_index)

    async def on_leave(self, message: wire.Leave, peer: Any) -> None:
        self.check_open()
        self.same_sender(message.node_id, peer, "Leave")
        record = peers.left_record(self.core.membership.record(peer.node_id))
        if record is not None:
            self.dispatch_dropping_replies(self.handle(coord.Ping(0, peer.node_id, (record,))))
        log.info("%s leaves: %s", peer.node_id, message.reason)
        return None

    async def on_join_request(self, message: wire.JoinRequest, peer: Any, manifest: RunManifest) -> wire.Message:
        """A site announces itself: admitted (revived as a member) when its manifest is ours; either
        way it gets the membership and our manifest, so a joiner can see what it contradicts."""
        self.check_open()
        self.same_sender(message.node_id, peer, "JoinRequest")
        if message.manifest_digest == manifest.digest_bytes():
            self.remember_member(message.node_id, message.advertise_url, message.role.value)
            self.addresses.learn_status_url(message.node_id, message.status_url)
            self.revive(message.node_id, peers.role_from_wire(message.role), even_if_left=True)
            log.info("%s admitted %s (%s, %s)", self.node_id, message.node_id, message.role.value,
                     message.advertise_url)
        voters = self.core.log.config.voters
        members = tuple(wire.Member(node_id, url, wire.Role(self.addresses.role(node_id) or "learner"),
                                    node_id in voters, status_url=self.addresses.status_url(node_id))
                        for node_id, url in self.addresses.items()
                        if not self.core.is_evicted(node_id))  # a joiner never contacts an evicted site
        return wire.Membership(self.core.epoch, self.core.log.latest_config_index(), members,
                               manifest.canonical_bytes())

    # ------------------------------------------------------------------ evicting (operator)

    async def evict(self, node_id: str, reason: str, fingerprints: list[str],
                    evicted: Callable[[str], EvictionRecord | None], wait_s: float) -> tuple[int, dict[str, Any]]:
        """An operator evicts `node_id` for this run: as the lease holder, append the EVICTION entry
        and wait up to `wait_s` for it to apply here. Returns (HTTP status, JSON body).

        200: evicted (now, or already); 202: appended, not applied yet; 400: a bad request;
        404: no such member; 409: not the lease holder (the body names it), or the holder cannot
        append now. A refusal changes nothing.
        """
        core = self.core
        if node_id == self.node_id:
            return 400, {"error": f"{self.node_id} cannot evict itself: ask another member's operator listener"}
        already = evicted(node_id)
        if already is not None:
            return 200, {"node_id": node_id, "index": already.index, "committed": True,
                         "message": already.refusal() + " (already)"}
        known = (node_id in core.log.config.voters or core.membership.record(node_id) is not None
                 or self.addresses.url(node_id) is not None)
        if not known:
            return 404, {"error": f"no member {node_id!r} in this run"}
        now = self.clock.monotonic()
        if not core.is_lease_holder(now):
            holder = core.election.leader_id
            return 409, {"error": f"{self.node_id} does not hold the lease: run `diloco-node evict` against "
                                  f"the lease holder's operator listener"
                                  + (f" ({holder})" if holder else " (none right now; try again shortly)"),
                         "lease_holder": holder, "lease_holder_url": self.addresses.url(holder) if holder else None}
        if self.storage_error is not None:
            return 409, {"error": f"{self.node_id} cannot persist its log now: {self.storage_error}"}
        try:
            payload = encode_payload(node_id, fingerprints, reason)
        except EvictionError as error:
            return 400, {"error": str(error)}
        entry, why, actions = core.propose(now, EntryKind.EVICTION, payload)
        if entry is None:
            return 409, {"error": f"cannot append the eviction: {why}"}
        self.dispatch(actions)
        log.warning("%s evicts %s at index %d: %s", self.node_id, node_id, entry.index, reason or "(no reason)")
        deadline = now + wait_s
        while evicted(node_id) is None and self.clock.monotonic() < deadline:
            await self.clock.sleep(self.tick_s)
        record = evicted(node_id)
        if record is None:
            return 202, {"node_id": node_id, "index": entry.index, "committed": False,
                         "message": f"eviction of {node_id} appended at index {entry.index}, not committed yet"}
        return 200, {"node_id": node_id, "index": record.index, "committed": True, "message": record.refusal()}

    # ------------------------------------------------------------------ leaving

    async def leave(self) -> None:
        """Ask the run to remove us (when others vote) and wait, bounded, for that to commit."""
        core = self.core
        if not set(core.log.config.voters) - {self.node_id}:
            return
        self.dispatch(core.leave(self.clock.monotonic()))
        deadline = self.clock.monotonic() + core.options.leave_timeout_s
        while not core.left and self.clock.monotonic() < deadline:
            await self.clock.sleep(self.tick_s)  # the ticker drives the leave to its commit
        log.info("%s: %s", self.node_id, core.last_membership_reason or "left")
        self.history.leave(core, core.last_membership_reason or "left")
