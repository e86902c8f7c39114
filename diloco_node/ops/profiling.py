"""On-demand JAX profiler traces of a running daemon (`diloco-node profile`, `POST /profile`).

`ProfileCapture.capture(seconds)` runs `jax.profiler.start_trace(dir)`, waits `seconds` while the
learner keeps training, and `stop_trace()`, into `<data_dir>/profiles/<UTC timestamp>/`; it answers
(HTTP status, JSON body): 200 with the directory and the files written, 400 for a duration out of
bounds, 409 while another capture runs (the JAX profiler is one per process). The trace opens in
TensorBoard's profile plugin or in Perfetto (docs/OPERATIONS.md, "Profiling").

JAX is imported only when a capture starts: the operator routes load without it (a witness).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Bounds of one capture: a second shows a few steps of a small model; five minutes of a large
# one is already gigabytes of trace (the profiler keeps it in memory until it stops).
MIN_PROFILE_SECONDS = 1.0
MAX_PROFILE_SECONDS = 300.0
PROFILES_DIR = "profiles"


class ProfileCapture:
    """One process's profiler: at most one capture at a time."""

    def __init__(self, data_dir: Path, wall: Callable[[], float] = time.time) -> None:
        self.root = Path(data_dir) / PROFILES_DIR
        self._wall = wall
        self._lock = threading.Lock()
        self._running: Path | None = None

    @property
    def running(self) -> Path | None:
        return self._running

    def _claim(self) -> Path | None:
        with self._lock:
            if self._running is not None:
                return None
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._wall()))
            directory = self.root / stamp
            suffix = 1
            while directory.exists():  # two captures within one second
                suffix += 1
                directory = self.root / f"{stamp}-{suffix}"
            self._running = directory
            return directory

    async def capture(self, seconds: Any) -> tuple[int, dict[str, Any]]:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                MIN_PROFILE_SECONDS <= seconds <= MAX_PROFILE_SECONDS):
            return 400, {"error": f"seconds = {seconds!r}: must be a number from {MIN_PROFILE_SECONDS:g} "
                                  f"to {MAX_PROFILE_SECONDS:g}"}
        directory = self._claim()
        if directory is None:
            return 409, {"error": f"a profile is being captured into {self._running}; try again when it is done"}
        loop = asyncio.get_running_loop()
        try:
            directory.mkdir(parents=True, exist_ok=False)
            await loop.run_in_executor(None, _start_trace, directory)
            try:
                await asyncio.sleep(float(seconds))
            finally:
                await loop.run_in_executor(None, _stop_trace)
        except Exception as error:  # the profiler refused (another trace of this process): say so
            return 500, {"error": f"profiling failed: {type(error).__name__}: {error}", "dir": str(directory)}
        finally:
            with self._lock:
                self._running = None
        files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        return 200, {"dir": str(directory), "seconds": float(seconds), "files": files}


def _start_trace(directory: Path) -> None:
    import jax

    jax.profiler.start_trace(str(directory))


def _stop_trace() -> None:
    import jax

    jax.profiler.stop_trace()
