"""The int4 uplink codec's quantizer on the device: the same bytes as `wire.codecs`, computed where
the delta lives, so only the encoded values and scales cross to the host.

`int4_blocks(x)` is the device twin of the int4 scheme's `encode_body` (wire/codecs/schemes.py,
the reference): per block of `INT4_BLOCK` values a bf16 scale rounded up from absmax / 7 (floored
at the smallest normal float32, capped so 7 * scale stays finite) and codes rint(x / scale) in
[-7, 7], two nibbles a byte (element j low, element j + block/2 high). Its output is the reference
encoder's, bit for bit, on every finite input. Two traps of device arithmetic are avoided on
purpose: comparisons of magnitudes are done on the float's bits (non-negative floats order as their
bit patterns), and subnormal inputs are scaled through their integer mantissa, because XLA flushes
subnormal operands to zero on the CPU (and may on an accelerator) where numpy keeps them.

On the host, `EncodedTensor` is one tensor's encoding as the learner hands it over: the device
arrays whose transfer to the host was started when it was made, decoded by the reference decoder
only when someone reads it (`np.asarray`). The daemon's contribution stream frames its bytes as
they are (`body_of`, `wire.contribution_stream.BlockEncoded`), with no decode; and re-encoding what
it decodes gives the same bytes (the int4 code of a decoded block is the block's code), so the
receiver and the runner see exactly what a host encoder sends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from wire.codecs import CODECS
from wire.errors import LocalProtocolError

# The int4 scheme's default block: the block the daemon's contribution chunks are encoded with
# (every chunk starts on a whole block of its tensor, so per-tensor blocks are the chunks' blocks).
_INT4 = CODECS["int4"]
INT4_BLOCK = _INT4.default_block_size
_QMAX = np.float32(_INT4.qmax)
# bf16 bits of the smallest scale an encoder writes (the smallest normal float32) and the largest
# (7 * scale must stay finite): the reference's own bounds.
_MIN_SCALE_BITS = 0x0080
_LARGEST_SCALE_BITS = int(_INT4.largest_scale_bits())
_BF16_MAX_BITS = 0x7F7F
_EXPONENT_MASK = 0x7F800000  # a float's bits at or above this are Inf or NaN
_SUBNORMAL_LIMIT = 0x00800000  # magnitude bits below this: zero or subnormal
# The codecs the device encodes; others (topk2, fp32, ...) are read to the host as float32 deltas.
DEVICE_CODECS = ("int4",)


def _f32_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _bits_f32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def int4_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Encode a float32 vector whose length is a whole number of blocks: (scale bits uint16 [n],
    codes uint8 [n, block/2], finite bool). Traceable (call it inside a jitted program)."""
    blocks = jnp.asarray(x, jnp.float32).reshape(-1, INT4_BLOCK)
    magnitude_bits = _f32_bits(blocks) & jnp.uint32(0x7FFFFFFF)
    absmax_bits = jnp.max(magnitude_bits, axis=1, initial=jnp.uint32(0))
    finite = jnp.all(absmax_bits < jnp.uint32(_EXPONENT_MASK))
    # absmax / 7 rounded up to bf16 (a subnormal quotient, flushed or not, ends at the floor below).
    quotient_bits = _f32_bits(_bits_f32(absmax_bits) / _QMAX) & jnp.uint32(0x7FFFFFFF)
    scale_bits = (quotient_bits + jnp.uint32(0xFFFF)) >> jnp.uint32(16)
    scale_bits = jnp.clip(scale_bits, _MIN_SCALE_BITS, min(_BF16_MAX_BITS, _LARGEST_SCALE_BITS))
    scales = _bits_f32(scale_bits << jnp.uint32(16))
    reciprocal = (jnp.float32(1.0) / scales)[:, None]  # always normal: scales are in [2^-126, 2^125.3]
    scaled = blocks * reciprocal
    # A subnormal x is m * 2^-149 (m its 23-bit mantissa): (m * 2^-75 * r) * 2^-74 rounds once, as
    # x * r does, and every operand is normal. Results too small to be normal become codes 0 either way.
    mantissa = (magnitude_bits & jnp.uint32(_SUBNORMAL_LIMIT - 1)).astype(jnp.float32)
    tiny = (mantissa * jnp.float32(2.0 ** -75) * reciprocal) * jnp.float32(2.0 ** -74)
    tiny = jnp.where((_f32_bits(blocks) >> jnp.uint32(31)) == 1, -tiny, tiny)
    scaled = jnp.where(magnitude_bits < jnp.uint32(_SUBNORMAL_LIMIT), tiny, scaled)
    # |x| * r never exceeds 7 by more than rounding, and rint(7 + tiny) is 7: the clip changes
    # nothing the reference does not also clip (its capped blocks).
    codes = jnp.round(jnp.clip(scaled, -_QMAX, _QMAX)).astype(jnp.int8)
    half = INT4_BLOCK // 2
    packed = (codes[:, :half] & jnp.int8(0x0F)) | (codes[:, half:] << jnp.int8(4))
    return scale_bits.astype(jnp.uint16), jax.lax.bitcast_convert_type(packed, jnp.uint8), finite


