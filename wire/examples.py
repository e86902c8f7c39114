"""Valid example messages of every kind for fuzzers and tests, and a whole-stream decode to check
them with; not used in production.

`ExampleMessages(rng).message(kind)` draws a random valid message of a kind from one
`random.Random`, covering each field's whole valid range (edge values included) and every
cross-field rule (entries follow `prev_index`, entry epochs not newer than the message's, chunks
inside `total`, unique members, commit index past the last entry read). benchmarks/wire_fuzz.py
calls it in a seeded loop at full speed; hypothesis tests draw it from
`st.randoms(use_true_random=False)`, so failures shrink and replay.

`decode_stream` feeds bytes to a `FrameDecoder` until the end of the stream and collects what came
out, and `DecodedStream.messages()` reassembles streamed frames, so a fuzzer and a test compare
what was sent with what was decoded, whole-buffer against split, the same way.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Sequence

from wire.auth import FrameVerifier
from wire.errors import RemoteProtocolError
from wire.frames import (
    CLOSED,
    NEED_DATA,
    Event,
    FrameDecoder,
    FrameEnd,
    FrameHeader,
    PayloadChunk,
    Received,
)
from wire import messages
from wire.limits import DEFAULT_LIMITS, Limits
from wire.messages import (
    DIGEST_BYTES,
    INT64_MIN,
    MAX_ENTRIES_PER_MESSAGE,
    MAX_NAME_CHARS,
    MAX_NODE_ID_CHARS,
    MAX_REASON_CHARS,
    MAX_STREAM_TENSORS,
    STREAM_ID_BYTES,
    U63_MAX,
    CommitNotice,
    ContributionChunk,
    ContributionOpen,
    FragmentContribution,
    Heartbeat,
    HeartbeatAck,
    JoinRequest,
    Leave,
    LogAck,
    LogAppend,
    PayloadFetch,
    PayloadOpen,
    PayloadPush,
    LogEntry,
    LogReadReply,
    LogReadRequest,
    Member,
    Membership,
    Message,
    MessageKind,
    Role,
    SnapshotChunk,
    SnapshotRequest,
    TensorSpec,
    VoteReply,
    VoteRequest,
)

_ID_FIRST = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_ID_REST = _ID_FIRST + "._:@-"
_NAME_FIRST = "abcdefghijklmnopqrstuvwxyz0123456789"
_NAME_REST = _NAME_FIRST + "._-"
# Free text (reasons, metadata): printable ASCII, then code points that take 2, 3 and 4 bytes in
# UTF-8; surrogates are left out since they cannot be encoded at all.
_TEXT_RANGES = ((0x20, 0x7F), (0xA0, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000))
# Small: enough for every rule about lists and lengths, while keeping frames far below the limits.
MAX_EXAMPLE_ENTRIES = 4
MAX_EXAMPLE_MEMBERS = 5
MAX_EXAMPLE_PAYLOAD = 300
# Indices in messages with entries stay below this, so `prev_index + entries` never passes U63_MAX.
_INDEX_SPAN = 2**40


class ExampleMessages:
    """Random valid messages and field values, all drawn from `rng`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def message(self, kind: MessageKind | None = None) -> Message:
        """A valid message of `kind` (a random kind when None)."""
        if kind is None:
            kind = self.rng.choice(_KINDS)
        return _BUILDERS[kind](self)

    # -- field values ---------------------------------------------------------------------------

    def uint(self) -> int:
        """Mostly small numbers, sometimes anywhere in [0, U63_MAX], sometimes an edge."""
        roll = self.rng.random()
        if roll < 0.5:
            return self.rng.randrange(1000)
        if roll < 0.9:
            return self.rng.randrange(U63_MAX + 1)
        return self.rng.choice((0, 1, U63_MAX))

    def flag(self) -> bool:
        return self.rng.random() < 0.5

    def node_id(self) -> str:
        rest = self.rng.choices(_ID_REST, k=self.rng.randrange(MAX_NODE_ID_CHARS))
        return self.rng.choice(_ID_FIRST) + "".join(rest)

    def name(self) -> str:
        rest = self.rng.choices(_NAME_REST, k=self.rng.randrange(MAX_NAME_CHARS))
        return self.rng.choice(_NAME_FIRST) + "".join(rest)

    def text(self, max_chars: int = 30) -> str:
        chars = []
        for _ in range(self.rng.randrange(max_chars + 1)):
            low, high = self.rng.choice(_TEXT_RANGES)
            chars.append(chr(self.rng.randrange(low, high)))
        return "".join(chars)

    def url(self) -> str:
        return f"{self.rng.choice(('http', 'https'))}://{self.node_id()}:{self.rng.randrange(1, 65536)}"

    def blob(self, max_bytes: int = MAX_EXAMPLE_PAYLOAD) -> bytes:
        return self.rng.randbytes(self.rng.randrange(max_bytes + 1))

    def digest(self) -> bytes:
        return self.rng.randbytes(DIGEST_BYTES)

    def role(self) -> Role:
        return self.rng.choice(_ROLES)

    def metadata_value(self, depth: int = 0) -> object:
        """Any value log entry metadata may hold: scalars, and lists and maps two levels deep."""
        choice = self.rng.randrange(9 if depth < 2 else 7)
        if choice == 0:
            return None
        if choice == 1:
            return self.flag()
        if choice == 2:
            return self.rng.randrange(INT64_MIN, U63_MAX + 1)
        if choice == 3:
            return self.rng.uniform(-1e9, 1e9)
        if choice == 4:
            return self.text(20)
        if choice == 5:
            return self.blob(20)
        if choice == 6:
            return self.rng.randrange(100)
        if choice == 7:
            return [self.metadata_value(depth + 1) for _ in range(self.rng.randrange(4))]
        return {self.text(8): self.metadata_value(depth + 1) for _ in range(self.rng.randrange(4))}

    def metadata(self) -> dict[str, object]:
        return {self.text(10): self.metadata_value() for _ in range(self.rng.randrange(6))}

    def entries(self, first_index: int, max_epoch: int) -> tuple[LogEntry, ...]:
        """Consecutive entries from `first_index`, none newer than `max_epoch`."""
        count = self.rng.randrange(min(MAX_EXAMPLE_ENTRIES, MAX_ENTRIES_PER_MESSAGE) + 1)
        return tuple(LogEntry(index=first_index + i, epoch=self.rng.randint(0, max_epoch), kind=self.name(),
                              metadata=self.metadata(), payload=self.blob())
                     for i in range(count))

    def relayed_entries(self, first_index: int, max_epoch: int) -> tuple[LogEntry, ...]:
        """As `entries`, some of them relayed (bytes named by digest and size, wire 2.2)."""
        return tuple(LogEntry(index=e.index, epoch=e.epoch, kind=e.kind, metadata=e.metadata, payload=b"",
                              payload_digest=self.digest(), payload_size=self.rng.randint(1, U63_MAX))
                     if self.flag() else e
                     for e in self.entries(first_index, max_epoch))

    def relay_tree(self) -> tuple[str, dict[str, str]]:
        """A root and a parent map: each member hangs under the root or an earlier member."""
        root = self.node_id()
        placed, parent = [root], {}
        for _ in range(self.rng.randrange(MAX_EXAMPLE_MEMBERS + 1)):
            member = self.node_id()
            if member in placed:
                continue
            parent[member] = self.rng.choice(placed)
            placed.append(member)
        return root, parent

    def member(self) -> Member:
        return Member(self.node_id(), self.url(), self.role(), self.flag())

    # -- one builder per kind -------------------------------------------------------------------

    def fragment_contribution(self) -> FragmentContribution:
        return FragmentContribution(fragment=self.uint(), base_index=self.uint(), base_round=self.uint(),
                                    c_steps=self.uint(), c_tokens=self.uint(), codec=self.name(),
                                    learner_id=self.node_id(), payload=self.blob())

    def log_append(self) -> LogAppend:
        epoch, prev_index = self.rng.randrange(_INDEX_SPAN), self.rng.randrange(_INDEX_SPAN)
        return LogAppend(epoch=epoch, leader=self.node_id(), prev_index=prev_index, prev_epoch=self.uint(),
                         entries=self.relayed_entries(prev_index + 1, epoch), leader_commit=self.uint())

    def log_ack(self) -> LogAck:
        return LogAck(epoch=self.uint(), follower=self.node_id(), index=self.uint(), success=self.flag())

    def commit_notice(self) -> CommitNotice:
        return CommitNotice(epoch=self.uint(), leader=self.node_id(), commit_index=self.uint())

    def vote_request(self) -> VoteRequest:
        return VoteRequest(epoch=self.uint(), candidate=self.node_id(), last_log_epoch=self.uint(),
                           last_log_index=self.uint(), pre_vote=self.flag())

    def vote_reply(self) -> VoteReply:
        return VoteReply(epoch=self.uint(), voter=self.node_id(), granted=self.flag(),
                         reason=self.text(self.rng.choice((80, MAX_REASON_CHARS))), pre_vote=self.flag())

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(epoch=self.uint(), leader=self.node_id(), seq=self.uint(), commit_index=self.uint())

    def heartbeat_ack(self) -> HeartbeatAck:
        return HeartbeatAck(epoch=self.uint(), follower=self.node_id(), seq=self.uint(), match_index=self.uint())

    def join_request(self) -> JoinRequest:
        return JoinRequest(node_id=self.node_id(), advertise_url=self.url(), role=self.role(),
                           manifest_digest=self.digest())

    def membership(self) -> Membership:
        members = {m.node_id: m for m in (self.member() for _ in range(self.rng.randrange(MAX_EXAMPLE_MEMBERS + 1)))}
        return Membership(epoch=self.uint(), config_index=self.uint(), members=tuple(members.values()),
                          payload=self.blob())

    def snapshot_request(self) -> SnapshotRequest:
        return SnapshotRequest(fragment=self.uint(), offset=self.uint(), max_length=self.rng.randint(1, U63_MAX))

    def snapshot_chunk(self) -> SnapshotChunk:
        payload, offset = self.blob(), self.rng.randrange(_INDEX_SPAN)
        return SnapshotChunk(fragment=self.uint(), commit_index=self.uint(), offset=offset,
                             total=offset + len(payload) + self.rng.randrange(_INDEX_SPAN), digest=self.digest(),
                             payload=payload)

    def log_read_request(self) -> LogReadRequest:
        return LogReadRequest(from_index=self.uint(), max_entries=self.rng.randint(1, MAX_ENTRIES_PER_MESSAGE))

    def log_read_reply(self) -> LogReadReply:
        first = self.rng.randrange(_INDEX_SPAN)
        entries = self.entries(first, self.rng.randrange(_INDEX_SPAN))
        last = entries[-1].index if entries else 0
        return LogReadReply(commit_index=last + self.rng.randrange(_INDEX_SPAN), first_index=first, entries=entries)

    def leave(self) -> Leave:
        return Leave(node_id=self.node_id(), reason=self.text(self.rng.choice((80, MAX_REASON_CHARS))))

    def tensor_spec(self, name: str) -> TensorSpec:
        return TensorSpec(name=name, shape=tuple(self.uint() for _ in range(self.rng.randrange(4))))

    def contribution_open(self) -> ContributionOpen:
        names = {self.text(self.rng.choice((12, 60))) or "w" for _ in range(self.rng.randint(1, 6))}
        return ContributionOpen(fragment=self.uint(), base_index=self.uint(), base_round=self.uint(),
                                c_steps=self.uint(), c_tokens=self.uint(), codec=self.name(),
                                learner_id=self.node_id(), stream=self.rng.randbytes(STREAM_ID_BYTES),
                                chunk_elements=self.rng.randint(1, U63_MAX),
                                tensors=tuple(self.tensor_spec(name) for name in sorted(names)))

    def contribution_chunk(self) -> ContributionChunk:
        return ContributionChunk(stream=self.rng.randbytes(STREAM_ID_BYTES),
                                 tensor=self.rng.randrange(MAX_STREAM_TENSORS), offset=self.uint(),
                                 payload=self.blob())

    def payload_push(self) -> PayloadPush:
        root, parent = self.relay_tree() if self.flag() else ("", {})
        return PayloadPush(digest=self.digest(), root=root, parent=parent, payload=self.blob() or b"\x00")

    def payload_fetch(self) -> PayloadFetch:
        return PayloadFetch(digest=self.digest())

    def payload_open(self) -> PayloadOpen:
        root, parent = self.relay_tree() if self.flag() else ("", {})
        return PayloadOpen(stream=self.rng.randbytes(STREAM_ID_BYTES), digest=self.digest(),
                           size=max(1, self.uint()), chunk_bytes=max(1, self.uint()), root=root, parent=parent)

    def payload_chunk(self) -> messages.PayloadChunk:
        return messages.PayloadChunk(stream=self.rng.randbytes(STREAM_ID_BYTES), offset=self.uint(),
                                     payload=self.blob() or b"\x00")


