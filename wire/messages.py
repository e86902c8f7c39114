"""Every message two diloco-node peers exchange, as frozen, validated values.

A message that exists is valid: each class checks its fields in `__post_init__` and raises
`LocalProtocolError` when we try to build an invalid one. Decoding a peer's frame goes through the
same constructors (`from_wire`), and `wire.frames` turns those errors into `RemoteProtocolError`.

Each kind has a stable numeric id (`MessageKind`) that never changes meaning within a wire major
version. On the wire a message is split in two (`to_wire`): a map of its structured fields (goes into
the frame's msgpack header map) and one opaque payload (raw bytes, never msgpack arrays of numbers).
Kinds with several payload-carrying parts (log entries) concatenate the parts and record each
part's length in the field map.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Self

from wire.errors import LocalProtocolError

# ---------------------------------------------------------------------------------------------
# Format invariants. These are part of what makes a message valid on every node, so they are not
# per-instance limits (those live in wire.limits); changing one needs a new wire minor version.
# ---------------------------------------------------------------------------------------------

# Counters, indices and epochs: non-negative and within int64 so any implementation can hold them.
U63_MAX = 2**63 - 1
# Node ids appear in logs, metrics labels and file names: short printable ASCII, no spaces.
MAX_NODE_ID_CHARS = 64
NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
# Advertise URLs are host:port-sized; anything longer is a mistake or an attack.
MAX_URL_CHARS = 256
URL_PATTERN = re.compile(r"https?://[^\s]+")
# Codec and log-entry kind names are identifiers chosen by us, e.g. "int4-zstd", "commit".
MAX_NAME_CHARS = 32
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]*")
# Human reasons (vote refusals, leave reasons) are for /status and logs; a line, not an essay.
MAX_REASON_CHARS = 512
# Content digests are BLAKE3 (wire/digest.py; wire 3.0), manifest digests SHA-256: 32 bytes either way.
DIGEST_BYTES = 32
# Log entry metadata (contributors, weights, digests) is small structured data; bound its shape so
# a hostile map cannot blow the stack or make equality checks quadratic.
MAX_METADATA_DEPTH = 6
MAX_METADATA_ITEMS = 4096
# A streamed contribution names its tensors up front: at most this many (a 70B model has ~700), each
# name at most this long (the tensor codec's own name bound), each shape at most this many dims.
MAX_STREAM_TENSORS = 1 << 16
MAX_TENSOR_NAME_CHARS = 1024
MAX_TENSOR_NDIM = 32
# Random id shared by the frames of one streamed contribution (or payload), so no frame of another
# stream fits.
STREAM_ID_BYTES = 16
# Batches: one LogAppend / LogReadReply carries at most this many entries (pagination, not a cap on
# the log), and a membership lists at most this many members (sites, not machines).
MAX_ENTRIES_PER_MESSAGE = 1024
MAX_MEMBERS = 1024
# A relay tree (PayloadPush) makes each node send at most this many copies; more is not a tree but
# the holder's broadcast again, and a hostile tree must not make a relay send to a thousand peers.
MAX_RELAY_FANOUT = 16
INT64_MIN = -(2**63)


class MessageKind(enum.IntEnum):
    """Stable numeric ids of the message kinds (the frame header's `kind` field)."""

    FRAGMENT_CONTRIBUTION = 1
    LOG_APPEND = 2
    LOG_ACK = 3
    COMMIT_NOTICE = 4
    VOTE_REQUEST = 5
    VOTE_REPLY = 6
    HEARTBEAT = 7
    HEARTBEAT_ACK = 8
    JOIN_REQUEST = 9
    MEMBERSHIP = 10
    SNAPSHOT_REQUEST = 11
    SNAPSHOT_CHUNK = 12
    LOG_READ_REQUEST = 13
    LOG_READ_REPLY = 14
    LEAVE = 15
    CONTRIBUTION_OPEN = 16  # wire 2.1: a contribution streamed tensor by tensor (docs/WIRE.md)
    CONTRIBUTION_CHUNK = 17
    PAYLOAD_PUSH = 18  # wire 2.2: a relayed log entry's payload bytes (docs/WIRE.md)
    PAYLOAD_FETCH = 19
    PAYLOAD_OPEN = 20  # wire 2.3: a relayed log entry's payload streamed in chunks (docs/WIRE.md)
    PAYLOAD_CHUNK = 21


class Role(enum.StrEnum):
    """What a member does besides replicating the global state and voting."""

    LEARNER = "learner"  # trains and contributes fragment deltas
    WITNESS = "witness"  # replica and voter only: keeps small runs at a voting majority


# ---------------------------------------------------------------------------------------------
# Field validators: type first (so a peer's wrong type can never raise TypeError), then range.
# ---------------------------------------------------------------------------------------------


def _fail(owner: str, name: str, problem: str) -> LocalProtocolError:
    return LocalProtocolError(f"{owner}.{name}: {problem}")


def _uint(owner: str, name: str, value: object, *, maximum: int = U63_MAX) -> None:
    if type(value) is not int:
        raise _fail(owner, name, f"must be an int, got {type(value).__name__}")
    if not 0 <= value <= maximum:
        raise _fail(owner, name, f"must be in [0, {maximum}], got {value}")


def _boolean(owner: str, name: str, value: object) -> None:
    if type(value) is not bool:
        raise _fail(owner, name, f"must be a bool, got {type(value).__name__}")


def _text(owner: str, name: str, value: object, *, max_chars: int, pattern: re.Pattern[str] | None = None,
          allow_empty: bool = False) -> None:
    if type(value) is not str:
        raise _fail(owner, name, f"must be a str, got {type(value).__name__}")
    if not value and not allow_empty:
        raise _fail(owner, name, "must not be empty")
    if len(value) > max_chars:
        raise _fail(owner, name, f"longer than {max_chars} characters ({len(value)})")
    if pattern is not None and value and not pattern.fullmatch(value):
        raise _fail(owner, name, f"{value!r} does not match {pattern.pattern}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(owner, name, "is not encodable as UTF-8 (lone surrogate)") from None


def _node_id(owner: str, name: str, value: object) -> None:
    _text(owner, name, value, max_chars=MAX_NODE_ID_CHARS, pattern=NODE_ID_PATTERN)


def _name(owner: str, name: str, value: object) -> None:
    _text(owner, name, value, max_chars=MAX_NAME_CHARS, pattern=NAME_PATTERN)


def _blob(owner: str, name: str, value: object, *, exact: int | None = None) -> None:
    if type(value) is not bytes:
        raise _fail(owner, name, f"must be bytes, got {type(value).__name__}")
    if exact is not None and len(value) != exact:
        raise _fail(owner, name, f"must be {exact} bytes, got {len(value)}")


def _payload(owner: str, value: object) -> None:
    _blob(owner, "payload", value)


class PayloadParts:
    """A payload to send given as the buffers it lies in, in order (views of the sender's own
    arrays, say), so that it is hashed and written where it is, never joined into one copy. On
    the wire it is exactly the bytes of its parts one after the other (`bytes(parts)`); a
    receiver always gets `bytes`. Only for kinds whose payload a sender serves from memory it
    already holds (`SnapshotChunk`)."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        views = []
        for part in parts:
            view = memoryview(part)
            if not view.c_contiguous:
                raise LocalProtocolError("PayloadParts: a part must be a C-contiguous buffer")
            views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
        self.parts: tuple[memoryview, ...] = tuple(views)
        self.nbytes = sum(view.nbytes for view in views)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PayloadParts):
            other = bytes(other)
        if isinstance(other, (bytes, bytearray, memoryview)):
            return len(other) == self.nbytes and bytes(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to bytes, but views of mutable memory

    def __repr__(self) -> str:
        return f"PayloadParts({len(self.parts)} parts, {self.nbytes} bytes)"


# What a sender may give as a served payload: bytes, any C-contiguous buffer, or its parts.
SendPayload = bytes | bytearray | memoryview | PayloadParts


def payload_pieces(payload: SendPayload) -> tuple[bytes | memoryview, ...]:
    """The buffers a payload's bytes lie in, in order (one for a single buffer): what a sender
    hashes and writes, piece by piece."""
    if isinstance(payload, PayloadParts):
        return payload.parts
    if type(payload) is bytes:
        return (payload,)
    return (_byte_view(payload),)


def _byte_view(value: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(value)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _served_payload(owner: str, value: object) -> None:
    """A payload a sender may give without copying it (bytes, a C-contiguous buffer or
    `PayloadParts`); what a receiver decodes is always bytes."""
    if type(value) is bytes or isinstance(value, PayloadParts):
        return
    if isinstance(value, (bytearray, memoryview)):
        if not memoryview(value).c_contiguous:
            raise _fail(owner, "payload", "must be a C-contiguous buffer")
        return
    raise _fail(owner, "payload", f"must be bytes, a buffer or PayloadParts, got {type(value).__name__}")


def payload_nbytes(payload: SendPayload) -> int:
    """The payload's length in bytes (a buffer's `len` counts its items)."""
    if type(payload) is bytes or isinstance(payload, PayloadParts):
        return len(payload)
    return memoryview(payload).nbytes


# ---------------------------------------------------------------------------------------------
# Metadata: a deep-frozen msgpack-compatible map, so frozen messages stay frozen all the way down.
# ---------------------------------------------------------------------------------------------



class FrozenMap(Mapping[str, Any]):
    """An immutable, hashable str-keyed mapping (the value type of log entry metadata)."""

    __slots__ = ("_items", "_hash")

    def __init__(self, items: Mapping[str, Any] | None = None) -> None:
        self._items: dict[str, Any] = dict(items or {})
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._items.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._items == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"

    def thaw(self) -> dict[str, Any]:
        """A plain dict (nested maps thawed too), as msgpack and JSON want it."""
        return {key: _thaw(value) for key, value in self._items.items()}


def _thaw(value: Any) -> Any:
    if isinstance(value, FrozenMap):
        return value.thaw()
    if isinstance(value, tuple):
        return [_thaw(item) for item in value]
    return value


def freeze_metadata(value: object, *, where: str = "metadata") -> FrozenMap:
    """Validate and deep-freeze a metadata map (lists become tuples, maps become FrozenMaps)."""
    budget = [MAX_METADATA_ITEMS]
    frozen = _freeze(value, where, depth=0, budget=budget)
    if not isinstance(frozen, FrozenMap):
        raise LocalProtocolError(f"{where}: must be a map, got {type(value).__name__}")
    return frozen


def _freeze(value: object, where: str, *, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise LocalProtocolError(f"{where}: more than {MAX_METADATA_ITEMS} items")
    if depth > MAX_METADATA_DEPTH:
        raise LocalProtocolError(f"{where}: nested deeper than {MAX_METADATA_DEPTH}")
    if value is None or type(value) is bool or type(value) is bytes:
        return value
    if type(value) is int:
        if not INT64_MIN <= value <= U63_MAX:
            raise LocalProtocolError(f"{where}: int {value} outside int64")
        return value
    if type(value) is float:
        # NaN breaks equality and digests of replicated state; infinities are never meaningful here.
        if not math.isfinite(value):
            raise LocalProtocolError(f"{where}: float {value} is not finite")
        return value
    if type(value) is str:
        _text("metadata", where, value, max_chars=U63_MAX, allow_empty=True)
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item, f"{where}[{i}]", depth=depth + 1, budget=budget) for i, item in enumerate(value))
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if type(key) is not str:
                raise LocalProtocolError(f"{where}: map keys must be str, got {type(key).__name__}")
            out[key] = _freeze(item, f"{where}.{key}", depth=depth + 1, budget=budget)
        return FrozenMap(out)
    raise LocalProtocolError(f"{where}: unsupported value type {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# Base class and the generic wire mapping for messages made of scalar fields plus one payload.
# ---------------------------------------------------------------------------------------------


class Message:
    """Base of all message kinds. Subclasses are frozen, slotted dataclasses."""

    __slots__ = ()
    KIND: ClassVar[MessageKind]
    # True when the message has a single opaque `payload` field that a receiver may stream.
    STREAMABLE: ClassVar[bool] = False

    def to_wire(self) -> tuple[dict[str, Any], SendPayload]:
        """Split into (field map for the msgpack header map, raw payload bytes: a buffer or
        `PayloadParts` where the sender gave one, see `payload_pieces`)."""
        field_map: dict[str, Any] = {}
        payload = b""
        for spec in fields(self):  # type: ignore[arg-type]
            value = getattr(self, spec.name)
            if spec.name == "payload":
                payload = value
            elif isinstance(value, enum.Enum):
                field_map[spec.name] = value.value
            else:
                field_map[spec.name] = value
        return field_map, payload

    @classmethod
    def from_wire(cls, field_map: Mapping[str, Any], payload: bytes) -> Self:
        """Rebuild from a peer's field map and payload; unknown keys are ignored (additive minors).

        Raises LocalProtocolError naming the bad field; the frame decoder reports it as the peer's.
        """
        kwargs: dict[str, Any] = {}
        for spec in fields(cls):  # type: ignore[arg-type]
            if spec.name == "payload":
                kwargs["payload"] = payload
                continue
            if spec.name not in field_map:
                if spec.default is not MISSING:  # an optional field added in a later minor
                    continue
                raise LocalProtocolError(f"{cls.__name__}.{spec.name}: missing")
            kwargs[spec.name] = field_map[spec.name]
        if "payload" not in kwargs and payload:
            raise LocalProtocolError(f"{cls.__name__} carries no payload, got {len(payload)} bytes")
        return cls(**kwargs)

    def check_payload_length(self, length: int) -> None:
        """Raise LocalProtocolError if a payload of `length` bytes cannot belong to this message's
        fields (lets a streaming receiver refuse a frame from its header alone)."""

    def without_payload(self) -> Self:
        """This message with an empty payload: the head of a streamed frame (see wire.frames)."""
        if not self.STREAMABLE:
            raise LocalProtocolError(f"{type(self).__name__} cannot be streamed")
        return type(self)(**{spec.name: (b"" if spec.name == "payload" else getattr(self, spec.name))
                             for spec in fields(self)})  # type: ignore[arg-type]


def _role(owner: str, value: object) -> Role:
    if isinstance(value, Role):
        return value
    if type(value) is str:
        try:
            return Role(value)
        except ValueError:
            pass
    raise LocalProtocolError(f"{owner}.role: must be one of {[r.value for r in Role]}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Contributions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FragmentContribution(Message):
    """A learner's encoded fragment delta, sent to the lease holder.

    `base_index`/`base_round` name the committed version the delta was computed against (the syncer
    rebases stale ones); `c_steps`/`c_tokens` are the learner's counters since it last received the
    fragment (the syncer caps them: counters come from the network); `codec` names the wire.codecs
    scheme that decodes `payload`.
    """

    KIND: ClassVar[MessageKind] = MessageKind.FRAGMENT_CONTRIBUTION
    STREAMABLE: ClassVar[bool] = True
    fragment: int
    base_index: int
    base_round: int
    c_steps: int
    c_tokens: int
    codec: str
    learner_id: str
    payload: bytes

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("fragment", "base_index", "base_round", "c_steps", "c_tokens"):
            _uint(owner, name, getattr(self, name))
        _name(owner, "codec", self.codec)
        _node_id(owner, "learner_id", self.learner_id)
        _payload(owner, self.payload)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor a streamed contribution will carry: its parameter name and shape (C order)."""

    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _text(owner, "name", self.name, max_chars=MAX_TENSOR_NAME_CHARS)
        if not isinstance(self.shape, (list, tuple)):
            raise _fail(owner, "shape", f"must be a sequence of ints, got {type(self.shape).__name__}")
        if len(self.shape) > MAX_TENSOR_NDIM:
            raise _fail(owner, "shape", f"more than {MAX_TENSOR_NDIM} dimensions ({len(self.shape)})")
        for position, dim in enumerate(self.shape):
            _uint(owner, f"shape[{position}]", dim)
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class ContributionOpen(Message):
    """The first frame of a streamed contribution (wire 2.1): who, against which version, and what
    follows.

    The fields of FragmentContribution, plus `stream` (random bytes every ContributionChunk of this
    contribution repeats), `chunk_elements` (every chunk carries this many values of its tensor,
    except a tensor's last, which carries the rest) and `tensors`, in the order they are sent. The
    receiver checks the list against the fragment's own tensors and shapes before any chunk.
    """

    KIND: ClassVar[MessageKind] = MessageKind.CONTRIBUTION_OPEN
    fragment: int
    base_index: int
    base_round: int
    c_steps: int
    c_tokens: int
    codec: str
    learner_id: str
    stream: bytes
    chunk_elements: int
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("fragment", "base_index", "base_round", "c_steps", "c_tokens"):
            _uint(owner, name, getattr(self, name))
        _name(owner, "codec", self.codec)
        _node_id(owner, "learner_id", self.learner_id)
        _blob(owner, "stream", self.stream, exact=STREAM_ID_BYTES)
        _uint(owner, "chunk_elements", self.chunk_elements)
        if self.chunk_elements < 1:
            raise _fail(owner, "chunk_elements", "must be >= 1")
        if not isinstance(self.tensors, (list, tuple)):
            raise _fail(owner, "tensors", f"must be a sequence of TensorSpec, got {type(self.tensors).__name__}")
        if not 1 <= len(self.tensors) <= MAX_STREAM_TENSORS:
            raise _fail(owner, "tensors", f"must list 1 to {MAX_STREAM_TENSORS} tensors, got {len(self.tensors)}")
        seen: set[str] = set()
        for position, spec in enumerate(self.tensors):
            if not isinstance(spec, TensorSpec):
                raise _fail(owner, f"tensors[{position}]", f"must be a TensorSpec, got {type(spec).__name__}")
            if spec.name in seen:
                raise _fail(owner, f"tensors[{position}]", f"duplicate tensor name {spec.name!r}")
            seen.add(spec.name)
        object.__setattr__(self, "tensors", tuple(self.tensors))

    def to_wire(self) -> tuple[dict[str, Any], bytes]:
        field_map, _ = super(ContributionOpen, self).to_wire()
        field_map["tensors"] = [{"name": t.name, "shape": list(t.shape)} for t in self.tensors]
        return field_map, b""

    @classmethod
    def from_wire(cls, field_map: Mapping[str, Any], payload: bytes) -> Self:
        owner = cls.__name__
        if payload:
            raise LocalProtocolError(f"{owner} carries no payload, got {len(payload)} bytes")
        kwargs: dict[str, Any] = {}
        for spec in fields(cls):  # type: ignore[arg-type]
            if spec.name not in field_map:
                raise LocalProtocolError(f"{owner}.{spec.name}: missing")
            kwargs[spec.name] = field_map[spec.name]
        described = kwargs["tensors"]
        if not isinstance(described, (list, tuple)):
            raise _fail(owner, "tensors", "must be an array of tensor maps")
        if len(described) > MAX_STREAM_TENSORS:
            raise _fail(owner, "tensors", f"more than {MAX_STREAM_TENSORS} tensors ({len(described)})")
        tensors = []
        for position, item in enumerate(described):
            if not isinstance(item, Mapping):
                raise _fail(owner, f"tensors[{position}]", "must be a map")
            for key in ("name", "shape"):
                if key not in item:
                    raise _fail(owner, f"tensors[{position}].{key}", "missing")
            tensors.append(TensorSpec(name=item["name"], shape=item["shape"]))
        kwargs["tensors"] = tuple(tensors)
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class ContributionChunk(Message):
    """One block of one tensor of a streamed contribution (wire 2.1).

    `tensor` indexes the ContributionOpen's `tensors`, `offset` is the first value's position in
    the tensor's flattened (C order) values; `payload` is a one-tensor wire.codecs message of the
    open's codec holding the next min(chunk_elements, remaining) values as a 1-D tensor. Chunks
    come in order: tensor by tensor, offsets ascending without gaps.
    """

    KIND: ClassVar[MessageKind] = MessageKind.CONTRIBUTION_CHUNK
    stream: bytes
    tensor: int
    offset: int
    payload: bytes

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _blob(owner, "stream", self.stream, exact=STREAM_ID_BYTES)
        _uint(owner, "tensor", self.tensor, maximum=MAX_STREAM_TENSORS - 1)
        _uint(owner, "offset", self.offset)
        _payload(owner, self.payload)


# ---------------------------------------------------------------------------------------------
# Replicated log
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One replicated log entry: an outer-step commit, a membership change, or a no-op.

    `kind` is a short name ("commit", "membership", "noop", ...); `metadata` carries its structured
    fields (fragment, round, contributors and weights, state digest); `payload` its bulk bytes
    (the encoded merged outer gradient for a commit).

    A *relayed* entry (wire 2.2, only in LogAppend) carries no bytes: `payload_digest` and
    `payload_size` name the payload, whose bytes travel down a relay tree in PayloadPush frames.
    """

    index: int
    epoch: int
    kind: str
    metadata: Mapping[str, Any]
    payload: bytes
    payload_digest: bytes = b""  # set: a relayed entry (payload empty, bytes come by PayloadPush)
    payload_size: int = 0  # a relayed entry's payload length

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "index", self.index)
        _uint(owner, "epoch", self.epoch)
        _name(owner, "kind", self.kind)
        _payload(owner, self.payload)
        _blob(owner, "payload_digest", self.payload_digest)
        _uint(owner, "payload_size", self.payload_size)
        if self.payload_digest:
            _blob(owner, "payload_digest", self.payload_digest, exact=DIGEST_BYTES)
            if self.payload:
                raise _fail(owner, "payload", "a relayed entry (payload_digest set) carries no bytes")
            if self.payload_size < 1:
                raise _fail(owner, "payload_size", "a relayed entry's payload is at least 1 byte")
        elif self.payload_size:
            raise _fail(owner, "payload_size", "set without payload_digest")
        object.__setattr__(self, "metadata", freeze_metadata(self.metadata, where=f"{owner}.metadata"))

    @property
    def relayed(self) -> bool:
        """True when the bytes are not here but named by `payload_digest` (see the class docstring)."""
        return bool(self.payload_digest)


def _entries(owner: str, value: object) -> tuple[LogEntry, ...]:
    if not isinstance(value, (list, tuple)):
        raise _fail(owner, "entries", f"must be a sequence of LogEntry, got {type(value).__name__}")
    if len(value) > MAX_ENTRIES_PER_MESSAGE:
        raise _fail(owner, "entries", f"more than {MAX_ENTRIES_PER_MESSAGE} entries ({len(value)})")
    for position, entry in enumerate(value):
        if not isinstance(entry, LogEntry):
            raise _fail(owner, f"entries[{position}]", f"must be a LogEntry, got {type(entry).__name__}")
        if position and entry.index != value[position - 1].index + 1:
            raise _fail(owner, f"entries[{position}]", "indices must be consecutive")
    return tuple(value)


def _entries_to_wire(entries: tuple[LogEntry, ...]) -> tuple[list[dict[str, Any]], bytes]:
    # A relayed entry has no `payload_length`: a 2.1 receiver refuses it ("missing") rather than
    # taking it for an entry with an empty payload.
    described = [
        {"index": e.index, "epoch": e.epoch, "kind": e.kind, "metadata": FrozenMap(e.metadata).thaw(),
         **({"payload_digest": e.payload_digest, "payload_size": e.payload_size} if e.relayed
            else {"payload_length": len(e.payload)})}
        for e in entries
    ]
    return described, b"".join(e.payload for e in entries)


def _entries_from_wire(owner: str, described: object, payload: bytes) -> tuple[LogEntry, ...]:
    if not isinstance(described, (list, tuple)):
        raise _fail(owner, "entries", "must be an array of entry maps")
    if len(described) > MAX_ENTRIES_PER_MESSAGE:
        raise _fail(owner, "entries", f"more than {MAX_ENTRIES_PER_MESSAGE} entries ({len(described)})")
    entries: list[LogEntry] = []
    offset = 0
    for position, item in enumerate(described):
        where = f"entries[{position}]"
        if not isinstance(item, Mapping):
            raise _fail(owner, where, "must be a map")
        relayed = "payload_digest" in item
        for key in ("index", "epoch", "kind", "metadata",
                    *(("payload_size",) if relayed else ("payload_length",))):
            if key not in item:
                raise _fail(owner, f"{where}.{key}", "missing")
        if relayed:
            if "payload_length" in item:
                raise _fail(owner, f"{where}.payload_length", "a relayed entry (payload_digest) carries no bytes")
            entries.append(LogEntry(index=item["index"], epoch=item["epoch"], kind=item["kind"],
                                    metadata=item["metadata"], payload=b"",
                                    payload_digest=item["payload_digest"], payload_size=item["payload_size"]))
            continue
        length = item["payload_length"]
        _uint(owner, f"{where}.payload_length", length)
        if offset + length > len(payload):
            raise _fail(owner, f"{where}.payload_length", "runs past the end of the frame payload")
        entries.append(LogEntry(index=item["index"], epoch=item["epoch"], kind=item["kind"],
                                metadata=item["metadata"], payload=payload[offset:offset + length]))
        offset += length
    if offset != len(payload):
        raise _fail(owner, "entries", f"payload has {len(payload) - offset} bytes not claimed by any entry")
    return tuple(entries)


@dataclass(frozen=True, slots=True)
class LogAppend(Message):
    """Leader to replica: append `entries` after (prev_index, prev_epoch); learn `leader_commit`.

    An empty `entries` is allowed (it only carries the commit index forward).
    """

    KIND: ClassVar[MessageKind] = MessageKind.LOG_APPEND
    epoch: int
    leader: str
    prev_index: int
    prev_epoch: int
    entries: tuple[LogEntry, ...]
    leader_commit: int

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "epoch", self.epoch)
        _node_id(owner, "leader", self.leader)
        _uint(owner, "prev_index", self.prev_index)
        _uint(owner, "prev_epoch", self.prev_epoch)
        _uint(owner, "leader_commit", self.leader_commit)
        entries = _entries(owner, self.entries)
        if entries and entries[0].index != self.prev_index + 1:
            raise _fail(owner, "entries", f"first index {entries[0].index} must follow prev_index {self.prev_index}")
        if any(entry.epoch > self.epoch for entry in entries):
            raise _fail(owner, "entries", f"an entry's epoch is newer than the message epoch {self.epoch}")
        object.__setattr__(self, "entries", entries)

    def to_wire(self) -> tuple[dict[str, Any], bytes]:
        described, payload = _entries_to_wire(self.entries)
        return ({"epoch": self.epoch, "leader": self.leader, "prev_index": self.prev_index,
                 "prev_epoch": self.prev_epoch, "entries": described, "leader_commit": self.leader_commit},
                payload)

    @classmethod
    def from_wire(cls, field_map: Mapping[str, Any], payload: bytes) -> Self:
        for key in ("epoch", "leader", "prev_index", "prev_epoch", "entries", "leader_commit"):
            if key not in field_map:
                raise LocalProtocolError(f"{cls.__name__}.{key}: missing")
        return cls(epoch=field_map["epoch"], leader=field_map["leader"], prev_index=field_map["prev_index"],
                   prev_epoch=field_map["prev_epoch"],
                   entries=_entries_from_wire(cls.__name__, field_map["entries"], payload),
                   leader_commit=field_map["leader_commit"])


@dataclass(frozen=True, slots=True)
class LogAck(Message):
    """Replica to leader: whether the append matched, and the highest index it has persisted."""

    KIND: ClassVar[MessageKind] = MessageKind.LOG_ACK
    epoch: int
    follower: str
    index: int
    success: bool

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "epoch", self.epoch)
        _node_id(owner, "follower", self.follower)
        _uint(owner, "index", self.index)
        _boolean(owner, "success", self.success)


@dataclass(frozen=True, slots=True)
class CommitNotice(Message):
    """Leader to replicas: everything up to `commit_index` is committed and may be applied."""

    KIND: ClassVar[MessageKind] = MessageKind.COMMIT_NOTICE
    epoch: int
    leader: str
    commit_index: int

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "epoch", self.epoch)
        _node_id(owner, "leader", self.leader)
        _uint(owner, "commit_index", self.commit_index)


# ---------------------------------------------------------------------------------------------
# Election and lease
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VoteRequest(Message):
    """Candidate to voters: grant me the lease for `epoch`; my log ends at (last epoch, last index)."""

    KIND: ClassVar[MessageKind] = MessageKind.VOTE_REQUEST
    epoch: int
    candidate: str
    last_log_epoch: int
    last_log_index: int
    # A pre-vote asks "would you vote for me at `epoch`?" and changes no state on either side.
    # Part of wire 1.0 (added before any release); absent means False. Not an additive minor
    # field: a receiver ignoring it would cast a real vote (docs/WIRE.md, versioning).
    pre_vote: bool = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "epoch", self.epoch)
        _node_id(owner, "candidate", self.candidate)
        _uint(owner, "last_log_epoch", self.last_log_epoch)
        _uint(owner, "last_log_index", self.last_log_index)
        _boolean(owner, "pre_vote", self.pre_vote)


@dataclass(frozen=True, slots=True)
class VoteReply(Message):
    """Voter to candidate: granted or not, with the voter's reason (shown on /status)."""

    KIND: ClassVar[MessageKind] = MessageKind.VOTE_REPLY
    epoch: int
    voter: str
    granted: bool
    reason: str
    pre_vote: bool = False  # answers a pre-vote request (optional, as in VoteRequest)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "epoch", self.epoch)
        _node_id(owner, "voter", self.voter)
        _boolean(owner, "granted", self.granted)
        _text(owner, "reason", self.reason, max_chars=MAX_REASON_CHARS, allow_empty=True)
        _boolean(owner, "pre_vote", self.pre_vote)


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Lease holder to voters: lease renewal number `seq` for `epoch` (acks are matched by seq)."""

    KIND: ClassVar[MessageKind] = MessageKind.HEARTBEAT
    epoch: int
    leader: str
    seq: int
    commit_index: int

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "epoch", self.epoch)
        _node_id(owner, "leader", self.leader)
        _uint(owner, "seq", self.seq)
        _uint(owner, "commit_index", self.commit_index)


@dataclass(frozen=True, slots=True)
class HeartbeatAck(Message):
    """Voter to lease holder: renewal `seq` acknowledged; my log has reached `match_index`."""

    KIND: ClassVar[MessageKind] = MessageKind.HEARTBEAT_ACK
    epoch: int
    follower: str
    seq: int
    match_index: int

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "epoch", self.epoch)
        _node_id(owner, "follower", self.follower)
        _uint(owner, "seq", self.seq)
        _uint(owner, "match_index", self.match_index)


# Lease renewal is the heartbeat: one message, two names for readers coming from either side.
LeaseRenewal = Heartbeat
LeaseRenewalAck = HeartbeatAck


# ---------------------------------------------------------------------------------------------
# Membership
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JoinRequest(Message):
    """New node to any member: add me. `manifest_digest` is SHA-256 of my run manifest (model,
    fragments, codecs), so a node with a different model is refused before it downloads anything."""

    KIND: ClassVar[MessageKind] = MessageKind.JOIN_REQUEST
    node_id: str
    advertise_url: str
    role: Role
    manifest_digest: bytes
    status_url: str = ""  # optional: where browsers reach my operator routes ("" none / at advertise_url)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _node_id(owner, "node_id", self.node_id)
        _text(owner, "advertise_url", self.advertise_url, max_chars=MAX_URL_CHARS, pattern=URL_PATTERN)
        object.__setattr__(self, "role", _role(owner, self.role))
        _blob(owner, "manifest_digest", self.manifest_digest, exact=DIGEST_BYTES)
        _text(owner, "status_url", self.status_url, max_chars=MAX_URL_CHARS, pattern=URL_PATTERN, allow_empty=True)


@dataclass(frozen=True, slots=True)
class Member:
    """One member of the run as listed in a Membership message."""

    node_id: str
    advertise_url: str
    role: Role
    voter: bool
    status_url: str = ""  # optional, as in JoinRequest

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _node_id(owner, "node_id", self.node_id)
        _text(owner, "advertise_url", self.advertise_url, max_chars=MAX_URL_CHARS, pattern=URL_PATTERN)
        object.__setattr__(self, "role", _role(owner, self.role))
        _boolean(owner, "voter", self.voter)
        _text(owner, "status_url", self.status_url, max_chars=MAX_URL_CHARS, pattern=URL_PATTERN, allow_empty=True)


@dataclass(frozen=True, slots=True)
class Membership(Message):
    """The current member list as of log index `config_index`, plus the run manifest bytes."""

    KIND: ClassVar[MessageKind] = MessageKind.MEMBERSHIP
    STREAMABLE: ClassVar[bool] = True
    epoch: int
    config_index: int
    members: tuple[Member, ...]
    payload: bytes  # the run manifest (opaque here; its SHA-256 is what JoinRequest carries)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "epoch", self.epoch)
        _uint(owner, "config_index", self.config_index)
        if not isinstance(self.members, (list, tuple)):
            raise _fail(owner, "members", f"must be a sequence of Member, got {type(self.members).__name__}")
        if len(self.members) > MAX_MEMBERS:
            raise _fail(owner, "members", f"more than {MAX_MEMBERS} members ({len(self.members)})")
        seen: set[str] = set()
        for position, member in enumerate(self.members):
            if not isinstance(member, Member):
                raise _fail(owner, f"members[{position}]", f"must be a Member, got {type(member).__name__}")
            if member.node_id in seen:
                raise _fail(owner, f"members[{position}]", f"duplicate node id {member.node_id!r}")
            seen.add(member.node_id)
        object.__setattr__(self, "members", tuple(self.members))
        _payload(owner, self.payload)

    def to_wire(self) -> tuple[dict[str, Any], bytes]:
        members = [{"node_id": m.node_id, "advertise_url": m.advertise_url, "role": m.role.value,
                    "voter": m.voter, **({"status_url": m.status_url} if m.status_url else {})}
                   for m in self.members]
        return {"epoch": self.epoch, "config_index": self.config_index, "members": members}, self.payload

    @classmethod
    def from_wire(cls, field_map: Mapping[str, Any], payload: bytes) -> Self:
        owner = cls.__name__
        for key in ("epoch", "config_index", "members"):
            if key not in field_map:
                raise LocalProtocolError(f"{owner}.{key}: missing")
        described = field_map["members"]
        if not isinstance(described, (list, tuple)):
            raise _fail(owner, "members", "must be an array of member maps")
        if len(described) > MAX_MEMBERS:
            raise _fail(owner, "members", f"more than {MAX_MEMBERS} members ({len(described)})")
        members = []
        for position, item in enumerate(described):
            if not isinstance(item, Mapping):
                raise _fail(owner, f"members[{position}]", "must be a map")
            for key in ("node_id", "advertise_url", "role", "voter"):
                if key not in item:
                    raise _fail(owner, f"members[{position}].{key}", "missing")
            members.append(Member(node_id=item["node_id"], advertise_url=item["advertise_url"],
                                  role=item["role"], voter=item["voter"], status_url=item.get("status_url", "")))
        return cls(epoch=field_map["epoch"], config_index=field_map["config_index"],
                   members=tuple(members), payload=payload)


@dataclass(frozen=True, slots=True)
class Leave(Message):
    """A node tells its peers it is leaving (SIGTERM), so it is removed without waiting for a timeout."""

    KIND: ClassVar[MessageKind] = MessageKind.LEAVE
    node_id: str
    reason: str

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _node_id(owner, "node_id", self.node_id)
        _text(owner, "reason", self.reason, max_chars=MAX_REASON_CHARS, allow_empty=True)


# ---------------------------------------------------------------------------------------------
# Catching up: snapshots and log reads
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SnapshotRequest(Message):
    """Ask a peer for bytes [offset, offset + max_length) of fragment `fragment`'s state (resumable)."""

    KIND: ClassVar[MessageKind] = MessageKind.SNAPSHOT_REQUEST
    fragment: int
    offset: int
    max_length: int

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "fragment", self.fragment)
        _uint(owner, "offset", self.offset)
        _uint(owner, "max_length", self.max_length)
        if self.max_length == 0:
            raise _fail(owner, "max_length", "must be positive")


