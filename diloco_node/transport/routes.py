"""The peer API's URL scheme and headers, shared by the transport's server and client.

Every message kind has one route, `POST /v1/<kind-name>` (e.g. `/v1/vote-request`); the request
body is one or more frames of that kind, the response body the reply frames (possibly none).
"""

from __future__ import annotations

from wire.messages import MessageKind

ROUTE_PREFIX = "/v1/"
# The sender's node id, as a hint for per-peer stream caps before any frame is authenticated;
# the server checks it against the authenticated sender of every frame.
SENDER_HEADER = "X-Diloco-Sender"
FRAME_CONTENT_TYPE = "application/x-diloco-frames"


def kind_name(kind: MessageKind) -> str:
    return kind.name.lower().replace("_", "-")


def kind_path(kind: MessageKind) -> str:
    return ROUTE_PREFIX + kind_name(kind)


_KINDS_BY_NAME = {kind_name(kind): kind for kind in MessageKind}


def kind_from_name(name: str) -> MessageKind | None:
    return _KINDS_BY_NAME.get(name)
