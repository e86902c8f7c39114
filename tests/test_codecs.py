"""Tests of the tensor codecs: error bounds, determinism, edge shapes, and a total, bounded decoder."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from wire.codecs import (
    CODECS,
    CODECS_BY_ID,
    MAX_NDIM,
    MAX_TENSORS,
    decode_named,
    decode_tensor,
    encode_named,
    encode_tensor,
)
from wire.codecs import container
from wire.errors import LocalProtocolError, RemoteProtocolError

FIXED = struct.Struct("<4sBBBBII")
SMALLEST_NORMAL = 2.0**-126
# The dense schemes, whose per-element bounds are checked here; the sparse ones (topk2, union8)
# send only some values and are tested in tests/test_sparse_codecs.py.
DENSE_CODECS = [name for name, codec in CODECS.items() if not codec.segmented]

# Any finite float32: zeros, subnormals, and values up to the float32 maximum.
finite_floats = st.floats(allow_nan=False, allow_infinity=False, width=32)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=70)
arrays = shapes.flatmap(lambda shape: hnp.arrays(np.float32, shape, elements=finite_floats))


def header(codec: str, block: int, entries: list[tuple[bytes, tuple[int, ...]]], flags: int = 0) -> bytes:
    """Build a header by hand, the way a hostile or buggy peer could."""
    out = FIXED.pack(b"DLTC", 1, CODECS[codec].wire_id, flags, 0, block, len(entries))
    for name, shape in entries:
        out += struct.pack("<H", len(name)) + name + struct.pack("<B", len(shape))
        out += b"".join(struct.pack("<Q", dim) for dim in shape)
    return out


def block_scales(flat: np.ndarray, block: int, qmax: float) -> np.ndarray:
    """Upper bound of each element's block scale: bf16 rounding up adds at most 2^-7."""
    padded = np.zeros(-(-flat.size // block) * block, dtype=np.float64)
    padded[: flat.size] = np.abs(flat)
    absmax = padded.reshape(-1, block).max(axis=1)
    scales = np.maximum(absmax / qmax * (1 + 2.0**-7), SMALLEST_NORMAL)
    return np.repeat(scales, block)[: flat.size]


def allowed_error(codec: str, x: np.ndarray) -> np.ndarray:
    """The documented per-element error bound, with a float32 rounding slack."""
    flat = x.astype(np.float64).reshape(-1)
    scheme = CODECS[codec]
    if codec == "fp32":
        return np.zeros_like(flat)
    if codec == "bf16":
        return np.abs(flat) * 2.0**-8 + 2.0**-134
    scales = block_scales(flat, scheme.default_block_size, scheme.qmax)
    if codec in ("int8", "int4"):
        return scales * (0.5 + 1e-5)
    assert codec == "e3m0"
    return np.maximum(np.abs(flat) / 3, scales * 2.0**-7) * (1 + 1e-5)


@pytest.mark.parametrize("codec", DENSE_CODECS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=arrays, zstd=st.sampled_from([1, None]))
def test_round_trip_within_documented_bound(codec: str, x: np.ndarray, zstd: int | None) -> None:
    decoded = decode_tensor(encode_tensor(x, codec, zstd_level=zstd))
    assert decoded.dtype == np.float32 and decoded.shape == x.shape
    error = np.abs(decoded.astype(np.float64) - x.astype(np.float64)).reshape(-1)
    bound = allowed_error(codec, x)
    worst = int(np.argmax(error - bound)) if error.size else 0
    assert (error <= bound).all(), f"{codec}: element {worst} error {error[worst]} > bound {bound[worst]}"


def test_fp32_is_bit_exact_including_signed_zero_and_extremes() -> None:
    info = np.finfo(np.float32)
    x = np.array([0.0, -0.0, info.max, -info.max, info.tiny, 1e-45, -1e-45, 1.0 / 3.0], dtype=np.float32)
    assert decode_tensor(encode_tensor(x, "fp32")).view(np.uint32).tolist() == x.view(np.uint32).tolist()


def test_bf16_matches_reference_round_to_nearest_even() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(10_000) * np.exp(rng.uniform(-60, 60, 10_000))).astype(np.float32)
    ties = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8)], dtype=np.float32)  # exact halfway points
    x = np.concatenate([x, ties])
    expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    decoded = decode_tensor(encode_tensor(x, "bf16"))
    np.testing.assert_array_equal(decoded, expected)
    assert decoded[-3:].tolist() == [1.0, 1 + 2.0**-6, -1.0]  # ties go to the even mantissa


