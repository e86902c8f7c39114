"""The peer API's client side: one aiohttp session per node, messages out, authenticated replies in.

`send(url, *messages)` posts small messages (one body, one or more frames of one kind) and returns
the peer's replies; `send_for_stream(url, message, reply_kind=...)` returns its one reply of a
streamed kind (a snapshot chunk) with the header authenticated and the payload left in the pieces
it arrived in, for the caller to take piece by piece (`StreamedReply.feed`), never joined.
`send_sequence(url, frames)` posts a body of frames produced one at a time (an opening frame,
then its parts: a streamed contribution) with chunked transfer encoding, so neither the whole
body nor its length is ever needed up front. `send_stream(url, head, payload)` uploads one large
payload as a streamed frame with bounded memory whatever its size: the payload comes from a
bytes-like object (sent as slices, never copied) or an async iterator of chunks, and aiohttp
drains the socket as it goes (backpressure). Timeouts are per read (`sock_read`), per connect, and per stall of an upload; a
whole-message deadline is the caller's `deadline_s`. There is no total timeout: a 256 MB fragment on
a slow link may rightly take minutes.

Cancelling a send closes its connection (aiohttp never returns a half-written connection to the
pool), so nothing is left half-sent. Hashing and encoding big payloads run in a thread pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from diloco_node.transport.counters import PeerTraffic, TrafficCounters
from diloco_node.transport.routes import (
    DECODE_BATCH_BYTES,
    FRAME_CONTENT_TYPE,
    INLINE_DECODE_MAX_BYTES,
    INLINE_ENCODE_MAX_BYTES,
    SENDER_HEADER,
    kind_path,
)
from diloco_node.transport.server import approx_payload_bytes
from diloco_node.transport.streaks import FailureStreaks
from diloco_node.transport.tls import SiteTls
from wire import digest as content_digest
from wire.auth import ANY_MEMBER, MAC_BYTES, NONCE_BYTES, AuthContext, FrameVerifier
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.frames import (
    CLOSED,
    FIXED_HEADER_BYTES,
    NEED_DATA,
    FrameDecoder,
    FrameEnd,
    FrameHeader,
    Received,
    encode_frame,
    encode_frame_head,
)
from wire.limits import DEFAULT_LIMITS, KiB, Limits, MiB
from wire.messages import Message, MessageKind

log = logging.getLogger(__name__)

# A TCP handshake across continents takes well under a second; a peer silent for 10 s is down.
CONNECT_TIMEOUT_S = 10.0
# Connections kept per peer: its per-peer stream cap plus room for small messages beside them.
MAX_CONNECTIONS_PER_PEER = 8
# All pooled connections of one node.
MAX_CONNECTIONS = 256
# Slices handed to aiohttp; it drains the socket every 64 KiB, so memory stays at a few slices.
UPLOAD_CHUNK_BYTES = 256 * KiB
# Bodies larger than this are sent as slices rather than one write (the socket buffer would copy them).
INLINE_BODY_MAX_BYTES = 256 * KiB
# Replies per request: a handler answers each frame at most once; more is a confused or hostile peer.
MAX_REPLY_FRAMES = 1024
# Replies to a batch of small messages may together exceed one small frame's bound.
MIN_REPLY_LIMIT_BYTES = 1 * MiB
# Replies of a known length up to this are read whole before they are decoded (one hop to the pool),
# and a streamed reply (`send_for_stream`: a snapshot chunk of 4 MiB and its frame head) may be no
# longer: it is held whole, in the pieces it arrived in, until its payload is taken.
WHOLE_REPLY_MAX_BYTES = 8 * MiB
# A refusal's reason text is read up to this size (the server sends at most
# wire.messages.MAX_REASON_CHARS, 512 characters).
MAX_REFUSAL_BODY_BYTES = 4 * KiB
# An idle pooled connection is dropped after this, well before a server closes it as idle
# (transport/guard.py, 10 s): reusing a connection the server is closing at that moment fails.
KEEPALIVE_S = 5.0

@dataclasses.dataclass(frozen=True, slots=True)
class ClientOptions:
    """Transport-side bounds of the client (wire-side ones, incl. the read timeout, are in `Limits`)."""

    connect_timeout_s: float = CONNECT_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER
    upload_chunk_bytes: int = UPLOAD_CHUNK_BYTES
    max_reply_frames: int = MAX_REPLY_FRAMES
    min_reply_limit_bytes: int = MIN_REPLY_LIMIT_BYTES
    keepalive_s: float = KEEPALIVE_S
    # Local IP outbound connections bind to (None: the kernel chooses by route).
    source_address: str | None = None

    def __post_init__(self) -> None:
        if not self.connect_timeout_s > 0:
            raise ValueError(f"ClientOptions.connect_timeout_s must be > 0, got {self.connect_timeout_s!r}")
        if not self.keepalive_s > 0:
            raise ValueError(f"ClientOptions.keepalive_s must be > 0, got {self.keepalive_s!r}")
        for name in ("max_connections", "max_connections_per_peer", "upload_chunk_bytes", "max_reply_frames",
                     "min_reply_limit_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"ClientOptions.{name} must be a positive int, got {value!r}")


Payload = bytes | bytearray | memoryview | AsyncIterable[bytes]  # or any C-contiguous buffer


class TransportError(Exception):
    """A send failed; `url` says where to."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class PeerRefused(TransportError):
    """The peer answered with an HTTP error; `status` and its `reason` text say why."""

    def __init__(self, url: str, status: int, reason: str) -> None:
        super().__init__(url, f"refused with {status}: {reason}")
        self.status = status
        self.reason = reason


