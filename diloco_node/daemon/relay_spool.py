"""Relayed payload bytes on disk: streams spooled into files and checked, kept until the log holds them, read back in chunks.

The relay's decisions are elsewhere (`bootstrap/relay_plane.py`) and so is its traffic
(`daemon/relays.py`); this module only holds bytes:

- `PayloadReceiver` takes one streamed payload (a PayloadOpen, then PayloadChunks): each chunk's
  place and size checked by the wire's `PayloadAssembler`, written to a spool file and hashed in a
  worker thread. Whole and of the declared SHA-256, it becomes a `SpooledPayload`; otherwise its file
  is deleted.
- `HeldPayloads` is the relay plane's `PayloadStore`: verified payloads by digest, bounded by count
  and bytes (the oldest go first, their files deleted), until their entry is in the log (`settle`);
  from then on their bytes are read from the log.
- `payload_frames` streams a payload out (a spool file, log.bin, or bytes) a chunk at a time.

Faults (failpoints `spool.write`, `spool.read`). Spool files are never fsynced: they are deleted at
every start, so a crash leaves nothing a restart could serve (the crash points fire where a payload's
file is complete). A spool write the disk refuses ends the stream with a 507 refusal and deletes the
partial file: the sender keeps its bytes and this node fetches them later, as for any lost stream.
Every read of a spool file is checked against the payload's SHA-256 (its name on the wire): a file
that does not match (a bit flip, a truncation) is quarantined (kept, named on `/status`) and the
payload is dropped from `HeldPayloads`, so the relay wants it again and fetches it; the reader gets
`SpoolCorrupt` (a `PayloadUnavailable`) before the last piece, so no whole bad copy is served.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from bootstrap.entries import PayloadUnavailable, StoredPayload
from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import failpoints
from wire import messages as wire
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.payload_stream import PayloadAssembler

log = logging.getLogger("diloco_node.daemon")

# Under the node's coordination directory: where streamed payloads are written as they arrive.
SPOOL_SUBDIR = "relay-spool"
# Payloads kept outside memory are hashed this much at a time.
HASH_PIECE_BYTES = 4 * 1024 * 1024
# Verified payloads kept (spool files on disk; a holder's own or a 2.2 push's bytes in memory) until
# their entry is in the log (then the log holds them); past either bound the oldest goes.
MAX_HELD_PAYLOADS = 16
MAX_HELD_BYTES = 4 * 1024**3
# Digests remembered with the log position of their entry, to serve fetches from the log.
MAX_KNOWN_POSITIONS = 4096


class SpoolCorrupt(PayloadUnavailable):
    """A spool file did not read back as the payload it holds (or could not be read at all)."""


class SpooledPayload:
    """Verified payload bytes in a spool file; once the file is gone (its entry is in the log and
    the file was deleted), read from the log through `fallback` instead. Every read is checked
    against `digest`; `bad` once one was not (the holder then drops it)."""

    __slots__ = ("path", "size", "digest", "_fallback", "bad")

    def __init__(self, path: Path, size: int, digest: bytes,
                 fallback: Callable[[], Payload | None] = lambda: None) -> None:
        self.path, self.size, self.digest = path, size, digest
        self._fallback = fallback
        self.bad = False

    def _logged(self) -> Payload:
        payload = self._fallback()
        if payload is None:
            raise PayloadUnavailable(f"relayed payload {self.digest.hex()[:16]}..: its spool file "
                                     f"{self.path.name} is gone and the log does not hold it")
        return payload

    def read(self) -> bytes:
        try:
            failpoints.hit("spool.read")
            with open(self.path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            logged = self._logged()
            return logged if isinstance(logged, bytes) else logged.read()
        except OSError as error:
            raise self._unreadable(error) from None
        self._check(hashlib.sha256(data).digest(), len(data))
        return data

    def pieces(self, piece_bytes: int) -> Iterator[bytes]:
        try:
            failpoints.hit("spool.read")
            handle = open(self.path, "rb")
        except FileNotFoundError:
            yield from payload_pieces(self._logged(), piece_bytes)
            return
        except OSError as error:
            raise self._unreadable(error) from None
        hasher = hashlib.sha256()
        size = 0
        with handle:  # once open, the bytes stay readable even if the file is deleted meanwhile
            # One piece is held back until the next is read: the last one is yielded only once the
            # whole file matched its digest, so a reader never takes in a complete bad copy.
            held: bytes | None = None
            while True:
                try:
                    piece = handle.read(piece_bytes)
                except OSError as error:
                    raise self._unreadable(error) from None
                if not piece:
                    break
                hasher.update(piece)
                size += len(piece)
                if held is not None:
                    yield held
                held = piece
            self._check(hasher.digest(), size)
            if held is not None:
                yield held

    def _check(self, digest: bytes, size: int) -> None:
        """The bytes read are the payload, or the file is quarantined and `SpoolCorrupt` raised."""
        if digest == self.digest and size == self.size:
            STORAGE.succeeded("spool.read")
            return
        reason = (f"relayed payload {self.digest.hex()[:16]}..: spool file holds {size} bytes of another "
                  f"SHA-256 (expected {self.size} bytes)")
        self.bad = True
        STORAGE.failed("spool.read", reason)
        try:
            STORAGE.quarantine(self.path, reason)
        except FileNotFoundError:
            pass  # deleted meanwhile: nothing to keep
        log.warning("%s; the file is set aside and the payload fetched again", reason)
        raise SpoolCorrupt(reason)

    def _unreadable(self, error: OSError) -> SpoolCorrupt:
        """A spool file the disk will not read: dropped, deleted and fetched again."""
        self.bad = True
        STORAGE.failed("spool.read", error)
        log.warning("relayed payload %s..: spool file %s unreadable (%s); fetched again",
                    self.digest.hex()[:16], self.path.name, error)
        return SpoolCorrupt(f"relayed payload {self.digest.hex()[:16]}..: spool file unreadable: {error}")

    def set_fallback(self, fallback: Callable[[], Payload | None]) -> None:
        self._fallback = fallback

    def as_stored(self) -> StoredPayload:
        """A log entry's payload that the log store copies into log.bin piece by piece."""
        return StoredPayload(self.size, self.read, pieces=self.pieces, transient=True)

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"SpooledPayload({self.path.name}, {self.size} bytes)"


