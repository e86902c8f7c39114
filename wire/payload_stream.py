"""A relayed log entry's payload streamed in chunks (wire 2.3): how a sender cuts it, how a
receiver checks each chunk, and the most bytes a run's payload can declare.

Sans-IO and pure: the transport hands frames in, the host writes the bytes to its spool file and
feeds them to the hash (off its event loop); nothing here reads a socket, a file or a clock. A
stream is one `PayloadOpen` (digest, size, chunk size, relay tree) then `PayloadChunk`s in order,
each `chunk_bytes` long except the last. The receiver (`PayloadAssembler`; what every stream's
receiver does, the stream id, nothing after the last chunk, dead after a refusal, is its base's,
`wire.stream_assembler.StreamAssembler`):

- checks the open before any chunk: its declared size at most `max_size` (the host's bound,
  `commit_size_bound` of the run's model shapes and codec, capped by
  `wire.limits.MAX_RELAYED_PAYLOAD_BYTES`) and its chunk size within the chunk payload limit;
- checks each chunk before the host keeps it: that its offset is where the last one ended, that
  it is exactly the size the open implies;
- checks at the end (`finish`) that every byte came and that the BLAKE3 digest the host computed is the
  declared one. Any failure is a `RemoteProtocolError` (400, or 413 for sizes) and the assembler
  is dead: the host deletes what it spooled.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from wire.codecs import CODECS
from wire.limits import DEFAULT_LIMITS, MAX_RELAYED_PAYLOAD_BYTES, Limits
from wire.messages import MessageKind, PayloadChunk, PayloadOpen
from wire.stream_assembler import StreamAssembler

# Non-commit payloads (an eviction record, a membership entry) are a few KiB; a run's bound is never
# below this, so they always fit whatever the model.
MIN_PAYLOAD_BOUND_BYTES = 1 << 20


def commit_size_bound(fragments: Iterable[Mapping[str, Sequence[int]]], codec_name: str, *,
                      overhead_bytes: int, ceiling: int = MAX_RELAYED_PAYLOAD_BYTES) -> int:
    """The most bytes any relayed payload of this run can have: the largest fragment's commit.

    `fragments`: each fragment's tensor shapes (the manifest's model, fragmented by the run's plan);
    a commit of a fragment is its tensors encoded with `codec_name` (each at most the codec's own
    bound, zstd only shrinks it) plus `overhead_bytes` for the entry's own fields. At least
    `MIN_PAYLOAD_BOUND_BYTES`, at most `ceiling`. Computed from shapes alone: nothing allocated.
    """
    codec = CODECS.get(codec_name)
    if codec is None:
        raise ValueError(f"unknown codec {codec_name!r}; known: {', '.join(sorted(CODECS))}")
    largest = 0
    for shapes in fragments:
        size = overhead_bytes
        for shape in shapes.values():
            values = 1
            for dim in shape:
                values *= int(dim)
            size += codec.estimate_encoded_size(values, max(1, len(shape)))
        largest = max(largest, size)
    return min(max(largest, MIN_PAYLOAD_BOUND_BYTES), ceiling)


def chunk_spans(size: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each chunk of a `size`-byte payload cut every `chunk_bytes`."""
    for offset in range(0, size, chunk_bytes):
        yield offset, min(chunk_bytes, size - offset)


def stream_chunk_bytes(limits: Limits = DEFAULT_LIMITS) -> int:
    """The chunk size a sender uses: the largest one the receiver's limit admits."""
    return limits.max_payload(MessageKind.PAYLOAD_CHUNK)


class PayloadAssembler(StreamAssembler[PayloadOpen, PayloadChunk]):
    """Checks one streamed payload chunk by chunk (sans-IO); the host keeps and hashes the bytes.

    Construct it from the PayloadOpen (raises RemoteProtocolError if the declaration is over
    `max_size` or its chunks over the chunk limit); `add` each chunk in arrival order before
    keeping it (raises on the first bad one; the assembler is then dead); `finish` with the BLAKE3 digest
    the host computed once the body ended.
    """

    KIND = "streamed payload"

    def __init__(self, head: PayloadOpen, max_size: int, limits: Limits = DEFAULT_LIMITS) -> None:
        if head.size > max_size:
            raise self.refused(f"it declares {head.size:,} bytes, more than the {max_size:,} bytes the largest "
                               "commit of this run's model can have", 413)
        chunk_limit = limits.max_payload(MessageKind.PAYLOAD_CHUNK)
        if head.chunk_bytes > chunk_limit:
            raise self.refused(f"chunk_bytes {head.chunk_bytes:,} is over the {chunk_limit:,}-byte chunk limit", 413)
        self.received = 0
        super().__init__(head)

    @property
    def complete(self) -> bool:
        return self.received == self.head.size

    @property
    def max_remaining_bytes(self) -> int:
        """Payload bytes still due (the transport bounds the rest of the body with it)."""
        return self.head.size - self.received

    @property
    def chunks_left(self) -> int:
        return -(-self.max_remaining_bytes // self.head.chunk_bytes)

    def _whole(self) -> str:
        return f"all {self.head.size:,} bytes came"

    def _take(self, chunk: PayloadChunk) -> None:
        """Refuse a chunk that is not the next one, exactly sized; else count it (the host keeps it)."""
        if chunk.offset != self.received:
            raise self.refused(f"expected the chunk at offset {self.received:,}, got one at {chunk.offset:,}")
        expected = min(self.head.chunk_bytes, self.head.size - self.received)
        if len(chunk.payload) != expected:
            raise self.refused(f"the chunk at offset {chunk.offset:,} holds {len(chunk.payload):,} bytes, expected "
                               f"{expected:,}", 413 if len(chunk.payload) > expected else 400)
        self.received += len(chunk.payload)

    def finish(self, digest: bytes) -> None:
        """The body ended and the host hashed what it kept: refused if short or not the declared bytes."""
        self._check_alive()
        if not self.complete:
            raise self._fail(f"short: {self.received:,} of {self.head.size:,} bytes",
                             f"the stream ended after {self.received:,} of {self.head.size:,} bytes")
        if digest != self.head.digest:
            raise self._fail("digest mismatch",
                             f"the bytes do not have BLAKE3 digest {self.head.digest.hex()[:16]}..; nothing kept")
