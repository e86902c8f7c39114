"""Talking to systemd: sd_notify readiness, status line, watchdog, start-timeout extensions and
stopping, with the stdlib only.

Under a `Type=notify` unit systemd passes `$NOTIFY_SOCKET` (a filesystem path, or an abstract
socket written with a leading '@') and, with `WatchdogSec=`, `$WATCHDOG_USEC` (and
`$WATCHDOG_PID`). Outside systemd every call is a no-op that returns False, so the daemon calls
these unconditionally. Sending never raises: a lost status line must not take the node down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Awaitable, Callable, Mapping, Protocol

from diloco_node.ops.liveness import Liveness

log = logging.getLogger(__name__)

# systemd reads one datagram per message; keep the status line far below any socket buffer.
MAX_STATUS_CHARS = 1024
# Ping at half the watchdog interval, as sd_watchdog_enabled(3) recommends: one late ping is tolerated.
WATCHDOG_PING_FRACTION = 0.5
# While a state download makes progress, the start timeout (TimeoutStartSec=) is pushed this far
# ahead every EXTEND_EVERY_S: a 100 GB download on a slow link outlasts any fixed start timeout,
# yet a download that stops moving lets the timeout run out as before. Three periods of slack.
EXTEND_TIMEOUT_S = 90.0
EXTEND_EVERY_S = 30.0


class SystemdNotifier:
    """sd_notify(3) over the datagram socket systemd gave us (or nothing, outside systemd)."""

    def __init__(self, environ: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog_s = _watchdog_seconds(env, os.getpid() if pid is None else pid)
        self._socket: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        """True when running under a unit that listens for notifications."""
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """The unit's watchdog timeout in seconds, or None when no watchdog applies to this process."""
        return self._watchdog_s

    def notify(self, *assignments: str) -> bool:
        """Send `KEY=VALUE` lines in one datagram; True when sent."""
        if self._address is None:
            return False
        message = "\n".join(assignments).encode()
        try:
            if self._socket is None:
                # Non-blocking: a notify socket nobody reads must never freeze the caller (the
                # daemon calls this from its event loop); a full queue drops one notification.
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                )
            self._socket.sendto(message, self._address)
            return True
        except BlockingIOError:
            log.warning("sd_notify %r dropped: the notify socket's queue is full", assignments)
            return False
        except OSError as exc:
            log.warning("sd_notify %r failed: %s", assignments, exc)
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([_status_line(status)] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(_status_line(text))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """EXTEND_TIMEOUT_USEC: the current (start, runtime or stop) timeout is extended so that it
        runs out no sooner than `seconds` from now, unless another message extends it again."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([_status_line(status)] if status else []))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _status_line(text: str) -> str:
    # One line: a newline would start a new (bogus) assignment.
    flat = " ".join(text.split())
    return "STATUS=" + flat[:MAX_STATUS_CHARS]


def _socket_address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # Linux abstract namespace
    if value.startswith("/"):
        return value
    log.warning("ignoring NOTIFY_SOCKET=%r: neither a path nor an abstract '@' name", value)
    return None


def _watchdog_seconds(env: Mapping[str, str], pid: int) -> float | None:
    usec = env.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    watchdog_pid = env.get("WATCHDOG_PID", "")
    if watchdog_pid and watchdog_pid != str(pid):
        return None  # the watchdog is for another process (e.g. our parent shell)
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    return value / 1e6 if value > 0 else None


async def run_watchdog(
    notifier: SystemdNotifier,
    healthy: Callable[[], Liveness],
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Ping the watchdog while `healthy()` says alive; returns at once when no watchdog is configured.

    Running on the event loop is the point: a blocked loop stops the pings and systemd restarts
    the node. An unhealthy node (e.g. its training thread is stuck) stops pinging on purpose.
    """
    interval = notifier.watchdog_interval_s
    if interval is None:
        return
    while True:
        verdict = healthy()
        if verdict.alive:
            notifier.watchdog()
        else:
            log.error("not pinging the systemd watchdog: %s", verdict.reason)
        await sleep(interval * WATCHDOG_PING_FRACTION)


class _Extends(Protocol):
    def extend_timeout(self, seconds: float) -> object: ...


async def extend_while_progressing(
    notifier: _Extends,
    progress: Callable[[], int],
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    every_s: float = EXTEND_EVERY_S,
    extend_s: float = EXTEND_TIMEOUT_S,
) -> None:
    """Extend systemd's start timeout every `every_s` while `progress()` (bytes received) grows.

    Run as a task beside a long download and cancel it when the download ends. The first
    extension is sent at once; later ones only when the figure moved since the previous look.
    """
    last: int | None = None
    while True:
        now = progress()
        if last is None or now > last:
            notifier.extend_timeout(extend_s)
        else:
            log.warning("state download made no progress for %g s: not extending the start timeout", every_s)
        last = now
        await sleep(every_s)
