"""Frames and messages: round trips for every kind, a total incremental decoder, size limits, versioning.

Valid messages come from `wire.examples`, the generator benchmarks/wire_fuzz.py uses too. The
fuzz-style properties run FUZZ_EXAMPLES examples each (300 by default, `WIRE_FUZZ_EXAMPLES` for more;
benchmarks/wire_fuzz.py runs a direct loop at 100k+, the depth the default suite leaves to it).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import struct

import blake3
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire.auth import AuthContext, FrameVerifier, compute_mac, derive_frame_key
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.examples import DecodedStream, ExampleMessages, decode_stream
from wire.frames import (
    CLOSED,
    FIXED_HEADER,
    FIXED_HEADER_BYTES,
    MAGIC,
    NEED_DATA,
    WIRE_MAJOR,
    FrameDecoder,
    FrameEnd,
    FrameHeader,
    PayloadChunk,
    Received,
    decode_frame,
    encode_frame,
    encode_frame_head,
)
from wire.limits import DEFAULT_LIMITS, Limits
from wire.messages import (
    MESSAGE_TYPES,
    CommitNotice,
    FragmentContribution,
    FrozenMap,
    JoinRequest,
    Leave,
    LogAck,
    LogAppend,
    LogEntry,
    LogReadReply,
    LogReadRequest,
    Member,
    Membership,
    MessageKind,
    PayloadParts,
    Role,
    SnapshotChunk,
    VoteRequest,
)

FUZZ_EXAMPLES = int(os.environ.get("WIRE_FUZZ_EXAMPLES", "300"))
fuzz = settings(max_examples=FUZZ_EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
quick = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

RUN = "run-test"
SECRET = b"s" * 32
KEY = derive_frame_key(SECRET)
AUTH = AuthContext(RUN, "site-a", KEY)
NOW = 1_800_000_000.0
NOW_MS = round(NOW * 1000)
STREAMABLE_KINDS = [kind for kind, cls in MESSAGE_TYPES.items() if cls.STREAMABLE]
_nonce_counter = itertools.count(1)


def fresh_nonce() -> bytes:
    return next(_nonce_counter).to_bytes(16, "big")


def frame(message, *, now: float = NOW, auth: AuthContext = AUTH) -> bytes:
    return encode_frame(message, auth, now_unix=now, nonce=fresh_nonce())


def verifier(limits: Limits = DEFAULT_LIMITS) -> FrameVerifier:
    return FrameVerifier(RUN, KEY, limits)


def signed_raw(kind: int, header_map: object, payload: bytes = b"", *, major: int = WIRE_MAJOR, minor: int = 0,
               flags: int = 0, payload_length: int | None = None) -> bytes:
    """A frame with an arbitrary header map, correctly MAC'd: what a buggy or hostile member could send."""
    map_bytes = msgpack.packb(header_map, use_bin_type=True)
    fixed = FIXED_HEADER.pack(MAGIC, major, minor, kind, flags, len(map_bytes),
                              len(payload) if payload_length is None else payload_length)
    return fixed + map_bytes + compute_mac(KEY, fixed + map_bytes) + payload


def auth_map(message_fields: object, payload: bytes = b"", **overrides: object) -> dict:
    header_map = {"run": RUN, "from": "site-a", "ts": NOW_MS, "nonce": fresh_nonce(),
                  "pd": blake3.blake3(payload).digest(), "to": "", "m": message_fields}
    header_map.update(overrides)
    return header_map


def run_decoder(chunks, *, limits: Limits = DEFAULT_LIMITS, stream_kinds=(), now: float = NOW) -> DecodedStream:
    return decode_stream(chunks, verifier(limits), now_unix=now, limits=limits, stream_kinds=stream_kinds)


# ---------------------------------------------------------------------------------------------
# Valid messages: wire.examples, drawn from a hypothesis-controlled Random (so failures shrink)
# ---------------------------------------------------------------------------------------------


def messages_of_kind(kind: MessageKind | None = None):
    """A strategy for valid messages of `kind` (any kind when None)."""
    return st.randoms(use_true_random=False).map(lambda rng: ExampleMessages(rng).message(kind))


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=lambda cls: cls.__name__)
def test_the_example_generator_builds_every_message_class(cls):
    """Every class in wire.messages has valid examples, and a run of draws covers each kind."""
    examples = ExampleMessages(random.Random(cls.KIND))
    drawn = [examples.message(cls.KIND) for _ in range(20)]
    assert all(type(m) is cls for m in drawn)
    assert len(set(drawn)) > 1  # random fields, not one fixed message
    assert cls in {type(examples.message()) for _ in range(400)}


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(MessageKind), ids=lambda kind: kind.name)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_every_kind(kind, data):
    message = data.draw(messages_of_kind(kind))
    received = decode_frame(frame(message), verifier(), now_unix=NOW + 1)
    assert received.message == message
    assert type(received.message) is type(message)
    assert received.sender == "site-a"
    assert received.sent_at_unix == NOW


