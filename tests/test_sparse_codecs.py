"""Tests of the sparse codecs (topk2, union8): what they select, what a sender may subtract, and a total decoder."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from wire.codecs import CODECS, decode_named, decode_tensor, encode_named, encode_tensor, quantize_roundtrip
from wire.codecs.layout import header_size
from wire.errors import LocalProtocolError, RemoteProtocolError

C = 4096
SPARSE = ["topk2", "union8"]


def bits(values: np.ndarray) -> list[int]:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).reshape(-1).tolist()


def sparse_delta(size: int, density: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(size).astype(np.float32)
    values[rng.random(size) >= density] = 0.0
    return values


def raw_body(message: bytes, entries: list[tuple[str, tuple[int, ...]]]) -> tuple[bytes, bytearray]:
    """(header, body) of an uncompressed message."""
    assert message[6] == 0, "expected an uncompressed message"
    split = header_size(entries)
    return message[:split], bytearray(message[split:])


@pytest.mark.parametrize("codec", ["topk2", "union8", "int4", "e3m0"])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (C,), (3 * C + 100,), (5, C), (65, 129)])
def test_quantize_roundtrip_is_the_decoded_message_bit_for_bit(codec: str, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32) * np.float32(1e-3)
    expected = decode_tensor(encode_tensor(x, codec))
    got = quantize_roundtrip(x, codec)
    assert got.shape == x.shape and got.dtype == np.float32
    assert bits(got) == bits(expected)


@pytest.mark.parametrize("codec", SPARSE)
def test_a_fragment_message_decodes_to_each_tensors_own_roundtrip(codec: str) -> None:
    """The learner computes Q per tensor; the message it sends holds the whole fragment."""
    rng = np.random.default_rng(2)
    # Densities on both sides of union8's sparse/dense crossover, and a tiny fully dense tail, in one message.
    tensors = {"w": rng.standard_normal((3, C + 10)).astype(np.float32), "norm": rng.standard_normal(300).astype(
        np.float32), "v": sparse_delta(2 * C, 0.01, seed=3), "u": sparse_delta(3 * C + 3, 0.36, seed=4),
        "t": sparse_delta(C + 1, 0.001, seed=5)}
    decoded = decode_named(encode_named(tensors, codec))
    assert list(decoded) == list(tensors)
    for name, value in tensors.items():
        assert bits(decoded[name]) == bits(quantize_roundtrip(value, codec)), name


def test_topk2_sends_the_k_largest_of_every_whole_chunk_and_int4_for_the_rest() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal(2 * C + 50).astype(np.float32)
    decoded = decode_tensor(encode_tensor(x, "topk2"))
    for chunk in range(2):
        values, got = x[chunk * C:(chunk + 1) * C], decoded[chunk * C:(chunk + 1) * C]
        top = np.sort(np.argsort(-np.abs(values), kind="stable")[:64])
        assert np.flatnonzero(got).tolist() == top.tolist()
        assert (np.sign(got[top]) == np.sign(values[top])).all()
        assert len(set(np.abs(got[top]).tolist())) <= 2  # two magnitude levels per chunk
        # Each kept value is nearer its own level than the other: error below half the chunk's spread.
        assert np.abs(got[top] - values[top]).max() <= np.abs(values[top]).max() - np.abs(values[top]).min()
    tail = x[2 * C:]
    assert np.abs(decoded[2 * C:] - tail).max() <= np.abs(tail).max() / 7 * 0.51 * (1 + 2**-7)  # int4's bound


def test_topk2_ties_go_to_the_lower_index_and_k_and_chunk_size_are_honoured() -> None:
    x = np.ones(C, dtype=np.float32)
    x[[5, 4000]] = 2.0
    decoded = decode_tensor(encode_tensor(x, "topk2", top_k=4))
    assert np.flatnonzero(decoded).tolist() == [0, 1, 5, 4000]
    zeros = decode_tensor(encode_tensor(np.zeros(2 * C, dtype=np.float32), "topk2"))
    assert not zeros.any()
    small = np.arange(1, 257, dtype=np.float32)
    decoded = decode_tensor(encode_tensor(small, "topk2", block_size=128, top_k=3))
    assert np.flatnonzero(decoded).tolist() == [125, 126, 127, 253, 254, 255]


def test_topk2_quantizes_the_same_however_a_tensor_is_cut_at_whole_chunks() -> None:
    """Streamed contributions cut tensors into pieces of whole chunks: each piece decodes alike."""
    x = np.random.default_rng(5).standard_normal(5 * C + 77).astype(np.float32)
    whole = quantize_roundtrip(x, "topk2")
    pieces = np.concatenate([quantize_roundtrip(x[:2 * C], "topk2"), quantize_roundtrip(x[2 * C:], "topk2")])
    assert bits(whole) == bits(pieces)


def test_topk2_costs_about_a_sixth_of_a_bit_per_value() -> None:
    x = np.random.default_rng(6).standard_normal(64 * C).astype(np.float32)
    message = encode_tensor(x, "topk2")
    assert len(message) * 8 / x.size < 0.18
    assert len(message) <= CODECS["topk2"].estimate_encoded_size(x.size)


def test_union8_keeps_zeros_exact_and_falls_back_to_int4_per_chunk() -> None:
    sparse = sparse_delta(3 * C, 0.02, seed=7)
    dense = np.random.default_rng(8).standard_normal(C).astype(np.float32)
    x = np.concatenate([sparse, dense])
    decoded = decode_tensor(encode_tensor(x, "union8", zstd_level=None))
    assert (decoded[:3 * C][sparse == 0] == 0).all()
    for chunk in range(3):
        values = sparse[chunk * C:(chunk + 1) * C]
        error = np.abs(decoded[chunk * C:(chunk + 1) * C] - values)
        assert error.max() <= np.abs(values).max() / 127 * 0.51 * (1 + 2**-7)
    assert np.abs(decoded[3 * C:] - dense).max() <= np.abs(dense).max() / 7 * 0.51 * (1 + 2**-7)
    dense_only = len(encode_tensor(dense, "union8", zstd_level=None))
    assert dense_only <= len(encode_tensor(dense, "int4", zstd_level=None)) + 4 + 2  # table + padding slack
    sparse_only = len(encode_tensor(sparse, "union8", zstd_level=None))
    assert sparse_only < len(encode_tensor(sparse, "int4", zstd_level=None)) / 3


def test_sparse_codecs_are_deterministic_and_refuse_misuse() -> None:
    x = sparse_delta(3 * C, 0.3, seed=9)
    for codec in SPARSE:
        assert encode_tensor(x, codec) == encode_tensor(x.copy(), codec)
    with pytest.raises(LocalProtocolError, match="top_k"):
        encode_tensor(x, "topk2", top_k=C + 1)
    with pytest.raises(LocalProtocolError, match="top_k"):
        encode_tensor(x, "topk2", top_k=0)
    with pytest.raises(LocalProtocolError, match="takes no top_k"):
        encode_tensor(x, "union8", top_k=3)
    with pytest.raises(LocalProtocolError, match="takes no top_k"):
        quantize_roundtrip(x, "int4", top_k=3)
    with pytest.raises(LocalProtocolError, match="chunk size must be a multiple of 64"):
        encode_tensor(x, "topk2", block_size=100)
    x[5] = np.nan
    for codec in SPARSE:
        with pytest.raises(LocalProtocolError, match="NaN or Inf"):
            quantize_roundtrip(x, codec)


def _refused(message: bytes | bytearray, reason: str) -> None:
    with pytest.raises(RemoteProtocolError, match=reason) as caught:
        decode_tensor(bytes(message))
    assert caught.value.status_hint == 400


def test_topk2_decoder_checks_k_sizes_levels_and_indices() -> None:
    x = np.random.default_rng(10).standard_normal(2 * C).astype(np.float32)
    entries = [("", (2 * C,))]
    head, body = raw_body(encode_tensor(x, "topk2", zstd_level=None), entries)
    for k, reason in ((0, "declares k = 0"), (C + 1, "declares k = 4097"), (65, "its k and shapes imply")):
        _refused(head + struct.pack("<I", k) + body[4:], reason)
    _refused(head + body[:-1], "its k and shapes imply")
    levels = bytearray(body)
    levels[4:8] = struct.pack("<HH", 0x4000, 0x3F80)  # low 2.0 above high 1.0
    _refused(head + levels, "levels are negative, out of order")
    levels[4:8] = struct.pack("<HH", 0x3F80, 0x7FC0)  # NaN
    _refused(head + levels, "levels are negative, out of order")
    # High bits start after k, levels, codes and 6-bit low fields: 2 chunks x 64 x (2 + 6) bits.
    high_start = 4 + 8 + 2 * 64 * 2 // 8 + 2 * 64 * 6 // 8
    damaged = bytearray(body)
    damaged[high_start] ^= 0x01 if not damaged[high_start] & 1 else 0x02
    with pytest.raises(RemoteProtocolError):
        decode_tensor(head + damaged)
    no_index = bytearray(body)
    no_index[high_start:high_start + 8] = bytes(8)
    _refused(head + no_index, "index bits hold")


def test_union8_decoder_checks_its_chunk_table() -> None:
    x = sparse_delta(2 * C, 0.01, seed=11)
    entries = [("", (2 * C,))]
    head, body = raw_body(encode_tensor(x, "union8", zstd_level=None), entries)
    table = list(struct.unpack("<II", body[:8]))
    assert 0 < table[0] < 100 and 0 < table[1] < 100
    rest = body[8:]

    def with_table(first: int, second: int) -> bytes:
        return head + struct.pack("<II", first, second) + rest

    _refused(with_table(C + 1, table[1]), "more values than it holds")
    _refused(with_table(3000, table[1]), "sparse where the encoder sends it dense")
    _refused(with_table(table[0] + 1, table[1]), "chunk table implies")
    _refused(head + body + b"\0", "chunk table implies")
    scale = bytearray(body)
    scale[8:10] = struct.pack("<H", 0xBF80)  # -1.0
    _refused(head + scale, "negative, NaN or oversized scale")
    lying = bytearray(head) + body  # a raw body longer than any valid one for the shape
    with pytest.raises(RemoteProtocolError, match="at most"):
        decode_tensor(bytes(lying) + bytes(CODECS["union8"].max_body_size([2 * C], C)))


def _valid_sparse_messages() -> list[bytes]:
    rng = np.random.default_rng(12)
    tensors = {"a": rng.standard_normal((2, 200)).astype(np.float32), "b": sparse_delta(300, 0.05, seed=13)}
    out = []
    for codec in SPARSE:
        for zstd in (1, None):
            out.append(encode_named(tensors, codec, zstd_level=zstd, block_size=128))
            out.append(encode_tensor(sparse_delta(3 * 128 + 5, 0.2, seed=14), codec, zstd_level=zstd, block_size=128))
    return out


def test_a_few_hundred_damaged_sparse_messages_raise_only_protocol_errors() -> None:
    """The quick version of benchmarks/wire_fuzz.py's codec fuzz (100,000 frames there)."""
    rng = random.Random(15)
    messages = _valid_sparse_messages()
    accepted = 0
    for _ in range(400):
        damaged = bytearray(rng.choice(messages))
        for _ in range(rng.randint(1, 3)):
            position = rng.randrange(len(damaged))
            damaged[position] ^= 1 << rng.randrange(8)
        if rng.random() < 0.2:
            del damaged[rng.randrange(len(damaged)):]
        try:
            for value in decode_named(bytes(damaged), max_elements=1 << 12).values():
                assert value.dtype == np.float32 and np.isfinite(value).all()
            accepted += 1
        except RemoteProtocolError as error:
            assert error.status_hint in (400, 413, 426)
    assert accepted < 400  # most damage is caught (a flipped value bit may still decode)


