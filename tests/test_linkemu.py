"""The WAN link emulator: each toxic changes what a client observes, and heal undoes it (the
emulator as its own process: tests/integration/test_linkemu_processes.py).

Only lower bounds on time are asserted (a shaped link can't be faster than its shape); speed
itself is measured in benchmarks/wire_bench.py.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator

import pytest

from diloco_node.testbed.linkemu import Direction, LinkEmulator, Shape

from conftest import roundtrip


@pytest.fixture
async def link(echo_port: int) -> AsyncIterator[LinkEmulator]:
    async with LinkEmulator("127.0.0.1", echo_port, seed=1) as emu:
        yield emu


async def test_clean_link_forwards_bytes_both_ways(link: LinkEmulator) -> None:
    payload = os.urandom(300_000)
    assert await roundtrip(link.port, payload) == payload
    assert link.stats.bytes_up == len(payload) and link.stats.bytes_down == len(payload)


async def test_latency_delays_each_direction_and_keeps_order(link: LinkEmulator) -> None:
    link.set_latency(0.1, jitter_s=0.03)
    payload = b"".join(i.to_bytes(4, "big") for i in range(50_000))
    start = time.monotonic()
    assert await roundtrip(link.port, payload) == payload  # jitter never reorders
    # Up and down each add at least latency - jitter.
    assert time.monotonic() - start >= 2 * (0.1 - 0.03)


async def test_bandwidth_cap_slows_a_transfer_down(link: LinkEmulator) -> None:
    rate = 2_000_000  # bytes/s
    link.set_bandwidth(rate, (Direction.UP,))
    assert link.shape(Direction.DOWN).bandwidth_Bps is None
    payload = os.urandom(1_000_000)
    start = time.monotonic()
    assert await roundtrip(link.port, payload) == payload
    # One token-bucket burst may pass free; the rest must wait for the cap.
    assert time.monotonic() - start >= (len(payload) - 64 * 1024) / rate * 0.9


async def test_connections_through_one_link_share_its_cap(link: LinkEmulator) -> None:
    # A pool of connections (pipelined requests) must not multiply the link's rate.
    rate = 2_000_000  # bytes/s
    link.set_bandwidth(rate, (Direction.UP,))
    payloads = [os.urandom(500_000) for _ in range(3)]
    start = time.monotonic()
    echoed = await asyncio.gather(*(roundtrip(link.port, p) for p in payloads))
    assert echoed == payloads
    # 1.5 MB through one 2 MB/s link: 0.75 s, less one burst. Per-connection buckets took 0.25 s.
    assert time.monotonic() - start >= (sum(map(len, payloads)) - 64 * 1024) / rate * 0.9


async def test_slicer_delivers_identical_bytes_in_small_pieces(link: LinkEmulator, echo_port: int) -> None:
    link.set_slicer(7, delay_s=0.0005, directions=(Direction.UP,))
    payload = os.urandom(5_000)
    assert await roundtrip(link.port, payload) == payload


async def test_blackhole_makes_a_request_time_out_and_heal_restores(link: LinkEmulator) -> None:
    link.set_blackhole()
    with pytest.raises(TimeoutError):
        await roundtrip(link.port, b"hello", timeout=0.5)
    assert link.stats.bytes_swallowed >= 5
    link.heal()
    assert await roundtrip(link.port, b"after heal") == b"after heal"


async def test_blackhole_swallows_an_open_connection_and_heal_closes_it(link: LinkEmulator) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    link.set_blackhole()
    writer.write(b"lost")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(4), 0.3)
    link.heal()  # the stream has a hole now: it must not silently resume
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        async with asyncio.timeout(5):
            writer.write(b"more")
            await writer.drain()
            await reader.readexactly(4)
    writer.close()


async def test_reset_fails_fast_and_keep_resetting_refuses_new_connections(link: LinkEmulator) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    writer.write(b"x")
    assert await asyncio.wait_for(reader.readexactly(1), 5) == b"x"
    link.reset(keep_resetting=True)
    start = time.monotonic()
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(reader.readexactly(1), 5)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await roundtrip(link.port, b"new")
    assert time.monotonic() - start < 2.5  # fails fast, far below the 5 s timeouts
    writer.close()
    link.heal()
    assert await roundtrip(link.port, b"healed") == b"healed"


async def test_stall_hangs_then_closes_every_connection(link: LinkEmulator) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    link.stall(0.4)
    start = time.monotonic()
    writer.write(b"held")
    assert await reader.read(4) == b""  # no data came through; then the link closed it
    assert time.monotonic() - start >= 0.35
    writer.close()
    assert not link.stalled
    assert await roundtrip(link.port, b"after") == b"after"


async def test_controls_work_from_another_thread(link: LinkEmulator) -> None:
    t = threading.Thread(target=link.set_blackhole)
    t.start()
    t.join()
    await asyncio.sleep(0.05)
    assert link.blackholed
    with pytest.raises(TimeoutError):
        await roundtrip(link.port, b"x", timeout=0.3)
    t = threading.Thread(target=link.heal)
    t.start()
    t.join()
    assert await roundtrip(link.port, b"y") == b"y"


async def test_close_ends_every_connection(echo_port: int) -> None:
    emu = LinkEmulator("127.0.0.1", echo_port)
    await emu.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
    writer.write(b"a")
    await asyncio.wait_for(reader.readexactly(1), 5)
    await emu.close()
    assert emu.stats.connections_open == 0
    assert await asyncio.wait_for(reader.read(1), 5) == b""
    writer.close()


def test_shape_rejects_nonsense_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        Shape(bandwidth_Bps=0)
    with pytest.raises(ValueError, match="latency"):
        Shape(latency_s=-1)
    with pytest.raises(ValueError, match="slice size"):
        Shape(slice_bytes=0)
