"""The tensor message container: header, optional zstd frame, and every size check on decode.

One message carries one or more named tensors encoded with one scheme (see `schemes.py`) as a
single body, so a whole fragment gets one quantization pass and one zstd frame. Decoding is
total: any bytes yield tensors or `RemoteProtocolError`, and every declared size is checked
against a limit before anything is allocated or decompressed. Layout: docs/CODECS.md.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Mapping

import numpy as np
import zstandard

from wire.codecs.layout import DIM as _DIM
from wire.codecs.layout import FIXED_HEADER as _FIXED_HEADER
from wire.codecs.layout import NAME_LEN as _NAME_LEN
from wire.codecs.layout import NDIM as _NDIM
from wire.codecs.schemes import ALL_CODECS, Codec
from wire.codecs.sparse import SPARSE_CODECS, SparseCodec
from wire.errors import LocalProtocolError, RemoteProtocolError

FORMAT_VERSION = 1
MAGIC = b"DLTC"  # "DiLoCo tensor codec"
FLAGS_OFFSET = 6  # byte of the flags in the fixed header
FLAG_ZSTD = 0x01  # body is one zstd frame (with its content size) rather than raw bytes
_KNOWN_FLAGS = FLAG_ZSTD

# Limits, each overridable by argument. Chosen so a hostile peer cannot make us allocate much
# more than a legitimate fragment would need.
# Decoded float32 elements per message: 2^28 values = 1 GiB of output, larger than any fragment
# of the models this project trains on one machine (a 12B model in 24 fragments would need 2^29).
MAX_TENSOR_ELEMENTS = 1 << 28
# Tensors per message: a fragment of a large transformer has a few hundred; parsing is a
# Python loop, so this bounds header work per message.
MAX_TENSORS = 1 << 16
# Bytes of one tensor name (UTF-8): parameter paths are well under this.
MAX_NAME_BYTES = 1024
# Dimensions per tensor: numpy's own historic limit.
MAX_NDIM = 32
# Extra elements block padding may add beyond max_elements (each tensor starts on a block
# boundary). Legitimate messages pad by less than one block per tensor (8M elements even for
# 65536 tensors at block 128); without a bound, 65536 one-element tensors at block 65536 would
# make a tiny compressed message allocate 2^32 floats.
MAX_PADDING_ELEMENTS = 1 << 24


CODECS: dict[str, Codec] = {codec.name: codec for codec in (*ALL_CODECS, *SPARSE_CODECS)}
CODECS_BY_ID: dict[int, Codec] = {codec.wire_id: codec for codec in CODECS.values()}

_thread_state = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """One compressor per thread and level: zstd contexts are reusable but not thread-safe."""
    cache: dict[int, zstandard.ZstdCompressor] = _thread_state.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_thread_state, "decompressor"):
        _thread_state.decompressor = zstandard.ZstdDecompressor()
    return _thread_state.decompressor


# ---------------------------------------------------------------------------------------------
# Encoding (our own input: misuse raises LocalProtocolError)


def _as_float_array(name: str, value: object) -> np.ndarray:
    array = np.asarray(value)
    # bfloat16 from JAX/ml_dtypes has kind 'V' but converts to float32 exactly.
    if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
        raise LocalProtocolError(f"tensor {name!r} has dtype {array.dtype}; codecs encode float arrays only")
    if array.ndim > MAX_NDIM:
        raise LocalProtocolError(f"tensor {name!r} has {array.ndim} dimensions; at most {MAX_NDIM}")
    return array


def _resolve_codec(codec: str) -> Codec:
    try:
        return CODECS[codec]
    except KeyError:
        raise LocalProtocolError(f"unknown codec {codec!r}; known: {sorted(CODECS)}") from None


def _check_zstd_level(zstd_level: int | None) -> None:
    if zstd_level is None:
        return
    if not isinstance(zstd_level, int) or not -(1 << 17) <= zstd_level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise LocalProtocolError(f"zstd level {zstd_level!r} is not a valid zstd level")


def _resolve_block(scheme: Codec, block_size: int | None, top_k: int | None) -> int:
    """The block (chunk) size a message uses; refuses options the scheme does not take."""
    if block_size is not None and not scheme.blockwise:
        raise LocalProtocolError(f"{scheme.name} is elementwise and takes no block size")
    if top_k is not None and scheme.name != "topk2":
        raise LocalProtocolError(f"{scheme.name} takes no top_k (only topk2 does)")
    block = (scheme.default_block_size if block_size is None else block_size) if scheme.blockwise else 0
    if (problem := scheme.check_block_size(block)) is not None:
        raise LocalProtocolError(problem)
    return block


def _gather(scheme: Codec, arrays: list[np.ndarray], block: int) -> tuple[np.ndarray, list[int]]:
    """All tensors in one float32 work buffer (also the dtype conversion) and each one's slot.

    For blockwise schemes each tensor starts on a block boundary, so blocks never mix tensors of
    different scales; sparse schemes cut their chunks per tensor themselves.
    """
    padded = [scheme.padded_count(array.size, block) for array in arrays]
    work = np.empty(sum(padded), dtype=np.float32)
    offset = 0
    for array, slot in zip(arrays, padded):
        with np.errstate(over="ignore"):  # float64 beyond float32 range becomes inf: refused below
            work[offset : offset + array.size] = array.reshape(-1)
        work[offset + array.size : offset + slot] = 0.0
        offset += slot
    return work, padded


def _encode_work(scheme: Codec, work: np.ndarray, sizes: list[int], block: int, top_k: int | None) -> np.ndarray:
    if isinstance(scheme, SparseCodec):
        return scheme.encode_segments(work, sizes, block, top_k)
    return scheme.encode_body(work, block)


def _decode_work(scheme: Codec, body: np.ndarray, sizes: list[int], padded_total: int, block: int) -> np.ndarray:
    if isinstance(scheme, SparseCodec):
        return scheme.decode_segments(body, sizes, block)
    return scheme.decode_body(body, padded_total, block)


def encode_named(
    tensors: Mapping[str, np.ndarray],
    codec: str = "int4",
    *,
    zstd_level: int | None = 1,
    block_size: int | None = None,
    top_k: int | None = None,
) -> bytes:
    """Encode several named float tensors as one message (one quantization pass, one zstd frame).

    Names keep the mapping's order. `zstd_level=None` never compresses; otherwise the body is
    compressed at that level and sent compressed only if that makes it smaller. `block_size`
    overrides the scheme's default for blockwise schemes (the chunk size C of the sparse ones);
    `top_k` overrides topk2's k. Deterministic: same input, same bytes.
    Raises LocalProtocolError for non-float or non-finite tensors, bad names, unknown codecs.
    """
    scheme = _resolve_codec(codec)
    _check_zstd_level(zstd_level)
    block = _resolve_block(scheme, block_size, top_k)
    if len(tensors) > MAX_TENSORS:
        raise LocalProtocolError(f"{len(tensors)} tensors in one message; at most {MAX_TENSORS}")

    arrays: list[np.ndarray] = []
    header = bytearray(_FIXED_HEADER.pack(MAGIC, FORMAT_VERSION, scheme.wire_id, 0, 0, block, len(tensors)))
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise LocalProtocolError(f"tensor names must be str, got {type(name).__name__}")
        try:
            name_bytes = name.encode("utf-8")
        except UnicodeEncodeError:
            raise LocalProtocolError(f"tensor name {name!r} is not encodable as UTF-8") from None
        if len(name_bytes) > MAX_NAME_BYTES:
            raise LocalProtocolError(
                f"tensor name {name[:40]!r}... is {len(name_bytes)} bytes; at most {MAX_NAME_BYTES}"
            )
        array = _as_float_array(name, value)
        arrays.append(array)
        header += _NAME_LEN.pack(len(name_bytes)) + name_bytes + _NDIM.pack(array.ndim)
        header += b"".join(_DIM.pack(dim) for dim in array.shape)

    work, _ = _gather(scheme, arrays, block)
    body = _encode_work(scheme, work, [array.size for array in arrays], block, top_k)
    return _framed(header, body, zstd_level)


def _framed(header: bytearray, body: np.ndarray, zstd_level: int | None) -> bytes:
    """Header and body as one message, the body zstd-compressed when that makes it smaller."""
    if zstd_level is not None and body.size:
        compressed = _compressor(zstd_level).compress(body)
        if len(compressed) < body.size:
            header[FLAGS_OFFSET] = FLAG_ZSTD
            return b"".join((header, compressed))
    return b"".join((header, body))  # joins the array's buffer directly: one copy of the body


def frame_body(num_elements: int, codec: str, body: np.ndarray, *, zstd_level: int | None = 1) -> bytes:
    """The message `encode_tensor(values, codec, zstd_level=...)` writes for a 1-D tensor of
    `num_elements` values whose body (`Codec.encode_body` of them, at the scheme's default block)
    was computed elsewhere: a twin of the scheme's encoder next to the values (the learner's
    device quantizer), so the body is not decoded and encoded again to be framed.

    Dense schemes only (a sparse body depends on its tensors' sizes). The caller answers for the
    body's bytes; its size is checked. Raises LocalProtocolError on misuse.
    """
    scheme = _resolve_codec(codec)
    _check_zstd_level(zstd_level)
    if isinstance(scheme, SparseCodec):
        raise LocalProtocolError(f"{scheme.name} bodies depend on their tensors' sizes; encode the values instead")
    block = _resolve_block(scheme, None, None)
    body = np.asarray(body)
    expected = scheme.body_size(scheme.padded_count(num_elements, block), block)
    if body.dtype != np.uint8 or body.ndim != 1 or body.size != expected:
        raise LocalProtocolError(f"a {scheme.name} body of {num_elements} values is {expected} uint8 bytes, "
                                 f"got {body.dtype} {body.shape}")
    header = bytearray(_FIXED_HEADER.pack(MAGIC, FORMAT_VERSION, scheme.wire_id, 0, 0, block, 1))
    header += _NAME_LEN.pack(0) + _NDIM.pack(1) + _DIM.pack(num_elements)
    return _framed(header, body, zstd_level)


def quantize_roundtrip(
    values: np.ndarray, codec: str, *, block_size: int | None = None, top_k: int | None = None
) -> np.ndarray:
    """What `decode_tensor(encode_tensor(values, codec, ...))` returns, bit for bit, without zstd.

    A float32 array of the shape of `values`: the Q(x) a sender with error feedback subtracts.
    Raises LocalProtocolError like `encode_tensor`.
    """
    scheme = _resolve_codec(codec)
    block = _resolve_block(scheme, block_size, top_k)
    array = _as_float_array("", values)
    work, padded = _gather(scheme, [array], block)
    body = _encode_work(scheme, work, [array.size], block, top_k)
    return _decode_work(scheme, body, [array.size], padded[0], block)[: array.size].reshape(array.shape)


def encode_tensor(
    x: np.ndarray,
    codec: str = "int4",
    *,
    zstd_level: int | None = 1,
    block_size: int | None = None,
    top_k: int | None = None,
) -> bytes:
    """Encode one float tensor (any shape, incl. scalars and empty) as a message with one unnamed entry."""
    return encode_named({"": x}, codec, zstd_level=zstd_level, block_size=block_size, top_k=top_k)


# ---------------------------------------------------------------------------------------------
# Decoding (a peer's bytes: anything wrong raises RemoteProtocolError, nothing else escapes)


def _malformed(reason: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"malformed tensor message: {reason}", status_hint=400)


class _Reader:
    """Bounds-checked cursor over the header bytes."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.offset = 0

    def take(self, size: int, what: str) -> memoryview:
        if size > len(self.data) - self.offset:
            raise _malformed(f"truncated in {what} at byte {self.offset}")
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        return fmt.unpack(self.take(fmt.size, what))


def _parse(
    data: bytes | bytearray | memoryview, max_elements: int, max_padding: int,
    expected: Mapping[str, tuple[int, ...]] | None = None,
) -> tuple[Codec, int, list[tuple[str, tuple[int, ...]]], memoryview, bool]:
    """Parse and check the header; return (codec, block, entries, body bytes, zstd flag).

    `expected`: the exact names and shapes the message must hold (a fragment's tensors), checked
    here, before anything is decompressed or allocated; the element bound is then theirs."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise LocalProtocolError(f"decode takes bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise _malformed("buffer is not a contiguous byte buffer") from None
    reader = _Reader(view)
    magic, version, codec_id, flags, reserved, block, count = reader.unpack(_FIXED_HEADER, "fixed header")
    if magic != MAGIC:
        raise _malformed(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RemoteProtocolError(
            f"tensor message format version {version}, we speak {FORMAT_VERSION}", status_hint=426
        )
    scheme = CODECS_BY_ID.get(codec_id)
    if scheme is None:
        raise _malformed(f"unknown codec id {codec_id}")
    if flags & ~_KNOWN_FLAGS or reserved:
        raise _malformed(f"unknown flags 0x{flags:02x} / reserved byte {reserved}")
    if (problem := scheme.check_block_size(block)) is not None:
        raise _malformed(problem)
    if count > MAX_TENSORS:
        raise RemoteProtocolError(f"{count} tensors in one message; at most {MAX_TENSORS}", status_hint=413)
    if expected is not None:
        if count != len(expected):
            raise _malformed(f"holds {count} tensors, expected {len(expected)}")
        max_elements = min(max_elements, sum(math.prod(shape) for shape in expected.values()))
    minimum_entry = _NAME_LEN.size + _NDIM.size
    if count * minimum_entry > len(view) - reader.offset:
        raise _malformed(f"declares {count} tensors but is only {len(view)} bytes")

    entries: list[tuple[str, tuple[int, ...]]] = []
    names: set[str] = set()
    total_elements = 0
    for _ in range(count):
        (name_len,) = reader.unpack(_NAME_LEN, "name length")
        if name_len > MAX_NAME_BYTES:
            raise _malformed(f"tensor name of {name_len} bytes; at most {MAX_NAME_BYTES}")
        try:
            name = str(reader.take(name_len, "name"), "utf-8")
        except UnicodeDecodeError:
            raise _malformed("tensor name is not valid UTF-8") from None
        if name in names:
            raise _malformed(f"tensor name {name!r} appears twice")
        names.add(name)
        (ndim,) = reader.unpack(_NDIM, "ndim")
        if ndim > MAX_NDIM:
            raise _malformed(f"tensor {name!r} has {ndim} dimensions; at most {MAX_NDIM}")
        dims = reader.take(_DIM.size * ndim, "shape")
        shape = tuple(_DIM.unpack_from(dims, i * _DIM.size)[0] for i in range(ndim))
        if expected is not None:
            if name not in expected:
                raise _malformed(f"tensor {name[:64]!r} is not one of the expected tensors")
            if shape != tuple(expected[name]):
                raise _malformed(f"tensor {name!r} has shape {shape}, expected {tuple(expected[name])}")
        # Python ints: the products cannot overflow, however large the declared dims. Zero-size
        # tensors still need every dim to be allocatable, so nonzero dims are bounded too.
        if math.prod(max(dim, 1) for dim in shape) > max_elements:
            raise RemoteProtocolError(
                f"tensor {name!r} declares shape {shape}, over {max_elements} elements (limit max_elements)",
                status_hint=413,
            )
        total_elements += math.prod(shape)
        if total_elements > max_elements:
            raise RemoteProtocolError(
                f"message declares more than {max_elements} elements (limit max_elements)", status_hint=413
            )
        entries.append((name, shape))
    padded_total = sum(scheme.padded_count(math.prod(shape), block) for _, shape in entries)
    if padded_total - total_elements > max_padding:
        raise RemoteProtocolError(
            f"block padding of {padded_total - total_elements} elements exceeds {max_padding} (limit max_padding)",
            status_hint=413,
        )
    return scheme, block, entries, view[reader.offset :], bool(flags & FLAG_ZSTD)


def _decode_body(
    scheme: Codec, block: int, entries: list[tuple[str, tuple[int, ...]]], payload: memoryview, compressed: bool
) -> list[np.ndarray]:
    """Check the payload's (declared) size against the header, decompress, decode, split.

    Blockwise and elementwise bodies have an exact size; a sparse body may be at most its
    scheme's bound for these shapes, and the scheme checks its exact size from its own prefix.
    """
    sizes = [math.prod(shape) for _, shape in entries]
    padded = [scheme.padded_count(size, block) for size in sizes]
    total_padded = sum(padded)
    exact = not isinstance(scheme, SparseCodec)
    expected = scheme.body_size(total_padded, block) if exact else scheme.max_body_size(sizes, block)
    wanted = "" if exact else "at most "
    if compressed:
        # The frame's declared size is checked before zstd allocates anything for it: a 2 KB
        # frame may claim gigabytes.
        try:
            declared = zstandard.frame_content_size(payload)
        except zstandard.ZstdError:
            raise _malformed("body is not a zstd frame") from None
        if (declared != expected) if exact else not 0 <= declared <= expected:
            raise _malformed(f"zstd frame declares {declared} bytes, header implies {wanted}{expected}")
        try:
            raw = _decompressor().decompress(payload, max_output_size=max(declared, 1), allow_extra_data=False)
        except zstandard.ZstdError as error:
            raise _malformed(f"zstd frame does not decompress: {error}") from None
        if len(raw) != declared:
            raise _malformed(f"zstd frame held {len(raw)} bytes, it declares {declared}")
        body = np.frombuffer(raw, dtype=np.uint8)
    else:
        if (len(payload) != expected) if exact else len(payload) > expected:
            raise _malformed(f"body is {len(payload)} bytes, header implies {wanted}{expected}")
        body = np.frombuffer(payload, dtype=np.uint8)
    flat = _decode_work(scheme, body, sizes, total_padded, block)
    tensors = []
    offset = 0
    for (_, shape), slot in zip(entries, padded):
        tensors.append(flat[offset : offset + math.prod(shape)].reshape(shape))
        offset += slot
    return tensors


def decode_named(
    data: bytes | memoryview,
    *,
    max_elements: int = MAX_TENSOR_ELEMENTS,
    max_padding: int = MAX_PADDING_ELEMENTS,
    expected: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, np.ndarray]:
    """Decode a message from `encode_named` into {name: float32 array of the original shape}.

    Raises RemoteProtocolError (status 400 malformed, 413 over `max_elements`, 426 unknown
    format version) for any bytes that are not a valid message; never anything else.
    The arrays are writable views into one freshly allocated buffer. With `expected` (name ->
    shape), a message holding anything else is refused before decompression, and decoding is
    bounded by those tensors' own element count.
    """
    scheme, block, entries, payload, compressed = _parse(data, max_elements, max_padding, expected)
    tensors = _decode_body(scheme, block, entries, payload, compressed)
    return {name: tensor for (name, _), tensor in zip(entries, tensors)}


def decode_tensor(
    data: bytes | memoryview,
    *,
    max_elements: int = MAX_TENSOR_ELEMENTS,
    max_padding: int = MAX_PADDING_ELEMENTS,
) -> np.ndarray:
    """Decode a message holding exactly one tensor (from `encode_tensor`) into a float32 array."""
    scheme, block, entries, payload, compressed = _parse(data, max_elements, max_padding)
    if len(entries) != 1:
        raise _malformed(f"expected one tensor, message holds {len(entries)}")
    return _decode_body(scheme, block, entries, payload, compressed)[0]
