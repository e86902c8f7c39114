"""Quantization schemes: one small class per scheme, turning float32 values into body bytes and back.

A scheme sees one flat float32 work buffer (all tensors of a message, each padded to whole blocks
for blockwise schemes) and produces the raw body; the container (`container.py`) adds the header,
the optional zstd frame and every size check. Byte layouts are specified in docs/CODECS.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from wire.codecs.layout import header_size
from wire.errors import LocalProtocolError, RemoteProtocolError

# Largest block a peer may declare: bigger blocks only lose precision, and the scale arrays of a
# malformed header must stay proportional to the body we were actually sent.
MAX_BLOCK_SIZE = 1 << 16

_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Scales never go below the smallest normal float32, so 1/scale stays finite (a subnormal scale
# would make its reciprocal overflow to inf and turn zeros into NaN).
_MIN_SCALE = np.float32(np.finfo(np.float32).tiny)
_BF16_MAX_BITS = 0x7F7F  # largest finite bfloat16; saturating here keeps every scale finite


def ceil_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round non-negative finite float32 values up to bfloat16 (as uint16 bits), saturating.

    Rounding up (not to nearest) guarantees |x| / scale never exceeds the largest code.
    """
    # Clearing the sign bit turns -0.0 (which max(x, -x) can return for all-zero blocks) into 0.
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    # Adding 0xFFFF before truncating rounds any nonzero low half up; cannot overflow uint32
    # because finite non-negative float32 bits are <= 0x7F7FFFFF.
    rounded = ((bits + np.uint32(0xFFFF)) >> np.uint32(16)).astype(np.uint16)
    np.minimum(rounded, np.uint16(_BF16_MAX_BITS), out=rounded)
    return rounded


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bits (uint16) to float32 exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round finite float32 values to bfloat16 bits, nearest-even, saturating at the bf16 max."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    # Round-to-nearest-even on the 16 dropped bits: add 0x7FFF plus the lowest kept bit.
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    # Finite inputs above the bf16 max round to inf bits (0x7F80/0xFF80): saturate instead, which
    # is still within 2^-8 relative error (float32 max is only 2^-8 above the bf16 max).
    magnitude = out & np.uint16(0x7FFF)
    overflow = magnitude == np.uint16(0x7F80)
    if overflow.any():
        out[overflow] = (out[overflow] & np.uint16(0x8000)) | np.uint16(_BF16_MAX_BITS)
    return out


def require_finite(values: np.ndarray) -> None:
    """Refuse NaN/Inf on encode: the caller decides what a non-finite update means."""
    if not np.isfinite(values).all():
        raise LocalProtocolError(
            "tensor contains NaN or Inf (or float64 values beyond the float32 range); "
            "codecs encode finite values only"
        )


def _interleave_planes(body: np.ndarray, width: int) -> np.ndarray:
    """Undo byte-planing: `width` planes of n bytes back to n little-endian values of `width` bytes."""
    planes = body.reshape(width, -1)
    values = np.empty((planes.shape[1], width), dtype=np.uint8)
    for index in range(width):  # one plane at a time: ~5x faster than a transposed copy
        values[:, index] = planes[index]
    return values.reshape(-1)