class PeerUnreachable(TransportError):
    """No answer: connection refused, reset or stalled, or a deadline passed."""


class StreamedReply:
    """One authenticated reply frame of a streamed kind, read whole, its payload not yet handed
    over (`PeerClient.send_for_stream`). `head` is the message without its payload, `payload_length`
    its size. `feed(write)` (a worker thread's work) gives `write` each received piece of the
    payload in order, uncopied, as the frame decoder hashes it, and raises RemoteProtocolError
    at the end if the pieces do not match the authenticated digest or anything follows the frame:
    `write` has then seen bytes that are not the peer's, and its caller discards all of them."""

    def __init__(self, decoder: FrameDecoder, header: FrameHeader, now_unix: float) -> None:
        self._decoder = decoder
        self._now_unix = now_unix
        self.sender = header.sender
        self.head = header.head
        self.payload_length = header.payload_length

    @classmethod
    def read(cls, pieces: list[bytes], decoder: FrameDecoder, reply_kind: MessageKind,
             now_unix: float) -> StreamedReply:
        """The reply in the body `pieces` (whole, as received): its frame header authenticated
        now (a few hundred bytes and a MAC), its payload left in the pieces. `decoder` streams
        `reply_kind`; RemoteProtocolError if the body does not start with such a frame."""
        for piece in pieces:
            if piece:  # b"" is the decoder's end of stream, given once below
                decoder.receive_data(piece)
        decoder.receive_data(b"")
        event = decoder.next_event(now_unix=now_unix)
        if not isinstance(event, FrameHeader) or event.head.KIND is not reply_kind:
            raise RemoteProtocolError(f"the reply is not a {reply_kind.name} frame", 400)
        return cls(decoder, event, now_unix)

    def feed(self, write: Callable[[bytes | bytearray | memoryview], None]) -> None:
        # The whole body was given: a short one fails in the decoder (400), a wrong one at its end (401).
        if not isinstance(self._decoder.stream_payload(write, now_unix=self._now_unix), FrameEnd):
            raise RemoteProtocolError("a streamed reply ended inside its payload", 400)
        if self._decoder.next_event(now_unix=self._now_unix) is not CLOSED:
            raise RemoteProtocolError("the reply holds more than its one frame", 400)


