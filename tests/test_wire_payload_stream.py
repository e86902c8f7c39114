"""Wire 2.3: a relayed payload streamed as PayloadOpen + PayloadChunks, and the receiver's checks."""

from __future__ import annotations

import math
import tracemalloc

import blake3
import pytest
from test_contribution_stream import llama_shapes

from diloco_node.daemon.coordination_store import MAX_RECORD_BYTES
from diloco_node.sync.fragments import WIRE_OVERHEAD_BYTES, plan_fragments, wire_fit_problems
from wire.codecs import CODECS
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.frames import WIRE_MAJOR, WIRE_MINOR
from wire.limits import (
    DEFAULT_LIMITS,
    MAX_LOG_APPEND_BYTES,
    MAX_PAYLOAD_STREAM_CHUNK_BYTES,
    MAX_RELAYED_PAYLOAD_BYTES,
    MiB,
)
from wire.messages import MessageKind, PayloadChunk, PayloadOpen
from wire.payload_stream import (
    MIN_PAYLOAD_BOUND_BYTES,
    PayloadAssembler,
    chunk_spans,
    commit_size_bound,
    stream_chunk_bytes,
)

STREAM = b"s" * 16
PAYLOAD = bytes(range(256)) * 41  # 10,496 bytes


def opened(size: int = len(PAYLOAD), chunk_bytes: int = 4096, digest: bytes | None = None) -> PayloadOpen:
    return PayloadOpen(STREAM, digest or blake3.blake3(PAYLOAD).digest(), size, chunk_bytes, "a", {"b": "a"})


def chunks(payload: bytes = PAYLOAD, chunk_bytes: int = 4096) -> list[PayloadChunk]:
    return [PayloadChunk(STREAM, offset, payload[offset:offset + length])
            for offset, length in chunk_spans(len(payload), chunk_bytes)]


def test_the_wire_version_is_3_0_and_the_stream_kinds_keep_their_ids():
    assert (WIRE_MAJOR, WIRE_MINOR) == (3, 0)
    assert (MessageKind.PAYLOAD_OPEN, MessageKind.PAYLOAD_CHUNK) == (20, 21)
    assert stream_chunk_bytes() == MAX_PAYLOAD_STREAM_CHUNK_BYTES == 16 * MiB


def test_open_and_chunk_round_trip_and_bad_fields_are_named():
    head = opened()
    assert head.chunks == 3
    fields, payload = head.to_wire()
    assert payload == b"" and PayloadOpen.from_wire(fields, payload) == head
    chunk = chunks()[1]
    assert PayloadChunk.from_wire(*chunk.to_wire()) == chunk
    with pytest.raises(LocalProtocolError, match="size: a relayed payload is at least 1 byte"):
        opened(size=0)
    with pytest.raises(LocalProtocolError, match="chunk_bytes: must be >= 1"):
        opened(chunk_bytes=0)
    with pytest.raises(LocalProtocolError, match="payload: a chunk carries at least 1 byte"):
        PayloadChunk(STREAM, 0, b"")
    with pytest.raises(LocalProtocolError, match="carries no payload"):
        PayloadOpen.from_wire(fields, b"x")


def test_a_whole_stream_passes_and_the_digest_is_checked_at_the_end():
    assembler = PayloadAssembler(opened(), max_size=len(PAYLOAD))
    assert (assembler.chunks_left, assembler.max_remaining_bytes) == (3, len(PAYLOAD))
    for chunk in chunks():
        assembler.add(chunk)
    assert assembler.complete and assembler.chunks_left == 0
    assembler.finish(blake3.blake3(PAYLOAD).digest())
    other = PayloadAssembler(opened(), max_size=len(PAYLOAD))
    for chunk in chunks():
        other.add(chunk)
    with pytest.raises(RemoteProtocolError, match="do not have BLAKE3 digest") as error:
        other.finish(blake3.blake3(b"altered").digest())
    assert error.value.status_hint == 400


def test_a_declaration_over_the_bound_or_the_chunk_limit_is_refused_before_any_chunk():
    with pytest.raises(RemoteProtocolError, match="declares 10,497 bytes, more than the 10,496") as error:
        PayloadAssembler(opened(size=len(PAYLOAD) + 1), max_size=len(PAYLOAD))
    assert error.value.status_hint == 413
    with pytest.raises(RemoteProtocolError, match="over the 16,777,216-byte chunk limit"):
        PayloadAssembler(opened(chunk_bytes=16 * MiB + 1), max_size=len(PAYLOAD))


