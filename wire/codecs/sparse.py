"""Sparse schemes: `topk2` (a learner's top k of every chunk at 2 bits) and `union8` (a merged sparse update).

Both cut each tensor, flattened, into chunks of C values (the header's block field; the last chunk of
a tensor is shorter) that never cross tensors, send a chunk's selected values with their indices
packed by `sparse_indices`, and fall back to dense int4 (blocks of 64) where sparsity does not pay:

- `topk2`: every whole chunk sends its k largest magnitudes (ties to the lower index) as sign plus
  one of two magnitude levels of that chunk; a tensor's partial last chunk (all of a tensor smaller
  than C: norms, biases) goes dense int4. Since streamed contribution chunks hold whole C-chunks,
  a tensor quantizes to the same values however it is cut.
- `union8`: every chunk sends its nonzero values as int8 with a scale, unless that takes more raw
  bits than dense int4, in which case the whole chunk is dense int4.

Bodies size themselves from their own prefix (k, or the chunk counts), so the container bounds
them by `max_body_size` and the decoder checks the exact size. Byte layout: docs/CODECS.md.
"""

from __future__ import annotations

import struct
from abc import abstractmethod
from functools import lru_cache

import numpy as np

from wire.codecs.schemes import (
    _FLOAT32_MAX,
    _MIN_SCALE,
    MAX_BLOCK_SIZE,
    Codec,
    Int4Codec,
    bf16_bits_to_f32,
    ceil_to_bf16_bits,
    require_finite,
    round_to_bf16_bits,
)
from wire.codecs.sparse_indices import chunk_index_bits, decode_indices, encode_indices, region_sizes
from wire.errors import LocalProtocolError, RemoteProtocolError

# Dense fallback: int4 with its own default block, so a fallback chunk is exactly what int4 sends.
_DENSE = Int4Codec()
_DENSE_BLOCK = _DENSE.default_block_size
_U32 = struct.Struct("<I")
_DENSE_CHUNK = 0xFFFFFFFF  # union8's count of a chunk sent dense


def _malformed(reason: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"malformed tensor message: {reason}", status_hint=400)