_BUILDERS: dict[MessageKind, Callable[[ExampleMessages], Message]] = {
    MessageKind.FRAGMENT_CONTRIBUTION: ExampleMessages.fragment_contribution,
    MessageKind.LOG_APPEND: ExampleMessages.log_append,
    MessageKind.LOG_ACK: ExampleMessages.log_ack,
    MessageKind.COMMIT_NOTICE: ExampleMessages.commit_notice,
    MessageKind.VOTE_REQUEST: ExampleMessages.vote_request,
    MessageKind.VOTE_REPLY: ExampleMessages.vote_reply,
    MessageKind.HEARTBEAT: ExampleMessages.heartbeat,
    MessageKind.HEARTBEAT_ACK: ExampleMessages.heartbeat_ack,
    MessageKind.JOIN_REQUEST: ExampleMessages.join_request,
    MessageKind.MEMBERSHIP: ExampleMessages.membership,
    MessageKind.SNAPSHOT_REQUEST: ExampleMessages.snapshot_request,
    MessageKind.SNAPSHOT_CHUNK: ExampleMessages.snapshot_chunk,
    MessageKind.LOG_READ_REQUEST: ExampleMessages.log_read_request,
    MessageKind.LOG_READ_REPLY: ExampleMessages.log_read_reply,
    MessageKind.LEAVE: ExampleMessages.leave,
    MessageKind.CONTRIBUTION_OPEN: ExampleMessages.contribution_open,
    MessageKind.CONTRIBUTION_CHUNK: ExampleMessages.contribution_chunk,
    MessageKind.PAYLOAD_PUSH: ExampleMessages.payload_push,
    MessageKind.PAYLOAD_FETCH: ExampleMessages.payload_fetch,
    MessageKind.PAYLOAD_OPEN: ExampleMessages.payload_open,
    MessageKind.PAYLOAD_CHUNK: ExampleMessages.payload_chunk,
}
_KINDS: Sequence[MessageKind] = tuple(MessageKind)
_ROLES: Sequence[Role] = tuple(Role)
assert set(_BUILDERS) == set(MessageKind), "every kind needs an example builder"