def test_topk2_selection_matches_a_stable_sort_even_with_many_ties() -> None:
    """Small integers tie everywhere: the selection is still a stable sort's first k of each chunk."""
    from wire.codecs.sparse import _top_k_columns

    rng = np.random.default_rng(16)
    for trial in range(60):
        width = int(rng.choice([64, 128, 256, C]))
        k = int(rng.integers(1, width + 1)) if trial % 3 else 64 % width or width
        rows = int(rng.integers(1, 5))
        if trial % 2:
            magnitudes = np.abs(rng.integers(-3, 4, (rows, width))).astype(np.float32)
        else:
            magnitudes = np.abs(rng.standard_normal((rows, width))).astype(np.float32)
        expected = np.sort(np.argsort(-magnitudes, axis=1, kind="stable")[:, :k], axis=1)
        assert _top_k_columns(magnitudes, k).tolist() == expected.tolist(), (width, k, rows)
    zero_chunk = np.zeros((1, C), dtype=np.float32)
    assert _top_k_columns(zero_chunk, 64).tolist() == [list(range(64))]


def test_extreme_values_stay_finite_and_the_manifest_offers_every_codec() -> None:
    from diloco_node.config.manifest import CODEC_NAMES

    biggest = np.finfo(np.float32).max
    x = np.zeros(2 * C + 3, dtype=np.float32)
    x[[0, 1, 7, C + 5, 2 * C + 1]] = [biggest, -biggest, 1e-45, -biggest / 3, biggest]
    for codec in SPARSE:
        decoded = decode_tensor(encode_tensor(x, codec))
        assert np.isfinite(decoded).all() and bits(decoded) == bits(quantize_roundtrip(x, codec))
        assert np.sign(decoded[[0, 1]]).tolist() == [1.0, -1.0]
    assert set(CODEC_NAMES) == set(CODECS)