def _dense_bytes(lengths: np.ndarray) -> np.ndarray:
    """int4 bytes of chunks of these lengths, each padded to whole int4 blocks."""
    blocks = -(-np.asarray(lengths, dtype=np.int64) // _DENSE_BLOCK)
    return blocks * (2 + _DENSE_BLOCK // 2)


def _each_tensor(sizes: list[int], chunk: int, dense: np.ndarray):
    """Per tensor: (offset, whole chunks, tail length, which whole chunks are dense, whether the tail is)."""
    first = offset = 0
    for size in sizes:
        rows, tail = divmod(size, chunk)
        yield offset, rows, tail, dense[first : first + rows], bool(tail) and bool(dense[first + rows])
        first += rows + (1 if tail else 0)
        offset += size


def _encode_dense(work: np.ndarray, sizes: list[int], chunk: int, dense: np.ndarray) -> np.ndarray:
    """int4 body of the chunks marked dense, in order, each padded with zeros to whole int4 blocks."""
    pieces = []
    for offset, rows, tail, row_dense, tail_dense in _each_tensor(sizes, chunk, dense):
        if rows and row_dense.any():
            block = work[offset : offset + rows * chunk].reshape(rows, chunk)
            pieces.append((block if row_dense.all() else block[row_dense]).reshape(-1))
        if tail_dense:
            padded = np.zeros(-(-tail // _DENSE_BLOCK) * _DENSE_BLOCK, dtype=np.float32)
            padded[:tail] = work[offset + rows * chunk : offset + rows * chunk + tail]
            pieces.append(padded)
    if not pieces:
        return np.zeros(0, dtype=np.uint8)
    return _DENSE.encode_body(np.concatenate(pieces), _DENSE_BLOCK)


def _decode_dense(body: np.ndarray, out: np.ndarray, sizes: list[int], chunk: int, dense: np.ndarray) -> None:
    """Decode an int4 body made by `_encode_dense` into the dense chunks of `out`."""
    if not body.size:
        return
    values = _DENSE.decode_body(body, body.size // (2 + _DENSE_BLOCK // 2) * _DENSE_BLOCK, _DENSE_BLOCK)
    cursor = 0
    for offset, rows, tail, row_dense, tail_dense in _each_tensor(sizes, chunk, dense):
        if rows and row_dense.any():
            block = out[offset : offset + rows * chunk].reshape(rows, chunk)
            count = int(row_dense.sum())
            piece = values[cursor : cursor + count * chunk].reshape(count, chunk)
            if count == rows:
                block[...] = piece
            else:
                block[row_dense] = piece
            cursor += count * chunk
        if tail_dense:
            out[offset + rows * chunk : offset + rows * chunk + tail] = values[cursor : cursor + tail]
            cursor += -(-tail // _DENSE_BLOCK) * _DENSE_BLOCK


def _chunk_lengths(sizes: list[int], chunk: int) -> np.ndarray:
    """Length of every chunk of every tensor, in order (whole chunks, then a shorter last one)."""
    lengths = []
    for size in sizes:
        lengths.append(np.full(size // chunk, chunk, dtype=np.int64))
        if size % chunk:
            lengths.append(np.array([size % chunk], dtype=np.int64))
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


def _chunk_starts(sizes: list[int], chunk: int) -> np.ndarray:
    """Offset in the flat output of every chunk of every tensor, in order."""
    starts, offset = [], 0
    for size in sizes:
        starts.append(offset + chunk * np.arange(-(-size // chunk), dtype=np.int64))
        offset += size
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


class SparseCodec(Codec):
    """A chunked sparse scheme: sees each tensor's extent and sizes its body from the body itself."""

    segmented = True
    default_block_size = 4096  # C, values per chunk

    def check_block_size(self, block_size: int) -> str | None:
        if not _DENSE_BLOCK <= block_size <= MAX_BLOCK_SIZE or block_size % _DENSE_BLOCK:
            return (f"{self.name} chunk size must be a multiple of {_DENSE_BLOCK} in "
                    f"[{_DENSE_BLOCK}, {MAX_BLOCK_SIZE}], got {block_size}")
        return None

    def padded_count(self, num_elements: int, block_size: int) -> int:
        return num_elements  # chunks are cut per tensor by the scheme itself: no padding

    def body_size(self, padded_elements: int, block_size: int) -> int:
        return self.max_body_size([padded_elements], block_size)

    @abstractmethod
    def max_body_size(self, sizes: list[int], block_size: int) -> int:
        """Most raw body bytes a valid message of tensors of these sizes can have."""

    @abstractmethod
    def encode_segments(self, work: np.ndarray, sizes: list[int], block_size: int, top_k: int | None) -> np.ndarray:
        """Encode the tensors laid end to end in `work` (sizes in order) into uint8 body bytes."""

    @abstractmethod
    def decode_segments(self, body: np.ndarray, sizes: list[int], block_size: int) -> np.ndarray:
        """Decode a body into the flat float32 values of those tensors; check its exact size."""

    def encode_body(self, work: np.ndarray, block_size: int) -> np.ndarray:
        return self.encode_segments(work, [work.size], block_size, None)

    def decode_body(self, body: np.ndarray, padded_elements: int, block_size: int) -> np.ndarray:
        return self.decode_segments(body, [padded_elements], block_size)


# ---------------------------------------------------------------------------------------------
# topk2


# Candidates for a row's top k are first narrowed with the maxima of groups of this many values:
# the k-th largest group maximum is a lower bound of the k-th largest value (k distinct values reach
# it), and only values above it (under 2 % of a row of Gaussian values) are ranked exactly. A group is
# every (width / _GROUP)-th value, so its maximum is an elementwise maximum of contiguous slices.
_GROUP = 16


def _top_k_columns(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Columns of the k largest values of each row, ascending; ties go to the lower column."""
    rows, width = magnitudes.shape
    if width % _GROUP == 0 and width // _GROUP >= k:
        groups = width // _GROUP
        group_max = magnitudes.reshape(rows, _GROUP, groups).max(axis=1)
        bound = np.partition(group_max, groups - k, axis=1)[:, groups - k]
    else:
        bound = np.zeros(rows, dtype=magnitudes.dtype)  # every value is a candidate
    row, column = np.nonzero(magnitudes >= bound[:, None])
    value = magnitudes[row, column]
    counts = np.bincount(row, minlength=rows)
    starts = np.zeros(rows, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    # The candidates of each row, left-aligned in a padded matrix; -1 pads below every magnitude.
    padded = np.full((rows, int(counts.max()) if rows else 0), -1.0, dtype=magnitudes.dtype)
    padded[row, np.arange(row.size) - starts[row]] = value
    width = padded.shape[1]
    threshold = np.partition(padded, width - k, axis=1)[:, width - k]
    above = value > threshold[row]
    equal = value == threshold[row]
    room = k - np.bincount(row, weights=above, minlength=rows).astype(np.int64)
    # Ties at the threshold: the first `room` of them in column order (rank within the row's ties).
    tie_rank = np.cumsum(equal)
    tie_rank -= np.concatenate([[0], tie_rank])[starts][row]
    chosen = above | (equal & (tie_rank <= room[row]))
    return column[chosen].reshape(rows, k)


def _two_levels(magnitudes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the two magnitude levels (bf16 bits, low <= high) that minimise the squared error.

    In one dimension the optimal two-level quantizer splits the sorted values once; every split
    is tried with prefix sums (the first best split wins, so ties are deterministic).
    """
    rows, k = magnitudes.shape
    ordered = np.sort(magnitudes, axis=1).astype(np.float64)
    prefix = np.cumsum(ordered, axis=1)
    total = prefix[:, -1:]
    if k == 1:
        low = high = total[:, 0]
    else:
        low_count = np.arange(1, k, dtype=np.float64)
        low_sum = prefix[:, :-1]
        high_sum = total - low_sum
        # Squared error = sum of squares - low_sum^2 / n_low - high_sum^2 / n_high.
        gain = low_sum * low_sum / low_count + high_sum * high_sum / (k - low_count)
        split = np.argmax(gain, axis=1)
        chosen = np.arange(rows)
        low = low_sum[chosen, split] / low_count[split]
        high = high_sum[chosen, split] / (k - low_count[split])
    with np.errstate(over="ignore"):  # means of finite float32 stay finite; bf16 saturates
        return round_to_bf16_bits(low.astype(np.float32)), round_to_bf16_bits(high.astype(np.float32))


def _two_bit_values(codes: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Decoded float32 values of 2-bit codes (rows of chunks) with their (low, high) levels."""
    magnitude = np.where(codes & 1, levels[:, 1:2], levels[:, 0:1])
    return np.where(codes & 2, -magnitude, magnitude)


@lru_cache(maxsize=64)
def _largest_topk_chunk_bits(chunk: int) -> int:
    """Most bits a whole chunk's codes and indices can take over every k in [1, chunk]."""
    k = np.arange(1, chunk + 1, dtype=np.int64)
    return int((2 * k + chunk_index_bits(np.full(chunk, chunk, dtype=np.int64), k)).max())


class TopK2Codec(SparseCodec):
    """Top k of every chunk of C values, 2 bits each (sign, level), two bf16 levels per chunk."""

    name = "topk2"
    wire_id = 6
    default_top_k = 64
    error_bound = ("the k largest |x| of each whole chunk of C: |err| <= the distance to the nearer of the "
                   "chunk's two levels; the other values of the chunk decode as 0; partial chunks as int4")

    @staticmethod
    def _partial(sizes: list[int], chunk: int) -> np.ndarray:
        """Which chunks (in order) are partial, the ones sent dense."""
        return _chunk_lengths(sizes, chunk) < chunk

    def max_body_size(self, sizes: list[int], block_size: int) -> int:
        lengths = _chunk_lengths(sizes, block_size)
        whole = int((lengths == block_size).sum())
        dense = int(_dense_bytes(lengths[lengths < block_size]).sum())
        # k, two levels per chunk, then three bit regions (codes, low, high), each padded to a byte.
        return 4 + 4 * whole + -(-whole * _largest_topk_chunk_bits(block_size) // 8) + 2 + dense

    def encode_segments(self, work: np.ndarray, sizes: list[int], block_size: int, top_k: int | None) -> np.ndarray:
        k = self.default_top_k if top_k is None else top_k
        if not isinstance(k, (int, np.integer)) or not 1 <= k <= block_size:
            raise LocalProtocolError(f"topk2 takes 1 <= top_k <= chunk size {block_size}, got {top_k!r}")
        k = int(k)
        require_finite(work)
        columns, values, offset = [], [], 0
        for size in sizes:
            rows = size // block_size
            if rows:
                chunks = work[offset : offset + rows * block_size].reshape(rows, block_size)
                chosen = _top_k_columns(np.abs(chunks), k)
                columns.append(chosen)
                values.append(np.take_along_axis(chunks, chosen, axis=1))
            offset += size
        columns_all = np.concatenate(columns) if columns else np.zeros((0, k), dtype=np.int64)
        values_all = np.concatenate(values) if values else np.zeros((0, k), dtype=np.float32)
        levels, codes = self.quantize_chunks(values_all)
        whole = columns_all.shape[0]
        lengths = np.full(whole, block_size, dtype=np.int64)
        counts = np.full(whole, k, dtype=np.int64)
        low, high = encode_indices(lengths, counts, columns_all.reshape(-1))
        return np.concatenate([
            np.frombuffer(_U32.pack(k), dtype=np.uint8),
            levels.view(np.uint8).reshape(-1),
            _pack_two_bit(codes.reshape(-1)),
            low,
            high,
            _encode_dense(work, sizes, block_size, self._partial(sizes, block_size)),
        ])

    @staticmethod
    def quantize_chunks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(levels: rows x 2 bf16 bits, codes: rows x k of sign << 1 | level) for chosen values."""
        if values.shape[0] == 0:
            return np.zeros((0, 2), dtype=np.uint16), np.zeros(values.shape, dtype=np.uint8)
        magnitudes = np.abs(values)
        low_bits, high_bits = _two_levels(magnitudes)
        levels = np.stack([low_bits, high_bits], axis=1)
        low = bf16_bits_to_f32(low_bits)[:, None]
        high = bf16_bits_to_f32(high_bits)[:, None]
        nearer_high = (magnitudes - low) > (high - magnitudes)
        codes = (nearer_high.astype(np.uint8)) | (np.signbit(values).astype(np.uint8) << 1)
        return levels, codes

    def decode_segments(self, body: np.ndarray, sizes: list[int], block_size: int) -> np.ndarray:
        if body.size < 4:
            raise _malformed("topk2 body is shorter than its k")
        (k,) = _U32.unpack(body[:4].tobytes())
        if not 1 <= k <= block_size:
            raise _malformed(f"topk2 declares k = {k} for chunks of {block_size}")
        chunk_lengths = _chunk_lengths(sizes, block_size)
        partial = chunk_lengths < block_size
        whole = int((~partial).sum())
        lengths = np.full(whole, block_size, dtype=np.int64)
        counts = np.full(whole, k, dtype=np.int64)
        low_size, high_size = region_sizes(lengths, counts)
        code_size = -(-whole * k // 4)
        dense_size = int(_dense_bytes(chunk_lengths[partial]).sum())
        expected = 4 + 4 * whole + code_size + low_size + high_size + dense_size
        if body.size != expected:
            raise _malformed(f"topk2 body is {body.size} bytes, its k and shapes imply {expected}")
        cursor = 4
        level_bits = body[cursor : cursor + 4 * whole].view(np.uint16).reshape(whole, 2)
        cursor += 4 * whole
        levels = bf16_bits_to_f32(level_bits)
        # No encoder writes a NaN, infinite, negative or out-of-order level (False for NaN).
        if whole and not ((levels[:, 0] >= 0) & (levels[:, 0] <= levels[:, 1]) & (levels[:, 1] <= _FLOAT32_MAX)).all():
            raise _malformed("topk2 levels are negative, out of order or not finite")
        codes = _unpack_two_bit(body[cursor : cursor + code_size], whole * k)
        cursor += code_size
        low = body[cursor : cursor + low_size]
        cursor += low_size
        indices, _ = decode_indices(low, body[cursor : cursor + high_size], lengths, counts)
        cursor += high_size
        out = np.zeros(sum(sizes), dtype=np.float32)
        values = _two_bit_values(codes.reshape(whole, k), levels)
        chunk_starts = _chunk_starts(sizes, block_size)[~partial]
        out[(chunk_starts[:, None] + indices.reshape(whole, k)).reshape(-1)] = values.reshape(-1)
        _decode_dense(body[cursor:], out, sizes, block_size, partial)
        return out


def _pack_two_bit(codes: np.ndarray) -> np.ndarray:
    """Four 2-bit codes per byte, the first in the lowest bits."""
    padded = np.zeros(-(-codes.size // 4) * 4, dtype=np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def _unpack_two_bit(packed: np.ndarray, count: int) -> np.ndarray:
    codes = np.empty((packed.size, 4), dtype=np.uint8)
    for position in range(4):
        codes[:, position] = (packed >> (2 * position)) & 3
    flat = codes.reshape(-1)
    if flat[count:].any():
        raise _malformed("nonzero padding after the 2-bit codes")
    return flat[:count]


# ---------------------------------------------------------------------------------------------
# union8

_INT8_MAX = 127.0
# Largest scale whose code 127 stays finite (bf16 bits, rounded down), as int8 uses.
_LARGEST_INT8_SCALE_BITS = np.uint16(np.array(_FLOAT32_MAX / _INT8_MAX, dtype=np.float32).view(np.uint32) >> 16)


def _sparse_wins(lengths: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Whether a chunk with this many nonzeros is sent sparse: raw bits no more than dense int4's.

    Decided per chunk from its own length and count alone, so a tensor encodes the same whatever
    else its message holds."""
    sparse_bits = 16 + 8 * counts + chunk_index_bits(lengths, counts)
    return sparse_bits <= 8 * _dense_bytes(lengths)


class Union8Codec(SparseCodec):
    """Every chunk's nonzeros as int8 with a bf16 scale and packed indices, or dense int4 if smaller."""

    name = "union8"
    wire_id = 7
    error_bound = ("sparse chunks: zeros exact, nonzeros |err| <= s/2, s = max(bf16_up(absmax / 127), 2^-126); "
                   "dense chunks: as int4")

    def max_body_size(self, sizes: list[int], block_size: int) -> int:
        lengths = _chunk_lengths(sizes, block_size)
        # A sparse chunk takes at most its dense bytes in bits; the two index regions' byte padding adds 2.
        return 4 * lengths.size + int(_dense_bytes(lengths).sum()) + 2

    def encode_segments(self, work: np.ndarray, sizes: list[int], block_size: int, top_k: int | None) -> np.ndarray:
        if top_k is not None:
            raise LocalProtocolError("union8 sends every nonzero and takes no top_k")
        require_finite(work)
        lengths = _chunk_lengths(sizes, block_size)
        starts = _chunk_starts(sizes, block_size)
        counts = np.empty(lengths.size, dtype=np.int64)
        first = 0
        for offset, rows, tail, _, _ in _each_tensor(sizes, block_size, np.zeros(lengths.size, dtype=bool)):
            if rows:
                counts[first : first + rows] = np.count_nonzero(
                    work[offset : offset + rows * block_size].reshape(rows, block_size), axis=1)
            if tail:
                counts[first + rows] = np.count_nonzero(work[offset + rows * block_size : offset + rows * block_size + tail])
            first += rows + (1 if tail else 0)
        sparse = _sparse_wins(lengths, counts)
        indices, values = _nonzeros_of_chunks(work, starts, counts, sparse)
        sparse_counts = counts[sparse]
        chunk_of = np.repeat(np.arange(sparse_counts.size), sparse_counts)
        absmax = np.zeros(sparse_counts.size, dtype=np.float32)
        np.maximum.at(absmax, chunk_of, np.abs(values))
        scale_bits = np.minimum(ceil_to_bf16_bits(absmax / np.float32(_INT8_MAX)), _LARGEST_INT8_SCALE_BITS)
        scales = np.maximum(bf16_bits_to_f32(scale_bits), _MIN_SCALE)
        scale_bits = ceil_to_bf16_bits(scales)
        scaled = values * (np.float32(1.0) / scales)[chunk_of]
        if (scale_bits == _LARGEST_INT8_SCALE_BITS).any():
            np.clip(scaled, -_INT8_MAX, _INT8_MAX, out=scaled)
        codes = np.rint(scaled).astype(np.int8)
        low, high = encode_indices(lengths[sparse], sparse_counts, indices)
        table = np.where(sparse, counts, _DENSE_CHUNK).astype("<u4")
        return np.concatenate([
            table.view(np.uint8),
            scale_bits.view(np.uint8),
            codes.view(np.uint8),
            low,
            high,
            _encode_dense(work, sizes, block_size, ~sparse),
        ])

    def decode_segments(self, body: np.ndarray, sizes: list[int], block_size: int) -> np.ndarray:
        lengths = _chunk_lengths(sizes, block_size)
        if body.size < 4 * lengths.size:
            raise _malformed("union8 body is shorter than its chunk table")
        table = body[: 4 * lengths.size].view("<u4").astype(np.int64)
        sparse = table != _DENSE_CHUNK
        counts = np.where(sparse, table, 0)
        if not (counts <= lengths).all():
            raise _malformed("a union8 chunk declares more values than it holds")
        sparse_counts = counts[sparse]
        if not _sparse_wins(lengths[sparse], sparse_counts).all():
            raise _malformed("a union8 chunk is sparse where the encoder sends it dense")
        total = int(sparse_counts.sum())
        scale_count = int(sparse.sum())
        low_size, high_size = region_sizes(lengths[sparse], sparse_counts)
        dense_size = int(_dense_bytes(lengths[~sparse]).sum())
        expected = 4 * lengths.size + 2 * scale_count + total + low_size + high_size + dense_size
        if body.size != expected:
            raise _malformed(f"union8 body is {body.size} bytes, its chunk table implies {expected}")
        cursor = 4 * lengths.size
        scales = bf16_bits_to_f32(body[cursor : cursor + 2 * scale_count].view(np.uint16))
        cursor += 2 * scale_count
        largest = bf16_bits_to_f32(np.array([_LARGEST_INT8_SCALE_BITS]))[0]
        if not ((scales >= 0) & (scales <= largest)).all():
            raise _malformed("union8 body has a negative, NaN or oversized scale")
        codes = body[cursor : cursor + total].view(np.int8)
        cursor += total
        low = body[cursor : cursor + low_size]
        cursor += low_size
        indices, chunk_of = decode_indices(low, body[cursor : cursor + high_size], lengths[sparse], sparse_counts)
        cursor += high_size
        out = np.zeros(sum(sizes), dtype=np.float32)
        values = codes * scales[chunk_of]
        if total and not np.isfinite(values).all():  # code -128 at the largest scale: no encoder writes it
            raise _malformed("union8 body holds codes that decode to Inf")
        out[_chunk_starts(sizes, block_size)[sparse][chunk_of] + indices] = values
        _decode_dense(body[cursor:], out, sizes, block_size, ~sparse)
        return out


def _nonzeros_of_chunks(
    work: np.ndarray, starts: np.ndarray, counts: np.ndarray, sparse: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(index within its chunk, value) of every nonzero of the sparse chunks, chunk by chunk, ascending."""
    if int(counts[sparse].sum()) * 2 >= int(counts.sum()):
        # Most nonzeros are sent sparse: one pass over everything, then drop the dense chunks'.
        positions = np.flatnonzero(work)
        chunk_of = np.searchsorted(starts, positions, side="right") - 1
        if not sparse.all():
            keep = sparse[chunk_of]
            positions, chunk_of = positions[keep], chunk_of[keep]
    else:
        ends = np.append(starts[1:], work.size)
        pieces = [np.flatnonzero(work[s:e]) + s for s, e in zip(starts[sparse].tolist(), ends[sparse].tolist())]
        positions = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        chunk_of = np.repeat(np.flatnonzero(sparse), counts[sparse])
    return positions - starts[chunk_of], work[positions]


SPARSE_CODECS: tuple[SparseCodec, ...] = (TopK2Codec(), Union8Codec())
