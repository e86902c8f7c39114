"""What the node's disk is doing to it: failed durable steps, recoveries and quarantined files.

Every durable step that fails (a full disk, an I/O error, a checksum that does not match) is
recorded here by its failpoint name (`diloco_node.storage.failpoints.POINTS`), from whichever thread
hit it; the next success at the same point clears it. A file found corrupt is renamed aside and
listed here. `/status` shows `to_status()` (the `storage` section) and the readiness reason names
the failing points, so an operator sees "log.append: No space left on device" instead of a
stalled node with no error.

One daemon process is one node, so the record is process-wide (`STORAGE`); tests make their own
`StorageHealth` or call `STORAGE.reset()`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MAX_QUARANTINED_LISTED = 32  # the status lists the newest ones; the files themselves are all kept


@dataclass(slots=True)
class PointFailure:
    """The last failure at one point, and how many times in a row it has failed."""

    error: str
    since_wall: float
    consecutive: int = 1


@dataclass(slots=True)
class Quarantined:
    """A file that failed its check, renamed aside (kept for an operator to inspect)."""

    original: str
    kept_as: str
    reason: str
    at_wall: float


@dataclass
class StorageHealth:
    """The failing points and quarantined files of this process; thread-safe."""

    failing: dict[str, PointFailure] = field(default_factory=dict)
    quarantined: list[Quarantined] = field(default_factory=list)
    failures_total: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def failed(self, point: str, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else (f"{type(error).__name__}: {error}")
        with self._lock:
            self.failures_total[point] = self.failures_total.get(point, 0) + 1
            current = self.failing.get(point)
            if current is None:
                self.failing[point] = PointFailure(text, time.time())
            else:
                current.error = text
                current.consecutive += 1

    def succeeded(self, point: str) -> bool:
        """The step at `point` worked; returns True when that ends a failure (a recovery)."""
        if point not in self.failing:  # the common case, without the lock
            return False
        with self._lock:
            return self.failing.pop(point, None) is not None

    def is_failing(self, point: str) -> bool:
        return point in self.failing

    def quarantine(self, path: Path, reason: str) -> Path:
        """Rename a corrupt file aside (`NAME.corrupt-N`, never overwriting an earlier one), list
        it, and return where it is now."""
        path = Path(path)
        number = 1
        while (target := path.with_name(f"{path.name}.corrupt-{number}")).exists():
            number += 1
        path.rename(target)
        with self._lock:
            self.quarantined.append(Quarantined(str(path), str(target), reason, time.time()))
        return target

    def to_status(self) -> dict[str, object]:
        with self._lock:
            return {
                "failing": {name: {"error": f.error, "since_unix": round(f.since_wall, 3), "consecutive": f.consecutive}
                            for name, f in sorted(self.failing.items())},
                "failures_total": dict(sorted(self.failures_total.items())),
                "quarantined": [{"file": q.original, "kept_as": q.kept_as, "reason": q.reason,
                                 "at_unix": round(q.at_wall, 3)} for q in self.quarantined[-MAX_QUARANTINED_LISTED:]],
            }

    def reset(self) -> None:
        with self._lock:
            self.failing.clear()
            self.quarantined.clear()
            self.failures_total.clear()


STORAGE = StorageHealth()