@pytest.mark.parametrize("kind", STREAMABLE_KINDS, ids=lambda kind: kind.name)
@quick
@given(data=st.data(), chunk=st.integers(1, 64))
def test_streamed_round_trip(kind, data, chunk):
    message = data.draw(messages_of_kind(kind))
    limits = Limits(max_payload_chunk_bytes=chunk)
    decoded = run_decoder([frame(message)], limits=limits, stream_kinds=[kind])
    assert decoded.status is None and decoded.closed
    assert isinstance(decoded.events[0], FrameHeader)
    assert decoded.events[0].head == message.without_payload()
    assert decoded.events[0].payload_length == len(message.payload)
    assert decoded.messages() == [message]
    # Chunk events never exceed the configured size.
    decoder = FrameDecoder(verifier(limits), limits, stream_kinds=[kind])
    decoder.receive_data(frame(message))
    while (event := decoder.next_event(now_unix=NOW)) is not NEED_DATA:
        if isinstance(event, PayloadChunk):
            assert 0 < len(event.data) <= chunk


def test_streamed_send_with_encode_frame_head():
    payload = os.urandom(5000)
    message = FragmentContribution(fragment=3, base_index=9, base_round=2, c_steps=24, c_tokens=98304,
                                   codec="int4-zstd", learner_id="site-b", payload=payload)
    head = encode_frame_head(message.without_payload(), AUTH, now_unix=NOW, nonce=fresh_nonce(),
                             payload_length=len(payload), payload_digest=blake3.blake3(payload).digest())
    assert decode_frame(head + payload, verifier(), now_unix=NOW).message == message
    with pytest.raises(LocalProtocolError, match="without its payload"):
        encode_frame_head(message, AUTH, now_unix=NOW, nonce=fresh_nonce(), payload_length=len(payload),
                          payload_digest=blake3.blake3(payload).digest())
    with pytest.raises(LocalProtocolError, match="cannot be streamed|no single payload"):
        encode_frame_head(LogAck(epoch=1, follower="a", index=1, success=True), AUTH, now_unix=NOW,
                          nonce=fresh_nonce(), payload_length=0, payload_digest=bytes(32))


def test_streamed_payload_that_does_not_match_its_digest_is_refused_at_the_end():
    payload = b"x" * 100
    message = SnapshotChunk(fragment=0, commit_index=1, offset=0, total=100, digest=bytes(32), payload=b"")
    head = encode_frame_head(message, AUTH, now_unix=NOW, nonce=fresh_nonce(), payload_length=100,
                             payload_digest=blake3.blake3(b"y" * 100).digest())
    decoded = run_decoder([head + payload], stream_kinds=[MessageKind.SNAPSHOT_CHUNK])
    assert decoded.status == 401
    assert isinstance(decoded.events[0], FrameHeader) and decoded.events[-1] == PayloadChunk(payload)


def test_a_served_payload_given_as_a_buffer_or_its_parts_encodes_to_the_same_bytes():
    """A sender may give SnapshotChunk's payload as a memoryview of its arrays, or as the parts it
    lies in (wire.messages.PayloadParts): the frame is byte for byte the one of the joined bytes,
    so the wire (its version, docs/WIRE.md's vectors) is unchanged; the receiver gets bytes."""
    import numpy as np

    params = np.arange(3000, dtype=np.float32)
    params.flags.writeable = False  # the state's arrays are read-only: served as they are
    data = params.tobytes()
    head = b"\xc4\x10" + bytes(range(16))
    whole = head + data
    kinds_of_payload = {
        "bytes": whole,
        "memoryview": memoryview(bytearray(whole)),
        "parts": PayloadParts([head, params[:1000], memoryview(params)[1000:].cast("B")]),
        "parts of one": PayloadParts([whole]),
    }
    nonce = fresh_nonce()
    encoded = {name: encode_frame(SnapshotChunk(2, 9, 40, 40 + len(whole) + 7, bytes(32), payload), AUTH,
                                  now_unix=NOW, nonce=nonce, to="site-b")
               for name, payload in kinds_of_payload.items()}
    assert len(set(encoded.values())) == 1
    assert len(PayloadParts([head, params])) == len(whole) and PayloadParts([head, params]) == whole
    received = decode_frame(encoded["parts"], FrameVerifier(RUN, KEY, node_id="site-b"), now_unix=NOW)
    assert type(received.message.payload) is bytes and received.message.payload == whole
    assert received.message == SnapshotChunk(2, 9, 40, 40 + len(whole) + 7, bytes(32), whole)
    with pytest.raises(LocalProtocolError, match="runs past total"):
        SnapshotChunk(0, 1, 0, len(whole) - 1, bytes(32), PayloadParts([head, params]))
    with pytest.raises(LocalProtocolError, match="C-contiguous"):
        SnapshotChunk(0, 1, 0, 1 << 20, bytes(32), memoryview(params)[::2])
    with pytest.raises(LocalProtocolError, match="C-contiguous"):
        PayloadParts([params[::2]])
    with pytest.raises(LocalProtocolError, match="must be bytes, a buffer or PayloadParts"):
        SnapshotChunk(0, 1, 0, 10, bytes(32), [b"a"])


