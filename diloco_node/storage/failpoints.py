"""Failpoints: named faults at the daemon's durable reads and writes, for tests and chaos runs.

A failpoint is a place in the code where a durable step happens (a log record appended, a
checkpoint written, a file read back). Each one is a name in `POINTS`. In production none is
armed and a point costs one truthiness test of an empty dict. A test or a chaos run arms points
by name, either in the environment before the daemon starts

    DILOCO_X_FAILPOINTS="log.append=enospc*3,checkpoint.write=crash-before"

or at run time (`arm`, which the loopback operator route calls). Actions:

- `enospc`, `eio`: the step raises `OSError` with that errno, as a full or failing disk would;
- `crash-before`, `crash-after`: the process exits at once (no cleanup, no flush) just before or
  just after the step's fsync. Before exiting, whatever was written but not fsynced is dropped
  (`diloco_node.storage.durable` truncates each file it tracks to its last fsynced length), so a test
  sees what a power cut would leave, not what the page cache would have saved;
- `stall:SECONDS`: the calling thread blocks that long (a disk that hangs).

`@K` after an action lets the first K-1 hits pass and fires from the K-th on; `*N` fires it on
N hits only, then the point disarms itself (`crash-before@3*1`: the third fsync crashes).
The list of points, what each guards and how a failure there is handled, is in docs/DAEMON.md.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

ENV_VAR = "DILOCO_X_FAILPOINTS"
CRASH_EXIT_CODE = 86  # distinct from a signal's 128+N, so a test can tell a failpoint crash apart

# Every durable step, by name. A `.read` point fails the read back (eio) or stalls it; a write
# point fails before anything is written, or crashes around the step's fsync.
POINTS: Mapping[str, str] = {
    "election.write": "the election record (epoch and vote), both copies, rewritten before a vote is answered",
    "election.read": "each copy of the election record read at start",
    "log.append": "replicated log records appended to log.bin (and fsynced before they are acknowledged)",
    "log.truncate": "log.bin rewritten whole (a leader overwrote a conflicting suffix, a snapshot was installed), "
                    "or cut back to its last good record at start",
    "log.compact": "the log rewritten below a checkpoint (compaction)",
    "vote_floor.write": "the vote floor (the newest epoch and index log.bin held) raised, after log.bin's fsync "
                        "and before anything that depends on it is acknowledged",
    "log.read": "log.bin read back (at start, for catch-up and for payloads)",
    "checkpoint.write": "a checkpoint written (temporary file, fsync, rename)",
    "checkpoint.read": "a checkpoint read back at start",
    "identity.write": "the identity file rewritten when only its address book changed",
    "identity.read": "the identity file read at start",
    "manifest.write": "the identity file written with a new run manifest (founding, joining)",
    "manifest.read": "the run manifest (in the identity file) read at start",
    "version_rings.write": "a past fragment version written into its ring slot (a cache, never fsynced)",
    "version_rings.read": "a past fragment version read back from its ring slot for a rebase (CRC32-checked)",
    "history.write": "a line appended to the history (history.jsonl)",
    "spool.write": "a relayed payload spooled to disk",
    "spool.read": "a spooled payload read back to serve it",
    "export.write": "an exported model written",
    "data_cache.write": "a site's tokenized-text cache written (temporary file, fsync, rename)",
}

ACTIONS = ("enospc", "eio", "crash-before", "crash-after", "stall")


class FailpointError(ValueError):
    """A failpoint specification that names no known point or action."""


@dataclass(slots=True)
class Armed:
    """One armed point: what it does, and how many more hits fire it (None: every hit)."""

    action: str
    stall_s: float = 0.0
    remaining: int | None = None
    skip: int = 0  # hits still to let pass before it fires


_armed: dict[str, Armed] = {}
_lock = threading.Lock()
_before_crash: list[Callable[[], None]] = []


def parse(spec: str) -> dict[str, Armed]:
    """`point=action[*N],...` to armed points; raises FailpointError naming what is wrong."""
    armed: dict[str, Armed] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, rest = item.partition("=")
        name = name.strip()
        if not sep:
            raise FailpointError(f"failpoint {item!r}: expected point=action")
        if name not in POINTS:
            raise FailpointError(f"unknown failpoint {name!r}; known: {', '.join(sorted(POINTS))}")
        action, star, count_text = rest.strip().partition("*")
        action, at, start_text = action.partition("@")
        skip = 0
        if at:
            if not start_text.isdigit() or int(start_text) < 1:
                raise FailpointError(f"failpoint {name}: @ needs the hit to start at (1 or more), got {start_text!r}")
            skip = int(start_text) - 1
        remaining = None
        if star:
            if not count_text.isdigit() or int(count_text) < 1:
                raise FailpointError(f"failpoint {name}: count must be a positive integer, got {count_text!r}")
            remaining = int(count_text)
        stall_s = 0.0
        if action.startswith("stall:"):
            try:
                stall_s = float(action.removeprefix("stall:"))
            except ValueError:
                raise FailpointError(f"failpoint {name}: stall needs seconds, got {action!r}") from None
            if not 0 <= stall_s <= 3600:
                raise FailpointError(f"failpoint {name}: stall must be 0..3600 s, got {stall_s}")
            action = "stall"
        if action not in ACTIONS:
            raise FailpointError(f"failpoint {name}: unknown action {action!r}; known: {', '.join(ACTIONS)}")
        armed[name] = Armed(action, stall_s, remaining, skip)
    return armed


def load_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Arm what `DILOCO_X_FAILPOINTS` names (called once at daemon start); returns `armed()`."""
    spec = (os.environ if environ is None else environ).get(ENV_VAR, "")
    parsed = parse(spec)
    with _lock:
        _armed.update(parsed)
    return armed()