def test_bf16_saturates_instead_of_overflowing_to_inf() -> None:
    x = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max], dtype=np.float32)
    decoded = decode_tensor(encode_tensor(x, "bf16"))
    assert np.isfinite(decoded).all()
    assert (np.abs(decoded - x) <= np.abs(x) * 2.0**-8).all()


def test_e3m0_rounds_to_nearest_power_of_two_and_zero() -> None:
    # With block absmax 1 the scale is exactly 1: representable magnitudes are 0 and 2^-6..2^0.
    x = np.array([1.0, 0.75, 0.74, -0.3, 2.0**-7, 0.99 * 2.0**-7, 2.0**-9, 0.0], dtype=np.float32)
    decoded = decode_tensor(encode_tensor(x, "e3m0"))
    assert decoded.tolist() == [1.0, 1.0, 0.5, -0.25, 2.0**-6, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_integer_codecs_hit_the_block_maximum_and_keep_zero_exact(codec: str) -> None:
    x = np.array([0.0, 1.0, -1.0, 0.5], dtype=np.float32)
    decoded = decode_tensor(encode_tensor(x, codec))
    assert decoded[0] == 0.0
    assert abs(decoded[1] - 1.0) <= 2.0**-7 and decoded[2] == -decoded[1]


def test_blocks_never_mix_tensors_so_small_tensors_keep_their_precision() -> None:
    big = np.full(10, 1e3, dtype=np.float32)  # 10 is not a multiple of the block
    small = np.linspace(-1e-3, 1e-3, 7, dtype=np.float32)
    decoded = decode_named(encode_named({"big": big, "small": small}, "int4"))
    assert list(decoded) == ["big", "small"]
    assert np.abs(decoded["small"] - small).max() <= 1e-3 / 7 * 0.51


@pytest.mark.parametrize("codec", DENSE_CODECS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (63,), (65,), (127,), (3, 0, 5), (2, 3, 129)])
def test_edge_shapes_round_trip(codec: str, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    decoded = decode_tensor(encode_tensor(x, codec))
    assert decoded.shape == shape and decoded.dtype == np.float32
    assert (np.abs(decoded - x).reshape(-1) <= allowed_error(codec, x)).all()


@pytest.mark.parametrize("codec", list(CODECS))
def test_encoding_is_deterministic_and_accepts_other_float_dtypes(codec: str) -> None:
    rng = np.random.default_rng(3)
    tensors = {"w": rng.standard_normal((33, 17)), "b": rng.standard_normal(5).astype(np.float16)}
    first = encode_named(tensors, codec, zstd_level=3)
    assert first == encode_named({name: value.copy() for name, value in tensors.items()}, codec, zstd_level=3)
    decoded = decode_named(first)
    assert [(name, value.shape, value.dtype) for name, value in decoded.items()] == [
        ("w", (33, 17), np.float32),
        ("b", (5,), np.float32),
    ]
    bf16 = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    assert decode_tensor(encode_tensor(bf16, codec)).shape == (2,)


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused_on_encode(codec: str, bad: float) -> None:
    x = np.ones(200, dtype=np.float32)
    x[137] = bad
    with pytest.raises(LocalProtocolError, match="NaN or Inf"):
        encode_tensor(x, codec)


def test_encode_refuses_misuse_with_a_clear_reason() -> None:
    with pytest.raises(LocalProtocolError, match="float32 range"):
        encode_tensor(np.array([1e300]), "int4")  # finite float64, inf once narrowed
    with pytest.raises(LocalProtocolError, match="float arrays only"):
        encode_tensor(np.arange(4), "int8")
    with pytest.raises(LocalProtocolError, match="unknown codec"):
        encode_tensor(np.ones(4), "int3")
    with pytest.raises(LocalProtocolError, match="block size"):
        encode_tensor(np.ones(4), "int4", block_size=7)
    with pytest.raises(LocalProtocolError, match="names must be str"):
        encode_named({1: np.ones(2)}, "int4")  # type: ignore[dict-item]


def test_zstd_is_used_only_when_it_shrinks_the_body() -> None:
    zeros = encode_tensor(np.zeros(4096, dtype=np.float32), "int8")
    assert zeros[6] == container.FLAG_ZSTD and len(zeros) < 200
    noise = np.random.default_rng(4).random(256).astype(np.float32)  # mantissas are incompressible
    raw = encode_tensor(noise, "fp32", zstd_level=None)
    assert raw[6] == 0 and len(raw) == CODECS["fp32"].estimate_encoded_size(256)
    assert len(encode_tensor(noise, "fp32")) <= len(raw)


def test_wire_ids_are_stable_and_estimates_are_honest_upper_bounds() -> None:
    assert {name: codec.wire_id for name, codec in CODECS.items()} == {
        "fp32": 1,
        "bf16": 2,
        "int8": 3,
        "int4": 4,
        "e3m0": 5,
        "topk2": 6,
        "union8": 7,
    }
    assert all(CODECS_BY_ID[codec.wire_id] is codec for codec in CODECS.values())
    rng = np.random.default_rng(5)
    for size in (0, 1, 100, 4097):
        x = rng.standard_normal(size).astype(np.float32)
        for name, codec in CODECS.items():
            raw = len(encode_tensor(x, name, zstd_level=None))
            # Dense bodies have one size; a sparse body's size depends on the values, up to the bound.
            assert raw <= codec.estimate_encoded_size(size) if codec.segmented else raw == codec.estimate_encoded_size(size)
            assert len(encode_tensor(x, name)) <= codec.estimate_encoded_size(size)
    # int4 stays close to half a byte per value including scales (the bandwidth budget).
    assert CODECS["int4"].estimate_encoded_size(1 << 20) / (1 << 20) < 0.54


# --- decoding a peer's bytes -------------------------------------------------------------------


def decode_both_or_protocol_error(data: bytes) -> None:
    """Both decoders must return or raise RemoteProtocolError; any other exception fails the test."""
    for decode in (decode_named, decode_tensor):
        try:
            decode(data, max_elements=1 << 16)
        except RemoteProtocolError as error:
            assert error.status_hint in (400, 413, 426)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_only_raise_remote_protocol_error(data: bytes) -> None:
    decode_both_or_protocol_error(data)
    decode_both_or_protocol_error(b"DLTC\x01" + data)  # get past the magic and version


def _valid_messages() -> list[bytes]:
    rng = np.random.default_rng(6)
    tensors = {"a": rng.standard_normal((3, 40)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    messages = []
    for codec in CODECS:
        messages.append(encode_named(tensors, codec))
        messages.append(encode_named(tensors, codec, zstd_level=None))
        messages.append(encode_tensor(np.zeros(300, dtype=np.float32), codec))  # compresses well
    return messages


VALID_MESSAGES = _valid_messages()


@settings(max_examples=400, deadline=None)
@given(
    message=st.sampled_from(VALID_MESSAGES),
    edits=st.lists(
        st.tuples(st.integers(min_value=0), st.integers(0, 255), st.sampled_from(["set", "insert", "delete"])),
        min_size=1,
        max_size=4,
    ),
)
def test_mutated_messages_only_raise_remote_protocol_error(message: bytes, edits: list[tuple[int, int, str]]) -> None:
    mutated = bytearray(message)
    for position, value, kind in edits:
        position %= len(mutated) + 1
        if kind == "insert":
            mutated.insert(position, value)
        elif position < len(mutated):
            if kind == "set":
                mutated[position] = value
            else:
                del mutated[position]
    decode_both_or_protocol_error(bytes(mutated))


@pytest.mark.parametrize("message", VALID_MESSAGES[:6])
def test_every_truncation_is_refused_as_malformed(message: bytes) -> None:
    for length in range(len(message)):
        with pytest.raises(RemoteProtocolError) as caught:
            decode_named(message[:length])
        assert caught.value.status_hint == 400


def test_decoders_accept_memoryview_and_bytearray() -> None:
    message = encode_tensor(np.arange(10, dtype=np.float32), "fp32")
    np.testing.assert_array_equal(decode_tensor(memoryview(message)), np.arange(10, dtype=np.float32))
    np.testing.assert_array_equal(decode_tensor(bytearray(message)), np.arange(10, dtype=np.float32))


@pytest.fixture
def no_decompression(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything reaches the zstd decompressor."""

    def refuse() -> None:
        raise AssertionError("decompression was attempted")

    monkeypatch.setattr(container, "_decompressor", refuse)


BOMB_BYTES = 64 << 20
BOMB_FRAME = zstandard.ZstdCompressor(level=3).compress(bytes(BOMB_BYTES))


def test_zstd_bomb_is_refused_before_decompressing(no_decompression: None) -> None:
    assert len(BOMB_FRAME) < 4096 and zstandard.frame_content_size(BOMB_FRAME) == BOMB_BYTES
    # Header says 1000 fp32 values (4000 bytes); the frame claims 64 MiB.
    lying = header("fp32", 0, [(b"x", (1000,))], flags=container.FLAG_ZSTD) + BOMB_FRAME
    with pytest.raises(RemoteProtocolError, match="declares 67108864 bytes") as caught:
        decode_tensor(lying)
    assert caught.value.status_hint == 400
    # Header and frame agree on 16M values, but that is over the receiver's limit.
    consistent = header("fp32", 0, [(b"x", (BOMB_BYTES // 4,))], flags=container.FLAG_ZSTD) + BOMB_FRAME
    with pytest.raises(RemoteProtocolError, match="max_elements") as caught:
        decode_tensor(consistent, max_elements=1 << 20)
    assert caught.value.status_hint == 413


def test_zstd_frame_without_declared_size_is_refused(no_decompression: None) -> None:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(4000))
    with pytest.raises(RemoteProtocolError, match="declares -1 bytes"):
        decode_tensor(header("fp32", 0, [(b"x", (1000,))], flags=container.FLAG_ZSTD) + frame)


def test_trailing_bytes_after_the_zstd_frame_are_refused() -> None:
    message = encode_tensor(np.zeros(1000, dtype=np.float32), "int8")
    assert message[6] == container.FLAG_ZSTD
    with pytest.raises(RemoteProtocolError, match="does not decompress"):
        decode_tensor(message + b"\x00")


@pytest.mark.parametrize(
    ("entries", "status", "reason"),
    [
        ([(b"x", (10,))], 400, "body is 400 bytes, header implies 40"),  # body holds 100 values
        ([(b"x", (1000,))], 400, "body is 400 bytes, header implies 4000"),
        ([(b"x", (1 << 40, 1 << 40))], 413, "max_elements"),  # product overflows 64 bits
        ([(b"x", (0, 1 << 62))], 413, "max_elements"),  # zero-size, yet not allocatable
        ([(b"x", (50,)), (b"x", (50,))], 400, "appears twice"),
        ([(b"\xff\xfe", (100,))], 400, "not valid UTF-8"),
        ([(b"x", (1,) * (MAX_NDIM + 1))], 400, "dimensions"),
    ],
)
def test_header_lying_about_shapes_is_refused(entries: list, status: int, reason: str) -> None:
    body = np.zeros(100, dtype=np.float32).tobytes()
    with pytest.raises(RemoteProtocolError, match=reason) as caught:
        decode_named(header("fp32", 0, entries) + body)
    assert caught.value.status_hint == status


def test_header_fields_are_checked() -> None:
    good = encode_tensor(np.ones(5, dtype=np.float32), "int4", zstd_level=None)
    cases = {
        "bad magic": b"XXXX" + good[4:],
        "version 2,": good[:4] + b"\x02" + good[5:],
        "unknown codec id 99": good[:5] + b"\x63" + good[6:],
        "unknown flags": good[:6] + b"\x80" + good[7:],
        "block size must be even": good[:8] + struct.pack("<I", 63) + good[12:],
        "declares 1000 tensors": good[:12] + struct.pack("<I", 1000) + good[16:],
    }
    for reason, data in cases.items():
        with pytest.raises(RemoteProtocolError, match=reason) as caught:
            decode_tensor(data)
        assert caught.value.status_hint == (426 if reason.startswith("version") else 400), reason
    too_many = FIXED.pack(b"DLTC", 1, 1, 0, 0, 0, MAX_TENSORS + 1)
    with pytest.raises(RemoteProtocolError) as caught:
        decode_named(too_many)
    assert caught.value.status_hint == 413


def test_max_elements_is_enforced_exactly() -> None:
    message = encode_named({"a": np.ones(60, np.float32), "b": np.ones((5, 8), np.float32)}, "int4")
    assert sum(value.size for value in decode_named(message, max_elements=100).values()) == 100
    with pytest.raises(RemoteProtocolError, match="max_elements") as caught:
        decode_named(message, max_elements=99)
    assert caught.value.status_hint == 413


def test_block_padding_cannot_be_used_to_inflate_allocation(no_decompression: None) -> None:
    # Many one-element tensors at the largest block: each pads to 65536 elements.
    entries = [(str(i).encode(), (1,)) for i in range(300)]
    with pytest.raises(RemoteProtocolError, match="max_padding") as caught:
        decode_named(header("int8", 1 << 16, entries, flags=container.FLAG_ZSTD) + BOMB_FRAME)
    assert caught.value.status_hint == 413


def test_decode_tensor_wants_exactly_one_tensor() -> None:
    message = encode_named({"a": np.ones(2), "b": np.ones(2)}, "bf16")
    with pytest.raises(RemoteProtocolError, match="expected one tensor, message holds 2"):
        decode_tensor(message)


@pytest.mark.parametrize(
    ("codec", "scale_bits"),
    [("int8", 0x7FC0), ("int4", 0xFF80), ("e3m0", 0xBF80), ("int8", 0x7F7F)],  # NaN, -inf, -1, huge
)
def test_bodies_no_encoder_writes_are_refused(codec: str, scale_bits: int) -> None:
    message = bytearray(encode_tensor(np.ones(64, dtype=np.float32), codec, zstd_level=None))
    block = CODECS[codec].default_block_size
    body_start = len(message) - CODECS[codec].body_size(CODECS[codec].padded_count(64, block), block)
    message[body_start : body_start + 2] = struct.pack("<H", scale_bits)
    with pytest.raises(RemoteProtocolError, match="scale"):
        decode_tensor(bytes(message))
    nan_fp32 = header("fp32", 0, [(b"", (1,))]) + np.array([np.nan], dtype=np.float32).tobytes()
    with pytest.raises(RemoteProtocolError, match="NaN"):
        decode_tensor(nan_fp32)


def test_benchmark_reports_every_codec_with_the_fields_other_benchmarks_read() -> None:
    from benchmarks.codec_bench import measure_codecs

    rows = measure_codecs(num_elements=4096, repeats=1)
    assert [row["codec"] for row in rows] == list(CODECS)
    by_codec = {row["codec"]: row for row in rows}
    assert by_codec["fp32"]["max_rel_error"] == 0.0
    assert by_codec["int4"]["ratio"] > 7 and by_codec["int4"]["max_rel_error"] <= 1 / 14
    assert all(row["encode_MBps"] > 0 and row["decode_MBps"] > 0 for row in rows)
