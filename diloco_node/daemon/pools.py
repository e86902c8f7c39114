"""The daemon's named thread pools: where every piece of work that leaves the event loop runs.

Each pool has one kind of work and the size the plan states (plan.py; docs/DAEMON.md lists them).
The learner's JAX thread is its own (learn/learner_thread.py). `io` is also installed as the
loop's default executor, so work handed to `asyncio.to_thread` (or to aiohttp's resolver) lands
in a named pool of a stated size instead of asyncio's CPUs + 4 threads; asyncio shuts it down
with the loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from diloco_node.daemon.plan import DaemonPlan


@dataclass(frozen=True, slots=True)
class Pools:
    codec: ThreadPoolExecutor  # codecs, merges, payload digests, fragment bytes for peers
    disk: ThreadPoolExecutor  # checkpoints and log compaction
    eval: ThreadPoolExecutor  # the global model's evaluation
    setup: ThreadPoolExecutor  # manifest sealing, the site's model, the learner's compile, MFU inputs
    io: ThreadPoolExecutor  # blocking I/O and waits; the loop's default executor

    @classmethod
    def open(cls, plan: DaemonPlan, node_id: str) -> Pools:
        sizes = plan.pools()
        return cls(**{name: ThreadPoolExecutor(size, thread_name_prefix=f"{name}-{node_id}")
                      for name, size in sizes.items()})

    def install_default(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make `io` the loop's default executor (asyncio.to_thread, run_in_executor(None, ...))."""
        loop.set_default_executor(self.io)

    def close(self) -> None:
        """Stop the pools the node owns; `io` belongs to the loop from `install_default` on."""
        for pool in (self.codec, self.disk, self.eval, self.setup):
            pool.shutdown(wait=False, cancel_futures=True)
