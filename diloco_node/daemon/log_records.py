"""log.bin's records: encoding entries and the snapshot header, scanning a file back, copying payloads.

A record is `u32 length | u32 crc32 | msgpack body`. The body is an entry
`[epoch, index, kind, payload, fragment, round, digest, voters]`, or, as the first record only, a
snapshot header `{"snapshot": [last_index, last_epoch, voters]}`. The store (coordination_store.py)
decides when records are appended, rewritten and fsynced; this module only makes and reads them,
one record (or one piece of a payload) in memory at a time.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgpack

from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, PayloadUnavailable, Snapshot, StoredPayload
from diloco_node.ops.storage_health import STORAGE

_RECORD_HEAD = struct.Struct("<II")
# One entry holds one merged fragment delta (at most wire.limits.MAX_RELAYED_PAYLOAD_BYTES) and its
# fields; the record's u32 length field can say no more than this (a torn length is caught by the
# file's end and the CRC).
MAX_RECORD_BYTES = 2**32 - 1
# A payload kept outside memory is copied into a record this much at a time (CRC computed as it goes).
WRITE_PIECE_BYTES = 4 * 1024 * 1024
_SNAPSHOT_KEY = "snapshot"
INITIAL_SNAPSHOT = Snapshot(0, 0, ClusterConfig())


class CoordinationStoreError(Exception):
    """The durable coordination state is unreadable; the message names the file."""


class PayloadGone(CoordinationStoreError, PayloadUnavailable):
    """An entry's payload is no longer in log.bin (truncated or compacted away) or its record is damaged."""


class PayloadDamaged(PayloadGone):
    """An entry's record in log.bin fails its checksum: damage at rest, found at run time (failing
    `log.read` on /status until `repair_damage` has quarantined the file and kept its good prefix)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        STORAGE.failed("log.read", message)


def _record(body: bytes) -> bytes:
    return _RECORD_HEAD.pack(len(body), zlib.crc32(body)) + body


def _encode_entry(entry: LogEntry) -> bytes:
    voters = entry.config.sorted_voters() if entry.config is not None else None
    return _record(msgpack.packb([entry.epoch, entry.index, entry.kind.value, entry.payload_bytes(), entry.fragment,
                                  entry.round, entry.digest, voters], use_bin_type=True))


def _encode_snapshot(snapshot: Snapshot) -> bytes:
    """The header record of a compacted log (none for the initial snapshot: the old format)."""
    if snapshot.last_index == 0:
        return b""
    return _record(msgpack.packb({_SNAPSHOT_KEY: [snapshot.last_index, snapshot.last_epoch,
                                                  snapshot.config.sorted_voters()]}, use_bin_type=True))


def encode_log(snapshot: Snapshot, entries: list[LogEntry]) -> bytes:
    """The whole `log.bin` for a log holding `entries` after `snapshot`."""
    return _encode_snapshot(snapshot) + b"".join(_encode_entry(e) for e in entries)


def _decode_body(body: Any, offset: int, path: Path) -> LogEntry | Snapshot:
    try:
        if isinstance(body, dict):
            last_index, last_epoch, voters = body[_SNAPSHOT_KEY]
            return Snapshot(int(last_index), int(last_epoch), ClusterConfig.of(voters))
        epoch, index, kind, payload, fragment, round_, digest, voters = body
        config = ClusterConfig.of(voters) if voters is not None else None
        return LogEntry(epoch, index, EntryKind(kind), payload, fragment, round_, digest, config)
    except (ValueError, TypeError, KeyError) as error:
        raise CoordinationStoreError(f"{path}: record at byte {offset} is not a log entry: {error}") from None


def decode_log(data: bytes, path: Path) -> tuple[Snapshot, list[LogEntry], int]:
    """(snapshot, entries, byte length of the valid prefix): a torn tail is cut off."""
    snapshot, located, valid, _ = _scan_log(io.BytesIO(data), len(data), path)
    return snapshot, [entry for entry, _, _ in located], valid


@contextlib.contextmanager
def _step(point: str) -> Iterator[None]:
    """One durable step at failpoint `point`: its OSError is recorded (failing on /status) and
    re-raised; its success ends a failure streak there."""
    try:
        yield
    except OSError as error:
        STORAGE.failed(point, error)
        raise
    STORAGE.succeeded(point)


def without_payload(entry: LogEntry) -> LogEntry:
    """`entry` without its payload bytes (a `_scan_log` for the records' places only)."""
    return replace(entry, payload=b"")


def _scan_log(handle: Any, size: int, path: Path, keep: Callable[[LogEntry], LogEntry] | None = None,
              ) -> tuple[Snapshot, list[tuple[LogEntry, int, int]], int, str | None]:
    """Read a log record by record from `handle` (`size` bytes): (snapshot, [(entry, record offset,
    record length)], byte length of the valid prefix, damage). Entries carry their payload bytes,
    or what `keep` makes of each entry as it is read (`without_payload` for a scan of the records'
    places only, the loader's references into the file), so a long log is never held in memory whole.

    A last record that runs past the end of the file is a torn append (it was never fsynced, so
    never acknowledged): the scan stops there, `damage` None. A complete record that fails its
    checksum is damage at rest (an append is torn only at the file's end, and a crash keeps what
    was fsynced whole): the scan stops there too, and `damage` says where, so the loader can
    quarantine the file instead of silently dropping entries this node may have acknowledged."""
    snapshot = INITIAL_SNAPSHOT
    entries: list[tuple[LogEntry, int, int]] = []
    offset = 0
    damage = None
    while offset + _RECORD_HEAD.size <= size:
        handle.seek(offset)
        length, crc = _RECORD_HEAD.unpack(handle.read(_RECORD_HEAD.size))
        start = offset + _RECORD_HEAD.size
        complete = length <= MAX_RECORD_BYTES and start + length <= size
        body = handle.read(length) if complete else b""
        if not complete or zlib.crc32(body) != crc:
            if offset == 0 and complete:
                # A header is written by an atomic rewrite: a complete first record that fails its
                # checksum is damage, and dropping it would silently throw the whole log away.
                raise CoordinationStoreError(f"{path}: the first record fails its checksum; the log is damaged")
            if complete:
                damage = (f"the record at byte {offset} (after entry "
                          f"{entries[-1][0].index if entries else snapshot.last_index}) fails its checksum")
            break
        try:
            unpacked = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.UnpackException) as error:
            raise CoordinationStoreError(f"{path}: record at byte {offset} is not msgpack: {error}") from None
        del body
        record = _decode_body(unpacked, offset, path)
        if isinstance(record, Snapshot):
            if offset != 0:
                raise CoordinationStoreError(f"{path}: a snapshot header at byte {offset}; only the first record "
                                             "may be one")
            snapshot = record
        else:
            expected = entries[-1][0].index + 1 if entries else snapshot.last_index + 1
            if record.index != expected:
                after = f"entry {entries[-1][0].index}" if entries else f"the snapshot through {snapshot.last_index}"
                raise CoordinationStoreError(f"{path}: entry {record.index} follows {after}")
            if keep is not None:
                record = keep(record)
            entries.append((record, offset, _RECORD_HEAD.size + length))
        offset = start + length
    return snapshot, entries, offset, damage


