"""The coordination store's small records: checksummed JSON files, the election record kept twice.

A record file is framed as diloco_node/storage/records.py says (the record's JSON object with its
format and CRC-32; a bit flip or a truncation is found when the file is read). Files are replaced
atomically (`durable.atomic_write`: temporary file, fsync, rename, fsync of the directory), behind
their failpoint.

`log.mark.json` (`LogMark`): the last index of log.bin known fsynced, a witness that tells a log
cut at rest from a torn append (coordination_store.py). It is a lower bound, written at most once a
second.

`vote_floor.bin` (`VoteFloor`): the newest (epoch, index) log.bin ever held, written (after the
log's own fsync, in place, one fsync) by every sync that moves it up, so before any acknowledgement that depends on it
leaves: an upper bound of every entry this node acknowledged. A node whose log was cut at rest
votes only for a candidate whose log is at least that up to date (bootstrap/election.py).

The election record (epoch and vote) is what Raft cannot lose: a node that forgot its vote could
grant a second one in the same epoch. It is written to two files, `election.json` then
`election.copy.json`, and the reply that depends on it leaves only once both are durable. A read
takes the newer of the copies that pass their checksum (higher epoch; in one epoch a vote is only
ever added, never changed), quarantines a damaged one (rewritten at the next sync); only when both
are damaged does it refuse to start (`DamagedStateError`), since no vote can then be trusted.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any

from diloco_node.clock import Clock
from diloco_node.config.manifest import ConfigError
from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import durable, failpoints
from diloco_node.storage.records import RecordError, frame, unframe

ELECTION_FILES = ("election.json", "election.copy.json")
# log.bin's high-water mark is rewritten at most this often, after an append that moved the durable
# end: an atomic write (two fsyncs) a second at most, never one per append. A cut of log.bin at
# rest below it is damage; the entries of the last interval before a crash can still only be told
# from a torn append by a checkpoint past them.
MARK_INTERVAL_S = 1.0
MARK_FILE = "log.mark.json"
_MARK_KEY = "fsynced_through"
FLOOR_FILE = "vote_floor.bin"
FLOOR_POINT = "vote_floor.write"
_FLOOR_MAGIC = b"VFL1"
_FLOOR_HEAD = struct.Struct("<4sQQ")  # magic, epoch, index
_FLOOR_CRC = struct.Struct("<I")
FLOOR_RECORD_BYTES = _FLOOR_HEAD.size + _FLOOR_CRC.size


class DamagedStateError(ConfigError):
    """The node's durable state is damaged in a way it cannot repair from its peers: it refuses to
    start (exit status of a configuration error), naming the quarantined file and what to do."""


def write_record(point: str, path: Path, record: dict[str, Any]) -> None:
    """Replace `path` with `record`, durably (raises OSError; `point` is then failing on /status)."""
    try:
        durable.atomic_write(point, path, frame(record))
    except OSError as error:
        STORAGE.failed(point, error)
        raise
    STORAGE.succeeded(point)


def read_record(point: str, path: Path, legacy_key: str) -> dict[str, Any]:
    """The record in `path`: OSError when it cannot be read, RecordError when it is damaged."""
    try:
        failpoints.hit(point)
        data = path.read_bytes()
    except OSError as error:
        STORAGE.failed(point, error)
        raise
    STORAGE.succeeded(point)
    return unframe(data, legacy_key)


def write_election(directory: Path, epoch: int, voted_for: str | None) -> None:
    """Both copies, in order: a crash between them leaves the first newer, which a read prefers."""
    for name in ELECTION_FILES:
        write_record("election.write", directory / name, {"current_epoch": epoch, "voted_for": voted_for})


def read_election(directory: Path) -> tuple[tuple[int, str | None] | None, bool]:
    """((epoch, vote) or None when never written, whether the copies must be rewritten).

    A damaged copy is quarantined and the other one used; both damaged: DamagedStateError."""
    found: list[tuple[int, str | None]] = []
    damaged: list[str] = []
    present = 0
    for name in ELECTION_FILES:
        path = directory / name
        if not path.exists():
            continue
        present += 1
        try:
            record = read_record("election.read", path, "current_epoch")
            voted_for = record.get("voted_for")
            if voted_for is not None and not isinstance(voted_for, str):
                raise RecordError(f"voted_for is {voted_for!r}")
            found.append((int(record["current_epoch"]), voted_for))
        except (RecordError, KeyError, TypeError, ValueError) as error:
            kept = STORAGE.quarantine(path, f"election record damaged: {error}")
            damaged.append(f"{path.name} (kept as {kept.name}: {error})")
    if damaged and not found:
        raise DamagedStateError(
            f"{directory}: every copy of the election record is damaged: {'; '.join(damaged)}. A node that "
            "forgot its vote could vote twice in one epoch, so it does not start: restore a copy, or remove "
            "this node's data directory and join the run again under a new node_id")
    if not found:
        return None, False
    # Newest first: a higher epoch, and in one epoch a vote over none (a vote is never withdrawn).
    newest = max(found, key=lambda item: (item[0], item[1] is not None))
    return newest, bool(damaged) or present < len(ELECTION_FILES) or len(set(found)) > 1


class LogMark:
    """log.bin's high-water mark: `index` is an entry known fsynced in log.bin (0: none known)."""

    def __init__(self, directory: Path, clock: Clock) -> None:
        self.path = Path(directory) / MARK_FILE
        self.index = 0
        self.interval_s = MARK_INTERVAL_S
        self._clock = clock
        self._written_at = clock.monotonic()  # the first one a full interval after the start

    def load(self) -> int:
        """The mark on disk. A damaged one is quarantined and ignored: it only witnesses damage."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return self.index
        try:
            mark = unframe(data, _MARK_KEY)[_MARK_KEY]
            if not isinstance(mark, int) or mark < 0:
                raise RecordError(f"{_MARK_KEY} is {mark!r}")
            self.index = mark
        except (RecordError, KeyError) as error:
            STORAGE.quarantine(self.path, f"log high-water mark damaged: {error}")
        return self.index

    def write(self, index: int) -> None:
        """Record `index` as fsynced, atomically, under failpoint `log.append` (the step it belongs
        to). Raises OSError."""
        durable.atomic_write("log.append", self.path, frame({_MARK_KEY: index}))
        self.index = index
        self._written_at = self._clock.monotonic()

    def settle(self, fsynced_last: int) -> None:
        """At a clean stop: record `fsynced_last` (this process appended and fsynced it) when the
        interval kept `advance` from it. A failure keeps the older mark (on /status)."""
        if fsynced_last > self.index:
            try:
                self.write(fsynced_last)
            except OSError as error:
                STORAGE.failed("log.append", f"{MARK_FILE} not written at stop: {error}")

    def advance(self, durable_last: int) -> None:
        """After an append: raise the mark to `durable_last`, at most once per interval. A failure
        leaves the older mark (a weaker witness, never a false one) and shows on /status."""
        if durable_last <= self.index or self._clock.monotonic() - self._written_at < self.interval_s:
            return
        try:
            self.write(durable_last)
        except OSError as error:
            STORAGE.failed("log.append", f"{MARK_FILE} not written: {error}")


class VoteFloor:
    """The newest (epoch, index) log.bin ever held: `value` (None while unknown: no file yet, or a
    damaged one, quarantined). `loaded` is what the file said at start, the floor of a node whose
    log was found cut at rest (coordination_store.py).

    One fixed-size record (`FLOOR_RECORD`: magic, epoch, index, CRC-32 of the rest), created by an
    atomic write and then overwritten in place with one fsync: a floor is raised by every sync that
    extends the log, so it costs one small fsync, not a file created, renamed and its directory
    synced. A write torn by a crash, or a record damaged at rest, fails its CRC and makes the floor
    unknown, which only ever bars more votes (a node with a damaged log and no floor votes for no
    one); a crash before the fsync leaves the older floor, which covers every acknowledgement sent
    before it, since none depending on the new one left."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / FLOOR_FILE
        self.value: tuple[int, int] | None = None
        self.loaded: tuple[int, int] | None = None
        self._fd = -1

    @staticmethod
    def encode(last_log: tuple[int, int]) -> bytes:
        body = _FLOOR_HEAD.pack(_FLOOR_MAGIC, *last_log)
        return body + _FLOOR_CRC.pack(zlib.crc32(body))

    def load(self) -> tuple[int, int] | None:
        """The floor on disk (OSError when it cannot be read). A damaged one is quarantined and the
        floor unknown: a node with a damaged log then falls back to not voting at all."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        body = data[:_FLOOR_HEAD.size]
        if (len(data) != FLOOR_RECORD_BYTES or not body.startswith(_FLOOR_MAGIC)
                or _FLOOR_CRC.unpack_from(data, _FLOOR_HEAD.size)[0] != zlib.crc32(body)):
            STORAGE.quarantine(self.path, f"vote floor damaged: {len(data)} bytes, not a {FLOOR_RECORD_BYTES}-byte "
                                          "record with its checksum")
            return None
        _, epoch, index = _FLOOR_HEAD.unpack(body)
        self.value = self.loaded = (epoch, index)
        return self.loaded

    def cover(self, last_log: tuple[int, int]) -> None:
        """Raise the floor to `last_log` when that is newer, durably (OSError when the write fails:
        then nothing that depends on `last_log` may be acknowledged). Never lowered here."""
        if self.value is None or last_log > self.value:
            self.write(last_log)

    def write(self, last_log: tuple[int, int]) -> None:
        """Replace the floor with `last_log`, even a lower one (only an operator's accepted loss)."""
        record = self.encode(last_log)
        try:
            if self._fd < 0 and self.value is None:  # a new file: its directory entry made durable too
                durable.atomic_write(FLOOR_POINT, self.path, record)
            else:
                failpoints.hit(FLOOR_POINT)
                if self._fd < 0:
                    self._fd = os.open(self.path, os.O_WRONLY)
                os.pwrite(self._fd, record, 0)
                durable.sync_file(FLOOR_POINT, self._fd)
        except OSError as error:
            self.close()
            STORAGE.failed(FLOOR_POINT, error)
            raise
        STORAGE.succeeded(FLOOR_POINT)
        self.value = last_log

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass
