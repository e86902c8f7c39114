"""Streamed contributions (wire 2.1): chunk plans from shapes, the receiver's per-chunk checks, the
encoded delta it keeps, and the limits at the scale of a 7B-parameter model (shapes only)."""

from __future__ import annotations

import math
import os
import tracemalloc

import numpy as np
import pytest

from diloco_node.sync.fragments import plan_fragments, wire_fit_problems
from wire.codecs import CODECS, encode_tensor
from wire.contribution_stream import (
    ContributionAssembler,
    EncodedDelta,
    chunk_bound,
    chunk_problems,
    contribution_chunks,
    max_encoded_bytes,
    open_for,
    plan_chunks,
)
from wire.errors import RemoteProtocolError
from wire.limits import DEFAULT_LIMITS, MAX_CHUNK_ELEMENTS, MAX_LOG_APPEND_BYTES, Limits
from wire.messages import ContributionChunk, ContributionOpen, MessageKind, TensorSpec

STREAM = bytes(range(16))


def _open(shapes, codec="int8", limits=DEFAULT_LIMITS, **overrides) -> ContributionOpen:
    fields = dict(fragment=1, base_index=5, base_round=2, c_steps=8, c_tokens=800, codec=codec, learner_id="site-a",
                  stream=STREAM, limits=limits)
    fields.update(overrides)
    return open_for(shapes, **fields)


def _delta(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"blocks/0/mlp/kernel": rng.normal(size=(64, 50)).astype(np.float32),
            "blocks/0/norm/scale": rng.normal(size=(50,)).astype(np.float32),
            "embed/embedding": rng.normal(size=(30, 8)).astype(np.float32)}


SMALL_CHUNKS = Limits(max_chunk_elements=1024)  # several chunks per tensor, so the ordering rules bite


def _shapes(delta):
    return {name: a.shape for name, a in delta.items()}


def _assemble(delta, limits=SMALL_CHUNKS, codec="int8") -> EncodedDelta:
    head = _open(_shapes(delta), codec, limits)
    assembler = ContributionAssembler(head, _shapes(delta), limits)
    for chunk in contribution_chunks(head, delta):
        assembler.add(chunk)
    return assembler.finish()


def test_a_streamed_contribution_decodes_to_what_one_message_would_and_measures_its_norms():
    delta = _delta()
    got = _assemble(delta)
    assert sorted(got) == sorted(delta)
    for name, values in delta.items():
        decoded = got[name]
        assert decoded.shape == values.shape and decoded.dtype == np.float32
        # int8: within half a block scale of the original
        assert np.max(np.abs(decoded - values)) <= np.max(np.abs(values)) / 127
        # the norm measured on arrival is that of the decoded tensor (one chunk: the same bits)
        flat = decoded.astype(np.float64).ravel()
        assert got.tensor_norms[name] == pytest.approx(math.sqrt(float(np.add.reduce(flat * flat))), rel=1e-12)
    single_chunk = _assemble(delta, limits=DEFAULT_LIMITS)
    flat = single_chunk["embed/embedding"].astype(np.float64).ravel()
    assert single_chunk.tensor_norms["embed/embedding"] == math.sqrt(float(np.add.reduce(flat * flat)))
    assert got.encoded_bytes < sum(a.nbytes for a in delta.values())


def test_chunks_cut_tensors_at_the_chunk_size_in_name_order():
    head = _open(_shapes(_delta()), limits=SMALL_CHUNKS)
    assert [t.name for t in head.tensors] == sorted(_delta())
    chunks = list(contribution_chunks(head, _delta()))
    # 3200 values -> 4 chunks, 50 -> 1, 240 -> 1
    assert [(c.tensor, c.offset) for c in chunks] == [(0, 0), (0, 1024), (0, 2048), (0, 3072), (1, 0), (2, 0)]


def _refusal(head, shapes, chunks=(), limits=SMALL_CHUNKS) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as caught:
        assembler = ContributionAssembler(head, shapes, limits)
        for chunk in chunks:
            assembler.add(chunk)
        assembler.finish()
    return caught.value


