"""[node] connect_timeout_s and read_timeout_s reach the peer transport: a peer that accepts and
never answers is cut by the read timeout, a connect that is never answered by the connect timeout."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest

from diloco_node.config.settings import HostPort, NodeConfig
from diloco_node.daemon.plan import plan_from
from diloco_node.transport import PeerClient, PeerUnreachable
from wire.auth import AuthContext, FrameVerifier, derive_frame_key
from wire.messages import VoteRequest

RUN = "run-timeouts"
KEY = derive_frame_key(b"k" * 32)
# Far above both timeouts under test: a failure naming "deadline" would mean they did not apply.
DEADLINE_S = 60.0


def _config(connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0) -> NodeConfig:
    return NodeConfig(node_id="a", listen=HostPort("127.0.0.1", 9000), advertise="http://127.0.0.1:9000",
                      connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)


def _client(cfg: NodeConfig) -> PeerClient:
    plan = plan_from(cfg)
    options, limits = plan.client_options, plan.limits
    return PeerClient(AuthContext(RUN, "a", KEY), FrameVerifier(RUN, KEY, limits), limits=limits, options=options)


def _message() -> VoteRequest:
    return VoteRequest(epoch=1, candidate="a", last_log_epoch=0, last_log_index=0)


def test_the_node_config_timeouts_become_the_transport_bounds() -> None:
    plan = plan_from(_config(connect_timeout_s=1.5, read_timeout_s=7.0))
    assert (plan.client_options.connect_timeout_s, plan.limits.read_timeout_s) == (1.5, 7.0)


@asynccontextmanager
async def _silent_peer() -> AsyncIterator[str]:
    """A peer that accepts, reads whatever comes, and never answers."""
    writers: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for writer in writers:  # its handlers then see EOF and return
            writer.close()
        await server.wait_closed()


async def test_a_peer_that_accepts_and_never_answers_is_cut_by_read_timeout_s() -> None:
    async with _silent_peer() as url, _client(_config(read_timeout_s=0.3)) as client:
        with pytest.raises(PeerUnreachable, match="read timeout"):
            await client.send(url, _message(), peer="b", deadline_s=DEADLINE_S)


@contextmanager
def _blackholed_listener() -> Iterator[str]:
    """A port whose SYNs go unanswered: a listen backlog of 0 filled by one connection that is
    never accepted makes Linux drop further handshakes, as a firewall's DROP rule would."""
    listener = socket.socket()
    filler = socket.socket()
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        filler.close()
        listener.close()


async def test_a_blackholed_connect_is_cut_by_connect_timeout_s() -> None:
    with _blackholed_listener() as url:
        async with _client(_config(connect_timeout_s=0.3, read_timeout_s=30.0)) as client:
            with pytest.raises(PeerUnreachable, match="connect timeout"):
                await client.send(url, _message(), peer="b", deadline_s=DEADLINE_S)