def test_a_streamed_payload_comes_out_in_the_pieces_it_arrived_in_never_joined():
    """Each PayloadChunk is (a view of) one received piece, so a consumer hashes and copies it where
    it lies; small pieces gathered while a view of their buffer is still held go to a new buffer."""
    payload = os.urandom(300_000)
    message = SnapshotChunk(fragment=0, commit_index=1, offset=0, total=len(payload), digest=bytes(32),
                            payload=payload)
    data = frame(message)
    decoder = FrameDecoder(verifier(), stream_kinds=[MessageKind.SNAPSHOT_CHUNK])
    big = 100_000  # >= the queue's small-piece size: kept as received
    pieces = [data[:big], data[big:2 * big], *(data[at:at + 1000] for at in range(2 * big, len(data), 1000))]
    events = []
    for piece in pieces:
        decoder.receive_data(piece)
        while (event := decoder.next_event(now_unix=NOW)) is not NEED_DATA:
            events.append(event)  # every view stays alive while more small pieces are gathered
    chunks = [e.data for e in events if isinstance(e, PayloadChunk)]
    assert isinstance(events[0], FrameHeader) and isinstance(events[-1], FrameEnd)
    assert b"".join(chunks) == payload
    assert isinstance(chunks[0], memoryview) and chunks[0].obj is pieces[0]  # a view of the piece: no copy
    assert chunks[1] is pieces[1]  # a whole piece: the piece itself
    # Events smaller than a gathered piece: views of it are handed out while more bytes arrive.
    limits = Limits(max_payload_chunk_bytes=600)
    decoder = FrameDecoder(verifier(limits), limits, stream_kinds=[MessageKind.SNAPSHOT_CHUNK])
    views = []
    for at in range(0, len(data), 1000):
        decoder.receive_data(data[at:at + 1000])  # joins the piece a view was just taken of, or not
        if isinstance(event := decoder.next_event(now_unix=NOW), PayloadChunk):  # one event per piece
            views.append(event.data)
    decoder.receive_data(b"")
    while (event := decoder.next_event(now_unix=NOW)) is not CLOSED:
        if isinstance(event, PayloadChunk):
            views.append(event.data)
    assert b"".join(views) == payload and sum(type(v) is memoryview for v in views) > 100


def test_stream_payload_hands_over_what_payload_chunk_events_would_in_one_call():
    payload = os.urandom(200_000)
    message = SnapshotChunk(fragment=0, commit_index=1, offset=0, total=len(payload), digest=bytes(32),
                            payload=payload)
    data = frame(message)
    decoder = FrameDecoder(verifier(), stream_kinds=[MessageKind.SNAPSHOT_CHUNK])
    with pytest.raises(LocalProtocolError, match="outside a streamed payload"):
        decoder.stream_payload(print, now_unix=NOW)
    decoder.receive_data(data[:120_000])
    assert isinstance(decoder.next_event(now_unix=NOW), FrameHeader)
    got: list[bytes | memoryview] = []
    assert decoder.stream_payload(got.append, now_unix=NOW) is NEED_DATA  # what has arrived so far
    decoder.receive_data(data[120_000:])
    assert isinstance(decoder.stream_payload(got.append, now_unix=NOW), FrameEnd)
    assert b"".join(got) == payload
    decoder.receive_data(b"")
    assert decoder.next_event(now_unix=NOW) is CLOSED
    # A payload that does not match its digest is refused at its end (401), after `write` saw it.
    spoiled = data[:-1] + bytes([data[-1] ^ 1])
    decoder = FrameDecoder(verifier(), stream_kinds=[MessageKind.SNAPSHOT_CHUNK])
    decoder.receive_data(spoiled)
    assert isinstance(decoder.next_event(now_unix=NOW), FrameHeader)
    with pytest.raises(RemoteProtocolError, match="does not match its authenticated digest") as refused:
        decoder.stream_payload(lambda data: None, now_unix=NOW)
    assert refused.value.status_hint == 401
    with pytest.raises(RemoteProtocolError, match="already failed"):
        decoder.stream_payload(lambda data: None, now_unix=NOW)
    # The stream ends inside the payload: refused (400).
    decoder = FrameDecoder(verifier(), stream_kinds=[MessageKind.SNAPSHOT_CHUNK])
    decoder.receive_data(data[:-10])
    decoder.receive_data(b"")
    assert isinstance(decoder.next_event(now_unix=NOW), FrameHeader)
    with pytest.raises(RemoteProtocolError, match="stream ended inside a frame") as refused:
        decoder.stream_payload(lambda data: None, now_unix=NOW)
    assert refused.value.status_hint == 400