@dataclass(frozen=True, slots=True)
class SnapshotChunk(Message):
    """Bytes [offset, offset + len(payload)) of fragment `fragment`'s state as of `commit_index`.

    `total` is the size of the fragment's download bytes and `digest` the fragment's state digest
    (BLAKE3, `GlobalState.fragment_digest`) as of `commit_index`: chunks of one fragment name it by
    it, so a reply with another digest means the fragment moved on. Every chunk comes in an
    authenticated frame; the requester checks the state digest of the fragment it decoded, once,
    before installing it (wire 3.0: there is no separate digest of the download bytes).
    """

    KIND: ClassVar[MessageKind] = MessageKind.SNAPSHOT_CHUNK
    STREAMABLE: ClassVar[bool] = True
    fragment: int
    commit_index: int
    offset: int
    total: int
    digest: bytes
    # Bytes as decoded; a sender may give a buffer or `PayloadParts` (the state's own arrays,
    # served without a copy): the frame's bytes are the same.
    payload: SendPayload

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("fragment", "commit_index", "offset", "total"):
            _uint(owner, name, getattr(self, name))
        _blob(owner, "digest", self.digest, exact=DIGEST_BYTES)
        _served_payload(owner, self.payload)
        self.check_payload_length(payload_nbytes(self.payload))

    def check_payload_length(self, length: int) -> None:
        if self.offset + length > self.total:
            raise _fail(type(self).__name__, "offset",
                        f"chunk [{self.offset}, {self.offset + length}) runs past total {self.total}")