# A payload as the relay I/O handles it: bytes (small, or a 2.2 push), a spool file, or the log's
# own reference to an entry's bytes in log.bin. Only `payload_pieces` reads the last two.
Payload = bytes | SpooledPayload | StoredPayload


def payload_size(payload: Payload) -> int:
    return len(payload) if isinstance(payload, bytes) else payload.size


def payload_pieces(payload: Payload, piece_bytes: int) -> Iterator[bytes]:
    """The payload's bytes in order, at most `piece_bytes` at a time (one piece in memory)."""
    if isinstance(payload, bytes):
        for offset in range(0, len(payload), piece_bytes):
            yield payload[offset:offset + piece_bytes]
        return
    yield from payload.pieces(piece_bytes)


def hash_payload(payload: Payload) -> tuple[bytes, int]:
    """SHA-256 and size, read a piece at a time (a stored record's CRC is checked by the end)."""
    hasher = hashlib.sha256()
    size = 0
    for piece in payload_pieces(payload, HASH_PIECE_BYTES):
        hasher.update(piece)
        size += len(piece)
    return hasher.digest(), size


def entry_payload(payload: Payload) -> Payload:
    """`payload` as a new log entry's payload: a reference into log.bin (another entry's record)
    becomes transient, so the log store writes the bytes into the new entry's own record."""
    if isinstance(payload, StoredPayload) and not payload.transient:
        return StoredPayload(payload.size, payload.read, pieces=payload.pieces, transient=True)
    return payload


