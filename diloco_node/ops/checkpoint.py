"""A node's local checkpoints: atomic, self-verifying files in the data directory, with fallback.

File layout (`ckpt-<sequence>.bin`, all integers little-endian):

    header  56 bytes: magic b"DILOCOCK", format version u32, flags u32 (0),
            body length u64, sha256 of the body (32 bytes)
    body    index length u32, index (msgpack map: sequence, meta, arrays[name, dtype, shape,
            offset, nbytes]), then every array's raw bytes, each starting on a 64-byte boundary

No pickle anywhere: metadata is plain msgpack, arrays are raw bytes plus a dtype name from a
fixed list. A checkpoint is written to a temporary file in the same directory, fsynced, renamed
into place and the directory fsynced (`storage/durable.py`, failpoint `checkpoint.write`), so a crash
at any moment leaves either the old set of checkpoints or the old set plus one complete new file.
Loading (failpoint `checkpoint.read`) verifies magic, version, length and checksum and raises
`CheckpointError` naming the file; `load_latest` falls back to the previous good checkpoint and
quarantines a bad one as `*.corrupt-N` (kept for inspection, listed in `/status` by
`ops/storage_health.py`). A file that cannot be read at all (an I/O error, `CheckpointUnreadable`)
is skipped but left in place: the disk, not the file, may be what failed.

This module knows files, not their contents: array names and metadata keys are the callers'. The
global state's ("global/...", with "rounds", "state_digest", "norm_refs") come from
`sync/state_codec.py`, the learner's ("learner/...") from `learn/learner_thread.py`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import msgpack
import numpy as np

from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import durable, failpoints

MAGIC = b"DILOCOCK"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ32s")
HEADER_BYTES = _HEADER.size
_INDEX_LEN = struct.Struct("<I")
# Array data starts on cache-line boundaries so loaded views are well aligned for numpy/JAX.
ARRAY_ALIGNMENT = 64
# The index holds names, shapes and small metadata; 16 MiB is far beyond any real one and stops
# a corrupt length from asking msgpack for gigabytes.
MAX_INDEX_BYTES = 16 << 20
# Two checkpoints: the newest and one to fall back to if the newest turns out corrupt.
DEFAULT_KEEP = 3
MIN_KEEP = 2
# dtypes a checkpoint may hold (by numpy name); bfloat16 comes from ml_dtypes (a JAX dependency).
ALLOWED_DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16",
)
_NAME_RE = re.compile(r"^ckpt-(\d{12})\.bin$")
# Quarantined files: `.corrupt-N` (ops/storage_health.py), `.corrupt` and `.corrupt.N` (older builds).
_CORRUPT_RE = re.compile(r"^ckpt-(\d{12})\.bin(\.corrupt([.-]\d+)?)?$")
_TEMP_RE = re.compile(r"^\.ckpt-\d{12}\.bin\.tmp$")
LOCK_NAME = ".checkpoint.lock"


class CheckpointError(Exception):
    """A checkpoint file is unreadable, truncated, corrupt or of another format; the message names it."""


class CheckpointUnreadable(CheckpointError):
    """Reading a checkpoint failed with an I/O error (the disk, not necessarily the file)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint. Arrays are views into one buffer read from the file."""

    sequence: int
    meta: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]
    path: Path


@dataclass(frozen=True, slots=True)
class LoadResult:
    checkpoint: Checkpoint
    skipped: tuple[str, ...] = ()  # one reason per newer checkpoint that failed to load


@dataclass(slots=True)
class _Layout:
    index: bytes
    arrays: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (offset in body, contiguous LE array)
    body_len: int = 0


def _dtype(name: str) -> np.dtype:
    if name not in ALLOWED_DTYPES:
        raise ValueError(f"dtype {name!r} is not allowed in a checkpoint (allowed: {', '.join(ALLOWED_DTYPES)})")
    if name == "bfloat16":
        import ml_dtypes  # only when needed: plain numpy has no bfloat16

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name).newbyteorder("<")


def _layout(sequence: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> _Layout:
    entries = []
    prepared: list[np.ndarray] = []
    for name, array in arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"array name {name!r}: must be a non-empty string")
        array = np.asarray(array)
        dtype = _dtype(array.dtype.name)
        prepared.append(np.ascontiguousarray(array, dtype=dtype))
        entries.append({"name": name, "dtype": array.dtype.name, "shape": list(array.shape)})
    # Offsets depend on the index length, which depends on the offsets' encoded sizes: fix the
    # index size first with placeholder offsets of the largest width, then fill in.
    for entry, array in zip(entries, prepared):
        entry["offset"] = 1 << 62
        entry["nbytes"] = array.nbytes
    try:
        probe = msgpack.packb({"sequence": sequence, "meta": dict(meta), "arrays": entries}, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint metadata is not plain data (msgpack): {exc}") from None
    start = _align(_INDEX_LEN.size + len(probe))
    offset = start
    for entry, array in zip(entries, prepared):
        entry["offset"] = offset
        offset = _align(offset + array.nbytes)
    index = msgpack.packb({"sequence": sequence, "meta": dict(meta), "arrays": entries}, use_bin_type=True)
    assert len(index) <= len(probe), "smaller offsets never encode longer"
    layout = _Layout(index=index)
    layout.arrays = [(entry["offset"], array) for entry, array in zip(entries, prepared)]
    layout.body_len = offset
    return layout


def _align(n: int) -> int:
    return (n + ARRAY_ALIGNMENT - 1) // ARRAY_ALIGNMENT * ARRAY_ALIGNMENT


def _write_body(handle: Any, layout: _Layout) -> bytes:
    """Write the body after the header; return its sha256."""
    digest = hashlib.sha256()
    position = 0

    def put(data: bytes | memoryview) -> None:
        nonlocal position
        handle.write(data)
        digest.update(data)
        position += len(data)

    index_len = len(layout.index)
    put(_INDEX_LEN.pack(index_len))
    put(layout.index)
    for offset, array in layout.arrays:
        put(b"\x00" * (offset - position))
        put(memoryview(array.reshape(-1).view(np.uint8)))
    put(b"\x00" * (layout.body_len - position))
    return digest.digest()


def write_checkpoint_file(path: Path, sequence: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> int:
    """Atomically create `path` (temp file, fsync, rename, fsync dir). Returns the file size.

    Failpoint `checkpoint.write`: an error fires before anything is written; a crash before or
    after the temporary file's fsync (the temporary file is what a restart removes). A failed
    write removes the temporary file and leaves the checkpoints as they were."""
    layout = _layout(sequence, meta, arrays)
    failpoints.hit("checkpoint.write")
    temp = durable.temp_path(path)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        durable.track(temp)
        with os.fdopen(fd, "wb") as handle:
            handle.write(b"\x00" * HEADER_BYTES)  # placeholder until the body's checksum is known
            checksum = _write_body(handle, layout)
            handle.seek(0)
            handle.write(_HEADER.pack(MAGIC, FORMAT_VERSION, 0, layout.body_len, checksum))
            handle.flush()
            durable.sync_file("checkpoint.write", handle.fileno(), temp)
        os.replace(temp, path)
        durable.forget(temp)
        durable.sync_dir(path.parent)
    except BaseException:
        durable.forget(temp)
        temp.unlink(missing_ok=True)
        raise
    return HEADER_BYTES + layout.body_len


def _checked_header(path: Path, handle: BinaryIO) -> tuple[int, bytes]:
    """(body length, sha256 of the body) from a checkpoint's header, after checking it and the file's length."""
    header = handle.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        raise CheckpointError(f"{path}: truncated: {len(header)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, flags, body_len, checksum = _HEADER.unpack(header)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a diloco-node checkpoint (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version}, this build reads {FORMAT_VERSION}")
    if flags != 0:  # always written 0: so every bit of the file is checked, the header's too
        raise CheckpointError(f"{path}: header flags {flags:#x}, expected 0: corrupt")
    actual = os.fstat(handle.fileno()).st_size - HEADER_BYTES
    if actual != body_len:
        raise CheckpointError(f"{path}: truncated or padded: header says {body_len} body bytes, file has {actual}")
    return body_len, checksum


def read_checkpoint_file(path: Path) -> Checkpoint:
    """Load and verify one checkpoint file; any problem raises `CheckpointError` naming the file
    (`CheckpointUnreadable` for an I/O error)."""
    try:
        failpoints.hit("checkpoint.read")
        with path.open("rb") as handle:
            body_len, checksum = _checked_header(path, handle)
            body = bytearray(body_len)
            if handle.readinto(body) != body_len:
                raise CheckpointError(f"{path}: short read")
    except OSError as exc:
        raise CheckpointUnreadable(f"{path}: cannot read: {exc.strerror or exc}") from None
    if hashlib.sha256(body).digest() != checksum:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 of the body differs from the header): corrupt")
    return _decode_body(path, body)


def verify_checkpoint_file(path: Path, chunk_bytes: int = 8 * 1024 * 1024) -> dict[str, Any]:
    """Check one checkpoint file's checksum without loading it, and return its metadata.

    The same checks as `read_checkpoint_file` (header, length, sha256 of the body, the index),
    reading `chunk_bytes` at a time: compaction's "does the checkpoint read back intact" costs a
    chunk of memory, not the model. `CheckpointError` naming the file otherwise.
    """
    digest = hashlib.sha256()
    try:
        failpoints.hit("checkpoint.read")
        with path.open("rb") as handle:
            body_len, checksum = _checked_header(path, handle)
            head = handle.read(min(body_len, _INDEX_LEN.size + MAX_INDEX_BYTES))
            digest.update(head)
            while chunk := handle.read(chunk_bytes):
                digest.update(chunk)
    except OSError as exc:
        raise CheckpointUnreadable(f"{path}: cannot read: {exc.strerror or exc}") from None
    if digest.digest() != checksum:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 of the body differs from the header): corrupt")
    if len(head) < _INDEX_LEN.size:
        raise CheckpointError(f"{path}: body too short for its index")
    (index_len,) = _INDEX_LEN.unpack_from(head, 0)
    if index_len > MAX_INDEX_BYTES or _INDEX_LEN.size + index_len > len(head):
        raise CheckpointError(f"{path}: index length {index_len} out of bounds")
    try:
        meta = msgpack.unpackb(head[_INDEX_LEN.size:_INDEX_LEN.size + index_len], raw=False,
                               strict_map_key=True)["meta"]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise CheckpointError(f"{path}: bad index: {exc}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: bad index: meta is not a map")
    return meta


def _decode_body(path: Path, body: bytearray) -> Checkpoint:
    # The checksum matched, so a failure below means a writer bug or a forged file: still refuse clearly.
    (index_len,) = _INDEX_LEN.unpack_from(body, 0)
    if index_len > MAX_INDEX_BYTES or _INDEX_LEN.size + index_len > len(body):
        raise CheckpointError(f"{path}: index length {index_len} out of bounds")
    try:
        index = msgpack.unpackb(bytes(body[_INDEX_LEN.size:_INDEX_LEN.size + index_len]), raw=False,
                                strict_map_key=True)
        sequence = int(index["sequence"])
        meta = index["meta"]
        entries = index["arrays"]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise CheckpointError(f"{path}: bad index: {exc}") from None
    view = memoryview(body)
    arrays: dict[str, np.ndarray] = {}
    for entry in entries:
        try:
            name, dtype_name, shape = entry["name"], entry["dtype"], tuple(int(d) for d in entry["shape"])
            offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
            dtype = _dtype(dtype_name)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: bad array entry {entry!r}: {exc}") from None
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes != expected or offset < 0 or offset + nbytes > len(body):
            raise CheckpointError(f"{path}: array {name!r} ({dtype_name}{list(shape)}) does not fit the body")
        arrays[name] = np.frombuffer(view[offset:offset + nbytes], dtype=dtype).reshape(shape)
    return Checkpoint(sequence=sequence, meta=meta, arrays=arrays, path=path)


class CheckpointStore:
    """The checkpoints of one node in one directory: save with rotation, load the newest good one.

    Opening takes an exclusive lock on the directory (two daemons on one data dir would
    overwrite each other's state) and removes temporary files left by a crashed write.
    """

    def __init__(self, directory: Path, keep: int = DEFAULT_KEEP) -> None:
        if keep < MIN_KEEP:
            raise ValueError(f"keep = {keep}: must be >= {MIN_KEEP} so a corrupt newest checkpoint can fall back")
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise CheckpointError(f"{self.directory}: locked by another process (is another node using this data_dir?)") from None
        self.removed_partials: tuple[Path, ...] = tuple(self._remove_partials())

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = -1

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _remove_partials(self) -> list[Path]:
        removed = []
        for entry in self.directory.iterdir():
            if _TEMP_RE.match(entry.name):
                entry.unlink(missing_ok=True)
                removed.append(entry)
        return removed

    def sequences(self) -> list[int]:
        """Sequence numbers of the checkpoint files present (not quarantined), ascending."""
        return sorted(int(m.group(1)) for e in self.directory.iterdir() if (m := _NAME_RE.match(e.name)))

    def path_for(self, sequence: int) -> Path:
        return self.directory / f"ckpt-{sequence:012d}.bin"

    def _next_sequence(self) -> int:
        # Quarantined files count too, so a sequence number is never reused for a different file.
        used = [int(m.group(1)) for e in self.directory.iterdir() if (m := _CORRUPT_RE.match(e.name))]
        return max(used, default=0) + 1

    def save(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Path:
        """Write a new checkpoint atomically, then drop the oldest beyond `keep`. Returns its path."""
        sequence = self._next_sequence()
        path = self.path_for(sequence)
        write_checkpoint_file(path, sequence, meta, arrays)
        stale = self.sequences()[: -self.keep]
        for old in stale:
            self.path_for(old).unlink(missing_ok=True)
        if stale:
            durable.sync_dir(self.directory)
        return path

    def load_latest(self) -> LoadResult | None:
        """The newest checkpoint that verifies; None when there is none at all.

        A checkpoint that fails verification is renamed to `*.corrupt` and the next older one is
        tried. If files exist but none verifies, raises `CheckpointError` listing every reason:
        starting from scratch silently would throw away this node's work.
        """
        skipped: list[str] = []
        for sequence in reversed(self.sequences()):
            path = self.path_for(sequence)
            try:
                checkpoint = read_checkpoint_file(path)
                if checkpoint.sequence != sequence:
                    raise CheckpointError(f"{path}: holds sequence {checkpoint.sequence}, name says {sequence}")
                STORAGE.succeeded("checkpoint.read")
                return LoadResult(checkpoint, tuple(skipped))
            except CheckpointUnreadable as exc:  # left in place: the disk may be what failed
                skipped.append(str(exc))
                STORAGE.failed("checkpoint.read", str(exc))
            except CheckpointError as exc:
                skipped.append(str(exc))
                STORAGE.failed("checkpoint.read", str(exc))
                self.quarantine(path, str(exc))
        if skipped:
            raise CheckpointError("no loadable checkpoint; every candidate failed:\n  " + "\n  ".join(skipped))
        return None

    def quarantine(self, path: Path, reason: str) -> None:
        """Set a checkpoint that failed its check aside: `ckpt-N.bin.corrupt-K`, kept, named on /status."""
        STORAGE.quarantine(path, reason)
        durable.sync_dir(self.directory)
