"""Training data: token sources, the train/eval split, per-learner shards and batches.

Three sources behind one interface (`load_corpus(spec) -> Corpus`):
- "stdlib": the running interpreter's own standard library `.py` files (present on every machine,
  nothing to download). Split into train/eval by a hash of each file's relative path.
- "text": user text files, directories or globs (`**` recurses), split the same way by path.
- "tokens": pre-tokenized files (a path or a glob; raw `.bin` of uint8, uint16 or uint32 ids, or
  `.npy`), memory-mapped and read as one stream, never loaded whole (token_files.py); the last
  `eval_fraction` of it is the eval split.
When a path split would leave one side empty (e.g. a single text file), the concatenated stream is
split by position instead (the tail is eval). A missing, empty or unreadable source is a
`DataError` naming the path.

Learner m trains on shard m: the m-th of M contiguous, disjoint ranges of the train stream.
Batches are random windows of seq_len + 1 tokens (inputs and shifted targets) from a generator
seeded by (seed, learner), so a run is reproducible.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from diloco_node.config.manifest import DataSpec
from diloco_node.learn import token_files

# Files of the stdlib that are not the standard library proper (third-party installs).
_STDLIB_EXCLUDED_DIRS = ("site-packages", "dist-packages")
# A split by file path needs this many files before both sides are reliably non-empty.
MIN_FILES_FOR_PATH_SPLIT = 20


class DataError(ValueError):
    """A data source is missing, empty, unreadable or too small; the message names the path."""


@dataclass(frozen=True)
class Corpus:
    """Train and eval token streams (uint8 or uint16 arrays, possibly memory-mapped)."""

    train: np.ndarray
    eval: np.ndarray
    vocab_size: int
    description: str
    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library `.py` files, sorted (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if not any(part in _STDLIB_EXCLUDED_DIRS for part in p.relative_to(root).parts)]
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


def _corpus_from_files(files: Sequence[Path], root: Path | None, spec: DataSpec, description: str) -> Corpus:
    names = [str(f.relative_to(root)) if root is not None else str(f) for f in files]
    by_name = dict(zip(names, files))
    train_names, eval_names = split_paths(names, spec.eval_fraction, spec.seed)
    if len(files) >= MIN_FILES_FOR_PATH_SPLIT and train_names and eval_names:
        train, evaluation = _concat([by_name[n] for n in train_names]), _concat([by_name[n] for n in eval_names])
        corpus = Corpus(train, evaluation, 256, description, tuple(train_names), tuple(eval_names))
    else:  # too few files to split by path: split the stream by position
        stream = _concat(files)
        cut = len(stream) - max(1, int(len(stream) * spec.eval_fraction))
        corpus = Corpus(stream[:cut], stream[cut:], 256, description + " (split by position)", tuple(names), ())
    if corpus.train.size == 0:
        raise DataError(f"data source {description}: contains no bytes")
    return corpus


def load_token_file(path: str, dtype: str, eval_fraction: float) -> Corpus:
    """Pre-tokenized files (a path or a glob; `.bin` of `dtype` ids or `.npy`), memory-mapped and
    read as one stream (learn/token_files.py): the head is train, the last `eval_fraction` eval."""
    try:
        stream = token_files.open_token_stream([path], dtype)
    except token_files.TokenFileError as error:
        raise DataError(str(error)) from None
    cut = len(stream) - max(1, int(len(stream) * eval_fraction))
    vocab = int(np.iinfo(np.dtype(dtype)).max) + 1
    return Corpus(stream.sub(0, cut), stream.sub(cut, len(stream)), vocab,
                  f"token file {path} ({dtype}, {len(stream)} tokens)")


def check_vocabulary(corpus: Corpus, vocab_size: int) -> None:
    """Every token id of the corpus below `vocab_size`: token files are scanned (in bounded chunks;
    the first offender is named with its file and position), byte sources need 256."""
    streams = [split for split in (corpus.train, corpus.eval) if isinstance(split, token_files.TokenStream)]
    if not streams:
        if corpus.vocab_size > vocab_size:
            raise DataError(f"the data ({corpus.description}) holds token ids up to {corpus.vocab_size - 1}, "
                            f"but model.vocab_size = {vocab_size}")
        return
    for stream in streams:
        try:
            token_files.check_token_ids(stream, vocab_size, corpus.description)
        except token_files.TokenFileError as error:
            raise DataError(str(error)) from None


def load_corpus(spec: DataSpec) -> Corpus:
    """The corpus named by a DataSpec (see the module docstring for the three sources)."""
    if spec.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_files()
        if not files:
            raise DataError(f"data source stdlib: no .py files under {str(root)!r}")
        return _corpus_from_files(files, root, spec, f"stdlib .py files under {root}")
    if spec.source == "text":
        files = expand_text_paths(spec.paths)
        return _corpus_from_files(files, None, spec, "text " + ", ".join(repr(p) for p in spec.paths))
    return load_token_file(spec.token_file, spec.token_dtype, spec.eval_fraction)


def shard_bounds(num_tokens: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of each of `num_shards` contiguous, disjoint, near-equal ranges."""
    if num_shards < 1:
        raise ValueError(f"num_shards = {num_shards}: must be >= 1")
    edges = [num_tokens * i // num_shards for i in range(num_shards + 1)]
    return [(edges[i], edges[i + 1]) for i in range(num_shards)]


class BatchSampler:
    """Random (inputs_BxL, targets_BxL) windows from one token range, reproducible from its seed."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, learner: int = 0):
        if len(tokens) < seq_len + 2:
            raise DataError(f"shard of {len(tokens)} tokens is too small for seq_len {seq_len}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed, self.learner = seed, learner
        self._rng = np.random.default_rng([seed, learner])

    def state(self) -> str:
        """Where the sampler stands (JSON): a learner checkpoint keeps it, so a restarted site
        continues with the batches it had not drawn yet instead of replaying the first ones."""
        return json.dumps({"seed": self.seed, "learner": self.learner, "tokens": len(self.tokens),
                           "batch": [self.batch_size, self.seq_len], "generator": self._rng.bit_generator.state})

    def restore(self, text: str) -> None:
        """Continue from `state()`; a DataError (nothing changed) when it belongs to another
        sampler: another seed, learner, batch shape or shard length (the data changed)."""
        try:
            saved = json.loads(text)
            mine = {"seed": self.seed, "learner": self.learner, "tokens": len(self.tokens),
                    "batch": [self.batch_size, self.seq_len]}
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
