"""A contribution streamed tensor by tensor (wire 2.1): how a sender cuts it into chunks, and how a
receiver checks each chunk as it arrives and keeps the contribution in its encoded form.

Sans-IO and pure (numpy and wire.codecs only): the transport hands frames in, nothing here reads
a socket or a clock. A stream is one `ContributionOpen` naming the tensors (names and shapes, in
sending order) and `chunk_elements`, then `ContributionChunk`s in order, each a one-tensor codec
message of at most `chunk_elements` values. The receiver (`ContributionAssembler`; what every
stream's receiver does, the stream id, nothing after the last chunk, dead after a refusal, is its
base's, `wire.stream_assembler.StreamAssembler`):

- checks the open against the fragment's own shapes (the model's, from the manifest) before any
  chunk: exactly the fragment's tensors, exact shapes, a known codec, and a chunk size whose
  largest encoding (the codec's own bound) fits `Limits.max_contribution_chunk_bytes`;
- checks each chunk before decoding: that it is the next chunk expected, that its encoded size
  is at most what the codec can produce for that many values; then decodes it
  (bounded by that many values; decoded values are always finite float32), checks its shape, and
  adds its sum of squares to the tensor's norm;
- keeps the chunk's encoded bytes, not the decoded values: `finish()` gives an `EncodedDelta`, a
  read-only mapping name -> float32 tensor that decodes one tensor when asked for it, with the
  tensor norms measured on arrival.

So a transfer holds one chunk (encoded and decoded) at a time, and a waiting contribution costs its
encoded size. `plan_chunks` is the same arithmetic from shapes alone: it lets a node check before
training that every tensor of its model can be sent (`chunk_problems`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from wire.codecs import CODECS, decode_tensor, encode_tensor, frame_body
from wire.codecs.schemes import Codec
from wire.errors import RemoteProtocolError
from wire.limits import DEFAULT_LIMITS, Limits
from wire.messages import ContributionChunk, ContributionOpen, MessageKind, TensorSpec
from wire.stream_assembler import StreamAssembler

# Byte 5 of a wire.codecs message is its codec's wire id (docs/CODECS.md, "Message layout").
_CODEC_ID_OFFSET = 5


def chunk_bound(codec: Codec, values: int) -> int:
    """Most bytes `codec` can encode `values` values into (one 1-D tensor; zstd only shrinks it)."""
    return codec.estimate_encoded_size(values, 1)


def chunk_elements_for(codec_name: str, limits: Limits = DEFAULT_LIMITS) -> int:
    """The largest chunk (in values) whose encoding always fits the chunk payload limit."""
    codec = _codec(codec_name)
    byte_limit = limits.max_payload(MessageKind.CONTRIBUTION_CHUNK)
    low, high = 0, limits.max_chunk_elements  # chunk_bound is increasing in values: bisect
    while low < high:
        mid = (low + high + 1) // 2
        if chunk_bound(codec, mid) <= byte_limit:
            low = mid
        else:
            high = mid - 1
    # Whole blocks, so a tensor quantizes to the same values however it is cut (each chunk is its
    # own codec message, padded to a block like a tensor of a whole-fragment message).
    block = codec.default_block_size
    if block and low >= block:
        low -= low % block
    if low < 1:
        raise ValueError(f"a chunk of one {codec_name} value does not fit the {byte_limit}-byte chunk limit")
    return low


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How one tensor is cut: `chunks` pieces of `chunk_elements` values (the last one shorter)."""

    name: str
    shape: tuple[int, ...]
    chunk_elements: int

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def chunks(self) -> int:
        return max(1, -(-self.num_elements // self.chunk_elements))

    def chunk_sizes(self) -> Iterator[tuple[int, int]]:
        """(offset, values) of each chunk in order (an empty tensor is one chunk of 0 values)."""
        n = self.num_elements
        if n == 0:
            yield 0, 0
            return
        for offset in range(0, n, self.chunk_elements):
            yield offset, min(self.chunk_elements, n - offset)


def plan_chunks(shapes: Mapping[str, Sequence[int]], codec_name: str,
                limits: Limits = DEFAULT_LIMITS) -> list[ChunkPlan]:
    """The chunks of a contribution of these tensors (sorted by name, the sending order)."""
    per_chunk = chunk_elements_for(codec_name, limits)
    return [ChunkPlan(name, tuple(int(d) for d in shapes[name]), per_chunk) for name in sorted(shapes)]


def max_encoded_bytes(head: ContributionOpen) -> int:
    """Most payload bytes the chunks this open announces can carry (the codec's bound, chunk by chunk)."""
    codec = _codec(head.codec)
    return sum(chunk_bound(codec, values) for spec in head.tensors
               for _, values in ChunkPlan(spec.name, spec.shape, head.chunk_elements).chunk_sizes())


def chunk_problems(shapes: Mapping[str, Sequence[int]], codec_name: str, limits: Limits = DEFAULT_LIMITS) -> list[str]:
    """Why some tensor of these could not be streamed (empty: every tensor can).

    Every chunk the plan makes must pass the receiver's own checks: at most `max_chunk_elements`
    values and the codec's bound for them within the chunk payload limit. The receiver applies the
    same checks to a peer's stream (`ContributionAssembler`), so a plan that passes here is never
    refused for its size.
    """
    codec = _codec(codec_name)
    byte_limit = limits.max_payload(MessageKind.CONTRIBUTION_CHUNK)
    problems = []
    for plan in plan_chunks(shapes, codec_name, limits):
        for _, values in plan.chunk_sizes():
            if values > limits.max_chunk_elements or chunk_bound(codec, values) > byte_limit:
                problems.append(f"tensor {plan.name} {plan.shape}: a chunk of {values:,} values can reach "
                                f"{chunk_bound(codec, values):,} bytes ({codec_name}), over the {byte_limit:,}-byte "
                                "chunk limit")
                break
    return problems


def _codec(name: str) -> Codec:
    codec = CODECS.get(name)
    if codec is None:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}")
    return codec


def squared_norm(values: np.ndarray) -> float:
    """Sum of squares in float64 with numpy's own pairwise reduction (the merge's norm, same bits)."""
    squares = np.array(values, dtype=np.float64).ravel()  # our own copy: squared in place
    np.multiply(squares, squares, out=squares)
    return float(np.add.reduce(squares))


class EncodedDelta(Mapping[str, np.ndarray]):
    """A received contribution kept encoded: name -> float32 tensor, decoded when asked for.

    `tensor_norms` are the L2 norms measured while the chunks arrived (float64, one per tensor:
    the square root of the sum of its chunks' sums of squares); `shapes` the validated shapes.
    Every tensor was decoded once on arrival, so decoding again cannot fail.
    """

    __slots__ = ("_chunks", "shapes", "tensor_norms", "encoded_bytes")

    def __init__(self, chunks: Mapping[str, Sequence[bytes]], shapes: Mapping[str, tuple[int, ...]],
                 tensor_norms: Mapping[str, float]) -> None:
        self._chunks = {name: tuple(parts) for name, parts in chunks.items()}
        self.shapes = dict(shapes)
        self.tensor_norms = dict(tensor_norms)
        self.encoded_bytes = sum(len(p) for parts in self._chunks.values() for p in parts)

    def __getitem__(self, name: str) -> np.ndarray:
        out = np.empty(math.prod(self.shapes[name]), dtype=np.float32)
        offset = 0
        for values in self.decoded_chunks(name):
            out[offset:offset + values.size] = values
            offset += values.size
        return out.reshape(self.shapes[name])

    def decoded_chunks(self, name: str) -> Iterator[np.ndarray]:
        """Tensor `name`'s values in order, one decoded chunk (1-D float32) at a time: what the
        merge folds, so a contribution is never decoded whole."""
        for part in self._chunks[name]:
            yield decode_tensor(part).reshape(-1)

    def __iter__(self) -> Iterator[str]:
        return iter(self._chunks)

    def __len__(self) -> int:
        return len(self._chunks)

    def __repr__(self) -> str:
        return f"EncodedDelta({len(self)} tensors, {self.encoded_bytes} encoded bytes)"


class ContributionAssembler(StreamAssembler[ContributionOpen, ContributionChunk]):
    """Checks one streamed contribution chunk by chunk against the fragment's shapes (sans-IO).

    Construct it from the ContributionOpen (raises RemoteProtocolError if the open does not fit
    `expected`, the fragment's names and shapes); `add` each chunk in arrival order (raises on the
    first bad one; the assembler is then dead); `finish` when the body ended.
    """

    KIND = "streamed contribution"

    def __init__(self, head: ContributionOpen, expected: Mapping[str, Sequence[int]],
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        codec = CODECS.get(head.codec)
        if codec is None:
            raise self.refused(f"unknown codec {head.codec!r}")
        self._codec = codec
        byte_limit = limits.max_payload(MessageKind.CONTRIBUTION_CHUNK)
        if head.chunk_elements > limits.max_chunk_elements:
            raise self.refused(f"chunk_elements {head.chunk_elements:,} is over the limit of "
                               f"{limits.max_chunk_elements:,} values per chunk", 413)
        if chunk_bound(codec, head.chunk_elements) > byte_limit:
            raise self.refused(f"a chunk of {head.chunk_elements:,} {head.codec} values can reach "
                               f"{chunk_bound(codec, head.chunk_elements):,} bytes, over the {byte_limit:,}-byte chunk limit",
                               413)
        want = {name: tuple(int(d) for d in shape) for name, shape in expected.items()}
        sent = {spec.name for spec in head.tensors}
        missing = sorted(set(want) - sent)
        extra = sorted(sent - set(want))
        if missing or extra:
            parts = []
            if extra:
                parts.append("not in fragment " + f"{head.fragment}: " + ", ".join(extra[:3]) + (" ..." if len(extra) > 3 else ""))
            if missing:
                parts.append("missing " + ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else ""))
            raise self.refused("tensor names do not match the fragment: " + "; ".join(parts))
        for spec in head.tensors:
            if spec.shape != want[spec.name]:
                raise self.refused(f"tensor {spec.name}: the open declares shape {spec.shape}, the model's is "
                                   f"{want[spec.name]}")
        self._plans = [ChunkPlan(spec.name, spec.shape, head.chunk_elements) for spec in head.tensors]
        self._sizes = [list(plan.chunk_sizes()) for plan in self._plans]
        self._tensor = 0  # index of the tensor the next chunk belongs to
        self._chunk = 0  # index of the next chunk within it
        self._parts: dict[str, list[bytes]] = {spec.name: [] for spec in head.tensors}
        self._squares: dict[str, float] = {spec.name: 0.0 for spec in head.tensors}
        super().__init__(head)

    @property
    def complete(self) -> bool:
        return self._tensor >= len(self._plans)

    @property
    def max_remaining_bytes(self) -> int:
        """Most payload bytes the chunks still due can carry (the transport bounds the body with it)."""
        total = 0
        for t in range(self._tensor, len(self._plans)):
            first = self._chunk if t == self._tensor else 0
            total += sum(chunk_bound(self._codec, values) for _, values in self._sizes[t][first:])
        return total

    @property
    def chunks_left(self) -> int:
        return sum(len(self._sizes[t]) for t in range(self._tensor, len(self._plans))) - self._chunk

    def _whole(self) -> str:
        return f"{len(self._plans)} tensors all complete"

    def _take(self, chunk: ContributionChunk) -> None:
        """Check, decode and measure one chunk; keep its encoded bytes."""
        plan = self._plans[self._tensor]
        offset, values = self._sizes[self._tensor][self._chunk]
        if chunk.tensor != self._tensor or chunk.offset != offset:
            raise self.refused(f"expected tensor {self._tensor} ({plan.name}) at offset {offset}, "
                               f"got tensor {chunk.tensor} at offset {chunk.offset}")
        bound = chunk_bound(self._codec, values)
        if len(chunk.payload) > bound:
            raise self.refused(f"chunk of {plan.name} at offset {offset}: {len(chunk.payload):,} bytes for {values:,} "
                               f"values, more than {self.head.codec} can encode them into ({bound:,})", 413)
        if len(chunk.payload) > _CODEC_ID_OFFSET and chunk.payload[_CODEC_ID_OFFSET] != self._codec.wire_id:
            raise self.refused(f"chunk of {plan.name} at offset {offset} is not encoded with {self.head.codec}")
        try:
            decoded = decode_tensor(chunk.payload, max_elements=max(values, 1))
        except RemoteProtocolError as error:
            raise self.refused(f"chunk of {plan.name} at offset {offset}: {error}", error.status_hint) from None
        if decoded.shape != (values,):
            raise self.refused(f"chunk of {plan.name} at offset {offset} holds shape {decoded.shape}, expected ({values},)")
        self._squares[plan.name] += squared_norm(decoded)
        self._parts[plan.name].append(chunk.payload)
        self._chunk += 1
        if self._chunk == len(self._sizes[self._tensor]):
            self._tensor += 1
            self._chunk = 0

    def finish(self) -> EncodedDelta:
        """The whole contribution, encoded; refused if the stream ended early."""
        self._check_alive()
        if not self.complete:
            plan = self._plans[self._tensor]
            raise self._fail(f"short: {self.chunks_left} chunk(s) missing",
                             f"the stream ended with {self.chunks_left} chunk(s) missing "
                             f"(tensor {self._tensor} of {len(self._plans)}, {plan.name})")
        norms = {name: math.sqrt(s) for name, s in self._squares.items()}
        return EncodedDelta(self._parts, {p.name: p.shape for p in self._plans}, norms)


@runtime_checkable
class BlockEncoded(Protocol):
    """A tensor already encoded with a dense codec's body layout (the learner's device quantizer
    hands these over): `codec` names the scheme, `body_of(offset, values)` gives the body of the
    values [offset, offset + values), a span of whole blocks (the tensor's tail block padded with
    zeros, as an encoder pads it). Its chunks are framed as they are, never decoded."""

    codec: str
    size: int

    def body_of(self, offset: int, values: int) -> np.ndarray: ...


def contribution_chunks(head: ContributionOpen, delta: Mapping[str, np.ndarray], *,
                        zstd_level: int | None = 1) -> Iterator[ContributionChunk]:
    """The sender's side: encode `delta` chunk by chunk in the open's order (one chunk in memory).

    A generator: each chunk is encoded when the consumer asks for it, so a sender streaming them
    holds one encoded chunk at a time besides the delta itself. A `BlockEncoded` tensor in the
    open's codec has its bodies framed directly (chunks start on whole blocks: `chunk_elements_for`),
    the same bytes as encoding its values.
    """
    for index, spec in enumerate(head.tensors):
        value = delta[spec.name]
        encoded = isinstance(value, BlockEncoded) and value.codec == head.codec
        flat = None if encoded else np.asarray(value).reshape(-1)
        size = value.size if encoded else flat.size
        if size != spec.num_elements:
            raise ValueError(f"tensor {spec.name}: {size} values, the open declares {spec.shape}")
        for offset, values in ChunkPlan(spec.name, spec.shape, head.chunk_elements).chunk_sizes():
            if encoded:
                payload = frame_body(values, head.codec, value.body_of(offset, values), zstd_level=zstd_level)
            else:
                payload = encode_tensor(flat[offset:offset + values], head.codec, zstd_level=zstd_level)
            yield ContributionChunk(head.stream, index, offset, payload)


def open_for(delta_shapes: Mapping[str, Sequence[int]], *, fragment: int, base_index: int, base_round: int,
             c_steps: int, c_tokens: int, codec: str, learner_id: str, stream: bytes,
             limits: Limits = DEFAULT_LIMITS) -> ContributionOpen:
    """The ContributionOpen for a delta of these shapes (tensors sorted by name)."""
    plans = plan_chunks(delta_shapes, codec, limits)
    return ContributionOpen(fragment, base_index, base_round, c_steps, c_tokens, codec, learner_id, stream,
                            plans[0].chunk_elements if plans else 1,
                            tuple(TensorSpec(p.name, p.shape) for p in plans))
