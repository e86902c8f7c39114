"""Strangers cannot stall a node or grow its memory through the transport (issue 13).

A stream earns its slot: it must authenticate its first frame header within the authentication
deadline, strangers are capped per source address and evicted oldest-first from a pool of their
own, members are counted under their authenticated id (never the claimed header), authenticated
streams keep a minimum rate, and connections without a request are closed by the guard.
Everything runs over loopback in one process; the attackers are raw sockets bound to another
loopback address than the members' client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import blake3
import pytest
from aiohttp import web

from diloco_node.transport import ClientOptions, ConnectionGuard, PeerClient, PeerRefused, PeerServer, ServerOptions
from diloco_node.transport import SENDER_HEADER, kind_path
from diloco_node.transport.counters import OTHER_PEERS, TrafficCounters
from diloco_node.transport.server import UNAUTHENTICATED
from wire.auth import AuthContext, FrameVerifier, derive_frame_key
from wire.frames import encode_frame, encode_frame_head
from wire.limits import Limits
from wire.messages import FragmentContribution, HeartbeatAck, Message, MessageKind, VoteReply, VoteRequest

from conftest import until, vote_request

RUN = "run-admission"
KEY = derive_frame_key(b"k" * 32)
MEMBER_ADDRESS = "127.0.0.2"
STRANGER_ADDRESS = "127.0.0.3"


def _server(limits: Limits = Limits(), options: ServerOptions = ServerOptions()) -> PeerServer:
    server = PeerServer(AuthContext(RUN, "b", KEY), FrameVerifier(RUN, KEY, limits, node_id="b"), limits=limits,
                        options=options)

    async def vote(message: Message, peer: object) -> Message:
        assert isinstance(message, VoteRequest)
        return VoteReply(epoch=message.epoch, voter="b", granted=True, reason="ok")

    server.on_message(MessageKind.VOTE_REQUEST, vote)
    return server


@asynccontextmanager
async def _serving(server: PeerServer, guard: ConnectionGuard | None = None) -> AsyncIterator[str]:
    app = web.Application()
    if guard is not None:
        guard.install(app)
    server.install(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    sweeper = asyncio.create_task(guard.run(runner.server)) if guard is not None else None
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        if sweeper is not None:
            sweeper.cancel()
            await asyncio.gather(sweeper, return_exceptions=True)
        await runner.cleanup()


def _member(node: str = "a", limits: Limits = Limits()) -> PeerClient:
    return PeerClient(AuthContext(RUN, node, KEY), FrameVerifier(RUN, KEY, limits, node_id=node), limits=limits,
                      options=ClientOptions(source_address=MEMBER_ADDRESS))


async def _slow_stranger(url: str, sender: str, *, prefix: bytes, pause_s: float,
                         address: str = STRANGER_ADDRESS) -> tuple[int, bytes]:
    """A forged-sender stream that sends a well-formed frame prefix one byte per `pause_s`;
    returns the status and reason it is answered with."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(address, 0))
    try:
        writer.write(f"POST {kind_path(MessageKind.VOTE_REQUEST)} HTTP/1.1\r\nHost: x\r\n"
                     f"{SENDER_HEADER}: {sender}\r\nContent-Length: 4096\r\n\r\n".encode())

        async def drip() -> None:
            for byte in prefix:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(pause_s)

        dripping = asyncio.create_task(drip())
        try:
            async with asyncio.timeout(30):
                status_line = await reader.readline()
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
        finally:
            dripping.cancel()
            await asyncio.gather(dripping, return_exceptions=True)
        return int(status_line.split()[1]), body
    finally:
        writer.close()


def _frame_prefix() -> bytes:
    """The first bytes of a real frame (a stranger cannot finish it: it has no key)."""
    frame = encode_frame(vote_request(), AuthContext(RUN, "x", derive_frame_key(b"z" * 32)), now_unix=time.time(),
                         nonce=os.urandom(16), to="b")
    return frame[:100]


async def test_slow_streams_with_forged_senders_are_cut_at_the_auth_deadline_and_members_get_through() -> None:
    limits = Limits(auth_deadline_s=0.5)
    server = _server(limits)
    async with _serving(server) as url, _member(limits=limits) as member:
        strangers = [asyncio.create_task(_slow_stranger(url, f"forged-{i}", prefix=_frame_prefix(), pause_s=0.05))
                     for i in range(20)]
        await until(lambda: server.unauthenticated_streams == 8, timeout_s=10.0)
        # Members are not behind the strangers: their streams authenticate and are answered.
        for _ in range(5):
            replies = await member.send(url, vote_request(), peer="b")
            assert replies[0].granted
        answers = await asyncio.gather(*strangers)
    statuses = sorted(status for status, _ in answers)
    assert statuses == [408] * 8 + [429] * 12, answers
    assert all(b"no authenticated frame header within 0.5 s" in body for status, body in answers if status == 408)
    assert all(b"already has 8 streams waiting to authenticate" in body for status, body in answers if status == 429)
    # Nothing is kept under the 20 invented names.
    assert set(server.counters.snapshot()) == {"a", UNAUTHENTICATED}
    assert server.counters.peer(UNAUTHENTICATED).refusals == 20
    assert server.active_streams == {} and server.unauthenticated_streams == 0


