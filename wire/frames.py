"""Framing: messages to authenticated bytes and back, sans-IO (bytes in, events out; no sockets, no clock).

A frame is a fixed 24-byte header, a msgpack header map, a 32-byte MAC, then the raw payload:

    magic "DLCO" | major u8 | minor u8 | kind u16 | flags u32 | map_len u32 | payload_len u64   (big-endian)
    header map (map_len bytes): {"run", "from", "ts", "nonce", "pd", "m": {message fields}}
    mac: HMAC-SHA256(key, fixed header || header map)     (the map's "pd" is BLAKE3 of the payload)
    header map key "to": the recipient's node id ("" only for kinds any member may answer), inside the
    MAC, so a captured frame cannot be replayed to another member
    payload (payload_len bytes)

The MAC covers the payload through its digest, so a receiver authenticates a frame from its first
24 + map_len + 32 bytes, before reading any payload, and checks the payload against "pd" at the end.
Sizes are refused from the fixed header alone (413) before anything is buffered. See docs/WIRE.md.

`FrameDecoder` is incremental: feed it whatever arrived with `receive_data`, then call
`next_event(now_unix=...)` until it returns `NEED_DATA`. Small kinds come out whole as `Received`;
kinds listed in `stream_kinds` come out as `FrameHeader`, `PayloadChunk`..., `FrameEnd`, so a 256 MB
payload never has to sit in memory. Anything wrong with the peer's bytes raises `RemoteProtocolError`
(and the decoder stays failed); any other exception is a bug.
"""

from __future__ import annotations

import enum
import math
import struct
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import msgpack

from wire import digest as content_digest
from wire.auth import ANY_MEMBER, MAC_BYTES, NONCE_BYTES, AuthContext, FrameVerifier, check_run_id, compute_mac
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.limits import DEFAULT_LIMITS, Limits
from wire.messages import MESSAGE_TYPES, U63_MAX, Message, MessageKind, payload_pieces

MAGIC = b"DLCO"
# Major: incompatible layout or semantics (receivers refuse other majors with 426).
# Minor: additive only (new header-map keys, new kinds, new flag bits); receivers accept any minor.
# 2.0: the header map names the recipient ("to"); a 1.x receiver would ignore it and accept a
# frame replayed to it from another member's traffic, so the change is incompatible.
# 3.0: every payload and state digest is BLAKE3 (wire/digest.py), not SHA-256: the "pd" a MAC signs,
# relayed payload names, SnapshotChunk's digest (now the fragment's state digest, no download
# digest of its own). A 2.x node would compute the wrong "pd" for every frame, so the change is
# incompatible; 2.x history: 2.1 streamed contributions, 2.2 relayed log payloads, 2.3 relayed
# payloads streamed (PayloadOpen, PayloadChunk; PayloadPush still accepted).
WIRE_MAJOR = 3
WIRE_MINOR = 0
FIXED_HEADER = struct.Struct(">4sBBHIIQ")
FIXED_HEADER_BYTES = FIXED_HEADER.size  # 24
DIGEST_BYTES = 32
# No flag bits are defined in 1.0. Senders write 0; receivers ignore bits they do not know (the MAC
# still covers them), so a later minor version can add optional meanings.
NO_FLAGS = 0

# Header-map keys. Auth fields live at the top level, message fields under "m", so the two name
# spaces can never collide.
KEY_RUN = "run"
KEY_SENDER = "from"
KEY_TIMESTAMP_MS = "ts"
KEY_NONCE = "nonce"
KEY_PAYLOAD_DIGEST = "pd"
KEY_RECIPIENT = "to"
KEY_MESSAGE = "m"


class Signal(enum.Enum):
    """Non-message results of `FrameDecoder.next_event`."""

    NEED_DATA = "need data"  # feed more bytes with receive_data
    CLOSED = "closed"  # the peer ended the stream cleanly between frames


NEED_DATA = Signal.NEED_DATA
CLOSED = Signal.CLOSED


@dataclass(frozen=True, slots=True)
class Received:
    """A whole, authenticated message (buffered kinds)."""

    sender: str
    sent_at_unix: float
    message: Message


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """Start of an authenticated streamed frame. `head` is the message with an empty payload; the
    payload follows as PayloadChunk events and must be treated as untrusted until FrameEnd."""

    sender: str
    sent_at_unix: float
    head: Message
    payload_length: int