@pytest.mark.parametrize("bad, problem", [
    (lambda c: [c[1]], "expected the chunk at offset 0, got one at 4,096"),
    (lambda c: [c[0], c[0]], "expected the chunk at offset 4,096, got one at 0"),
    (lambda c: [PayloadChunk(b"t" * 16, 0, c[0].payload)], "another stream"),
    (lambda c: [PayloadChunk(STREAM, 0, c[0].payload[:-1])], "holds 4,095 bytes, expected 4,096"),
    (lambda c: [PayloadChunk(STREAM, 0, c[0].payload + b"x")], "holds 4,097 bytes, expected 4,096"),
    (lambda c: [*c, PayloadChunk(STREAM, len(PAYLOAD), b"x")], "after the last one"),
])
def test_chunks_out_of_order_or_of_the_wrong_size_are_refused_and_kill_the_stream(bad, problem):
    assembler = PayloadAssembler(opened(), max_size=MAX_RELAYED_PAYLOAD_BYTES)
    with pytest.raises(RemoteProtocolError, match=problem):
        for chunk in bad(chunks()):
            assembler.add(chunk)
    with pytest.raises(RemoteProtocolError, match="already failed"):
        assembler.finish(blake3.blake3(PAYLOAD).digest())


def test_a_short_stream_is_refused():
    assembler = PayloadAssembler(opened(), max_size=len(PAYLOAD))
    for chunk in chunks()[:2]:
        assembler.add(chunk)
    with pytest.raises(RemoteProtocolError, match="ended after 8,192 of 10,496 bytes"):
        assembler.finish(blake3.blake3(PAYLOAD).digest())


def test_the_bound_is_the_largest_fragments_commit_within_a_floor_and_the_ceiling():
    small = [{"w": (10, 10)}, {"b": (10,)}]
    assert commit_size_bound(small, "fp32", overhead_bytes=0) == MIN_PAYLOAD_BOUND_BYTES
    big = [{"w": (1024, 1024), "v": (1024,)}, {"b": (512, 1024)}]
    bound = commit_size_bound(big, "fp32", overhead_bytes=1000)
    assert 4 * (1024 * 1024 + 1024) + 1000 <= bound < 4 * (1024 * 1024 + 1024) + 1000 + 4096
    assert commit_size_bound(big, "int4", overhead_bytes=1000) < bound / 4
    assert commit_size_bound([{"e": (2**20, 2**10)}], "fp32", overhead_bytes=0) == MAX_RELAYED_PAYLOAD_BYTES
    with pytest.raises(ValueError, match="unknown codec 'nope'"):
        commit_size_bound(big, "nope", overhead_bytes=0)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_no_limit_refuses_the_commit_of_any_fragment_of_a_7b_model_at_24_fragments(codec):
    """Every codec (fp32 included) as codec_down: the commit of every fragment of LLaMA-7B at P = 24
    passes every limit of the streamed path, checked from the shapes alone (nothing allocated)."""
    shapes = llama_shapes()
    plan = plan_fragments(shapes, 24, 48, 1)
    fragments = [{name: shapes[name] for name in fragment.names} for fragment in plan.fragments]
    tracemalloc.start()
    try:
        # The receiver's bound: the largest fragment's commit, what a node computes from its manifest.
        bound = commit_size_bound(fragments, codec, overhead_bytes=WIRE_OVERHEAD_BYTES)
        assert bound <= MAX_RELAYED_PAYLOAD_BYTES < MAX_RECORD_BYTES  # a declared payload fits a log.bin record
        # The start-up check a node runs before training (site_model.py) passes: no fragment refused.
        assert wire_fit_problems(plan, shapes, "int4", codec, max_log_append_bytes=MAX_RELAYED_PAYLOAD_BYTES) == []
        chunk_bytes = stream_chunk_bytes()
        chunk_limit = DEFAULT_LIMITS.max_payload(MessageKind.PAYLOAD_CHUNK)
        for fragment in fragments:
            commit = WIRE_OVERHEAD_BYTES + sum(CODECS[codec].estimate_encoded_size(math.prod(s), len(s))
                                               for s in fragment.values())
            assert commit <= bound
            head = PayloadOpen(STREAM, b"d" * 32, commit, chunk_bytes, "", {})
            assembler = PayloadAssembler(head, bound)  # the receiver takes the declaration
            assert assembler.chunks_left == head.chunks == -(-commit // chunk_bytes)
            assert all(length <= chunk_limit for _, length in chunk_spans(commit, chunk_bytes))
        if codec == "fp32":  # the embedding fragment: 131M values, ~501 MiB, over the 256 MiB frame limit
            assert bound > MAX_LOG_APPEND_BYTES
        # ... and one byte more than the bound is refused from the declaration alone.
        with pytest.raises(RemoteProtocolError, match="more than the") as error:
            PayloadAssembler(PayloadOpen(STREAM, b"d" * 32, bound + 1, chunk_bytes, "", {}), bound)
        assert error.value.status_hint == 413
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20  # shapes and plans only: no payload was allocated
