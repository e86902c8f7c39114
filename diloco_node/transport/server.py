"""The peer API's server side: request bodies of authenticated frames in, handler replies out.

For each `POST /v1/<kind>` the server refuses what it can before reading a byte (unknown route 404,
compressed body 415, Content-Length over the kind's bound 413, too many unauthenticated streams 429),
then reads the body in chunks with a per-read timeout and a per-frame deadline (408), counts the
bytes itself (aiohttp's client_max_size does not cover streamed bodies), and feeds them to a
`wire.frames.FrameDecoder`. Peer garbage surfaces as `RemoteProtocolError`, answered with its
`status_hint` (400/401/409/413/426/429); handlers never see an unauthenticated message.

A stream earns its slot. Until its first frame header (fixed header, header map, MAC) has
authenticated it holds an *unauthenticated* slot: few per source address, a node-wide pool of
its own (the oldest is evicted when the pool is full), and `Limits.auth_deadline_s` to authenticate.
Only then does it take a member's slot, counted under the authenticated sender, never under the
unauthenticated `X-Diloco-Sender` header; so strangers can never take the slots members use. An
authenticated stream must keep `Limits.min_transfer_bytes_per_s` over the time we wait for it.
Nothing a stranger sends is kept per sender: its traffic is counted in one shared bucket.

Handlers are registered per message kind by the composition root:
- `on_message(kind, handler)`: `async def handler(message, peer) -> reply | None` for whole messages;
- `on_stream(kind, open_sink)`: `async def open_sink(head, peer, payload_length) -> PayloadSink` for
  kinds whose payload is streamed (bounded memory whatever its size). The sink gets the chunks,
  then `finish()` once the payload matched its authenticated digest, or `abort(reason)`;
- `on_sequence(open_kind, part_kind, open_consumer)`: a body that is one `open_kind` frame followed
  by any number of `part_kind` frames, each authenticated and handed over as it completes
  (`async def open_consumer(head, peer) -> SequenceConsumer`; a streamed contribution). The body is
  bounded by what the consumer says its declaration still allows (`max_remaining_bytes`), so its
  size follows the model's shapes rather than a fixed cap; memory is one frame.

Decoding batches of 64 KiB or more (BLAKE3 of payloads, msgpack) and encoding big replies run in a
thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, Final, Protocol

import aiohttp
from aiohttp import http_exceptions, web

from diloco_node.transport.counters import TrafficCounters
from diloco_node.transport.routes import (
    DECODE_BATCH_BYTES,
    FRAME_CONTENT_TYPE,
    INLINE_DECODE_MAX_BYTES,
    INLINE_ENCODE_MAX_BYTES,
    ROUTE_PREFIX,
    SENDER_HEADER,
    kind_from_name,
    kind_name,
)
from diloco_node.transport.streaks import FailureStreaks
from diloco_node.transport.tls import certificate_sha256, certified_node_id
from wire.auth import ANY_MEMBER, MAC_BYTES, NONCE_BYTES, AuthContext, FrameVerifier
from wire.errors import RemoteProtocolError
from wire.frames import (
    CLOSED,
    FIXED_HEADER_BYTES,
    NEED_DATA,
    Event,
    FrameDecoder,
    FrameEnd,
    FrameHeader,
    PayloadChunk,
    Received,
    encode_frame,
    encode_frame_head,
    pieces_digest,
)
from wire.limits import DEFAULT_LIMITS, KiB, Limits, MiB
from wire.messages import (
    MAX_NODE_ID_CHARS,
    MAX_REASON_CHARS,
    NODE_ID_PATTERN,
    Message,
    MessageKind,
    payload_nbytes,
    payload_pieces,
)

log = logging.getLogger(__name__)

# Authenticated streams open at once, across members: a run has tens of sites, each with a few
# streams; beyond this even members are refused (429) before they cost buffers or threads.
MAX_CONCURRENT_STREAMS = 64
# Streams that have not authenticated yet, node-wide. A member's frame header arrives within a
# round trip, so this pool is only ever full under a flood; then the oldest unauthenticated stream
# is cut to make room (a stranger can hold a slot only until newer streams push it out).
MAX_UNAUTHENTICATED_STREAMS = 64
# ... and per source address: one host cannot take the whole pool. A site opens at most a few
# streams at once (contribution, log append, snapshot, vote), so 8 leaves headroom.
MAX_UNAUTHENTICATED_STREAMS_PER_ADDRESS = 8
# Traffic of requests that never authenticated is counted under this one name (not per claimed
# sender, which is anyone's to choose: 15,000 invented names once grew a node by 129 MB).
UNAUTHENTICATED = "(unauthenticated)"
# Header values we look at are bounded before use: the sender header holds a node id.
MAX_SENDER_HEADER_CHARS = MAX_NODE_ID_CHARS
# Small kinds may batch several frames in one body; their bodies may reach this size even when one
# frame of the kind is smaller.
MIN_BODY_LIMIT_BYTES = 1 * MiB
# Reply bodies above this are written in slices of this size (each awaits the socket draining).
STREAMED_REPLY_MIN_BYTES = 256 * KiB
# A reply written from views of the state (a served chunk, no copy) holds them this long at most;
# then what is left of it is copied, so a slow reader never keeps a replaced state version alive
# (daemon/memory_bound.py). A chunk crosses a 1 Gbit/s link in about 35 ms.
REPLY_VIEWS_S = 1.0
# After refusing a request whose body is still coming, read and drop at most this much of it (or
# for at most this long) so the answer reaches the client before the connection closes under it.
REFUSAL_DRAIN_BYTES = 8 * MiB
REFUSAL_DRAIN_S = 1.0
# A sequence's body is bounded by its consumer's declared payload bytes plus this much per frame
# still due: a part frame's header map is a few hundred bytes (auth keys, stream id, indices), so a
# body that outgrows this is padding what no honest sender pads (413).
SEQUENCE_FRAME_OVERHEAD_BYTES = 4 * KiB


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    """Who sent a message: the authenticated node id from the frame, and where it came from."""

    node_id: str
    address: str | None
    sent_at_unix: float


class PayloadSink(Protocol):
    """Receives one streamed payload. Bytes are untrusted until `finish` is called."""

    async def write(self, data: bytes) -> None: ...

    async def finish(self) -> Message | None:
        """The payload is complete and authentic; return the reply, if any."""
        ...

    async def abort(self, reason: str) -> None:
        """The stream failed (bad digest, disconnect, deadline): discard what was written."""
        ...


class SequenceConsumer(Protocol):
    """Receives the frames that follow a sequence's opening frame, one authenticated frame at a time."""

    @property
    def max_remaining_bytes(self) -> int:
        """Most payload bytes the frames still due may carry (bounds the rest of the body)."""
        ...

    @property
    def frames_left(self) -> int:
        """Most frames still due (each adds its header's bytes to the body's bound)."""
        ...

    async def part(self, message: Message) -> None:
        """One more frame, checked and kept (raise RemoteProtocolError to refuse the stream)."""
        ...

    async def finish(self) -> Message | None:
        """The body ended: the sequence must be complete; return the reply, if any."""
        ...

    async def abort(self, reason: str) -> None:
        """The stream failed: discard what was received."""
        ...


