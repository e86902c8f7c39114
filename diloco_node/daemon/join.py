"""Joining a running run: the join handshake and the fragment-by-fragment state download.

Handshake (`request_membership`): a JoinRequest carrying the SHA-256 of the manifest we would
run. A bootstrap peer that is still starting (503) or unreachable is asked again, round-robin over
the bootstrap list with exponential backoff and jitter, until `JOIN_DEADLINE_S`; refusals that
asking again cannot change (wrong secret 401, other run 409, another wire major version 426,
contradicting settings) end at once. The peer answers a Membership with the run's manifest bytes; it admits us (adds us to its
member view, so the lease holder starts replicating to us) only when the digests agree. A
joiner whose own settings merely left keys at their defaults adopts the run's manifest and asks
again with the run's digest; one whose explicit settings contradict the run stops with the
difference spelled out (`config.check_joiner_manifest`), having changed nothing anywhere.

Download (`FragmentDownload`): each fragment's serialized state in chunks (SnapshotRequest /
SnapshotChunk), resumable from the byte offset reached, from any peer that serves it. Chunks name
the fragment by its state digest (wire 3.0): each comes in an authenticated frame, and its payload
is taken in the pieces it arrived in, each hashed for the frame's payload digest, then into the
state digest and copied into the fragment's arrays while it is in cache (never joined, read from
memory once); the decoded fragment's digest is checked against the one the chunks named, once,
before it is installed. Up to `DOWNLOAD_PEERS` peers serve
different fragments at once, and each keeps `CHUNKS_IN_FLIGHT` requests outstanding, so the
links' capacities add up and no link idles for a round trip between chunks. If the fragment moved on while we
were downloading (the digest or the size changed), the download restarts for that fragment. A download may
carry a floor (`min_commit_index`): fragments served as of an older log index are fetched again,
from another peer, until each is at least that new.

A snapshot install (peers.py: how `InstallSnapshot` crosses the wire) ends in this same download,
with the snapshot's index as the floor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from diloco_node.clock import Clock
from diloco_node.config.manifest import RunManifest
from diloco_node.config.settings import ConfigError, EffectiveConfig
from diloco_node.sync.global_state import CheckedFragment, GlobalStateError
from diloco_node.sync.replica import Replica
from diloco_node.sync.state_codec import FragmentAssembler, FragmentState, StateCodecError, fragment_shapes
from diloco_node.transport import PeerClient, PeerRefused, PeerUnreachable, StreamedReply, TransportError
from wire import messages as wire
from wire.errors import RemoteProtocolError
from wire.limits import MAX_CONCURRENT_STREAMS_PER_PEER

# Bytes per SnapshotChunk request: big enough that per-request overhead is noise, small enough
# that a dropped connection loses little (the download resumes at the offset reached).
SNAPSHOT_CHUNK_BYTES = 4 * 1024 * 1024
# Seconds one chunk may take; beyond this the chunk is retried from its offset on the next peer.
CHUNK_DEADLINE_S = 120.0
# Peers one download draws from at once, each serving different fragments: a joiner's downlink is
# usually wider than one peer's uplink, so three peers fill it (the target: 90 % of three
# 1 Gbit/s links). Each busy peer costs one fragment's buffer in memory.
DOWNLOAD_PEERS = 3
# Chunk requests a download keeps outstanding to one peer. With one, the link idles for a round
# trip after every chunk (4 MiB at 1 Gbit/s is 34 ms: a 20 ms RTT would waste a third of it).
CHUNKS_IN_FLIGHT = 3
# Chunk requests one download keeps outstanding to one peer, whichever fragments they are for: a
# server answers at most MAX_CONCURRENT_STREAMS_PER_PEER requests of ours at once (it holds a
# request's slot until its reply is written) and refuses more (429); one slot stays free for our
# other messages. Matters when fewer peers than DOWNLOAD_PEERS serve (M = 2: the holder alone).
CHUNK_REQUESTS_PER_PEER = MAX_CONCURRENT_STREAMS_PER_PEER - 1
# A peer whose copy of a fragment is older than the download's floor is asked again after this
# pause (round-robin over the peers): it is usually applying the very entries we need.
BEHIND_FLOOR_RETRY_S = 0.2
# A joiner keeps asking bootstrap peers that are starting (503) or unreachable for this long: sites
# of a new run are often started together, and a founder builds its model (seconds to minutes of
# JAX set-up) before it answers. Past it the joiner exits with every peer's last answer.
JOIN_DEADLINE_S = 300.0
# Backoff between rounds over the bootstrap list: doubles from the first to the last, with up to
# +-50 % jitter so sites started together do not ask in lock step.
JOIN_RETRY_FIRST_S = 0.5
JOIN_RETRY_MAX_S = 10.0
JOIN_RETRY_JITTER = 0.5
# One JoinRequest to one bootstrap peer gives up after this; the next round over the list retries.
MEMBERSHIP_DEADLINE_S = 10.0
# Statuses that mean "ask again later": still starting or stopping, or too busy.
TRANSIENT_STATUSES = frozenset({429, 503})

log = logging.getLogger("diloco_node.daemon")


class JoinRefused(Exception):
    """The run cannot be joined (wrong secret, contradicting manifest, no answer); says why.
    `permanent`: asking another bootstrap peer cannot help (our own settings or model differ).
    `transient`: the same peer may answer later (still starting, unreachable)."""

    def __init__(self, message: str, *, permanent: bool = False, transient: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.transient = transient


class _PeerBehind(Exception):
    """A peer's copy of a fragment is older than the download's floor: ask another peer."""


def parse_manifest(data: bytes) -> RunManifest:
    try:
        return RunManifest.from_dict(json.loads(data))
    except (ValueError, ConfigError) as error:
        raise RemoteProtocolError(f"the run's manifest is malformed: {error}", 400) from None


async def request_membership(client: PeerClient, url: str, request: wire.JoinRequest) -> wire.Membership:
    try:
        replies = await client.send(url, request, deadline_s=MEMBERSHIP_DEADLINE_S)
    except TransportError as error:
        transient = isinstance(error, PeerUnreachable) or (isinstance(error, PeerRefused)
                                                           and error.status in TRANSIENT_STATUSES)
        raise JoinRefused(f"join through {url} failed: {error}", transient=transient) from None
    for reply in replies:
        if isinstance(reply, wire.Membership):
            return reply
    raise JoinRefused(f"join through {url}: the peer sent no membership")


def join_backoff_s(attempt: int, rng: random.Random) -> float:
    """The pause before round `attempt` (1, 2, ...) over the bootstrap list, jittered."""
    base = min(JOIN_RETRY_MAX_S, JOIN_RETRY_FIRST_S * 2 ** (attempt - 1))
    return base * (1 + JOIN_RETRY_JITTER * (2 * rng.random() - 1))


async def negotiate(client: PeerClient, urls: Sequence[str], effective: EffectiveConfig, node_id: str,
                    advertise: str, role: wire.Role,
                    check_model: Callable[[RunManifest], Awaitable[None]] | None = None, *, clock: Clock,
                    deadline_s: float = JOIN_DEADLINE_S,
                    rng: random.Random | None = None, status_url: str = "") -> tuple[RunManifest, wire.Membership, str]:
    """Join through the first bootstrap peer that answers: (run manifest, membership, peer url).

    `check_model` (raising ConfigError) vets the run's model before we ask to be admitted, so a
    site whose model differs is refused having changed nothing anywhere. Peers that are starting
    or unreachable are asked again with backoff until `deadline_s` has passed. `status_url`: our
    operator URL, advertised with the request (the `status_url` key). The backoff sleeps on `clock`."""
    rng = rng or random.Random()
    give_up_at = clock.monotonic() + deadline_s
    attempt = 0
    while True:
        attempt += 1
        errors, transient = await _negotiate_once(client, urls, effective, node_id, advertise, role, check_model,
                                                  status_url)
        if isinstance(errors, tuple):
            return errors
        pause = join_backoff_s(attempt, rng)
        if not transient or clock.monotonic() + pause > give_up_at:
            # Every peer refused for good (permanent), or the deadline passed with peers that may
            # yet answer (transient: a restart asks again).
            raise JoinRefused("could not join through any bootstrap peer"
                              + (f" within {deadline_s:g} s" if transient else "") + ":\n  " + "\n  ".join(errors),
                              permanent=not transient, transient=transient)
        log.info("%s: no bootstrap peer could admit us yet (%s); asking again in %.1f s", node_id, errors[-1], pause)
        await clock.sleep(pause)


async def _negotiate_once(client: PeerClient, urls: Sequence[str], effective: EffectiveConfig, node_id: str,
                          advertise: str, role: wire.Role,
                          check_model: Callable[[RunManifest], Awaitable[None]] | None, status_url: str = "",
                          ) -> tuple[tuple[RunManifest, wire.Membership, str] | list[str], bool]:
    """One round over the bootstrap list: the join, or (every peer's error, whether any may change)."""
    errors: list[str] = []
    transient = False
    for url in urls:
        ours = effective.run
        request = wire.JoinRequest(node_id, advertise, role, ours.digest_bytes(), status_url=status_url)
        try:
            membership = await request_membership(client, url, request)
            theirs = parse_manifest(membership.payload)
            if theirs.digest() != ours.digest():
                try:
                    effective.manifest_for_join(theirs)
                    if check_model is not None:
                        await check_model(theirs)
                except ConfigError as error:
                    raise JoinRefused(str(error), permanent=True) from None
                request = wire.JoinRequest(node_id, advertise, role, theirs.digest_bytes(), status_url=status_url)
                membership = await request_membership(client, url, request)
                if parse_manifest(membership.payload).digest() != theirs.digest():
                    raise JoinRefused(f"{url}: the run's manifest changed while joining; try again")
            return (theirs, membership, url), False
        except JoinRefused as error:
            if error.permanent:
                raise
            if any(f"refused with {status}" in str(error) for status in (401, 409, 426)):
                # A wrong secret, run or wire major version (the refusal names both versions):
                # asking anyone again cannot help.
                raise JoinRefused(str(error), permanent=True) from None
            errors.append(str(error))
            transient = transient or error.transient
        except RemoteProtocolError as error:
            errors.append(f"{url}: {error}")
    return errors, transient


@dataclass(slots=True)
class FragmentProgress:
    fragment: int
    received: int = 0
    total: int | None = None
    digest: bytes | None = None
    done: bool = False
    commit_index: int = 0  # the newest log index a server said these bytes are current at


class FragmentDownload:
    """Downloads every fragment of the global state into `replica`, resumable, digest-verified.
    Each fragment's bytes are decoded, hashed and checked in `executor` (the codec pool); a peer behind the
    floor is asked again after a pause on `clock`."""

    def __init__(self, client: PeerClient, replica: Replica, peers: Callable[[], list[str]], *,
                 executor: Executor, clock: Clock, chunk_bytes: int = SNAPSHOT_CHUNK_BYTES,
                 min_commit_index: int = 0, accept: Callable[[int, int], tuple[bool, str]] | None = None) -> None:
        """`accept(fragment, served index)`: asked just before a downloaded fragment is installed
        (a repair's floor, bootstrap/apply_rule.py); a refusal asks a peer again like one behind."""
        self.client = client
        self.accept = accept
        self.replica = replica
        self.peers = peers
        self.executor = executor
        self.clock = clock
        self.chunk_bytes = chunk_bytes
        self.progress = [FragmentProgress(p) for p in range(replica.plan.num_fragments)]
        self.bytes_received = 0
        # Fragments arrive as of different log indices; once the log is applied through the
        # newest of them, every fragment is exactly as of that index.
        self.max_commit_index = 0
        # Every fragment must be at least this new (a snapshot install's index): older copies
        # would miss commits the log no longer holds. May be raised while the download runs.
        self.min_commit_index = min_commit_index
        self._peer_slots: dict[str, asyncio.Semaphore] = {}  # url -> CHUNK_REQUESTS_PER_PEER slots

    def raise_floor(self, index: int) -> None:
        """A snapshot through `index` arrived meanwhile: fragments older than it are fetched again."""
        self.min_commit_index = max(self.min_commit_index, index)

    def describe(self) -> str:
        done = sum(1 for f in self.progress if f.done)
        got = sum(f.received for f in self.progress)
        total = sum(f.total or 0 for f in self.progress)
        return f"downloading global state: {done}/{len(self.progress)} fragments, {got}/{total or '?'} bytes"

    async def run(self, attempts: int = 20) -> None:
        while True:
            stale = [p for p in self.progress if not p.done or p.commit_index < self.min_commit_index]
            if not stale:
                return
            queue = deque(stale)
            workers = max(1, min(DOWNLOAD_PEERS, len(self.peers()), len(stale)))
            tasks = [asyncio.create_task(self._worker(queue, first_peer=w, attempts=attempts)) for w in range(workers)]
            try:
                await asyncio.gather(*tasks)
            finally:  # one worker's failure ends the download: stop the others too
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _worker(self, queue: deque[FragmentProgress], *, first_peer: int, attempts: int) -> None:
        """Fragments from the shared queue, one at a time, starting with peer number `first_peer`."""
        while queue:
            await self._one(queue.popleft(), attempts, first_peer=first_peer)

    async def fetch_fragment(self, p: int, attempts: int) -> None:
        """Download fragment p alone (a repair after a digest mismatch), trying up to `attempts` times."""
        await self._one(self.progress[p], attempts)

    async def _request_chunk(self, url: str, fragment: int, offset: int) -> StreamedReply:
        """A SnapshotChunk reply, its header authenticated, its payload not yet taken (it is fed to
        the fragment in offset order: `_Received.feed`)."""
        slots = self._peer_slots.setdefault(url, asyncio.Semaphore(CHUNK_REQUESTS_PER_PEER))
        async with slots:
            reply = await self.client.send_for_stream(url, wire.SnapshotRequest(fragment, offset, self.chunk_bytes),
                                                      reply_kind=wire.MessageKind.SNAPSHOT_CHUNK,
                                                      deadline_s=CHUNK_DEADLINE_S)
        if not isinstance(reply.head, wire.SnapshotChunk):
            raise RemoteProtocolError("no snapshot chunk in the reply", 400)
        return reply

    async def _fetch_rest(self, url: str, progress: FragmentProgress, received: _Received) -> None:
        """Feed `received` fragment bytes from `url`, from the offset it reached to the end.

        Once the first reply has told the size, up to `CHUNKS_IN_FLIGHT` requests are outstanding;
        replies are taken in offset order. A reply with another digest or size means the fragment
        moved on while we downloaded (its state, or the evictions its bytes carry): everything is
        dropped and the fragment starts again.
        """
        in_flight: deque[tuple[int, asyncio.Task[StreamedReply]]] = deque()
        try:
            while progress.total is None or received.offset < progress.total:
                next_offset = in_flight[-1][0] + self.chunk_bytes if in_flight else received.offset
                window = CHUNKS_IN_FLIGHT if progress.total is not None else 1  # the size is learnt first
                while len(in_flight) < window and (progress.total is None or next_offset < progress.total):
                    task = asyncio.create_task(self._request_chunk(url, progress.fragment, next_offset))
                    in_flight.append((next_offset, task))
                    next_offset += self.chunk_bytes
                _, task = in_flight.popleft()
                reply = await task
                chunk = reply.head  # authenticated; its payload is taken below
                if progress.digest is not None and (chunk.digest, chunk.total) != (progress.digest, progress.total):
                    for _, other in in_flight:
                        other.cancel()
                    in_flight.clear()
                    received.restart()  # the fragment advanced: start it again
                    progress.digest, progress.received, progress.commit_index, progress.total = None, 0, 0, None
                    continue
                if not received.offset and chunk.commit_index < self.min_commit_index:
                    raise _PeerBehind(f"serves fragment {progress.fragment} as of index {chunk.commit_index}, "
                                      f"older than the snapshot through {self.min_commit_index}")
                if chunk.offset != received.offset:
                    raise RemoteProtocolError(f"chunk at offset {chunk.offset}, expected {received.offset}", 400)
                progress.digest, progress.total = chunk.digest, chunk.total
                progress.commit_index = max(progress.commit_index, chunk.commit_index)
                # Checked, hashed and decoded into the fragment's arrays piece by piece, off the
                # event loop: the fragment's bytes are never held whole, nor a chunk's joined.
                try:
                    await asyncio.get_running_loop().run_in_executor(self.executor, received.feed, reply)
                finally:
                    progress.received = received.offset  # 0 again if the chunk was refused
                self.bytes_received += reply.payload_length
                if not reply.payload_length and received.offset < chunk.total:
                    raise RemoteProtocolError("empty chunk before the end", 400)
        finally:
            for _, task in in_flight:
                task.cancel()
            if in_flight:
                await asyncio.gather(*(task for _, task in in_flight), return_exceptions=True)

    async def _one(self, progress: FragmentProgress, attempts: int, first_peer: int = 0) -> None:
        received = _Received(self.replica, progress.fragment)
        progress.digest, progress.received, progress.done, progress.commit_index = None, 0, False, 0
        progress.total = None
        errors: list[str] = []
        for attempt in range(attempts):
            peers = self.peers()
            if not peers:
                raise JoinRefused("no peer to download the global state from")
            url = peers[(first_peer + attempt) % len(peers)]
            try:
                await self._fetch_rest(url, progress, received)
                if progress.commit_index < self.min_commit_index:  # the floor was raised meanwhile
                    raise _PeerBehind(f"fragment {progress.fragment} is as of index {progress.commit_index}, "
                                      f"older than the snapshot through {self.min_commit_index}")
                # Checking a fragment (finiteness, its shapes) takes seconds at 1B parameters: in a
                # worker thread, so heartbeats and the other fragments' chunks keep flowing.
                loop = asyncio.get_running_loop()
                expected = progress.digest
                try:
                    checked = await loop.run_in_executor(self.executor, received.checked, expected)
                except RemoteProtocolError:
                    progress.digest, progress.received, progress.commit_index, progress.total = None, 0, 0, None
                    raise
                if self.accept is not None:  # nothing awaited from here to the install
                    accepted, why = self.accept(progress.fragment, progress.commit_index)
                    if not accepted:
                        raise _PeerBehind(why)
                self.replica.install_checked_bytes(checked)  # the quick half, on the loop like every apply
                self.max_commit_index = max(self.max_commit_index, progress.commit_index)
                progress.done = True
                return
            except _PeerBehind as error:
                received.restart()
                progress.digest, progress.received, progress.commit_index, progress.total = None, 0, 0, None
                errors.append(f"{url}: {error}")
                await self.clock.sleep(BEHIND_FLOOR_RETRY_S)
            except (TransportError, RemoteProtocolError) as error:
                errors.append(f"{url}: {error}")
        raise JoinRefused(f"fragment {progress.fragment}: download failed {attempts} times; last: {errors[-1]}")


class _Received:
    """One fragment's bytes as they arrive: decoded straight into arrays of the fragment's shapes
    and hashed into its state digest as they are copied (state_codec `FragmentAssembler`), so a
    fragment in flight costs its own size once, never a buffer of its bytes beside the arrays
    decoded from them, and its bytes are read from memory once (hashed twice: the frame's payload
    digest and the state digest, two different inputs of the wire's digest definitions)."""

    def __init__(self, replica: Replica, fragment: int) -> None:
        self.replica = replica
        self.fragment = fragment
        tensors = replica.state.fragment_params(fragment, copies=False)  # the state's own arrays: shapes only
        self.shapes = fragment_shapes({n: a.shape for n, a in tensors.items()})
        self.restart()

    def restart(self) -> None:
        self.assembler = FragmentAssembler(self.shapes)

    @property
    def offset(self) -> int:
        return self.assembler.received

    def feed(self, reply: StreamedReply) -> None:
        """The chunk's payload, each received piece in one pass while it is in cache: the frame
        decoder hashes it into the frame's payload digest, then the assembler into the state
        digest and copies it into the arrays. The payload digest is checked at the chunk's end,
        after its bytes went in: a chunk refused then (or malformed) starts the fragment again,
        since its bytes cannot be taken back out of the state digest."""
        try:
            reply.feed(self.assembler.feed)
        except StateCodecError as error:
            self.restart()
            raise RemoteProtocolError(f"fragment {self.fragment} bytes are malformed: {error}", 400) from None
        except RemoteProtocolError:
            self.restart()
            raise

    def checked(self, expected_digest: bytes | None) -> tuple[FragmentState, CheckedFragment]:
        """The decoded fragment checked against this run and against the state digest its chunks
        named (`Replica.check_fragment_bytes`'s result); RemoteProtocolError (400) if it is not that
        state: the peer's bytes were not the fragment they named."""
        p = self.fragment
        try:
            state = self.assembler.finish()
            digest = self.assembler.state_digest()
        except StateCodecError as error:
            raise RemoteProtocolError(f"fragment {p} bytes are malformed: {error}", 400) from None
        finally:
            self.restart()  # the arrays now belong to `state` alone
        if state.fragment != p:
            raise RemoteProtocolError(f"fragment {p} bytes hold fragment {state.fragment}", 400)
        if expected_digest is None or bytes.fromhex(digest) != expected_digest:
            named = expected_digest.hex()[:12] if expected_digest else "none"
            raise RemoteProtocolError(f"fragment {p}: the assembled state has digest {digest[:12]}, its chunks named "
                                      f"{named}", 400)
        try:  # decoded and hashed just now: ours, not hashed again
            return state, self.replica.state.check_fragment(state, adopt=True, digest=digest)
        except GlobalStateError as error:
            raise RemoteProtocolError(f"fragment {p} does not fit this run: {error}", 400) from None