@dataclass(frozen=True, slots=True)
class LogReadRequest(Message):
    """Ask a peer for committed log entries starting at `from_index` (at most `max_entries`)."""

    KIND: ClassVar[MessageKind] = MessageKind.LOG_READ_REQUEST
    from_index: int
    max_entries: int

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "from_index", self.from_index)
        _uint(owner, "max_entries", self.max_entries, maximum=MAX_ENTRIES_PER_MESSAGE)
        if self.max_entries == 0:
            raise _fail(owner, "max_entries", "must be positive")


@dataclass(frozen=True, slots=True)
class LogReadReply(Message):
    """Committed entries from the requested index. If it was compacted away, `entries` is empty and
    `first_index` (the oldest entry still held) tells the requester to fetch a snapshot instead."""

    KIND: ClassVar[MessageKind] = MessageKind.LOG_READ_REPLY
    commit_index: int
    first_index: int
    entries: tuple[LogEntry, ...]

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _uint(owner, "commit_index", self.commit_index)
        _uint(owner, "first_index", self.first_index)
        entries = _entries(owner, self.entries)
        if any(entry.relayed for entry in entries):
            raise _fail(owner, "entries", "a log read carries every entry's bytes (no relayed entries)")
        if entries and entries[-1].index > self.commit_index:
            raise _fail(owner, "entries", f"entry {entries[-1].index} is past commit index {self.commit_index}")
        object.__setattr__(self, "entries", entries)

    def to_wire(self) -> tuple[dict[str, Any], bytes]:
        described, payload = _entries_to_wire(self.entries)
        return {"commit_index": self.commit_index, "first_index": self.first_index, "entries": described}, payload

    @classmethod
    def from_wire(cls, field_map: Mapping[str, Any], payload: bytes) -> Self:
        for key in ("commit_index", "first_index", "entries"):
            if key not in field_map:
                raise LocalProtocolError(f"{cls.__name__}.{key}: missing")
        return cls(commit_index=field_map["commit_index"], first_index=field_map["first_index"],
                   entries=_entries_from_wire(cls.__name__, field_map["entries"], payload))


