"""A WAN link emulator: an asyncio TCP proxy on loopback with faults ("toxics") set at run time.

Modelled on toxiproxy. One `LinkEmulator` listens on a local port and forwards every accepted
connection to one upstream address. While it runs, a test, a benchmark or the demo can change the
link's behaviour per direction ("up" = client to upstream, "down" = upstream to client):

- bandwidth cap (token bucket, bytes/s, per direction, shared by every connection through the
  link, as a real link's capacity is), latency with jitter (per chunk, order kept),
- slicer (writes split into tiny pieces with small delays, to exercise incremental decoders),
- stall (data hangs for N seconds, then every connection is closed),
- reset (connections are torn down with a TCP RST now, optionally every new one too),
- blackhole (connections are accepted and their bytes swallowed: a partition),
- blocked sources (the blackhole for connections from some remote IPs only: with one loopback
  address per sender, 127.0.0.0/8, this cuts chosen senders off, i.e. one side of a partition),
- heal (back to a clean link).

Control methods may be called from the event loop or from another thread: settings are plain
attribute swaps, and anything touching sockets is handed to the loop with `call_soon_threadsafe`.

As a process of its own (the demo's and the launcher's links): `diloco-node linkemu`
(`diloco_node/cli/linkemu.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import ipaddress
import random
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable

# Largest read from a socket in one go; also the unit latency is applied to. 64 KiB keeps the
# per-chunk overhead negligible at loopback speeds while a 200 Mbit/s link still sees fine grain.
READ_CHUNK_BYTES = 64 * 1024
# Bytes a direction may hold between reading and writing (latency queue). Bounds memory; must
# exceed the bandwidth-delay product of the emulated link (200 Mbit/s x 100 ms = 2.5 MB).
MAX_IN_FLIGHT_BYTES = 8 * 1024 * 1024
# Token bucket depth: how far a capped link may burst after idling. 16 ms worth of bytes (at least
# one read chunk) keeps short-term rates close to the cap.
BUCKET_SECONDS = 0.016
# Upstream connect timeout: a dead upstream must not hold an accepted client forever.
UPSTREAM_CONNECT_TIMEOUT_S = 5.0


class Direction(enum.Enum):
    UP = "up"  # client -> upstream
    DOWN = "down"  # upstream -> client


BOTH = (Direction.UP, Direction.DOWN)


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """How one direction of the link treats bytes; replaced whole, so readers see a consistent set."""

    bandwidth_Bps: float | None = None  # None: unlimited
    latency_s: float = 0.0
    jitter_s: float = 0.0
    slice_bytes: int | None = None  # None: no slicer
    slice_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_Bps is not None and not self.bandwidth_Bps > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s or None, got {self.bandwidth_Bps}")
        if self.latency_s < 0 or self.jitter_s < 0:
            raise ValueError(f"latency and jitter must be >= 0, got {self.latency_s}, {self.jitter_s}")
        if self.slice_bytes is not None and self.slice_bytes < 1:
            raise ValueError(f"slice size must be >= 1 byte, got {self.slice_bytes}")
        if self.slice_delay_s < 0:
            raise ValueError(f"slice delay must be >= 0, got {self.slice_delay_s}")


@dataclasses.dataclass(slots=True)
class LinkStats:
    connections_accepted: int = 0
    connections_open: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    bytes_swallowed: int = 0
    resets: int = 0
    connections_blocked: int = 0  # accepted from a blocked source, or open when its source was blocked


class _TokenBucket:
    """Bytes/s limiter that lets the balance go into debt, so big chunks cost exactly their size."""

    def __init__(self, min_burst_bytes: int) -> None:
        self._min_burst = float(min_burst_bytes)
        self._tokens = 0.0
        self._stamp = time.monotonic()

    def delay_for(self, nbytes: int, rate_Bps: float) -> float:
        """Charge `nbytes` and return how long to wait before sending them at `rate_Bps`."""
        now = time.monotonic()
        burst = max(self._min_burst, rate_Bps * BUCKET_SECONDS)
        self._tokens = min(burst, self._tokens + (now - self._stamp) * rate_Bps)
        self._stamp = now
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / rate_Bps


class _Connection:
    """One proxied client connection: two pumps (up, down) and the sockets they own."""

    def __init__(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.client_reader = client_reader
        self.client_writer = client_writer
        self.source = _peer_host(client_writer)  # the sender's IP, normalised; "" if unknown
        self.upstream_writer: asyncio.StreamWriter | None = None
        self.swallowing = False  # set once any byte was dropped: the stream has a hole
        self.cut_counted = False  # counted in LinkStats.connections_blocked
        self.task: asyncio.Task[None] | None = None

    def abort(self, rst: bool) -> None:
        """Tear both sockets down now; with `rst` the peers see a TCP reset rather than a FIN."""
        for writer in (self.client_writer, self.upstream_writer):
            if writer is None:
                continue
            if rst:
                _arm_rst(writer)
            writer.transport.abort()
        if self.task is not None:
            self.task.cancel()


def _peer_host(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if not peer:
        return ""
    try:
        return _normalise_host(str(peer[0]))
    except ValueError:
        return str(peer[0])


def _normalise_host(host: str) -> str:
    """One spelling per address (an IPv4 peer on a dual-stack socket shows as ::ffff:a.b.c.d)."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def _arm_rst(writer: asyncio.StreamWriter) -> None:
    """SO_LINGER with a zero timeout makes close() send RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class LinkEmulator:
    """A fault-injecting TCP proxy from `listen_host:listen_port` to `upstream_host:upstream_port`."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        max_in_flight_bytes: int = MAX_IN_FLIGHT_BYTES,
        read_chunk_bytes: int = READ_CHUNK_BYTES,
        seed: int | None = None,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listen = (listen_host, listen_port)
        self.max_in_flight_bytes = max_in_flight_bytes
        self.read_chunk_bytes = read_chunk_bytes
        self.stats = LinkStats()
        self._shape = {Direction.UP: Shape(), Direction.DOWN: Shape()}
        # One bucket per direction for the whole link: a client that opens several connections
        # (a pool, pipelined requests) shares the link's rate instead of multiplying it.
        self._buckets = {Direction.UP: _TokenBucket(read_chunk_bytes), Direction.DOWN: _TokenBucket(read_chunk_bytes)}
        self._blackhole = False
        self._blocked_sources: frozenset[str] = frozenset()
        self._stalled = False
        self._reset_new = False
        self._rng = random.Random(seed)
        self._connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()  # bound to the loop on first wait (py >= 3.10)
        self._stall_timer: asyncio.TimerHandle | None = None
        self._port: int | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> int:
        """Listen (port 0 picks a free one) and return the port."""
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._accept, *self._listen)
        self._port = self._server.sockets[0].getsockname()[1]
        return self._port

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("LinkEmulator not started")
        return self._port

    @property
    def address(self) -> str:
        return f"{self._listen[0]}:{self.port}"

    async def close(self) -> None:
        """Stop listening and close every connection; returns once all pumps have ended."""
        if self._server is not None:
            self._server.close()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        tasks = [c.task for c in self._connections if c.task is not None]
        for conn in list(self._connections):
            conn.abort(rst=False)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> LinkEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- control (callable from any thread) ------------------------------------------------

    def shape(self, direction: Direction) -> Shape:
        return self._shape[direction]

    def set_bandwidth(self, bytes_per_s: float | None, directions: tuple[Direction, ...] = BOTH) -> None:
        self._update(directions, bandwidth_Bps=bytes_per_s)

    def set_bandwidth_mbit(self, mbit_per_s: float | None, directions: tuple[Direction, ...] = BOTH) -> None:
        self.set_bandwidth(None if mbit_per_s is None else mbit_per_s * 1e6 / 8, directions)

    def set_latency(self, latency_s: float, jitter_s: float = 0.0, directions: tuple[Direction, ...] = BOTH) -> None:
        self._update(directions, latency_s=latency_s, jitter_s=jitter_s)

    def set_slicer(self, slice_bytes: int | None, delay_s: float = 0.0,
                   directions: tuple[Direction, ...] = BOTH) -> None:
        self._update(directions, slice_bytes=slice_bytes, slice_delay_s=delay_s)

    def set_blackhole(self, on: bool = True) -> None:
        """Partition: keep accepting, forward nothing, swallow every byte. Healing closes the
        connections that lost bytes (their streams have holes) so peers reconnect cleanly."""
        self._blackhole = on
        self._call_in_loop(self._after_blackhole_change)

    def set_blocked_sources(self, hosts: Iterable[str]) -> None:
        """Blackhole the connections whose remote IP is in `hosts` (replacing the previous set; empty:
        none). New ones are accepted and swallowed; open ones from a newly blocked source stop
        carrying bytes both ways, as a partitioned WAN link does: no reset, no answer, so the sender
        learns of the partition only through its own timeouts. Unblocking a source closes, with an
        RST, its connections that lost bytes (their streams have holes), like healing a blackhole.

        A bad address raises ValueError naming it and changes nothing."""
        blocked = set()
        for host in hosts:
            try:
                blocked.add(_normalise_host(host))
            except ValueError:
                raise ValueError(f"blocked source {host!r} is not an IP address") from None
        self._blocked_sources = frozenset(blocked)
        self._call_in_loop(self._after_blackhole_change)

    @property
    def blocked_sources(self) -> frozenset[str]:
        return self._blocked_sources

    def stall(self, seconds: float) -> None:
        """Hold all data for `seconds`, then close every connection (toxiproxy's "timeout")."""
        if seconds < 0:
            raise ValueError(f"stall seconds must be >= 0, got {seconds}")
        self._stalled = True
        self._call_in_loop(lambda: self._arm_stall_timer(seconds))

    def reset(self, keep_resetting: bool = False) -> None:
        """RST every open connection now; with `keep_resetting`, also every new one until heal."""
        self._reset_new = keep_resetting
        self._call_in_loop(self._reset_all)

    def heal(self) -> None:
        """Remove every toxic: full speed, no latency, no slicer, no stall, no blackhole, no blocked
        sources, no resets."""
        for d in BOTH:
            self._shape[d] = Shape()
        self._reset_new = False
        self._stalled = False
        self._blackhole = False
        self._blocked_sources = frozenset()

        def in_loop() -> None:
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None
            self._after_blackhole_change()
            self._notify()

        self._call_in_loop(in_loop)

    @property
    def blackholed(self) -> bool:
        return self._blackhole

    @property
    def stalled(self) -> bool:
        return self._stalled

    def _update(self, directions: tuple[Direction, ...], **changes: object) -> None:
        for d in directions:
            self._shape[d] = dataclasses.replace(self._shape[d], **changes)  # validates
        self._call_in_loop(self._notify)

    def _call_in_loop(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn()
        else:
            loop.call_soon_threadsafe(fn)

    def _notify(self) -> None:
        """Wake pumps waiting on a setting (stall lifted, blackhole healed, shape changed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _arm_stall_timer(self, seconds: float) -> None:
        assert self._loop is not None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        self._stall_timer = self._loop.call_later(seconds, self._end_stall)

    def _end_stall(self) -> None:
        self._stall_timer = None
        for conn in list(self._connections):
            conn.abort(rst=False)
        self._stalled = False
        self._notify()

    def _reset_all(self) -> None:
        for conn in list(self._connections):
            conn.abort(rst=True)
            self.stats.resets += 1

    def _cut(self, conn: _Connection) -> bool:
        """Whether this connection's bytes are swallowed now (blackhole, or its source blocked)."""
        return self._blackhole or conn.source in self._blocked_sources

    def _after_blackhole_change(self) -> None:
        """Close the connections that lost bytes and flow again; wake the pumps to re-check."""
        for conn in list(self._connections):
            if conn.swallowing and not self._cut(conn):
                conn.abort(rst=True)
                self.stats.resets += 1
            elif not conn.cut_counted and conn.source in self._blocked_sources:
                conn.cut_counted = True
                self.stats.connections_blocked += 1
        self._notify()

    # ---- data path ---------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections_accepted += 1
        conn = _Connection(reader, writer)
        self._connections.add(conn)
        self.stats.connections_open += 1
        try:
            if self._reset_new:
                self.stats.resets += 1
                conn.abort(rst=True)
                return
            # The work runs in its own task so toxics can cancel it without cancelling the
            # server's callback task (asyncio logs a cancelled callback task as an error).
            conn.task = asyncio.create_task(self._serve(conn))
            try:
                await conn.task
            except (ConnectionError, OSError):
                pass  # a peer went away or upstream is down: the client sees its socket close
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # we are being cancelled ourselves, not just the connection
        finally:
            self._connections.discard(conn)
            self.stats.connections_open -= 1
            for w in (conn.client_writer, conn.upstream_writer):
                if w is not None:
                    w.transport.abort()

    async def _serve(self, conn: _Connection) -> None:
        # A partition or stall at accept time: hold the client without dialling upstream.
        if conn.source in self._blocked_sources:
            conn.cut_counted = True
            self.stats.connections_blocked += 1
        while self._cut(conn) or self._stalled:
            if self._cut(conn):
                await self._swallow_until_healed(conn)
            else:
                await self._changed.wait()
        async with asyncio.timeout(UPSTREAM_CONNECT_TIMEOUT_S):
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        conn.upstream_writer = up_writer
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._pump(conn, Direction.UP, conn.client_reader, up_writer))
            tg.create_task(self._pump(conn, Direction.DOWN, up_reader, conn.client_writer))

    async def _swallow_until_healed(self, conn: _Connection) -> None:
        """Read and drop the client's bytes until heal (a connection that lost none may go on)."""
        reader = conn.client_reader
        while self._cut(conn):
            changed = asyncio.ensure_future(self._changed.wait())
            read = asyncio.ensure_future(reader.read(self.read_chunk_bytes))
            try:
                done, _ = await asyncio.wait({changed, read}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                if not read.done():
                    read.cancel()
            if read in done and not read.cancelled():
                data = read.result()
                if not data:
                    raise ConnectionResetError("client closed during blackhole")
                conn.swallowing = True
                self.stats.bytes_swallowed += len(data)

    async def _pump(
        self,
        conn: _Connection,
        direction: Direction,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Read -> charge bandwidth -> stamp due time (latency) -> queue -> write in order.

        Bandwidth is paid before the latency stamp (serialisation, then propagation), and the
        queue lets several chunks be in flight so latency does not cap throughput.
        """
        queue: deque[tuple[float, bytes]] = deque()
        queued_bytes = 0
        space = asyncio.Event()
        ready = asyncio.Event()
        bucket = self._buckets[direction]
        last_due = 0.0
        eof = False

        async def writer_side() -> None:
            nonlocal queued_bytes
            while True:
                while not queue:
                    if eof:
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    ready.clear()
                    await ready.wait()
                due, data = queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                queue.popleft()
                queued_bytes -= len(data)
                space.set()
                await self._deliver(conn, direction, data, writer)

        async def reader_side() -> None:
            nonlocal queued_bytes, last_due, eof
            while True:
                while queued_bytes >= self.max_in_flight_bytes:
                    space.clear()
                    await space.wait()
                data = await reader.read(self.read_chunk_bytes)
                if not data:
                    eof = True
                    ready.set()
                    return
                while self._stalled and not self._cut(conn):
                    await self._changed.wait()
                if self._cut(conn):
                    conn.swallowing = True
                    self.stats.bytes_swallowed += len(data)
                    continue
                shape = self._shape[direction]
                if shape.bandwidth_Bps is not None:
                    delay = bucket.delay_for(len(data), shape.bandwidth_Bps)
                    if delay > 0:
                        await asyncio.sleep(delay)
                due = time.monotonic() + self._one_way_delay(shape)
                last_due = max(last_due, due)  # jitter never reorders bytes
                queue.append((last_due, data))
                queued_bytes += len(data)
                ready.set()

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(reader_side())
                tg.create_task(writer_side())
        except* (ConnectionError, OSError):
            # One side broke: drop both sockets so the other pump sees EOF and ends too.
            for w in (conn.client_writer, conn.upstream_writer):
                if w is not None:
                    w.transport.abort()

    def _one_way_delay(self, shape: Shape) -> float:
        if shape.jitter_s == 0:
            return shape.latency_s
        return max(0.0, shape.latency_s + self._rng.uniform(-shape.jitter_s, shape.jitter_s))

    async def _deliver(self, conn: _Connection, direction: Direction, data: bytes,
                       writer: asyncio.StreamWriter) -> None:
        while self._stalled and not self._cut(conn):
            await self._changed.wait()
        if self._cut(conn):
            conn.swallowing = True
            self.stats.bytes_swallowed += len(data)
            return
        shape = self._shape[direction]
        if shape.slice_bytes is None:
            pieces = [data]
        else:
            pieces = [data[i : i + shape.slice_bytes] for i in range(0, len(data), shape.slice_bytes)]
        for i, piece in enumerate(pieces):
            if i and shape.slice_delay_s:
                await asyncio.sleep(shape.slice_delay_s)
            writer.write(piece)
            await writer.drain()
            if direction is Direction.UP:
                self.stats.bytes_up += len(piece)
            else:
                self.stats.bytes_down += len(piece)