def test_streamed_head_refused_when_declared_length_cannot_fit():
    message = SnapshotChunk(fragment=0, commit_index=1, offset=90, total=100, digest=bytes(32), payload=b"")
    with pytest.raises(LocalProtocolError, match="runs past total"):
        encode_frame_head(message, AUTH, now_unix=NOW, nonce=fresh_nonce(), payload_length=11,
                          payload_digest=bytes(32))
    raw = signed_raw(MessageKind.SNAPSHOT_CHUNK, auth_map(message.to_wire()[0], b"z" * 11), b"z" * 11)
    decoded = run_decoder([raw], stream_kinds=[MessageKind.SNAPSHOT_CHUNK])
    assert (decoded.events, decoded.status) == ((), 400)


def test_streaming_only_for_single_payload_kinds():
    with pytest.raises(LocalProtocolError, match="cannot be streamed"):
        FrameDecoder(verifier(), stream_kinds=[MessageKind.LOG_APPEND])


# ---------------------------------------------------------------------------------------------
# The total decoder
# ---------------------------------------------------------------------------------------------

# A fixed pool of valid messages (two of every kind, from the one example generator) keeps the
# 2,000-example fuzz properties fast: hypothesis spends its budget on damage and splits, not on
# building messages.
_POOL_EXAMPLES = ExampleMessages(random.Random(20240601))
POOL_MESSAGES = [_POOL_EXAMPLES.message(kind) for kind in MessageKind for _ in range(2)]
POOL_FRAMES = [frame(m) for m in POOL_MESSAGES]
frame_streams = st.lists(st.integers(0, len(POOL_FRAMES) - 1), min_size=1, max_size=3, unique=True).map(
    lambda picks: b"".join(POOL_FRAMES[i] for i in picks))


@st.composite
def hostile_bytes(draw):
    """Random bytes, or a valid frame stream damaged by flips, cuts, splices and insertions."""
    choice = draw(st.integers(0, 4))
    if choice == 0:
        return draw(st.binary(max_size=400))
    data = bytearray(draw(frame_streams))
    if choice == 1:
        for _ in range(draw(st.integers(1, 4))):
            position = draw(st.integers(0, len(data) - 1))
            data[position] ^= draw(st.integers(1, 255))
    elif choice == 2:
        data = data[:draw(st.integers(0, len(data)))]
    elif choice == 3:
        position = draw(st.integers(0, len(data)))
        data[position:position] = draw(st.binary(min_size=1, max_size=40))
    else:
        start = draw(st.integers(0, len(data)))
        del data[start:start + draw(st.integers(1, 40))]
    return bytes(data)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=12), st.binary(max_size=40))
_keys = st.one_of(st.text(max_size=8), st.binary(max_size=4))
_shallow = st.one_of(_scalars, st.lists(_scalars, max_size=3), st.dictionaries(_keys, _scalars, max_size=3))
# Two levels of containers are enough to reach every type check; deeper shapes are cheap to reject.
_anything = st.one_of(_shallow, st.lists(_shallow, max_size=3), st.dictionaries(_keys, _shallow, max_size=3))
_HEADER_KEYS = ["run", "from", "ts", "nonce", "pd", "m"]


@st.composite
def authenticated_garbage(draw):
    """Correctly MAC'd frames whose header map and fields are arbitrary: the decoder's inner layers."""
    base = POOL_MESSAGES[draw(st.integers(0, len(POOL_MESSAGES) - 1))]
    kind = draw(st.one_of(st.just(int(base.KIND)), st.just(int(base.KIND)), st.integers(0, 2**16 - 1)))
    payload = draw(st.one_of(st.just(base.to_wire()[1]), st.binary(max_size=64)))
    fields = dict(base.to_wire()[0])
    for key in list(fields):
        action = draw(st.integers(0, 5))  # mostly keep, sometimes drop or replace
        if action == 4:
            del fields[key]
        elif action == 5:
            fields[key] = draw(_anything)
    header_map = auth_map(fields, payload)
    for _ in range(draw(st.integers(0, 2))):
        header_map[draw(st.sampled_from(_HEADER_KEYS))] = draw(_anything)
    return signed_raw(kind, header_map, payload)


@fuzz
@given(data=st.one_of(hostile_bytes(), authenticated_garbage()), stream=st.booleans())
def test_decoder_is_total(data, stream):
    """Any bytes give events or RemoteProtocolError; nothing else escapes."""
    decoded = run_decoder([data], stream_kinds=STREAMABLE_KINDS if stream else ())
    assert decoded.status in (None, 400, 401, 409, 413, 426)
    assert all(isinstance(e, (Received, FrameHeader, PayloadChunk, FrameEnd)) for e in decoded.events)
    assert decoded.closed == (decoded.status is None)


@fuzz
@given(data=st.one_of(frame_streams, hostile_bytes(), authenticated_garbage()), stream=st.booleans())
def test_byte_at_a_time_equals_whole_buffer(data, stream):
    kinds = STREAMABLE_KINDS if stream else ()
    whole = run_decoder([data], stream_kinds=kinds)
    single = run_decoder([data[i:i + 1] for i in range(len(data))], stream_kinds=kinds)
    assert single == whole


