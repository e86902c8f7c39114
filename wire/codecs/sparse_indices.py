"""Packed sorted indices of sparse chunks: Elias-Fano coding, vectorised over every chunk of a message.

A chunk of `length` values sends `count` strictly increasing indices. Each index i splits into
its low `width` bits (the chunk's own width, floor(log2(length / count)), so a chunk is coded the
same whatever else its message holds; written as they are) and its high part h = i >> width,
written in unary: bit h + r of the chunk's high bit string is set for the index of rank r. That costs about 2 + log2(length / count) bits per index (8 for 64 of
4,096) instead of log2(length) (12). All chunks' low fields form one little-endian bit stream, all
chunks' high bit strings another, each padded with zero bits to a whole byte. Layout:
docs/CODECS.md.

The decoder checks everything before it scatters: exact counts per chunk, zero padding, indices
in range and strictly increasing; anything else is a `RemoteProtocolError`.
"""

from __future__ import annotations

import numpy as np

from wire.errors import RemoteProtocolError

# Indices are below 2^16 (the largest chunk), so wider low fields are never useful.
MAX_LOW_WIDTH = 16


def _malformed(reason: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"malformed tensor message: {reason}", status_hint=400)


def low_widths(lengths: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Low bits per index of each chunk: floor(log2(length // count)), 0 for empty chunks."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    ratio = np.maximum(lengths // np.maximum(counts, 1), 1)
    # frexp gives ratio = m * 2^e with m in [0.5, 1): floor(log2(ratio)) = e - 1, exactly.
    _, exponent = np.frexp(ratio.astype(np.float64))
    return np.where(counts > 0, np.minimum(exponent.astype(np.int64) - 1, MAX_LOW_WIDTH), 0)


def high_lengths(lengths: np.ndarray, counts: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Bits of each chunk's unary high string: the largest high part plus one bit per index."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    return np.where(counts > 0, ((np.maximum(lengths, 1) - 1) >> widths) + counts, 0)


def chunk_index_bits(lengths: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Bits the indices of each chunk take (low fields plus high string), before byte padding."""
    widths = low_widths(lengths, counts)
    return np.asarray(counts, dtype=np.int64) * widths + high_lengths(lengths, counts, widths)


def region_sizes(lengths: np.ndarray, counts: np.ndarray) -> tuple[int, int]:
    """Bytes of the low-bit region and of the high-bit region for these chunks."""
    widths = low_widths(lengths, counts)
    low_bits = int((np.asarray(counts, dtype=np.int64) * widths).sum())
    return -(-low_bits // 8), -(-int(high_lengths(lengths, counts, widths).sum()) // 8)


def _width_groups(widths: np.ndarray, counts: np.ndarray, width_of: np.ndarray):
    """(width, which indices have it) for every nonzero width in use; all indices when there is one."""
    used = np.unique(widths[(counts > 0) & (widths > 0)])
    if used.size == 1 and not (widths[counts > 0] == 0).any():
        yield int(used[0]), slice(None)
        return
    for width in used.tolist():
        yield width, np.flatnonzero(width_of == width)


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    out = np.zeros(values.size, dtype=np.int64)
    np.cumsum(values[:-1], out=out[1:])
    return out


def encode_indices(lengths: np.ndarray, counts: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack the indices (chunk by chunk, each chunk's strictly increasing) into (low, high) bytes."""
    counts = np.asarray(counts, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    widths = low_widths(lengths, counts)
    highs = high_lengths(lengths, counts, widths)
    chunk_of = np.repeat(np.arange(counts.size), counts)
    width_of = widths[chunk_of]
    low_stream = np.zeros(int(width_of.sum()), dtype=np.uint8)
    offsets = np.cumsum(width_of) - width_of
    for width, which in _width_groups(widths, counts, width_of):
        shifts = np.arange(width, dtype=np.int64)
        fields = ((indices[which][:, None] >> shifts) & 1).astype(np.uint8)
        if isinstance(which, slice):  # one width: the fields are the stream, in order
            low_stream = fields.reshape(-1)
        else:
            low_stream[(offsets[which][:, None] + shifts).reshape(-1)] = fields.reshape(-1)
    rank = np.arange(indices.size, dtype=np.int64) - _exclusive_cumsum(counts)[chunk_of]
    high_stream = np.zeros(int(highs.sum()), dtype=np.uint8)
    high_stream[_exclusive_cumsum(highs)[chunk_of] + (indices >> width_of) + rank] = 1
    return np.packbits(low_stream, bitorder="little"), np.packbits(high_stream, bitorder="little")


def decode_indices(
    low: np.ndarray, high: np.ndarray, lengths: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Unpack (indices, chunk of each index) from regions sized by `region_sizes`; check them all.

    Raises RemoteProtocolError unless every chunk holds exactly its count of strictly increasing
    indices below its length and every padding bit is zero.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    widths = low_widths(lengths, counts)
    highs = high_lengths(lengths, counts, widths)
    total = int(counts.sum())
    chunk_of = np.repeat(np.arange(counts.size), counts)
    width_of = widths[chunk_of]
    low_bits = int(width_of.sum())

    low_stream = np.unpackbits(low, bitorder="little")
    if low_stream[low_bits:].any():
        raise _malformed("nonzero padding after the low index bits")
    low_parts = np.zeros(total, dtype=np.int64)
    offsets = np.cumsum(width_of) - width_of
    for width, which in _width_groups(widths, counts, width_of):
        shifts = np.arange(width, dtype=np.int64)
        if isinstance(which, slice):
            fields = low_stream[:low_bits].reshape(total, width)
        else:
            fields = low_stream[offsets[which][:, None] + shifts]
        low_parts[which] = fields.astype(np.int64) @ (np.int64(1) << shifts)

    high_stream = np.unpackbits(high, bitorder="little")
    ones = np.flatnonzero(high_stream)
    if ones.size != total:
        raise _malformed(f"index bits hold {ones.size} indices, the chunk counts say {total}")
    starts = _exclusive_cumsum(highs)[chunk_of]
    within = ones - starts
    if total and not ((within >= 0) & (within < highs[chunk_of])).all():
        raise _malformed("a chunk's index bits do not hold exactly its count of indices")
    rank = np.arange(total, dtype=np.int64) - _exclusive_cumsum(counts)[chunk_of]
    indices = ((within - rank) << width_of) | low_parts
    if total:
        if not (indices < lengths[chunk_of]).all():
            raise _malformed("an index is beyond its chunk")
        same_chunk = chunk_of[1:] == chunk_of[:-1]
        if (same_chunk & (indices[1:] <= indices[:-1])).any():
            raise _malformed("a chunk's indices are not strictly increasing")
    return indices, chunk_of
