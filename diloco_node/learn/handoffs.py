"""The hand-offs between a learner's thread and the daemon's event loop: begin, stop, state copies.

Every learner (the training `LearnerThread`, the benchmarks' `SyntheticLearner`) runs on a thread
of its own. The daemon, from its event loop, tells it to begin training, to stop, and asks it for
a copy of its state (for a checkpoint). The learner answers state requests at its next step
boundary, where its state is consistent, or at once while it is not training (before
`begin_training`, or once its thread has ended). What a copy holds is the learner's own business
(`_answer_state_requests`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Generic, TypeVar

Snapshot = TypeVar("Snapshot")


class LearnerHandoffs(threading.Thread, Generic[Snapshot]):
    """A learner's thread with its begin/stop events and its queue of state requests."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._lock = threading.Lock()  # guards what the loop hands the thread (requests, offers)
        self._state_requests: list[Future[Snapshot]] = []
        self._stop_requested = threading.Event()
        self._go = threading.Event()

    def begin_training(self) -> None:
        self._go.set()

    def request_state(self) -> Future[Snapshot]:
        """A copy of the learner's state, answered at its next step boundary (at once while it is not training)."""
        future: Future[Snapshot] = Future()
        with self._lock:
            self._state_requests.append(future)
        if not self._go.is_set() or not self.is_alive():
            self._answer_state_requests()
        return future

    def stop(self) -> None:
        self._stop_requested.set()
        self._go.set()  # a thread still waiting to begin must wake up to end

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    def _answer_state_requests(self) -> None:
        """Answer every pending state request (the learner's thread, or the loop while it is not training)."""
        raise NotImplementedError

    def _take_state_requests(self) -> list[Future[Snapshot]]:
        with self._lock:
            requests, self._state_requests = self._state_requests, []
        return requests

    @staticmethod
    def _resolve(requests: list[Future[Snapshot]], snapshot: Snapshot) -> None:
        for future in requests:
            if not future.done():  # a request cancelled by its caller (a stopping daemon) is skipped
                future.set_result(snapshot)
