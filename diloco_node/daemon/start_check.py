"""The node's own state files read once before anything imports JAX, so a start that cannot read
them ends in a second or two rather than after the import (tens of seconds on a loaded host).

`diloco-node run` calls `check_state_files` before it imports the daemon. It reads what the start
reads first, the way the start reads it: the identity record and the election record (through the
coordination store's own readers: a damaged record is quarantined and refused exactly as the start
would), the high-water mark and the vote floor, the head of `log.bin` (behind its failpoint
`log.read`) and of the history, and the checkpoints' headers, newest first, until one reads
(behind `checkpoint.read`): when none can be read at all, the start would stop with the same
error. Read failpoints armed at start are hit here as well as by the start. Nothing is written but
what the record readers quarantine; what it cannot see (damage deep in `log.bin`, a checkpoint
whose header is corrupt or whose body fails its checksum) is the start's to find, with the same
one line. Importing this module imports no JAX (tests/integration/test_commands_without_jax.py).
"""

from __future__ import annotations

from pathlib import Path

from diloco_node.daemon.coordination_records import FLOOR_FILE, MARK_FILE, read_election
from diloco_node.daemon.coordination_store import CoordinationStore
from diloco_node.daemon.log_records import CoordinationStoreError
from diloco_node.ops.checkpoint import _NAME_RE, CheckpointError, _checked_header
from diloco_node.ops.history import HISTORY_FILE_NAME
from diloco_node.storage import failpoints

COORDINATION_DIR = "coordination"
CHECKPOINTS_DIR = "checkpoints"
# How much of log.bin and of the history is read: the first records, enough to fail as an unreadable
# file fails, without reading a log of gigabytes twice.
HEAD_BYTES = 64 * 1024


def _read_head(path: Path, point: str | None = None) -> None:
    if not path.exists() and not path.is_symlink():
        return
    if point is not None:
        failpoints.hit(point)
    with open(path, "rb") as handle:
        handle.read(HEAD_BYTES)


def check_state_files(data_dir: str | Path) -> None:
    """Read the node's state files under `data_dir` as the start would. Raises OSError or
    CoordinationStoreError (the start's exit 4), or DamagedStateError (a ConfigError: exit 2)."""
    data_dir = Path(data_dir)
    directory = data_dir / COORDINATION_DIR
    _read_head(data_dir / HISTORY_FILE_NAME)
    _check_checkpoints(data_dir / CHECKPOINTS_DIR)
    if not directory.is_dir():
        return  # a new node (or not a directory: the start says so, creating it)
    store = CoordinationStore(directory)
    if not store.exists():
        return
    store.load_identity()
    try:
        read_election(directory)
    except OSError as error:  # worded as the start words it (coordination_store.load_persistent)
        raise CoordinationStoreError(f"{directory}: the election record is unreadable: {error}") from None
    for name in (MARK_FILE, FLOOR_FILE):
        _read_head(directory / name)
    try:
        _read_head(store.log_path, "log.read")
    except OSError as error:
        raise CoordinationStoreError(f"{store.log_path}: unreadable: {error}") from None


def _check_checkpoints(directory: Path) -> None:
    """CheckpointError when there are checkpoints and none can be read at all (the start's own
    error when every candidate fails). A header that reads, or one that is corrupt (the start
    quarantines it and tries the next), ends the check: the rest is the start's."""
    if not directory.is_dir():
        return
    names = sorted((entry.name for entry in directory.iterdir() if _NAME_RE.match(entry.name)), reverse=True)
    unreadable = []
    for name in names:
        path = directory / name
        try:
            failpoints.hit("checkpoint.read")
            with path.open("rb") as handle:
                _checked_header(path, handle)
        except OSError as error:  # worded as ops/checkpoint.read_checkpoint_file words it
            unreadable.append(f"{path}: cannot read: {error.strerror or error}")
            continue
        except CheckpointError:
            return
        return
    if unreadable:
        raise CheckpointError("no loadable checkpoint; every candidate failed:\n  " + "\n  ".join(unreadable))