class Codec(ABC):
    """One wire scheme: a stable id, a documented error bound, and an honest size estimate."""

    name: ClassVar[str]
    wire_id: ClassVar[int]
    # Human-readable bound on |decoded - x| for one element; the tests check it numerically.
    error_bound: ClassVar[str]
    # 0 for elementwise schemes; otherwise the block size encode uses unless told otherwise.
    default_block_size: ClassVar[int] = 0
    # Sparse schemes (sparse.py) see each tensor's extent and size their body from the body itself.
    segmented: ClassVar[bool] = False

    @property
    def blockwise(self) -> bool:
        return self.default_block_size > 0

    def check_block_size(self, block_size: int) -> str | None:
        """Return why `block_size` is invalid for this scheme, or None if it is fine."""
        if not self.blockwise:
            return None if block_size == 0 else f"{self.name} is not blockwise but block size is {block_size}"
        if not 2 <= block_size <= MAX_BLOCK_SIZE or block_size % 2:
            return f"{self.name} block size must be even and in [2, {MAX_BLOCK_SIZE}], got {block_size}"
        return None

    def padded_count(self, num_elements: int, block_size: int) -> int:
        """Elements a tensor occupies in the work buffer: whole blocks for blockwise schemes."""
        if not self.blockwise:
            return num_elements
        return -(-num_elements // block_size) * block_size

    @abstractmethod
    def body_size(self, padded_elements: int, block_size: int) -> int:
        """Exact raw (pre-zstd) body size in bytes for this many padded elements."""

    @abstractmethod
    def encode_body(self, work: np.ndarray, block_size: int) -> np.ndarray:
        """Encode a flat float32 work buffer (which this call may overwrite) into uint8 body bytes.

        Raises LocalProtocolError if the values are not finite.
        """

    @abstractmethod
    def decode_body(self, body: np.ndarray, padded_elements: int, block_size: int) -> np.ndarray:
        """Decode a uint8 body of exactly `body_size` bytes into flat float32 values.

        Raises RemoteProtocolError if the body holds values no encoder produces (bad scales).
        """

    def estimate_encoded_size(self, num_elements: int, ndim: int = 1) -> int:
        """Upper bound of `encode_tensor` output for a tensor of `num_elements` values and `ndim` dims.

        zstd is used only when it shrinks the body, so the real size is at most this (and usually
        well below it for quantized schemes).
        """
        block_size = self.default_block_size
        return header_size([("", (num_elements,) + (1,) * (ndim - 1))]) + self.body_size(
            self.padded_count(num_elements, block_size), block_size
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} wire_id={self.wire_id}>"


class Fp32Codec(Codec):
    """Lossless float32, byte-planed (all low bytes, then the next...) so zstd finds the exponents."""

    name = "fp32"
    wire_id = 1
    error_bound = "exact (bit-identical float32)"

    def body_size(self, padded_elements: int, block_size: int) -> int:
        return 4 * padded_elements

    def encode_body(self, work: np.ndarray, block_size: int) -> np.ndarray:
        require_finite(work)
        return np.ascontiguousarray(work.view(np.uint8).reshape(-1, 4).T).reshape(-1)

    def decode_body(self, body: np.ndarray, padded_elements: int, block_size: int) -> np.ndarray:
        values = _interleave_planes(body, 4).view(np.float32)
        if not np.isfinite(values).all():
            raise RemoteProtocolError("fp32 body holds NaN or Inf", status_hint=400)
        return values


class Bf16Codec(Codec):
    """bfloat16, round-to-nearest-even, byte-planed (low bytes, then high bytes)."""

    name = "bf16"
    wire_id = 2
    error_bound = (
        "|err| <= 2^-8 |x| for |x| >= 2^-126 (normal floats); |err| <= 2^-134 below; "
        "values above the bf16 max saturate to it (still within 2^-8 |x|)"
    )

    def body_size(self, padded_elements: int, block_size: int) -> int:
        return 2 * padded_elements

    def encode_body(self, work: np.ndarray, block_size: int) -> np.ndarray:
        require_finite(work)
        bits = round_to_bf16_bits(work)
        return np.ascontiguousarray(bits.view(np.uint8).reshape(-1, 2).T).reshape(-1)

    def decode_body(self, body: np.ndarray, padded_elements: int, block_size: int) -> np.ndarray:
        bits = _interleave_planes(body, 2).view(np.uint16)
        if ((bits & np.uint16(0x7F80)) == np.uint16(0x7F80)).any():
            raise RemoteProtocolError("bf16 body holds NaN or Inf", status_hint=400)
        return bf16_bits_to_f32(bits)


class BlockCodec(Codec):
    """Shared frame of the blockwise schemes: a bf16 scale per block, then the codes.

    Body = scales (one little-endian bf16 per block) followed by the codes of every block.
    """

    # Value a code of magnitude 1.0 * scale maps to the block's largest |x|: scale = absmax / qmax.
    qmax: ClassVar[float]
    # Largest |code value| a body can hold (incl. codes no encoder writes): above
    # float32 max / this, a decoded block could overflow, so decode scans it for Inf.
    max_code_magnitude: ClassVar[float]
    code_bits: ClassVar[int]

    def body_size(self, padded_elements: int, block_size: int) -> int:
        num_blocks = padded_elements // block_size
        return 2 * num_blocks + padded_elements * self.code_bits // 8

    def encode_body(self, work: np.ndarray, block_size: int) -> np.ndarray:
        num_blocks = work.size // block_size
        blocks = work.reshape(num_blocks, block_size)
        absmax = np.maximum(blocks.max(axis=1, initial=0.0), -blocks.min(axis=1, initial=0.0))
        # max/min propagate NaN and |Inf| stays Inf, so one check on the per-block maxima is
        # enough to refuse non-finite input without another pass over the data.
        require_finite(absmax)
        scale_bits = ceil_to_bf16_bits(absmax / np.float32(self.qmax))
        # Cap so that qmax * scale stays finite; only blocks within 2^-7 of the float32 maximum
        # reach the cap, and their codes are clipped to qmax (saturation) below.
        largest_bits = self.largest_scale_bits()
        np.minimum(scale_bits, largest_bits, out=scale_bits)
        scales = np.maximum(bf16_bits_to_f32(scale_bits), _MIN_SCALE)
        scale_bits = ceil_to_bf16_bits(scales)  # the floor at _MIN_SCALE is exactly representable
        body = np.empty(self.body_size(work.size, block_size), dtype=np.uint8)
        body[: 2 * num_blocks] = scale_bits.view(np.uint8)
        blocks *= (np.float32(1.0) / scales)[:, None]
        if (scale_bits == largest_bits).any():
            np.clip(blocks, -self.qmax, self.qmax, out=blocks)
        self._quantize(blocks, body[2 * num_blocks :].reshape(num_blocks, block_size * self.code_bits // 8))
        return body

    def largest_scale_bits(self) -> np.uint16:
        """bf16 bits of the largest scale an encoder writes: qmax * scale must not overflow."""
        return np.uint16(np.array(_FLOAT32_MAX / self.qmax, dtype=np.float32).view(np.uint32) >> 16)

    def decode_body(self, body: np.ndarray, padded_elements: int, block_size: int) -> np.ndarray:
        num_blocks = padded_elements // block_size
        scales = bf16_bits_to_f32(body[: 2 * num_blocks].view(np.uint16))
        # No encoder writes a negative, NaN or larger scale (the comparison is False for NaN).
        largest_scale = bf16_bits_to_f32(np.array([self.largest_scale_bits()]))[0]
        if not ((scales >= 0) & (scales <= largest_scale)).all():
            raise RemoteProtocolError(f"{self.name} body has a negative, NaN or oversized scale", status_hint=400)
        out = np.empty((num_blocks, block_size), dtype=np.float32)
        codes = body[2 * num_blocks :].reshape(num_blocks, block_size * self.code_bits // 8)
        self._dequantize(codes, scales[:, None], out)
        # Near the float32 limit, a code no encoder writes (int8 -128, int4 -8) can overflow to
        # -inf; only then is the output scanned, so ordinary messages pay nothing for it.
        if num_blocks and scales.max() > _FLOAT32_MAX / self.max_code_magnitude and not np.isfinite(out).all():
            raise RemoteProtocolError(f"{self.name} body holds codes that decode to Inf", status_hint=400)
        return out.reshape(-1)

    @abstractmethod
    def _quantize(self, scaled: np.ndarray, codes: np.ndarray) -> None:
        """Write codes for `scaled` (blocks already divided by their scale; may be overwritten)."""

    @abstractmethod
    def _dequantize(self, codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        """Write code * scale into `out` (num_blocks x block_size)."""


class Int8Codec(BlockCodec):
    """Symmetric int8 per block: q = round(x / s), s = absmax / 127 rounded up to bf16."""

    name = "int8"
    wire_id = 3
    default_block_size = 128
    qmax = 127.0
    max_code_magnitude = 128.0  # -128 is never written but decodes like any other code
    code_bits = 8
    error_bound = "|err| <= s/2 (+ float32 rounding), s = max(bf16_up(block absmax / 127), 2^-126)"

    def _quantize(self, scaled: np.ndarray, codes: np.ndarray) -> None:
        np.rint(scaled, out=codes.view(np.int8), casting="unsafe")

    def _dequantize(self, codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        np.multiply(codes.view(np.int8), scales, out=out)


class Int4Codec(BlockCodec):
    """Symmetric int4 per block, codes in [-7, 7] as two's-complement nibbles, two per byte.

    Byte j of a block holds element j (low nibble) and element j + block/2 (high nibble), so
    packing and unpacking touch contiguous half-blocks instead of strided pairs.
    """

    name = "int4"
    wire_id = 4
    default_block_size = 64
    qmax = 7.0
    max_code_magnitude = 8.0
    code_bits = 4
    error_bound = "|err| <= s/2 (+ float32 rounding), s = max(bf16_up(block absmax / 7), 2^-126)"

    def _quantize(self, scaled: np.ndarray, codes: np.ndarray) -> None:
        half = codes.shape[1]
        q = np.empty(scaled.shape, dtype=np.int8)
        np.rint(scaled, out=q, casting="unsafe")
        packed = codes.view(np.int8)
        np.bitwise_and(q[:, :half], np.int8(0x0F), out=packed)
        q_high = q[:, half:]
        np.left_shift(q_high, np.int8(4), out=q_high)
        np.bitwise_or(packed, q_high, out=packed)

    def _dequantize(self, codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        half = codes.shape[1]
        packed = codes.view(np.int8)
        # Arithmetic shifts sign-extend each nibble back to int8.
        low = np.left_shift(packed, np.int8(4))
        np.right_shift(low, np.int8(4), out=low)
        np.multiply(low, scales, out=out[:, :half])
        np.right_shift(packed, np.int8(4), out=low)
        np.multiply(low, scales, out=out[:, half:])


def _e3m0_tables() -> tuple[np.ndarray, np.ndarray]:
    """Tables of the 4-bit float: nibble = sign << 3 | m, value = 0 (m = 0) or 2^(m - 7).

    The encode table is indexed by the top 10 bits of the float32 (sign, 8 exponent bits, first
    mantissa bit), which is exactly enough to round to the nearest power of two in linear terms:
    between 2^k and 2^(k+1) the midpoint 1.5 * 2^k is where the first mantissa bit turns on.
    """
    encode = np.zeros(1024, dtype=np.uint8)
    for index in range(1024):
        sign, biased_exponent, half_bit = index >> 9, (index >> 1) & 0xFF, index & 1
        exponent = biased_exponent - 127 + half_bit  # nearest power of two, ties away from zero
        if biased_exponent - 127 < -7:
            m = 0  # below 2^-7: nearer to 0 than to 2^-6
        elif biased_exponent - 127 == -7:
            m = 1  # [2^-7, 2^-6): nearer to (or tied with) 2^-6 than 0
        else:
            m = min(max(exponent + 7, 1), 7)  # saturate at 2^0 (scale rounding can exceed 1)
        encode[index] = (sign << 3) | m
    decode = np.array(
        [(-1.0 if n >> 3 else 1.0) * (0.0 if n & 7 == 0 else 2.0 ** ((n & 7) - 7)) for n in range(16)],
        dtype=np.float32,
    )
    return encode, decode


class E3M0Codec(BlockCodec):
    """4-bit float (sign + 3 exponent bits, no mantissa) per block, Streaming DiLoCo's format.

    Magnitudes are {0, 2^-6, ..., 2^0} times the block scale s = absmax rounded up to bf16;
    rounding is to the nearest representable value in linear terms. Nibble layout as int4.
    """

    name = "e3m0"
    wire_id = 5
    # Its error is mostly relative to each value, so bigger blocks cost little precision.
    default_block_size = 128
    qmax = 1.0
    max_code_magnitude = 1.0
    code_bits = 4
    error_bound = "|err| <= max(|x| / 3, s * 2^-7) (+ float32 rounding), s = max(bf16_up(block absmax), 2^-126)"

    _ENCODE, _DECODE = _e3m0_tables()
    # Low/high nibble of every byte straight to float32, so decoding is one lookup per element.
    _DECODE_LOW = _DECODE[np.arange(256) & 0x0F]
    _DECODE_HIGH = _DECODE[np.arange(256) >> 4]

    def _quantize(self, scaled: np.ndarray, codes: np.ndarray) -> None:
        half = codes.shape[1]
        index = scaled.view(np.uint32)
        np.right_shift(index, np.uint32(22), out=index)
        nibbles = np.take(self._ENCODE, index)
        np.left_shift(nibbles[:, half:], np.uint8(4), out=codes)
        np.bitwise_or(codes, nibbles[:, :half], out=codes)

    def _dequantize(self, codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        half = codes.shape[1]
        np.multiply(np.take(self._DECODE_LOW, codes), scales, out=out[:, :half])
        np.multiply(np.take(self._DECODE_HIGH, codes), scales, out=out[:, half:])


ALL_CODECS: tuple[Codec, ...] = (Fp32Codec(), Bf16Codec(), Int8Codec(), Int4Codec(), E3M0Codec())
