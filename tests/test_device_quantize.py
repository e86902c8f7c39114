"""The device twin of the int4 codec (learn/device_quantize.py) against the wire's reference
encoder: the same body bytes on random, heavy-tailed, all-zero, very large and subnormal inputs,
and a decoded `EncodedTensor` that re-encodes to the bytes the device made."""

from __future__ import annotations

import dataclasses
from unittest import mock

import jax
import numpy as np
import pytest

from diloco_node.learn import device_quantize as dq
from wire.codecs import CODECS, encode_tensor, frame_body
from wire.contribution_stream import contribution_chunks, open_for
from wire.errors import LocalProtocolError

INT4 = CODECS["int4"]
BLOCK = dq.INT4_BLOCK
_encode = jax.jit(dq.int4_tensor)


def _reference_body(x: np.ndarray) -> np.ndarray:
    work = np.zeros(dq.padded_size(x.size), np.float32)
    work[: x.size] = x.reshape(-1)
    return INT4.encode_body(work, BLOCK)


def _device_body(x: np.ndarray) -> np.ndarray:
    scale_bits, codes, finite = _encode(x)
    assert bool(finite)
    return dq.body_bytes(np.asarray(scale_bits), np.asarray(codes))


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    f32 = np.finfo(np.float32)
    subnormals = (rng.integers(1, 1 << 23, 4 * BLOCK) * rng.choice([-1, 1], 4 * BLOCK)).astype(np.int64)
    sub = (np.abs(subnormals).astype(np.uint32) | np.where(subnormals < 0, np.uint32(1 << 31), np.uint32(0)))
    mixed_tiny = np.concatenate([sub.view(np.float32)[:BLOCK], np.full(BLOCK, f32.tiny, np.float32),
                                 (sub.view(np.float32)[BLOCK:2 * BLOCK] * 0 + np.float32(3e-38))])
    return {
        "random": rng.standard_normal(10 * BLOCK + 17).astype(np.float32) * 1e-3,
        "heavy_tailed": rng.standard_cauchy(7 * BLOCK + 3).astype(np.float32),
        "all_zero": np.zeros(3 * BLOCK, np.float32),
        "negative_zero": np.full(BLOCK, -0.0, np.float32),
        "very_large": np.concatenate([np.full(BLOCK, f32.max, np.float32), -np.full(BLOCK, f32.max, np.float32),
                                      rng.uniform(-1, 1, BLOCK).astype(np.float32) * f32.max,
                                      np.array([f32.max / 7, -f32.max / 6.9] * (BLOCK // 2), np.float32)]),
        "subnormal": sub.view(np.float32),
        "tiny_mixed": mixed_tiny,
        "ties": (rng.integers(-7, 8, 4 * BLOCK) + 0.5).astype(np.float32),
        "one_value": np.array([0.3], np.float32),
        "spread": (rng.standard_normal(6 * BLOCK) * 10.0 ** rng.integers(-40, 38, 6 * BLOCK)).astype(np.float32),
        "matrix": rng.standard_normal((33, 70)).astype(np.float32),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_the_device_int4_body_is_the_reference_encoders_bit_for_bit(case: str) -> None:
    x = _cases()[case]
    np.testing.assert_array_equal(_device_body(x), _reference_body(x), err_msg=case)


@pytest.mark.parametrize("case", sorted(_cases()))
def test_a_decoded_encoded_tensor_reencodes_to_the_same_wire_bytes(case: str) -> None:
    """What the daemon's codec pool does with a device-encoded delta: decode it and encode it as a
    contribution chunk. The receiver gets what a host encoder of the raw delta would have sent."""
    x = _cases()[case]
    tensor = dq.EncodedTensor("t", x.shape, *_encode(x))
    decoded = np.asarray(tensor)
    assert decoded.shape == x.shape and decoded.dtype == np.float32 and np.shape(tensor) == x.shape
    for zstd_level in (None, 1):
        assert encode_tensor(decoded, "int4", zstd_level=zstd_level) == encode_tensor(x, "int4", zstd_level=zstd_level)
    assert tensor.transfer_bytes == dq.padded_size(x.size) // 2 + 2 * dq.padded_size(x.size) // BLOCK + 1


def test_non_finite_deltas_are_flagged_and_refused_when_read() -> None:
    x = np.ones(2 * BLOCK, np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        x[BLOCK + 3] = bad
        scale_bits, codes, finite = _encode(x)
        assert not bool(finite)
        with pytest.raises(LocalProtocolError, match="NaN or Inf"):
            np.asarray(dq.EncodedTensor("t", x.shape, scale_bits, codes, finite))


def test_the_fragment_program_encodes_base_minus_params() -> None:
    rng = np.random.default_rng(3)
    base = {"a": rng.standard_normal((5, 64)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    params = {n: v + rng.standard_normal(v.shape).astype(np.float32) * 1e-2 for n, v in base.items()}
    out = dq.delta_program(("a", "b"))(base, params)
    for name in base:
        delta = np.subtract(base[name], params[name], dtype=np.float32)
        np.testing.assert_array_equal(dq.body_bytes(np.asarray(out[name][0]), np.asarray(out[name][1])),
                                      _reference_body(delta))


def _chunks(head, delta) -> list:
    return [(c.tensor, c.offset, c.payload) for c in contribution_chunks(head, delta)]


@pytest.mark.parametrize("chunk_blocks", [1, 3, 1000])
def test_device_encoded_chunks_are_framed_as_the_host_encodes_the_raw_delta(chunk_blocks: int) -> None:
    """The daemon's contribution stream frames a device-encoded tensor's own bytes (no decode):
    every chunk (whole blocks, a tensor's short tail chunk, an empty tensor) is the payload a host
    encoder of the raw float32 delta writes, zstd or not."""
    cases = _cases()
    raw = {name: cases[name] for name in ("random", "heavy_tailed", "one_value", "matrix", "subnormal")}
    raw["empty"] = np.zeros((0, 3), np.float32)
    head = open_for({n: v.shape for n, v in raw.items()}, fragment=0, base_index=0, base_round=0, c_steps=1,
                    c_tokens=1, codec="int4", learner_id="a", stream=b"s" * 16)
    head = dataclasses.replace(head, chunk_elements=chunk_blocks * BLOCK)
    encoded = {n: dq.EncodedTensor(n, v.shape, *_encode(v)) for n, v in raw.items()}
    framed = _chunks(head, encoded)
    assert framed == _chunks(head, raw)
    assert len(framed) > len(raw) or chunk_blocks == 1000
    # No decode on the way: the framed path never builds the float32 tensor.
    with mock.patch.object(dq.EncodedTensor, "__array__", side_effect=AssertionError("decoded")):
        assert _chunks(head, encoded) == framed
    # Chunks that are not whole blocks (never planned: `chunk_elements_for` cuts whole blocks) cut
    # the device's blocks: they are re-encoded from the decoded values, as before this framing.
    odd = dataclasses.replace(head, chunk_elements=BLOCK + 2)
    assert _chunks(odd, encoded) == _chunks(odd, {n: np.asarray(t) for n, t in encoded.items()})


def test_a_non_finite_device_delta_is_refused_when_framed() -> None:
    x = np.ones(2 * BLOCK, np.float32)
    x[5] = np.nan
    head = open_for({"t": x.shape}, fragment=0, base_index=0, base_round=0, c_steps=1, c_tokens=1, codec="int4",
                    learner_id="a", stream=b"s" * 16)
    with pytest.raises(LocalProtocolError, match="NaN or Inf"):
        _chunks(head, {"t": dq.EncodedTensor("t", x.shape, *_encode(x))})


def test_frame_body_checks_the_body_it_is_given() -> None:
    body = _reference_body(np.ones(BLOCK, np.float32))
    assert frame_body(BLOCK, "int4", body) == encode_tensor(np.ones(BLOCK, np.float32), "int4")
    with pytest.raises(LocalProtocolError, match="uint8 bytes"):
        frame_body(BLOCK + 1, "int4", body)
    with pytest.raises(LocalProtocolError, match="encode the values"):
        frame_body(BLOCK, "topk2", body)
