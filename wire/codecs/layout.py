"""The container's header layout: the structs of its fixed header and per-tensor entries, and their size.

Shared by the container (which writes and reads headers) and the codec schemes (whose size
estimates include the header), so neither imports the other for it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

FIXED_HEADER = struct.Struct("<4sBBBBII")  # magic, version, codec id, flags, reserved, block, count
NAME_LEN = struct.Struct("<H")
NDIM = struct.Struct("<B")
DIM = struct.Struct("<Q")


def header_size(entries: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of the header for these (name, shape) entries."""
    return FIXED_HEADER.size + sum(NAME_LEN.size + len(name.encode()) + NDIM.size + DIM.size * len(shape)
                                   for name, shape in entries)
