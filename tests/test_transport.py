"""The HTTP transport over loopback: round trips, streamed payloads in bounded memory, refusals
before reading, authentication, deadlines, stream caps, cancellation, and faults via the link emulator.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import blake3
import aiohttp
import numpy as np
import pytest

from diloco_node.testbed.linkemu import LinkEmulator
from diloco_node.transport.routes import FRAME_CONTENT_TYPE
from diloco_node.transport.server import UNAUTHENTICATED
from diloco_node.transport import (
    ClientOptions,
    Peer,
    PeerClient,
    PeerRefused,
    PeerServer,
    PeerUnreachable,
    SENDER_HEADER,
    kind_path,
)
from wire.auth import AuthContext, FrameVerifier, derive_frame_key
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.frames import encode_frame, encode_frame_head
from wire.limits import Limits, MiB
from wire.messages import (
    FragmentContribution,
    Heartbeat,
    HeartbeatAck,
    Message,
    MessageKind,
    SnapshotChunk,
    SnapshotRequest,
    VoteReply,
    VoteRequest,
)

from conftest import serve_peer_server, until, vote_request

RUN = "run-transport"
KEY = derive_frame_key(b"k" * 32)


def _auth(node: str, key=KEY, run: str = RUN) -> AuthContext:
    return AuthContext(run, node, key)


def _server(limits: Limits = Limits(), **kwargs: object) -> PeerServer:
    return PeerServer(_auth("b"), FrameVerifier(RUN, KEY, limits), limits=limits, **kwargs)


def _client(node: str = "a", key=KEY, run: str = RUN, limits: Limits = Limits()) -> PeerClient:
    return PeerClient(_auth(node, key, run), FrameVerifier(RUN, KEY, limits), limits=limits)


@asynccontextmanager
async def _serving(server: PeerServer) -> AsyncIterator[str]:
    runner, port = await serve_peer_server(server)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class _Voter:
    def __init__(self) -> None:
        self.calls: list[tuple[Message, Peer]] = []

    async def __call__(self, message: Message, peer: Peer) -> Message:
        assert isinstance(message, VoteRequest)
        self.calls.append((message, peer))
        return VoteReply(epoch=message.epoch, voter="b", granted=True, reason="log is up to date")


def _contribution_head() -> FragmentContribution:
    return FragmentContribution(fragment=1, base_index=4, base_round=2, c_steps=50, c_tokens=6400,
                                codec="int4-zstd", learner_id="a", payload=b"")


class _HashingSink:
    """Receives a streamed payload without keeping it: hashes and counts."""

    def __init__(self, head: Message, peer: Peer, length: int, log: list[str]) -> None:
        self.head, self.peer, self.length, self.log = head, peer, length, log
        self.hasher = blake3.blake3()
        self.received = 0
        self.max_chunk = 0

    async def write(self, data: bytes) -> None:
        self.hasher.update(data)
        self.received += len(data)
        self.max_chunk = max(self.max_chunk, len(data))

    async def finish(self) -> Message | None:
        self.log.append("finish")
        return HeartbeatAck(epoch=1, follower="b", seq=self.received, match_index=0)

    async def abort(self, reason: str) -> None:
        self.log.append(f"abort: {reason}")


def _sink_opener(sinks: list[_HashingSink], log: list[str]):
    async def open_sink(head: Message, peer: Peer, length: int) -> _HashingSink:
        sink = _HashingSink(head, peer, length, log)
        sinks.append(sink)
        log.append("open")
        return sink
    return open_sink


def _pattern_chunk(i: int, size: int) -> bytes:
    return (i.to_bytes(8, "big") * (size // 8 + 1))[:size]


async def _pattern(total: int, chunk: int) -> AsyncIterator[bytes]:
    for i in range(total // chunk):
        yield _pattern_chunk(i, chunk)


def _pattern_digest(total: int, chunk: int) -> bytes:
    h = blake3.blake3()
    for i in range(total // chunk):
        h.update(_pattern_chunk(i, chunk))
    return h.digest()


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def _raw_exchange(url: str, request: bytes, *, then: AsyncIterator[bytes] | None = None,
                        timeout: float = 5.0) -> tuple[int, bytes]:
    """Send raw HTTP bytes, optionally keep feeding `then`; return (status, body) of the response."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    feeder = None
    try:
        writer.write(request)
        if then is not None:
            async def feed() -> None:
                async for piece in then:
                    writer.write(piece)
                    await writer.drain()
            feeder = asyncio.create_task(feed())
        async with asyncio.timeout(timeout):
            status_line = await reader.readline()
            headers = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            body = await reader.readexactly(length)
        return int(status_line.split()[1]), body
    finally:
        if feeder is not None:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
        writer.close()


