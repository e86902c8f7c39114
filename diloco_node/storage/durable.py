"""Durable file steps: every fsync of the daemon goes through here, behind its failpoint.

- `sync_file(point, fd, path)`: fsync one file's data and remember the length that is now durable;
- `sync_dir(directory)`: make a rename or a new entry in a directory durable;
- `atomic_write(point, path, data)`: temporary file, fsync, rename, fsync of the directory, so a
  reader sees the old bytes or the new ones, never a mix;
- `track(path)`: a file whose writes a crash failpoint must treat as lost until they are fsynced.

Because the fsyncs are all here, a crash failpoint can do what a power cut does: before the
process exits, every tracked file is cut back to the length its last fsync made durable (and a
file never fsynced to nothing). Only the data past the last fsync of appended files is modelled;
a rename is durable once `sync_dir` returned, and `atomic_write` always calls it at once.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from diloco_node.storage import failpoints

_synced_length: dict[Path, int] = {}
_lock = threading.Lock()


def track(path: Path) -> None:
    """Start treating `path`'s unsynced writes as lost at a failpoint crash. What is on disk when
    tracking starts counts as durable (it survived to be opened)."""
    path = Path(path)
    length = path.stat().st_size if path.exists() else 0
    with _lock:
        _synced_length.setdefault(path, length)


def forget(path: Path) -> None:
    """Stop tracking `path` (it was removed, or renamed into place by `atomic_write`)."""
    with _lock:
        _synced_length.pop(Path(path), None)


def sync_file(point: str, fd: int, path: Path | None = None) -> None:
    """fsync `fd` behind failpoint `point` (crash-before/after fire here); then the file's current
    length is what a crash keeps."""
    def fsync_and_record() -> None:
        os.fsync(fd)
        if path is not None:  # recorded before a crash-after can fire: those bytes are durable
            length = os.fstat(fd).st_size
            with _lock:
                _synced_length[Path(path)] = length

    failpoints.around_fsync(point, fsync_and_record)


def sync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable (its entry, not only the file's data)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """Where `atomic_write` stages `path` (a dot file beside it; removed at start if left over)."""
    return path.with_name(f".{path.name}.tmp")


def atomic_write(point: str, path: Path, data: bytes | memoryview) -> None:
    """Replace `path` with `data` durably: the failpoint's errors fire before anything is written,
    its crashes around the fsync of the temporary file. A failed write removes the temporary file
    and leaves `path` as it was."""
    path = Path(path)
    failpoints.hit(point)
    temp = temp_path(path)
    try:
        with open(temp, "wb") as handle:
            track(temp)
            handle.write(data)
            handle.flush()
            sync_file(point, handle.fileno(), temp)
        os.replace(temp, path)
        forget(temp)
        sync_dir(path.parent)
    except BaseException:
        forget(temp)
        temp.unlink(missing_ok=True)
        raise


def drop_unsynced() -> list[tuple[Path, int, int]]:
    """Cut every tracked file back to its last fsynced length, as a power cut would; returns
    (path, length before, length kept) for each file that lost bytes."""
    dropped: list[tuple[Path, int, int]] = []
    with _lock:
        items = list(_synced_length.items())
    for path, durable_length in items:
        try:
            length = path.stat().st_size
            if length > durable_length:
                os.truncate(path, durable_length)
                dropped.append((path, length, durable_length))
        except FileNotFoundError:
            continue
    return dropped


failpoints.on_crash(drop_unsynced)
