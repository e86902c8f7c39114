"""Training data: a site's token sources, the train/eval split, the vocabulary checks, batches.

A site's `[node.data]` (config/site_data.py) names its data; `open_site_data(SiteData,
cache_dir)` opens it as a `Corpus` (a train and an eval token stream and the vocabulary they
imply). Nothing is downloaded and nothing large is read whole:
- "stdlib": the running interpreter's own standard library `.py` files as bytes (present on
  every machine: the demo's corpus), split into train/eval by a hash of each file's path.
- "tokens": flat token files (`.bin` of `token_dtype` ids or `.npy`), memory-mapped and read as
  one stream (token_files.py); the last `eval_fraction` of the stream is eval.
- "text": text files, directories or globs read in chunks, encoded as bytes (vocabulary 256) or,
  with a local `tokenizer.json`, as the tokenizer's ids, and written once to a token file in
  `cache_dir` named by a digest of the encoder and the files (path, size, mtime), so a restarted
  site maps the cache instead of tokenizing again. Enough files are split by path hash, else the
  tail of the stream is eval.
- documents ("jsonl", "parquet", "arrow", or "documents" by extension): records read in bounded
  batches and tokenized (documents.py), each document ended with the end-of-document id, cached
  as text is; the tail split begins at a document.
- a mixture (`[node.data.mix.NAME]`): each entry opened as above; the train stream is a
  `Mixture` the sampler draws from by the entries' weights, the eval stream all their eval splits.
- separate eval sets (`[node.data.eval.NAME]`): each source opened as above but read whole
  (`hold_out=False`), checked not to share a file with the training data, and kept in
  `Corpus.eval_sets`; with eval sets, nothing of the training data is held out.
A missing, empty or unreadable source is a `DataError` naming the path.

What the sites of a run must agree on is checked here: `check_tokens` scans a corpus for ids at
or above the model's vocabulary in bounded chunks and names the first one; `check_tokenizer`
compares the site's tokenizer with the run's digest (`[run.data] tokenizer_sha256`).

Learner m trains on shard m: the m-th of M contiguous, disjoint ranges of the train stream.
Batches are random windows of seq_len + 1 tokens (inputs and shifted targets) from a generator
seeded by (seed, learner), so a run is reproducible; `BatchSampler.state()` is its position,
kept in the learner checkpoint, and `restore` continues from it. From a `Mixture`, each row of a
batch comes from an entry drawn by weight from the same generator.
"""

from __future__ import annotations

import glob
import hashlib
import json
import mmap
import os
import sysconfig
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco_node.config.manifest import DataAgreement, RunManifest
from diloco_node.config.site_data import DOCUMENT_SOURCES, SiteData
from diloco_node.learn import documents as documents_lib
from diloco_node.learn import token_files
from diloco_node.storage import durable, failpoints

# Files of the stdlib that are not the standard library proper (third-party installs).
_STDLIB_EXCLUDED_DIRS = ("site-packages", "dist-packages")
# A split by file path needs this many files before both sides are reliably non-empty.
MIN_FILES_FOR_PATH_SPLIT = 20


class DataError(ValueError):
    """A data source is missing, empty, unreadable or too small; the message names the path."""


@dataclass(frozen=True)
class Corpus:
    """Train and eval token streams: arrays, or `token_files.TokenStream`s of memory-mapped files
    (both are only measured with len() and sliced). `vocab_size` is the vocabulary the data
    implies: 256 for bytes, the tokenizer's for tokenized text, the dtype's range for token files.
    `tokenizer_digest` is the sha256 of the tokenizer.json that made the ids ("" when none did or
    none was named) and `tokenizer_vocab_size` its vocabulary (0 when text was not tokenized here).
    `documents` counts the documents read (train and eval; 0 when the source has none, e.g. text
    or token files without `eos_id`), `train_documents` those of the train split, and `eos_id`
    the id that ends each (-1: none). `eval_sets` are the separate eval sets (name, whole token
    stream) of `[node.data.eval.NAME]`, in the order they were given (`open_eval_sets`)."""

    train: np.ndarray | token_files.TokenStream
    eval: np.ndarray | token_files.TokenStream
    vocab_size: int
    description: str
    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    tokenizer_digest: str = ""
    tokenizer_vocab_size: int = 0
    documents: int = 0
    train_documents: int = 0
    eos_id: int = -1
    eval_sets: tuple[tuple[str, Any], ...] = ()


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library `.py` files, sorted (site-packages excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    # os.walk pruning the excluded directories, not Path.rglob filtering afterwards: rglob walks
    # every installed package below site-packages first, about 40x the CPU (0.76 against
    # 0.02 CPU-s here), and every node pays it at start.
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _STDLIB_EXCLUDED_DIRS]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files)