# ---- round trips ------------------------------------------------------------------------------


async def test_round_trip_of_small_messages_with_replies_and_counters() -> None:
    server = _server()
    voter = _Voter()
    server.on_message(MessageKind.VOTE_REQUEST, voter)

    async def ack(message: Message, peer: Peer) -> Message:
        assert isinstance(message, Heartbeat)
        return HeartbeatAck(epoch=message.epoch, follower="b", seq=message.seq, match_index=message.commit_index)

    server.on_message(MessageKind.HEARTBEAT, ack)
    async with _serving(server) as url, _client() as client:
        replies = await client.send(url, vote_request(), peer="b")
        assert replies == [VoteReply(epoch=3, voter="b", granted=True, reason="log is up to date")]
        (message, peer), = voter.calls
        assert message == vote_request() and peer.node_id == "a" and peer.address == "127.0.0.1"
        # Several frames of one kind in one body: one reply each, in order.
        beats = [Heartbeat(epoch=1, leader="a", seq=s, commit_index=s * 2) for s in range(3)]
        acks = await client.send(url, *beats, peer="b")
        assert [(r.seq, r.match_index) for r in acks] == [(0, 0), (1, 2), (2, 4)]
        sent = client.counters.peer("b")
        assert sent.requests_sent == 2 and sent.bytes_sent > 0 and sent.bytes_received > 0
        assert server.counters.peer("a").bytes_received == sent.bytes_sent
        assert server.counters.peer("a").bytes_sent == sent.bytes_received
        status = server.status()
        assert status["active_streams"] == {} and status["peers"]["a"]["requests_received"] == 2


async def test_the_client_connects_from_its_configured_source_address() -> None:
    server = _server()
    voter = _Voter()
    server.on_message(MessageKind.VOTE_REQUEST, voter)
    client = PeerClient(_auth("a"), FrameVerifier(RUN, KEY), options=ClientOptions(source_address="127.0.0.23"))
    async with _serving(server) as url, client:
        await client.send(url, vote_request(), peer="b")
    (_, peer), = voter.calls
    assert peer.address == "127.0.0.23"


async def test_a_big_reply_comes_back_whole() -> None:
    server = _server()
    state = os.urandom(3 * MiB)

    async def snapshot(message: Message, peer: Peer) -> Message:
        assert isinstance(message, SnapshotRequest)
        part = state[message.offset:message.offset + message.max_length]
        return SnapshotChunk(fragment=message.fragment, commit_index=7, offset=message.offset, total=len(state),
                             digest=blake3.blake3(state).digest(), payload=part)

    server.on_message(MessageKind.SNAPSHOT_REQUEST, snapshot)
    async with _serving(server) as url, _client() as client:
        (reply,) = await client.send(url, SnapshotRequest(fragment=2, offset=MiB, max_length=2 * MiB))
        assert isinstance(reply, SnapshotChunk) and reply.payload == state[MiB:]
        # A client bounds replies by its own limits: a peer cannot push more than it accepts.
        small = Limits(max_payload_bytes={MessageKind.SNAPSHOT_CHUNK: 512 * 1024})
        async with _client(limits=small) as careful:
            with pytest.raises(RemoteProtocolError) as refused:
                await careful.send(url, SnapshotRequest(fragment=2, offset=0, max_length=2 * MiB))
            assert refused.value.status_hint == 413


