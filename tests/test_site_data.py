"""A site's own data (`[node.data]`): the config table, text streamed and tokenized with a local
tokenizer.json (cached for restarts), and what the run fixes (the tokenizer's digest, the
vocabulary) checked with clear errors."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_node.config.manifest import DataAgreement, RunManifest
from diloco_node.config.settings import ConfigError, load_config
from diloco_node.config.site_data import SiteData
from diloco_node.learn import data as data_lib

from conftest import TOKENIZER_WORDS

WORDS = TOKENIZER_WORDS  # the word tokenizer's vocabulary: "[UNK]" and these


# --- the [node.data] table --------------------------------------------------------------------


def test_node_data_from_a_file_with_paths_relative_to_it(tmp_path) -> None:
    config_file = tmp_path / "conf" / "site.toml"
    config_file.parent.mkdir()
    config_file.write_text('[node.data]\nsource = "tokens"\npaths = ["shards/*.bin", "/abs/x.npy"]\n'
                           'token_dtype = "uint32"\neval_fraction = 0.1\n')
    config = load_config(config_file, {}, {})
    data = config.node.data
    assert data == SiteData("tokens", (str(tmp_path / "conf" / "shards/*.bin"), "/abs/x.npy"), "", "uint32", 0.1)
    assert config.sources["data.paths"] == f"file:{config_file}"
    # Not part of the run manifest: sites differ in it.
    assert config.run.to_dict()["data"] == {"tokenizer_sha256": ""}


def test_node_data_from_environment_and_flags(tmp_path) -> None:
    environ = {"DILOCO_DATA_SOURCE": "text", "DILOCO_DATA_PATHS": "a.txt, b/*.txt"}
    config = load_config(None, environ, {"data.tokenizer": "tok.json"})
    cwd = Path.cwd()
    assert config.node.data.paths == (str(cwd / "a.txt"), str(cwd / "b/*.txt"))
    assert config.node.data.tokenizer == str(cwd / "tok.json")
    assert config.sources["data.source"] == "env:DILOCO_DATA_SOURCE"


@pytest.mark.parametrize(("text", "message"), [
    ('[node.data]\nsource = "tokens"\npaths = ["x.bin"]\n', "data.token_dtype = '': source 'tokens' needs the id type"),
    ('[node.data]\nsource = "text"\n', "data.paths: source 'text' needs at least one file"),
    ('[node.data]\nsource = "stdlib"\ntokenizer = "t.json"\n', "data.tokenizer: source 'stdlib' is read as bytes"),
    ('[node.data]\nsource = "csv"\n', "data.source = 'csv': must be one of stdlib, text, tokens"),
    ('[node.data]\npath = ["x"]\n', "node.data.path (file:"),
    ('[node.data]\neval_fraction = 0.7\n', "data.eval_fraction = 0.7: must be a number in (0, 0.5)"),
    ('[run.data]\ntoken_file = "x.bin"\n', "where a site reads its data is a site setting now: move it to [node.data]"),
    ('[run.data]\ntokenizer_sha256 = "abc"\n', "data.tokenizer_sha256 = 'abc': must be the 64 lowercase hex digits"),
])
def test_bad_node_data_is_a_clear_error(tmp_path, text, message) -> None:
    path = tmp_path / "site.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path, {}, {})
    assert message in str(error.value)


def test_a_stored_manifest_from_before_node_data_says_where_its_keys_went() -> None:
    with pytest.raises(ConfigError, match="move source, token_file to \\[node.data\\]"):
        RunManifest.from_dict({"data": {"source": "tokens", "token_file": "x.bin"}})


# --- text, streamed ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=400),
       chunk=st.integers(4, 64))
def test_text_pieces_join_to_the_file_and_each_decodes_alone(tmp_path_factory, text, chunk) -> None:
    path = tmp_path_factory.mktemp("t") / "f.txt"
    path.write_bytes(text.encode())
    pieces = list(data_lib.iter_text_chunks(path, chunk))
    assert b"".join(pieces) == text.encode()
    assert all(0 < len(piece) <= chunk for piece in pieces)
    for piece in pieces:
        piece.decode("utf-8")  # never half a character


def test_tokenized_text_equals_tokenizing_the_whole_file(tmp_path, word_tokenizer, word_text) -> None:
    tokenizer_path = word_tokenizer(tmp_path / "tokenizer.json")
    text = word_text(tmp_path / "corpus.txt", 3000)
    spec = SiteData(source="text", paths=(str(tmp_path / "corpus.txt"),), tokenizer=str(tokenizer_path))
    corpus = data_lib.open_site_data(spec, None, chunk_bytes=97)  # many pieces, cut at line ends and spaces
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(tokenizer_path)).encode(text, add_special_tokens=False).ids
    ids = np.concatenate([np.asarray(corpus.train), np.asarray(corpus.eval)])
    assert ids.dtype == np.uint32 and ids.tolist() == whole
    assert corpus.tokenizer_digest == hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
    assert corpus.vocab_size == corpus.tokenizer_vocab_size == len(WORDS) + 1
    # Batches come out of it like any other source.
    x, y = data_lib.BatchSampler(corpus.train, 2, 8, seed=0).next()
    assert x.max() <= len(WORDS) and np.array_equal(x[:, 1:], y[:, :-1])


def test_text_is_read_in_bounded_pieces_not_whole(tmp_path) -> None:
    path = tmp_path / "big.txt"
    block = ("the quick brown fox jumps over the lazy dog " * 24 + "\n").encode()
    with open(path, "wb") as out:
        for _ in range((16 << 20) // len(block)):
            out.write(block)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        corpus = data_lib.open_site_data(SiteData(source="text", paths=(str(path),)), tmp_path / "cache",
                                         chunk_bytes=1 << 18)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(corpus.train) + len(corpus.eval) == size
    # What is held: one group of pieces handed to the encoder at once, and their ids.
    bound = 3 * data_lib.ENCODE_GROUP_CHUNKS * (1 << 18)
    assert peak < min(bound, size / 2), f"peak {peak} bytes while reading a {size}-byte file"


def test_encoded_text_is_cached_and_an_edited_file_is_encoded_again(tmp_path, monkeypatch, word_tokenizer,
                                                                     word_text) -> None:
    tokenizer_path = word_tokenizer(tmp_path / "tokenizer.json")
    word_text(tmp_path / "a.txt", 600)
    spec = SiteData(source="text", paths=(str(tmp_path / "a.txt"),), tokenizer=str(tokenizer_path))
    cache = tmp_path / "cache"
    first = data_lib.open_site_data(spec, cache)
    real_write = data_lib._write_text_tokens
    calls: list[int] = []

    def counting(*args, **kwargs):
        calls.append(1)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(data_lib, "_write_text_tokens", counting)
    again = data_lib.open_site_data(spec, cache)
    assert calls == [] and np.array_equal(np.asarray(again.train), np.asarray(first.train))
    word_text(tmp_path / "a.txt", 900, seed=1)
    os.utime(tmp_path / "a.txt", ns=(1, 1))  # a new mtime even on a coarse clock
    edited = data_lib.open_site_data(spec, cache)
    assert calls == [1] and len(edited.train) + len(edited.eval) > len(first.train) + len(first.eval)


def test_text_that_is_not_utf8_is_named_with_its_offset(tmp_path, word_tokenizer) -> None:
    tokenizer_path = word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "latin1.txt").write_bytes(b"alpha beta caf\xe9 gamma\n" * 10)
    spec = SiteData(source="text", paths=(str(tmp_path / "latin1.txt"),), tokenizer=str(tokenizer_path))
    with pytest.raises(data_lib.DataError, match=r"latin1.txt': not UTF-8 at byte 14"):
        data_lib.open_site_data(spec, None)


def test_a_file_that_is_not_a_tokenizer_is_named(tmp_path, word_text) -> None:
    (tmp_path / "tok.json").write_text("{not json")
    word_text(tmp_path / "a.txt", 100)
    spec = SiteData(source="text", paths=(str(tmp_path / "a.txt"),), tokenizer=str(tmp_path / "tok.json"))
    with pytest.raises(data_lib.DataError, match="tok.json'.*not a tokenizer.json"):
        data_lib.open_site_data(spec, None)


# --- what the run fixes: the tokenizer and the vocabulary -----------------------------------------


def test_the_tokenizer_is_sealed_by_the_founder_and_checked_at_every_site(tmp_path, word_tokenizer) -> None:
    ours = word_tokenizer(tmp_path / "ours.json")
    theirs = word_tokenizer(tmp_path / "theirs.json", WORDS[:10])
    digest = hashlib.sha256(ours.read_bytes()).hexdigest()
    text_site = SiteData(source="text", paths=("x.txt",), tokenizer=str(ours))
    sealed = data_lib.seal_tokenizer(RunManifest(), text_site)
    assert sealed.data == DataAgreement(digest)
    assert data_lib.check_tokenizer(digest, text_site) is None
    with pytest.raises(data_lib.DataError) as error:
        data_lib.check_tokenizer(digest, SiteData(source="text", paths=("x.txt",), tokenizer=str(theirs)))
    assert f"is not the run's tokenizer (sha256 {digest})" in str(error.value) and "theirs.json" in str(error.value)
    # A site reading bytes in a tokenized run would train on other ids.
    with pytest.raises(data_lib.DataError, match="reads the standard library's .py files as bytes"):
        data_lib.check_tokenizer(digest, SiteData())
    # Token files that name no tokenizer cannot be checked: a warning, not a refusal.
    warning = data_lib.check_tokenizer(digest, SiteData(source="tokens", paths=("x.bin",), token_dtype="uint32"))
    assert warning is not None and "not checked" in warning
    # A tokenized site in a run that names no tokenizer is refused, and told the digest to state.
    with pytest.raises(data_lib.DataError, match=f'run.data.tokenizer_sha256 = "{digest}"'):
        data_lib.check_tokenizer("", text_site)
    with pytest.raises(data_lib.DataError, match="must name the same tokenizer.json"):
        data_lib.seal_tokenizer(RunManifest(data=DataAgreement("0" * 64)), text_site)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path, word_tokenizer, word_text) -> None:
    tokenizer_path = word_tokenizer(tmp_path / "tokenizer.json")
    word_text(tmp_path / "a.txt", 240)
    corpus = data_lib.open_site_data(SiteData(source="text", paths=(str(tmp_path / "a.txt"),),
                                              tokenizer=str(tokenizer_path)), None)
    data_lib.check_tokens(corpus, len(WORDS) + 1)
    with pytest.raises(data_lib.DataError, match=r"tokenizer's vocabulary \(25 ids\) is larger than model.vocab_size = 20"):
        data_lib.check_tokens(corpus, 20)
