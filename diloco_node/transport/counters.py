"""Per-peer traffic counters of the transport (bytes in/out, requests, refusals) for /status.

One `TrafficCounters` per node, shared by its server and client sides. Plain integers updated on the
event loop; `snapshot()` returns a JSON-ready copy.
"""

from __future__ import annotations

import dataclasses
from collections import deque

# Errors kept per peer for /status: enough to see a pattern, small enough to never matter.
MAX_RECENT_ERRORS = 8
# Named peers tracked at most: a run's members (the wire allows 1024) plus the few addresses we
# send to. The server names only authenticated senders; this bound holds even if a member with the
# run secret invents names. Traffic of names past it is added up under OTHER_PEERS.
MAX_TRACKED_PEERS = 1024 + 64
OTHER_PEERS = "(other)"


@dataclasses.dataclass(slots=True)
class PeerTraffic:
    bytes_sent: int = 0
    bytes_received: int = 0
    requests_sent: int = 0
    requests_received: int = 0
    refusals: int = 0  # requests that ended in a non-200 status, either way
    recent_errors: deque[str] = dataclasses.field(default_factory=lambda: deque(maxlen=MAX_RECENT_ERRORS))


class TrafficCounters:
    """Bytes and requests per peer. Peers are named by node id when known, else by address."""

    def __init__(self, max_peers: int = MAX_TRACKED_PEERS) -> None:
        self._peers: dict[str, PeerTraffic] = {}
        self._max_peers = max_peers

    def peer(self, name: str) -> PeerTraffic:
        traffic = self._peers.get(name)
        if traffic is None:
            if len(self._peers) >= self._max_peers:
                name = OTHER_PEERS
                traffic = self._peers.get(name)
                if traffic is not None:
                    return traffic
            traffic = self._peers[name] = PeerTraffic()
        return traffic

    def sent(self, peer: str, nbytes: int) -> None:
        self.peer(peer).bytes_sent += nbytes

    def received(self, peer: str, nbytes: int) -> None:
        self.peer(peer).bytes_received += nbytes

    def refused(self, peer: str, reason: str) -> None:
        traffic = self.peer(peer)
        traffic.refusals += 1
        traffic.recent_errors.append(reason)

    @property
    def total_sent(self) -> int:
        return sum(p.bytes_sent for p in self._peers.values())

    @property
    def total_received(self) -> int:
        return sum(p.bytes_received for p in self._peers.values())

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {
            name: {
                "bytes_sent": t.bytes_sent,
                "bytes_received": t.bytes_received,
                "requests_sent": t.requests_sent,
                "requests_received": t.requests_received,
                "refusals": t.refusals,
                "recent_errors": list(t.recent_errors),
            }
            for name, t in sorted(self._peers.items())
        }