@dataclasses.dataclass(slots=True, eq=False)
class _Stream:
    """One request body being read: its slot, and what the deadlines and rate checks need."""

    address: str
    admitted_at: float
    sender: str | None = None  # set once its first frame header authenticated
    evicted: bool = False  # pushed out of the unauthenticated pool by newer streams
    waiting: asyncio.Timeout | None = None  # the read in progress (eviction cuts it short)
    received: int = 0
    waited_s: float = 0.0  # time spent waiting for the peer's bytes (the rate's denominator)
    certified: str | None = None  # with mutual TLS: the node id the peer's certificate names


MessageHandler = Callable[[Message, Peer], Awaitable[Message | None]]
# Why a peer is refused for good (an eviction), from its node id and certificate fingerprint; None
# admits it. Asked before a request's body is read (the certificate) and at its first frame (the
# authenticated sender).
PeerGate = Callable[[str | None, str | None], str | None]
SinkOpener = Callable[[Message, Peer, int], Awaitable[PayloadSink]]
SequenceOpener = Callable[[Message, Peer], Awaitable[SequenceConsumer]]


@dataclasses.dataclass(frozen=True, slots=True)
class ServerOptions:
    """Transport-side bounds of the server (wire-side ones, incl. per-peer streams, are in `Limits`)."""

    max_concurrent_streams: int = MAX_CONCURRENT_STREAMS
    max_unauthenticated_streams: int = MAX_UNAUTHENTICATED_STREAMS
    max_unauthenticated_streams_per_address: int = MAX_UNAUTHENTICATED_STREAMS_PER_ADDRESS
    min_body_limit_bytes: int = MIN_BODY_LIMIT_BYTES
    inline_decode_max_bytes: int = INLINE_DECODE_MAX_BYTES
    decode_batch_bytes: int = DECODE_BATCH_BYTES
    refusal_drain_bytes: int = REFUSAL_DRAIN_BYTES
    refusal_drain_s: float = REFUSAL_DRAIN_S

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if spec.name == "refusal_drain_s":
                if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                    raise ValueError(f"ServerOptions.refusal_drain_s must be >= 0 seconds, got {value!r}")
            elif type(value) is not int or value <= 0:
                raise ValueError(f"ServerOptions.{spec.name} must be a positive int, got {value!r}")


