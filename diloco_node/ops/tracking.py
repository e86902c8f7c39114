"""Experiment trackers: a site's figures as TensorBoard event files and/or a Weights & Biases run
(`[node.tracking]`, config/site_tracking.py), under one scalar name scheme.

The scheme (`SCALARS`; the x axis of every scalar is the learner's step: commits and evaluations
are logged at the step the learner had reached when they happened):

    learner/loss  learner/tokens_per_s  learner/step_time_s  learner/mfu  learner/grad_norm
    learner/lr  learner/tokens  eval/loss  eval/<NAME>/loss  sync/commit_index  sync/bytes_sent
    sync/bytes_received

Writes never touch the training thread's or the event loop's time: `Tracking.log` appends to a
small bounded queue per tracker (full: the oldest entry is dropped and counted) and one writer
thread per tracker drains it. A tracker that fails (a full disk, no network, wandb raising) is
reported on /status (`tracking`) and in the log, its entries are dropped and counted, and
training goes on; the next writes are tried again (a disk that has room again is used again).

TensorBoard files are written with the `tensorboard` package's own `EventFileWriter` and
`Summary`/`Event` protos (no TensorFlow, no torch). `wandb` is imported only when
`wandb_project` is set; both are optional extras (`pip install 'diloco-node[tensorboard]'`,
`[wandb]`), checked at start with an error that says what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from diloco_node.config.manifest import ConfigError
from diloco_node.config.site_tracking import TrackingSpec
from diloco_node.ops.status import MAX_ERROR_CHARS, TrackerStatus, TrackingStatus

log = logging.getLogger(__name__)

# The one name scheme both trackers use: name -> what it is (docs/OPERATIONS.md repeats it).
SCALARS: dict[str, str] = {
    "learner/loss": "training loss (nats per token) at the window's last step",
    "learner/tokens_per_s": "tokens per wall second over the step window",
    "learner/step_time_s": "wall seconds per step over the step window",
    "learner/mfu": "model FLOPs utilisation over the step window (absent where the peak is unknown)",
    "learner/grad_norm": "global norm of the batch gradient before clipping",
    "learner/lr": "inner learning rate",
    "learner/tokens": "tokens trained on by this learner (cumulative)",
    "eval/loss": "the global model's loss on this site's eval split",
    "eval/<NAME>/loss": "the global model's loss on the eval set [node.data.eval.NAME]",
    "sync/commit_index": "the replicated log's applied commit index",
    "sync/bytes_sent": "bytes sent to peers (cumulative)",
    "sync/bytes_received": "bytes received from peers (cumulative)",
}
# An eval set's scalar: SCALARS' "eval/<NAME>/loss" with the set's name (any name but a slash).
_EVAL_SET_SCALAR = re.compile(r"eval/[^/]+/loss")


def eval_set_scalar(name: str) -> str:
    """The tracker scalar of the eval set `name` (a slash in the name would add a level: replaced)."""
    return f"eval/{name.replace('/', '_')}/loss"


# Entries waiting per tracker: one a step window (~2 s) plus commits and evaluations, so 1024 is
# minutes of backlog behind a slow tracker (a W&B upload stalled on the network), bounded memory.
QUEUE_CAPACITY = 1024
# How long `close` waits for a tracker's writer to drain and finish (W&B's finish can upload).
CLOSE_TIMEOUT_S = 30.0


class Sink(Protocol):
    """One tracker's writer, built and used in its writer thread only."""

    def write(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars as TensorBoard event files in `directory` (tensorboard's own EventFileWriter)."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        # Its own queue is a hand-off to its own thread; ours is the bounded one, so flush per batch.
        self._writer = EventFileWriter(str(directory), max_queue_size=64, flush_secs=5)

    def write(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()])
        self._writer.add_event(self._event(wall_time=wall_time, step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()  # raises what the writer's thread met (e.g. a full disk)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars as a W&B run (offline: files under `directory`, `wandb sync` uploads them later)."""

    def __init__(self, spec: TrackingSpec, directory: Path, name: str, config: Mapping[str, Any],
                 module: Any = None) -> None:
        wandb = module if module is not None else importlib.import_module("wandb")
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=spec.wandb_project, entity=spec.wandb_entity or None, name=name,
                               mode=spec.wandb_mode, dir=str(directory), config=dict(config))

    def write(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def flush(self) -> None:
        pass  # W&B buffers and uploads on its own

    def close(self) -> None:
        self._run.finish()


class TrackerWorker:
    """One tracker: a bounded queue and the thread that writes it through its sink."""

    def __init__(self, name: str, target: str, make_sink: Callable[[], Sink], capacity: int = QUEUE_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"tracker {name}: capacity {capacity} must be >= 1")
        self.name, self.target = name, target
        self._make_sink = make_sink
        self._queue: deque[tuple[int, float, dict[str, float]]] = deque()
        self._capacity = capacity
        self._cond = threading.Condition()
        self._closing = False
        self.written = 0
        self.dropped = 0
        self.error = ""
        self._thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def put(self, step: int, wall_time: float, scalars: dict[str, float]) -> None:
        """Never blocks: a full queue drops its oldest entry (counted)."""
        with self._cond:
            if self._closing:
                return
            if len(self._queue) >= self._capacity:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append((step, wall_time, scalars))
            self._cond.notify()

    def status(self) -> TrackerStatus:
        with self._cond:
            return TrackerStatus(enabled=True, target=self.target, written=self.written, dropped=self.dropped,
                                 error=self.error)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _failed(self, what: str, error: BaseException, lost: int) -> None:
        message = f"{self.name} tracker: {what}: {type(error).__name__}: {error}"[:MAX_ERROR_CHARS]
        with self._cond:
            new = message != self.error
            self.error = message
            self.dropped += lost
        if new:  # once per distinct failure, not once per entry
            log.warning("%s (training goes on; its entries are dropped and counted)", message)

    def _run(self) -> None:
        sink: Sink | None = None
        try:
            sink = self._make_sink()
        except Exception as error:  # a tracker that cannot start never stops training
            self._failed("cannot start", error, 0)
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                batch = list(self._queue)
                self._queue.clear()
                closing = self._closing
            if batch:
                if sink is None:
                    with self._cond:
                        self.dropped += len(batch)
                else:
                    self._write(sink, batch)
            if closing and not batch:
                break
        if sink is not None:
            try:
                sink.close()
            except Exception as error:
                self._failed("closing", error, 0)

    def _write(self, sink: Sink, batch: list[tuple[int, float, dict[str, float]]]) -> None:
        done = 0
        try:
            for step, wall_time, scalars in batch:
                sink.write(step, wall_time, scalars)
                done += 1
            sink.flush()
        except Exception as error:
            # What reached the sink before the failure may be lost with its buffer: count the batch.
            self._failed("writing", error, len(batch))
            return
        with self._cond:
            self.written += done
            if self.error:
                log.info("%s tracker: writing again after: %s", self.name, self.error)
                self.error = ""


class Tracking:
    """A site's trackers (none, TensorBoard, W&B, or both), fed with `log(step, scalars)`."""

    def __init__(self, tensorboard: TrackerWorker | None = None, wandb: TrackerWorker | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.tensorboard, self.wandb = tensorboard, wandb
        self._wall = wall

    @classmethod
    def open(cls, spec: TrackingSpec, data_dir: Path, run_name: str, config: Mapping[str, Any],
             wandb_module: Any = None) -> Tracking:
        """The trackers `spec` turns on; `check_available` first (an error naming what to install)."""
        check_available(spec, wandb_module)
        tensorboard = wandb = None
        if spec.tensorboard_dir:
            directory = tensorboard_dir(spec, data_dir)
            tensorboard = TrackerWorker("tensorboard", str(directory), lambda: TensorBoardSink(directory))
        if spec.wandb_project:
            name = spec.run_name or run_name
            wandb = TrackerWorker("wandb", f"{spec.wandb_project} ({spec.wandb_mode})",
                                  lambda: WandbSink(spec, data_dir / "wandb", name, config, wandb_module))
        return cls(tensorboard, wandb)

    @property
    def enabled(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def log(self, step: int, scalars: Mapping[str, float | None]) -> None:
        """Queue `scalars` (SCALARS' names; unknown and non-finite values left out) at `step`."""
        clean = {name: float(value) for name, value in scalars.items()
                 if value is not None and math.isfinite(value)}
        unknown = {name for name in set(clean) - set(SCALARS) if not _EVAL_SET_SCALAR.fullmatch(name)}
        if unknown:
            raise ValueError(f"tracker scalars {sorted(unknown)}: not in the scheme (ops/tracking.py SCALARS)")
        if not clean or not self.enabled:
            return
        wall = self._wall()
        for worker in (self.tensorboard, self.wandb):
            if worker is not None:
                worker.put(step, wall, clean)

    def status(self) -> TrackingStatus:
        return TrackingStatus(
            tensorboard=self.tensorboard.status() if self.tensorboard is not None else TrackerStatus(),
            wandb=self.wandb.status() if self.wandb is not None else TrackerStatus())

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        for worker in (self.tensorboard, self.wandb):
            if worker is not None:
                worker.close(timeout_s)


def tensorboard_dir(spec: TrackingSpec, data_dir: Path) -> Path:
    """`tensorboard_dir` as a path: relative ones live under the data dir."""
    path = Path(spec.tensorboard_dir).expanduser()
    return path if path.is_absolute() else data_dir / path


def check_available(spec: TrackingSpec, wandb_module: Any = None) -> None:
    """A ConfigError naming the key and the extra to install when a tracker's package is missing."""
    if spec.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"tracking.tensorboard_dir = {spec.tensorboard_dir!r}: the tensorboard package is not "
                          "installed: pip install 'diloco-node[tensorboard]' (or set tracking.tensorboard_dir = \"\")")
    if spec.wandb_project and wandb_module is None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"tracking.wandb_project = {spec.wandb_project!r}: the wandb package is not installed: "
                          "pip install 'diloco-node[wandb]' (or set tracking.wandb_project = \"\")")
