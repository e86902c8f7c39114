"""The link emulator's per-source filter: one side of a partition, told apart by the sender's
loopback address (every 127.0.0.0/8 address is loopback on Linux, so each client binds its own)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from diloco_node.testbed.linkemu import LinkEmulator

A = "127.0.0.21"  # the sender that gets blocked
B = "127.0.0.22"  # a sender on the other side, never blocked


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


class _Talker:
    """Sends a byte every 20 ms without being asked (traffic in the down direction only) until
    its connection breaks."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while not reader.at_eof():
                writer.write(b".")
                await writer.drain()
                await asyncio.sleep(0.02)
        except ConnectionError:
            pass
        finally:
            writer.close()
            self.ended.set()


@pytest.fixture
async def link() -> AsyncIterator[LinkEmulator]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    async with LinkEmulator("127.0.0.1", server.sockets[0].getsockname()[1], seed=1) as emu:
        yield emu
    server.close()
    await server.wait_closed()


async def _connect(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), 5)


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes,
                    timeout: float = 5.0) -> bytes:
    writer.write(payload)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(payload)), timeout)


async def _roundtrip(port: int, source: str, payload: bytes, timeout: float = 5.0) -> bytes:
    reader, writer = await _connect(port, source)
    try:
        return await _exchange(reader, writer, payload, timeout)
    finally:
        writer.close()


async def test_a_blocked_source_gets_no_answer_while_others_pass(link: LinkEmulator) -> None:
    link.set_blocked_sources([A])
    assert link.blocked_sources == frozenset({A})
    with pytest.raises(TimeoutError):
        await _roundtrip(link.port, A, b"from a", timeout=0.4)  # accepted, then silence: no refusal
    assert await _roundtrip(link.port, B, b"from b") == b"from b"
    assert link.stats.connections_blocked == 1
    assert link.stats.bytes_swallowed >= len(b"from a")
    assert not link.blackholed  # the link as a whole is fine


async def test_an_open_connection_from_a_newly_blocked_source_goes_silent_then_is_reset(link: LinkEmulator) -> None:
    reader_a, writer_a = await _connect(link.port, A)
    reader_b, writer_b = await _connect(link.port, B)
    assert await _exchange(reader_a, writer_a, b"a1") == b"a1"
    link.set_blocked_sources([A])
    with pytest.raises(TimeoutError):
        await _exchange(reader_a, writer_a, b"a2", timeout=0.3)
    assert await _exchange(reader_b, writer_b, b"b1") == b"b1"  # the other side's connection flows on
    assert link.stats.connections_blocked == 1
    link.set_blocked_sources([])
    # A's stream lost "a2": it must be torn down, never resume with a hole in it.
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await _exchange(reader_a, writer_a, b"a3")
    assert link.stats.resets == 1
    assert await _exchange(reader_b, writer_b, b"b2") == b"b2"
    assert await _roundtrip(link.port, A, b"a again") == b"a again"  # new connections pass
    for w in (writer_a, writer_b):
        w.close()


async def test_a_connection_that_lost_nothing_survives_the_partition(link: LinkEmulator) -> None:
    reader, writer = await _connect(link.port, A)
    assert await _exchange(reader, writer, b"before") == b"before"
    link.set_blocked_sources([A])
    await asyncio.sleep(0.1)  # idle while cut: like a pooled keep-alive connection
    link.set_blocked_sources([])
    assert await _exchange(reader, writer, b"after") == b"after"
    assert link.stats.resets == 0
    writer.close()


async def test_the_down_direction_is_cut_too() -> None:
    talker = _Talker()
    server = await asyncio.start_server(talker, "127.0.0.1", 0)
    try:
        async with LinkEmulator("127.0.0.1", server.sockets[0].getsockname()[1]) as emu:
            reader, writer = await _connect(emu.port, A)
            assert await asyncio.wait_for(reader.readexactly(3), 5) == b"..."
            emu.set_blocked_sources([A])
            await asyncio.sleep(0.1)  # bytes already past the emulator arrive; then nothing
            while True:
                try:
                    await asyncio.wait_for(reader.read(4096), 0.05)
                except TimeoutError:
                    break
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.3)
            assert emu.stats.bytes_swallowed > 0
            emu.set_blocked_sources([])
            with pytest.raises(ConnectionResetError):  # it lost bytes: torn down with an RST
                await asyncio.wait_for(reader.read(4096), 5)
            writer.close()
            await asyncio.wait_for(talker.ended.wait(), 5)
    finally:
        server.close()
        await server.wait_closed()


async def test_setting_replaces_and_heal_clears(link: LinkEmulator) -> None:
    link.set_blocked_sources([A])
    link.set_blocked_sources([B])  # replaces: A passes again
    assert await _roundtrip(link.port, A, b"a") == b"a"
    with pytest.raises(TimeoutError):
        await _roundtrip(link.port, B, b"b", timeout=0.3)
    link.heal()
    assert link.blocked_sources == frozenset()
    assert await _roundtrip(link.port, B, b"b healed") == b"b healed"


async def test_a_mapped_ipv6_spelling_names_the_same_sender(link: LinkEmulator) -> None:
    link.set_blocked_sources([f"::ffff:{A}"])
    assert link.blocked_sources == frozenset({A})
    with pytest.raises(TimeoutError):
        await _roundtrip(link.port, A, b"x", timeout=0.3)


async def test_a_bad_address_is_refused_by_name_and_changes_nothing(link: LinkEmulator) -> None:
    link.set_blocked_sources([A])
    with pytest.raises(ValueError, match="blocked source 'n2' is not an IP address"):
        link.set_blocked_sources([B, "n2"])
    assert link.blocked_sources == frozenset({A})


async def test_blocking_works_from_another_thread(link: LinkEmulator) -> None:
    t = threading.Thread(target=link.set_blocked_sources, args=([A],))
    t.start()
    t.join()
    with pytest.raises(TimeoutError):
        await _roundtrip(link.port, A, b"x", timeout=0.3)
    assert await _roundtrip(link.port, B, b"y") == b"y"