class PeerServer:
    """Routes `POST /v1/<kind>` bodies of frames to the handler registered for that kind."""

    def __init__(
        self,
        auth: AuthContext,
        verifier: FrameVerifier,
        *,
        limits: Limits = DEFAULT_LIMITS,
        options: ServerOptions = ServerOptions(),
        counters: TrafficCounters | None = None,
        executor: Executor | None = None,
        wall_clock: Callable[[], float] = time.time,
        certified_senders: bool = False,
        gate: PeerGate = lambda node_id, fingerprint: None,
    ) -> None:
        """`certified_senders`: peers come over mutual TLS, and every frame's sender must be the
        node id its connection's certificate names (a member cannot speak for another). `gate`:
        why a peer is refused for good (the daemon's eviction check), None to let it in."""
        self._certified_senders = certified_senders
        self._auth = auth
        self._verifier = verifier
        self.limits = limits
        self.options = options
        self.counters = counters if counters is not None else TrafficCounters()
        self._refusals = FailureStreaks(log, "refused", "accepted again")  # one line per streak, not per request
        self._executor = executor  # None: the loop's default pool
        self._wall_clock = wall_clock  # only for frame timestamps (replay window); deadlines use the loop
        self._handlers: dict[MessageKind, MessageHandler] = {}
        self._sinks: dict[MessageKind, SinkOpener] = {}
        self._sequences: dict[MessageKind, tuple[MessageKind, SequenceOpener]] = {}  # open kind -> (part kind, opener)
        self._streams: dict[str, int] = {}  # authenticated streams per member
        self._streams_total = 0
        self._pending: dict[_Stream, None] = {}  # unauthenticated streams, oldest first
        self._pending_by_address: dict[str, int] = {}
        self.gate = gate
        # Certificate fingerprints each certified node id presented, so an eviction can name them.
        # Bounded: only verified certificates of the run's CA get here, a few per member.
        self.seen_certificates: dict[str, set[str]] = {}

    # ---- wiring -----------------------------------------------------------------------------

    def on_message(self, kind: MessageKind, handler: MessageHandler) -> None:
        self._check_unregistered(kind)
        self._handlers[kind] = handler

    def on_stream(self, kind: MessageKind, open_sink: SinkOpener) -> None:
        self._check_unregistered(kind)
        self._sinks[kind] = open_sink

    def on_sequence(self, open_kind: MessageKind, part_kind: MessageKind, open_consumer: SequenceOpener) -> None:
        """Bodies of one `open_kind` frame then `part_kind` frames, on the `open_kind` route."""
        self._check_unregistered(open_kind)
        self._sequences[open_kind] = (part_kind, open_consumer)

    def _check_unregistered(self, kind: MessageKind) -> None:
        if kind in self._handlers or kind in self._sinks or kind in self._sequences:
            raise ValueError(f"a handler for {kind.name} is already registered")

    def install(self, app: web.Application) -> None:
        """Add the peer routes to `app` (the composition root owns the app and its AppRunner)."""
        app[PEER_SERVER] = self
        app.router.add_post(ROUTE_PREFIX + "{kind}", self._handle, expect_handler=self._expect)

    @property
    def active_streams(self) -> dict[str, int]:
        """Authenticated streams open now, per member."""
        return dict(self._streams)

    @property
    def unauthenticated_streams(self) -> int:
        return len(self._pending)

    def status(self) -> dict[str, object]:
        """The transport's part of /status: open streams and traffic per peer."""
        return {"active_streams": self.active_streams, "streams_total": self._streams_total,
                "unauthenticated_streams": len(self._pending), "peers": self.counters.snapshot()}

    def body_limit(self, kind: MessageKind) -> int:
        """Largest request body for `kind`: one frame of the largest allowed size (or a small batch).
        A sequence's body may grow past this once its opening frame declared what follows."""
        limits = self.limits
        largest_frame = self._frame_bound(limits.max_payload(kind))
        return max(largest_frame, self.options.min_body_limit_bytes)

    def _frame_bound(self, payload_bytes: int) -> int:
        return FIXED_HEADER_BYTES + self.limits.max_header_map_bytes + MAC_BYTES + payload_bytes

    # ---- one request ------------------------------------------------------------------------

    @staticmethod
    def _claimed_sender(request: web.Request) -> str | None:
        """The sender the header claims, if well-formed: only ever compared with the authenticated
        one (a mismatch is refused), never used to count or keep anything."""
        claimed = request.headers.get(SENDER_HEADER)
        if claimed is None or len(claimed) > MAX_SENDER_HEADER_CHARS or not NODE_ID_PATTERN.fullmatch(claimed):
            return None
        return claimed

    def _precheck(self, request: web.Request) -> tuple[int, str] | MessageKind:
        """Everything decidable from the request line and headers: the route's kind, or a refusal."""
        name = request.match_info["kind"]
        kind = kind_from_name(name)
        if kind is None or (kind not in self._handlers and kind not in self._sinks and kind not in self._sequences):
            return 404, f"no handler for {name[:64]!r} on this node"
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        if encoding != "identity":
            # aiohttp would inflate it: a decompression bomb past our byte counts.
            return 415, f"Content-Encoding {encoding[:32]!r} is not accepted; send frames as-is"
        limit = self.body_limit(kind)
        # A sequence's body is bounded once its opening frame says what follows (see _consume).
        if kind not in self._sequences and request.content_length is not None and request.content_length > limit:
            return 413, f"{kind.name} body of {request.content_length} bytes exceeds the limit of {limit}"
        if self._certified_senders:
            certified, why = self._certified(request)
            if certified is None:
                return 403, why
            fingerprint = self._fingerprint(request)
            refused = self.gate(certified, fingerprint)
            if refused is not None:
                return 403, refused
            if fingerprint is not None:
                self.seen_certificates.setdefault(certified, set()).add(fingerprint)
        address = request.remote or "unknown"
        per_address = self.options.max_unauthenticated_streams_per_address
        if self._pending_by_address.get(address, 0) >= per_address:
            return 429, f"{address} already has {per_address} streams waiting to authenticate"
        return kind

    @staticmethod
    def _certified(request: web.Request) -> tuple[str | None, str]:
        transport = request.transport
        return certified_node_id(transport.get_extra_info("ssl_object") if transport is not None else None)

    @staticmethod
    def _fingerprint(request: web.Request) -> str | None:
        transport = request.transport
        return certificate_sha256(transport.get_extra_info("ssl_object") if transport is not None else None)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` (big uploads): refuse before the client sends any body byte."""
        verdict = self._precheck(request)
        if not isinstance(verdict, MessageKind):
            self.counters.peer(UNAUTHENTICATED).requests_received += 1  # _handle never runs for it
            return await self._refuse(request, UNAUTHENTICATED, *verdict)
        if request.headers.get("Expect", "").lower() != "100-continue":
            return await self._refuse(request, UNAUTHENTICATED, 417, "only 'Expect: 100-continue' is understood")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        verdict = self._precheck(request)
        if not isinstance(verdict, MessageKind):
            self.counters.peer(UNAUTHENTICATED).requests_received += 1
            return await self._refuse(request, UNAUTHENTICATED, *verdict)
        kind = verdict
        loop = asyncio.get_running_loop()
        stream = self._admit(request.remote or "unknown", loop.time())
        if self._certified_senders:
            stream.certified = self._certified(request)[0]
        # The stream's slot is held until its reply is written: a slow reader's reply counts
        # against MAX_CONCURRENT_STREAMS and its sender's per-peer streams until it has left, so
        # the bytes of replies in flight are bounded (daemon/memory_bound.py).
        try:
            try:
                # No name keeps the replies: the body is all that holds a served chunk's views.
                body = await self._encode_replies(
                    await self._consume(request, kind, self._claimed_sender(request), stream, loop), stream.sender)
            except RemoteProtocolError as error:
                if stream.sender is None:
                    self.counters.peer(UNAUTHENTICATED).requests_received += 1
                return await self._refuse(request, stream.sender or UNAUTHENTICATED, error.status_hint, str(error))
            assert stream.sender is not None  # a body without an authenticated frame was refused
            return await self._write_reply(request, stream.sender, body)
        finally:
            self._release(stream)

    async def _write_reply(self, request: web.Request, peer_key: str,
                           body: list[bytes | memoryview]) -> web.StreamResponse:
        length = sum(len(piece) for piece in body)
        self.counters.sent(peer_key, length)
        self._refusals.succeeded(peer_key)  # a streak of refusals to this peer ends (one line)
        try:
            if length <= STREAMED_REPLY_MIN_BYTES:
                return web.Response(body=b"".join(body), content_type=FRAME_CONTENT_TYPE)
            # A big reply (log read, snapshot chunk) goes out in slices, so the socket buffer never
            # holds a second copy of it.
            response = web.StreamResponse(headers={"Content-Type": FRAME_CONTENT_TYPE})
            response.content_length = length
            await response.prepare(request)
            async with asyncio.timeout(self.limits.message_timeout_s):
                await self._write_slices(request, response, body)
            return response
        except TimeoutError:
            log.info("reply to %s not delivered: the reader took nothing for %g s, or the reply took over %g s",
                     peer_key, self.limits.read_timeout_s, self.limits.message_timeout_s)
            request.protocol.force_close()
            return web.Response(status=499)
        except (ConnectionError, aiohttp.ClientConnectionResetError) as error:
            # The client went away while we answered: one line, not aiohttp's traceback.
            log.info("reply to %s not delivered: %s", peer_key, error or type(error).__name__)
            request.protocol.force_close()
            return web.Response(status=499)

    async def _write_slices(self, request: web.Request, response: web.StreamResponse,
                            body: list[bytes | memoryview]) -> None:
        """Write `body` in slices, then its end. A reader that takes no slice for the read timeout is
        stalled, as a sender that sends no byte is (TimeoutError). The body may be views of a state
        version (a served chunk): a slice of them is handed over only while the socket takes it
        (not paused) and within `REPLY_VIEWS_S`; else what is left is copied (at most a chunk) and
        every view let go, `body` emptied in place (the caller's list), so a slow reader keeps a
        version that a commit replaced alive for at most `REPLY_VIEWS_S` plus one slice's wait.
        (A write is never cancelled but by the stall: aiohttp's drain does not survive it.)"""
        loop = asyncio.get_running_loop()
        views_until = loop.time() + REPLY_VIEWS_S
        rest = [memoryview(piece).cast("B") for piece in body]
        while rest:
            if body and (request.protocol.writing_paused or loop.time() >= views_until):
                rest = [memoryview(b"".join(rest))]  # one copy, at most a chunk: the views go
                body.clear()
            piece, rest[0] = rest[0][:STREAMED_REPLY_MIN_BYTES], rest[0][STREAMED_REPLY_MIN_BYTES:]
            if not rest[0]:
                rest.pop(0)
            async with asyncio.timeout(self.limits.read_timeout_s):
                await response.write(piece)
            del piece
        async with asyncio.timeout(self.limits.read_timeout_s):
            await response.write_eof()

    # ---- stream slots -----------------------------------------------------------------------

    def _admit(self, address: str, now: float) -> _Stream:
        """An unauthenticated slot for a new stream (the precheck has bounded its address)."""
        if len(self._pending) >= self.options.max_unauthenticated_streams:
            # Full: cut the stream that has waited longest. Members authenticate within a round
            # trip, so it is almost surely a stranger; a flood can only churn this pool.
            oldest = next(iter(self._pending))
            self._unpend(oldest)
            oldest.evicted = True
            if oldest.waiting is not None:
                oldest.waiting.reschedule(now)
        stream = _Stream(address=address, admitted_at=now)
        self._pending[stream] = None
        self._pending_by_address[address] = self._pending_by_address.get(address, 0) + 1
        return stream

    def _unpend(self, stream: _Stream) -> None:
        if self._pending.pop(stream, False) is not False:
            left = self._pending_by_address[stream.address] - 1
            if left:
                self._pending_by_address[stream.address] = left
            else:
                del self._pending_by_address[stream.address]

    def _authenticated(self, stream: _Stream, sender: str) -> None:
        """The stream's first frame header authenticated: move it to its member's slots (or refuse)."""
        if stream.evicted:
            raise RemoteProtocolError("stream evicted: too many unauthenticated streams", 429)
        if self._certified_senders and sender != stream.certified:
            # The MAC proves "a member of the run"; the certificate proves which one.
            raise RemoteProtocolError(f"the connection's certificate names {stream.certified!r} but the frame is "
                                      f"from {sender!r}: a member cannot speak for another", 403)
        refused = self.gate(sender, None)
        if refused is not None:  # with or without TLS: an evicted member's frames change nothing
            raise RemoteProtocolError(refused, 403)
        self._unpend(stream)
        per_peer = self.limits.max_concurrent_streams_per_peer
        if self._streams.get(sender, 0) >= per_peer:
            raise RemoteProtocolError(f"{sender} already has {per_peer} streams open", 429)
        if self._streams_total >= self.options.max_concurrent_streams:
            raise RemoteProtocolError(f"this node already has {self._streams_total} streams open", 429)
        stream.sender = sender
        self._streams[sender] = self._streams.get(sender, 0) + 1
        self._streams_total += 1
        traffic = self.counters.peer(sender)
        traffic.requests_received += 1
        traffic.bytes_received += stream.received

    def _release(self, stream: _Stream) -> None:
        self._unpend(stream)
        sender = stream.sender
        if sender is not None:
            self._streams_total -= 1
            if self._streams[sender] <= 1:
                del self._streams[sender]
            else:
                self._streams[sender] -= 1

    async def _refuse(self, request: web.Request, peer_key: str, status: int, reason: str) -> web.Response:
        # A refusal's reason is sent back as text, bounded like every reason on the wire: a peer
        # cannot make us echo megabytes.
        reason = reason[:MAX_REASON_CHARS]
        self._refusals.failed(peer_key, f"({request.remote}) with {status}: {reason}")
        self.counters.refused(peer_key, f"{status} {reason}")
        response = web.Response(status=status, text=reason)
        response.force_close()
        try:
            await response.prepare(request)
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            # The client left after (or before) its refusal: nothing to answer, nothing to log twice.
            request.protocol.force_close()
            return response
        # The body may be partly unread. Closing at once would make the client's kernel see a
        # reset while it is still sending, which can destroy our answer before it is read; aiohttp's
        # own "lingering" reads up to 10 s of it. Discard a bounded amount, then close.
        await self._discard_body(request)
        request.protocol.force_close()
        return response

    async def _discard_body(self, request: web.Request) -> None:
        content = request.content
        left = self.options.refusal_drain_bytes
        try:
            async with asyncio.timeout(self.options.refusal_drain_s):
                while left > 0 and not content.is_eof():
                    chunk = await content.readany()
                    if not chunk:
                        return
                    left -= len(chunk)
        except (TimeoutError, OSError, aiohttp.ClientError, http_exceptions.HttpProcessingError):
            pass  # done waiting: the connection is closed next either way

    async def _consume(self, request: web.Request, kind: MessageKind, claimed: str | None, stream: _Stream,
                       loop: asyncio.AbstractEventLoop) -> list[Message]:
        """Read, decode and dispatch the whole body; return the handlers' replies."""
        decoder = FrameDecoder(self._verifier, self.limits, stream_kinds=(kind,) if kind in self._sinks else ())
        limit = self.body_limit(kind)
        replies: list[Message] = []
        sink: PayloadSink | None = None
        sequence = self._sequences.get(kind)
        consumer: SequenceConsumer | None = None
        frame_started: float | None = None
        try:
            while True:
                data = await self._read_some(request, stream, frame_started, loop)
                stream.received += len(data)
                if stream.sender is not None:
                    self.counters.received(stream.sender, len(data))
                if stream.received > limit:
                    raise RemoteProtocolError(f"{kind.name} body exceeds the limit of {limit} bytes", 413)
                events = await self._decode(decoder, data)
                if stream.sender is None and decoder.authenticated_sender is not None:
                    self._authenticated(stream, decoder.authenticated_sender)
                for event in events:
                    if isinstance(event, Received) and sequence is not None:
                        part_kind, open_consumer = sequence
                        if consumer is None:
                            peer = self._peer(event.sender, event.sent_at_unix, event.message.KIND, kind, claimed,
                                              stream, request)
                            consumer = await open_consumer(event.message, peer)
                            # From here the body may carry what the opening frame declared, no more.
                            limit = (stream.received + self.options.decode_batch_bytes + consumer.max_remaining_bytes
                                     + consumer.frames_left * SEQUENCE_FRAME_OVERHEAD_BYTES)
                        else:
                            if event.message.KIND is not part_kind:
                                raise RemoteProtocolError(f"a {kind_name(kind)} body continues with {kind_name(part_kind)} "
                                                          f"frames, got {event.message.KIND.name}", 400)
                            self._peer(event.sender, event.sent_at_unix, part_kind, part_kind, claimed, stream, request)
                            await consumer.part(event.message)
                    elif isinstance(event, Received):
                        peer = self._peer(event.sender, event.sent_at_unix, event.message.KIND, kind, claimed,
                                          stream, request)
                        reply = await self._handlers[kind](event.message, peer)
                        if reply is not None:
                            replies.append(reply)
                    elif isinstance(event, FrameHeader):
                        peer = self._peer(event.sender, event.sent_at_unix, event.head.KIND, kind, claimed,
                                          stream, request)
                        sink = await self._sinks[kind](event.head, peer, event.payload_length)
                    elif isinstance(event, PayloadChunk):
                        assert sink is not None
                        await sink.write(event.data)
                    elif isinstance(event, FrameEnd):
                        assert sink is not None
                        finished, sink = sink, None
                        reply = await finished.finish()
                        if reply is not None:
                            replies.append(reply)
                if not data:
                    if stream.sender is None:
                        raise RemoteProtocolError("the body held no frame", 400)
                    if consumer is not None:
                        done, consumer = consumer, None
                        reply = await done.finish()
                        if reply is not None:
                            replies.append(reply)
                    return replies
                if decoder.between_frames:
                    frame_started = None
                elif frame_started is None:
                    frame_started = loop.time()
        except BaseException as error:
            if sink is not None:
                await sink.abort(f"stream failed: {error or type(error).__name__}")
            if consumer is not None:
                await consumer.abort(f"stream failed: {error or type(error).__name__}")
            raise

    async def _read_some(self, request: web.Request, stream: _Stream, frame_started: float | None,
                         loop: asyncio.AbstractEventLoop) -> bytes:
        """The next bytes of the body (b"" at its end), within the read timeout, the authentication
        deadline, the frame deadline and the minimum rate."""
        limits = self.limits
        now = loop.time()
        timeout = limits.read_timeout_s
        if stream.sender is None:
            left = stream.admitted_at + limits.auth_deadline_s - now
            if left <= 0:
                raise self._auth_deadline_error()
            timeout = min(timeout, left)
        if frame_started is not None:
            left = frame_started + limits.message_timeout_s - now
            if left <= 0:
                raise self._deadline_error()
            timeout = min(timeout, left)
        content = request.content
        try:
            async with asyncio.timeout(timeout) as waiting:
                stream.waiting = waiting
                chunk = await content.readany()
        except TimeoutError:
            now = loop.time()
            if stream.evicted:
                raise RemoteProtocolError("stream evicted: too many unauthenticated streams", 429) from None
            if stream.sender is None and now >= stream.admitted_at + limits.auth_deadline_s:
                raise self._auth_deadline_error() from None
            if frame_started is not None and now >= frame_started + limits.message_timeout_s:
                raise self._deadline_error() from None
            raise RemoteProtocolError(f"no body byte for {limits.read_timeout_s:g} s", 408) from None
        except (OSError, aiohttp.ClientError, http_exceptions.HttpProcessingError) as error:
            raise RemoteProtocolError(f"request body broke off: {type(error).__name__}: {error}", 400) from None
        finally:
            stream.waiting = None
            stream.waited_s += loop.time() - now
        if stream.evicted:
            raise RemoteProtocolError("stream evicted: too many unauthenticated streams", 429)
        if not chunk:
            return b""
        parts = [chunk]
        size = len(chunk)
        while size < self.options.decode_batch_bytes:
            more = content.read_nowait(self.options.decode_batch_bytes - size)
            if not more:
                break
            parts.append(more)
            size += len(more)
        if stream.waited_s > limits.min_transfer_window_s:
            rate = (stream.received + size) / stream.waited_s
            if rate < limits.min_transfer_bytes_per_s:
                raise RemoteProtocolError(f"{stream.received + size} bytes in {stream.waited_s:.1f} s: below the "
                                          f"minimum rate of {limits.min_transfer_bytes_per_s} bytes/s", 408)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _auth_deadline_error(self) -> RemoteProtocolError:
        return RemoteProtocolError(f"no authenticated frame header within {self.limits.auth_deadline_s:g} s", 408)

    def _deadline_error(self) -> RemoteProtocolError:
        return RemoteProtocolError(f"a frame took longer than the {self.limits.message_timeout_s:g} s deadline", 408)

    async def _decode(self, decoder: FrameDecoder, data: bytes) -> list[Event]:
        now_unix = self._wall_clock()
        # Whatever is already buffered counts too: completing a big buffered frame hashes all of it.
        if len(data) + decoder.buffered_bytes < self.options.inline_decode_max_bytes:
            return _decode_batch(decoder, data, now_unix)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _decode_batch, decoder, data, now_unix)

    def _peer(self, sender: str, sent_at_unix: float, frame_kind: MessageKind, route_kind: MessageKind,
              claimed: str | None, stream: _Stream, request: web.Request) -> Peer:
        if frame_kind is not route_kind:
            raise RemoteProtocolError(f"{frame_kind.name} frame sent to the {kind_name(route_kind)} route", 400)
        if claimed is not None and claimed != sender:
            raise RemoteProtocolError(f"{SENDER_HEADER} says {claimed!r} but the frame is signed by {sender!r}", 401)
        if sender != stream.sender:
            raise RemoteProtocolError(f"one body carries frames of one sender: {stream.sender!r}, then {sender!r}", 400)
        return Peer(node_id=sender, address=request.remote, sent_at_unix=sent_at_unix)

    async def _encode_replies(self, replies: list[Message], to: str | None) -> list[bytes | memoryview]:
        """The reply body as pieces, in order: a big single-payload reply (a snapshot chunk) is its
        frame's head and the payload itself, which is written as it is, never copied behind a head."""
        loop = asyncio.get_running_loop()
        pieces: list[bytes | memoryview] = []
        for reply in replies:
            stamp = {"now_unix": self._wall_clock(), "nonce": os.urandom(NONCE_BYTES), "to": to or ANY_MEMBER}
            if approx_payload_bytes(reply) < INLINE_ENCODE_MAX_BYTES:
                pieces.append(encode_frame(reply, self._auth, **stamp))
            elif reply.STREAMABLE:
                payload = payload_pieces(reply.payload)  # type: ignore[attr-defined]
                pieces.append(await loop.run_in_executor(self._executor, functools.partial(
                    _frame_head, reply, payload, self._auth, **stamp)))
                pieces.extend(payload)  # written where it lies (a served chunk: views of the state)
            else:
                pieces.append(await loop.run_in_executor(self._executor, functools.partial(
                    encode_frame, reply, self._auth, **stamp)))
        return pieces


def _frame_head(message: Message, payload: tuple[bytes | memoryview, ...], auth: AuthContext, **stamp: Any) -> bytes:
    """The head of `message`'s frame, whose payload (its pieces, `payload_pieces`) follows it
    unchanged: the same bytes as `encode_frame(message)` without joining them, hashed where they lie."""
    return encode_frame_head(message.without_payload(), auth, payload_length=sum(len(piece) for piece in payload),
                             payload_digest=pieces_digest(payload), **stamp)


def _decode_batch(decoder: FrameDecoder, data: bytes, now_unix: float) -> list[Event]:
    """Feed `data` (b"": end of body) and collect every event it completes."""
    decoder.receive_data(data)
    events: list[Event] = []
    while True:
        event = decoder.next_event(now_unix=now_unix)
        if event is NEED_DATA or event is CLOSED:
            return events
        events.append(event)


def approx_payload_bytes(message: Message) -> int:
    """Bulk bytes a message carries (its payload, or its log entries' payloads)."""
    payload = getattr(message, "payload", b"")
    entries = getattr(message, "entries", ())
    return payload_nbytes(payload) + sum(len(entry.payload) for entry in entries)


PEER_SERVER: Final = web.AppKey("diloco_peer_server", PeerServer)