def _record_parts(entry: LogEntry) -> tuple[bytes, bytes]:
    """An entry record's msgpack body without its payload: what comes before the payload's bytes
    (array header, epoch, index, kind, bin header) and after them (fragment, round, digest, voters)."""
    packer = msgpack.Packer(use_bin_type=True)
    voters = entry.config.sorted_voters() if entry.config is not None else None
    head = (packer.pack_array_header(8) + packer.pack(entry.epoch) + packer.pack(entry.index)
            + packer.pack(entry.kind.value) + _bin_header(entry.payload_size))
    tail = packer.pack(entry.fragment) + packer.pack(entry.round) + packer.pack(entry.digest) + packer.pack(voters)
    return head, tail


def _bin_header(size: int) -> bytes:
    """msgpack's bin header for `size` bytes (the form msgpack.packb itself picks)."""
    if size < 1 << 8:
        return struct.pack(">BB", 0xC4, size)
    if size < 1 << 16:
        return struct.pack(">BH", 0xC5, size)
    return struct.pack(">BI", 0xC6, size)


def _write_entry(handle: Any, entry: LogEntry) -> int:
    """Write `entry`'s record to `handle`; returns its length.

    A payload kept outside memory (`StoredPayload`: a spool file, or the old log during a rewrite)
    is copied a piece at a time: the record is the same msgpack array `_encode_entry` makes, its
    parts packed around the payload's bin header, and its CRC is computed over the pieces in a first
    pass (the header that carries it comes first in the file), so no whole payload is in memory.
    """
    payload = entry.payload
    if not isinstance(payload, StoredPayload):
        record = _encode_entry(entry)
        handle.write(record)
        return len(record)
    head, tail = _record_parts(entry)
    crc = zlib.crc32(head)
    for piece in payload.pieces(WRITE_PIECE_BYTES):
        crc = zlib.crc32(piece, crc)
    crc = zlib.crc32(tail, crc)
    length = len(head) + payload.size + len(tail)
    handle.write(_RECORD_HEAD.pack(length, crc))
    handle.write(head)
    for piece in payload.pieces(WRITE_PIECE_BYTES):
        handle.write(piece)
    handle.write(tail)
    return _RECORD_HEAD.size + length


def _write_records(handle: Any, start: int, entries: list[LogEntry]) -> tuple[list[tuple[int, int, int, int]], int]:
    """Append `entries` as records at byte `start` of `handle`, at most one payload (or one piece of
    one) in memory at a time. Returns ([(index, epoch, record offset, record length)], end offset)."""
    located = []
    offset = start
    for entry in entries:
        length = _write_entry(handle, entry)
        located.append((entry.index, entry.epoch, offset, length))
        offset += length
    return located, offset


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    parts = []
    while length > 0:
        part = os.pread(fd, length, offset)
        if not part:
            break
        parts.append(part)
        length -= len(part)
        offset += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class AppendFile:
    """log.bin opened for appending, unbuffered: after a failed write nothing stays queued to be
    flushed later, and a short write (a disk filling up) is continued until it completes or fails."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def flush(self) -> None:
        """Nothing is buffered."""

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        os.close(self._fd)


@dataclass(frozen=True, slots=True)
class PreparedLog:
    """A compacted log written to the temp file, waiting for the state that carries its snapshot."""

    snapshot: tuple[int, int]  # (last_index, last_epoch)
    count: int  # entries written after the header
    last: tuple[int, int] | None  # (index, epoch) of the last of them
    size: int
    located: tuple[tuple[int, int, int, int], ...] = ()  # (index, epoch, offset, length) of each record

    def fits(self, snapshot: Snapshot, entries: list[LogEntry]) -> bool:
        """True when `entries` (after `snapshot`) start with exactly the entries written."""
        if (snapshot.last_index, snapshot.last_epoch) != self.snapshot or len(entries) < self.count:
            return False
        return self.count == 0 or (entries[self.count - 1].index, entries[self.count - 1].epoch) == self.last
