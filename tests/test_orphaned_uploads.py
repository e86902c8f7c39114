"""An aiohttp upload task orphaned by a peer that hung up is logged at DEBUG, not as an asyncio
"Task exception was never retrieved" traceback; every other unhandled exception still reaches the
handler that was installed before (transport/orphaned_uploads.py)."""

from __future__ import annotations

import asyncio
import logging

from diloco_node.transport.orphaned_uploads import is_orphaned_upload_error, quiet_orphaned_uploads


class ClientRequest:
    """Stands in for aiohttp's: its upload coroutine has the same qualified name."""

    async def write_bytes(self) -> None:
        raise ConnectionResetError("Cannot write to closing transport")


async def _other() -> None:
    raise ConnectionResetError("not an upload")


def _finished(loop: asyncio.AbstractEventLoop, coro) -> asyncio.Task:
    task = loop.create_task(coro)
    loop.run_until_complete(asyncio.wait([task]))
    return task


def test_an_orphaned_upload_is_logged_at_debug_and_anything_else_goes_to_the_previous_handler(caplog) -> None:
    loop = asyncio.new_event_loop()
    seen: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    quiet_orphaned_uploads(loop)
    try:
        upload = _finished(loop, ClientRequest().write_bytes())
        other = _finished(loop, _other())
        with caplog.at_level(logging.DEBUG, logger="diloco_node.transport"):
            for task in (upload, other):
                loop.call_exception_handler({"message": "Task exception was never retrieved",
                                             "exception": task.exception(), "future": task})
    finally:
        loop.close()
    assert [c["future"] for c in seen] == [other]  # only the other task reached the previous handler
    [line] = [r for r in caplog.records if r.name == "diloco_node.transport"]
    assert line.levelno == logging.DEBUG and "closed the connection first" in line.getMessage()


def test_only_a_connection_reset_of_the_upload_coroutine_is_recognised() -> None:
    loop = asyncio.new_event_loop()
    try:
        upload = _finished(loop, ClientRequest().write_bytes())
        assert is_orphaned_upload_error({"future": upload, "exception": upload.exception()})
        assert not is_orphaned_upload_error({"future": upload, "exception": RuntimeError("x")})
        assert not is_orphaned_upload_error({"exception": upload.exception()})  # no task in the context
        other = _finished(loop, _other())
        assert not is_orphaned_upload_error({"future": other, "exception": other.exception()})
    finally:
        loop.close()