@fuzz
@given(data=st.one_of(frame_streams, hostile_bytes()), cuts=st.lists(st.integers(0, 2000), max_size=8),
       stream=st.booleans())
def test_random_chunk_splits_equal_whole(data, cuts, stream):
    kinds = STREAMABLE_KINDS if stream else ()
    points = sorted({min(c, len(data)) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]
    assert run_decoder(chunks, stream_kinds=kinds) == run_decoder([data], stream_kinds=kinds)


@fuzz
@given(pick=st.integers(0, len(POOL_FRAMES) - 1), where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_a_flipped_byte_anywhere_is_caught_or_harmless(pick, where, mask):
    encoded = bytearray(POOL_FRAMES[pick])
    encoded[int(where * len(encoded))] ^= mask
    decoded = run_decoder([bytes(encoded)])
    if decoded.status is None:
        assert decoded.messages() == [POOL_MESSAGES[pick]]
    else:
        # 409: the flip changed the run id, which is checked (for a clear answer to a misconfigured
        # node) before the MAC; the frame is refused either way.
        assert decoded.status in (400, 401, 409, 413, 426)


def test_clean_end_between_frames_and_truncation_inside_one():
    encoded = frame(LogAck(epoch=2, follower="b", index=7, success=True))
    decoded = run_decoder([encoded])
    assert decoded.status is None and decoded.closed and len(decoded.events) == 1
    for cut in (1, FIXED_HEADER_BYTES, len(encoded) - 1):
        decoded = run_decoder([encoded[:cut]])
        assert (decoded.events, decoded.status) == ((), 400)


def test_truncation_message_names_the_place():
    decoder = FrameDecoder(verifier())
    decoder.receive_data(frame(LogAck(epoch=2, follower="b", index=7, success=True))[:30])
    decoder.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="stream ended inside a frame \\(header map"):
        decoder.next_event(now_unix=NOW)


def test_a_failed_decoder_stays_failed():
    decoder = FrameDecoder(verifier())
    decoder.receive_data(b"XXXX" + bytes(40))
    with pytest.raises(RemoteProtocolError, match="not a diloco-node frame") as first:
        decoder.next_event(now_unix=NOW)
    decoder.receive_data(frame(LogAck(epoch=2, follower="b", index=7, success=True)))
    with pytest.raises(RemoteProtocolError, match="already failed") as second:
        decoder.next_event(now_unix=NOW)
    assert first.value.status_hint == second.value.status_hint == 400
    assert decoder.buffered_bytes <= 44  # nothing received after the failure is kept


def test_receive_data_after_end_of_stream_is_our_bug():
    decoder = FrameDecoder(verifier())
    decoder.receive_data(b"")
    with pytest.raises(LocalProtocolError, match="after end of stream"):
        decoder.receive_data(b"x")


def test_next_event_needs_a_real_time():
    decoder = FrameDecoder(verifier())
    with pytest.raises(LocalProtocolError, match="now_unix must be a finite"):
        decoder.next_event(now_unix=float("nan"))


def test_decode_frame_wants_exactly_one_frame():
    one = frame(Leave(node_id="site-c", reason="SIGTERM"))
    assert decode_frame(one, verifier(), now_unix=NOW).message == Leave(node_id="site-c", reason="SIGTERM")
    with pytest.raises(RemoteProtocolError, match="more than one frame"):
        decode_frame(one + frame(Leave(node_id="site-c", reason="")), verifier(), now_unix=NOW)
    with pytest.raises(RemoteProtocolError, match="no frame"):
        decode_frame(b"", verifier(), now_unix=NOW)


# ---------------------------------------------------------------------------------------------
# Versioning and unknown things
# ---------------------------------------------------------------------------------------------


def test_unknown_header_map_keys_are_ignored():
    message = VoteRequest(epoch=4, candidate="site-b", last_log_epoch=3, last_log_index=17)
    fields = {**message.to_wire()[0], "future_field": [1, 2, 3]}
    raw = signed_raw(MessageKind.VOTE_REQUEST, auth_map(fields, trace_id="abc", priority=7))
    assert decode_frame(raw, verifier(), now_unix=NOW).message == message


def test_newer_minor_version_and_unknown_flags_are_accepted():
    message = CommitNotice(epoch=2, leader="site-a", commit_index=5)
    raw = signed_raw(MessageKind.COMMIT_NOTICE, auth_map(message.to_wire()[0]), minor=9, flags=0b1010)
    assert decode_frame(raw, verifier(), now_unix=NOW).message == message


def test_other_major_version_is_refused_with_426():
    message = CommitNotice(epoch=2, leader="site-a", commit_index=5)
    raw = signed_raw(MessageKind.COMMIT_NOTICE, auth_map(message.to_wire()[0]), major=1)
    with pytest.raises(RemoteProtocolError, match="wire version 1.0 is not supported: this node speaks wire 3.0") as error:
        decode_frame(raw, verifier(), now_unix=NOW)
    assert error.value.status_hint == 426


def test_unknown_kind_is_refused():
    raw = signed_raw(999, auth_map({}))
    with pytest.raises(RemoteProtocolError, match="unknown message kind 999") as error:
        decode_frame(raw, verifier(), now_unix=NOW)
    assert error.value.status_hint == 400


def test_missing_message_field_is_named():
    fields = LogAck(epoch=2, follower="b", index=7, success=True).to_wire()[0]
    del fields["success"]
    with pytest.raises(RemoteProtocolError, match="LogAck.success: missing") as error:
        decode_frame(signed_raw(MessageKind.LOG_ACK, auth_map(fields)), verifier(), now_unix=NOW)
    assert error.value.status_hint == 400


def test_wrong_field_type_from_peer_is_a_remote_error():
    fields = {**LogAck(epoch=2, follower="b", index=7, success=True).to_wire()[0], "index": "7"}
    with pytest.raises(RemoteProtocolError, match="LogAck.index: must be an int, got str"):
        decode_frame(signed_raw(MessageKind.LOG_ACK, auth_map(fields)), verifier(), now_unix=NOW)


def test_ext_types_are_refused():
    raw_map = msgpack.packb(auth_map({"epoch": msgpack.ExtType(5, b"x")}), use_bin_type=True)
    fixed = FIXED_HEADER.pack(MAGIC, WIRE_MAJOR, 0, MessageKind.COMMIT_NOTICE, 0, len(raw_map), 0)
    raw = fixed + raw_map + compute_mac(KEY, fixed + raw_map)
    with pytest.raises(RemoteProtocolError, match="ext type 5 is not allowed"):
        decode_frame(raw, verifier(), now_unix=NOW)


# ---------------------------------------------------------------------------------------------
# Size limits: refused from the fixed header alone
# ---------------------------------------------------------------------------------------------


def test_oversize_payload_is_refused_from_the_fixed_header_alone():
    decoder = FrameDecoder(verifier())
    decoder.receive_data(FIXED_HEADER.pack(MAGIC, WIRE_MAJOR, 0, MessageKind.FRAGMENT_CONTRIBUTION, 0, 100,
                                           DEFAULT_LIMITS.max_payload(MessageKind.FRAGMENT_CONTRIBUTION) + 1))
    with pytest.raises(RemoteProtocolError, match="FRAGMENT_CONTRIBUTION payload of 268435457 bytes") as error:
        decoder.next_event(now_unix=NOW)
    assert error.value.status_hint == 413
    assert decoder.buffered_bytes == FIXED_HEADER_BYTES


def test_payload_on_a_kind_without_payload_is_refused_from_the_fixed_header():
    decoder = FrameDecoder(verifier())
    decoder.receive_data(FIXED_HEADER.pack(MAGIC, WIRE_MAJOR, 0, MessageKind.HEARTBEAT, 0, 100, 1))
    with pytest.raises(RemoteProtocolError, match="limit of 0") as error:
        decoder.next_event(now_unix=NOW)
    assert error.value.status_hint == 413


def test_oversize_header_map_is_refused_from_the_fixed_header_alone():
    limits = Limits(max_header_map_bytes=512)
    decoder = FrameDecoder(verifier(limits), limits)
    decoder.receive_data(FIXED_HEADER.pack(MAGIC, WIRE_MAJOR, 0, MessageKind.HEARTBEAT, 0, 513, 0))
    with pytest.raises(RemoteProtocolError, match="header map of 513 bytes exceeds the limit of 512") as error:
        decoder.next_event(now_unix=NOW)
    assert error.value.status_hint == 413


def test_per_instance_payload_limit():
    limits = DEFAULT_LIMITS.with_max_payload(MessageKind.SNAPSHOT_CHUNK, 10)
    ok = SnapshotChunk(fragment=0, commit_index=1, offset=0, total=20, digest=bytes(32), payload=b"a" * 10)
    big = dataclasses.replace(ok, payload=b"a" * 11)
    assert run_decoder([frame(ok)], limits=limits).status is None
    assert run_decoder([frame(big)], limits=limits).status == 413


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="max_header_map_bytes must be a positive int"):
        Limits(max_header_map_bytes=0)
    with pytest.raises(ValueError, match="clock_skew_allowance_s"):
        Limits(clock_skew_allowance_s=float("nan"))
    with pytest.raises(ValueError, match=r"max_payload_bytes\[1\]"):
        Limits(max_payload_bytes={1: -1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_LIMITS.read_timeout_s = 1.0  # type: ignore[misc]


def test_fixed_header_layout_is_24_bytes_big_endian():
    encoded = frame(LogAck(epoch=2, follower="b", index=7, success=True))
    magic, major, minor, kind, flags, map_length, payload_length = struct.unpack(">4sBBHIIQ", encoded[:24])
    assert (magic, major, minor, kind, flags, payload_length) == (b"DLCO", 3, 0, 3, 0, 0)
    assert len(encoded) == 24 + map_length + 32


# ---------------------------------------------------------------------------------------------
# Messages are valid by construction
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("build", "reason"), [
    (lambda: LogAck(epoch=-1, follower="a", index=0, success=True), r"LogAck.epoch: must be in \[0, "),
    (lambda: LogAck(epoch=True, follower="a", index=0, success=True), "LogAck.epoch: must be an int, got bool"),
    (lambda: LogAck(epoch=1, follower="a b", index=0, success=True), "does not match"),
    (lambda: LogAck(epoch=1, follower="a" * 65, index=0, success=True), "longer than 64"),
    (lambda: LogAck(epoch=1, follower="a", index=0, success=1), "must be a bool"),
    (lambda: JoinRequest(node_id="a", advertise_url="ftp://x", role="learner", manifest_digest=bytes(32)),
     "advertise_url"),
    (lambda: JoinRequest(node_id="a", advertise_url="http://x:1", role="boss", manifest_digest=bytes(32)),
     "role: must be one of"),
    (lambda: JoinRequest(node_id="a", advertise_url="http://x:1", role="witness", manifest_digest=b"x"),
     "manifest_digest: must be 32 bytes"),
    (lambda: FragmentContribution(0, 0, 0, 0, 0, "Int4", "a", b""), "codec"),
    (lambda: FragmentContribution(0, 0, 0, 0, 0, "int4", "a", bytearray()), "payload: must be bytes"),
    (lambda: LogEntry(index=1, epoch=1, kind="commit", metadata={"x": float("nan")}, payload=b""), "not finite"),
    (lambda: LogEntry(index=1, epoch=1, kind="commit", metadata={1: 2}, payload=b""), "keys must be str"),
    (lambda: LogEntry(index=1, epoch=1, kind="commit", metadata={"x": object()}, payload=b""),
     "unsupported value type"),
    (lambda: LogAppend(epoch=1, leader="a", prev_index=4, prev_epoch=1, leader_commit=0,
                       entries=(LogEntry(index=6, epoch=1, kind="noop", metadata={}, payload=b""),)),
     "must follow prev_index"),
    (lambda: LogAppend(epoch=1, leader="a", prev_index=4, prev_epoch=1, leader_commit=0,
                       entries=(LogEntry(index=5, epoch=2, kind="noop", metadata={}, payload=b""),)),
     "newer than the message epoch"),
    (lambda: Membership(epoch=1, config_index=1, payload=b"", members=(
        Member("a", "http://a:1", Role.LEARNER, True), Member("a", "http://b:1", Role.WITNESS, True))),
     "duplicate node id"),
    (lambda: SnapshotChunk(fragment=0, commit_index=0, offset=5, total=6, digest=bytes(32), payload=b"ab"),
     "runs past total"),
    (lambda: LogReadRequest(from_index=0, max_entries=0), "must be positive"),
    (lambda: LogReadReply(commit_index=3, first_index=4, entries=(
        LogEntry(index=4, epoch=1, kind="noop", metadata={}, payload=b""),)), "past commit index"),
])
def test_invalid_construction_is_a_local_error_naming_the_field(build, reason):
    with pytest.raises(LocalProtocolError, match=reason):
        build()


def test_messages_are_frozen_and_deeply_immutable():
    entry = LogEntry(index=1, epoch=1, kind="commit", metadata={"w": [1, {"x": 2}]}, payload=b"p")
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.index = 2  # type: ignore[misc]
    assert isinstance(entry.metadata, FrozenMap)
    assert entry.metadata["w"] == (1, FrozenMap({"x": 2}))
    assert hash(entry) == hash(LogEntry(index=1, epoch=1, kind="commit", metadata={"w": (1, {"x": 2})}, payload=b"p"))
    with pytest.raises(TypeError):
        entry.metadata["w"] = 3  # type: ignore[index]


def test_role_strings_become_roles():
    request = JoinRequest(node_id="w1", advertise_url="http://10.0.0.2:8470", role="witness",
                          manifest_digest=bytes(32))
    assert request.role is Role.WITNESS


def test_the_example_frame_in_docs_is_what_the_code_produces():
    """docs/WIRE.md's hex example is the interoperability reference: keep it byte-exact."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "WIRE.md").read_text()
    block = doc.split("<!-- example-frame")[1].split("```")[1].removeprefix("text")  # the fence says text (tests/test_doc_blocks.py)
    documented = bytes.fromhex("".join(block.split()))
    secret = b"example-run-secret-0123456789abcdef"
    auth = AuthContext("run-demo", "site-a", derive_frame_key(secret))
    message = FragmentContribution(fragment=2, base_index=7, base_round=10, c_steps=24, c_tokens=98304,
                                   codec="int8", learner_id="site-a", payload=bytes.fromhex("deadbeef"))
    assert encode_frame(message, auth, now_unix=1_800_000_000.0, nonce=bytes(range(16)), to="site-b") == documented
    received = decode_frame(documented, FrameVerifier("run-demo", derive_frame_key(secret), node_id="site-b"),
                            now_unix=1_800_000_000.0)
    assert received.message == message


def test_the_digest_vectors_in_docs_are_what_the_code_computes():
    """docs/WIRE.md's BLAKE3 vectors: a payload digest as `pd` carries it, and a fragment's state
    digest (the layout another implementation must reproduce to check a state download)."""
    from pathlib import Path

    import numpy as np

    from diloco_node.sync.state_codec import fragment_state_digest
    from wire.auth import payload_digest

    doc = (Path(__file__).resolve().parent.parent / "docs" / "WIRE.md").read_text()
    block = doc.split("<!-- digest-vectors")[1].split("```")[1].removeprefix("text")
    vectors = {line.rsplit(None, 1)[0]: line.rsplit(None, 1)[1] for line in block.strip().splitlines()}
    assert vectors.pop('pd("")') == payload_digest(b"").hex()
    assert vectors.pop("pd(de ad be ef)") == payload_digest(bytes.fromhex("deadbeef")).hex()
    state = fragment_state_digest(2, 5, {"w": np.array([1.0, -2.0, 0.5], np.float32)},
                                  {"w": np.array([0.0, 0.25, -1.0], np.float32)})
    assert vectors.pop("state(2, 5, w)") == state and not vectors


def test_a_frame_names_its_recipient_inside_the_mac():
    """A frame captured on its way to one member is refused by every other (401 with the reason);
    only kinds that change nothing a replay could abuse may be addressed to any member."""
    to_b = encode_frame(CommitNotice(epoch=2, leader="site-a", commit_index=5), AUTH, now_unix=NOW,
                        nonce=fresh_nonce(), to="site-b")
    at_b = FrameVerifier(RUN, KEY, node_id="site-b")
    at_c = FrameVerifier(RUN, KEY, node_id="site-c")
    assert decode_frame(to_b, at_b, now_unix=NOW).message.commit_index == 5
    with pytest.raises(RemoteProtocolError, match="addressed to 'site-b', not to 'site-c'") as error:
        decode_frame(to_b, at_c, now_unix=NOW)
    assert error.value.status_hint == 401
    unaddressed = frame(CommitNotice(epoch=2, leader="site-a", commit_index=5))
    with pytest.raises(RemoteProtocolError, match="COMMIT_NOTICE frame from 'site-a' names no recipient"):
        decode_frame(unaddressed, at_c, now_unix=NOW)
    join = frame(JoinRequest(node_id="site-a", advertise_url="http://10.0.0.2:8470", role="learner",
                             manifest_digest=bytes(32)))
    assert decode_frame(join, at_c, now_unix=NOW).message.node_id == "site-a"
    # Rewriting "to" breaks the MAC.
    forged = bytearray(to_b)
    at = bytes(forged).index(b"site-b", 24)
    forged[at:at + 6] = b"site-c"
    with pytest.raises(RemoteProtocolError, match="bad MAC"):
        decode_frame(bytes(forged), at_c, now_unix=NOW)


def test_the_receive_queue_gives_back_exactly_what_came_in_any_pieces():
    """The decoder's queue of received pieces (wire/frames.py `_ByteQueue`) against a bytearray."""
    from wire.frames import _ByteQueue

    rng = random.Random(1)
    for _ in range(100):
        queue, reference = _ByteQueue(), bytearray()
        for _ in range(40):
            if rng.random() < 0.6:
                data = rng.randbytes(rng.choice([0, 1, 5, 100, 70_000, 200_000]))
                queue.append(data if rng.random() < 0.5 else bytearray(data))
                reference += data
            elif reference:
                n = rng.randrange(len(reference) + 1)
                if rng.random() < 0.3:
                    assert queue.peek(n) == bytes(reference[:n])
                else:
                    assert queue.take(n) == bytes(reference[:n])
                    del reference[:n]
            assert len(queue) == len(reference)


def test_a_payload_that_arrives_as_one_read_is_not_copied():
    """A payload is copied at most once between the socket and its message: when one read holds
    exactly it, the message holds that very object."""
    payload = bytes(range(256)) * 1024
    encoded = frame(FragmentContribution(fragment=0, base_index=0, base_round=0, c_steps=1, c_tokens=1,
                                         codec="int8", learner_id="site-a", payload=payload))
    head, body = encoded[:-len(payload)], bytes(encoded[-len(payload):])
    decoder = FrameDecoder(verifier())
    decoder.receive_data(head)
    assert decoder.next_event(now_unix=NOW) is NEED_DATA
    decoder.receive_data(body)
    event = decoder.next_event(now_unix=NOW)
    assert isinstance(event, Received) and event.message.payload == payload and event.message.payload is body
