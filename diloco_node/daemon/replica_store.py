"""Durable coordination state: the election state, the replicated log and the node's run identity.

The coordination core (`bootstrap.coordinator_node`) mutates its `PersistentState` in place and
requires it to be on disk before any message that depends on it leaves the node. `sync()` is
called after every batch of actions and before sending them; it writes only what changed:

- `election.json` (epoch, vote): rewritten atomically (temp file, fsync, rename, fsync dir);
- `log.bin`: append-only records `u32 length | u32 crc32 | msgpack entry`, fsynced. When the log
  was truncated (a conflicting uncommitted suffix replaced by a new leader) the file is rewritten
  atomically. A torn last record (crash mid-append) fails its CRC and is dropped at load: it was
  never acknowledged, since acknowledgements leave only after `sync()` returned;
- `identity.json`: node id, role, run manifest and the address book (rewritten when changed).

The log is never compacted by the daemon, so the snapshot in the store is always index 0.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack

from bootstrap.coordinator_node import PersistentState
from bootstrap.election import ElectionState
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot
from bootstrap.replog import LogStore

_RECORD_HEAD = struct.Struct("<II")
# One entry holds one merged fragment delta; bigger than this is a corrupt length field.
MAX_RECORD_BYTES = 512 * 1024 * 1024


class ReplicaStoreError(Exception):
    """The durable coordination state is unreadable; the message names the file."""


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)
    _fsync_dir(path.parent)


def _encode_entry(entry: LogEntry) -> bytes:
    voters = entry.config.sorted_voters() if entry.config is not None else None
    body = msgpack.packb([entry.epoch, entry.index, entry.kind.value, entry.payload, entry.fragment,
                          entry.round, entry.digest, voters], use_bin_type=True)
    return _RECORD_HEAD.pack(len(body), zlib.crc32(body)) + body


def _decode_entries(data: bytes, path: Path) -> tuple[list[LogEntry], int]:
    """Entries and the byte length of the valid prefix (a torn tail is cut off)."""
    entries: list[LogEntry] = []
    offset = 0
    while offset + _RECORD_HEAD.size <= len(data):
        length, crc = _RECORD_HEAD.unpack_from(data, offset)
        start = offset + _RECORD_HEAD.size
        if length > MAX_RECORD_BYTES or start + length > len(data):
            break
        body = data[start:start + length]
        if zlib.crc32(body) != crc:
            break
        try:
            epoch, index, kind, payload, fragment, round_, digest, voters = msgpack.unpackb(body, raw=False)
            config = ClusterConfig.of(voters) if voters is not None else None
            entry = LogEntry(epoch, index, EntryKind(kind), payload, fragment, round_, digest, config)
        except (ValueError, TypeError) as error:
            raise ReplicaStoreError(f"{path}: record at byte {offset} is not a log entry: {error}") from None
        if entries and entry.index != entries[-1].index + 1:
            raise ReplicaStoreError(f"{path}: entry {entry.index} follows {entries[-1].index}")
        entries.append(entry)
        offset = start + length
    return entries, offset


class ReplicaStore:
    """The files of one node's coordination state under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._election_path = self.directory / "election.json"
        self._log_path = self.directory / "log.bin"
        self._identity_path = self.directory / "identity.json"
        self._written_election: tuple[int, str | None] | None = None
        self._written_count = 0
        self._written_last: tuple[int, int] | None = None  # (index, epoch) of the last persisted entry
        self._written_identity: str | None = None
        self._log_handle: Any = None

    # ---- loading ----------------------------------------------------------------------------

    def exists(self) -> bool:
        return self._identity_path.exists()

    def load_identity(self) -> dict[str, Any]:
        try:
            identity = json.loads(self._identity_path.read_text())
        except (OSError, ValueError) as error:
            raise ReplicaStoreError(f"{self._identity_path}: unreadable: {error}") from None
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
                raise ReplicaStoreError(f"{self._election_path}: unreadable: {error}") from None
        entries: list[LogEntry] = []
        if self._log_path.exists():
            data = self._log_path.read_bytes()
            entries, valid = _decode_entries(data, self._log_path)
            if valid != len(data):
                with open(self._log_path, "r+b") as handle:
                    handle.truncate(valid)
                    os.fsync(handle.fileno())
        self._written_election = (election.current_epoch, election.voted_for)
        self._written_count = len(entries)
        self._written_last = (entries[-1].index, entries[-1].epoch) if entries else None
        return PersistentState(election, LogStore(Snapshot(0, 0, ClusterConfig()), entries))

    # ---- writing ----------------------------------------------------------------------------

    def save_identity(self, identity: dict[str, Any]) -> None:
        text = json.dumps(identity, sort_keys=True)
        if text != self._written_identity:
            _atomic_write(self._identity_path, text.encode())
            self._written_identity = text

    def sync(self, state: PersistentState) -> None:
        """Make `state` durable (only the parts that changed since the last call)."""
        election = (state.election.current_epoch, state.election.voted_for)
        if election != self._written_election:
            _atomic_write(self._election_path,
                          json.dumps({"current_epoch": election[0], "voted_for": election[1]}).encode())
            self._written_election = election
        entries = state.log.entries
        if state.log.snapshot.last_index != 0:
            raise ReplicaStoreError("the daemon never compacts its log; found a snapshot")
        count = self._written_count
        prefix_intact = len(entries) >= count and (
            count == 0 or (entries[count - 1].index, entries[count - 1].epoch) == self._written_last)
        if not prefix_intact:
            self._rewrite(entries)
        elif len(entries) > count:
            self._append(entries[count:])
        if entries:
            self._written_last = (entries[-1].index, entries[-1].epoch)
        else:
            self._written_last = None
        self._written_count = len(entries)

    def _append(self, new: list[LogEntry]) -> None:
        if self._log_handle is None:
            self._log_handle = open(self._log_path, "ab")
        self._log_handle.write(b"".join(_encode_entry(e) for e in new))
        self._log_handle.flush()
        os.fsync(self._log_handle.fileno())

    def _rewrite(self, entries: list[LogEntry]) -> None:
        self.close()
        _atomic_write(self._log_path, b"".join(_encode_entry(e) for e in entries))

    def close(self) -> None:
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