class HeldPayloads:
    """The `PayloadStore` of the relay plane: verified payloads by SHA-256 until the log holds them.

    A payload is a `SpooledPayload` (a streamed one, on disk), the log's reference to an entry's
    bytes (the holder's own while it pushes them), or bytes (small ones, a 2.2 single-frame push).
    Bounded by count and bytes (the oldest go first, their spool files deleted: the holder
    resends, a child fetches). Once an entry is in the log its spool file is deleted and its bytes
    are read back from the log (`settle` records where).
    """

    def __init__(self, from_log: Callable[[int, int], Payload | None], *, max_items: int = MAX_HELD_PAYLOADS,
                 max_bytes: int = MAX_HELD_BYTES) -> None:
        # (index, epoch) -> the log entry's payload as the log keeps it (bytes, or its reference
        # into log.bin: nothing read), or None when the log no longer holds that entry
        self._from_log = from_log
        self._held: OrderedDict[bytes, Payload] = OrderedDict()
        self._positions: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._max_items, self._max_bytes = max_items, max_bytes
        self.held_bytes = 0

    def get(self, digest: bytes) -> Payload | None:
        """The payload with this digest, kept here or in the log (a reference: nothing is read)."""
        payload = self.held(digest)
        if payload is not None:
            return payload
        position = self._positions.get(digest)
        return self._from_log(*position) if position is not None else None

    def held(self, digest: bytes) -> Payload | None:
        """The payload if kept here (not read back from the log). A spool file found bad when it
        was read is dropped here: the relay sees the payload missing and fetches it again."""
        payload = self._held.get(digest)
        if isinstance(payload, SpooledPayload) and payload.bad:
            del self._held[digest]
            self._drop(payload)
            return None
        return payload

    def put(self, digest: bytes, payload: Payload) -> None:
        if self.held(digest) is not None or digest in self._positions:  # (a copy found bad is not kept)
            if isinstance(payload, SpooledPayload) and self._held.get(digest) is not payload:
                payload.delete()  # a second copy of bytes already here
            return
        self._held[digest] = payload
        self.held_bytes += payload_size(payload)
        while self._held and (len(self._held) > self._max_items or self.held_bytes > self._max_bytes):
            _, dropped = self._held.popitem(last=False)
            self._drop(dropped)

    def _drop(self, payload: Payload) -> None:
        self.held_bytes -= payload_size(payload)
        if isinstance(payload, SpooledPayload):
            payload.delete()

    def settle(self, digest: bytes, index: int, epoch: int) -> bool:
        """The entry (index, epoch) with these bytes is in the log: serve it from there from now on.
        False when the log does not hold it (after all, or no longer)."""
        if self._from_log(index, epoch) is None:
            return False
        self._positions[digest] = (index, epoch)
        self._positions.move_to_end(digest)
        while len(self._positions) > MAX_KNOWN_POSITIONS:
            self._positions.popitem(last=False)
        dropped = self._held.pop(digest, None)
        if dropped is not None:
            self._drop(dropped)
        return True

    def clear(self) -> None:
        """Forget (and delete) everything kept: the node stops."""
        while self._held:
            self._drop(self._held.popitem()[1])

    @property
    def spooled(self) -> int:
        return sum(1 for payload in self._held.values() if isinstance(payload, SpooledPayload))

    def __contains__(self, digest: bytes) -> bool:
        return self.get(digest) is not None

    def __len__(self) -> int:
        """Payloads kept here (not counting those read back from the log)."""
        return len(self._held)


class SpoolDirectory:
    """Where streamed payloads are written: the node's directory (a previous run's leftovers
    deleted, unverified or no longer needed), or, without one (tests), a temporary directory made
    when first needed and removed at close."""

    def __init__(self, path: Path | None) -> None:
        self._own = path is None
        self._path = None if path is None else Path(path)
        if self._path is not None and self._path.exists():
            for leftover in self._path.iterdir():
                leftover.unlink(missing_ok=True)
        self._serial = 0

    @property
    def path(self) -> Path:
        if self._path is None:
            self._path = Path(tempfile.mkdtemp(prefix="diloco-relay-spool-"))
        self._path.mkdir(parents=True, exist_ok=True)
        return self._path

    def new_file(self, digest: bytes) -> Path:
        self._serial += 1
        return self.path / f"{digest.hex()[:16]}-{self._serial}.part"

    def close(self) -> None:
        if self._own and self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)


