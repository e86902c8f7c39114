"""The daemon's named thread pools: where every piece of work that leaves the event loop runs.

Each pool has one kind of work and the size the plan states (plan.py; docs/DAEMON.md lists them).
The learner's JAX thread is its own (learn/learner_thread.py). `io` is also installed as the
loop's default executor, so work handed to `asyncio.to_thread` (or to aiohttp's resolver) lands
in a named pool of a stated size instead of asyncio's CPUs + 4 threads; asyncio shuts it down
with the loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from diloco_node.daemon.plan import DaemonPlan

log = logging.getLogger("diloco_node.daemon")

# Every allocation of at least this many bytes gets its own pages from the kernel and gives them
# back when freed. glibc's default raises this threshold, up to 32 MiB, each time such a block is
# freed; from then on the model's tensors (4-16 MiB each at 1B parameters) and every transfer
# chunk are carved from per-thread arenas that keep freed memory, and a node's resident set
# creeps up by a GB over a minute of commits. A fixed threshold also switches that adjustment off.
ALLOCATIONS_MAPPED_FROM = 1024 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt parameter numbers (glibc malloc.h)


def bound_allocator() -> bool:
    """Make glibc's malloc return large freed blocks to the kernel (`ALLOCATIONS_MAPPED_FROM`);
    False where the C library is not glibc (nothing changed). Process-wide, idempotent."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, ALLOCATIONS_MAPPED_FROM))


@dataclass(frozen=True, slots=True)
class Pools:
    codec: ThreadPoolExecutor  # codecs, merges, payload digests, fragment bytes for peers
    disk: ThreadPoolExecutor  # checkpoints and log compaction
    eval: ThreadPoolExecutor  # the global model's evaluation
    setup: ThreadPoolExecutor  # manifest sealing, the site's model, the learner's compile, MFU inputs
    io: ThreadPoolExecutor  # blocking I/O and waits; the loop's default executor

    @classmethod
    def open(cls, plan: DaemonPlan, node_id: str) -> Pools:
        """The node's pools; also bounds the allocator (`bound_allocator`) before they first run."""
        if not bound_allocator():
            log.info("%s: malloc is not glibc's; freed blocks may stay in the process", node_id)
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
