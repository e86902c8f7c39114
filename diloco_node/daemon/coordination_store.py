"""Durable coordination state: the election state, the replicated log and the node's run identity.

The coordination core (`bootstrap.coordinator_node`) mutates its `PersistentState` in place and
requires it to be on disk before any message that depends on it leaves the node. `sync()` is
called after every batch of actions and before sending them; it writes only what changed:

- `election.json` (epoch, vote): rewritten atomically (temp file, fsync, rename, fsync dir);
- `log.bin`: records `u32 length | u32 crc32 | msgpack body`, fsynced. The first record may be a
  snapshot header (`{"snapshot": [last_index, last_epoch, voters]}`): the log was compacted (or a
  snapshot installed) through `last_index`, and the entry records that follow start right after
  it. A file without a header is a log from index 1 (the format before compaction existed).
  New entries are appended. When the log was truncated (a conflicting uncommitted suffix replaced
  by a new leader), compacted, or a snapshot was installed, the whole file (header and kept
  entries) is rewritten to `.log.bin.tmp` and renamed over `log.bin`: a crash at any moment
  leaves the old log or the new one, never a mix; a temp file left behind is deleted at load.
  A torn last record (crash mid-append) fails its CRC and is dropped at load: it was never
  acknowledged, since acknowledgements leave only after `sync()` returned. A header is only ever
  written by a rewrite, so a damaged header is corruption and refuses to load;
- `identity.json`: node id, role, run manifest and the address book (rewritten when changed).

Payloads live in `log.bin`, not in memory: once an entry is on disk (appended, rewritten or
loaded) the in-memory log keeps its metadata and a `StoredPayload` that reads the record back
(CRC checked, index and epoch compared) whenever the entry is sent to a follower, applied,
rewritten or compacted. Only payloads up to `INLINE_PAYLOAD_BYTES` (no-ops, membership) stay in
memory. The store knows where each entry's record is in the current file and moves that map with
every rewrite and compaction, so a reference stays valid for as long as its entry is in the log.

The snapshot's application state is not stored here: the global state lives in the node's
checkpoints (diloco_node/ops/checkpoint.py) and a lagging node fetches it from peers (join.py).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from bootstrap.coordinator_node import PersistentState
from bootstrap.election import ElectionState
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, PayloadUnavailable, Snapshot, StoredPayload
from bootstrap.replog import LogStore
from diloco_node.ops.checkpoint import fsync_dir

_RECORD_HEAD = struct.Struct("<II")
# One entry holds one merged fragment delta (at most wire.limits.MAX_RELAYED_PAYLOAD_BYTES) and its
# fields; the record's u32 length field can say no more than this (a torn length is caught by the
# file's end and the CRC).
MAX_RECORD_BYTES = 2**32 - 1
# A payload kept outside memory is copied into a record this much at a time (CRC computed as it goes).
WRITE_PIECE_BYTES = 4 * 1024 * 1024
_SNAPSHOT_KEY = "snapshot"
# Payloads up to this size stay in memory (no-ops, membership, tests' small entries): a reference
# and a read per use would cost more than the bytes.
INLINE_PAYLOAD_BYTES = 4096
INITIAL_SNAPSHOT = Snapshot(0, 0, ClusterConfig())


def compaction_point(*, checkpoint_index: int, commit_index: int, snapshot_index: int,
                     retain: int) -> tuple[int | None, str]:
    """How far the log may be compacted after a verified checkpoint at `checkpoint_index`.

    Never past the checkpoint (a restart replays the log from it, so checkpoint and log must
    stay contiguous) nor past the commit index, and `retain` entries below that are kept for
    peers that lag a little; and only once the cut drops at least half as many entries as it keeps.
    Returns (index to compact through, or None; reason).
    """
    bound = min(checkpoint_index, commit_index)
    through = bound - retain
    if through <= snapshot_index:
        return None, (f"nothing to compact: checkpoint {checkpoint_index}, commit {commit_index}, keeping "
                      f"{retain} entries puts the cut at {through}, log already starts after {snapshot_index}")
    # A cut rewrites the retained tail; waiting until it drops at least half as many entries as it
    # keeps bounds the rewriting at ~3x the log's own writes, however often checkpoints come.
    min_drop = max(1, retain // 2)
    if through - snapshot_index < min_drop:
        return None, (f"not yet: the cut at {through} would drop {through - snapshot_index} entries, "
                      f"fewer than {min_drop} (half the {retain} kept)")
    return through, (f"compact through {through}: {retain} entries kept below "
                     f"min(checkpoint {checkpoint_index}, commit {commit_index})")


class CoordinationStoreError(Exception):
    """The durable coordination state is unreadable; the message names the file."""


class PayloadGone(CoordinationStoreError, PayloadUnavailable):
    """An entry's payload is no longer in log.bin (truncated or compacted away) or its record is damaged."""


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _atomic_write(path: Path, data: bytes) -> None:
    temp = _temp_path(path)
    with open(temp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)
    fsync_dir(path.parent)


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
    snapshot, located, valid = _scan_log(io.BytesIO(data), len(data), path)
    return snapshot, [entry for entry, _, _ in located], valid