class PayloadReceiver:
    """One streamed payload arriving (the transport's SequenceConsumer): checked chunk by chunk,
    spooled to a file and hashed in a worker thread; kept only if whole and of the declared digest.

    `progress(received)` after each chunk; then once, `accept(payload)` for verified bytes, and
    `ended(refused)` whatever happened (after `accept`): refused is True for a wrong digest or a
    short stream, False for a body that broke off or a stream that was kept.
    """

    def __init__(self, assembler: PayloadAssembler, sender: str, path: Path, *, progress: Callable[[int], None],
                 accept: Callable[[SpooledPayload], None], ended: Callable[[bool], None]) -> None:
        self.assembler, self.sender, self.path = assembler, sender, path
        self._progress, self._accept, self._ended = progress, accept, ended
        self._hasher = hashlib.sha256()
        self._file: BinaryIO | None = None
        self._done = False
        progress(0)

    @property
    def max_remaining_bytes(self) -> int:
        return self.assembler.max_remaining_bytes

    @property
    def frames_left(self) -> int:
        return self.assembler.chunks_left

    async def part(self, message: wire.Message) -> None:
        if not isinstance(message, wire.PayloadChunk):
            raise RemoteProtocolError(f"a PayloadOpen body continues with PayloadChunks, got {type(message).__name__}")
        self.assembler.add(message)
        await asyncio.to_thread(self._write, message.payload)
        self._progress(self.assembler.received)

    def _write(self, data: bytes) -> None:
        try:
            failpoints.hit("spool.write")
            if self._file is None:
                self._file = open(self.path, "wb")
            self._file.write(data)
        except OSError as error:
            first = not STORAGE.is_failing("spool.write")
            STORAGE.failed("spool.write", error)
            if first:
                log.warning("relayed payload from %s not spooled (%s): refused, it is fetched later", self.sender,
                            error)
            # 507 Insufficient Storage: the sender keeps the bytes; the transport aborts this stream.
            raise RemoteProtocolError(f"cannot spool the payload: {error}", 507) from None
        self._hasher.update(data)

    async def finish(self) -> None:
        await asyncio.to_thread(self._close)
        try:
            self.assembler.finish(self._hasher.digest())
        except RemoteProtocolError:
            self._discard(refused=True)
            raise
        # Spool files are not fsynced (deleted at start): the crash points fire with the file complete.
        failpoints.around_fsync("spool.write", lambda: None)
        if STORAGE.succeeded("spool.write"):
            log.warning("relayed payloads are spooled again")
        head = self.assembler.head
        try:
            self._accept(SpooledPayload(self.path, head.size, head.digest))
        finally:
            self._end(refused=False)
        return None

    async def abort(self, reason: str) -> None:
        try:
            await asyncio.to_thread(self._close)
        except RemoteProtocolError:
            pass  # the file is deleted below whatever its last bytes did
        self._discard(refused=False)
        log.info("payload stream from %s dropped: %s", self.sender, reason)

    def _close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()  # flushes the last buffered bytes: the disk may refuse them here
            except OSError as error:
                STORAGE.failed("spool.write", error)
                raise RemoteProtocolError(f"cannot spool the payload: {error}", 507) from None

    def _discard(self, *, refused: bool) -> None:
        self.path.unlink(missing_ok=True)
        self._end(refused=refused)

    def _end(self, *, refused: bool) -> None:
        if not self._done:
            self._done = True
            self._ended(refused)


async def payload_frames(head: wire.PayloadOpen, payload: Payload) -> AsyncIterator[wire.Message]:
    """The open, then each chunk, read one at a time in a worker thread (a spool file, log.bin)."""
    yield head
    pieces = payload_pieces(payload, head.chunk_bytes)
    buffer = bytearray()
    offset = 0
    try:
        while True:
            piece = await asyncio.to_thread(next, pieces, None)
            if piece is None:
                break
            if not buffer and (len(piece) == head.chunk_bytes or offset + len(piece) == head.size) \
                    and len(piece) <= head.chunk_bytes:
                yield wire.PayloadChunk(head.stream, offset, bytes(piece))  # the usual case: no copy
                offset += len(piece)
                continue
            buffer += piece
            while len(buffer) >= head.chunk_bytes or (buffer and offset + len(buffer) == head.size):
                chunk = bytes(buffer[:head.chunk_bytes])
                del buffer[:head.chunk_bytes]
                yield wire.PayloadChunk(head.stream, offset, chunk)
                offset += len(chunk)
    finally:
        pieces.close()
    if offset != head.size or buffer:
        raise LocalProtocolError(f"payload {head.digest.hex()[:16]}.. gave {offset + len(buffer)} bytes, "
                                 f"declared {head.size}")
