"""Frames and messages: round trips for every kind, a total incremental decoder, size limits, versioning.

The fuzz-style properties run FUZZ_EXAMPLES examples each (2,000 by default; benchmarks/wire_fuzz.py
runs a direct loop at 100k+).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire.auth import AuthContext, FrameVerifier, compute_mac, derive_frame_key
from wire.errors import LocalProtocolError, RemoteProtocolError
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
    DIGEST_BYTES,
    MAX_NODE_ID_CHARS,
    MESSAGE_TYPES,
    U63_MAX,
    CommitNotice,
    FragmentContribution,
    FrozenMap,
    Heartbeat,
    HeartbeatAck,
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
    Role,
    SnapshotChunk,
    SnapshotRequest,
    VoteReply,
    VoteRequest,
)

FUZZ_EXAMPLES = int(os.environ.get("WIRE_FUZZ_EXAMPLES", "2000"))
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
                  "pd": hashlib.sha256(payload).digest(), "m": message_fields}
    header_map.update(overrides)
    return header_map


def run_decoder(chunks, *, limits: Limits = DEFAULT_LIMITS, stream_kinds=(), now: float = NOW):
    """Feed chunks then end-of-stream; return (events with payload chunks coalesced, error status or None)."""
    decoder = FrameDecoder(verifier(limits), limits, stream_kinds=stream_kinds)
    events: list = []
    try:
        for chunk in [*(c for c in chunks if c), b""]:
            decoder.receive_data(chunk)
            while (event := decoder.next_event(now_unix=now)) not in (NEED_DATA, CLOSED):
                events.append(event)
        return coalesce(events), None, event
    except RemoteProtocolError as error:
        return coalesce(events), error.status_hint, None


def coalesce(events: list) -> list:
    out: list = []
    for event in events:
        if isinstance(event, PayloadChunk) and out and isinstance(out[-1], PayloadChunk):
            out[-1] = PayloadChunk(out[-1].data + event.data)
        else:
            out.append(event)
    return out


def messages_of(events: list) -> list:
    """Reassemble streamed frames into whole messages so both decoding modes compare equal."""
    out, head, parts = [], None, []
    for event in events:
        if isinstance(event, Received):
            out.append(event.message)
        elif isinstance(event, FrameHeader):
            head, parts = event.head, []
        elif isinstance(event, PayloadChunk):
            parts.append(event.data)
        elif isinstance(event, FrameEnd):
            out.append(dataclasses.replace(head, payload=b"".join(parts)))
    return out


# ---------------------------------------------------------------------------------------------
# Strategies: one per message kind
# ---------------------------------------------------------------------------------------------

_ID_FIRST = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_ID_REST = _ID_FIRST + "._:@-"
node_ids = st.builds(lambda a, b: a + b, st.sampled_from(_ID_FIRST),
                     st.text(_ID_REST, max_size=MAX_NODE_ID_CHARS - 1))
names = st.builds(lambda a, b: a + b, st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789"),
                  st.text("abcdefghijklmnopqrstuvwxyz0123456789._-", max_size=31))
uints = st.one_of(st.integers(0, 1000), st.integers(0, U63_MAX))
small_uints = st.integers(0, 2**40)
payloads = st.binary(max_size=300)
digests = st.binary(min_size=DIGEST_BYTES, max_size=DIGEST_BYTES)
urls = st.builds(lambda host, port: f"http://{host}:{port}", node_ids, st.integers(1, 65535))
reasons = st.text(max_size=80)
roles = st.sampled_from(list(Role))
metadata_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20), st.binary(max_size=20)),
    lambda children: st.one_of(st.lists(children, max_size=4).map(tuple),
                               st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)
metadata = st.dictionaries(st.text(max_size=10), metadata_values, max_size=5)


@st.composite
def entry_runs(draw, *, first_index: int, max_epoch: int):
    count = draw(st.integers(0, 4))
    return tuple(LogEntry(index=first_index + i, epoch=draw(st.integers(0, max_epoch)), kind=draw(names),
                          metadata=draw(metadata), payload=draw(payloads)) for i in range(count))


@st.composite
def log_appends(draw):
    epoch = draw(small_uints)
    prev_index = draw(small_uints)
    return LogAppend(epoch=epoch, leader=draw(node_ids), prev_index=prev_index, prev_epoch=draw(small_uints),
                     entries=draw(entry_runs(first_index=prev_index + 1, max_epoch=epoch)),
                     leader_commit=draw(small_uints))


@st.composite
def log_read_replies(draw):
    first = draw(small_uints)
    entries = draw(entry_runs(first_index=first, max_epoch=draw(small_uints)))
    commit = draw(st.integers(entries[-1].index if entries else 0, 2**41))
    return LogReadReply(commit_index=commit, first_index=first, entries=entries)


@st.composite
def snapshot_chunks(draw):
    payload = draw(payloads)
    offset = draw(small_uints)
    return SnapshotChunk(fragment=draw(uints), commit_index=draw(uints), offset=offset,
                         total=offset + len(payload) + draw(small_uints), digest=draw(digests), payload=payload)


members = st.builds(Member, node_id=node_ids, advertise_url=urls, role=roles, voter=st.booleans())

STRATEGIES = {
    MessageKind.FRAGMENT_CONTRIBUTION: st.builds(
        FragmentContribution, fragment=uints, base_index=uints, base_round=uints, c_steps=uints, c_tokens=uints,
        codec=names, learner_id=node_ids, payload=payloads),
    MessageKind.LOG_APPEND: log_appends(),
    MessageKind.LOG_ACK: st.builds(LogAck, epoch=uints, follower=node_ids, index=uints, success=st.booleans()),
    MessageKind.COMMIT_NOTICE: st.builds(CommitNotice, epoch=uints, leader=node_ids, commit_index=uints),
    MessageKind.VOTE_REQUEST: st.builds(VoteRequest, epoch=uints, candidate=node_ids, last_log_epoch=uints,
                                        last_log_index=uints),
    MessageKind.VOTE_REPLY: st.builds(VoteReply, epoch=uints, voter=node_ids, granted=st.booleans(), reason=reasons),
    MessageKind.HEARTBEAT: st.builds(Heartbeat, epoch=uints, leader=node_ids, seq=uints, commit_index=uints),
    MessageKind.HEARTBEAT_ACK: st.builds(HeartbeatAck, epoch=uints, follower=node_ids, seq=uints, match_index=uints),
    MessageKind.JOIN_REQUEST: st.builds(JoinRequest, node_id=node_ids, advertise_url=urls, role=roles,
                                        manifest_digest=digests),
    MessageKind.MEMBERSHIP: st.builds(
        Membership, epoch=uints, config_index=uints,
        members=st.lists(members, max_size=5, unique_by=lambda m: m.node_id).map(tuple), payload=payloads),
    MessageKind.SNAPSHOT_REQUEST: st.builds(SnapshotRequest, fragment=uints, offset=uints, max_length=st.integers(1, U63_MAX)),
    MessageKind.SNAPSHOT_CHUNK: snapshot_chunks(),
    MessageKind.LOG_READ_REQUEST: st.builds(LogReadRequest, from_index=uints, max_entries=st.integers(1, 1024)),
    MessageKind.LOG_READ_REPLY: log_read_replies(),
    MessageKind.LEAVE: st.builds(Leave, node_id=node_ids, reason=reasons),
}
any_message = st.one_of(*STRATEGIES.values())


def test_every_kind_has_a_strategy_and_a_unique_class():
    assert set(STRATEGIES) == set(MessageKind)
    assert {cls.KIND for cls in MESSAGE_TYPES.values()} == set(MessageKind)


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(MessageKind), ids=lambda kind: kind.name)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_every_kind(kind, data):
    message = data.draw(STRATEGIES[kind])
    received = decode_frame(frame(message), verifier(), now_unix=NOW + 1)
    assert received.message == message
    assert type(received.message) is type(message)
    assert received.sender == "site-a"
    assert received.sent_at_unix == NOW


@pytest.mark.parametrize("kind", STREAMABLE_KINDS, ids=lambda kind: kind.name)
@quick
@given(data=st.data(), chunk=st.integers(1, 64))
def test_streamed_round_trip(kind, data, chunk):
    message = data.draw(STRATEGIES[kind])
    limits = Limits(max_payload_chunk_bytes=chunk)
    events, status, _ = run_decoder([frame(message)], limits=limits, stream_kinds=[kind])
    assert status is None
    assert isinstance(events[0], FrameHeader)
    assert events[0].head == message.without_payload()
    assert events[0].payload_length == len(message.payload)
    assert messages_of(events) == [message]
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
                             payload_length=len(payload), payload_sha256=hashlib.sha256(payload).digest())
    assert decode_frame(head + payload, verifier(), now_unix=NOW).message == message
    with pytest.raises(LocalProtocolError, match="without its payload"):
        encode_frame_head(message, AUTH, now_unix=NOW, nonce=fresh_nonce(), payload_length=len(payload),
                          payload_sha256=hashlib.sha256(payload).digest())
    with pytest.raises(LocalProtocolError, match="cannot be streamed|no single payload"):
        encode_frame_head(LogAck(epoch=1, follower="a", index=1, success=True), AUTH, now_unix=NOW,
                          nonce=fresh_nonce(), payload_length=0, payload_sha256=bytes(32))


def test_streamed_payload_that_does_not_match_its_digest_is_refused_at_the_end():
    payload = b"x" * 100
    message = SnapshotChunk(fragment=0, commit_index=1, offset=0, total=100, digest=bytes(32), payload=b"")
    head = encode_frame_head(message, AUTH, now_unix=NOW, nonce=fresh_nonce(), payload_length=100,
                             payload_sha256=hashlib.sha256(b"y" * 100).digest())
    events, status, _ = run_decoder([head + payload], stream_kinds=[MessageKind.SNAPSHOT_CHUNK])
    assert status == 401
    assert isinstance(events[0], FrameHeader) and events[-1] == PayloadChunk(payload)


def test_streamed_head_refused_when_declared_length_cannot_fit():
    message = SnapshotChunk(fragment=0, commit_index=1, offset=90, total=100, digest=bytes(32), payload=b"")
    with pytest.raises(LocalProtocolError, match="runs past total"):
        encode_frame_head(message, AUTH, now_unix=NOW, nonce=fresh_nonce(), payload_length=11,
                          payload_sha256=bytes(32))
    raw = signed_raw(MessageKind.SNAPSHOT_CHUNK, auth_map(message.to_wire()[0], b"z" * 11), b"z" * 11)
    events, status, _ = run_decoder([raw], stream_kinds=[MessageKind.SNAPSHOT_CHUNK])
    assert (events, status) == ([], 400)


def test_streaming_only_for_single_payload_kinds():
    with pytest.raises(LocalProtocolError, match="cannot be streamed"):
        FrameDecoder(verifier(), stream_kinds=[MessageKind.LOG_APPEND])


# ---------------------------------------------------------------------------------------------
# The total decoder
# ---------------------------------------------------------------------------------------------

# A fixed pool of valid messages (every kind, with payloads and metadata) keeps the 2,000-example
# fuzz properties fast: hypothesis spends its budget on damage and splits, not on building messages.
_ENTRIES = (LogEntry(index=8, epoch=3, kind="commit", payload=b"delta" * 7,
                     metadata={"fragment": 2, "round": 11, "contributors": ["site-a", "site-b"],
                               "weights": [0.25, 0.75], "digest": bytes(range(32))}),
            LogEntry(index=9, epoch=3, kind="membership", metadata={"add": "site-d"}, payload=b""))
POOL_MESSAGES = [
    FragmentContribution(fragment=2, base_index=7, base_round=10, c_steps=24, c_tokens=98_304, codec="int4-zstd",
                         learner_id="site-b", payload=bytes(range(0, 256, 4))),
    LogAppend(epoch=3, leader="site-a", prev_index=7, prev_epoch=2, entries=_ENTRIES, leader_commit=7),
    LogAck(epoch=3, follower="site-b", index=9, success=True),
    CommitNotice(epoch=3, leader="site-a", commit_index=9),
    VoteRequest(epoch=4, candidate="site-c", last_log_epoch=3, last_log_index=9),
    VoteReply(epoch=4, voter="site-b", granted=False, reason="heard from lease holder site-a 0.4 s ago"),
    Heartbeat(epoch=3, leader="site-a", seq=1234, commit_index=9),
    HeartbeatAck(epoch=3, follower="site-c", seq=1234, match_index=9),
    JoinRequest(node_id="site-d", advertise_url="http://10.0.0.4:8470", role=Role.LEARNER,
                manifest_digest=hashlib.sha256(b"manifest").digest()),
    Membership(epoch=3, config_index=9, payload=b'{"model": "tiny"}', members=(
        Member("site-a", "http://10.0.0.1:8470", Role.LEARNER, True),
        Member("w1", "http://10.0.0.9:8470", Role.WITNESS, True))),
    SnapshotRequest(fragment=2, offset=4096, max_length=1 << 20),
    SnapshotChunk(fragment=2, commit_index=9, offset=4096, total=10_000, digest=bytes(32), payload=b"\x00\xff" * 20),
    LogReadRequest(from_index=8, max_entries=64),
    LogReadReply(commit_index=9, first_index=1, entries=_ENTRIES),
    Leave(node_id="site-b", reason="SIGTERM"),
]
assert {m.KIND for m in POOL_MESSAGES} == set(MessageKind)
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
    events, status, end = run_decoder([data], stream_kinds=STREAMABLE_KINDS if stream else ())
    assert status in (None, 400, 401, 409, 413, 426)
    assert all(isinstance(e, (Received, FrameHeader, PayloadChunk, FrameEnd)) for e in events)
    if status is None:
        assert end is CLOSED


@fuzz
@given(data=st.one_of(frame_streams, hostile_bytes(), authenticated_garbage()), stream=st.booleans())
def test_byte_at_a_time_equals_whole_buffer(data, stream):
    kinds = STREAMABLE_KINDS if stream else ()
    whole = run_decoder([data], stream_kinds=kinds)[:2]
    single = run_decoder([data[i:i + 1] for i in range(len(data))], stream_kinds=kinds)[:2]
    assert single == whole


@fuzz
@given(data=st.one_of(frame_streams, hostile_bytes()), cuts=st.lists(st.integers(0, 2000), max_size=8),
       stream=st.booleans())
def test_random_chunk_splits_equal_whole(data, cuts, stream):
    kinds = STREAMABLE_KINDS if stream else ()
    points = sorted({min(c, len(data)) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]
    assert run_decoder(chunks, stream_kinds=kinds)[:2] == run_decoder([data], stream_kinds=kinds)[:2]


@fuzz
@given(pick=st.integers(0, len(POOL_FRAMES) - 1), where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_a_flipped_byte_anywhere_is_caught_or_harmless(pick, where, mask):
    encoded = bytearray(POOL_FRAMES[pick])
    encoded[int(where * len(encoded))] ^= mask
    events, status, _ = run_decoder([bytes(encoded)])
    if status is None:
        assert messages_of(events) == [POOL_MESSAGES[pick]]
    else:
        # 409: the flip changed the run id, which is checked (for a clear answer to a misconfigured
        # node) before the MAC; the frame is refused either way.
        assert status in (400, 401, 409, 413, 426)


def test_clean_end_between_frames_and_truncation_inside_one():
    encoded = frame(LogAck(epoch=2, follower="b", index=7, success=True))
    events, status, end = run_decoder([encoded])
    assert status is None and end is CLOSED and len(events) == 1
    for cut in (1, FIXED_HEADER_BYTES, len(encoded) - 1):
        events, status, _ = run_decoder([encoded[:cut]])
        assert (events, status) == ([], 400)


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
    raw = signed_raw(MessageKind.COMMIT_NOTICE, auth_map(message.to_wire()[0]), major=2)
    with pytest.raises(RemoteProtocolError, match="wire version 2.0 is not supported") as error:
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
    assert run_decoder([frame(ok)], limits=limits)[1] is None
    assert run_decoder([frame(big)], limits=limits)[1] == 413


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
    assert (magic, major, minor, kind, flags, payload_length) == (b"DLCO", 1, 0, 3, 0, 0)
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
    block = doc.split("<!-- example-frame")[1].split("```")[1]
    documented = bytes.fromhex("".join(block.split()))
    secret = b"example-run-secret-0123456789abcdef"
    auth = AuthContext("run-demo", "site-a", derive_frame_key(secret))
    message = FragmentContribution(fragment=2, base_index=7, base_round=10, c_steps=24, c_tokens=98304,
                                   codec="int8", learner_id="site-a", payload=bytes.fromhex("deadbeef"))
    assert encode_frame(message, auth, now_unix=1_800_000_000.0, nonce=bytes(range(16))) == documented
    received = decode_frame(documented, FrameVerifier("run-demo", derive_frame_key(secret)),
                            now_unix=1_800_000_000.0)
    assert received.message == message
