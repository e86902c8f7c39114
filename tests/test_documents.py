"""Documents in (jsonl, parquet, arrow, a Hugging Face `save_to_disk` directory), each ended with
the end-of-document id; malformed records named by file and line/row; the cache; mixtures of
sources sampled by weight and resumable (issue 28, items 1, 2 and 4)."""

from __future__ import annotations

import gzip
import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from diloco_node.config.manifest import RunManifest
from diloco_node.config.settings import ConfigError, load_config
from diloco_node.config.site_data import SiteData
from diloco_node.learn import data as data_lib
from diloco_node.learn import documents as documents_lib

from conftest import TOKENIZER_WORDS

pa = pytest.importorskip("pyarrow")
import pyarrow.ipc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

EOS = "</s>"


def make_tokenizer(path: Path, *, eos: str | None = EOS, special: bool = True) -> Path:
    """A word-level tokenizer.json: "[UNK]" is 0, `eos` (when given) 1, the words after."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = ["[UNK]"] + ([eos] if eos else []) + list(TOKENIZER_WORDS)
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos and special:
        tokenizer.add_special_tokens([eos])
    tokenizer.save(str(path))
    return path


def make_documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(TOKENIZER_WORDS, int(rng.integers(3, 40)))) for _ in range(count)]


def expected_ids(texts: list[str], eos_id: int = 1) -> list[int]:
    ids: list[int] = []
    for text in texts:
        if text:
            ids += [TOKENIZER_WORDS.index(word) + 2 for word in text.split()] + [eos_id]
    return ids


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt") as out:
        for i, text in enumerate(texts):
            out.write(json.dumps({"id": i, field: text}) + "\n")
    return path


def write_parquet(path: Path, texts: list[str], row_group: int = 37) -> Path:
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=row_group)
    return path


def write_hf_dataset(directory: Path, texts: list[str], shards: int = 2) -> Path:
    """A directory laid out as `datasets.Dataset.save_to_disk` writes it: Arrow *stream* files
    data-0000i-of-0000N.arrow, listed in state.json, beside dataset_info.json."""
    directory.mkdir()
    names = []
    for shard, part in enumerate(np.array_split(np.arange(len(texts)), shards)):
        name = f"data-{shard:05d}-of-{shards:05d}.arrow"
        batch = pa.record_batch({"text": [texts[i] for i in part], "id": [int(i) for i in part]})
        with pa.ipc.new_stream(str(directory / name), batch.schema) as writer:
            for start in range(0, len(part), 10):  # several record batches, as the datasets writer does
                writer.write_batch(batch.slice(start, 10))
        names.append(name)
    (directory / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                      "_fingerprint": "0", "_format_type": None}))
    return directory


def all_ids(corpus: data_lib.Corpus) -> list[int]:
    return np.asarray(corpus.train).tolist() + np.asarray(corpus.eval).tolist()


# --- documents in ------------------------------------------------------------------------------


def test_jsonl_documents_are_tokenized_each_ended_with_eos_and_counted(tmp_path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    texts = make_documents(300) + [""]  # an empty text is no document
    write_jsonl(tmp_path / "a.jsonl", texts[:200])
    write_jsonl(tmp_path / "b.jsonl.gz", texts[200:])
    spec = SiteData("jsonl", (str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz")), str(tokenizer))
    corpus = data_lib.open_site_data(spec, tmp_path / "cache")
    assert all_ids(corpus) == expected_ids(texts)
    assert corpus.documents == 300 and corpus.eos_id == 1
    assert "300 documents" in corpus.description and f"{len(expected_ids(texts)):,} tokens" in corpus.description
    # The eval split begins at a document, and the counts add up.
    assert np.asarray(corpus.train)[-1] == 1
    assert corpus.train_documents == int(np.count_nonzero(np.asarray(corpus.train) == 1)) < 300
    x, y = data_lib.BatchSampler(corpus.train, 4, 16, seed=0).next()
    assert np.array_equal(x[:, 1:], y[:, :-1])


def test_parquet_arrow_and_a_saved_hf_dataset_read_the_same_documents(tmp_path) -> None:
    tokenizer = str(make_tokenizer(tmp_path / "tokenizer.json"))
    texts = make_documents(250, seed=3)
    write_parquet(tmp_path / "d.parquet", texts)
    table = pa.table({"text": texts})
    with pa.ipc.new_file(str(tmp_path / "d.arrow"), table.schema) as writer:  # the IPC *file* format
        writer.write_table(table, max_chunksize=64)
    hf = write_hf_dataset(tmp_path / "saved", texts, shards=2)
    (hf / "cache-0123.arrow").write_bytes(b"not listed in state.json: not read")
    for source, path in (("parquet", "d.parquet"), ("arrow", "d.arrow"), ("arrow", "saved")):
        corpus = data_lib.open_site_data(SiteData(source, (str(tmp_path / path),), tokenizer), None)
        assert all_ids(corpus) == expected_ids(texts), (source, path)
        assert corpus.documents == 250


def test_directories_and_globs_read_only_document_files(tmp_path) -> None:
    tokenizer = str(make_tokenizer(tmp_path / "tokenizer.json"))
    texts = make_documents(90, seed=5)
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", texts[:30])
    write_parquet(data / "b.parquet", texts[30:60])
    write_jsonl(data / "c.jsonl", texts[60:])
    (data / "README.md").write_bytes(b"\xff\xfe not a document: read as bytes it would be garbage")
    (data / "notes.json").write_text("{}")
    mixed = data_lib.open_site_data(SiteData("documents", (str(data),), tokenizer), None)
    assert all_ids(mixed) == expected_ids(texts)  # sorted: a.jsonl, b.parquet, c.jsonl
    only_jsonl = data_lib.open_site_data(SiteData("jsonl", (str(data),), tokenizer), None)
    assert all_ids(only_jsonl) == expected_ids(texts[:30] + texts[60:])
    globbed = data_lib.open_site_data(SiteData("documents", (str(data / "*"),), tokenizer), None)
    assert all_ids(globbed) == expected_ids(texts)
    with pytest.raises(data_lib.DataError, match=r"'.*\*.txt': the glob matches no .parquet file"):
        data_lib.open_site_data(SiteData("parquet", (str(data / "*.txt"),), tokenizer), None)
    with pytest.raises(data_lib.DataError, match="README.md': its extension names no document format"):
        data_lib.open_site_data(SiteData("documents", (str(data / "README.md"),), tokenizer), None)


def test_the_text_field_names_the_field_or_column(tmp_path) -> None:
    tokenizer = str(make_tokenizer(tmp_path / "tokenizer.json"))
    texts = make_documents(40)
    write_jsonl(tmp_path / "a.jsonl", texts, field="content")
    spec = SiteData("jsonl", (str(tmp_path / "a.jsonl"),), tokenizer, text_field="content")
    assert all_ids(data_lib.open_site_data(spec, None)) == expected_ids(texts)
    with pytest.raises(data_lib.DataError, match=r"a.jsonl' line 1: no 'text' field \(fields: id, content\)"):
        data_lib.open_site_data(SiteData("jsonl", (str(tmp_path / "a.jsonl"),), tokenizer), None)
    write_parquet(tmp_path / "b.parquet", texts)
    with pytest.raises(data_lib.DataError, match=r"b.parquet': no column 'content' \(columns: id, text\)"):
        data_lib.open_site_data(SiteData("parquet", (str(tmp_path / "b.parquet"),), tokenizer, text_field="content"), None)


@pytest.mark.parametrize(("lines", "message"), [
    (['{"text": "alpha"}', '{"text": "beta"', '{"text": "gamma"}'], r"bad.jsonl' line 2: not a JSON object"),
    (['{"text": "alpha"}', '', '{"txt": "beta"}'], r"bad.jsonl' line 3: no 'text' field"),
    (['{"text": 12}'], r"bad.jsonl' line 1: field 'text' is int, not a string"),
    (['["alpha"]'], r"bad.jsonl' line 1: no 'text' field \(list\)"),
])
def test_a_malformed_jsonl_record_is_named_by_file_and_line(tmp_path, lines, message) -> None:
    tokenizer = str(make_tokenizer(tmp_path / "tokenizer.json"))
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(data_lib.DataError, match=message):
        data_lib.open_site_data(SiteData("jsonl", (str(tmp_path / "bad.jsonl"),), tokenizer), None)


def test_malformed_parquet_and_arrow_are_named_by_file_and_row_and_the_site_refuses_to_start(tmp_path) -> None:
    from diloco_node.daemon.site_model import open_learner_data

    tokenizer = str(make_tokenizer(tmp_path / "tokenizer.json"))
    pq.write_table(pa.table({"text": ["alpha", "beta", None, "gamma"]}), tmp_path / "nulls.parquet", row_group_size=2)
    with pytest.raises(data_lib.DataError, match=r"nulls.parquet' row 2: column 'text' is null"):
        data_lib.open_site_data(SiteData("parquet", (str(tmp_path / "nulls.parquet"),), tokenizer), None)
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    with pytest.raises(data_lib.DataError, match=r"ints.parquet': column 'text' holds int64, not strings"):
        data_lib.open_site_data(SiteData("parquet", (str(tmp_path / "ints.parquet"),), tokenizer), None)
    (tmp_path / "junk.arrow").write_bytes(b"this is no arrow data")
    with pytest.raises(data_lib.DataError, match="junk.arrow': not an Arrow IPC file or stream"):
        data_lib.open_site_data(SiteData("arrow", (str(tmp_path / "junk.arrow"),), tokenizer), None)
    (tmp_path / "bad.jsonl").write_text('{"text": "alpha"}\n{oops}\n')
    import hashlib

    sealed = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    manifest = RunManifest.from_dict({"model": {"vocab_size": 64, "seq_len": 8}, "data": {"tokenizer_sha256": sealed}})
    with pytest.raises(ConfigError, match="bad.jsonl' line 2"):
        open_learner_data(manifest, SiteData("jsonl", (str(tmp_path / "bad.jsonl"),), tokenizer), None)


def test_documents_need_a_tokenizer(tmp_path) -> None:
    with pytest.raises(ConfigError, match="data.tokenizer: source 'jsonl' needs a tokenizer.json"):
        SiteData("jsonl", (str(tmp_path / "a.jsonl"),))


def test_texts_are_read_in_bounded_batches(tmp_path) -> None:
    texts = make_documents(3000, seed=7)
    write_jsonl(tmp_path / "a.jsonl", texts)
    write_parquet(tmp_path / "a.parquet", texts, row_group=1000)
    for fmt in ("jsonl", "parquet"):
        batches = list(documents_lib.iter_texts(tmp_path / f"a.{fmt}", fmt, "text", batch_documents=100,
                                                batch_bytes=4096))
        assert [t for _, batch in batches for t in batch] == texts
        assert max(len(batch) for _, batch in batches) <= 100
        assert max(sum(map(len, batch)) for _, batch in batches) < 2 * 4096  # about the limit
    # The first record's number: jsonl lines count from 1, rows from 0.
    assert [first for first, _ in documents_lib.iter_texts(tmp_path / "a.jsonl", "jsonl", "text",
                                                           batch_documents=1000)] == [1, 1001, 2001]


def test_reading_a_large_jsonl_holds_a_few_batches_not_the_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(documents_lib, "BATCH_TEXT_BYTES", 1 << 18)
    tokenizer = str(make_tokenizer(tmp_path / "tokenizer.json"))
    path = tmp_path / "big.jsonl"
    line = (json.dumps({"text": " ".join(TOKENIZER_WORDS * 20)}) + "\n").encode()
    with open(path, "wb") as out:
        out.write(line * ((12 << 20) // len(line)))
    tracemalloc.start()
    try:
        corpus = data_lib.open_site_data(SiteData("jsonl", (str(path),), tokenizer), tmp_path / "cache")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert corpus.documents == (12 << 20) // len(line)
    # Held at once: the batches read ahead, the one encoded, and its ids (a Python list, then an array).
    bound = (documents_lib.READ_AHEAD_BATCHES + 2) * (1 << 18) * 4
    assert peak < min(bound, path.stat().st_size), f"peak {peak} bytes reading a {path.stat().st_size}-byte file"


def test_documents_are_cached_and_a_changed_file_or_option_tokenizes_again(tmp_path, monkeypatch) -> None:
    tokenizer = str(make_tokenizer(tmp_path / "tokenizer.json"))
    write_jsonl(tmp_path / "a.jsonl", make_documents(100))
    spec = SiteData("jsonl", (str(tmp_path / "a.jsonl"),), tokenizer)
    cache = tmp_path / "cache"
    first = data_lib.open_site_data(spec, cache)
    real = documents_lib.write_document_ids
    calls: list[int] = []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(documents_lib, "write_document_ids", counting)
    again = data_lib.open_site_data(spec, cache)
    assert calls == [] and all_ids(again) == all_ids(first) and again.documents == 100
    assert "100 documents" in again.description
    data_lib.open_site_data(SiteData("jsonl", spec.paths, tokenizer, eos_token="omega"), cache)
    assert calls == [1]  # another end-of-document id: other ids
    write_jsonl(tmp_path / "a.jsonl", make_documents(120, seed=9))
    os.utime(tmp_path / "a.jsonl", ns=(1, 1))
    edited = data_lib.open_site_data(spec, cache)
    assert calls == [1, 1] and edited.documents == 120


# --- the end-of-document token -----------------------------------------------------------------


def test_the_end_of_document_token_is_found_or_named(tmp_path) -> None:
    from tokenizers import Tokenizer, processors

    write_jsonl(tmp_path / "a.jsonl", ["alpha beta", "gamma"])
    paths = (str(tmp_path / "a.jsonl"),)

    def ids(tokenizer: Path, **keys) -> list[int]:
        return all_ids(data_lib.open_site_data(SiteData("jsonl", paths, str(tokenizer), **keys), None))

    # Declared as a special token of a well-known name.
    assert ids(make_tokenizer(tmp_path / "t1.json")) == [2, 3, 1, 4, 1]
    # Declared by tokenizer_config.json beside it (Hugging Face's own place for it), over the names.
    beside = tmp_path / "hf"
    beside.mkdir()
    make_tokenizer(beside / "tokenizer.json")
    (beside / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "omega"}}))
    omega = TOKENIZER_WORDS.index("omega") + 2
    assert ids(beside / "tokenizer.json") == [2, 3, omega, 4, omega]
    # Appended to a sequence by the post-processor (which itself is not applied: one eos, once).
    processed = Tokenizer.from_file(str(make_tokenizer(tmp_path / "t3.json", eos="<end>", special=False)))
    processed.post_processor = processors.TemplateProcessing(single="$A <end>", special_tokens=[("<end>", 1)])
    processed.save(str(tmp_path / "t3.json"))
    assert ids(tmp_path / "t3.json") == [2, 3, 1, 4, 1]
    # None declared: a clear error, and the keys that fix it.
    bare = make_tokenizer(tmp_path / "t4.json", eos="<end>", special=False)
    with pytest.raises(data_lib.DataError, match="declares no end-of-document token.*set data.eos_token"):
        ids(bare)
    assert ids(bare, eos_token="<end>") == [2, 3, 1, 4, 1]
    assert ids(bare, eos_id=1) == ids(bare, eos_id=1, eos_token="<end>") == [2, 3, 1, 4, 1]
    with pytest.raises(data_lib.DataError, match="data.eos_token = 'nope': not a token of"):
        ids(bare, eos_token="nope")
    with pytest.raises(data_lib.DataError, match=r"data.eos_id = 999: not an id of .* \(vocabulary 26\)"):
        ids(bare, eos_id=999)


def test_token_files_with_an_eos_id_count_their_documents(tmp_path) -> None:
    tokens = np.array([5, 6, 1, 7, 1, 8, 9, 9, 1] * 50, dtype=np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    spec = SiteData("tokens", (str(tmp_path / "t.bin"),), token_dtype="uint16", eos_id=1, eval_fraction=0.1)
    corpus = data_lib.open_site_data(spec, None)
    assert corpus.documents == 150 and corpus.eos_id == 1 and "150 documents ending with id 1" in corpus.description
    plain = data_lib.open_site_data(SiteData("tokens", spec.paths, token_dtype="uint16"), None)
    assert plain.documents == 0 and "documents" not in plain.description


# --- mixtures ----------------------------------------------------------------------------------


def _token_file(path: Path, low: int, count: int = 4000) -> str:
    np.arange(low, low + 100, dtype=np.uint16)[np.arange(count) % 100].tofile(path)
    return str(path)


def mixture_spec(tmp_path: Path, weights: tuple[float, float] = (3, 1)) -> SiteData:
    return SiteData(token_dtype="uint16", source="tokens", mix={
        "web": {"paths": [_token_file(tmp_path / "web.bin", 0)], "weight": weights[0]},
        "code": {"paths": [_token_file(tmp_path / "code.bin", 1000, 8000)], "weight": weights[1]}})


def test_a_mixture_from_the_config_file_with_paths_relative_to_it(tmp_path) -> None:
    config = tmp_path / "site.toml"
    config.write_text('[node.data]\nsource = "tokens"\ntoken_dtype = "uint16"\n'
                      '[node.data.mix.web]\npaths = ["web/*.bin"]\nweight = 3\n'
                      '[node.data.mix.code]\nsource = "jsonl"\ntoken_dtype = ""\npaths = ["code.jsonl"]\n'
                      'tokenizer = "tok.json"\nweight = 1\n')
    with pytest.raises(ConfigError, match="data.mix.code.tokenizer: a site tokenizes with one tokenizer"):
        load_config(config, {}, {})
    config.write_text(config.read_text().replace('tokenizer = "tok.json"\n', "")
                      .replace('[node.data]\n', '[node.data]\ntokenizer = "tok.json"\n') + '[node.data.mix.more]\npaths = []\n')
    with pytest.raises(ConfigError, match=r"data.mix.more.weight = None: every mixture entry needs a weight > 0"):
        load_config(config, {}, {})
    config.write_text(config.read_text().replace("[node.data.mix.more]\npaths = []\n", ""))
    data = load_config(config, {}, {}).node.data
    (web, web_weight, web_data), (code, code_weight, code_data) = data.mixture()
    assert (web, web_weight, code, code_weight) == ("web", 3.0, "code", 1.0)
    assert web_data.paths == (str(tmp_path / "web/*.bin"),) and web_data.token_dtype == "uint16"
    assert code_data.source == "jsonl" and code_data.tokenizer == str(tmp_path / "tok.json")
    # The same from the environment, as TOML inline tables.
    environ = {"DILOCO_DATA_SOURCE": "tokens", "DILOCO_DATA_TOKEN_DTYPE": "uint32",
               "DILOCO_DATA_MIX": 'a = {paths = ["a.bin"], weight = 2}, b = {paths = ["b.bin"], weight = 0.5}'}
    mixed = load_config(None, environ, {}).node.data
    assert [(name, weight, leaf.paths) for name, weight, leaf in mixed.mixture()] == [
        ("a", 2.0, (str(Path.cwd() / "a.bin"),)), ("b", 0.5, (str(Path.cwd() / "b.bin"),))]
    with pytest.raises(ConfigError, match="data.paths: a site with \\[node.data.mix.NAME\\] tables reads their paths"):
        SiteData(paths=("x.bin",), mix={"a": {"paths": ["y.bin"], "weight": 1, "source": "text"}})


def test_mixture_rows_follow_the_weights_reproducibly(tmp_path) -> None:
    corpus = data_lib.open_site_data(mixture_spec(tmp_path), None)
    assert isinstance(corpus.train, data_lib.Mixture)
    assert "web (weight 3, 75% of the rows)" in corpus.description
    assert len(corpus.eval) == 200 + 400  # each entry's eval split
    sampler = data_lib.BatchSampler(corpus.train, 8, 16, seed=4)
    rows = np.concatenate([sampler.next()[0] for _ in range(200)])
    from_code = rows[:, 0] >= 1000
    # A row is one entry's window, never a join of two.
    assert np.array_equal(from_code, (rows >= 1000).all(axis=1)) and ((rows < 1000).all(axis=1) | from_code).all()
    assert 0.21 < from_code.mean() < 0.29  # weight 1 of 4, over 1600 rows
    again = data_lib.BatchSampler(corpus.train, 8, 16, seed=4)
    assert np.array_equal(np.concatenate([again.next()[0] for _ in range(200)]), rows)
    flipped = data_lib.open_site_data(mixture_spec(tmp_path, (1, 3)), None)
    rows = np.concatenate([data_lib.BatchSampler(flipped.train, 8, 16, seed=4).next()[0] for _ in range(200)])
    assert 0.71 < (rows[:, 0] >= 1000).mean() < 0.79


def test_a_mixture_sampler_resumes_and_a_changed_mixture_is_refused(tmp_path) -> None:
    corpus = data_lib.open_site_data(mixture_spec(tmp_path), None)
    sampler = data_lib.BatchSampler(corpus.train, 4, 16, seed=1, learner=2)
    for _ in range(5):
        sampler.next()
    saved = sampler.state()
    expected = [sampler.next()[0] for _ in range(3)]
    resumed = data_lib.BatchSampler(corpus.train, 4, 16, seed=1, learner=2)
    resumed.restore(saved)
    assert all(np.array_equal(a, resumed.next()[0]) for a in expected)
    reweighted = data_lib.open_site_data(mixture_spec(tmp_path, (3, 2)), None)
    other = data_lib.BatchSampler(reweighted.train, 4, 16, seed=1, learner=2)
    with pytest.raises(data_lib.DataError, match=r"belongs to another sampler \(mixture: saved \[\['web', 3.0, 3800\]"):
        other.restore(saved)
    single = data_lib.BatchSampler(np.arange(5000), 4, 16, seed=1, learner=2)
    with pytest.raises(data_lib.DataError, match="mixture: saved None"):
        other.restore(single.state())


def test_a_mixture_of_token_files_in_a_tokenized_run_warns_and_a_mixture_entry_too_small_is_named(tmp_path) -> None:
    spec = mixture_spec(tmp_path)
    assert "cannot" not in (data_lib.check_tokenizer("ab" * 32, spec) or "") and data_lib.check_tokenizer("ab" * 32, spec)
    corpus = data_lib.open_site_data(spec, None)
    with pytest.raises(data_lib.DataError, match="data.mix.web: its train split of 3800 tokens is too small for seq_len 5000"):
        data_lib.BatchSampler(corpus.train, 2, 5000, seed=0)
    with pytest.raises(data_lib.DataError, match="data.mix.gone: .*no such file"):
        data_lib.open_site_data(SiteData(source="tokens", token_dtype="uint16", mix={
            "gone": {"paths": [str(tmp_path / "missing.bin")], "weight": 1}}), None)