def _scan_log(handle: Any, size: int, path: Path) -> tuple[Snapshot, list[tuple[LogEntry, int, int]], int]:
    """Read a log record by record from `handle` (`size` bytes): (snapshot, [(entry, record offset,
    record length)], byte length of the valid prefix). Entries carry their payload bytes; the
    caller decides what stays in memory (one record is in memory at a time)."""
    snapshot = INITIAL_SNAPSHOT
    entries: list[tuple[LogEntry, int, int]] = []
    offset = 0
    while offset + _RECORD_HEAD.size <= size:
        handle.seek(offset)
        length, crc = _RECORD_HEAD.unpack(handle.read(_RECORD_HEAD.size))
        start = offset + _RECORD_HEAD.size
        complete = length <= MAX_RECORD_BYTES and start + length <= size
        body = handle.read(length) if complete else b""
        if not complete or zlib.crc32(body) != crc:
            if offset == 0 and complete:
                # Only an append can be torn, and a header is written by an atomic rewrite: a
                # complete first record that fails its checksum is damage, and dropping it
                # would silently throw the whole log away.
                raise CoordinationStoreError(f"{path}: the first record fails its checksum; the log is damaged")
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
            entries.append((record, offset, _RECORD_HEAD.size + length))
        offset = start + length
    return snapshot, entries, offset


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