async def test_a_chunk_served_from_arrays_is_taken_piece_by_piece_never_joined() -> None:
    """The server writes a reply whose payload is views of its arrays (PayloadParts, no copy);
    `send_for_stream` authenticates its header and hands the payload over in the pieces it arrived
    in, each checked against the frame's digest; the bytes are the arrays' bytes."""
    import numpy as np

    from wire.messages import PayloadParts

    server = _server()
    arrays = [np.random.default_rng(i).standard_normal(300_000).astype(np.float32) for i in range(3)]
    state = b"".join(a.tobytes() for a in arrays)

    async def snapshot(message: Message, peer: Peer) -> Message:
        assert isinstance(message, SnapshotRequest)
        return SnapshotChunk(fragment=message.fragment, commit_index=7, offset=0, total=len(state),
                             digest=blake3.blake3(state).digest(), payload=PayloadParts(arrays))

    server.on_message(MessageKind.SNAPSHOT_REQUEST, snapshot)
    async with _serving(server) as url, _client() as client:
        request = SnapshotRequest(fragment=2, offset=0, max_length=len(state))
        reply = await client.send_for_stream(url, request, reply_kind=MessageKind.SNAPSHOT_CHUNK)
        assert reply.head == SnapshotChunk(2, 7, 0, len(state), blake3.blake3(state).digest(), b"")
        assert reply.payload_length == len(state)
        pieces: list[bytes | memoryview] = []
        reply.feed(pieces.append)
        assert b"".join(pieces) == state and len(pieces) > 1
        (whole,) = await client.send(url, request)  # the same reply, decoded whole: the same bytes
        assert isinstance(whole, SnapshotChunk) and whole.payload == state
        small = Limits(max_payload_bytes={MessageKind.SNAPSHOT_CHUNK: 512 * 1024})
        async with _client(limits=small) as careful:
            with pytest.raises(RemoteProtocolError, match="at most") as refused:
                await careful.send_for_stream(url, request, reply_kind=MessageKind.SNAPSHOT_CHUNK)
            assert refused.value.status_hint == 413


async def test_unknown_route_and_mixed_kinds_are_refused_with_reasons() -> None:
    server = _server()
    server.on_message(MessageKind.VOTE_REQUEST, _Voter())
    async with _serving(server) as url, _client() as client:
        with pytest.raises(PeerRefused) as refused:
            await client.send(url, Heartbeat(epoch=1, leader="a", seq=1, commit_index=0))
        assert refused.value.status == 404 and "no handler for 'heartbeat'" in refused.value.reason
        with pytest.raises(LocalProtocolError, match="one kind"):
            await client.send(url, vote_request(), Heartbeat(epoch=1, leader="a", seq=1, commit_index=0))


# ---- streamed payloads ------------------------------------------------------------------------


async def test_64_mib_streamed_payload_arrives_whole_in_bounded_memory() -> None:
    total, chunk = 64 * MiB, 1 * MiB
    digest = await asyncio.to_thread(_pattern_digest, total, chunk)
    server = _server()
    sinks: list[_HashingSink] = []
    log: list[str] = []
    server.on_stream(MessageKind.FRAGMENT_CONTRIBUTION, _sink_opener(sinks, log))
    async with _serving(server) as url, _client() as client:
        baseline = peak = _rss_bytes()
        done = False

        async def sample() -> None:
            nonlocal peak
            while not done:
                peak = max(peak, _rss_bytes())
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        replies = await client.send_stream(url, _contribution_head(), _pattern(total, chunk),
                                           payload_length=total, payload_digest=digest)
        done = True
        await sampler
    (sink,) = sinks
    assert log == ["open", "finish"]
    assert sink.received == total and sink.hasher.digest() == digest
    assert sink.head == _contribution_head() and sink.peer.node_id == "a" and sink.length == total
    assert replies == [HeartbeatAck(epoch=1, follower="b", seq=total, match_index=0)]
    assert sink.max_chunk <= Limits().max_payload_chunk_bytes
    # The 64 MiB never existed whole on either side (both run in this process).
    assert peak - baseline < 32 * MiB, f"RSS grew by {(peak - baseline) / MiB:.1f} MiB"