async def test_a_full_unauthenticated_pool_evicts_its_oldest_stream_for_a_member() -> None:
    limits = Limits(auth_deadline_s=30.0)
    server = _server(limits, ServerOptions(max_unauthenticated_streams=4))
    async with _serving(server) as url, _member(limits=limits) as member:
        strangers = [asyncio.create_task(_slow_stranger(url, "a", prefix=_frame_prefix(), pause_s=0.2,
                                                        address=f"127.0.0.{10 + i}")) for i in range(4)]
        await until(lambda: server.unauthenticated_streams == 4, timeout_s=10.0)
        replies = await member.send(url, vote_request(), peer="b")
        assert replies[0].granted
        status, reason = await asyncio.wait_for(strangers[0], 10)
        assert status == 429 and b"evicted" in reason
        for task in strangers[1:]:
            task.cancel()
        await asyncio.gather(*strangers[1:], return_exceptions=True)


async def test_an_authenticated_trickle_is_cut_below_the_minimum_rate() -> None:
    limits = Limits(min_transfer_bytes_per_s=64 * 1024, min_transfer_window_s=0.3)
    server = _server(limits)
    opened: list[str] = []

    async def open_sink(head: Message, peer: object, length: int) -> object:
        opened.append(head.learner_id)

        class Sink:
            async def write(self, data: bytes) -> None:
                pass

            async def finish(self) -> Message:
                return HeartbeatAck(epoch=1, follower="b", seq=0, match_index=0)

            async def abort(self, reason: str) -> None:
                opened.append(f"abort: {reason}")
        return Sink()

    server.on_stream(MessageKind.FRAGMENT_CONTRIBUTION, open_sink)
    payload = b"p" * (1024 * 1024)

    async def trickle() -> AsyncIterator[bytes]:
        for start in range(0, len(payload), 1024):
            await asyncio.sleep(0.05)  # ~20 KiB/s, under the 64 KiB/s floor
            yield payload[start:start + 1024]

    head = FragmentContribution(fragment=1, base_index=4, base_round=2, c_steps=5, c_tokens=640, codec="int4",
                                learner_id="a", payload=b"")
    async with _serving(server) as url, _member(limits=limits) as member:
        with pytest.raises(PeerRefused) as refused:
            await member.send_stream(url, head, trickle(), payload_length=len(payload),
                                     payload_digest=blake3.blake3(payload).digest(), peer="b")
    assert refused.value.status == 408 and "below the minimum rate of 65536 bytes/s" in refused.value.reason
    assert opened[0] == "a" and opened[1].startswith("abort")
    assert server.active_streams == {}


async def test_thousands_of_invented_sender_names_keep_nothing() -> None:
    server = _server()
    async with _serving(server) as url:
        host, port = url.removeprefix("http://").split(":")
        garbage = b"NOPE" + bytes(40)

        async def one(i: int) -> int:
            reader, writer = await asyncio.open_connection(host, int(port), local_addr=(STRANGER_ADDRESS, 0))
            writer.write(f"POST {kind_path(MessageKind.VOTE_REQUEST)} HTTP/1.1\r\nHost: x\r\n"
                         f"{SENDER_HEADER}: n{i:06d}{'x' * (i % 200)}\r\nContent-Length: {len(garbage)}\r\n\r\n"
                         .encode() + garbage)
            status = int((await reader.readline()).split()[1])
            writer.close()
            return status

        for batch in range(10):
            statuses = await asyncio.gather(*(one(batch * 100 + i) for i in range(100)))
            assert set(statuses) <= {400, 429}  # bad magic (or, in a burst, over the address's cap)
    assert set(server.counters.snapshot()) == {UNAUTHENTICATED}
    assert server.counters.peer(UNAUTHENTICATED).requests_received == 1000
    assert server.active_streams == {} and server.unauthenticated_streams == 0


def test_traffic_counters_are_bounded_even_for_invented_authenticated_names() -> None:
    counters = TrafficCounters(max_peers=3)
    for i in range(100):
        counters.received(f"n{i}", 10)
    snapshot = counters.snapshot()
    assert set(snapshot) == {"n0", "n1", "n2", OTHER_PEERS}
    assert snapshot[OTHER_PEERS]["bytes_received"] == 970


async def test_connections_without_a_request_are_closed_by_the_header_timeout() -> None:
    guard = ConnectionGuard(header_timeout_s=0.5)
    server = _server()
    async with _serving(server, guard) as url, _member() as member:
        host, port = url.removeprefix("http://").split(":")
        connections = [await asyncio.open_connection(host, int(port), local_addr=(STRANGER_ADDRESS, 0))
                       for _ in range(60)]
        for _, writer in connections[30:]:
            writer.write(b"POST /v1/vote-request HTTP/1.1\r\nHost: x\r\nContent-Le")  # half a header
        # A member's request on a fresh connection is still answered meanwhile.
        assert (await member.send(url, vote_request(), peer="b"))[0].granted
        async with asyncio.timeout(10):
            for reader, writer in connections:
                assert await reader.read() == b""  # closed by the server
                writer.close()
    assert guard.closed >= 60


async def test_a_client_that_leaves_after_its_refusal_logs_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    server = _server()
    caplog.set_level(logging.INFO)
    async with _serving(server) as url:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(20):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST {kind_path(MessageKind.VOTE_REQUEST)} HTTP/1.1\r\nHost: x\r\n"
                         "Content-Length: 100000\r\n\r\n".encode() + b"XXXX" * 16)
            await writer.drain()
            writer.transport.abort()  # reset, without reading the answer
        await until(lambda: server.counters.peer(UNAUTHENTICATED).refusals == 20, timeout_s=10.0)
        await asyncio.sleep(0.2)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    refusal_lines = [r for r in caplog.records if r.getMessage().startswith("refused")]
    assert len(refusal_lines) == 1  # one line for the streak (transport/streaks.py), all 20 counted