@dataclass(frozen=True, slots=True)
class PayloadChunk:
    """The next bytes of a streamed payload (at most Limits.max_payload_chunk_bytes, at most one
    received piece): the received bytes themselves or a view of them, not a copy."""

    data: bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class FrameEnd:
    """The streamed payload is complete and matches the authenticated digest."""

    payload_digest: bytes


Event = Received | FrameHeader | PayloadChunk | FrameEnd | Signal


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def encode_frame(message: Message, auth: AuthContext, *, now_unix: float, nonce: bytes, to: str = ANY_MEMBER) -> bytes:
    """The complete frame for `message`, stamped with `now_unix` and `nonce` (16 fresh random bytes),
    addressed to node `to` (ANY_MEMBER only for the kinds in ANY_RECIPIENT_KINDS)."""
    field_map, payload = message.to_wire()
    pieces = payload_pieces(payload)
    head = _encode_head(message.KIND, field_map, auth, now_unix=now_unix, nonce=nonce, to=to,
                        payload_length=sum(len(piece) for piece in pieces),  # bytes, or views cast to bytes
                        payload_digest=pieces_digest(pieces))
    return b"".join((head, *pieces))


def pieces_digest(pieces: Collection[bytes | memoryview]) -> bytes:
    """The payload digest ("pd") of a payload given as its pieces (`payload_pieces`), each hashed
    where it lies: the same digest as of their bytes joined."""
    hasher = content_digest.hasher()
    for piece in pieces:
        hasher.update(piece)
    return hasher.digest()


def encode_frame_head(message: Message, auth: AuthContext, *, now_unix: float, nonce: bytes,
                      payload_length: int, payload_digest: bytes, to: str = ANY_MEMBER) -> bytes:
    """Everything of a frame but its payload, for sending a large payload without holding it in memory.

    `message` is the head (a STREAMABLE message with an empty payload, see Message.without_payload);
    the caller writes exactly `payload_length` payload bytes after the returned bytes.
    """
    if not message.STREAMABLE:
        raise LocalProtocolError(f"{type(message).__name__} has no single payload to stream")
    field_map, payload = message.to_wire()
    if payload:
        raise LocalProtocolError("encode_frame_head takes the message without its payload")
    if type(payload_length) is not int or not 0 <= payload_length <= U63_MAX:
        raise LocalProtocolError(f"payload_length must be an int in [0, 2^63), got {payload_length!r}")
    message.check_payload_length(payload_length)
    if type(payload_digest) is not bytes or len(payload_digest) != DIGEST_BYTES:
        raise LocalProtocolError("payload_digest must be the 32-byte BLAKE3 digest of the payload")
    return _encode_head(message.KIND, field_map, auth, now_unix=now_unix, nonce=nonce, to=to,
                        payload_length=payload_length, payload_digest=payload_digest)


def _encode_head(kind: MessageKind, field_map: dict[str, Any], auth: AuthContext, *, now_unix: float,
                 nonce: bytes, to: str, payload_length: int, payload_digest: bytes) -> bytes:
    if not isinstance(auth, AuthContext):
        raise LocalProtocolError("auth must be an AuthContext")
    if not isinstance(now_unix, (int, float)) or not math.isfinite(now_unix) or now_unix < 0:
        raise LocalProtocolError(f"now_unix must be a finite, non-negative time, got {now_unix!r}")
    if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
        raise LocalProtocolError(f"nonce must be {NONCE_BYTES} fresh random bytes")
    if to != ANY_MEMBER:  # receivers refuse ANY_MEMBER for kinds outside ANY_RECIPIENT_KINDS
        check_run_id(to, what="recipient")
    header_map = {
        KEY_RUN: auth.run_id,
        KEY_SENDER: auth.sender,
        KEY_TIMESTAMP_MS: round(now_unix * 1000),
        KEY_NONCE: nonce,
        KEY_PAYLOAD_DIGEST: payload_digest,
        KEY_RECIPIENT: to,
        KEY_MESSAGE: field_map,
    }
    map_bytes = msgpack.packb(header_map, use_bin_type=True)
    fixed = FIXED_HEADER.pack(MAGIC, WIRE_MAJOR, WIRE_MINOR, int(kind), NO_FLAGS, len(map_bytes), payload_length)
    signed = fixed + map_bytes
    return signed + compute_mac(auth.key, signed)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


