"""Pre-tokenized data: one or more flat token files, memory-mapped, read as one stream.

A token file is a flat array of token ids: raw `.bin` (the dtype named in the config: uint8,
uint16 or uint32) or `.npy` (the dtype in its header, which must be the configured one). Nothing
is read whole: every file is an `np.memmap`, and `TokenStream` presents several of them as one
sequence (`len`, slicing), so a 100 GB corpus costs page cache, not memory. The samplers and the
eval windows only slice it.

uint16 holds ids below 65,536; vocabularies above that (Llama 3, Qwen, GPT-4-class tokenizers)
need uint32. (The vocabulary scan, naming the first id at or above the model's vocabulary with
its file and position, is `data.check_tokens`.)
"""

from __future__ import annotations

import bisect
import glob
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diloco_node.config.site_data import TOKEN_DTYPES

SCAN_CHUNK_TOKENS = 1 << 24  # 16M ids (64 MB of uint32) per step of a vocabulary scan


class TokenFileError(ValueError):
    """A token file cannot be used; the message names the file and why."""


class TokenStream:
    """Several memory-mapped token arrays as one read-only sequence (no copy)."""

    def __init__(self, parts: Sequence[tuple[str, np.ndarray]]) -> None:
        self.parts = [(name, array) for name, array in parts if len(array)]
        self.dtype = self.parts[0][1].dtype if self.parts else np.dtype(np.uint16)
        self._starts = [0]
        for _, array in self.parts:
            self._starts.append(self._starts[-1] + len(array))

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def size(self) -> int:
        return len(self)

    def __getitem__(self, index: slice | int) -> np.ndarray | TokenStream:
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"token {index} of a stream of {len(self)}")
            part = bisect.bisect_right(self._starts, i) - 1
            return self.parts[part][1][i - self._starts[part]]
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("token streams slice contiguously")
        if stop <= start:
            return np.empty(0, self.dtype)
        first = bisect.bisect_right(self._starts, start) - 1
        last = bisect.bisect_right(self._starts, stop - 1) - 1
        if first == last:  # one file: a view of its map, no copy
            offset = self._starts[first]
            return self.parts[first][1][start - offset:stop - offset]
        # A range over several files: a stream of views (samplers copy only their windows).
        pieces = []
        for p in range(first, last + 1):
            offset = self._starts[p]
            a, b = max(start, offset) - offset, min(stop, self._starts[p + 1]) - offset
            pieces.append((self.parts[p][0], self.parts[p][1][a:b]))
        return TokenStream(pieces)

    def sub(self, start: int, stop: int) -> TokenStream:
        """The range as a stream (views of the files, each still named)."""
        piece = self[start:stop]
        return piece if isinstance(piece, TokenStream) else TokenStream([(self.where(start)[0], piece)])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        joined = np.concatenate([array for _, array in self.parts]) if self.parts else np.empty(0, self.dtype)
        return joined if dtype is None else joined.astype(dtype)

    def where(self, position: int) -> tuple[str, int]:
        """(file, offset in it) of a position of the stream."""
        part = bisect.bisect_right(self._starts, position) - 1
        return self.parts[part][0], position - self._starts[part]


def expand_token_paths(patterns: Sequence[str]) -> list[Path]:
    """Files named by paths and globs, in the order given (each glob sorted); DataError-style
    messages for a pattern that matches nothing."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern))) if glob.has_magic(pattern) else [os.path.expanduser(pattern)]
        if not matches:
            raise TokenFileError(f"token files {pattern!r}: the glob matches no file")
        files.extend(Path(m) for m in matches)
    return files


def map_token_file(path: Path, dtype: str) -> np.ndarray:
    """One token file as a read-only memory map of `dtype` ids."""
    if dtype not in TOKEN_DTYPES:
        raise TokenFileError(f"token_dtype = {dtype!r}: must be one of {', '.join(TOKEN_DTYPES)}")
    if not path.is_file():
        raise TokenFileError(f"token file {str(path)!r}: no such file")
    if not os.access(path, os.R_OK):
        raise TokenFileError(f"token file {str(path)!r}: cannot read it (permission denied)")
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            raise TokenFileError(f"token file {str(path)!r}: not a readable .npy file ({error})") from None
        if array.ndim != 1:
            raise TokenFileError(f"token file {str(path)!r}: a .npy of shape {array.shape}; expected a flat 1-D array")
        if array.dtype != np.dtype(dtype):
            raise TokenFileError(f"token file {str(path)!r}: holds {array.dtype} ids, token_dtype is {dtype}")
        if not len(array):
            raise TokenFileError(f"token file {str(path)!r}: the file holds no tokens")
        return array
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0:
        raise TokenFileError(f"token file {str(path)!r}: the file is empty")
    if size % itemsize:
        raise TokenFileError(f"token file {str(path)!r}: {size} bytes is not a whole number of {dtype} tokens")
    try:
        return np.memmap(path, dtype=np.dtype(dtype), mode="r")
    except (OSError, ValueError) as error:
        raise TokenFileError(f"token file {str(path)!r}: cannot map it ({error})") from None


def open_token_stream(patterns: Sequence[str], dtype: str) -> TokenStream:
    return TokenStream([(str(path), map_token_file(path, dtype)) for path in expand_token_paths(patterns)])