def is_eval_path(relative_path: str, eval_fraction: float, seed: int) -> bool:
    """Deterministic: a file is eval when the hash of (seed, path) falls below eval_fraction."""
    digest = hashlib.sha256(f"{seed}:{relative_path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def split_paths(relative_paths: Sequence[str], eval_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, eval) by path hash; the same inputs always give the same split."""
    train, evaluation = [], []
    for path in relative_paths:
        (evaluation if is_eval_path(path, eval_fraction, seed) else train).append(path)
    return train, evaluation


def expand_text_paths(patterns: Sequence[str]) -> list[Path]:
    """Files named by paths, directories (all files below) or globs; errors name the culprit."""
    files: list[Path] = []
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True) if os.path.isfile(m))
            if not matches:
                raise DataError(f"data source {pattern!r}: the glob matches no files")
            files.extend(matches)
            continue
        path = Path(pattern)
        if not path.exists():
            raise DataError(f"data source {pattern!r}: no such file or directory")
        if path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.is_file())
            if not matches:
                raise DataError(f"data source {pattern!r}: the directory contains no files")
            files.extend(matches)
        else:
            if path.stat().st_size == 0:
                raise DataError(f"data source {pattern!r}: the file is empty")
            files.append(path)
    return files


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"data source {str(path)!r}: cannot read it ({exc.strerror or exc})") from None


def _concat(files: Sequence[Path]) -> np.ndarray:
    return np.frombuffer(b"".join(_read(f) for f in files), dtype=np.uint8)


def stdlib_corpus(eval_fraction: float = 0.05, seed: int = 0) -> Corpus:
    """The standard library's `.py` files as bytes (tens of MB, read whole), split by path hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    if not files:
        raise DataError(f"data source stdlib: no .py files under {str(root)!r}")
    names = [str(f.relative_to(root)) for f in files]
    by_name = dict(zip(names, files))
    train_names, eval_names = split_paths(names, eval_fraction, seed)
    train, evaluation = _concat([by_name[n] for n in train_names]), _concat([by_name[n] for n in eval_names])
    if not train.size or not evaluation.size:
        raise DataError(f"data source stdlib under {str(root)!r}: too few files to hold out an eval split")
    return Corpus(train, evaluation, 256, f"stdlib .py files under {root}", tuple(train_names), tuple(eval_names))


# --- A site's own data: `[node.data]` --------------------------------------------------------

TEXT_CHUNK_BYTES = 1 << 20  # text is read and encoded in pieces of this size: memory stays bounded
ENCODE_GROUP_CHUNKS = 8  # pieces given to the tokenizer in one call (it encodes a batch in parallel)
TEXT_CACHE_FORMAT = 1  # part of the cache key: a change to the layout or the chunking never reuses old caches
TOKENIZERS_MISSING = "install the 'tokenizers' extra: pip install 'diloco-node[tokenizers]'"


def tokenizer_digest(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of a tokenizer.json's bytes: every site of a run must tokenize with the same file."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    except FileNotFoundError:
        raise DataError(f"node.data.tokenizer {str(path)!r}: no such file") from None
    except OSError as exc:
        raise DataError(f"node.data.tokenizer {str(path)!r}: cannot read it ({exc.strerror or exc})") from None
    return digest.hexdigest()


def _load_tokenizer(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(f"node.data.tokenizer: {TOKENIZERS_MISSING}") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # noqa: BLE001 - the library raises a bare Exception for a malformed file
        raise DataError(f"node.data.tokenizer {path!r}: not a tokenizer.json the tokenizers library can load "
                        f"({error})") from None


def _cut_point(buffer: bytearray, limit: int) -> int:
    """Where to end a piece of at most `limit` bytes: after its last line end, else after its last
    space, else before the UTF-8 character that straddles the limit. Tokens then rarely straddle a
    cut (a tokenizer never sees half a word or half a character) and every piece decodes alone."""
    for separator in (b"\n", b" "):
        end = buffer.rfind(separator, 0, limit)
        if end >= 0:
            return end + 1
    cut = limit
    while cut > 0 and buffer[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte: the character began earlier
        cut -= 1
    return cut or limit


def iter_text_chunks(path: Path, chunk_bytes: int = TEXT_CHUNK_BYTES) -> Iterator[bytes]:
    """A file's bytes in pieces of at most `chunk_bytes` (cut as `_cut_point` says); joined, they
    are the file. At most twice `chunk_bytes` is held at once, whatever the file's size."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes = {chunk_bytes}: must be >= 1")
    buffer = bytearray()
    try:
        with open(path, "rb") as file:
            while True:
                block = file.read(chunk_bytes)
                buffer += block
                # Cut only with a byte beyond the limit in hand (or at the end): the cut looks at it.
                while len(buffer) > chunk_bytes:
                    cut = _cut_point(buffer, chunk_bytes)
                    yield bytes(buffer[:cut])
                    del buffer[:cut]
                if not block:
                    if buffer:
                        yield bytes(buffer)
                    return
    except OSError as exc:
        raise DataError(f"data source {str(path)!r}: cannot read it ({exc.strerror or exc})") from None


# An encoder turns one file's pieces, each with its byte offset in the file, into id arrays.
Encoder = Callable[[Path, list[tuple[int, bytes]]], list[np.ndarray]]


def _encode_bytes(path: Path, pieces: list[tuple[int, bytes]]) -> list[np.ndarray]:
    return [np.frombuffer(piece, dtype=np.uint8) for _, piece in pieces]


def _tokenizer_encoder(tokenizer: Any) -> Encoder:
    def encode(path: Path, pieces: list[tuple[int, bytes]]) -> list[np.ndarray]:
        texts = []
        for offset, piece in pieces:
            try:
                texts.append(piece.decode("utf-8"))
            except UnicodeDecodeError as error:
                raise DataError(f"text file {str(path)!r}: not UTF-8 at byte {offset + error.start}; the tokenizer "
                                "reads UTF-8 text (convert the file, e.g. with iconv)") from None
        # No special tokens: a BOS/EOS per piece would land in the middle of the text.
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.uint32) for encoding in encodings]
    return encode