class _State(enum.Enum):
    FIXED_HEADER = "fixed header"
    HEADER_MAP = "header map"
    BUFFERED_PAYLOAD = "buffered payload"
    STREAMED_PAYLOAD = "streamed payload"


@dataclass(frozen=True, slots=True)
class _Pending:
    """What the decoder knows about the frame in progress."""

    kind: MessageKind
    map_length: int
    payload_length: int


@dataclass(frozen=True, slots=True)
class _Authenticated:
    sender: str
    sent_at_unix: float
    payload_digest: bytes
    message_fields: dict[str, Any]


class _ByteQueue:
    """Received bytes not yet decoded, kept as the pieces they arrived in. Taking a range copies it
    once (one join of the pieces it spans), or not at all when it is exactly one whole piece: a
    payload is copied once on its way from the socket to its message, not into a growing buffer
    and then out of it. Small pieces (a peer trickling bytes) are gathered into one bytearray of
    up to GATHER_BYTES, so what the queue holds costs its bytes, not an object per read."""

    SMALL_PIECE_BYTES = 64 * 1024
    GATHER_BYTES = 1 << 20

    def __init__(self) -> None:
        self._pieces: deque[bytes | bytearray] = deque()
        self._offset = 0  # bytes of the first piece already taken
        self._size = 0
        self._lent: bytearray | None = None  # a gathering piece a view was handed out of: grows no more

    def __len__(self) -> int:
        return self._size

    def append(self, data: bytes | bytearray | memoryview) -> None:
        size = len(data)
        if not size:
            return
        self._size += size
        if size < self.SMALL_PIECE_BYTES:
            last = self._pieces[-1] if self._pieces else None
            if type(last) is bytearray and len(last) < self.GATHER_BYTES and last is not self._lent:
                last += data
            else:
                self._pieces.append(bytearray(data))
        else:  # bytes are immutable: kept as they are; anything else is the caller's and may change
            self._pieces.append(data if type(data) is bytes else bytes(data))

    def peek(self, n: int) -> bytes:
        """The first `n` bytes (n <= len), left in place."""
        parts: list[bytes | memoryview] = []
        need, offset = n, self._offset
        for piece in self._pieces:
            if not need:
                break
            take = min(need, len(piece) - offset)
            parts.append(piece if offset == 0 and take == len(piece) else memoryview(piece)[offset:offset + take])
            need -= take
            offset = 0
        if len(parts) == 1 and type(parts[0]) is bytes:
            return parts[0]  # type: ignore[return-value]
        joined = b"".join(parts)
        for part in parts:  # a view of a gathering bytearray would stop it from growing
            if type(part) is memoryview:
                part.release()
        return joined

    def take_view(self, n: int) -> bytes | bytearray | memoryview:
        """Up to `n` of the first bytes (n >= 1, the queue not empty), removed, without copying:
        what is left of the first piece, or a view of it (a gathering bytearray a view is taken
        of grows no more: a view would stop it from resizing)."""
        piece = self._pieces[0]
        take = min(n, len(piece) - self._offset)
        if self._offset == 0 and take == len(piece):
            self._pieces.popleft()
            data: bytes | bytearray | memoryview = piece
        else:
            if type(piece) is bytearray:
                self._lent = piece
            data = memoryview(piece)[self._offset:self._offset + take]
            self._offset += take
            if self._offset == len(piece):
                self._pieces.popleft()
                self._offset = 0
        if self._lent is not None and (not self._pieces or self._pieces[-1] is not self._lent):
            self._lent = None  # no longer the gathering piece: nothing to protect
        self._size -= take
        return data

    def take(self, n: int) -> bytes:
        """The first `n` bytes (n <= len), removed."""
        data = self.peek(n)
        self._size -= n
        while n:
            available = len(self._pieces[0]) - self._offset
            if n < available:
                self._offset += n
                break
            self._pieces.popleft()
            self._offset = 0
            n -= available
        return data


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