class PeerClient:
    """Sends messages to peers over one pooled `aiohttp.ClientSession`."""

    def __init__(
        self,
        auth: AuthContext,
        verifier: FrameVerifier,
        *,
        limits: Limits = DEFAULT_LIMITS,
        counters: TrafficCounters | None = None,
        executor: Executor | None = None,
        wall_clock: Callable[[], float] = time.time,
        options: ClientOptions = ClientOptions(),
        tls: SiteTls | None = None,
    ) -> None:
        """`tls`: speak to peers over mutual TLS only (https URLs; plain http is refused)."""
        self._auth = auth
        self._tls = tls
        self._verifier = verifier
        self.limits = limits
        self.counters = counters if counters is not None else TrafficCounters()
        self._failures = FailureStreaks(log, "send to", "answered again")  # one line per streak, not per request
        self._executor = executor
        self._wall_clock = wall_clock
        self.options = options
        self._session: aiohttp.ClientSession | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        options = self.options
        local_addr = (options.source_address, 0) if options.source_address is not None else None
        connector = aiohttp.TCPConnector(limit=options.max_connections, limit_per_host=options.max_connections_per_peer,
                                         local_addr=local_addr, keepalive_timeout=options.keepalive_s)
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=options.connect_timeout_s,
                                        sock_read=self.limits.read_timeout_s)
        # auto_decompress off: a peer's gzip reply must not inflate past our byte counts.
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> PeerClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def cleanup_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """For `app.cleanup_ctx.append(client.cleanup_ctx)`: the session lives as long as the app."""
        app[PEER_CLIENT] = self
        await self.start()
        yield
        await self.close()

    @property
    def max_reply_bytes(self) -> int:
        """Largest reply body accepted: one frame of the largest kind (replies answer requests, and
        only catch-up replies are big), or a batch of small ones."""
        largest_payload = max(self.limits.max_payload_bytes.values(), default=0)
        largest_frame = FIXED_HEADER_BYTES + self.limits.max_header_map_bytes + MAC_BYTES + largest_payload
        return max(largest_frame, self.options.min_reply_limit_bytes)

    # ---- sending ----------------------------------------------------------------------------

    async def send(self, base_url: str, *messages: Message, peer: str | None = None,
                   deadline_s: float | None = None) -> list[Message]:
        """Post `messages` (all of one kind) in one body; return the peer's replies in order.

        `peer`: the receiver's node id, which every frame names inside its MAC (None: "any member",
        accepted only for the kinds in wire.auth.ANY_RECIPIENT_KINDS)."""
        if not messages:
            raise LocalProtocolError("send needs at least one message")
        kind = messages[0].KIND
        if any(m.KIND is not kind for m in messages):
            raise LocalProtocolError("one body carries frames of one kind; send the others separately")
        frames = [await self._encode(m, peer or ANY_MEMBER) for m in messages]
        body = frames[0] if len(frames) == 1 else b"".join(frames)
        if len(body) <= INLINE_BODY_MAX_BYTES:
            chunks: AsyncIterable[bytes | memoryview] | bytes = body
        else:
            chunks = _slices(memoryview(body), self.options.upload_chunk_bytes)
        return await self._post(base_url.rstrip("/") + kind_path(kind), chunks, len(body), peer, deadline_s)

    async def send_for_stream(self, base_url: str, message: Message, *, reply_kind: MessageKind,
                              peer: str | None = None, deadline_s: float | None = None) -> StreamedReply:
        """Post `message`; its reply must be one frame of the streamable `reply_kind` with a known
        length of at most `WHOLE_REPLY_MAX_BYTES` (a snapshot chunk). The reply is read whole and its
        header authenticated here; its payload is neither joined nor hashed yet: `StreamedReply.feed`
        hands it over piece by piece as it is checked, so the caller hashes and copies each piece
        where it lies, while it is in cache."""
        frame = await self._encode(message, peer or ANY_MEMBER)
        return await self._post(base_url.rstrip("/") + kind_path(message.KIND), frame, len(frame), peer, deadline_s,
                                read=functools.partial(self._read_streamed, reply_kind))

    async def send_stream(self, base_url: str, head: Message, payload: Payload, *,
                          payload_length: int | None = None, payload_digest: bytes | None = None,
                          peer: str | None = None, deadline_s: float | None = None) -> list[Message]:
        """Upload one large payload as a streamed frame of `head`'s kind.

        `head` is the message with an empty payload (`message.without_payload()`). For a bytes-like
        payload, length and digest (BLAKE3) are computed here (in the thread pool); an async iterator must
        come with both, since the authenticated frame header carries them before the first byte.
        """
        loop = asyncio.get_running_loop()
        if not isinstance(payload, AsyncIterable):  # any buffer: bytes, bytearray, memoryview, ndarray
            view = memoryview(payload).cast("B")
            if payload_length is not None and payload_length != len(view):
                raise LocalProtocolError(f"payload_length {payload_length} != len(payload) {len(view)}")
            payload_length = len(view)
            if payload_digest is None:
                payload_digest = await loop.run_in_executor(self._executor, lambda: content_digest.digest(view))
            source: AsyncIterable[bytes | memoryview] = _slices(view, self.options.upload_chunk_bytes)
        else:
            if payload_length is None or payload_digest is None:
                raise LocalProtocolError("a streamed payload from an iterator needs payload_length and payload_digest")
            source = payload
        head_bytes = encode_frame_head(head, self._auth, now_unix=self._wall_clock(), nonce=os.urandom(NONCE_BYTES),
                                       payload_length=payload_length, payload_digest=payload_digest,
                                       to=peer or ANY_MEMBER)
        misuse: list[LocalProtocolError] = []
        body = _exactly(head_bytes, source, payload_length, misuse)
        try:
            return await self._post(base_url.rstrip("/") + kind_path(head.KIND), body,
                                    len(head_bytes) + payload_length, peer, deadline_s)
        except TransportError:
            if misuse:
                raise misuse[0] from None
            raise

    async def send_sequence(self, base_url: str, frames: AsyncIterable[Message], *, peer: str | None = None,
                            deadline_s: float | None = None) -> list[Message]:
        """Post the messages `frames` yields (the first names the route) as one chunked body.

        Each message is encoded (in the thread pool when big) only when the socket has taken the
        previous one, so memory holds one frame whatever the body's size. An exception raised by
        `frames` aborts the upload and is raised here unchanged.
        """
        iterator = aiter(frames)
        try:
            first = await anext(iterator)
        except StopAsyncIteration:
            raise LocalProtocolError("send_sequence needs at least one message") from None
        to = peer or ANY_MEMBER
        failure: list[BaseException] = []

        async def body() -> AsyncIterator[bytes | memoryview]:
            message: Message | None = first
            while message is not None:
                frame = await self._encode(message, to)
                view = memoryview(frame)
                for start in range(0, len(view), self.options.upload_chunk_bytes):
                    yield view[start:start + self.options.upload_chunk_bytes]
                del view, frame
                try:
                    message = await anext(iterator)
                except StopAsyncIteration:
                    message = None
                except Exception as error:  # the producer failed: stop the upload, report its error
                    failure.append(error)  # (not a cancellation: aiohttp cancels the body when the peer refuses)
                    raise

        try:
            replies = await self._post(base_url.rstrip("/") + kind_path(first.KIND), body(), None, peer, deadline_s)
        except TransportError:
            if failure:
                raise failure[0] from None
            raise
        if failure:
            raise failure[0]
        return replies

    async def _encode(self, message: Message, to: str) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        now_unix = self._wall_clock()
        if approx_payload_bytes(message) < INLINE_ENCODE_MAX_BYTES:
            return encode_frame(message, self._auth, now_unix=now_unix, nonce=nonce, to=to)
        loop = asyncio.get_running_loop()
        encode = functools.partial(encode_frame, message, self._auth, now_unix=now_unix, nonce=nonce, to=to)
        return await loop.run_in_executor(self._executor, encode)

    async def _post(self, url: str, body: AsyncIterable[bytes | memoryview] | bytes, length: int | None,
                    peer: str | None, deadline_s: float | None, read: Callable[..., Awaitable[Any]] | None = None,
                    ) -> Any:
        """POST `body` (`length` None: unknown, sent with chunked transfer encoding); the reply is
        `read(response, traffic)` (default: the reply frames, decoded)."""
        if self._session is None:
            raise LocalProtocolError("PeerClient is not started")
        peer_key = peer or _origin(url)
        tls_options: dict[str, object] = {}
        if self._tls is not None:
            if not url.startswith("https://"):
                self.counters.refused(peer_key, "plain http refused")
                raise PeerUnreachable(url, "plain http is refused: this site speaks to peers over mutual TLS only "
                                           "(the peer must advertise an https:// URL)")
            # With the peer's node id known, the handshake fails unless its certificate names it:
            # nothing is sent to a site that is not the one we meant.
            tls_options = {"ssl": self._tls.client_context(peer), "server_hostname": peer or None}
        traffic = self.counters.peer(peer_key)
        traffic.requests_sent += 1
        loop = asyncio.get_running_loop()
        stall_s = self.limits.read_timeout_s
        headers = {SENDER_HEADER: self._auth.sender, "Content-Type": FRAME_CONTENT_TYPE}
        if length is not None:
            headers["Content-Length"] = str(length)
        try:
            async with asyncio.timeout(deadline_s) as deadline, asyncio.timeout(stall_s) as stall:
                if isinstance(body, bytes):
                    data: object = body
                    traffic.bytes_sent += len(body)
                else:
                    # Every chunk aiohttp takes proves the previous one drained: push the stall
                    # guard forward. A peer that stops reading trips it after `stall_s`.
                    data = _counted(body, traffic, lambda: stall.reschedule(loop.time() + stall_s))
                # Big bodies ask first (Expect: 100-continue): a refusal decidable from the headers
                # (413, 429, 404) then costs no body bytes and cannot race our upload.
                async with self._session.post(url, data=data, headers=headers,
                                              expect100=length is None or length > INLINE_BODY_MAX_BYTES,
                                              **tls_options) as response:  # type: ignore[arg-type]
                    stall.reschedule(None)  # from here on sock_read bounds each read
                    self._failures.succeeded(peer_key)  # it answers: a streak of failures ends (one line)
                    if response.status != 200:
                        reason = (await response.content.read(MAX_REFUSAL_BODY_BYTES)).decode("utf-8", "replace")
                        self.counters.refused(peer_key, f"{response.status} {reason}")
                        raise PeerRefused(url, response.status, reason)
                    return await (read or self._read_replies)(response, traffic)
        except TimeoutError as error:
            if deadline.expired():
                which = "deadline"
            elif isinstance(error, aiohttp.ConnectionTimeoutError):
                which = "connect timeout"  # ClientOptions.connect_timeout_s ([node] connect_timeout_s)
            elif stall.expired() and not isinstance(body, bytes):
                which = "upload stalled"
            else:  # a small body is handed over whole: silence after it is the peer's
                which = "read timeout"
            self._failures.failed(peer_key, f"{url} failed: {which}")
            self.counters.refused(peer_key, f"unreachable: {which}")
            raise PeerUnreachable(url, f"{which}: {error or 'timed out'}") from None
        except (aiohttp.ClientError, OSError) as error:
            self._failures.failed(peer_key, f"{url} failed: {type(error).__name__}: {error}")
            self.counters.refused(peer_key, f"unreachable: {type(error).__name__}")
            raise PeerUnreachable(url, f"{type(error).__name__}: {error}") from None

    async def _read_whole_reply(self, response: aiohttp.ClientResponse, decoder: FrameDecoder,
                                traffic: PeerTraffic) -> list[Message]:
        """A reply of known, bounded length (a snapshot chunk, say): read whole, then decoded in one
        hop to the pool. Decoded as it came, a 4 MiB reply arriving in 64 KiB socket reads would
        cost a hop per read (the decoder's buffer is past the inline size after the first)."""
        assert response.content_length is not None
        pieces = await _read_pieces(response, response.content_length, traffic)
        events = await asyncio.get_running_loop().run_in_executor(
            self._executor, _decode_all, decoder, [*pieces, b""], self._wall_clock())
        replies = []
        for event in events:
            assert isinstance(event, Received)  # the client decoder streams no kind
            replies.append(event.message)
        if len(replies) > self.options.max_reply_frames:
            raise RemoteProtocolError(f"more than {self.options.max_reply_frames} reply frames", 400)
        return replies

    async def _read_streamed(self, reply_kind: MessageKind, response: aiohttp.ClientResponse,
                             traffic: PeerTraffic) -> StreamedReply:
        length = response.content_length
        bound = min(self.max_reply_bytes, WHOLE_REPLY_MAX_BYTES)
        if length is None or length > bound:
            raise RemoteProtocolError(f"a {reply_kind.name} reply must declare a length of at most {bound} bytes, "
                                      f"got {length}", 413)
        pieces = await _read_pieces(response, length, traffic)
        return StreamedReply.read(pieces, FrameDecoder(self._verifier, self.limits, stream_kinds=(reply_kind,)),
                                  reply_kind, self._wall_clock())

    async def _read_replies(self, response: aiohttp.ClientResponse, traffic: PeerTraffic) -> list[Message]:
        decoder = FrameDecoder(self._verifier, self.limits)
        loop = asyncio.get_running_loop()
        replies: list[Message] = []
        received = 0
        limit = self.max_reply_bytes
        if response.content_length is not None and INLINE_DECODE_MAX_BYTES <= response.content_length <= min(
                limit, WHOLE_REPLY_MAX_BYTES):
            return await self._read_whole_reply(response, decoder, traffic)
        while True:
            chunk = await response.content.readany()
            pieces = [chunk]
            size = len(chunk)
            while 0 < size < DECODE_BATCH_BYTES:  # what is already buffered, decoded in one call (not joined)
                more = response.content.read_nowait(DECODE_BATCH_BYTES - size)
                if not more:
                    break
                pieces.append(more)
                size += len(more)
            traffic.bytes_received += size
            received += size
            if received > limit:
                raise RemoteProtocolError(f"reply body exceeds {limit} bytes", 413)
            if size + decoder.buffered_bytes < INLINE_DECODE_MAX_BYTES:
                events = _decode_all(decoder, pieces, self._wall_clock())
            else:
                events = await loop.run_in_executor(self._executor, _decode_all, decoder, pieces, self._wall_clock())
            for event in events:
                assert isinstance(event, Received)  # the client decoder streams no kind
                replies.append(event.message)
            if len(replies) > self.options.max_reply_frames:
                raise RemoteProtocolError(f"more than {self.options.max_reply_frames} reply frames", 400)
            if not chunk:
                return replies


