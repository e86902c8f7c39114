"""The one content hash of the wire and the replicated state: BLAKE3 with 32-byte digests.

Frame payload digests (the header map's "pd", which the frame MAC signs), the state digests of
fragments and of the whole global state, the names of relayed payloads and their spool files,
history and checkpoint digests all use it (wire 3.0). It replaced SHA-256 there because every
received byte is hashed at least once, and BLAKE3 costs about a quarter of SHA-256's CPU per
byte in one thread (docs/SCALE.md). It is as strong a hash for this use (collision and second
preimage resistance at 128 bits).

`hasher()` is incremental (`update`, `digest`, `hexdigest`, like hashlib's), so every caller
hashes bytes where they already are, a chunk at a time. One thread per hasher: the data plane
runs several transfers at once on the worker pool, and a hasher that spawned threads of its own
would fight them for the same cores. The `blake3` package releases the GIL for large updates.
"""

from __future__ import annotations

from typing import Any

import blake3

DIGEST_NAME = "blake3"
DIGEST_BYTES = 32


def hasher(data: bytes | bytearray | memoryview = b"") -> Any:
    """A new incremental hasher (BLAKE3, 32-byte digest), fed `data` first."""
    return blake3.blake3(data)


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """The 32-byte BLAKE3 digest of `data`."""
    return blake3.blake3(data).digest()
