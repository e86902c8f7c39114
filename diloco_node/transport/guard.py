"""Closing connections that carry no request: idle, half-open, or stuck in half a request header.

aiohttp bounds the body of a request (the server's own deadlines do) but, depending on its
version, nothing bounds a connection that never sends a request, or sends half a header: 500 such
connections stayed open for 60 s in a probe, bounded only by the process's fd limit. The guard
tracks, per connection of one `web.Server`, whether a request handler is running (a middleware)
and since when the connection has been without one, and closes connections that have been
without a request for `header_timeout_s`. Connections that keep a request running (a long
upload) are never touched here: the transport's own deadlines bound those.

Install with `guard.install(app)` before the app is frozen, then run `await guard.run(server)`
as a background task once the AppRunner is set up (`server = runner.server`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

# A connection with no request in progress is closed after this long: ten times a slow WAN round
# trip for a client to send its request line and headers, and twice the client's own keep-alive
# (transport/client.py KEEPALIVE_S, 5 s), so a pooled connection is dropped by its client first.
HEADER_TIMEOUT_S = 10.0
# How often connections are looked at; a connection is closed within the header timeout (it is
# given header_timeout_s - sweep seconds from the sweep that first saw it).
SWEEP_FRACTION = 0.1


class ConnectionGuard:
    """Closes a server's connections that have had no request running for `header_timeout_s`."""

    def __init__(self, header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        if not 0 < header_timeout_s < float("inf"):
            raise ValueError(f"header_timeout_s must be a positive number of seconds, got {header_timeout_s!r}")
        self.header_timeout_s = header_timeout_s
        self.sweep_s = header_timeout_s * SWEEP_FRACTION
        self._busy: dict[int, int] = {}  # id(protocol) -> requests running on it
        self._idle_since: dict[int, float] = {}  # id(protocol) -> when it last had none running
        self.closed = 0  # connections closed for idling (for /status and tests)

    def install(self, app: web.Application) -> None:
        app.middlewares.append(self._middleware)

    @web.middleware
    async def _middleware(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        key = id(request.protocol)
        self._busy[key] = self._busy.get(key, 0) + 1
        try:
            return await handler(request)
        finally:
            left = self._busy.get(key, 1) - 1
            if left:
                self._busy[key] = left
            else:
                self._busy.pop(key, None)
                self._idle_since[key] = asyncio.get_running_loop().time()

    def sweep(self, connections: list[Any], now: float) -> int:
        """Close the connections idle for too long; returns how many were closed."""
        closed = 0
        alive = set()
        # A connection first seen now may have connected up to one sweep ago.
        allowed = self.header_timeout_s - self.sweep_s
        for protocol in connections:
            key = id(protocol)
            alive.add(key)
            if key in self._busy:
                continue
            since = self._idle_since.setdefault(key, now)
            if now - since >= allowed:
                protocol.force_close()
                self._idle_since.pop(key, None)
                closed += 1
        for key in [k for k in self._idle_since if k not in alive]:
            del self._idle_since[key]
        for key in [k for k in self._busy if k not in alive]:
            del self._busy[key]
        self.closed += closed
        return closed

    async def run(self, server: web.Server) -> None:
        loop = asyncio.get_running_loop()
        while True:
            closed = self.sweep(list(server.connections), loop.time())
            if closed:
                log.info("closed %d connection(s) without a request for %g s", closed, self.header_timeout_s)
            await asyncio.sleep(self.sweep_s)