# ---------------------------------------------------------------------------------------------
# Relayed payloads (wire 2.2)
# ---------------------------------------------------------------------------------------------


def check_relay_tree(owner: str, root: str, parent: Mapping[str, str]) -> None:
    """Raise LocalProtocolError unless `parent` is a tree rooted at `root` with fan-out <= MAX_RELAY_FANOUT."""
    if not isinstance(parent, Mapping):
        raise _fail(owner, "parent", f"must be a map of node id to node id, got {type(parent).__name__}")
    if len(parent) > MAX_MEMBERS:
        raise _fail(owner, "parent", f"more than {MAX_MEMBERS} members ({len(parent)})")
    if not root:
        if parent:
            raise _fail(owner, "parent", "a push without a root (a fetch answer) carries no tree")
        return
    _node_id(owner, "root", root)
    children: dict[str, int] = {}
    for child, up in parent.items():
        _node_id(owner, "parent key", child)
        _node_id(owner, f"parent[{child}]", up)
        children[up] = children.get(up, 0) + 1
        if children[up] > MAX_RELAY_FANOUT:
            raise _fail(owner, "parent", f"{up!r} would send to more than {MAX_RELAY_FANOUT} members")
    if root in parent:
        raise _fail(owner, "parent", f"the root {root!r} has a parent")
    for child in parent:
        node, hops = child, 0
        while node != root:
            node = parent.get(node, "")
            hops += 1
            if not node:
                raise _fail(owner, "parent", f"{child!r} does not lead to the root {root!r}")
            if hops > len(parent):
                raise _fail(owner, "parent", f"{child!r} is on a cycle")