def arm(spec: str) -> dict[str, str]:
    """Arm the points `spec` names (same syntax as the environment); returns `armed()`."""
    parsed = parse(spec)
    with _lock:
        _armed.update(parsed)
    return armed()


def disarm(name: str | None = None) -> dict[str, str]:
    """Disarm one point, or all of them with None; returns `armed()`."""
    if name is not None and name not in POINTS:
        raise FailpointError(f"unknown failpoint {name!r}")
    with _lock:
        if name is None:
            _armed.clear()
        else:
            _armed.pop(name, None)
    return armed()


def armed() -> dict[str, str]:
    """The armed points and their actions, as text (for `/status` and the operator route)."""
    with _lock:
        return {name: _describe(a) for name, a in sorted(_armed.items())}


def enabled() -> bool:
    """Whether any point is armed (the operator route refuses to arm unless the daemon was
    started with failpoints allowed; this is only the state)."""
    return bool(_armed)


def on_crash(hook: Callable[[], None]) -> None:
    """Run `hook` just before a crash action exits the process (durable.py drops unsynced data)."""
    _before_crash.append(hook)


def hit(name: str) -> None:
    """A write or read step at `name` is about to happen: raise, stall or crash if armed.
    Crash actions armed on a point with an fsync fire in `around_fsync` instead."""
    if not _armed:
        return
    action = _take(name, ("enospc", "eio", "stall"))
    if action is not None:
        _perform(name, action)


def around_fsync(name: str, fsync: Callable[[], None]) -> None:
    """Run the step's fsync, crashing just before or after it if `name` is armed so."""
    if not _armed:
        fsync()
        return
    action = _take(name, ("crash-before",))
    if action is not None:
        _crash(name)
    fsync()
    action = _take(name, ("crash-after",))
    if action is not None:
        _crash(name)


def _take(name: str, actions: tuple[str, ...]) -> Armed | None:
    if name not in POINTS:
        raise FailpointError(f"code names an unknown failpoint {name!r}")
    with _lock:
        current = _armed.get(name)
        if current is None or current.action not in actions:
            return None
        if current.skip > 0:
            current.skip -= 1
            return None
        if current.remaining is not None:
            current.remaining -= 1
            if current.remaining <= 0:
                del _armed[name]
        return current


def _perform(name: str, armed_point: Armed) -> None:
    if armed_point.action == "stall":
        time.sleep(armed_point.stall_s)
    elif armed_point.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (failpoint {name})")
    elif armed_point.action == "eio":
        raise OSError(errno.EIO, f"Input/output error (failpoint {name})")


def _crash(name: str) -> None:
    for hook in _before_crash:
        hook()
    os.write(2, f"failpoint {name}: crashing\n".encode())
    os._exit(CRASH_EXIT_CODE)


def _describe(a: Armed) -> str:
    text = f"stall:{a.stall_s:g}" if a.action == "stall" else a.action
    text += f"@{a.skip + 1}" if a.skip else ""
    return text if a.remaining is None else f"{text}*{a.remaining}"
