"""The node's HTTP transport: authenticated wire frames between peers over aiohttp.

`PeerServer` (server.py) answers `POST /v1/<kind>` bodies of frames with every bound enforced;
`PeerClient` (client.py) sends messages and streamed payloads over one pooled session;
`TrafficCounters` (counters.py) keeps bytes per peer for /status; routes.py holds the URL scheme;
`ConnectionGuard` (guard.py) closes connections that carry no request.
The composition root owns the aiohttp application and its AppRunner and wires handlers per kind.
"""

from diloco_node.transport.client import (
    PEER_CLIENT,
    ClientOptions,
    PeerClient,
    PeerRefused,
    PeerUnreachable,
    StreamedReply,
    TransportError,
)
from diloco_node.transport.counters import PeerTraffic, TrafficCounters
from diloco_node.transport.guard import ConnectionGuard
from diloco_node.transport.routes import SENDER_HEADER, kind_path
from diloco_node.transport.server import PEER_SERVER, PayloadSink, Peer, PeerServer, SequenceConsumer, ServerOptions

__all__ = [
    "ClientOptions",
    "ConnectionGuard",
    "PEER_CLIENT",
    "PEER_SERVER",
    "SENDER_HEADER",
    "Peer",
    "PayloadSink",
    "SequenceConsumer",
    "PeerClient",
    "PeerRefused",
    "PeerServer",
    "PeerTraffic",
    "PeerUnreachable",
    "ServerOptions",
    "StreamedReply",
    "TrafficCounters",
    "TransportError",
    "kind_path",
]