async def test_streamed_payload_from_bytes_and_a_lying_iterator() -> None:
    server = _server()
    sinks: list[_HashingSink] = []
    log: list[str] = []
    server.on_stream(MessageKind.FRAGMENT_CONTRIBUTION, _sink_opener(sinks, log))
    payload = os.urandom(3 * MiB + 17)
    async with _serving(server) as url, _client() as client:
        await client.send_stream(url, _contribution_head(), bytearray(payload))
        assert sinks[0].hasher.digest() == blake3.blake3(payload).digest()
        values = np.linspace(-1, 1, 300_001, dtype=np.float32)  # any buffer goes, without a copy
        await client.send_stream(url, _contribution_head(), values)
        assert sinks[1].hasher.digest() == blake3.blake3(values.tobytes()).digest()
        log.clear()

        async def short() -> AsyncIterator[bytes]:
            yield payload[:1000]

        with pytest.raises(LocalProtocolError, match="gave 1000 bytes, declared"):
            await client.send_stream(url, _contribution_head(), short(), payload_length=len(payload),
                                     payload_digest=blake3.blake3(payload).digest())
        await until(lambda: server.active_streams == {})
        # The server either never saw the second head, or saw it and aborted: never a finish.
        assert "finish" not in log and (log == [] or log[-1].startswith("abort"))


async def test_a_forged_streamed_payload_is_aborted_with_401() -> None:
    server = _server()
    sinks: list[_HashingSink] = []
    log: list[str] = []
    server.on_stream(MessageKind.FRAGMENT_CONTRIBUTION, _sink_opener(sinks, log))
    async with _serving(server) as url, _client() as client:
        with pytest.raises(PeerRefused) as refused:
            await client.send_stream(url, _contribution_head(), b"x" * MiB, payload_digest=b"\0" * 32)
    assert refused.value.status == 401 and "digest" in refused.value.reason
    assert log == ["open", log[1]] and log[1].startswith("abort") and "digest" in log[1]


# ---- refusals before reading ------------------------------------------------------------------


async def test_oversize_by_content_length_is_refused_before_reading() -> None:
    limits = Limits().with_max_payload(MessageKind.FRAGMENT_CONTRIBUTION, 1 * MiB)
    server = _server(limits)
    sinks: list[_HashingSink] = []
    log: list[str] = []
    server.on_stream(MessageKind.FRAGMENT_CONTRIBUTION, _sink_opener(sinks, log))
    async with _serving(server) as url, _client() as client:
        # Declares 10 GB and sends nothing: answered at once, without waiting for a body.
        path = kind_path(MessageKind.FRAGMENT_CONTRIBUTION)
        request = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {10**10}\r\n\r\n").encode()
        status, body = await _raw_exchange(url, request, timeout=2)
        assert status == 413 and b"exceeds the limit" in body
        with pytest.raises(PeerRefused) as refused:
            await client.send_stream(url, _contribution_head(), b"\1" * (4 * MiB))
        assert refused.value.status == 413
        # The client asked first (Expect: 100-continue), so not one body byte was sent.
        assert server.counters.peer("a").bytes_received == 0
        assert client.counters.peer(url.removeprefix("http://")).bytes_sent == 0
        # A chunked body has no Content-Length: the frame header's declared size is refused (413)
        # before its payload is read.
        head = encode_frame_head(_contribution_head(), _auth("a"), now_unix=time.time(), nonce=os.urandom(16),
                                 payload_length=4 * MiB, payload_digest=b"\0" * 32)

        async def chunked() -> AsyncIterator[bytes]:
            yield head
            for _ in range(8):
                yield b"\0" * (512 * 1024)

        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, data=chunked()) as response:
                assert response.status == 413 and "exceeds the limit" in await response.text()
    assert sinks == [] and log == []  # nothing was handed to a handler


async def test_compressed_bodies_are_refused() -> None:
    server = _server()
    voter = _Voter()
    server.on_message(MessageKind.VOTE_REQUEST, voter)
    async with _serving(server) as url:
        frame = encode_frame(vote_request(), _auth("a"), now_unix=time.time(), nonce=os.urandom(16))
        async with aiohttp.ClientSession() as session:
            async with session.post(url + kind_path(MessageKind.VOTE_REQUEST), data=frame,
                                    headers={"Content-Encoding": "gzip"}) as response:
                assert response.status == 415
    assert voter.calls == []


# ---- authentication ---------------------------------------------------------------------------


