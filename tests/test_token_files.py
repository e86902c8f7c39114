"""Pre-tokenized data: uint32 ids above 65,536, .npy files, several files as one stream without a
copy, the vocabulary scan naming the offender, and clear errors for unusable files."""

from __future__ import annotations

import numpy as np
import pytest

from diloco_node.config.manifest import ModelSpec, RunManifest
from diloco_node.config.site_data import SiteData
from diloco_node.learn import data as data_lib
from diloco_node.learn import token_files


def test_uint32_ids_above_65536_train_and_eval_through_the_sampler(tmp_path) -> None:
    ids = np.random.default_rng(0).integers(0, 150_000, 20_000).astype(np.uint32)
    ids.tofile(tmp_path / "train.bin")
    corpus = data_lib.open_site_data(SiteData(source="tokens", paths=(str(tmp_path / "train.bin"),),
                                              token_dtype="uint32"), None)
    assert len(corpus.train) + len(corpus.eval) == 20_000 and corpus.vocab_size == 2**32
    x, y = data_lib.BatchSampler(corpus.train, 4, 32, seed=0).next()
    assert x.dtype == np.int32 and x.max() >= 65_536 and np.array_equal(x[:, 1:], y[:, :-1])
    data_lib.check_tokens(corpus, 150_000)
    with pytest.raises(data_lib.DataError, match=r"train.bin': id \d+ at position \d+, not below model.vocab_size = 100000"):
        data_lib.check_tokens(corpus, 100_000)


def test_several_files_and_npy_form_one_stream_without_copying(tmp_path) -> None:
    np.arange(0, 1000, dtype=np.uint32).tofile(tmp_path / "a-0.bin")
    np.arange(1000, 2500, dtype=np.uint32).tofile(tmp_path / "a-1.bin")
    stream = token_files.open_token_stream([str(tmp_path / "a-*.bin")], "uint32")
    assert len(stream) == 2500
    assert isinstance(stream.parts[0][1], np.memmap)
    assert np.array_equal(np.asarray(stream[990:1010]), np.arange(990, 1010))  # across the boundary
    assert isinstance(stream[10:20], np.memmap) or stream[10:20].base is not None  # one file: a view
    assert stream.where(1200) == (str(tmp_path / "a-1.bin"), 200)
    np.save(tmp_path / "b.npy", np.arange(300, dtype=np.uint16))
    npy = token_files.open_token_stream([str(tmp_path / "b.npy")], "uint16")
    assert np.array_equal(np.asarray(npy[5:8]), [5, 6, 7])


@pytest.mark.parametrize(("setup", "dtype", "message"), [
    (lambda d: (d / "t.bin").write_bytes(b""), "uint16", "the file is empty"),
    (lambda d: (d / "t.bin").write_bytes(b"abc"), "uint16", "3 bytes is not a whole number of uint16 tokens"),
    (lambda d: np.save(d / "t.npy", np.zeros(4, np.uint16)), "uint32", "holds uint16 ids, token_dtype is uint32"),
    (lambda d: np.save(d / "t.npy", np.zeros((2, 2), np.uint32)), "uint32", "expected a flat 1-D array"),
])
def test_unusable_token_files_are_named(tmp_path, setup, dtype, message) -> None:
    setup(tmp_path)
    name = "t.npy" if (tmp_path / "t.npy").exists() else "t.bin"
    with pytest.raises(token_files.TokenFileError) as error:
        token_files.open_token_stream([str(tmp_path / name)], dtype)
    assert message in str(error.value) and name in str(error.value)
    with pytest.raises(token_files.TokenFileError, match="matches no file"):
        token_files.open_token_stream([str(tmp_path / "none-*.bin")], dtype)


def test_a_witness_and_learners_build_the_same_model_from_a_uint32_manifest() -> None:
    from diloco_node.learn import factory

    manifest = RunManifest(model=ModelSpec.of("llama", vocab_size=150_000, seq_len=16, size="1m", d_model=32,
                                              num_layers=1, num_heads=2, num_kv_heads=1, d_ff=32))
    sealed = factory.seal(manifest)
    # A witness opens no data: its model comes from the manifest alone and matches the signature.
    factory.check_signature(sealed)
    assert ("embed/embedding", (150_000, 32), "float32") in sealed.model.tensors


def test_the_sampler_resumes_where_it_stopped_and_refuses_another_samplers_state(tmp_path) -> None:
    tokens = np.arange(5_000, dtype=np.uint32)
    sampler = data_lib.BatchSampler(tokens, 4, 16, seed=3, learner=1)
    for _ in range(5):
        sampler.next()
    saved = sampler.state()
    expected = [sampler.next() for _ in range(3)]
    resumed = data_lib.BatchSampler(tokens, 4, 16, seed=3, learner=1)
    resumed.restore(saved)
    for (x, y), (ex, ey) in zip(([resumed.next() for _ in range(3)]), expected, strict=True):
        assert np.array_equal(x, ex) and np.array_equal(y, ey)
    other = data_lib.BatchSampler(tokens, 4, 16, seed=4, learner=1)
    before = other.state()
    with pytest.raises(data_lib.DataError, match="seed: saved 3, now 4"):
        other.restore(saved)
    assert other.state() == before  # nothing changed
    shorter = data_lib.BatchSampler(tokens[:4_000], 4, 16, seed=3, learner=1)
    with pytest.raises(data_lib.DataError, match="tokens: saved 5000, now 4000"):
        shorter.restore(saved)