def padded_size(size: int) -> int:
    return -(-size // INT4_BLOCK) * INT4_BLOCK


def int4_tensor(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One tensor of any shape, padded with zeros to whole blocks (as the reference's work buffer)."""
    flat = jnp.asarray(x, jnp.float32).reshape(-1)
    flat = jnp.pad(flat, (0, padded_size(flat.size) - flat.size))
    return int4_blocks(flat)


def delta_program(names: tuple[str, ...]) -> Callable[[Mapping[str, Any], Mapping[str, Any]], dict]:
    """The compiled program of one fragment: delta = base - params, then its int4 encoding, per
    tensor. Returns {name: (scale bits, codes, finite)}; the float32 delta never leaves the device."""
    def run(base: Mapping[str, Any], params: Mapping[str, Any]) -> dict:
        return {name: int4_tensor(jnp.asarray(base[name], jnp.float32) - params[name]) for name in names}

    return jax.jit(run)


def body_bytes(scale_bits: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The int4 body (all scales, then all codes) the reference encoder writes for these blocks."""
    return np.concatenate([np.ascontiguousarray(scale_bits, np.uint16).view(np.uint8).reshape(-1),
                           np.ascontiguousarray(codes, np.uint8).reshape(-1)])


class EncodedTensor:
    """One tensor of a due fragment, int4-encoded on the device; its host copy was started when it
    was made. `np.asarray` decodes it (waiting for the copy if it has not landed): that is done by
    whoever encodes the contribution, never by the training thread."""

    dtype = np.dtype(np.float32)
    codec = "int4"  # `wire.contribution_stream.BlockEncoded`: its chunks are framed from these bytes

    def __init__(self, name: str, shape: tuple[int, ...], scale_bits: Any, codes: Any, finite: Any) -> None:
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.ndim = len(self.shape)
        self._parts = (scale_bits, codes, finite)

    @property
    def transfer_bytes(self) -> int:
        """Bytes the device hands the host for this tensor (scales, codes and the finiteness flag)."""
        return sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in self._parts)

    def host_parts(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """(scale bits, codes, finite) on the host; waits for the transfer."""
        scale_bits, codes, finite = (np.asarray(a) for a in self._parts)
        return scale_bits, codes, bool(finite)

    def _finite_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale bits, codes); a non-finite delta is refused as the reference encoder refuses it."""
        scale_bits, codes, finite = self.host_parts()
        if not finite:
            raise LocalProtocolError(f"tensor {self.name}: delta contains NaN or Inf; codecs encode finite values only")
        return scale_bits, codes

    def body(self) -> np.ndarray:
        """The int4 body of this tensor, as the reference encoder writes it."""
        return body_bytes(*self._finite_parts())

    def body_of(self, offset: int, values: int) -> np.ndarray:
        """The int4 body the reference encoder writes for the values [offset, offset + values) as
        one tensor: its blocks' scales and codes sliced out, when the span is whole blocks (or
        ends at the tensor's end, whose padding is the encoder's); else re-encoded from the
        decoded values (the same bytes, the slow way)."""
        if offset % INT4_BLOCK == 0 and (values % INT4_BLOCK == 0 or offset + values == self.size):
            scale_bits, codes = self._finite_parts()
            first, end = offset // INT4_BLOCK, offset // INT4_BLOCK + padded_size(values) // INT4_BLOCK
            return body_bytes(scale_bits[first:end], codes[first:end])
        work = np.zeros(padded_size(values), np.float32)
        work[:values] = np.asarray(self).reshape(-1)[offset:offset + values]
        return _INT4.encode_body(work, INT4_BLOCK)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        padded = padded_size(self.size)
        values = _INT4.decode_body(self.body(), padded, INT4_BLOCK)[: self.size].reshape(self.shape)
        return values if dtype is None else values.astype(dtype)

    def __repr__(self) -> str:
        return f"<EncodedTensor {self.name} {self.shape} int4>"
