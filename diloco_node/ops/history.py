"""A node's history: an append-only JSONL record of what it did, for the chaos checker and metrics.

The daemon calls a `HistoryWriter` at fixed points (join, vote, lease acquired/lost, append,
commit, apply, leave, start, stop) and feeds it learner progress (`step`), which is batched into
about one event per second. `read_history` reads a file back; `load_histories` reads a run's
directory. The format is the contract between the daemon and `diloco_node.testbed.chaos` and is
documented in docs/CHAOS.md.

One event per line, a JSON object with exactly these keys:
    t_wall, t_mono, node, kind, epoch, index, entry_digest, state_digest, fragment, round, detail

Durability: every event is written with one `os.write` on an `O_APPEND` descriptor, so a line
survives the process being SIGKILLed the moment the call returns (the page cache belongs to the
kernel). `fsync` only matters for power loss; the default policy ("critical") fsyncs after the
events that record a promise to peers (vote, lease_acquired, commit, leave, stop), through
`storage/durable.py` at failpoint `history.write`. A crash can leave at most one torn last line; the
reader drops it, the writer cuts it off when it reopens the file, and any other malformed line is
an error.

A write the disk refuses (full, failing: `OSError`) never reaches the caller: the history is a
record of what the node did, and the node (its learner above all) goes on doing it. The event is
dropped and counted (`lost_events`), a partial line is cut back off the file so the next line starts
clean, `/status`'s storage section names `history.write` (`ops/storage_health.py`), the log warns
once per failure streak, and lines resume with the first write that succeeds. A gap in a history is
therefore possible where the disk failed; a line in it is never half of one.

Bounded on disk: when the live file passes `max_bytes` (default 64 MiB) it is renamed to
`history.jsonl.1` (older segments shift to `.2`, ... and the one past `keep` is deleted), so a
daemon that runs for months keeps at most (keep + 1) x max_bytes of history. Readers take the
rotated segments too (`find_history_files`).

Small on purpose: no JAX, no asyncio, a lock around each write so any thread may record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import durable, failpoints

log = logging.getLogger("diloco_node.history")

HISTORY_FILE_NAME = "history.jsonl"

NODE_KINDS = frozenset({
    "join", "vote", "lease_acquired", "lease_lost", "append", "commit", "apply", "leave",
    "step", "start", "stop", "eval",
})
# Written by the chaos harness (its own "nemesis" history), never by a node.
NEMESIS_KINDS = frozenset({"fault", "heal", "final"})
KINDS = NODE_KINDS | NEMESIS_KINDS

# Kinds that state something about a log entry must say which entry.
_ENTRY_KINDS = frozenset({"append", "commit", "apply"})
# Events after which the default policy fsyncs: each records a promise made to peers
# (a vote, a lease, a commit) that must not be forgotten across a power loss either.
CRITICAL_KINDS = frozenset({"vote", "lease_acquired", "commit", "leave", "stop"})
FsyncPolicy = Literal["always", "critical", "never"]
FSYNC_POLICIES: tuple[str, ...] = ("always", "critical", "never")

# Learner progress is summed and written about once per this many seconds: enough resolution
# for goodput and uptime over runs of minutes, and a few hundred bytes per second per node.
STEP_BATCH_S = 1.0
# A line longer than this is refused at write time (a bug, e.g. a tensor put into `detail`)
# and at read time (not a history file).
MAX_LINE_BYTES = 64 * 1024
# Rotation: a busy tiny-model node writes ~13 KB/s (~1.1 GB/day) without it. 64 MiB segments hold
# over an hour of the busiest run we have measured; five of them bound the total at 320 MiB.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_KEEP = 4  # rotated segments kept besides the live file

FIELDS = ("t_wall", "t_mono", "node", "kind", "epoch", "index", "entry_digest", "state_digest",
          "fragment", "round", "detail")


class HistoryFormatError(ValueError):
    """A history line or event is malformed; the message names the file, line and field."""


def _check_opt_int(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise HistoryFormatError(f"{name} = {value!r}: expected a non-negative integer or null")


def _check_opt_str(name: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise HistoryFormatError(f"{name} = {value!r}: expected a string or null")


@dataclass(frozen=True, slots=True)
class HistoryEvent:
    """One line of a history. Valid by construction; `epoch` is the node's current epoch."""

    t_wall: float  # time.time(): for humans only, never compared across nodes
    t_mono: float  # time.monotonic(): CLOCK_MONOTONIC, shared by every process on one host
    node: str
    kind: str
    epoch: int | None = None
    index: int | None = None
    entry_digest: str | None = None
    state_digest: str | None = None
    fragment: int | None = None
    round: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("t_wall", "t_mono"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise HistoryFormatError(f"{name} = {value!r}: expected a finite number")
        if not isinstance(self.node, str) or not self.node:
            raise HistoryFormatError(f"node = {self.node!r}: expected a non-empty string")
        if self.kind not in KINDS:
            raise HistoryFormatError(f"kind = {self.kind!r}: expected one of {sorted(KINDS)}")
        for name in ("epoch", "index", "fragment", "round"):
            _check_opt_int(name, getattr(self, name))
        for name in ("entry_digest", "state_digest"):
            _check_opt_str(name, getattr(self, name))
        if not isinstance(self.detail, Mapping):
            raise HistoryFormatError(f"detail = {self.detail!r}: expected an object")
        if self.kind in _ENTRY_KINDS and (self.index is None or self.entry_digest is None):
            raise HistoryFormatError(f"a {self.kind} event needs index and entry_digest")
        if self.kind == "apply" and self.state_digest is None:
            raise HistoryFormatError("an apply event needs state_digest (the state after applying)")
        if self.kind in ("vote", "lease_acquired", "lease_lost") and self.epoch is None:
            raise HistoryFormatError(f"a {self.kind} event needs epoch")
        if self.kind == "step":
            for key in ("steps", "tokens", "productive_s"):
                value = self.detail.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                    raise HistoryFormatError(f"a step event needs detail.{key} >= 0, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {name: (dict(self.detail) if name == "detail" else getattr(self, name)) for name in FIELDS}

    def to_line(self) -> bytes:
        line = json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False).encode() + b"\n"
        if len(line) > MAX_LINE_BYTES:
            raise HistoryFormatError(f"{self.kind} event is {len(line)} bytes, limit {MAX_LINE_BYTES}")
        return line

    @classmethod
    def from_dict(cls, raw: object) -> HistoryEvent:
        if not isinstance(raw, dict):
            raise HistoryFormatError(f"expected a JSON object, got {type(raw).__name__}")
        missing = [name for name in FIELDS if name not in raw]
        if missing:
            raise HistoryFormatError(f"missing {', '.join(missing)}")
        extra = sorted(set(raw) - set(FIELDS))
        if extra:
            raise HistoryFormatError(f"unknown keys {', '.join(extra)}")
        detail = raw["detail"] if raw["detail"] is not None else {}
        return cls(**{**raw, "detail": detail})


class HistoryWriter:
    """Appends one node's events to its history file. Thread-safe; `close()` when done."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        node: str,
        *,
        fsync: FsyncPolicy = "critical",
        step_batch_s: float = STEP_BATCH_S,
        wall_clock: Callable[[], float] = time.time,
        mono_clock: Callable[[], float] = time.monotonic,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync = {fsync!r}: expected one of {FSYNC_POLICIES}")
        if max_bytes is not None and max_bytes < MAX_LINE_BYTES:
            raise ValueError(f"max_bytes = {max_bytes}: must be None (no rotation) or >= {MAX_LINE_BYTES}")
        if keep < 1:
            raise ValueError(f"keep = {keep}: must be >= 1 (rotation needs somewhere to put the old file)")
        if not node:
            raise ValueError("node: expected a non-empty node id")
        self.path = Path(path)
        self.node = node
        self.fsync_policy = fsync
        self.step_batch_s = step_batch_s
        self._wall = wall_clock
        self._mono = mono_clock
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._cut_torn_tail()
        self._size = os.fstat(self._fd).st_size
        # Events the disk refused since the writer opened (see the module's docstring).
        self.lost_events = 0
        self._closed = False
        # Learner progress accumulated since the last step event.
        self._steps = 0
        self._tokens = 0
        self._productive_s = 0.0
        self._step_extra: dict[str, Any] = {}
        self._batch_started: float | None = None

    def _cut_torn_tail(self) -> None:
        """A previous process may have died mid-line; appending after it would glue two events."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(max(0, size - MAX_LINE_BYTES - 1))
            tail = f.read()
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n")
        keep = size - len(tail) + cut + 1 if cut >= 0 else 0
        os.truncate(self.path, keep)

    def record(
        self,
        kind: str,
        *,
        epoch: int | None = None,
        index: int | None = None,
        entry_digest: str | None = None,
        state_digest: str | None = None,
        fragment: int | None = None,
        round: int | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> HistoryEvent:
        """Write one event now and return it. Pending learner progress is written first."""
        with self._lock:
            if kind != "step":
                self._flush_steps_locked()
            event = HistoryEvent(
                t_wall=self._wall(), t_mono=self._mono(), node=self.node, kind=kind, epoch=epoch,
                index=index, entry_digest=entry_digest, state_digest=state_digest,
                fragment=fragment, round=round, detail=dict(detail or {}),
            )
            self._write_locked(event)
            return event

    def step(self, steps: int, tokens: int, productive_s: float, **extra: Any) -> HistoryEvent | None:
        """Add learner progress; writes a `step` event once `step_batch_s` has passed since the
        batch began. `extra` (e.g. learner_step=1234, loss=2.1) keeps the latest value."""
        if steps < 0 or tokens < 0 or not productive_s >= 0:
            raise ValueError(f"step progress must be >= 0, got steps={steps} tokens={tokens} productive_s={productive_s}")
        with self._lock:
            now = self._mono()
            if self._batch_started is None:
                self._batch_started = now
            self._steps += steps
            self._tokens += tokens
            self._productive_s += productive_s
            self._step_extra.update(extra)
            if now - self._batch_started >= self.step_batch_s:
                return self._flush_steps_locked()
            return None

    def flush_steps(self) -> HistoryEvent | None:
        """Write pending learner progress now (before stopping, or at a test's checkpoint)."""
        with self._lock:
            return self._flush_steps_locked()

    def _flush_steps_locked(self) -> HistoryEvent | None:
        if self._batch_started is None:
            return None
        detail = {**self._step_extra, "steps": self._steps, "tokens": self._tokens,
                  "productive_s": self._productive_s}
        event = HistoryEvent(t_wall=self._wall(), t_mono=self._mono(), node=self.node, kind="step",
                             detail=detail)
        self._steps, self._tokens, self._productive_s = 0, 0, 0.0
        self._step_extra = {}
        self._batch_started = None
        self._write_locked(event)
        return event

    def _write_locked(self, event: HistoryEvent) -> None:
        if self._closed:
            raise ValueError(f"history {self.path} is closed")
        line = event.to_line()
        try:
            if self._fd is None:  # a rotation that failed part way could not reopen the live file
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._size = os.fstat(self._fd).st_size
            failpoints.hit("history.write")
            written = os.write(self._fd, line)
            if written != len(line):  # disk full mid-line
                raise OSError(f"history {self.path}: short write ({written} of {len(line)} bytes)")
            self._size += written
            if self.fsync_policy == "always" or (self.fsync_policy == "critical" and event.kind in CRITICAL_KINDS):
                durable.sync_file("history.write", self._fd)
        except OSError as error:
            self._write_failed_locked(event, error)
            return
        if self.max_bytes is not None and self._size >= self.max_bytes:
            try:
                self._rotate_locked()
            except OSError as error:  # the line is written; the file grows past its bound until a rotation works
                self._rotation_failed_locked(error)
                return
        if STORAGE.succeeded("history.write"):
            log.warning("%s: history lines are written again (%d events lost while the disk refused them)",
                        self.path, self.lost_events)

    def _write_failed_locked(self, event: HistoryEvent, error: OSError) -> None:
        """The disk refused `event`: drop it, cut a partial line back off, say so once per streak."""
        self.lost_events += 1
        try:
            if self._fd is not None and os.fstat(self._fd).st_size != self._size:
                os.ftruncate(self._fd, self._size)
        except OSError:
            pass  # a torn tail is cut when the file is next opened; the reader drops it meanwhile
        self._report_failure(f"{event.kind} event not written", error)

    def _rotation_failed_locked(self, error: OSError) -> None:
        """A rotation stopped part way: write on to whatever file is now live."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._size = os.fstat(self._fd).st_size
            except OSError:
                pass  # the next write fails and tries no rotation
        self._report_failure("history not rotated", error)

    def _report_failure(self, what: str, error: OSError) -> None:
        first = not STORAGE.is_failing("history.write")
        STORAGE.failed("history.write", error)
        if first:
            log.warning("%s: %s; the node goes on without it until the disk takes writes again: %s",
                        self.path, what, error)

    def _rotate_locked(self) -> None:
        """Live file -> `.1`, `.k` -> `.k+1`, the one past `keep` deleted; then a fresh live file.
        Only whole lines are ever rotated (we rotate between writes), so segments never tear."""
        assert self._fd is not None
        durable.sync_file("history.write", self._fd)
        os.close(self._fd)
        self._fd = None
        for number in range(self.keep, 0, -1):
            older = rotated_path(self.path, number)
            if older.exists():
                if number == self.keep:
                    older.unlink()
                else:
                    os.replace(older, rotated_path(self.path, number + 1))
        os.replace(self.path, rotated_path(self.path, 1))
        durable.sync_dir(self.path.parent)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = 0

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._flush_steps_locked()
            self._closed = True
            if self._fd is not None:
                try:
                    durable.sync_file("history.write", self._fd)
                except OSError as error:  # the lines are written; only their durability is in doubt
                    STORAGE.failed("history.write", error)
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class History:
    """The events of one file in file order, and whether a torn last line was dropped."""

    path: Path
    events: tuple[HistoryEvent, ...]
    torn_tail: bool = False


def read_history(path: str | os.PathLike[str]) -> History:
    """Read a history file. A torn last line (no newline: the writer died mid-write) is dropped;
    any other malformed line raises `HistoryFormatError` naming the file and line."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = lines[-1] != b""  # the text after the last newline: empty unless a write was cut
    events: list[HistoryEvent] = []
    for number, line in enumerate(lines[:-1], start=1):
        if len(line) > MAX_LINE_BYTES:
            raise HistoryFormatError(f"{path}:{number}: line of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
        try:
            events.append(HistoryEvent.from_dict(json.loads(line)))
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise HistoryFormatError(f"{path}:{number}: {exc}") from None
    return History(path=path, events=tuple(events), torn_tail=torn)


def rotated_path(path: Path, number: int) -> Path:
    """The `number`-th older segment of the history file at `path` (1 = the most recent)."""
    return path.with_name(f"{path.name}.{number}")


def find_history_files(root: str | os.PathLike[str]) -> list[Path]:
    """Every history file under `root` (a run's working directory), rotated segments included,
    sorted for stable output (`load_histories` orders events by time, not by file)."""
    found: list[Path] = []
    for live in sorted(Path(root).rglob(HISTORY_FILE_NAME)):
        rotated = [p for p in live.parent.glob(f"{HISTORY_FILE_NAME}.*") if p.suffix[1:].isdigit()]
        found.extend(sorted(rotated, key=lambda p: -int(p.suffix[1:])))  # oldest segment first
        found.append(live)
    return found


def load_histories(paths: Iterable[str | os.PathLike[str]]) -> dict[str, list[HistoryEvent]]:
    """Read several files and group events by node (a node's file may be split across restarts
    or data directories); each node's events are sorted by `t_mono`, stable for ties."""
    by_node: dict[str, list[HistoryEvent]] = {}
    for path in paths:
        for event in read_history(path).events:
            by_node.setdefault(event.node, []).append(event)
    for events in by_node.values():
        events.sort(key=lambda e: e.t_mono)
    return by_node