async def test_wrong_mac_is_401_wrong_run_409_and_the_handler_is_not_called() -> None:
    server = _server()
    voter = _Voter()
    server.on_message(MessageKind.VOTE_REQUEST, voter)
    async with _serving(server) as url:
        async with _client(key=derive_frame_key(b"z" * 32)) as stranger:
            with pytest.raises(PeerRefused) as refused:
                await stranger.send(url, vote_request())
            assert refused.value.status == 401 and "bad MAC" in refused.value.reason
        async with _client(run="other-run") as lost:
            with pytest.raises(PeerRefused) as refused:
                await lost.send(url, vote_request())
            assert refused.value.status == 409 and "other-run" in refused.value.reason
        async with aiohttp.ClientSession() as session:
            # A frame signed by "a" under a header claiming "c": identity mismatch.
            frame = encode_frame(vote_request(), _auth("a"), now_unix=time.time(), nonce=os.urandom(16))
            async with session.post(url + kind_path(MessageKind.VOTE_REQUEST), data=frame,
                                    headers={SENDER_HEADER: "c"}) as response:
                assert response.status == 401 and "signed by 'a'" in await response.text()
            # A future wire major version: 426.
            newer = frame[:4] + bytes([9]) + frame[5:]
            async with session.post(url + kind_path(MessageKind.VOTE_REQUEST), data=newer) as response:
                assert response.status == 426
    assert voter.calls == []
    # Only an authenticated sender is counted by name; the bad MAC, the wrong run and the future
    # version share the strangers' bucket (what a header claims is never a key).
    snapshot = server.counters.snapshot()
    assert snapshot["a"]["refusals"] == 1
    assert snapshot[UNAUTHENTICATED]["refusals"] == 3 and set(snapshot) == {"a", UNAUTHENTICATED}


async def test_a_replayed_request_is_refused() -> None:
    server = _server()
    voter = _Voter()
    server.on_message(MessageKind.VOTE_REQUEST, voter)
    async with _serving(server) as url, aiohttp.ClientSession() as session:
        frame = encode_frame(vote_request(), _auth("a"), now_unix=time.time(), nonce=os.urandom(16))
        statuses = []
        for _ in range(2):
            async with session.post(url + kind_path(MessageKind.VOTE_REQUEST), data=frame) as response:
                statuses.append(response.status)
    assert statuses == [200, 401] and len(voter.calls) == 1


# ---- deadlines --------------------------------------------------------------------------------


async def test_a_slow_sender_is_cut_by_the_frame_deadline() -> None:
    server = _server(Limits(read_timeout_s=5.0, message_timeout_s=0.5))
    voter = _Voter()
    server.on_message(MessageKind.VOTE_REQUEST, voter)
    frame = encode_frame(vote_request(), _auth("a"), now_unix=time.time(), nonce=os.urandom(16))

    async def drip() -> AsyncIterator[bytes]:  # one byte every 20 ms: each read is "on time"
        for byte in frame:
            await asyncio.sleep(0.02)
            yield bytes([byte])

    async with _serving(server) as url:
        path = kind_path(MessageKind.VOTE_REQUEST)
        request = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(frame)}\r\n\r\n".encode()
        start = time.monotonic()
        status, body = await _raw_exchange(url, request, then=drip())
        elapsed = time.monotonic() - start
    assert status == 408 and b"deadline" in body
    assert elapsed < len(frame) * 0.02  # cut before the frame could complete
    assert voter.calls == []


async def test_a_silent_sender_is_cut_by_the_read_timeout() -> None:
    server = _server(Limits(read_timeout_s=0.3, message_timeout_s=60.0))
    server.on_message(MessageKind.VOTE_REQUEST, _Voter())
    async with _serving(server) as url:
        request = f"POST {kind_path(MessageKind.VOTE_REQUEST)} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        status, body = await _raw_exchange(url, request.encode())
    assert status == 408 and b"no body byte for 0.3 s" in body
    assert server.active_streams == {}


# ---- stream caps and cancellation -------------------------------------------------------------