def test_the_receiver_refuses_what_the_model_does_not_have_or_the_codec_cannot_produce():
    delta = _delta()
    shapes = _shapes(delta)
    head = _open(shapes, limits=SMALL_CHUNKS)
    chunks = list(contribution_chunks(head, delta))

    wider = _open({**shapes, "blocks/0/norm/scale": (51,)}, limits=SMALL_CHUNKS)
    error = _refusal(wider, shapes)
    assert error.status_hint == 400 and "blocks/0/norm/scale: the open declares shape (51,), the model's is (50,)" in str(error)

    stranger = _open({**shapes, "blocks/9/mlp/kernel": (2, 2)}, limits=SMALL_CHUNKS)
    assert "not in fragment 1: blocks/9/mlp/kernel" in str(_refusal(stranger, shapes))
    fewer = _open({n: s for n, s in shapes.items() if n != "embed/embedding"}, limits=SMALL_CHUNKS)
    assert "missing embed/embedding" in str(_refusal(fewer, shapes))

    bloated = ContributionChunk(STREAM, 0, 0, chunks[0].payload + b"\0" * chunk_bound(CODECS["int8"], 1000))
    error = _refusal(head, shapes, [bloated])
    assert error.status_hint == 413 and "more than int8 can encode them into" in str(error)

    error = _refusal(head, shapes, [chunks[1]])
    assert "expected tensor 0 (blocks/0/mlp/kernel) at offset 0, got tensor 0 at offset 1024" in str(error)
    other = ContributionChunk(bytes(16), 0, 0, chunks[0].payload)
    assert "another stream" in str(_refusal(head, shapes, [other]))
    fp32 = ContributionChunk(STREAM, 0, 0, encode_tensor(delta["blocks/0/mlp/kernel"].ravel()[:1000], "fp32",
                                                        zstd_level=None)[:chunk_bound(CODECS["int8"], 1000)])
    assert "not encoded with int8" in str(_refusal(head, shapes, [fp32]))
    short = ContributionChunk(STREAM, 0, 0, encode_tensor(delta["blocks/0/mlp/kernel"].ravel()[:1023], "int8"))
    assert "holds shape (1023,), expected (1024,)" in str(_refusal(head, shapes, [short]))
    error = _refusal(head, shapes, chunks[:-1])
    assert "the stream ended with 1 chunk(s) missing (tensor 2 of 3, embed/embedding)" in str(error)
    assert "a chunk after the last one" in str(_refusal(head, shapes, chunks + chunks[-1:]))

    huge = ContributionOpen(1, 5, 2, 8, 800, "int8", "site-a", STREAM, MAX_CHUNK_ELEMENTS + 1,
                            tuple(TensorSpec(n, s) for n, s in sorted(shapes.items())))
    error = _refusal(huge, shapes, limits=DEFAULT_LIMITS)
    assert error.status_hint == 413 and "over the limit of 4,194,304 values per chunk" in str(error)


def test_a_failed_assembler_stays_failed():
    delta = _delta()
    head = _open(_shapes(delta), limits=SMALL_CHUNKS)
    chunks = list(contribution_chunks(head, delta))
    assembler = ContributionAssembler(head, _shapes(delta), SMALL_CHUNKS)
    with pytest.raises(RemoteProtocolError):
        assembler.add(chunks[1])
    with pytest.raises(RemoteProtocolError, match="already failed"):
        assembler.add(chunks[0])
    with pytest.raises(RemoteProtocolError, match="already failed"):
        assembler.finish()


# ------------------------------------------------------------------ a 7B model, shapes only