async def _read_pieces(response: aiohttp.ClientResponse, length: int, traffic: PeerTraffic) -> list[bytes]:
    """A reply body of `length` bytes as it arrived, in pieces (not joined)."""
    pieces: list[bytes] = []
    size = 0
    while True:
        chunk = await response.content.readany()
        if not chunk:
            return pieces
        size += len(chunk)
        traffic.bytes_received += len(chunk)
        if size > length:
            raise RemoteProtocolError(f"reply body longer than its Content-Length {length}", 400)
        pieces.append(chunk)


def _decode_all(decoder: FrameDecoder, pieces: list[bytes], now_unix: float) -> list[object]:
    for data in pieces:
        decoder.receive_data(data)
    events = []
    while (event := decoder.next_event(now_unix=now_unix)) is not NEED_DATA and event is not CLOSED:
        events.append(event)
    return events


async def _slices(view: memoryview, size: int) -> AsyncIterator[memoryview]:
    for start in range(0, len(view), size):
        yield view[start:start + size]


async def _exactly(head: bytes, source: AsyncIterable[bytes | memoryview], length: int,
                   misuse: list[LocalProtocolError]) -> AsyncIterator[bytes | memoryview]:
    """The head, then exactly `length` payload bytes from `source`; a mismatch is our bug."""
    yield head
    sent = 0
    async for chunk in source:
        sent += len(chunk)
        if sent > length:
            break
        if chunk:
            yield chunk
    if sent != length:
        misuse.append(LocalProtocolError(f"payload iterator gave {'more' if sent > length else sent} bytes, "
                                         f"declared {length}"))
        raise misuse[-1]


async def _counted(body: AsyncIterable[bytes | memoryview], traffic: PeerTraffic,
                   on_progress: Callable[[], None]) -> AsyncIterator[bytes | memoryview]:
    async for chunk in body:
        on_progress()
        yield chunk
        traffic.bytes_sent += len(chunk)


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or url


PEER_CLIENT: Final = web.AppKey("diloco_peer_client", PeerClient)