async def test_a_flood_of_concurrent_streams_is_capped_with_429() -> None:
    limits = Limits(max_concurrent_streams_per_peer=2)
    server = _server(limits)
    sinks: list[_HashingSink] = []
    log: list[str] = []
    server.on_stream(MessageKind.FRAGMENT_CONTRIBUTION, _sink_opener(sinks, log))
    release = asyncio.Event()
    payload = b"p" * (2 * MiB)
    digest = blake3.blake3(payload).digest()

    async def held() -> AsyncIterator[bytes]:
        yield payload[: MiB]
        await release.wait()
        yield payload[MiB:]

    async with _serving(server) as url, _client() as client:
        async def upload() -> list[Message]:
            return await client.send_stream(url, _contribution_head(), held(), payload_length=len(payload),
                                             payload_digest=digest)
        first = [asyncio.create_task(upload()) for _ in range(2)]
        await until(lambda: server.active_streams.get("a") == 2)
        flood = await asyncio.gather(*(upload() for _ in range(6)), return_exceptions=True)
        assert all(isinstance(r, PeerRefused) and r.status == 429 for r in flood), flood
        assert "already has 2 streams open" in flood[0].reason
        release.set()
        results = await asyncio.gather(*first)
    assert all(r[0].seq == len(payload) for r in results)
    assert log.count("finish") == 2 and server.active_streams == {}


async def test_cancelling_an_upload_leaves_no_half_state() -> None:
    server = _server()
    sinks: list[_HashingSink] = []
    log: list[str] = []
    server.on_stream(MessageKind.FRAGMENT_CONTRIBUTION, _sink_opener(sinks, log))
    server.on_message(MessageKind.VOTE_REQUEST, _Voter())
    never = asyncio.Event()

    async def stuck() -> AsyncIterator[bytes]:
        yield b"s" * MiB
        await never.wait()
        yield b"never"

    async with _serving(server) as url, _client() as client:
        task = asyncio.create_task(client.send_stream(url, _contribution_head(), stuck(),
                                                      payload_length=2 * MiB, payload_digest=b"\0" * 32))
        await until(lambda: sinks and sinks[0].received == MiB)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: server.active_streams == {})
        assert log[0] == "open" and log[1].startswith("abort") and "finish" not in log
        connector = client._session.connector  # peek: no connection is still checked out
        assert not connector._acquired
        assert await client.send(url, vote_request())  # the client is still usable


# ---- through the link emulator ----------------------------------------------------------------


async def test_link_faults_as_seen_by_the_transport() -> None:
    server = _server()
    server.on_message(MessageKind.VOTE_REQUEST, _Voter())
    async with _serving(server) as url, _client() as client:
        port = int(url.rsplit(":", 1)[1])
        async with LinkEmulator("127.0.0.1", port) as link:
            via = f"http://127.0.0.1:{link.port}"
            for _ in range(3):
                assert await client.send(via, vote_request())
            assert link.stats.connections_accepted == 1  # the session reuses its connection
            link.set_latency(0.1)
            start = time.monotonic()
            assert await client.send(via, vote_request())
            assert time.monotonic() - start >= 0.2  # one way up, one way down
            link.heal()

            link.set_blackhole()
            with pytest.raises(PeerUnreachable, match="deadline"):
                await client.send(via, vote_request(), deadline_s=0.5)
            link.heal()
            assert await client.send(via, vote_request(), deadline_s=5)

            link.reset(keep_resetting=True)
            start = time.monotonic()
            with pytest.raises(PeerUnreachable):
                await client.send(via, vote_request(), deadline_s=5)
            assert time.monotonic() - start < 2.0  # a reset fails fast, not by the deadline
            link.heal()
            assert await client.send(via, vote_request(), deadline_s=5)


# ---- sequences: an opening frame, then its parts, one chunked body -------------------------------


class _Sequence:
    """A SequenceConsumer that records what it got and declares room for `parts` small parts."""

    def __init__(self, head: Message, peer: Peer, parts: int, log: list[str]) -> None:
        self.head, self.peer, self.parts_due, self.log = head, peer, parts, log
        self.parts: list[Message] = []

    @property
    def max_remaining_bytes(self) -> int:
        return 1024 * (self.parts_due - len(self.parts))

    @property
    def frames_left(self) -> int:
        return self.parts_due - len(self.parts)

    async def part(self, message: Message) -> None:
        self.parts.append(message)
        self.log.append("part")

    async def finish(self) -> Message | None:
        self.log.append("finish")
        return HeartbeatAck(epoch=1, follower="b", seq=len(self.parts), match_index=0)

    async def abort(self, reason: str) -> None:
        self.log.append(f"abort: {reason}")