class CoordinationStore:
    """The files of one node's coordination state under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._election_path = self.directory / "election.json"
        self._log_path = self.directory / "log.bin"
        self._identity_path = self.directory / "identity.json"
        self._written_election: tuple[int, str | None] | None = None
        self._written_snapshot: tuple[int, int] = (0, 0)  # (last_index, last_epoch) of the header
        self._written_count = 0
        self._written_last: tuple[int, int] | None = None  # (index, epoch) of the last persisted entry
        self._written_identity: str | None = None
        self._log_bytes = 0
        self._log_handle: Any = None
        # Where each entry's record is in the current log.bin: index -> (epoch, offset, length).
        # Read by StoredPayload readers on any thread, replaced on the loop: under the lock, with
        # the read descriptor (reopened after a rename).
        self._locations: dict[int, tuple[int, int, int]] = {}
        self._read_lock = threading.Lock()
        self._read_fd = -1

    # ---- what is on disk --------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        return self._log_path

    @property
    def log_first_index(self) -> int:
        """The first index `log.bin` holds an entry for (1 until the log is compacted)."""
        return self._written_snapshot[0] + 1

    @property
    def log_bytes(self) -> int:
        """Size of `log.bin` as last written."""
        return self._log_bytes

    # ---- loading ----------------------------------------------------------------------------

    def exists(self) -> bool:
        return self._identity_path.exists()

    def load_identity(self) -> dict[str, Any]:
        try:
            identity = json.loads(self._identity_path.read_text())
        except (OSError, ValueError) as error:
            raise CoordinationStoreError(f"{self._identity_path}: unreadable: {error}") from None
        self._written_identity = json.dumps(identity, sort_keys=True)
        return identity

    def load_persistent(self) -> PersistentState:
        """The coordination state as last synced (a torn log tail is dropped and the file trimmed)."""
        election = ElectionState()
        if self._election_path.exists():
            try:
                raw = json.loads(self._election_path.read_text())
                election = ElectionState(int(raw["current_epoch"]), raw.get("voted_for"))
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise CoordinationStoreError(f"{self._election_path}: unreadable: {error}") from None
        # A rewrite that crashed before its rename: log.bin is still the complete old log.
        _temp_path(self._log_path).unlink(missing_ok=True)
        self._compaction_path.unlink(missing_ok=True)
        snapshot, entries = INITIAL_SNAPSHOT, []
        if self._log_path.exists():
            with open(self._log_path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                snapshot, located, valid = _scan_log(handle, size, self._log_path)
            if valid != size:
                with open(self._log_path, "r+b") as handle:
                    handle.truncate(valid)
                    os.fsync(handle.fileno())
            self._log_bytes = valid
            self._set_locations([(e.index, e.epoch, offset, length) for e, offset, length in located], replace=True)
            entries = [self._stored(e) for e, _, _ in located]
        self._written_election = (election.current_epoch, election.voted_for)
        self._written_snapshot = (snapshot.last_index, snapshot.last_epoch)
        self._written_count = len(entries)
        self._written_last = (entries[-1].index, entries[-1].epoch) if entries else None
        return PersistentState(election, LogStore(snapshot, entries))

    # ---- writing ----------------------------------------------------------------------------

    def save_identity(self, identity: dict[str, Any]) -> None:
        text = json.dumps(identity, sort_keys=True)
        if text != self._written_identity:
            _atomic_write(self._identity_path, text.encode())
            self._written_identity = text

    def sync(self, state: PersistentState, prepared: PreparedLog | None = None) -> None:
        """Make `state` durable (only the parts that changed since the last call).

        `prepared`: a compaction written by `prepare_compaction`, used when `state` carries its
        snapshot and still begins with its entries (else the log is rewritten whole).
        """
        election = (state.election.current_epoch, state.election.voted_for)
        if election != self._written_election:
            _atomic_write(self._election_path,
                          json.dumps({"current_epoch": election[0], "voted_for": election[1]}).encode())
            self._written_election = election
        snapshot, entries = state.log.snapshot, state.log.entries
        count = self._written_count
        same_snapshot = (snapshot.last_index, snapshot.last_epoch) == self._written_snapshot
        prefix_intact = same_snapshot and len(entries) >= count and (
            count == 0 or (entries[count - 1].index, entries[count - 1].epoch) == self._written_last)
        if not same_snapshot and prepared is not None and prepared.fits(snapshot, entries):
            self._finish_compaction(prepared, entries)
            prepared = None
        elif not prefix_intact:
            self._rewrite(snapshot, entries)
        elif len(entries) > count:
            self._append(entries, count)
        if prepared is not None:  # the state moved on differently (e.g. a snapshot was installed)
            self.discard_prepared()
        self._written_snapshot = (snapshot.last_index, snapshot.last_epoch)
        self._written_last = (entries[-1].index, entries[-1].epoch) if entries else None
        self._written_count = len(entries)

    def _append(self, entries: list[LogEntry], start: int) -> None:
        """Append `entries[start:]`; in memory they then keep only a reference to their payload."""
        if self._log_handle is None:
            self._log_handle = open(self._log_path, "ab")
        located, end = _write_records(self._log_handle, self._log_bytes, entries[start:])
        self._log_handle.flush()
        os.fsync(self._log_handle.fileno())
        self._log_bytes = end
        self._set_locations(located)
        self._store_payloads(entries, start)

    def _rewrite(self, snapshot: Snapshot, entries: list[LogEntry]) -> None:
        """Header and entries in one atomic replacement: compaction and truncation are crash-safe.

        Written record by record (payloads read from the old file) to the temp file, then renamed."""
        self.close()
        temp = _temp_path(self._log_path)
        header = _encode_snapshot(snapshot)
        with open(temp, "wb") as handle:
            handle.write(header)
            located, end = _write_records(handle, len(header), entries)
            handle.flush()
            os.fsync(handle.fileno())
        self._replace_log(temp, located)
        self._log_bytes = end
        self._store_payloads(entries, 0)

    # ---- payloads on disk -----------------------------------------------------------------------

    def _replace_log(self, written: Path, located: list[tuple[int, int, int, int]]) -> None:
        """Rename `written` over log.bin and switch readers to it in one step: a reader on another
        thread sees the old file with the old map or the new file with the new map, never a mix."""
        with self._read_lock:
            os.replace(written, self._log_path)
            if self._read_fd >= 0:
                os.close(self._read_fd)
                self._read_fd = -1
            self._locations = {index: (epoch, offset, length) for index, epoch, offset, length in located}
        fsync_dir(self.directory)

    def _set_locations(self, located: list[tuple[int, int, int, int]], replace: bool = False) -> None:
        with self._read_lock:
            if replace:
                self._locations = {}
            for index, epoch, offset, length in located:
                self._locations[index] = (epoch, offset, length)

    def _stored(self, entry: LogEntry) -> LogEntry:
        """`entry` with its payload as a reference into log.bin (small payloads stay inline; a
        transient one, e.g. in a relay's spool file, is replaced: log.bin holds it now)."""
        payload = entry.payload
        if isinstance(payload, StoredPayload):
            if not payload.transient:
                return entry
            if payload.size <= INLINE_PAYLOAD_BYTES:
                return dataclasses.replace(entry, payload=payload.read())
        elif len(payload) <= INLINE_PAYLOAD_BYTES:
            return entry
        reader = functools.partial(self.read_payload, entry.index, entry.epoch)
        prefix = len(_record_parts(entry)[0])
        pieces = functools.partial(self.read_payload_pieces, entry.index, entry.epoch, prefix, entry.payload_size)
        return dataclasses.replace(entry, payload=StoredPayload(entry.payload_size, reader, pieces=pieces))

    def _store_payloads(self, entries: list[LogEntry], start: int) -> None:
        """Swap the payloads of `entries[start:]` (just written) for references, in place: the
        core's log list is the one that holds them for as long as they are in the log."""
        for position in range(start, len(entries)):
            entries[position] = self._stored(entries[position])

    def read_payload(self, index: int, epoch: int) -> bytes:
        """The payload of entry `index` of `epoch` from log.bin (any thread): the record's CRC,
        index and epoch are checked. CoordinationStoreError when the log no longer holds that entry
        (truncated or compacted away) or the record is damaged."""
        with self._read_lock:
            location = self._locations.get(index)
            if location is None or location[0] != epoch:
                raise PayloadGone(f"{self._log_path}: entry {index} of epoch {epoch} is no longer in the log")
            _, offset, length = location
            if self._read_fd < 0:
                self._read_fd = os.open(self._log_path, os.O_RDONLY)
            record = _pread_all(self._read_fd, length, offset)
        if len(record) != length:
            raise PayloadGone(f"{self._log_path}: entry {index}: short read at byte {offset}")
        size, crc = _RECORD_HEAD.unpack_from(record)
        body = memoryview(record)[_RECORD_HEAD.size:]
        if size != len(body) or zlib.crc32(body) != crc:
            raise PayloadGone(f"{self._log_path}: entry {index}: the record at byte {offset} fails its checksum")
        try:
            entry = _decode_body(msgpack.unpackb(body, raw=False), offset, self._log_path)
        except (ValueError, msgpack.UnpackException) as error:
            raise PayloadGone(f"{self._log_path}: entry {index}: not msgpack: {error}") from None
        if not isinstance(entry, LogEntry) or (entry.index, entry.epoch) != (index, epoch):
            raise PayloadGone(f"{self._log_path}: the record at byte {offset} is not entry {index} of epoch {epoch}")
        return entry.payload_bytes()

    def read_payload_pieces(self, index: int, epoch: int, prefix: int, size: int, piece_bytes: int) -> Iterator[bytes]:
        """The payload of entry `index` of `epoch` from log.bin, `piece_bytes` at a time (any thread),
        without the record in memory. `prefix` is the body's length before the payload (`_record_parts`).

        The record's CRC covers all of it, so it is known good only at the end: a damaged record
        raises PayloadGone after its last piece (a caller that must not act on bad bytes, like a
        hash taken before sending, finishes reading first). The pieces come from the file that held
        the entry when reading started, even if a rewrite replaces log.bin meanwhile.
        """
        with self._read_lock:
            location = self._locations.get(index)
            if location is None or location[0] != epoch:
                raise PayloadGone(f"{self._log_path}: entry {index} of epoch {epoch} is no longer in the log")
            _, offset, length = location
            fd = os.open(self._log_path, os.O_RDONLY)
        try:
            head = _pread_all(fd, _RECORD_HEAD.size + prefix, offset)
            if len(head) != _RECORD_HEAD.size + prefix:
                raise PayloadGone(f"{self._log_path}: entry {index}: short read at byte {offset}")
            body_length, crc = _RECORD_HEAD.unpack_from(head)
            if body_length != length - _RECORD_HEAD.size or prefix + size > body_length:
                raise PayloadGone(f"{self._log_path}: entry {index}: the record at byte {offset} is not "
                                  f"{size} payload bytes long")
            running = zlib.crc32(memoryview(head)[_RECORD_HEAD.size:])
            position = offset + _RECORD_HEAD.size + prefix
            end = position + size
            while position < end:
                piece = _pread_all(fd, min(piece_bytes, end - position), position)
                if not piece:
                    raise PayloadGone(f"{self._log_path}: entry {index}: short read at byte {position}")
                running = zlib.crc32(piece, running)
                position += len(piece)
                yield piece
            rest = _pread_all(fd, offset + length - end, end)
            if zlib.crc32(rest, running) != crc:
                raise PayloadGone(f"{self._log_path}: entry {index}: the record at byte {offset} fails its checksum")
        finally:
            os.close(fd)

    # ---- compaction, written mostly off the event loop -----------------------------------------

    @property
    def _compaction_path(self) -> Path:
        return self._log_path.with_name(f".{self._log_path.name}.compact.tmp")

    def prepare_compaction(self, snapshot: Snapshot, committed: list[LogEntry]) -> PreparedLog:
        """Write the compacted log's header and `committed` entries (the ones right after the
        snapshot; committed, so no leader ever truncates them) to a temp file and fsync it.

        The slow part of a compaction (megabytes of entries), safe to run in a worker thread while
        `sync()` keeps appending to the live `log.bin` (this touches no attribute of the store).
        The compaction takes effect at `sync(state, prepared)` once the state carries this
        snapshot: only the entries after `committed` are then appended and the file renamed over
        `log.bin` (atomic). A crash before the rename leaves the old log and a temp file that the
        next load deletes.
        """
        if committed and committed[0].index != snapshot.last_index + 1:
            raise CoordinationStoreError(f"compaction: entry {committed[0].index} does not follow the snapshot "
                                    f"through {snapshot.last_index}")
        header = _encode_snapshot(snapshot)
        with open(self._compaction_path, "wb") as handle:
            handle.write(header)
            located, end = _write_records(handle, len(header), committed)  # payloads read from log.bin
            handle.flush()
            os.fsync(handle.fileno())
        last = (committed[-1].index, committed[-1].epoch) if committed else None
        return PreparedLog((snapshot.last_index, snapshot.last_epoch), len(committed), last, end, tuple(located))

    def discard_prepared(self) -> None:
        self._compaction_path.unlink(missing_ok=True)

    def _finish_compaction(self, prepared: PreparedLog, entries: list[LogEntry]) -> None:
        self.close()
        with open(self._compaction_path, "ab") as handle:
            located, end = _write_records(handle, prepared.size, entries[prepared.count:])
            handle.flush()
            os.fsync(handle.fileno())
        self._replace_log(self._compaction_path, [*prepared.located, *located])
        self._log_bytes = end
        self._store_payloads(entries, 0)

    def close(self) -> None:
        """Close the files (reads reopen what they need)."""
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        with self._read_lock:
            if self._read_fd >= 0:
                os.close(self._read_fd)
                self._read_fd = -1


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