def llama_shapes(layers=32, d_model=4096, d_ff=11008, vocab=32000) -> dict[str, tuple[int, ...]]:
    """A Llama-style decoder's parameters (LLaMA-7B sizes by default), names only: nothing allocated."""
    shapes: dict[str, tuple[int, ...]] = {"embed/embedding": (vocab, d_model), "final_norm/scale": (d_model,),
                                          "unembed/kernel": (d_model, vocab)}
    for i in range(layers):
        for part in ("q", "k", "v", "o"):
            shapes[f"blocks/{i}/attn/{part}/kernel"] = (d_model, d_model)
        shapes[f"blocks/{i}/mlp/gate/kernel"] = (d_model, d_ff)
        shapes[f"blocks/{i}/mlp/up/kernel"] = (d_model, d_ff)
        shapes[f"blocks/{i}/mlp/down/kernel"] = (d_ff, d_model)
        shapes[f"blocks/{i}/attn_norm/scale"] = (d_model,)
        shapes[f"blocks/{i}/mlp_norm/scale"] = (d_model,)
    return shapes


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_no_limit_refuses_any_tensor_of_a_7b_model_at_24_fragments(codec):
    shapes = llama_shapes()
    total = sum(math.prod(s) for s in shapes.values())
    assert 6.7e9 < total < 6.8e9
    plan = plan_fragments(shapes, 24, 48, 1)
    tracemalloc.start()
    try:
        assert chunk_problems(shapes, codec) == []
        # the start-up check: contributions of any codec, commits of int4 within one log-append frame
        # (commits of any codec are streamed past it: tests/test_wire_payload_stream.py)
        assert wire_fit_problems(plan, shapes, codec, "int4", max_log_append_bytes=MAX_LOG_APPEND_BYTES) == []
        byte_limit = DEFAULT_LIMITS.max_payload(MessageKind.CONTRIBUTION_CHUNK)
        for fragment in plan.fragments:
            expected = {name: shapes[name] for name in fragment.names}
            head = _open(expected, codec, fragment=fragment.index)
            assembler = ContributionAssembler(head, expected)  # the receiver takes the declaration
            assert assembler.chunks_left == sum(p.chunks for p in plan_chunks(expected, codec))
            assert assembler.max_remaining_bytes == max_encoded_bytes(head) >= fragment.num_elements * 0.5
            for chunk_plan in plan_chunks(expected, codec):
                for _, values in chunk_plan.chunk_sizes():
                    assert values <= MAX_CHUNK_ELEMENTS and chunk_bound(CODECS[codec], values) <= byte_limit
            # ... and what is wrong is refused from the declaration alone
            name = max(expected, key=lambda n: math.prod(expected[n]))
            grown = (expected[name][0] + 1,) + expected[name][1:]
            with pytest.raises(RemoteProtocolError, match="the model's is"):
                ContributionAssembler(_open({**expected, name: grown}, codec, fragment=fragment.index), expected)
            with pytest.raises(RemoteProtocolError, match="not in fragment"):
                ContributionAssembler(_open({**expected, "blocks/99/mlp/up/kernel": (4096, 11008)}, codec,
                                            fragment=fragment.index), expected)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20  # shapes and plans only: no tensor was allocated


def test_a_chunk_of_a_7b_tensor_with_more_bytes_than_the_codec_allows_is_refused_before_decoding():
    shapes = llama_shapes()
    plan = plan_fragments(shapes, 24, 48, 1)
    fragment = next(f for f in plan.fragments if any(n.endswith("norm/scale") for n in f.names))
    expected = {name: shapes[name] for name in fragment.names}
    head = _open(expected, "int4", fragment=fragment.index)
    first = head.tensors[0]
    values = min(head.chunk_elements, first.num_elements)
    too_many_bytes = ContributionChunk(STREAM, 0, 0, b"\0" * (chunk_bound(CODECS["int4"], values) + 1))
    assembler = ContributionAssembler(head, expected)
    with pytest.raises(RemoteProtocolError, match="more than int4 can encode them into") as caught:
        assembler.add(too_many_bytes)
    assert caught.value.status_hint == 413


def test_the_chunk_size_keeps_every_codec_under_the_chunk_byte_limit():
    limit = DEFAULT_LIMITS.max_payload(MessageKind.CONTRIBUTION_CHUNK)
    for name, codec in CODECS.items():
        per_chunk = plan_chunks({"w": (1 << 30,)}, name)[0].chunk_elements
        assert chunk_bound(codec, per_chunk) <= limit < chunk_bound(codec, per_chunk + 1) or per_chunk == MAX_CHUNK_ELEMENTS


def test_frames_of_a_streamed_contribution_round_trip():
    from wire.auth import AuthContext, FrameVerifier, derive_frame_key
    from wire.frames import decode_frame, encode_frame

    key = derive_frame_key(os.urandom(32))
    auth = AuthContext(run_id="run", sender="site-a", key=key)
    verifier = FrameVerifier("run", key, DEFAULT_LIMITS, node_id="site-b")
    delta = _delta()
    head = _open(_shapes(delta), limits=SMALL_CHUNKS)
    for n, message in enumerate([head, *contribution_chunks(head, delta)]):
        data = encode_frame(message, auth, now_unix=1000.0, nonce=n.to_bytes(16, "big"), to="site-b")
        assert decode_frame(data, verifier, now_unix=1000.0).message == message