class FrameDecoder:
    """Incremental decoder of a stream of frames from one peer connection or request body."""

    def __init__(self, verifier: FrameVerifier, limits: Limits = DEFAULT_LIMITS, *,
                 stream_kinds: Collection[MessageKind] = ()) -> None:
        if not isinstance(verifier, FrameVerifier):
            raise LocalProtocolError("FrameDecoder needs a FrameVerifier (shared by all connections)")
        for kind in stream_kinds:
            if not MESSAGE_TYPES[MessageKind(kind)].STREAMABLE:
                raise LocalProtocolError(f"{MessageKind(kind).name} has no single payload and cannot be streamed")
        self._verifier = verifier
        self._limits = limits
        self._stream_kinds = frozenset(MessageKind(kind) for kind in stream_kinds)
        self._buffer = _ByteQueue()
        self._end_of_stream = False
        self._state = _State.FIXED_HEADER
        self._pending: _Pending | None = None
        self._authenticated: _Authenticated | None = None
        self._remaining = 0
        self._hasher: Any = None
        self._failure: RemoteProtocolError | None = None
        self._first_sender: str | None = None

    @property
    def authenticated_sender(self) -> str | None:
        """The sender of the first frame whose header authenticated (before its payload arrived);
        None until then. The transport uses it to give a stream its slot as soon as it has earned it."""
        return self._first_sender

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet turned into events."""
        return len(self._buffer)

    @property
    def between_frames(self) -> bool:
        """True when no frame is partially decoded (a clean place for the stream to end)."""
        return self._state is _State.FIXED_HEADER and not len(self._buffer)

    def receive_data(self, data: bytes) -> None:
        """Add received bytes; `b""` means the peer ended the stream."""
        if self._end_of_stream:
            raise LocalProtocolError("receive_data after end of stream")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise LocalProtocolError(f"receive_data takes bytes, got {type(data).__name__}")
        if len(data) == 0:
            self._end_of_stream = True
        elif self._failure is None:  # a failed stream is dead: keep nothing more from it
            self._buffer.append(data)

    def next_event(self, *, now_unix: float) -> Event:
        """The next event, `NEED_DATA`, or `CLOSED`. `now_unix` is this node's wall clock (only used
        for the timestamp window of frames whose header completes during this call)."""
        if not isinstance(now_unix, (int, float)) or not math.isfinite(now_unix):
            raise LocalProtocolError(f"now_unix must be a finite wall-clock time, got {now_unix!r}")
        if self._failure is not None:
            raise RemoteProtocolError(f"stream already failed: {self._failure}", self._failure.status_hint)
        try:
            return self._advance(now_unix)
        except RemoteProtocolError as error:
            self._failure = error
            raise

    # -- state machine ------------------------------------------------------------------------

    def _advance(self, now_unix: float) -> Event:
        if self._state is _State.FIXED_HEADER:
            if len(self._buffer) < FIXED_HEADER_BYTES:
                return self._short(allow_close=not len(self._buffer))
            self._pending = self._parse_fixed_header(self._buffer.peek(FIXED_HEADER_BYTES))
            self._state = _State.HEADER_MAP
        if self._state is _State.HEADER_MAP:
            return self._header_map(now_unix)
        if self._state is _State.BUFFERED_PAYLOAD:
            return self._buffered_payload()
        return self._streamed_payload()

    def _short(self, *, allow_close: bool = False) -> Signal:
        if not self._end_of_stream:
            return NEED_DATA
        if allow_close:
            return CLOSED
        raise RemoteProtocolError(f"stream ended inside a frame ({self._state.value}, "
                                  f"{len(self._buffer)} bytes buffered)", 400)

    def _parse_fixed_header(self, fixed: bytes) -> _Pending:
        magic, major, minor, kind_id, _flags, map_length, payload_length = FIXED_HEADER.unpack(fixed)
        if magic != MAGIC:
            raise RemoteProtocolError(f"not a diloco-node frame (magic {magic!r}, expected {MAGIC!r})", 400)
        if major != WIRE_MAJOR:
            raise RemoteProtocolError(f"wire version {major}.{minor} is not supported: this node speaks wire "
                                      f"{WIRE_MAJOR}.{WIRE_MINOR} (any {WIRE_MAJOR}.x); run the same major "
                                      "version of diloco-node on every node", 426)
        try:
            kind = MessageKind(kind_id)
        except ValueError:
            raise RemoteProtocolError(f"unknown message kind {kind_id}", 400) from None
        if map_length == 0:
            raise RemoteProtocolError("empty header map", 400)
        if map_length > self._limits.max_header_map_bytes:
            raise RemoteProtocolError(f"header map of {map_length} bytes exceeds the limit of "
                                      f"{self._limits.max_header_map_bytes}", 413)
        max_payload = self._limits.max_payload(kind)
        if payload_length > max_payload:
            raise RemoteProtocolError(f"{kind.name} payload of {payload_length} bytes exceeds the limit of "
                                      f"{max_payload}", 413)
        return _Pending(kind=kind, map_length=map_length, payload_length=payload_length)

    def _header_map(self, now_unix: float) -> Event:
        pending = self._pending
        assert pending is not None
        map_end = FIXED_HEADER_BYTES + pending.map_length
        if len(self._buffer) < map_end + MAC_BYTES:
            return self._short()
        head = self._buffer.take(map_end + MAC_BYTES)
        signed, mac = head[:map_end], head[map_end:]
        authenticated = self._authenticate(pending, signed, mac, now_unix)
        self._remaining = pending.payload_length
        self._hasher = content_digest.hasher()
        if pending.kind in self._stream_kinds:
            head = self._build(pending.kind, authenticated.message_fields, b"")
            try:
                head.check_payload_length(pending.payload_length)
            except LocalProtocolError as error:
                raise RemoteProtocolError(f"invalid {pending.kind.name}: {error}", 400) from None
            self._authenticated = authenticated
            self._state = _State.STREAMED_PAYLOAD
            return FrameHeader(sender=authenticated.sender, sent_at_unix=authenticated.sent_at_unix,
                               head=head, payload_length=pending.payload_length)
        self._authenticated = authenticated
        self._state = _State.BUFFERED_PAYLOAD
        return self._buffered_payload()

    def _authenticate(self, pending: _Pending, signed: bytes, mac: bytes, now_unix: float) -> _Authenticated:
        map_bytes = signed[FIXED_HEADER_BYTES:]
        try:
            # The input length is already bounded by max_header_map_bytes (unpackb derives its
            # container limits from it); raw=False decodes str as UTF-8, strict_map_key allows only
            # str/bytes keys, ext types are refused.
            header_map = msgpack.unpackb(map_bytes, raw=False, strict_map_key=True, use_list=False,
                                         ext_hook=_refuse_ext)
        except (ValueError, msgpack.UnpackException) as error:
            raise RemoteProtocolError(f"header map is not valid msgpack: {type(error).__name__}: {error}", 400) from None
        if type(header_map) is not dict:
            raise RemoteProtocolError(f"header map must be a msgpack map, got {type(header_map).__name__}", 400)
        run_id = _field(header_map, KEY_RUN, str)
        sender = _field(header_map, KEY_SENDER, str)
        sent_at_ms = _field(header_map, KEY_TIMESTAMP_MS, int)
        nonce = _field(header_map, KEY_NONCE, bytes)
        payload_digest = _field(header_map, KEY_PAYLOAD_DIGEST, bytes)
        recipient = _field(header_map, KEY_RECIPIENT, str)
        message_fields = _field(header_map, KEY_MESSAGE, dict)
        try:
            check_run_id(run_id, what="header map 'run'")
            check_run_id(sender, what="header map 'from'")
            if recipient != ANY_MEMBER:
                check_run_id(recipient, what="header map 'to'")
        except LocalProtocolError as error:
            raise RemoteProtocolError(str(error), 400) from None
        if not 0 <= sent_at_ms <= U63_MAX:
            raise RemoteProtocolError(f"header map 'ts' {sent_at_ms} out of range", 400)
        if len(nonce) != NONCE_BYTES:
            raise RemoteProtocolError(f"header map 'nonce' must be {NONCE_BYTES} bytes, got {len(nonce)}", 400)
        if len(payload_digest) != DIGEST_BYTES:
            raise RemoteProtocolError(f"header map 'pd' must be {DIGEST_BYTES} bytes, got {len(payload_digest)}", 400)
        self._verifier.verify(run_id=run_id, sender=sender, sent_at_ms=sent_at_ms, nonce=nonce,
                              signed_bytes=signed, mac=mac, now_unix=now_unix, recipient=recipient,
                              kind=pending.kind)
        if self._first_sender is None:
            self._first_sender = sender
        return _Authenticated(sender=sender, sent_at_unix=sent_at_ms / 1000, payload_digest=payload_digest,
                              message_fields=message_fields)

    def _buffered_payload(self) -> Event:
        pending, authenticated = self._pending, self._authenticated
        assert pending is not None and authenticated is not None
        if len(self._buffer) < pending.payload_length:
            return self._short()
        payload = self._buffer.take(pending.payload_length)
        if content_digest.digest(payload) != authenticated.payload_digest:
            raise RemoteProtocolError(f"{pending.kind.name} payload from {authenticated.sender!r} does not "
                                      "match its authenticated digest", 401)
        message = self._build(pending.kind, authenticated.message_fields, payload)
        self._finish_frame()
        return Received(sender=authenticated.sender, sent_at_unix=authenticated.sent_at_unix, message=message)

    def _streamed_payload(self) -> Event:
        authenticated = self._authenticated
        assert authenticated is not None
        if self._remaining == 0:
            if self._hasher.digest() != authenticated.payload_digest:
                raise RemoteProtocolError(f"streamed payload from {authenticated.sender!r} does not match its "
                                          "authenticated digest: discard what was received", 401)
            self._finish_frame()
            return FrameEnd(payload_digest=authenticated.payload_digest)
        if not len(self._buffer):
            return self._short()
        # One received piece (or the part of it this frame owns) per event, never joined: the
        # consumer hashes or copies it where it lies, while it is still in cache.
        data = self._buffer.take_view(min(self._remaining, self._limits.max_payload_chunk_bytes))
        self._hasher.update(data)
        self._remaining -= len(data)
        return PayloadChunk(data)

    def stream_payload(self, write: Callable[[bytes | bytearray | memoryview], None], *, now_unix: float) -> Event:
        """The data of the `PayloadChunk` events of the streamed payload in progress, up to its end
        or to the bytes received so far, handed to `write` in one call (each hashed before it is
        handed over), then what `next_event` returns next: `FrameEnd` once the payload matched its
        digest, or `NEED_DATA`. What `next_event` does, without an event object per piece."""
        if self._failure is not None:
            raise RemoteProtocolError(f"stream already failed: {self._failure}", self._failure.status_hint)
        if self._state is not _State.STREAMED_PAYLOAD:
            raise LocalProtocolError("stream_payload outside a streamed payload")
        buffer, limit, hasher = self._buffer, self._limits.max_payload_chunk_bytes, self._hasher
        while self._remaining and len(buffer):
            data = buffer.take_view(min(self._remaining, limit))
            hasher.update(data)
            self._remaining -= len(data)
            write(data)
        if self._remaining:
            try:
                return self._short()
            except RemoteProtocolError as error:
                self._failure = error
                raise
        return self.next_event(now_unix=now_unix)  # the payload's end: its digest checked

    def _build(self, kind: MessageKind, message_fields: dict[str, Any], payload: bytes) -> Message:
        try:
            return MESSAGE_TYPES[kind].from_wire(message_fields, payload)
        except LocalProtocolError as error:
            raise RemoteProtocolError(f"invalid {kind.name}: {error}", 400) from None

    def _finish_frame(self) -> None:
        self._state = _State.FIXED_HEADER
        self._pending = None
        self._authenticated = None
        self._hasher = None
        self._remaining = 0


def _field(header_map: dict[Any, Any], key: str, expected: type) -> Any:
    if key not in header_map:
        raise RemoteProtocolError(f"header map lacks {key!r}", 400)
    value = header_map[key]
    if type(value) is not expected:
        raise RemoteProtocolError(f"header map {key!r} must be {expected.__name__}, got {type(value).__name__}", 400)
    return value


def decode_frame(data: bytes, verifier: FrameVerifier, *, now_unix: float, limits: Limits = DEFAULT_LIMITS) -> Received:
    """Decode a body that holds exactly one whole frame (small request/response bodies)."""
    decoder = FrameDecoder(verifier, limits)
    if data:
        decoder.receive_data(data)
    decoder.receive_data(b"")
    event = decoder.next_event(now_unix=now_unix)
    if not isinstance(event, Received):
        raise RemoteProtocolError("body holds no frame", 400)
    if decoder.next_event(now_unix=now_unix) is not CLOSED:
        raise RemoteProtocolError("body holds more than one frame", 400)
    return event