def _sequence_server(parts_due: int) -> tuple[PeerServer, list[_Sequence], list[str]]:
    server = _server()
    opened: list[_Sequence] = []
    log: list[str] = []

    async def open_consumer(head: Message, peer: Peer) -> _Sequence:
        log.append("open")
        opened.append(_Sequence(head, peer, parts_due, log))
        return opened[-1]

    server.on_sequence(MessageKind.CONTRIBUTION_OPEN, MessageKind.CONTRIBUTION_CHUNK, open_consumer)
    return server, opened, log


def _stream_open() -> Message:
    from wire.messages import ContributionOpen, TensorSpec

    return ContributionOpen(0, 1, 1, 4, 64, "int4", "a", bytes(16), 8, (TensorSpec("w", (8, 4)),))


def _stream_chunk(i: int, size: int = 100) -> Message:
    from wire.messages import ContributionChunk

    return ContributionChunk(bytes(16), 0, 8 * i, bytes([i]) * size)


async def _frames(*messages: Message, fail: Exception | None = None) -> AsyncIterator[Message]:
    for message in messages:
        await asyncio.sleep(0)
        yield message
    if fail is not None:
        raise fail


async def test_a_sequence_arrives_frame_by_frame_in_one_chunked_body() -> None:
    server, opened, log = _sequence_server(parts_due=4)
    async with _serving(server) as url, _client() as client:
        parts = [_stream_chunk(i) for i in range(4)]
        replies = await client.send_sequence(url, _frames(_stream_open(), *parts), peer="b")
    (consumer,) = opened
    assert log == ["open", "part", "part", "part", "part", "finish"]
    assert consumer.head == _stream_open() and consumer.parts == parts and consumer.peer.node_id == "a"
    assert replies == [HeartbeatAck(epoch=1, follower="b", seq=4, match_index=0)]


async def test_a_sequence_is_bounded_by_what_its_opening_frame_declared() -> None:
    server, opened, log = _sequence_server(parts_due=2)  # room for 2 parts of ~1 KiB each
    async with _serving(server) as url, _client() as client:
        with pytest.raises(PeerRefused) as refused:
            big = [_stream_chunk(i, 512 * 1024) for i in range(8)]  # 4 MiB: far past the declaration
            await client.send_sequence(url, _frames(_stream_open(), *big), peer="b")
        assert refused.value.status == 413 and "CONTRIBUTION_OPEN body exceeds the limit" in refused.value.reason
        assert log[0] == "open" and log[-1].startswith("abort: stream failed")
        log.clear()
        with pytest.raises(PeerRefused) as refused:
            await client.send_sequence(url, _frames(_stream_open(), _stream_open()), peer="b")
        assert refused.value.status == 400
        assert "contribution-open body continues with contribution-chunk frames, got CONTRIBUTION_OPEN" in refused.value.reason
        assert log[0] == "open" and log[-1].startswith("abort")
        with pytest.raises(PeerRefused) as refused:  # a part alone has no route
            await client.send(url, _stream_chunk(0), peer="b")
        assert refused.value.status == 404


async def test_a_failing_producer_aborts_the_upload_with_its_own_error() -> None:
    server, opened, log = _sequence_server(parts_due=4)
    async with _serving(server) as url, _client() as client:
        with pytest.raises(ValueError, match="encoder broke"):
            await client.send_sequence(url, _frames(_stream_open(), _stream_chunk(0), fail=ValueError("encoder broke")),
                                       peer="b")
        await until(lambda: log and log[-1].startswith("abort"))
    assert "finish" not in log


