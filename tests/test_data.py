"""Data sources, the train/eval split, shards, batches and the errors for bad sources."""

import numpy as np
import pytest

from diloco_node.config.site_data import SiteData
from diloco_node.learn import data as data_lib


def test_stdlib_split_is_deterministic_disjoint_and_covers_every_file():
    root_files = data_lib.stdlib_files()
    names = [str(p) for p in root_files]
    assert len(names) > 100
    train, evaluation = data_lib.split_paths(names, 0.05, seed=0)
    assert set(train).isdisjoint(evaluation)
    assert sorted(train + evaluation) == sorted(names)
    assert 0 < len(evaluation) < 0.15 * len(names)
    assert data_lib.split_paths(names, 0.05, seed=0) == (train, evaluation)
    assert data_lib.split_paths(names, 0.05, seed=1) != (train, evaluation)


def test_stdlib_corpus_loads_with_disjoint_eval_files():
    corpus = data_lib.open_site_data(SiteData(), None)
    assert corpus.train.dtype == np.uint8 and corpus.train.size > 1_000_000 and corpus.eval.size > 10_000
    assert set(corpus.train_files).isdisjoint(corpus.eval_files)
    assert all(name.endswith(".py") and "site-packages" not in name for name in corpus.eval_files)


def test_shards_are_disjoint_contiguous_and_cover_the_stream():
    bounds = data_lib.shard_bounds(1003, 4)
    assert bounds[0][0] == 0 and bounds[-1][1] == 1003
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


def test_batches_are_reproducible_shifted_windows_of_the_shard():
    tokens = np.arange(1000, dtype=np.uint16) % 251
    a = data_lib.BatchSampler(tokens, 4, 8, seed=3, learner=1)
    b = data_lib.BatchSampler(tokens, 4, 8, seed=3, learner=1)
    c = data_lib.BatchSampler(tokens, 4, 8, seed=3, learner=2)
    xa, ya = a.next()
    xb, yb = b.next()
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(xa[:, 1:], ya[:, :-1])
    assert not np.array_equal(xa, c.next()[0])
    assert xa.shape == (4, 8) and xa.dtype == np.int32


def test_text_files_and_globs(tmp_path):
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_bytes(bytes([65 + i]) * 500)
    corpus = data_lib.open_site_data(SiteData(source="text", paths=(str(tmp_path / "*.txt"),)), None)
    assert "split by position" in corpus.description  # too few files to split by path
    assert corpus.train.size + corpus.eval.size == 1500
    assert bytes(corpus.train[:3]) == b"AAA" and bytes(corpus.eval[len(corpus.eval) - 3:]) == b"CCC"
    single = data_lib.open_site_data(SiteData(source="text", paths=(str(tmp_path / "part1.txt"),)), None)
    assert single.train.size + single.eval.size == 500


def test_token_file_is_memory_mapped_and_split_by_position(tmp_path):
    tokens = (np.arange(10_000) % 60_000).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    corpus = data_lib.open_site_data(SiteData(source="tokens", paths=(str(path),), token_dtype="uint16",
                                              eval_fraction=0.1), None)
    # Memory-mapped, not read: the splits are views of the file's map (learn/token_files.py).
    assert all(isinstance(array, np.memmap) for _, array in corpus.train.parts + corpus.eval.parts)
    assert corpus.vocab_size == 65536
    np.testing.assert_array_equal(np.concatenate([np.asarray(corpus.train), np.asarray(corpus.eval)]), tokens)
    assert corpus.eval.size == 1000


@pytest.mark.parametrize("make, match", [
    (lambda d: SiteData(source="text", paths=(str(d / "missing.txt"),)), "missing.txt.*no such file"),
    (lambda d: SiteData(source="text", paths=(str(d / "nothing*.txt"),)), "nothing\\*.txt.*matches no files"),
    (lambda d: SiteData(source="text", paths=(str(d / "empty.txt"),)), "empty.txt.*empty"),
    (lambda d: SiteData(source="tokens", paths=(str(d / "missing.bin"),), token_dtype="uint8"), "missing.bin.*no such file"),
    (lambda d: SiteData(source="tokens", paths=(str(d / "empty.txt"),), token_dtype="uint8"), "empty.txt.*empty"),
    (lambda d: SiteData(source="tokens", paths=(str(d / "odd.bin"),), token_dtype="uint16"), "odd.bin.*whole number"),
])
def test_bad_sources_are_clear_errors_naming_the_path(tmp_path, make, match):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(data_lib.DataError, match=match):
        data_lib.open_site_data(make(tmp_path), None)


def test_unreadable_file_is_a_clear_error_naming_it(tmp_path, monkeypatch):
    path = tmp_path / "secret.txt"
    path.write_bytes(b"x" * 100)
    real_open = open

    def refuse(file, *args, **kwargs):
        if str(file).endswith("secret.txt"):
            raise PermissionError(13, "Permission denied")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(data_lib, "open", refuse, raising=False)  # the module's own open(), not the test's
    with pytest.raises(data_lib.DataError, match="secret.txt.*cannot read it.*Permission denied"):
        data_lib.open_site_data(SiteData(source="text", paths=(str(path),)), None)

def test_eval_batches_are_fixed():
    tokens = np.arange(5000, dtype=np.uint8)
    x1, y1 = data_lib.eval_batches(tokens, 3, 4, 16)
    x2, _ = data_lib.eval_batches(tokens, 3, 4, 16)
    assert x1.shape == (3, 4, 16)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(x1[..., 1:], y1[..., :-1])
