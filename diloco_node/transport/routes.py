"""What the transport's server and client share: the peer API's URL scheme and headers, and the
sizes at which frame encoding and decoding leave the event loop.

Every message kind has one route, `POST /v1/<kind-name>` (e.g. `/v1/vote-request`); the request
body is one or more frames of that kind, the response body the reply frames (possibly none).
"""

from __future__ import annotations

from wire.limits import KiB, MiB
from wire.messages import MessageKind

ROUTE_PREFIX = "/v1/"
# The sender's node id, as a hint for per-peer stream caps before any frame is authenticated;
# the server checks it against the authenticated sender of every frame.
SENDER_HEADER = "X-Diloco-Sender"
FRAME_CONTENT_TYPE = "application/x-diloco-frames"

# Frames whose payloads exceed this are encoded (SHA-256 + copy) in the thread pool; below it,
# encoding on the loop is cheaper than the hop to a thread.
INLINE_ENCODE_MAX_BYTES = 64 * KiB
# Received bytes (with what the decoder already holds) below this are decoded on the loop, the
# rest in the thread pool.
INLINE_DECODE_MAX_BYTES = 64 * KiB
# Bytes already buffered by aiohttp are coalesced up to this size into one decode call, so a fast
# stream costs one thread hop per MiB rather than one per socket read.
DECODE_BATCH_BYTES = 1 * MiB


def kind_name(kind: MessageKind) -> str:
    return kind.name.lower().replace("_", "-")


def kind_path(kind: MessageKind) -> str:
    return ROUTE_PREFIX + kind_name(kind)


_KINDS_BY_NAME = {kind_name(kind): kind for kind in MessageKind}


def kind_from_name(name: str) -> MessageKind | None:
    return _KINDS_BY_NAME.get(name)
