"""systemd notifications sent off the event loop.

`systemd.SystemdNotifier` writes to the notify socket with a blocking `sendto`. When nobody
drains that socket (a supervisor that stopped reading, a test), the receive queue fills after a
handful of datagrams and the next send blocks: on the event loop that would freeze the node.
`BackgroundNotifier` hands every notification to one daemon thread through a small bounded
queue and drops what does not fit, so the loop never waits on systemd.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from collections.abc import Callable

from diloco_node.ops.systemd import SystemdNotifier

log = logging.getLogger(__name__)

# Notifications waiting for the sender thread; beyond this they are dropped (systemd is not
# reading anyway, and a newer STATUS= supersedes an older one).
MAX_PENDING_NOTIFICATIONS = 8


class BackgroundNotifier:
    def __init__(self, notifier: SystemdNotifier, max_pending: int = MAX_PENDING_NOTIFICATIONS) -> None:
        self._notifier = notifier
        self._queue: queue.Queue[Callable[[], object] | None] = queue.Queue(maxsize=max_pending)
        self.dropped = 0
        self._thread: threading.Thread | None = None
        if notifier.enabled:
            self._thread = threading.Thread(target=self._run, name="sd-notify", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._notifier.enabled

    @property
    def watchdog_interval_s(self) -> float | None:
        return self._notifier.watchdog_interval_s

    def ready(self, status: str | None = None) -> None:
        self._offer(lambda: self._notifier.ready(status))

    def status(self, text: str) -> None:
        self._offer(lambda: self._notifier.status(text))

    def watchdog(self) -> None:
        self._offer(self._notifier.watchdog)

    def extend_timeout(self, seconds: float) -> None:
        self._offer(lambda: self._notifier.extend_timeout(seconds))

    def stopping(self, status: str | None = None) -> None:
        self._offer(lambda: self._notifier.stopping(status))

    def close(self) -> None:
        """Stop the sender thread if it is idle; a thread stuck in sendto dies with the process."""
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return
        self._thread.join(timeout=1.0)
        if not self._thread.is_alive():
            self._notifier.close()

    def _offer(self, send: Callable[[], object]) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(send)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("systemd is not reading notifications: %d dropped", self.dropped)

    def _run(self) -> None:
        while True:
            send = self._queue.get()
            if send is None:
                return
            send()


# systemd STATUS= lines repeat at most this often while nothing but numbers changes.
STATUS_LINE_EVERY_S = 10.0


class StatusLineThrottle:
    """When to send systemd's STATUS= line: when the kind of state changes (numbers aside), else at
    most every STATUS_LINE_EVERY_S; the notify socket is a blocking datagram socket, so never a flood."""

    def __init__(self, every_s: float = STATUS_LINE_EVERY_S) -> None:
        self.every_s = every_s
        self._shape = ""
        self._sent_at = float("-inf")

    def due(self, text: str, now: float) -> bool:
        shape = re.sub(r"\d+", "#", text)
        if shape == self._shape and now - self._sent_at < self.every_s:
            return False
        self._shape, self._sent_at = shape, now
        return True
