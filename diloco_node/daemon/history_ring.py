"""A fragment's past versions for rebasing, kept in a ring file on disk instead of in memory.

The lease holder rebases a stale contribution as (Theta_now - Theta_base) + delta, so it needs
the fragment as of each of the last few rounds (`global_state.DEFAULT_HISTORY_LEN`). In memory that
is one fp32 copy of the model per kept round; here each fragment has one file of `capacity`
slots, a slot being the fragment's tensors as raw little-endian float32 in name order, written
with `pwrite` when a round is applied (round r goes to slot r mod capacity). The newest version
is the global state's own current arrays, held by reference, so it costs nothing; an older one is
read back whole with `preadv` when a merge asks for it (one fragment's fp32, freed after the
rebase). Pages written go to the page cache and are the kernel's to write back: they are not in
the process's resident set.

The ring is a cache of what the log already made: it is not fsynced and is started afresh at
each start (files truncated), exactly as the in-memory history starts with the current version
after a restart or an install; nothing in it is ever read across a restart. A contribution against
a round the ring no longer (or not yet) holds is rejected with that reason by the merge, as before.

Faults (failpoints `version_rings.write`, `version_rings.read`), each on `/status` and warned once
per streak; nothing wrong is ever served, and the merge rejects a contribution against a lost
round by reason:
- a slot the disk refused to write: that round is served from memory while it is the newest and
  is dropped when the next round comes (the other slots are untouched);
- a slot that cannot be read (an I/O error): that round is dropped;
- a slot that fails its CRC32 (kept in memory when written, checked when read back: a bit flip) or
  ends early (a truncated file): the file is quarantined (kept, named on `/status`), a fresh one
  opened, and the ring keeps only the newest version (in memory) and fills again.
The ring has no fsync: its crash failpoints fire where a slot is complete.

`version` and `record` may run on different threads (a merge in the pool, an apply on the event
loop): a lock makes a read see a whole slot of the round it asked for.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import failpoints

log = logging.getLogger("diloco_node.daemon")

_DTYPE = np.dtype("<f4")
# Under a node's data_dir; deleted and rewritten freely (a cache of what the log made).
HISTORY_RING_DIR = "history-ring"


class DiskFragmentHistory:
    """One fragment's ring of versions: slots in `<directory>/fragment-<p>.ring`."""

    def __init__(self, directory: Path, fragment: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity {capacity} must be >= 1")
        self.fragment = fragment
        self.capacity = capacity
        self.path = Path(directory) / f"fragment-{fragment}.ring"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._lock = threading.Lock()
        self._layout: list[tuple[str, tuple[int, ...], int]] = []  # (name, shape, byte offset in a slot)
        self._slot_bytes = 0
        self._rounds: OrderedDict[int, int] = OrderedDict()  # round -> slot, oldest first
        self._crc: dict[int, int] = {}  # slot -> CRC32 of its bytes as written
        self._unwritten: int | None = None  # the newest round, when its slot could not be written
        self._newest: Mapping[str, np.ndarray] | None = None

    def _set_layout(self, params: Mapping[str, np.ndarray]) -> None:
        offset = 0
        for name in sorted(params):
            shape = tuple(np.shape(params[name]))
            self._layout.append((name, shape, offset))
            offset += int(np.prod(shape, dtype=np.int64)) * _DTYPE.itemsize
        self._slot_bytes = offset

    def record(self, round_: int, params: Mapping[str, np.ndarray]) -> None:
        """Write the version of `round_` (newer than every kept one) into its slot; the oldest goes."""
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"fragment {self.fragment}: the history ring was closed")
            if self._rounds and round_ <= next(reversed(self._rounds)):
                raise ValueError(f"fragment {self.fragment}: round {round_} is not newer than "
                                 f"{next(reversed(self._rounds))}")
            if not self._layout:
                self._set_layout(params)
            if sorted(params) != [name for name, _, _ in self._layout]:
                raise ValueError(f"fragment {self.fragment}: round {round_} has other tensors than the ring")
            for name, shape, _ in self._layout:
                if tuple(np.shape(params[name])) != shape:
                    raise ValueError(f"fragment {self.fragment}: {name} has shape {np.shape(params[name])}, "
                                     f"the ring {shape}")
            if self._unwritten is not None:  # held in memory only, as the newest: no longer servable
                self._rounds.pop(self._unwritten, None)
                self._unwritten = None
            slot = round_ % self.capacity
            for r in [r for r, s in self._rounds.items() if s == slot]:
                del self._rounds[r]  # overwritten below
            self._crc.pop(slot, None)
            try:
                self._crc[slot] = self._write_slot(slot, params)
            except OSError as error:
                self._failed("version_rings.write", f"version of round {round_} not written; served from memory "
                             "while it is the newest", error)
                self._unwritten = round_
            else:
                if STORAGE.succeeded("version_rings.write"):
                    log.warning("fragment %d: version ring written again (round %d)", self.fragment, round_)
            self._rounds[round_] = slot
            while len(self._rounds) > self.capacity:
                self._rounds.popitem(last=False)
            self._newest = params

    def _write_slot(self, slot: int, params: Mapping[str, np.ndarray]) -> int:
        """Write one version into `slot`; returns the CRC32 of the slot's bytes."""
        failpoints.hit("version_rings.write")
        base = slot * self._slot_bytes
        crc = 0
        for name, shape, offset in self._layout:
            data = memoryview(np.ascontiguousarray(params[name], dtype=_DTYPE).reshape(-1)).cast("B")
            crc = zlib.crc32(data, crc)
            _write_all(self._fd, data, base + offset)
        # No fsync (a cache, see the module's docstring): the crash points fire with the slot complete.
        failpoints.around_fsync("version_rings.write", lambda: None)
        return crc

    def _failed(self, point: str, what: str, error: BaseException | str) -> None:
        first = not STORAGE.is_failing(point)
        STORAGE.failed(point, error)
        if first:
            log.warning("fragment %d: %s (%s); contributions against rounds the ring lacks are rejected",
                        self.fragment, what, error)

    def version(self, round_: int) -> Mapping[str, np.ndarray] | None:
        """The fragment at `round_` (read-only arrays), or None when the ring does not hold it."""
        with self._lock:
            slot = self._rounds.get(round_)
            if slot is None:
                return None
            if round_ == next(reversed(self._rounds)):
                return self._newest
            try:
                out = self._read_slot(slot)
            except ShortRead as error:  # the file was cut short: as corrupt as a flipped bit
                self._corrupt(round_, slot, str(error))
                return None
            except OSError as error:
                self._failed("version_rings.read", f"version of round {round_} not read; dropped", error)
                del self._rounds[round_]
                return None
            crc = 0
            for name, _, _ in self._layout:
                crc = zlib.crc32(memoryview(out[name].reshape(-1)).cast("B"), crc)
            if crc != self._crc.get(slot):
                self._corrupt(round_, slot, "CRC32 of the slot differs from what was written")
                return None
            STORAGE.succeeded("version_rings.read")
            return out

    def _read_slot(self, slot: int) -> dict[str, np.ndarray]:
        failpoints.hit("version_rings.read")
        base = slot * self._slot_bytes
        out: dict[str, np.ndarray] = {}
        for name, shape, offset in self._layout:
            arr = np.empty(shape, dtype=_DTYPE)
            _read_all(self._fd, memoryview(arr.reshape(-1)).cast("B"), base + offset, self.path)
            arr.setflags(write=False)
            out[name] = arr
        return out

    def _corrupt(self, round_: int, slot: int, why: str) -> None:
        """A slot that does not read back as written: the file is quarantined, a fresh one started."""
        reason = f"fragment {self.fragment} round {round_} (slot {slot}): {why}"
        self._failed("version_rings.read", f"version ring {self.path.name} corrupt, quarantined; the ring keeps "
                     "only the newest version and fills again", reason)
        while len(self._rounds) > 1:  # every slot of the file is in doubt
            self._rounds.popitem(last=False)
        self._crc.clear()
        try:
            STORAGE.quarantine(self.path, reason)
            fresh = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as error:
            log.warning("fragment %d: the corrupt ring %s could not be set aside: %s", self.fragment, self.path, error)
            return
        os.close(self._fd)
        self._fd = fresh

    @property
    def newest_round(self) -> int:
        if not self._rounds:
            raise LookupError(f"fragment {self.fragment}: history is empty")
        return next(reversed(self._rounds))

    @property
    def oldest_round(self) -> int:
        if not self._rounds:
            raise LookupError(f"fragment {self.fragment}: history is empty")
        return next(iter(self._rounds))

    def rounds(self) -> tuple[int, ...]:
        return tuple(self._rounds)

    def __len__(self) -> int:
        return len(self._rounds)

    def close(self) -> None:
        """Release the file; from now on only the newest version is served (a merge still
        running against a replaced ring rejects older bases by reason instead of failing)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            while len(self._rounds) > 1:
                self._rounds.popitem(last=False)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class ShortRead(OSError):
    """A ring file ends before the slot being read: it was cut short."""


def _read_all(fd: int, buffer: memoryview, offset: int, path: Path) -> None:
    while buffer:
        got = os.preadv(fd, [buffer], offset)
        if got == 0:
            raise ShortRead(f"{path}: short read at byte {offset}")
        buffer, offset = buffer[got:], offset + got


class DiskVersionRings:
    """Makes the rings of one node under `directory` (a `global_state.HistoryFactory`) and closes them.

    A fragment's ring made again (a fragment installed from a peer) replaces the old file.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._rings: dict[int, DiskFragmentHistory] = {}

    def __call__(self, fragment: int, capacity: int) -> DiskFragmentHistory:
        old = self._rings.pop(fragment, None)
        if old is not None:
            old.close()
        ring = DiskFragmentHistory(self.directory, fragment, capacity)
        self._rings[fragment] = ring
        return ring

    def close(self) -> None:
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()
