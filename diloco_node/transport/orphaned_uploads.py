"""aiohttp's upload task, when the peer closes the connection before the request's headers are out,
ends with an exception nobody awaits: asyncio then logs "Task exception was never retrieved" with a
traceback at ERROR. The request itself has already failed and been reported (the client's failure
streak, /status), so that traceback says nothing an operator can act on. This handler logs such a
task at DEBUG and leaves every other unhandled exception to the handler that was there before.

Seen in aiohttp 3.14.5 with `expect100=True` (big uploads): `ClientRequest.write_bytes` calls
`send_headers()` outside the part that turns a write error into the response's error.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("diloco_node.transport")

# The coroutine aiohttp runs per request to write its body.
_UPLOAD_CORO = "ClientRequest.write_bytes"


def is_orphaned_upload_error(context: dict[str, Any]) -> bool:
    """An unawaited aiohttp upload task that ended because the connection was closed under it."""
    task = context.get("future")
    error = context.get("exception")
    if not isinstance(task, asyncio.Task) or not isinstance(error, ConnectionResetError):
        return False
    coro = task.get_coro()
    return getattr(coro, "__qualname__", "") == _UPLOAD_CORO


def quiet_orphaned_uploads(loop: asyncio.AbstractEventLoop) -> None:
    """Install the handler on `loop`, on top of whatever handler it had."""
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if is_orphaned_upload_error(context):
            log.debug("upload to a peer that closed the connection first: %s", context.get("exception"))
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
