"""Durable coordination state: the election state, the replicated log and the node's run identity.

The coordination core (`bootstrap.coordinator_node`) mutates its `PersistentState` in place and
requires it to be on disk before any message that depends on it leaves the node. `sync()` is
called after every batch of actions and before sending them; it writes only what changed:

- `election.json` and `election.copy.json` (epoch, vote), `identity.json` (node id, role, run
  manifest, address book): checksummed records replaced atomically (coordination_records.py);
- `log.bin`: records `u32 length | u32 crc32 | msgpack body` (log_records.py), fsynced. The first
  may be a snapshot header: the log was compacted (or a snapshot installed) through its index.
  New entries are appended; a failed append is cut back before the next. When the log was
  truncated (a conflicting uncommitted suffix replaced by a new leader), compacted, or a snapshot
  was installed, the whole file is rewritten to a temp file and renamed over `log.bin`: a crash
  leaves the old log or the new one, never a mix; a temp file left behind is deleted at load.
  A torn last record (crash mid-append) is dropped at load: it was never acknowledged, since
  acknowledgements leave only after `sync()` returned. A complete record failing its CRC is
  damage at rest: the file is quarantined and its good prefix kept (`damaged_after`), at load or,
  when a payload read finds it while running (`damage_found`), by `repair_damage`. A damaged
  header refuses to load. A log that ends before an index this node knew durable is damage too,
  not a torn append: witnesses are `log.mark.json` (`LogMark`, lowered before a rewrite shortens
  the log), `vote_floor.bin` (below: a log ending in the floor's epoch before its index), and the
  newest checkpoint's index (persistence.py: `report_lost_entries`). Each step is behind its
  failpoint, reports to `STORAGE`; every fsync goes through storage/durable.py.
- `vote_floor.bin` (`VoteFloor`): the newest (epoch, index) log.bin held, raised by `sync()` after
  the log's fsync: no acknowledgement leaves past it. A node with entries lost votes only above it.

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

import contextlib
import dataclasses
import functools
import json
import os
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from bootstrap.coordinator_node import PersistentState
from bootstrap.election import ElectionState
from bootstrap.entries import LogEntry, Snapshot, StoredPayload
from bootstrap.replog import LogStore
from diloco_node.clock import Clock, SystemClock
from diloco_node.daemon.coordination_records import ELECTION_FILES, DamagedStateError, RecordError, read_election
from diloco_node.daemon.coordination_records import FLOOR_FILE, MARK_FILE, LogMark, VoteFloor, read_record
from diloco_node.daemon.coordination_records import write_election, write_record
from diloco_node.daemon.log_records import (  # noqa: F401  (re-exported: the store's record format)
    _RECORD_HEAD, INITIAL_SNAPSHOT, MAX_RECORD_BYTES, WRITE_PIECE_BYTES, AppendFile, CoordinationStoreError,
    PayloadDamaged, PayloadGone, PreparedLog, _decode_body, _encode_entry, _encode_snapshot, _pread_all, _record_parts, _scan_log,
    _step, _write_records, decode_log, encode_log, without_payload,
)
from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import durable, failpoints

# Payloads up to this size stay in memory (no-ops, membership, tests' small entries): a reference
# and a read per use would cost more than the bytes.
INLINE_PAYLOAD_BYTES = 4096


_temp_path = durable.temp_path
_canonical = functools.partial(json.dumps, sort_keys=True)


class CoordinationStore:
    """The files of one node's coordination state under `directory`."""

    def __init__(self, directory: Path, clock: Clock | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._log_path = self.directory / "log.bin"
        self._identity_path = self.directory / "identity.json"
        self.mark = LogMark(self.directory, clock or SystemClock())
        self.floor = VoteFloor(self.directory)
        self._written_election: tuple[int, str | None] | None = None
        self._written_snapshot: tuple[int, int] = (0, 0)  # (last_index, last_epoch) of the header
        self._written_count = 0
        self._written_last: tuple[int, int] | None = None  # (index, epoch) of the last persisted entry
        self._written_identity: str | None = None
        self._written_manifest: str | None = None
        self._log_bytes = 0
        self._log_handle: Any = None
        # The last index this process appended and fsynced: what a clean stop marks (settle_mark).
        # Not one only read at load: a crashed process may have left it unsynced in the page cache.
        self._fsynced_last = 0
        # An append that failed may have left part of its records past `_log_bytes`: cut off
        # before the next append, so no torn record ever sits between good ones.
        self._tail_dirty = False
        # Set at load when log.bin was damaged at rest: entries from `damaged_after` + 1 on, which
        # this node may have acknowledged, were lost. The coordination I/O (coordination.py) does
        # not vote until it has them again from a lease holder.
        self.damaged_after: int | None = None
        self.damage_reason = ""
        # The index of a record found failing its checksum while running (set on any thread that
        # read it): `repair_damage` deals with it on the event loop.
        self.damage_found: int | None = None
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

    @property
    def durable_last_index(self) -> int:
        """The last index `log.bin` holds (what a crash now would keep)."""
        return self._written_last[0] if self._written_last else self._written_snapshot[0]

    # ---- loading ----------------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether this directory holds a node's state. Not only identity.json: a node whose
        identity was quarantined must not start again as a brand-new one (load_identity refuses)."""
        return self._identity_path.exists() or any(
            p.name.startswith(("identity.json", "election", "log.bin")) for p in self.directory.iterdir())

    def load_identity(self) -> dict[str, Any]:
        """identity.json, checksum verified; a damaged one is quarantined and the node refuses to
        start (DamagedStateError) rather than found or join again as someone else."""
        if not self._identity_path.exists():
            raise DamagedStateError(
                f"{self.directory} holds coordination state but no identity.json (quarantined: "
                f"{sorted(p.name for p in self.directory.glob('identity.json.corrupt-*')) or 'none'}): "
                "this node does not start under a new identity; restore identity.json, or remove the "
                "data directory and join the run again")
        try:
            identity = read_record("identity.read", self._identity_path, "node_id")
            with _step("manifest.read"):
                failpoints.hit("manifest.read")  # the run manifest is a part of the identity record
            if not isinstance(identity.get("manifest"), dict) or not isinstance(identity.get("node_id"), str):
                raise RecordError("no node_id or manifest")
        except RecordError as error:
            kept = STORAGE.quarantine(self._identity_path, f"identity record damaged: {error}")
            raise DamagedStateError(
                f"{self._identity_path} is damaged ({error}); kept as {kept.name}. This node does not start "
                "under a new identity: restore identity.json from a backup, or remove the data directory "
                "and join the run again") from None
        except OSError as error:
            raise CoordinationStoreError(f"{self._identity_path}: unreadable: {error}") from None
        self._written_identity = _canonical(identity)
        self._written_manifest = _canonical(identity["manifest"])
        return identity

    def load_persistent(self) -> PersistentState:
        """The coordination state as last synced: a torn log tail is dropped and the file trimmed;
        a log damaged at rest is quarantined and its good prefix kept (`damaged_after`)."""
        try:
            election_record, rewrite = read_election(self.directory)
        except OSError as error:
            raise CoordinationStoreError(f"{self.directory}: the election record is unreadable: {error}") from None
        election = ElectionState(*election_record) if election_record else ElectionState()
        # A write that crashed before its rename: the old file is still whole; its temp file goes.
        for path in (self._log_path, self._identity_path, self.mark.path, self.floor.path,
                     *(self.directory / name for name in ELECTION_FILES)):
            _temp_path(path).unlink(missing_ok=True)
        self._compaction_path.unlink(missing_ok=True)
        self.mark.load()
        try:
            self.floor.load()
            snapshot, entries = self._load_log()
        except OSError as error:
            raise CoordinationStoreError(f"{self._log_path}: unreadable: {error}") from None
        # A damaged or missing copy of the election record is written again at the first sync.
        self._written_election = None if rewrite else (election.current_epoch, election.voted_for)
        self._written_snapshot = (snapshot.last_index, snapshot.last_epoch)
        self._written_count = len(entries)
        self._written_last = (entries[-1].index, entries[-1].epoch) if entries else None
        return PersistentState(election, LogStore(snapshot, entries))

    def _load_log(self) -> tuple[Snapshot, list[LogEntry]]:
        snapshot, entries = INITIAL_SNAPSHOT, []
        if self._log_path.exists():
            with _step("log.read"):
                failpoints.hit("log.read")
                with open(self._log_path, "rb") as handle:
                    size = os.fstat(handle.fileno()).st_size
                    # Each entry a reference into log.bin as it is read: one payload in memory at a time.
                    snapshot, located, valid, damage = _scan_log(handle, size, self._log_path, keep=self._stored)
            last = located[-1][0].index if located else snapshot.last_index
            last_epoch = located[-1][0].epoch if located else snapshot.last_epoch
            floor = self.floor.loaded
            if damage is None and last < self.mark.index:
                # Not a torn append: entries through the mark were fsynced (and may be acknowledged).
                damage = (f"it ends at entry {last} ({size} bytes) but entries through {self.mark.index} were "
                          f"fsynced ({MARK_FILE}): cut at rest")
            elif damage is None and floor is not None and floor[0] == last_epoch and last < floor[1]:
                # Written once log.bin held it, fsynced; no leader shortens a log within one epoch.
                damage = (f"it ends at entry {last} of epoch {last_epoch} but held entry {floor[1]} of that "
                          f"epoch ({FLOOR_FILE}): cut at rest")
            if damage is not None:
                self._keep_good_prefix(valid, damage, last)
            elif valid != size:
                with _step("log.truncate"), open(self._log_path, "r+b") as handle:
                    handle.truncate(valid)
                    durable.sync_file("log.truncate", handle.fileno(), self._log_path)
            self._log_bytes = valid
            self._set_locations([(e.index, e.epoch, offset, length) for e, offset, length in located], replace=True)
            entries = [e for e, _, _ in located]
            durable.forget(self._log_path)
            durable.track(self._log_path)
        return snapshot, entries

    def _keep_good_prefix(self, valid: int, damage: str, last_good: int,
                          located: list[tuple[int, int, int, int]] | None = None) -> None:
        """log.bin is damaged at rest: its first `valid` bytes (through entry `last_good`) become the
        new log.bin and the file is renamed aside whole. `located`: the kept records, at run time."""
        temp = _temp_path(self._log_path)
        with _step("log.truncate"):
            with open(self._log_path, "rb") as source, open(temp, "wb") as target:
                remaining = valid
                while remaining > 0:
                    piece = source.read(min(remaining, WRITE_PIECE_BYTES))
                    target.write(piece)
                    remaining -= len(piece)
                target.flush()
                durable.sync_file("log.truncate", target.fileno(), temp)
            kept = STORAGE.quarantine(self._log_path, damage)
            current = [(index, *at) for index, at in self._locations.items()]
            self._replace_log(temp, current if located is None else located)
        self.damaged_after, self.damage_reason = last_good, f"log.bin damaged ({damage}); kept as {kept.name}"

    def repair_damage(self) -> int | None:
        """After a record failed its check while running (`damage_found`), on the event loop: when
        log.bin has a damaged record, keep the good prefix before it (the file quarantined whole) and
        return the last index kept: the caller drops the later entries from the core's log before
        the next `sync`. None when log.bin reads whole (the record was in a file since rewritten)."""
        if self.damage_found is None:
            return None
        self.close()
        with _step("log.read"), open(self._log_path, "rb") as handle:
            failpoints.hit("log.read")
            size = os.fstat(handle.fileno()).st_size
            snapshot, scanned, valid, damage = _scan_log(handle, size, self._log_path, keep=without_payload)
        if damage is None or (snapshot.last_index, snapshot.last_epoch) != self._written_snapshot:
            self.damage_found = None
            return None
        located = [(entry.index, entry.epoch, offset, length) for entry, offset, length in scanned]
        last = located[-1][0] if located else snapshot.last_index
        self._keep_good_prefix(valid, damage, last, located)
        self.damage_found = None
        self._log_bytes, self._tail_dirty = valid, False
        self._written_count = len(located)
        self._written_last = (last, located[-1][1]) if located else None
        return last

    def report_lost_entries(self, last_index: int, witness: str) -> None:
        """log.bin (loaded, ending at `last_index`) lost entries `witness` shows were durable: damage,
        as a failed checksum is (quarantined, content kept, no vote until the entries are back)."""
        if self.damaged_after is not None:
            return
        damage = f"it ends at entry {last_index} but {witness}: cut at rest"
        if not self._log_path.exists():  # removed whole: nothing to keep aside
            self.damaged_after, self.damage_reason = last_index, f"log.bin missing ({damage})"
            return
        self.close()
        self._keep_good_prefix(self._log_bytes, damage, last_index)

    # ---- writing ----------------------------------------------------------------------------

    def save_identity(self, identity: dict[str, Any]) -> None:
        """identity.json when it changed: failpoint `manifest.write` when the run manifest in it
        changed (founding, joining), `identity.write` when only the rest did (the address book)."""
        text, manifest = _canonical(identity), _canonical(identity.get("manifest"))
        if text != self._written_identity:
            point = "manifest.write" if manifest != self._written_manifest else "identity.write"
            write_record(point, self._identity_path, identity)
            self._written_identity, self._written_manifest = text, manifest

    def sync(self, state: PersistentState, prepared: PreparedLog | None = None) -> None:
        """Make `state` durable (only the parts that changed since the last call).

        `prepared`: a compaction written by `prepare_compaction`, used when `state` carries its
        snapshot and still begins with its entries (else the log is rewritten whole). Raises
        OSError when a step fails (its point is then failing on /status): nothing that depends
        on `state` may leave the node, and the next call writes what is still missing.
        """
        election = (state.election.current_epoch, state.election.voted_for)
        if election != self._written_election:
            write_election(self.directory, *election)
            self._written_election = election
        snapshot, entries = state.log.snapshot, state.log.entries
        count = self._written_count
        appended = False
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
            appended = True
        if prepared is not None:  # the state moved on differently (e.g. a snapshot was installed)
            self.discard_prepared()
        self._written_snapshot = (snapshot.last_index, snapshot.last_epoch)
        self._written_last = (entries[-1].index, entries[-1].epoch) if entries else None
        self._written_count = len(entries)
        if appended:
            self._fsynced_last = self.durable_last_index
            self.mark.advance(self.durable_last_index)
        if self.floor.value is not None or self.damaged_after is None:
            # Once log.bin holds it. A damaged log's unknown floor stays unwritten (no vote at all).
            last = entries[-1] if entries else None
            self.floor.cover((last.epoch, last.index) if last else (snapshot.last_epoch, snapshot.last_index))

    def _append(self, entries: list[LogEntry], start: int) -> None:
        """Append `entries[start:]`; in memory they then keep only a reference to their payload."""
        with _step("log.append"):
            failpoints.hit("log.append")
            if self._tail_dirty:
                self._cut_tail()
            if self._log_handle is None:
                durable.track(self._log_path)
                self._log_handle = AppendFile(self._log_path)
            try:
                located, end = _write_records(self._log_handle, self._log_bytes, entries[start:])
                self._log_handle.flush()
                durable.sync_file("log.append", self._log_handle.fileno(), self._log_path)
            except BaseException:
                self._tail_dirty = True
                self._drop_append_handle()
                raise
        self._log_bytes = end
        self._set_locations(located)
        self._store_payloads(entries, start)

    def _drop_append_handle(self) -> None:
        handle, self._log_handle = self._log_handle, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()

    def _cut_tail(self) -> None:
        """Cut log.bin back to its last good record (after a failed append), durably."""
        fd = os.open(self._log_path, os.O_WRONLY)
        try:
            os.ftruncate(fd, self._log_bytes)
            durable.sync_file("log.append", fd, self._log_path)
        finally:
            os.close(fd)
        self._tail_dirty = False

    def _rewrite(self, snapshot: Snapshot, entries: list[LogEntry]) -> None:
        """Header and entries in one atomic replacement: compaction and truncation are crash-safe.

        Written record by record (payloads read from the old file) to the temp file, then renamed."""
        self.close()
        temp = _temp_path(self._log_path)
        header = _encode_snapshot(snapshot)
        with _step("log.truncate"):
            failpoints.hit("log.truncate")
            new_last = entries[-1].index if entries else snapshot.last_index
            if new_last < self.mark.index:
                # A leader replaced a suffix: the mark comes down first, so a crash before the rename
                # is never read as damage.
                self.mark.write(new_last)
            try:
                with open(temp, "wb") as handle:
                    durable.track(temp)
                    handle.write(header)
                    located, end = _write_records(handle, len(header), entries)
                    handle.flush()
                    durable.sync_file("log.truncate", handle.fileno(), temp)
                self._replace_log(temp, located)
            except BaseException:
                durable.forget(temp)
                temp.unlink(missing_ok=True)
                raise
        self._log_bytes = end
        self._tail_dirty = False
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
        durable.forget(written)
        durable.forget(self._log_path)
        durable.track(self._log_path)  # its whole length was fsynced before the rename
        durable.sync_dir(self.directory)

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

    def _read_point(self, index: int) -> None:
        """Failpoint `log.read` before a payload is read back: its error is the payload's absence
        (the caller fetches it elsewhere), and shows on /status."""
        try:
            failpoints.hit("log.read")
        except OSError as error:
            STORAGE.failed("log.read", error)
            raise PayloadGone(f"{self._log_path}: entry {index}: {error}") from None

    def _damaged(self, index: int, offset: int) -> PayloadDamaged:
        """A record failed its checksum (any thread): `repair_damage` looks at the file next."""
        self.damage_found = index
        return PayloadDamaged(f"{self._log_path}: entry {index}: the record at byte {offset} fails its checksum")

    def read_payload(self, index: int, epoch: int) -> bytes:
        """The payload of entry `index` of `epoch` from log.bin (any thread): the record's CRC,
        index and epoch are checked. CoordinationStoreError when the log no longer holds that entry
        (truncated or compacted away) or the record is damaged."""
        self._read_point(index)
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
            raise self._damaged(index, offset)
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
        self._read_point(index)
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
                raise self._damaged(index, offset)
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
        with _step("log.compact"):
            failpoints.hit("log.compact")
            with open(self._compaction_path, "wb") as handle:
                durable.track(self._compaction_path)
                handle.write(header)
                located, end = _write_records(handle, len(header), committed)  # payloads read from log.bin
                handle.flush()
                durable.sync_file("log.compact", handle.fileno(), self._compaction_path)
        last = (committed[-1].index, committed[-1].epoch) if committed else None
        return PreparedLog((snapshot.last_index, snapshot.last_epoch), len(committed), last, end, tuple(located))

    def discard_prepared(self) -> None:
        durable.forget(self._compaction_path)
        self._compaction_path.unlink(missing_ok=True)

    def _finish_compaction(self, prepared: PreparedLog, entries: list[LogEntry]) -> None:
        self.close()
        with _step("log.compact"):
            failpoints.hit("log.compact")
            with open(self._compaction_path, "r+b") as handle:
                # Cut to what prepare_compaction wrote: a failed earlier finish may have left more.
                handle.truncate(prepared.size)
                handle.seek(prepared.size)
                located, end = _write_records(handle, prepared.size, entries[prepared.count:])
                handle.flush()
                durable.sync_file("log.compact", handle.fileno(), self._compaction_path)
            self._replace_log(self._compaction_path, [*prepared.located, *located])
        self._log_bytes = end
        self._tail_dirty = False
        self._store_payloads(entries, 0)

    def settle_mark(self) -> None:
        """At a clean stop: the mark at the last entry this process fsynced, never past a cut a
        rewrite made since (`LogMark.settle`)."""
        self.mark.settle(min(self._fsynced_last, self.durable_last_index))

    def close(self) -> None:
        """Close the files (reads reopen what they need)."""
        self.floor.close()
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        with self._read_lock:
            if self._read_fd >= 0:
                os.close(self._read_fd)
                self._read_fd = -1