async def _ask_for_a_chunk_with_a_small_window(url: str, length: int):
    """A raw connection with a 64 KiB receive buffer (so the server's writes back up as soon as the
    reader stops reading) that has sent one authenticated SnapshotRequest; (reader, writer)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    frame = encode_frame(SnapshotRequest(fragment=1, offset=0, max_length=length), _auth("a"),
                         now_unix=time.time(), nonce=os.urandom(16))
    writer.write(f"POST {kind_path(MessageKind.SNAPSHOT_REQUEST)} HTTP/1.1\r\nHost: {host}\r\n"
                 f"Content-Type: {FRAME_CONTENT_TYPE}\r\nContent-Length: {len(frame)}\r\n\r\n".encode() + frame)
    await writer.drain()
    return reader, writer


async def test_a_reader_that_stops_taking_a_big_reply_is_cut_off_after_the_read_timeout(caplog) -> None:
    """A reply made of views of the state's arrays keeps that version alive while it is written: a
    reader that takes nothing for the read timeout is dropped, as a stalled sender is."""
    import logging

    from wire.messages import PayloadParts

    caplog.set_level(logging.INFO, logger="diloco_node")
    server = _server(Limits(read_timeout_s=0.3))
    state = np.zeros(64 * MiB // 4, np.float32)  # far more than the two sockets' buffers hold
    served = asyncio.Event()

    async def snapshot(message: Message, peer: Peer) -> Message:
        served.set()
        return SnapshotChunk(fragment=message.fragment, commit_index=7, offset=0, total=state.nbytes,
                             digest=bytes(32), payload=PayloadParts([state]))

    server.on_message(MessageKind.SNAPSHOT_REQUEST, snapshot)
    async with _serving(server) as url:
        reader, writer = await _ask_for_a_chunk_with_a_small_window(url, state.nbytes)
        await asyncio.wait_for(served.wait(), 5)
        # Take nothing: the server's writes back up, and it gives up on this reader.
        await until(lambda: "reader took nothing" in caplog.text, timeout_s=10)
        received = 0
        async with asyncio.timeout(10):  # what was already in flight, then the end of the connection
            while piece := await reader.read(1 << 20):
                received += len(piece)
        writer.close()
    assert received < state.nbytes


def test_damaged_snapshot_chunk_replies_raise_only_protocol_errors_and_accepted_ones_are_whole() -> None:
    """The quick version of benchmarks/wire_fuzz.py's streamed-reply fuzz (which found that an empty
    piece among the received ones ended the decoder's stream early)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "wire_fuzz.py"
    spec = importlib.util.spec_from_file_location("wire_fuzz", path)
    wire_fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wire_fuzz)
    assert wire_fuzz.fuzz_streamed_replies(400, seed=3) == 0


async def test_a_slow_readers_reply_lets_the_served_arrays_go_and_still_arrives_whole(monkeypatch) -> None:
    """A served chunk is written from views of the state's arrays; a reader slower than
    REPLY_VIEWS_S gets the rest from one copy, so the arrays (a state version a commit may have
    replaced) are not kept alive by it; the bytes it reads are the arrays' bytes all the same."""
    import gc
    import weakref

    from diloco_node.transport import server as server_module
    from wire.messages import PayloadParts

    monkeypatch.setattr(server_module, "REPLY_VIEWS_S", 0.2)
    server = _server()
    served: list[weakref.ref] = []
    # Three times what the kernel buffers on a socket here (tcp_wmem 4 MiB): most of it waits on the reader.
    expected = np.random.default_rng(5).standard_normal(12 * MiB // 4).astype(np.float32)

    async def snapshot(message: Message, peer: Peer) -> Message:
        arrays = [expected[: expected.size // 2].copy(), expected[expected.size // 2:].copy()]
        served.extend(weakref.ref(a) for a in arrays)
        return SnapshotChunk(fragment=message.fragment, commit_index=7, offset=0, total=expected.nbytes,
                             digest=bytes(32), payload=PayloadParts(arrays))

    server.on_message(MessageKind.SNAPSHOT_REQUEST, snapshot)
    async with _serving(server) as url:
        reader, writer = await _ask_for_a_chunk_with_a_small_window(url, expected.nbytes)
        body = bytearray()
        read_when_released = None
        async with asyncio.timeout(30):
            while True:
                piece = await reader.read(64 * 1024)
                if not piece:
                    break
                body += piece
                if served and read_when_released is None:
                    gc.collect()
                    if all(ref() is None for ref in served):
                        read_when_released = len(body)
                head_end = body.find(b"\r\n\r\n")
                if head_end >= 0:
                    length = int(body[:head_end].split(b"Content-Length: ")[1].split(b"\r\n")[0])
                    if len(body) >= head_end + 4 + length:
                        break
                await asyncio.sleep(0.02)  # at most about 3 MB/s: the 12 MiB reply takes some 4 s
        writer.close()
    # Let go within REPLY_VIEWS_S, not once the kernel took the last slice (8 MiB later).
    assert read_when_released is not None and read_when_released < expected.nbytes // 3, read_when_released
    got = bytes(body[-expected.nbytes:])  # the frame's payload ends the body
    assert got == expected.tobytes(), f"{len(body)} bytes read"
