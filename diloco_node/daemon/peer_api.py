"""The peer API's dispatch: each request kind goes to the daemon part that answers it.

The HTTP server (transport/) is listening before the node has built its parts (the state is
built, or downloaded, while /status already answers). Every request goes through the node's one
`StartingGate` (gate.py): before the parts exist it gets 503 "still starting: <phase>", which
peers treat as "try later".
"""

from __future__ import annotations

from typing import Any, Protocol

from diloco_node.config.manifest import RunManifest
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.gate import StartingGate
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.state_transfer import StateKeeper
from diloco_node.transport import PeerServer, SequenceConsumer
from wire import messages as wire


class PeerParts(Protocol):
    """What the peer API reads of the node's parts (parts.py `SiteParts`)."""

    @property
    def coordination(self) -> CoordinationIO: ...
    @property
    def keeper(self) -> StateKeeper: ...
    @property
    def rounds(self) -> RoundDriver: ...
    @property
    def manifest(self) -> RunManifest: ...


class PeerApi:
    def __init__(self, gate: StartingGate[Any]) -> None:
        self._gate = gate

    def install(self, server: PeerServer) -> None:
        for kind, handler in ((wire.MessageKind.VOTE_REQUEST, self.vote), (wire.MessageKind.LOG_APPEND, self.append),
                              (wire.MessageKind.HEARTBEAT, self.heartbeat), (wire.MessageKind.LEAVE, self.leave),
                              (wire.MessageKind.JOIN_REQUEST, self.join),
                              (wire.MessageKind.SNAPSHOT_REQUEST, self.snapshot),
                              (wire.MessageKind.FRAGMENT_CONTRIBUTION, self.contribution),
                              (wire.MessageKind.PAYLOAD_PUSH, self.payload_push),
                              (wire.MessageKind.PAYLOAD_FETCH, self.payload_fetch)):
            server.on_message(kind, handler)
        server.on_sequence(wire.MessageKind.CONTRIBUTION_OPEN, wire.MessageKind.CONTRIBUTION_CHUNK,
                           self.contribution_stream)
        server.on_sequence(wire.MessageKind.PAYLOAD_OPEN, wire.MessageKind.PAYLOAD_CHUNK, self.payload_stream)

    def _parts(self) -> PeerParts:
        parts: PeerParts = self._gate.parts()  # 503 while starting
        return parts

    async def vote(self, message: wire.VoteRequest, peer: Any) -> wire.Message | None:
        return await self._parts().coordination.on_vote_request(message, peer)

    async def append(self, message: wire.LogAppend, peer: Any) -> wire.Message | None:
        return await self._parts().coordination.on_log_append(message, peer)

    async def payload_push(self, message: wire.PayloadPush, peer: Any) -> None:
        return await self._parts().coordination.on_payload_push(message, peer)

    async def payload_fetch(self, message: wire.PayloadFetch, peer: Any) -> None:
        return await self._parts().coordination.on_payload_fetch(message, peer)

    async def payload_stream(self, head: wire.PayloadOpen, peer: Any) -> SequenceConsumer:
        return await self._parts().coordination.open_payload_stream(head, peer)

    async def heartbeat(self, message: wire.Heartbeat, peer: Any) -> wire.Message | None:
        return await self._parts().coordination.on_heartbeat(message, peer)

    async def leave(self, message: wire.Leave, peer: Any) -> None:
        return await self._parts().coordination.on_leave(message, peer)

    async def join(self, message: wire.JoinRequest, peer: Any) -> wire.Message:
        parts = self._parts()
        return await parts.coordination.on_join_request(message, peer, parts.manifest)

    async def snapshot(self, message: wire.SnapshotRequest, peer: Any) -> wire.Message:
        parts = self._parts()
        parts.coordination.check_open()
        return await parts.keeper.on_snapshot_request(message)

    async def contribution(self, message: wire.FragmentContribution, peer: Any) -> None:
        parts = self._parts()
        parts.coordination.check_open()
        parts.coordination.same_sender(message.learner_id, peer, "FragmentContribution")
        await parts.rounds.on_contribution(message)

    async def contribution_stream(self, head: wire.ContributionOpen, peer: Any) -> SequenceConsumer:
        parts = self._parts()
        parts.coordination.check_open()
        parts.coordination.same_sender(head.learner_id, peer, "ContributionOpen")
        return parts.rounds.open_contribution(head)