# ---------------------------------------------------------------------------------------------
# Decoding a whole stream
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DecodedStream:
    """Everything a decoder gave for a byte stream followed by its end."""

    events: tuple[Event, ...]  # consecutive PayloadChunks merged, so any split compares equal
    status: int | None  # the RemoteProtocolError's status hint; None when the stream decoded cleanly
    closed: bool  # the decoder reported CLOSED: the stream ended between frames

    def messages(self) -> list[Message]:
        """The decoded messages, streamed frames reassembled into whole ones."""
        out: list[Message] = []
        head: Message | None = None
        parts: list[bytes] = []
        for event in self.events:
            if isinstance(event, Received):
                out.append(event.message)
            elif isinstance(event, FrameHeader):
                head, parts = event.head, []
            elif isinstance(event, PayloadChunk):
                parts.append(bytes(event.data))
            elif isinstance(event, FrameEnd) and head is not None:
                out.append(dataclasses.replace(head, payload=b"".join(parts)))  # type: ignore[type-var]
        return out


def decode_stream(chunks: Iterable[bytes], verifier: FrameVerifier, *, now_unix: float,
                  limits: Limits = DEFAULT_LIMITS, stream_kinds: Iterable[MessageKind] = ()) -> DecodedStream:
    """Feed `chunks`, then the end of the stream, to a new decoder; collect what comes out."""
    decoder = FrameDecoder(verifier, limits, stream_kinds=stream_kinds)
    events: list[Event] = []
    event: Event = NEED_DATA
    try:
        for chunk in [*(c for c in chunks if c), b""]:  # b"" only once: it means end of stream
            decoder.receive_data(chunk)
            while (event := decoder.next_event(now_unix=now_unix)) not in (NEED_DATA, CLOSED):
                if isinstance(event, PayloadChunk) and events and isinstance(events[-1], PayloadChunk):
                    events[-1] = PayloadChunk(bytes(events[-1].data) + event.data)
                else:
                    events.append(event)
    except RemoteProtocolError as error:
        return DecodedStream(tuple(events), error.status_hint, closed=False)
    return DecodedStream(tuple(events), None, closed=event is CLOSED)
