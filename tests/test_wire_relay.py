"""Wire 2.2: relayed log entries (digest and size instead of bytes), PayloadPush and PayloadFetch."""

from __future__ import annotations


import blake3
import pytest

from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.frames import WIRE_MAJOR, WIRE_MINOR
from wire.messages import (
    MAX_RELAY_FANOUT,
    LogAppend,
    LogEntry,
    LogReadReply,
    MessageKind,
    PayloadFetch,
    PayloadPush,
)

DIGEST = blake3.blake3(b"delta").digest()


def relayed(index: int) -> LogEntry:
    return LogEntry(index=index, epoch=1, kind="commit", metadata={"fragment": 0}, payload=b"",
                    payload_digest=DIGEST, payload_size=5)


def test_the_relay_kinds_keep_their_ids_in_wire_3():
    assert WIRE_MAJOR == 3
    assert (MessageKind.PAYLOAD_PUSH, MessageKind.PAYLOAD_FETCH) == (18, 19)


def test_a_relayed_entry_round_trips_beside_ordinary_ones_and_adds_no_payload_bytes():
    append = LogAppend(2, "a", 0, 0, (relayed(1), LogEntry(2, 2, "noop", {}, b"xy")), 0)
    fields, payload = append.to_wire()
    assert payload == b"xy"
    assert "payload_length" not in fields["entries"][0] and fields["entries"][0]["payload_size"] == 5
    decoded = LogAppend.from_wire(fields, payload)
    assert decoded == append and decoded.entries[0].relayed and not decoded.entries[1].relayed


def test_a_2_1_style_decoder_refuses_a_relayed_entry_instead_of_reading_an_empty_payload():
    fields, payload = LogAppend(1, "a", 0, 0, (relayed(1),), 0).to_wire()
    # What a 2.1 receiver requires of every entry map: payload_length. It is absent, so it refuses.
    assert all("payload_length" not in entry for entry in fields["entries"])


@pytest.mark.parametrize("change, problem", [
    ({"payload_digest": b"short"}, "must be 32 bytes"),
    ({"payload_size": 0}, "at least 1 byte"),
    ({"payload": b"x"}, "carries no bytes"),
])
def test_bad_relayed_entries_are_refused_naming_the_field(change, problem):
    kwargs = dict(index=1, epoch=1, kind="commit", metadata={}, payload=b"", payload_digest=DIGEST, payload_size=5)
    with pytest.raises(LocalProtocolError, match=problem):
        LogEntry(**{**kwargs, **change})


def test_a_size_without_a_digest_and_a_length_beside_a_digest_are_refused():
    with pytest.raises(LocalProtocolError, match="payload_size: set without payload_digest"):
        LogEntry(1, 1, "commit", {}, b"", payload_size=3)
    fields, payload = LogAppend(1, "a", 0, 0, (relayed(1),), 0).to_wire()
    fields["entries"][0]["payload_length"] = 0
    with pytest.raises(LocalProtocolError, match="payload_length: a relayed entry"):
        LogAppend.from_wire(fields, payload)


def test_a_log_read_never_carries_relayed_entries():
    with pytest.raises(LocalProtocolError, match="no relayed entries"):
        LogReadReply(commit_index=5, first_index=1, entries=(relayed(1),))


def test_a_push_with_a_tree_and_a_fetch_answer_round_trip():
    push = PayloadPush(DIGEST, "a", {"b": "a", "c": "a", "d": "b"}, b"delta")
    fields, payload = push.to_wire()
    assert PayloadPush.from_wire(fields, payload) == push
    answer = PayloadPush(DIGEST, "", {}, b"delta")
    assert PayloadPush.from_wire(*answer.to_wire()) == answer
    fetch = PayloadFetch(DIGEST)
    assert PayloadFetch.from_wire(*fetch.to_wire()) == fetch


@pytest.mark.parametrize("root, parent, problem", [
    ("a", {"b": "c"}, "'b' does not lead to the root 'a'"),
    ("a", {"b": "c", "c": "b"}, "does not lead to the root|cycle"),
    ("a", {"a": "b", "b": "a"}, "the root 'a' has a parent"),
    ("", {"b": "a"}, "carries no tree"),
    ("a", {"b c": "a"}, "does not match"),
    ("a", {f"n{i}": "a" for i in range(MAX_RELAY_FANOUT + 1)}, "more than 16 members"),
])
def test_a_bad_tree_is_refused_naming_what_is_wrong(root, parent, problem):
    with pytest.raises(LocalProtocolError, match=problem):
        PayloadPush(DIGEST, root, parent, b"delta")


def test_pushes_and_fetches_refuse_bad_digests_and_empty_payloads():
    with pytest.raises(LocalProtocolError, match="digest: must be 32 bytes"):
        PayloadFetch(b"\x00" * 31)
    with pytest.raises(LocalProtocolError, match="at least 1 byte"):
        PayloadPush(DIGEST, "", {}, b"")


def test_a_peers_push_with_a_cyclic_tree_is_refused_by_the_decoder_as_its_error():
    """A correctly signed frame from a member whose tree has a cycle: RemoteProtocolError 400, never a crash."""
    import msgpack

    from wire.auth import FrameVerifier, compute_mac, derive_frame_key
    from wire.frames import FIXED_HEADER, MAGIC, decode_frame

    key = derive_frame_key(b"s" * 32)
    now = 1_800_000_000.0
    payload = b"delta"
    header = {"run": "run-test", "from": "a", "ts": round(now * 1000), "nonce": b"\x01" * 16,
              "pd": blake3.blake3(payload).digest(), "to": "",
              "m": {"digest": DIGEST, "root": "a", "parent": {"b": "c", "c": "b"}}}
    map_bytes = msgpack.packb(header, use_bin_type=True)
    fixed = FIXED_HEADER.pack(MAGIC, WIRE_MAJOR, WIRE_MINOR, int(MessageKind.PAYLOAD_PUSH), 0, len(map_bytes),
                              len(payload))
    frame = fixed + map_bytes + compute_mac(key, fixed + map_bytes) + payload
    with pytest.raises(RemoteProtocolError, match="PayloadPush.parent") as refused:
        decode_frame(frame, FrameVerifier("run-test", key), now_unix=now)
    assert refused.value.status_hint == 400