def _write_text_tokens(files: Sequence[Path], encode: Encoder, dtype: np.dtype, out: Any,
                       chunk_bytes: int) -> list[tuple[int, int]]:
    """Encode the files into `out`, one after another; the [start, stop) of each file's ids."""
    ranges: list[tuple[int, int]] = []
    written = 0
    for path in files:
        start, offset, group = written, 0, []
        for piece in iter_text_chunks(path, chunk_bytes):
            group.append((offset, piece))
            offset += len(piece)
            if len(group) == ENCODE_GROUP_CHUNKS:
                written += _write_ids(encode(path, group), dtype, out)
                group = []
        if group:
            written += _write_ids(encode(path, group), dtype, out)
        ranges.append((start, written))
    return ranges


def _write_ids(arrays: list[np.ndarray], dtype: np.dtype, out: Any) -> int:
    count = 0
    for ids in arrays:
        out.write(np.ascontiguousarray(ids, dtype=dtype).data)
        count += len(ids)
    return count


def _text_cache_key(files: Sequence[Path], encoder_id: str, chunk_bytes: int) -> str:
    """Digest of what the cached ids depend on: the encoder, the chunking and each file's resolved
    path, size and modification time (an edited file gets a new cache)."""
    described = []
    for path in files:
        try:
            stat = path.stat()
        except OSError as exc:
            raise DataError(f"data source {str(path)!r}: cannot read it ({exc.strerror or exc})") from None
        described.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    blob = json.dumps({"format": TEXT_CACHE_FORMAT, "encoder": encoder_id, "chunk_bytes": chunk_bytes,
                       "files": described}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _cached_ranges(meta_path: Path, tokens_path: Path, dtype: np.dtype, file_count: int,
                   cache_format: int = TEXT_CACHE_FORMAT) -> list[tuple[int, int]] | None:
    """The file ranges of a complete cache, or None when there is none (or it is damaged: rebuilt)."""
    try:
        meta = json.loads(meta_path.read_text())
        ranges = [(int(start), int(stop)) for start, stop in meta["ranges"]]
        size = tokens_path.stat().st_size
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if meta.get("format") != cache_format or meta.get("dtype") != dtype.name or len(ranges) != file_count:
        return None
    if not ranges or size != ranges[-1][1] * dtype.itemsize:
        return None
    return ranges


def _replace_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """Write a file under a temporary name, sync it, then rename it: a crash leaves no half file.
    Failpoint `data_cache.write` (storage/failpoints.py): a full disk here leaves no file at all."""
    failpoints.hit("data_cache.write")
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            durable.sync_file("data_cache.write", out.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def _open_text_tokens(files: Sequence[Path], encoder_id: str, encode: Encoder, dtype: np.dtype,
                      cache_dir: Path | None, chunk_bytes: int, what: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The files' ids as one memory-mapped array and each file's [start, stop) in it: from the
    cache when it holds them, else encoded now (into the cache, or into a nameless temporary file
    when there is no cache directory: then a restart encodes again)."""
    def no_text() -> DataError:
        return DataError(f"data source {what}: the files hold no text")

    if cache_dir is None:
        with tempfile.TemporaryFile() as out:  # the map keeps the (already unlinked) file alive
            ranges = _write_text_tokens(files, encode, dtype, out, chunk_bytes)
            out.flush()
            if not ranges[-1][1]:
                raise no_text()
            return np.memmap(out, dtype=dtype, mode="r", shape=(ranges[-1][1],)), ranges
    key = _text_cache_key(files, encoder_id, chunk_bytes)
    tokens_path, meta_path = cache_dir / f"text-{key}.bin", cache_dir / f"text-{key}.json"
    ranges = _cached_ranges(meta_path, tokens_path, dtype, len(files))
    if ranges is None:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(f"data cache {str(cache_dir)!r}: cannot create it ({exc.strerror or exc})") from None
        found: list[tuple[int, int]] = []
        _replace_atomically(tokens_path, lambda out: found.extend(_write_text_tokens(files, encode, dtype, out, chunk_bytes)))
        ranges = found
        if not ranges[-1][1]:
            tokens_path.unlink(missing_ok=True)
            raise no_text()
        # Written after the ids, so a crash in between leaves no cache that claims to be complete.
        meta = {"format": TEXT_CACHE_FORMAT, "dtype": dtype.name, "encoder": encoder_id,
                "files": [str(path) for path in files], "ranges": ranges}
        _replace_atomically(meta_path, lambda out: out.write(json.dumps(meta).encode()))
    return np.memmap(tokens_path, dtype=dtype, mode="r", shape=(ranges[-1][1],)), ranges


def _split_stream(stream: token_files.TokenStream, eval_fraction: float) -> tuple[token_files.TokenStream, token_files.TokenStream]:
    """(head, tail): the tail is the last `eval_fraction` of the stream (at least one token)."""
    cut = len(stream) - max(1, int(len(stream) * eval_fraction))
    return stream.sub(0, cut), stream.sub(cut, len(stream))


def _open_site_text(spec: SiteData, cache_dir: Path | None, chunk_bytes: int) -> Corpus:
    files = expand_text_paths(spec.paths)
    patterns = ", ".join(repr(p) for p in spec.paths)
    if spec.tokenizer:
        digest = tokenizer_digest(spec.tokenizer)
        tokenizer = _load_tokenizer(spec.tokenizer)
        vocab_size = int(tokenizer.get_vocab_size())
        encoder_id, encode, dtype = f"tokenizer:{digest}", _tokenizer_encoder(tokenizer), np.dtype(np.uint32)
        description = f"text {patterns} tokenized by {spec.tokenizer!r} (sha256 {digest[:12]}, vocabulary {vocab_size})"
    else:
        digest, vocab_size = "", 256
        encoder_id, encode, dtype = "bytes", _encode_bytes, np.dtype(np.uint8)
        description = f"text {patterns} as bytes"
    ids, ranges = _open_text_tokens(files, encoder_id, encode, dtype, cache_dir, chunk_bytes, f"text {patterns}")
    names = [str(path) for path in files]
    parts = [(name, ids[start:stop]) for name, (start, stop) in zip(names, ranges)]
    # As the stdlib: hold out whole files by path hash when there are enough, else the stream's tail.
    by_files = _held_out_files(parts, spec)
    if by_files is not None:
        train, evaluation, train_names, eval_names = by_files
        return Corpus(train, evaluation, vocab_size, description, train_names, eval_names, digest,
                      vocab_size if digest else 0)
    train, evaluation = _split_stream(token_files.TokenStream(parts), spec.eval_fraction)
    return Corpus(train, evaluation, vocab_size, description + " (split by position)", tuple(names), (), digest,
                  vocab_size if digest else 0)


def _held_out_files(parts: list[tuple[str, Any]],
                    spec: SiteData) -> tuple[Any, Any, tuple[str, ...], tuple[str, ...]] | None:
    """(train, eval, train file names, eval file names) when whole files can be held out by path
    hash: enough files, and both sides non-empty. None: split the stream by position instead."""
    if len(parts) < MIN_FILES_FOR_PATH_SPLIT:
        return None
    train_names, eval_names = split_paths([name for name, _ in parts], spec.eval_fraction, spec.seed)
    if not (train_names and eval_names):
        return None
    held_out = set(eval_names)
    train = token_files.TokenStream([part for part in parts if part[0] not in held_out])
    evaluation = token_files.TokenStream([part for part in parts if part[0] in held_out])
    if not (len(train) and len(evaluation)):
        return None
    return train, evaluation, tuple(train_names), tuple(eval_names)


def _open_site_tokens(spec: SiteData) -> Corpus:
    try:
        stream = token_files.open_token_stream(spec.paths, spec.token_dtype)
    except token_files.TokenFileError as error:
        raise DataError(str(error)) from None
    train, evaluation = _split_stream(stream, spec.eval_fraction)
    vocab_size = int(np.iinfo(np.dtype(spec.token_dtype)).max) + 1
    names = tuple(name for name, _ in stream.parts)
    # A tokenizer named beside token files only declares which one made them: its digest is checked.
    digest = tokenizer_digest(spec.tokenizer) if spec.tokenizer else ""
    description = f"token files {', '.join(repr(p) for p in spec.paths)} ({spec.token_dtype}, {len(stream):,} tokens"
    eos_id = spec.eos_id
    if eos_id < 0 and spec.eos_token:  # SiteData requires a tokenizer beside an eos_token
        try:
            eos_id, _ = documents_lib.find_eos(_load_tokenizer(spec.tokenizer), spec.tokenizer, spec.eos_token)
        except documents_lib.DocumentError as error:
            raise DataError(str(error)) from None
    if eos_id < 0:
        return Corpus(train, evaluation, vocab_size, description + ")", names, (), digest)
    # The documents are already separated by eos_id: counted (one more pass over the ids) to be reported.
    train_documents = documents_lib.count_id(train, eos_id, token_files.SCAN_CHUNK_TOKENS)
    documents = train_documents + documents_lib.count_id(evaluation, eos_id, token_files.SCAN_CHUNK_TOKENS)
    return Corpus(train, evaluation, vocab_size, description + f", {documents:,} documents ending with id {eos_id})",
                  names, (), digest, documents=documents, train_documents=train_documents, eos_id=eos_id)


DOCUMENT_CACHE_FORMAT = 1  # part of the documents cache key: a layout change never reuses old caches


def _document_cache_key(files: Sequence[tuple[Path, str]], encoder_id: str, text_field: str, eos_id: int) -> str:
    """Digest of what the cached ids depend on: the tokenizer, the text field, the end-of-document
    id and each file's format, resolved path, size and modification time (an edited file, another
    tokenizer or option gets a new cache). Batch sizes are not in it: each document is encoded
    alone, so they change no id."""
    described = []
    for path, fmt in files:
        try:
            stat = path.stat()
        except OSError as exc:
            raise DataError(f"data source {str(path)!r}: cannot read it ({exc.strerror or exc})") from None
        described.append([fmt, str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    blob = json.dumps({"format": DOCUMENT_CACHE_FORMAT, "encoder": encoder_id, "text_field": text_field,
                       "eos_id": eos_id, "files": described}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _open_document_ids(files: Sequence[tuple[Path, str]], write: Callable[[Any], tuple[list, list]], key: str,
                       cache_dir: Path | None, what: str) -> tuple[np.ndarray, list[tuple[int, int]], list[int]]:
    """The documents' ids as one memory-mapped uint32 array, each file's [start, stop) in it and
    its number of documents: from the cache (`cache_dir/documents-<key>.bin` and `.json`) when it
    holds them, else tokenized now by `write` (into the cache, or a nameless temporary file)."""
    dtype = np.dtype(np.uint32)

    def no_documents() -> DataError:
        return DataError(f"data source {what}: the files hold no documents with text")

    if cache_dir is None:
        with tempfile.TemporaryFile() as out:  # the map keeps the (already unlinked) file alive
            ranges, counts = write(out)
            out.flush()
            if not ranges[-1][1]:
                raise no_documents()
            return np.memmap(out, dtype=dtype, mode="r", shape=(ranges[-1][1],)), ranges, counts
    tokens_path, meta_path = cache_dir / f"documents-{key}.bin", cache_dir / f"documents-{key}.json"
    ranges = _cached_ranges(meta_path, tokens_path, dtype, len(files), DOCUMENT_CACHE_FORMAT)
    counts: list[int] = []
    if ranges is not None:
        try:
            counts = [int(count) for count in json.loads(meta_path.read_text())["documents"]]
        except (OSError, ValueError, TypeError, KeyError):
            ranges = None
        if len(counts) != len(files):
            ranges = None
    if ranges is None:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(f"data cache {str(cache_dir)!r}: cannot create it ({exc.strerror or exc})") from None
        found: list[Any] = []
        _replace_atomically(tokens_path, lambda out: found.extend(write(out)))
        ranges, counts = found
        if not ranges[-1][1]:
            tokens_path.unlink(missing_ok=True)
            raise no_documents()
        # Written after the ids, so a crash in between leaves no cache that claims to be complete.
        meta = {"format": DOCUMENT_CACHE_FORMAT, "dtype": dtype.name, "files": [str(path) for path, _ in files],
                "ranges": ranges, "documents": counts}
        _replace_atomically(meta_path, lambda out: out.write(json.dumps(meta).encode()))
    return np.memmap(tokens_path, dtype=dtype, mode="r", shape=(ranges[-1][1],)), ranges, counts


def _find_id(stream: Any, token_id: int, start: int, stop: int, *, last: bool = False) -> int:
    """The first (or `last`) position in [start, stop) holding `token_id`, -1 when none; read in
    bounded chunks."""
    step = token_files.SCAN_CHUNK_TOKENS
    starts = range(start, stop, step)
    for begin in (reversed(starts) if last else starts):
        chunk = np.asarray(stream[begin:min(begin + step, stop)])
        hits = np.flatnonzero(chunk == token_id)
        if hits.size:
            return begin + int(hits[-1] if last else hits[0])
    return -1


def _document_cut(stream: token_files.TokenStream, eval_fraction: float, eos_id: int) -> int:
    """Where the eval tail begins: the first document start at or after the last `eval_fraction`
    of the stream (else the last one before it; else, one document, the plain position)."""
    length = len(stream)
    cut = length - max(1, int(length * eval_fraction))
    after = _find_id(stream, eos_id, max(cut - 1, 0), length - 1)
    if after >= 0:
        return after + 1
    before = _find_id(stream, eos_id, 0, max(cut - 1, 0), last=True)
    return before + 1 if before >= 0 else cut


def _open_site_documents(spec: SiteData, cache_dir: Path | None) -> Corpus:
    patterns = ", ".join(repr(p) for p in spec.paths)
    try:
        files = documents_lib.expand_document_paths(spec.paths, spec.source)
        digest = tokenizer_digest(spec.tokenizer)
        tokenizer = _load_tokenizer(spec.tokenizer)
        vocab_size = int(tokenizer.get_vocab_size())
        eos_id, eos_how = documents_lib.find_eos(tokenizer, spec.tokenizer, spec.eos_token, spec.eos_id)
        key = _document_cache_key(files, f"tokenizer:{digest}", spec.text_field, eos_id)
        ids, ranges, counts = _open_document_ids(
            files, lambda out: documents_lib.write_document_ids(files, spec.text_field, tokenizer, eos_id, out),
            key, cache_dir, f"documents {patterns}")
    except documents_lib.DocumentError as error:
        raise DataError(str(error)) from None
    names = [str(path) for path, _ in files]
    parts = [(name, ids[start:stop]) for name, (start, stop) in zip(names, ranges)]
    total = sum(counts)
    description = (f"documents {patterns} tokenized by {spec.tokenizer!r} (sha256 {digest[:12]}, vocabulary "
                   f"{vocab_size}; each ends with {eos_how}, id {eos_id}): {total:,} documents, {len(ids):,} tokens")
    found = dict(vocab_size=vocab_size, tokenizer_digest=digest, tokenizer_vocab_size=vocab_size, documents=total,
                 eos_id=eos_id)
    # As text: hold out whole files by path hash when there are enough, else the stream's tail.
    by_files = _held_out_files(parts, spec)
    if by_files is not None:
        train, evaluation, train_names, eval_names = by_files
        held_out = set(eval_names)
        train_documents = sum(count for name, count in zip(names, counts) if name not in held_out)
        return Corpus(train, evaluation, description=description, train_files=train_names,
                      eval_files=eval_names, train_documents=train_documents, **found)
    stream = token_files.TokenStream(parts)
    cut = _document_cut(stream, spec.eval_fraction, eos_id)
    train, evaluation = stream.sub(0, cut), stream.sub(cut, len(stream))
    train_documents = total - documents_lib.count_id(evaluation, eos_id, token_files.SCAN_CHUNK_TOKENS)
    return Corpus(train, evaluation, description=description + " (split by position, at a document)",
                  train_files=tuple(names), train_documents=train_documents, **found)


class Mixture(token_files.TokenStream):
    """A mixture's train streams with their weights (`entries`: name, weight, stream). As a
    stream it is all of them one after another (measured, scanned and sliced like any: a slice
    is a plain stream); `BatchSampler` draws each row of a batch from one entry chosen by weight."""

    def __init__(self, entries: Sequence[tuple[str, float, Any]]) -> None:
        self.entries = [(name, float(weight), stream) for name, weight, stream in entries]
        super().__init__([part for name, _, stream in self.entries for part in _named_parts(name, stream)])


def _named_parts(name: str, stream: Any) -> list[tuple[str, Any]]:
    return list(stream.parts) if isinstance(stream, token_files.TokenStream) else [(name, stream)]


def _open_mixture(spec: SiteData, cache_dir: Path | None, chunk_bytes: int, hold_out: bool) -> Corpus:
    opened = []
    for name, weight, entry in spec.mixture():
        try:
            opened.append((name, weight, open_site_data(entry, cache_dir, chunk_bytes=chunk_bytes, hold_out=hold_out)))
        except DataError as error:
            raise DataError(f"data.mix.{name}: {error}") from None
    total_weight = sum(weight for _, weight, _ in opened)
    train = Mixture([(name, weight, corpus.train) for name, weight, corpus in opened])
    evaluation = token_files.TokenStream([part for name, _, corpus in opened for part in _named_parts(name, corpus.eval)])
    eos_ids = {corpus.eos_id for _, _, corpus in opened if corpus.eos_id >= 0}
    description = "a mixture of " + "; ".join(f"{name} (weight {weight:g}, {weight / total_weight:.0%} of the rows): "
                                              f"{corpus.description}" for name, weight, corpus in opened)
    return Corpus(train, evaluation, max(corpus.vocab_size for _, _, corpus in opened), description,
                  tuple(f for _, _, corpus in opened for f in corpus.train_files),
                  tuple(f for _, _, corpus in opened for f in corpus.eval_files),
                  next((corpus.tokenizer_digest for _, _, corpus in opened if corpus.tokenizer_digest), ""),
                  max(corpus.tokenizer_vocab_size for _, _, corpus in opened),
                  sum(corpus.documents for _, _, corpus in opened), sum(corpus.train_documents for _, _, corpus in opened),
                  eos_ids.pop() if len(eos_ids) == 1 else -1)


def _whole(corpus: Corpus) -> Corpus:
    """The corpus with nothing held out: its eval split joined back to the train stream (every
    token trains, or, for an eval set, every token is evaluated). The files' order may change
    (a path split's held-out files come last), which no reader depends on."""
    if not len(corpus.eval):
        return corpus
    if isinstance(corpus.train, np.ndarray) and isinstance(corpus.eval, np.ndarray):
        train: Any = np.concatenate([corpus.train, corpus.eval])
    else:
        train = token_files.TokenStream(_named_parts("train", corpus.train) + _named_parts("eval", corpus.eval))
    return dataclasses.replace(corpus, train=train, eval=np.empty(0, np.asarray(corpus.eval[:1]).dtype),
                               train_files=corpus.train_files + corpus.eval_files, eval_files=(),
                               train_documents=corpus.documents)


def open_site_data(spec: SiteData, cache_dir: Path | None, *, chunk_bytes: int = TEXT_CHUNK_BYTES,
                   hold_out: bool | None = None) -> Corpus:
    """The corpus a site's `[node.data]` names (module docstring). `cache_dir` keeps encoded text
    and documents between restarts (None: encode into a temporary file each time); `chunk_bytes`
    is the size of the pieces text is read and tokenized in. `hold_out`: whether an eval split is
    carved out of the data (default: unless the site has separate eval sets, which replace it);
    False reads the whole source as `train` and leaves `eval` empty."""
    if hold_out is None:
        hold_out = not spec.eval
    if spec.mix:
        return _open_mixture(spec, cache_dir, chunk_bytes, hold_out)
    if spec.source == "stdlib":
        corpus = stdlib_corpus(spec.eval_fraction, spec.seed)
    elif spec.source == "text":
        corpus = _open_site_text(spec, cache_dir, chunk_bytes)
    elif spec.source in DOCUMENT_SOURCES:
        corpus = _open_site_documents(spec, cache_dir)
    else:
        corpus = _open_site_tokens(spec)
    if not hold_out:
        corpus = _whole(corpus)
    if not len(corpus.train):
        raise DataError(f"data source {corpus.description}: too small to hold out an eval split and train on the rest")
    return corpus


def _real_files(names: Sequence[str]) -> dict[str, str]:
    return {os.path.realpath(name): name for name in names if os.path.isabs(name)}


def open_eval_sets(spec: SiteData, cache_dir: Path | None, training: Corpus | None = None, *,
                   chunk_bytes: int = TEXT_CHUNK_BYTES) -> tuple[tuple[str, Any], ...]:
    """The site's separate eval sets (`[node.data.eval.NAME]`) as (name, whole token stream), each
    opened as a source of its own and read whole. A set that shares a file with the `training`
    corpus (train or held-out files) is refused, naming the file: held-out data that is also
    trained on measures memory, not generalisation."""
    trained = _real_files(training.train_files + training.eval_files) if training is not None else {}
    sets = []
    for name, entry in spec.eval_sets():
        try:
            corpus = open_site_data(entry, cache_dir, chunk_bytes=chunk_bytes, hold_out=False)
        except DataError as error:
            raise DataError(f"data.eval.{name}: {error}") from None
        shared = sorted(set(_real_files(corpus.train_files)) & set(trained))
        if shared:
            raise DataError(f"data.eval.{name}: {trained[shared[0]]!r} is also a training file of this site; "
                            "an eval set must be held out (remove it from [node.data] paths or from the set)")
        sets.append((name, corpus.train))
    return tuple(sets)


def _index_in_own_file(array: np.ndarray, name: str) -> int | None:
    """Where `array` begins in the token file `name`, when it is a view of that file's memory map
    (None otherwise, e.g. a text file's ids in the cache). The map's root array starts at the
    file's first token, so the distance between the data pointers is the position."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    filename = getattr(root, "filename", None)
    if not isinstance(root.base, mmap.mmap) or not filename or os.path.realpath(filename) != os.path.realpath(name):
        return None
    return (array.ctypes.data - root.ctypes.data) // array.itemsize


def check_tokens(corpus: Corpus, vocab_size: int) -> None:
    """Every token id of the corpus below `vocab_size` (the model's vocabulary), scanned in chunks of
    `token_files.SCAN_CHUNK_TOKENS` so memory stays bounded; a DataError names the first offender:
    its file (or the train/eval split of an in-memory corpus), its position and its value. A
    tokenizer whose vocabulary exceeds the model's is refused even before an id shows it."""
    if corpus.tokenizer_vocab_size > vocab_size:
        raise DataError(f"{corpus.description}: the tokenizer's vocabulary ({corpus.tokenizer_vocab_size} ids) is "
                        f"larger than model.vocab_size = {vocab_size}; raise run.model.vocab_size to at least "
                        f"{corpus.tokenizer_vocab_size}")
    splits = [("train split", corpus.train), ("eval split", corpus.eval)]
    splits += [(f"eval set {name!r}", stream) for name, stream in corpus.eval_sets]
    for split_name, split in splits:
        parts = split.parts if isinstance(split, token_files.TokenStream) else [(split_name, split)]
        for name, array in parts:
            for start in range(0, len(array), token_files.SCAN_CHUNK_TOKENS):
                chunk = np.asarray(array[start:start + token_files.SCAN_CHUNK_TOKENS])
                if not chunk.size or int(chunk.max()) < vocab_size:
                    continue
                position = start + int(np.argmax(chunk >= vocab_size))
                value = int(chunk[position - start])
                limit = f"not below model.vocab_size = {vocab_size}"
                if name == split_name:
                    raise DataError(f"the {split_name} of {corpus.description}: id {value} at position {position}, {limit}")
                in_file = _index_in_own_file(array, name)
                if in_file is not None:
                    raise DataError(f"token file {name!r}: id {value} at position {in_file + position}, {limit}")
                raise DataError(f"text file {name!r}: id {value} at token {position} of the file, {limit} "
                                f"(the tokenizer's vocabulary is {corpus.vocab_size})")


def check_tokenizer(run_sha256: str, spec: SiteData) -> str | None:
    """Refuse a site whose tokenizer is not the run's (`[run.data] tokenizer_sha256`); a DataError
    says what differs and what to do. Returns a warning when the agreement cannot be checked (token
    files that name no tokenizer in a tokenized run), else None."""
    ours = tokenizer_digest(spec.tokenizer) if spec.tokenizer else ""
    if ours:
        if not run_sha256:
            raise DataError(f"node.data.tokenizer {spec.tokenizer!r} (sha256 {ours}): the run names no tokenizer, "
                            "so no site could check it tokenizes alike; found the run with it "
                            f"(or set run.data.tokenizer_sha256 = \"{ours}\" at the founding site)")
        if ours != run_sha256:
            raise DataError(f"node.data.tokenizer {spec.tokenizer!r} (sha256 {ours}) is not the run's tokenizer "
                            f"(sha256 {run_sha256}): every site must tokenize with the same tokenizer.json")
        return None
    if not run_sha256:
        return None
    if all(leaf.source == "tokens" for leaf in spec.leaves()):
        return (f"the run's data is tokenized by the tokenizer with sha256 {run_sha256}; this site's token files "
                "name no tokenizer, so which one made them is not checked (set node.data.tokenizer to check it)")
    raise DataError(f"the run's data is tokenized by the tokenizer with sha256 {run_sha256}, but this site reads "
                    f"{spec.describe()} as bytes: set node.data.tokenizer to the run's tokenizer.json")


def seal_tokenizer(manifest: RunManifest, spec: SiteData) -> RunManifest:
    """The manifest a founding learner publishes: its tokenizer's digest in `[run.data]` (a
    configured `tokenizer_sha256` must be the same file's)."""
    if not spec.tokenizer:
        return manifest
    ours = tokenizer_digest(spec.tokenizer)
    configured = manifest.data.tokenizer_sha256
    if configured and configured != ours:
        raise DataError(f"node.data.tokenizer {spec.tokenizer!r} has sha256 {ours}, but run.data.tokenizer_sha256 "
                        f"= {configured}: they must name the same tokenizer.json")
    return dataclasses.replace(manifest, data=DataAgreement(ours))


def shard_bounds(num_tokens: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of each of `num_shards` contiguous, disjoint, near-equal ranges."""
    if num_shards < 1:
        raise ValueError(f"num_shards = {num_shards}: must be >= 1")
    edges = [num_tokens * i // num_shards for i in range(num_shards + 1)]
    return [(edges[i], edges[i + 1]) for i in range(num_shards)]


class BatchSampler:
    """Random (inputs_BxL, targets_BxL) windows from one token range, reproducible from its seed."""

    def __init__(self, tokens: np.ndarray | token_files.TokenStream, batch_size: int, seq_len: int, seed: int,
                 learner: int = 0):
        self._entries: list[tuple[str, float, Any]] = []
        if isinstance(tokens, Mixture):
            for name, _, stream in tokens.entries:
                if len(stream) < seq_len + 2:
                    raise DataError(f"data.mix.{name}: its train split of {len(stream)} tokens is too small for "
                                    f"seq_len {seq_len}")
            self._entries = tokens.entries
            weights = np.array([weight for _, weight, _ in self._entries], dtype=np.float64)
            self._shares = weights / weights.sum()
            self._highs = np.array([len(stream) - seq_len - 1 for _, _, stream in self._entries], dtype=np.int64)
        elif len(tokens) < seq_len + 2:
            raise DataError(f"shard of {len(tokens)} tokens is too small for seq_len {seq_len}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed, self.learner = seed, learner
        self._rng = np.random.default_rng([seed, learner])

    def _identity(self) -> dict[str, Any]:
        """What a saved position is only valid for; a mixture adds its entries (name, weight, length)."""
        mine: dict[str, Any] = {"seed": self.seed, "learner": self.learner, "tokens": len(self.tokens),
                                "batch": [self.batch_size, self.seq_len]}
        if self._entries:
            mine["mixture"] = [[name, weight, len(stream)] for name, weight, stream in self._entries]
        return mine

    def state(self) -> str:
        """Where the sampler stands (JSON): a learner checkpoint keeps it, so a restarted site
        continues with the batches it had not drawn yet instead of replaying the first ones."""
        return json.dumps(self._identity() | {"generator": self._rng.bit_generator.state})

    def restore(self, saved_state: str | Mapping[str, Any]) -> None:
        """Continue from `state()` (its JSON text, or that text parsed into a dict); a DataError
        (nothing changed) when it belongs to another sampler: another seed, learner, batch shape
        or shard length (the data changed), or another mixture (entries, weights or lengths)."""
        try:
            saved = dict(saved_state) if isinstance(saved_state, Mapping) else json.loads(saved_state)
            mine = self._identity()
            differs = sorted(k for k, v in mine.items() if saved.get(k) != v)
            generator = saved["generator"]
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise DataError(f"sampler state is malformed: {error!r}") from None
        if differs:
            raise DataError("sampler state belongs to another sampler (" + ", ".join(
                f"{k}: saved {saved.get(k)!r}, now {mine[k]!r}" for k in differs) + ")")
        rng = np.random.default_rng()
        try:
            rng.bit_generator.state = generator
        except (ValueError, TypeError, KeyError) as error:
            raise DataError(f"sampler state: the generator state is malformed: {error!r}") from None
        self._rng = rng

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        if self._entries:
            # Each row from an entry drawn by weight, then a window of that entry: one generator, so
            # the batches are reproducible from the seed and resumable from state().
            entry_B = self._rng.choice(len(self._entries), size=self.batch_size, p=self._shares)
            starts_B = self._rng.integers(0, self._highs[entry_B])
            windows_BxL1 = np.stack([np.asarray(self._entries[e][2][s:s + self.seq_len + 1])
                                     for e, s in zip(entry_B, starts_B)]).astype(np.int32)
            return windows_BxL1[:, :-1], windows_BxL1[:, 1:]
        starts_B = self._rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        windows_BxL1 = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts_B]).astype(np.int32)
        return windows_BxL1[:, :-1], windows_BxL1[:, 1:]


def eval_batches(tokens: np.ndarray, num_batches: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed held-out set: windows evenly spaced over the eval stream, as (N, B, L) arrays."""
    count = num_batches * batch_size
    if len(tokens) < seq_len + 2:
        raise DataError(f"eval split of {len(tokens)} tokens is too small for seq_len {seq_len}")
    starts = np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)
    windows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts]).astype(np.int32)
    windows = windows.reshape(num_batches, batch_size, seq_len + 1)
    return windows[..., :-1], windows[..., 1:]