@dataclass(frozen=True, slots=True)
class PayloadPush(Message):
    """A relayed log entry's payload: bytes claimed to have BLAKE3 digest `digest`.

    Pushed down the relay tree, `root` (the lease holder) and `parent` (member -> the member that
    sends it the bytes) say whom the receiver passes them to: the members whose parent it is. As
    the answer to a PayloadFetch, `root` is "" and `parent` empty: keep, do not pass on. The
    receiver checks the digest before it keeps or forwards anything, so a relay cannot alter bytes
    undetected.
    """

    KIND: ClassVar[MessageKind] = MessageKind.PAYLOAD_PUSH
    digest: bytes
    root: str
    parent: Mapping[str, str]
    payload: bytes

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _blob(owner, "digest", self.digest, exact=DIGEST_BYTES)
        _text(owner, "root", self.root, max_chars=MAX_NODE_ID_CHARS, allow_empty=True)
        check_relay_tree(owner, self.root, self.parent)
        object.__setattr__(self, "parent", FrozenMap(self.parent))
        _payload(owner, self.payload)
        if not self.payload:
            raise _fail(owner, "payload", "a relayed payload is at least 1 byte")

    def to_wire(self) -> tuple[dict[str, Any], bytes]:
        return {"digest": self.digest, "root": self.root, "parent": dict(self.parent)}, self.payload


