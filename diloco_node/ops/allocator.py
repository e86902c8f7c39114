"""The process's heap allocator: large arrays go back to the operating system when freed.

glibc serves a request of at least its mmap threshold with a mapping of its own, which `free`
returns at once; a smaller one comes from a heap arena, which keeps the memory after `free` for
reuse. The threshold starts at 128 KiB but is dynamic: each time a mapped block is freed it rises
to that block's size, up to 32 MiB. After the first few frees, every numpy array of up to 32 MiB
(a contribution's decoded chunk, a merge block, a received state chunk, 16 MiB each) lands in an
arena, and each codec-pool thread has arenas of its own. A 1B lease holder's resident memory grew
that way by about 1.5 GB over its live data and passed its memory bound (docs/SCALE.md, "Memory
bound"), which systemd's `MemoryMax=` turns into a kill.

`return_large_frees_to_os()` fixes the threshold (which also ends its dynamic rise): every block
of `LARGE_BLOCK_BYTES` or more is mapped on its own and returned when freed. The cost is a fresh
mapping, and its page faults, for each such array. An operator's own setting (`GLIBC_TUNABLES`
naming malloc's mmap_threshold, or `MALLOC_MMAP_THRESHOLD_`) wins. Other C libraries are left as
they are.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

# Measured on a 1B run (docs/SCALE.md): 1 MiB and 4 MiB both kept the holder under its bound
# (8,851 and 8,889 MiB peak against 10,105, from 10,389-10,494 unset); 4 MiB cost less CPU.
LARGE_BLOCK_BYTES = 4 * 1024 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def operator_setting(environ: Mapping[str, str]) -> str | None:
    """The operator's own mmap threshold setting, if the environment names one."""
    if "MALLOC_MMAP_THRESHOLD_" in environ:
        return f"MALLOC_MMAP_THRESHOLD_={environ['MALLOC_MMAP_THRESHOLD_']}"
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.mmap_threshold" in tunables:
        return f"GLIBC_TUNABLES={tunables}"
    return None


def return_large_frees_to_os(environ: Mapping[str, str] | None = None) -> str:
    """Fix glibc's mmap threshold at `LARGE_BLOCK_BYTES` (before the state is allocated); returns
    what was done, for the start-up log."""
    environ = os.environ if environ is None else environ
    own = operator_setting(environ)
    if own is not None:
        return f"allocator: the operator's {own} kept"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "allocator: not glibc, left as it is"
    try:
        libc = ctypes.CDLL(None)
        done = libc.mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)
    except (OSError, AttributeError) as error:
        return f"allocator: mallopt unavailable ({error}), left as it is"
    if done != 1:
        return "allocator: mallopt refused the mmap threshold, left as it is"
    return f"allocator: blocks of {LARGE_BLOCK_BYTES >> 20} MiB or more are returned to the system when freed"
