"""The daemon's background tasks and long-lived resources, owned in one place.

Every task the node starts goes through `TaskSet.spawn`, which keeps a strong reference until the
task ends, logs an exception that would otherwise go unobserved, and cancels and awaits whatever is
left at shutdown. Callers that must stop one task early keep the handle `spawn` returns; nothing is
looked up by name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from aiohttp import web

log = logging.getLogger("diloco_node.daemon")


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        """Cancel every task still running and wait until all have ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def closed_on_cleanup(*closers: Callable[[], object]) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp cleanup context that calls `closers` in order when the app is cleaned up."""
    async def context(app: web.Application) -> AsyncIterator[None]:
        yield
        for close in closers:
            close()
    return context