@dataclass(frozen=True, slots=True)
class PayloadFetch(Message):
    """Ask a member for the payload with BLAKE3 digest `digest`.

    Wire 2.3: answered with an empty 200 at once, the bytes then stream back to the asker as a
    PayloadOpen without a tree (its own request, so no reply holds the payload); 404 when the
    member has no such payload. (A 2.2 member answered with a PayloadPush without a tree.)
    """

    KIND: ClassVar[MessageKind] = MessageKind.PAYLOAD_FETCH
    digest: bytes

    def __post_init__(self) -> None:
        _blob(type(self).__name__, "digest", self.digest, exact=DIGEST_BYTES)


@dataclass(frozen=True, slots=True)
class PayloadOpen(Message):
    """The first frame of a relayed log entry's payload streamed in chunks (wire 2.3).

    `digest` and `size` name the whole payload (BLAKE3 digest, bytes); `chunk_bytes` is what every
    PayloadChunk of this `stream` carries except the last (the rest); `root` and `parent` are the
    relay tree as in PayloadPush (empty: keep, do not pass on: a fetch answer, or a push from a
    holder that sends to every member itself). The receiver checks `size` against the largest
    payload the run's model can produce before any chunk, and the digest after the last one.
    """

    KIND: ClassVar[MessageKind] = MessageKind.PAYLOAD_OPEN
    stream: bytes
    digest: bytes
    size: int
    chunk_bytes: int
    root: str
    parent: Mapping[str, str]

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _blob(owner, "stream", self.stream, exact=STREAM_ID_BYTES)
        _blob(owner, "digest", self.digest, exact=DIGEST_BYTES)
        _uint(owner, "size", self.size)
        if self.size < 1:
            raise _fail(owner, "size", "a relayed payload is at least 1 byte")
        _uint(owner, "chunk_bytes", self.chunk_bytes)
        if self.chunk_bytes < 1:
            raise _fail(owner, "chunk_bytes", "must be >= 1")
        _text(owner, "root", self.root, max_chars=MAX_NODE_ID_CHARS, allow_empty=True)
        check_relay_tree(owner, self.root, self.parent)
        object.__setattr__(self, "parent", FrozenMap(self.parent))

    @property
    def chunks(self) -> int:
        """How many PayloadChunks follow."""
        return -(-self.size // self.chunk_bytes)

    def to_wire(self) -> tuple[dict[str, Any], bytes]:
        return {"stream": self.stream, "digest": self.digest, "size": self.size, "chunk_bytes": self.chunk_bytes,
                "root": self.root, "parent": dict(self.parent)}, b""


@dataclass(frozen=True, slots=True)
class PayloadChunk(Message):
    """The next bytes of a streamed relayed payload (wire 2.3): `payload` starts at byte `offset`.

    Chunks come in order without gaps, each `chunk_bytes` long except the last.
    """

    KIND: ClassVar[MessageKind] = MessageKind.PAYLOAD_CHUNK
    stream: bytes
    offset: int
    payload: bytes

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _blob(owner, "stream", self.stream, exact=STREAM_ID_BYTES)
        _uint(owner, "offset", self.offset)
        _payload(owner, self.payload)
        if not self.payload:
            raise _fail(owner, "payload", "a chunk carries at least 1 byte")


MESSAGE_TYPES: Mapping[MessageKind, type[Message]] = {
    cls.KIND: cls
    for cls in (FragmentContribution, LogAppend, LogAck, CommitNotice, VoteRequest, VoteReply, Heartbeat,
                HeartbeatAck, JoinRequest, Membership, SnapshotRequest, SnapshotChunk, LogReadRequest,
                LogReadReply, Leave, ContributionOpen, ContributionChunk, PayloadPush, PayloadFetch, PayloadOpen,
                PayloadChunk)
}
assert len(MESSAGE_TYPES) == len(MessageKind), "every kind needs exactly one message class"
