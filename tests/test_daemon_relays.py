"""The daemon's relayed-payload I/O (diloco_node/daemon/relays.py, relay_spool.py), in process: several
`RelayIO`s joined by a fake peer client, real asyncio with short waits. The decisions are the relay
plane's (tests/test_relay_plane.py); these tests check that the daemon performs them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import blake3
import pytest

from bootstrap import messages as coord
from bootstrap.entries import EntryKind, LogEntry
from bootstrap.relay_tree import plan_relay_tree
from diloco_node.config.manifest import ConfigError
from diloco_node.config.settings import load_config
from bootstrap.relay_plane import GIVE_UP_S
from diloco_node.clock import Clock, FakeClock, SystemClock
from diloco_node.daemon.relay_spool import HeldPayloads, SpooledPayload
from diloco_node.daemon.relays import RelayIO
from diloco_node.daemon.tasks import TaskSet
from diloco_node.transport import PeerRefused, PeerUnreachable
from wire import messages as wire
from wire.errors import RemoteProtocolError

from conftest import serve_peer_server

PAYLOAD = b"merged fragment delta " * 1000


class FakeNet:
    """Routes one node's sends to another node's RelayIO; `dead` members are unreachable."""

    def __init__(self) -> None:
        self.nodes: dict[str, RelayIO] = {}
        self.dead: set[str] = set()
        self.lost: set[str] = set()  # message kinds silently lost on the way
        self.sent: list[tuple[str, str, str]] = []  # (from, to, kind)
        self.in_flight: dict[str, int] = {}  # fetches being answered, per answering member
        self.most_in_flight = 0
        self.chunks = 0  # PayloadChunks delivered

    def client(self, me: str) -> FakeClient:
        return FakeClient(self, me)


class FakeClient:
    def __init__(self, net: FakeNet, me: str) -> None:
        self.net, self.me = net, me

    async def send(self, url: str, message: wire.Message, *, peer: str, deadline_s: float) -> list[wire.Message]:
        self.net.sent.append((self.me, peer, type(message).__name__))
        await asyncio.sleep(0)
        if peer in self.net.dead:
            raise PeerUnreachable(url, "connection refused")
        if type(message).__name__ in self.net.lost:
            raise PeerUnreachable(url, "deadline passed")
        node = self.net.nodes[peer]
        try:
            if isinstance(message, wire.PayloadPush):
                node.on_push(message, self.me)
                return []
            self.net.in_flight[peer] = self.net.in_flight.get(peer, 0) + 1
            self.net.most_in_flight = max(self.net.most_in_flight, self.net.in_flight[peer])
            try:
                await asyncio.sleep(0.01)  # a request takes time
                node.on_fetch(message, self.me)  # the bytes come back as a stream of their own
                return []
            finally:
                self.net.in_flight[peer] -= 1
        except RemoteProtocolError as error:
            raise PeerRefused(url, error.status_hint, str(error)) from None

    async def send_sequence(self, url: str, frames, *, peer: str, deadline_s: float) -> list[wire.Message]:
        """What PeerServer.on_sequence does with a body: the open, then each chunk, then finish."""
        iterator = aiter(frames)
        head = await anext(iterator)
        self.net.sent.append((self.me, peer, type(head).__name__))
        await asyncio.sleep(0)
        if peer in self.net.dead:
            raise PeerUnreachable(url, "connection refused")
        if type(head).__name__ in self.net.lost:
            raise PeerUnreachable(url, "deadline passed")
        consumer = None
        try:
            consumer = await self.net.nodes[peer].open_payload_stream(head, self.me)
            async for chunk in iterator:
                self.net.chunks += 1
                await consumer.part(chunk)
            done, consumer = consumer, None
            await done.finish()
            return []
        except RemoteProtocolError as error:
            raise PeerRefused(url, error.status_hint, str(error)) from None
        finally:
            if consumer is not None:
                await consumer.abort("the body broke off")


def cluster(root: Path, names: list[str], *, hold_s: float = 0.5, timeout_s: float = 0.05,
            chunk_bytes: int = 4096, clock: Clock | None = None, **options) -> tuple[FakeNet, TaskSet]:
    """RelayIOs named `names` (the first one the holder, fan-out 1), each spooling under root/<name>,
    streaming in chunks of `chunk_bytes` (PAYLOAD is several); the relay plane's wakes on `clock`."""
    net, tasks = FakeNet(), TaskSet()
    for name in names:
        net.nodes[name] = node = RelayIO(
            node_id=name, fanout=1 if name == names[0] else 0, client=net.client(name),
            url_of=lambda peer: f"http://{peer}", from_log=lambda index, epoch: None, tasks=tasks,
            clock=clock or SystemClock(), spool_dir=root / name, hold_s=hold_s, timeout_s=timeout_s, **options)
        node.chunk_bytes = chunk_bytes
        node.open_payload_stream = _opener(node)
    return net, tasks


def _opener(node: RelayIO):
    async def open_payload_stream(head: wire.PayloadOpen, sender: str):
        return node.open_stream(head, sender)
    return open_payload_stream


async def completed_payloads(node: RelayIO, append: wire.LogAppend) -> list[bytes]:
    """Each entry's payload bytes in the prefix `complete` gives (spooled ones read from their file)."""
    prefix, payloads = await node.complete(append)
    out = []
    for entry in prefix.entries:
        payload = payloads.get(entry.index, entry.payload)
        out.append(payload if isinstance(payload, bytes) else payload.read())
    return out


def holders_append() -> coord.AppendEntries:
    entries = (LogEntry(3, 5, EntryKind.NOOP), LogEntry(3, 6, EntryKind.OUTER_COMMIT, PAYLOAD, fragment=0, round=1))
    return coord.AppendEntries(3, "a", 4, 3, entries, 4, sent_at=0.0)


async def settle_network() -> None:
    """Let pushes run (spool writes and reads go through worker threads: real time, not just turns)."""
    for _ in range(40):
        await asyncio.sleep(0.005)


def test_relay_fanout_is_validated_and_defaults_off():
    assert load_config(None, {}, {}).node.relay_fanout == 0
    assert load_config(None, {}, {"relay_fanout": "2"}).node.relay_fanout == 2
    for bad in ("-1", "17"):
        with pytest.raises(ConfigError, match=r"relay_fanout = .*: must be in \[0, 16\]"):
            load_config(None, {}, {"relay_fanout": bad})


def test_the_holder_sends_the_bytes_once_and_they_travel_down_the_chain(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b", "c", "d"])
        a = net.nodes["a"]
        tree = plan_relay_tree("a", ["b", "c", "d"], 1)  # a -> b -> c -> d
        out = a.relayed_append(holders_append(), tree, leader_commit=4)
        again = a.relayed_append(holders_append(), tree, leader_commit=4)  # resent to another follower
        await settle_network()
        # The metadata names the bytes; the noop travels as it is.
        assert not out.entries[0].relayed and out.entries[1].relayed
        assert out.entries[1].payload_digest == blake3.blake3(PAYLOAD).digest() == again.entries[1].payload_digest
        assert out.entries[1].payload == b"" and out.entries[1].payload_size == len(PAYLOAD)
        pushes = [(src, dst) for src, dst, kind in net.sent if kind == "PayloadOpen"]
        assert pushes == [("a", "b"), ("b", "c"), ("c", "d")]
        assert net.chunks == 3 * 6  # 22,000 bytes in chunks of 4,096, three times
        assert await completed_payloads(net.nodes["d"], out) == [b"", PAYLOAD]
        assert a.counts["pushed"] == 1 and net.nodes["b"].counts["forwarded"] == 1
        await tasks.close()

    asyncio.run(scenario())


def test_a_follower_under_a_dead_relay_fetches_from_the_holder_within_its_hold(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b", "c"], hold_s=1.0, timeout_s=0.05)
        net.dead.add("b")  # the only relay between a and c
        tree = plan_relay_tree("a", ["b", "c"], 1)
        out = net.nodes["a"].relayed_append(holders_append(), tree, leader_commit=4)
        net.nodes["c"].follower.learn_tree(tree)  # as learned from an earlier push
        started = asyncio.get_running_loop().time()
        payloads = await completed_payloads(net.nodes["c"], out)
        waited = asyncio.get_running_loop().time() - started
        assert payloads == [b"", PAYLOAD]
        fetches = [dst for src, dst, kind in net.sent if src == "c" and kind == "PayloadFetch"]
        assert fetches[:2] == ["b", "a"]  # parent first, then the holder
        assert waited < 1.0  # well within the hold: two relay timeouts and a fetch
        await tasks.close()

    asyncio.run(scenario())


def chain_whose_first_push_is_lost(root: Path, *, timeout_s: float, leader_commit: int = 4, clock: Clock | None = None):
    """a -> b -> c, both knowing the tree; the holder's push of the commit to b was lost. Returns
    (net, tasks, the append every follower got)."""
    net, tasks = cluster(root, ["a", "b", "c"], hold_s=3.0, timeout_s=timeout_s, clock=clock)
    tree = plan_relay_tree("a", ["b", "c"], 1)
    for name in ("b", "c"):
        net.nodes[name].follower.learn_tree(tree)  # as learned from an earlier push
    net.lost.add("PayloadOpen")
    return net, tasks, net.nodes["a"].relayed_append(holders_append(), tree, leader_commit=leader_commit)


def test_a_relay_still_awaiting_the_bytes_promises_them_and_its_child_does_not_climb_to_the_holder(tmp_path):
    async def scenario() -> None:
        net, tasks, out = chain_whose_first_push_is_lost(tmp_path, timeout_s=0.2)
        await settle_network()
        net.lost.clear()
        a, b, c = (net.nodes[name] for name in "abc")
        b.follower.timeout_s = 30.0  # b awaits the bytes and has not fetched them yet when c asks
        b_done = asyncio.ensure_future(completed_payloads(b, out))
        c_done = asyncio.ensure_future(completed_payloads(c, out))
        for _ in range(500):  # c's first fetch leaves after one timeout
            if b.counts["promised"]:
                break
            await asyncio.sleep(0.01)
        assert b.counts["promised"] == 1, f"b made no promise; fetches so far: {net.sent}"
        a.on_fetch(wire.PayloadFetch(out.entries[1].payload_digest), "b")  # b's bytes arrive now
        assert await c_done == [b"", PAYLOAD] and await b_done == [b"", PAYLOAD]
        fetches = [(src, dst) for src, dst, kind in net.sent if kind == "PayloadFetch"]
        assert fetches == [("c", "b")]  # c waited on b's promise instead of climbing to a
        assert b.counts["promised"] == 1 and b.counts["served"] == 1
        assert a.counts["served"] == 1  # to b only: the holder sent c no copy
        await tasks.close()

    asyncio.run(scenario())


def test_a_relay_catching_up_on_committed_entries_promises_nothing_and_its_child_climbs_on(tmp_path):
    async def scenario() -> None:
        net, tasks, out = chain_whose_first_push_is_lost(tmp_path, timeout_s=0.05, leader_commit=6)  # 6 committed
        await settle_network()
        b = net.nodes["b"]
        b.url_of = lambda peer: None  # b wants the bytes too, catching up, but cannot reach anyone
        b_waiting = asyncio.ensure_future(b.complete(out))
        await asyncio.sleep(0)
        net.lost.discard("PayloadOpen")
        assert await completed_payloads(net.nodes["c"], out) == [b"", PAYLOAD]
        assert b.counts["promised"] == 0
        assert ("c", "a", "PayloadFetch") in net.sent  # c climbed on to the holder at its usual pace
        b_waiting.cancel()
        await tasks.close()

    asyncio.run(scenario())


def test_a_relay_that_promised_and_never_got_the_bytes_is_routed_around_after_a_bounded_wait(tmp_path):
    async def scenario() -> None:
        net, tasks, out = chain_whose_first_push_is_lost(tmp_path, timeout_s=0.05)
        await settle_network()
        b = net.nodes["b"]
        b.follower.timeout_s = 10.0  # b awaits the bytes but never fetches them in this test
        b_waiting = asyncio.ensure_future(b.complete(out))
        await asyncio.sleep(0)
        net.lost.clear()
        started = asyncio.get_running_loop().time()
        c_payloads = await completed_payloads(net.nodes["c"], out)
        waited = asyncio.get_running_loop().time() - started
        assert c_payloads == [b"", PAYLOAD]
        fetches = [(src, dst) for src, dst, kind in net.sent if kind == "PayloadFetch"]
        assert fetches == [("c", "b"), ("c", "a")]  # the promise ran out, then the holder
        # One timeout, then the promise (4 timeouts + 22 kB at 16 MiB/s), then one more timeout.
        assert 0.25 <= waited < 2.0
        b_waiting.cancel()
        await tasks.close()

    asyncio.run(scenario())


def test_without_the_bytes_the_append_is_answered_with_the_prefix_it_can_take(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b"], hold_s=0.15, timeout_s=0.05)
        net.lost.update({"PayloadOpen", "PayloadFetch"})  # the holder's push is lost, and every fetch
        out = net.nodes["a"].relayed_append(holders_append(), plan_relay_tree("a", ["b"], 1), leader_commit=4)
        started = asyncio.get_running_loop().time()
        completed, _ = await net.nodes["b"].complete(out)
        assert asyncio.get_running_loop().time() - started >= 0.14  # it held the append for its hold time
        assert [e.index for e in completed.entries] == [5]  # the noop; the commit waits for its bytes
        assert completed.leader_commit == 4 and completed.prev_index == 4
        await tasks.close()

    asyncio.run(scenario())


def test_altered_bytes_are_refused_kept_nowhere_and_not_forwarded(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b", "c"])
        tree = plan_relay_tree("a", ["b", "c"], 1)
        digest = blake3.blake3(PAYLOAD).digest()
        forged = wire.PayloadPush(digest, "a", dict(tree.parent), PAYLOAD[:-1] + b"!")
        with pytest.raises(RemoteProtocolError, match="do not have BLAKE3 digest") as refused:
            net.nodes["b"].on_push(forged, "a")
        assert refused.value.status_hint == 400
        await settle_network()
        assert digest not in net.nodes["b"].store and net.sent == []
        with pytest.raises(RemoteProtocolError, match="holds no payload") as missing:
            net.nodes["b"].on_fetch(wire.PayloadFetch(digest), "c")
        assert missing.value.status_hint == 404
        await tasks.close()

    asyncio.run(scenario())


def test_held_payloads_are_bounded_and_read_from_the_log_once_settled():
    log = {(7, 2): b"seven"}
    store = HeldPayloads(lambda index, epoch: log.get((index, epoch)), max_items=2, max_bytes=100)
    digests = [blake3.blake3(bytes([i])).digest() for i in range(3)]
    for i, digest in enumerate(digests):
        store.put(digest, bytes([i]) * 10)
    assert digests[0] not in store and store.get(digests[2]) == b"\x02" * 10  # the oldest went first
    store.settle(digests[2], 7, 2)
    assert store.held_bytes == 10 and store.get(digests[2]) == b"seven"  # now served from the log
    store.settle(digests[1], 8, 2)  # not in the log: kept in memory
    assert store.get(digests[1]) == b"\x01" * 10


def test_once_the_entry_is_in_the_log_its_bytes_leave_memory_and_are_served_from_the_log(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b", "c"])
        log: dict[tuple[int, int], bytes] = {}
        b = net.nodes["b"]
        b.store = b.relay.store = b.follower.store = HeldPayloads(lambda index, epoch: log.get((index, epoch)))
        b._from_log = lambda index, epoch: log.get((index, epoch))
        out = net.nodes["a"].relayed_append(holders_append(), plan_relay_tree("a", ["b"], 1), leader_commit=4)
        await settle_network()
        digest = out.entries[1].payload_digest
        spooled = b.store.held(digest)
        assert isinstance(spooled, SpooledPayload) and spooled.path.exists() and b.store.held_bytes == len(PAYLOAD)
        log[(6, 3)] = (await completed_payloads(b, out))[1]  # what the core appended
        b.settle(out)  # the append as it came: relayed entries name their digests
        assert b.store.held_bytes == 0 and not spooled.path.exists()  # the spool file went
        assert spooled.read() == PAYLOAD  # a reader holding the old reference now reads the log
        b.on_fetch(wire.PayloadFetch(digest), "c")
        await settle_network()
        assert ("b", "c", "PayloadOpen") in net.sent and net.nodes["c"].store.get(digest).read() == PAYLOAD
        await tasks.close()

    asyncio.run(scenario())


def test_a_catching_up_follower_fetches_committed_payloads_at_once_one_at_a_time_per_source(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b"], hold_s=0.4, timeout_s=0.3)
        payloads = [bytes([i]) * 5000 for i in range(1, 5)]
        entries = tuple(LogEntry(2, 10 + i, EntryKind.OUTER_COMMIT, p, fragment=0, round=i)
                        for i, p in enumerate(payloads))
        net.lost.add("PayloadOpen")  # b was still starting when these were pushed
        out = net.nodes["a"].relayed_append(coord.AppendEntries(2, "a", 9, 2, entries, 13, sent_at=0.0),
                                            plan_relay_tree("a", ["b"], 1), leader_commit=13)
        started = asyncio.get_running_loop().time()
        net.lost.discard("PayloadOpen")  # from here, fetch answers stream back
        completed = await completed_payloads(net.nodes["b"], out)
        # Committed (index <= leader_commit): fetched without waiting a relay timeout (0.3 s) first.
        assert asyncio.get_running_loop().time() - started < 0.3
        assert completed == payloads
        assert net.most_in_flight == 1  # one fetch at a time from the holder: never a flood of streams
        await tasks.close()

    asyncio.run(scenario())


def test_an_entry_whose_payload_is_in_the_log_file_is_hashed_once_off_the_loop_and_streamed_in_pieces(tmp_path):
    from bootstrap.entries import StoredPayload

    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b"])
        reads: list[int] = []  # piece sizes read from "log.bin"

        def pieces(piece_bytes: int):
            for offset in range(0, len(PAYLOAD), piece_bytes):
                reads.append(min(piece_bytes, len(PAYLOAD) - offset))
                yield PAYLOAD[offset:offset + piece_bytes]

        stored = StoredPayload(len(PAYLOAD), lambda: pytest.fail("read whole"), pieces=pieces)
        entry = LogEntry(3, 6, EntryKind.OUTER_COMMIT, stored, fragment=0, round=1)
        message = coord.AppendEntries(3, "a", 5, 3, (entry,), 4, sent_at=0.0)
        tree = plan_relay_tree("a", ["b"], 1)
        a = net.nodes["a"]
        await a.prepare(message.entries)  # the holder hashes it in a worker thread, once
        assert reads == [len(PAYLOAD)]  # one 4 MiB piece at most
        out = a.relayed_append(message, tree, leader_commit=4)
        a.relayed_append(message, tree, leader_commit=4)  # to another follower: no new read, no new push
        await settle_network()
        assert out.entries[0].payload_digest == blake3.blake3(PAYLOAD).digest()
        # Hashed once, then read once more for the one copy pushed, a chunk (4096 bytes) at a time.
        assert reads[1:] == [4096] * 5 + [len(PAYLOAD) - 5 * 4096]
        assert await completed_payloads(net.nodes["b"], out) == [PAYLOAD]
        await tasks.close()

    asyncio.run(scenario())


def spool_files(node: RelayIO) -> list[str]:
    return sorted(path.name for path in node.spool_dir.iterdir())


async def stream_frames(head: wire.PayloadOpen, payload: bytes, chunk_bytes: int):
    yield head
    for offset in range(0, len(payload), chunk_bytes):
        yield wire.PayloadChunk(head.stream, offset, payload[offset:offset + chunk_bytes])


def test_streamed_bytes_are_spooled_to_a_file_and_forwarded_chunk_by_chunk_from_it(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b", "c"])
        out = net.nodes["a"].relayed_append(holders_append(), plan_relay_tree("a", ["b", "c"], 1), leader_commit=4)
        await settle_network()
        digest = out.entries[1].payload_digest
        for name in ("b", "c"):
            spooled = net.nodes[name].store.held(digest)
            # On disk under the node's spool directory, not in memory; b read it back to forward it.
            assert isinstance(spooled, SpooledPayload) and spooled.path.parent == tmp_path / name
            assert spooled.path.read_bytes() == PAYLOAD and spool_files(net.nodes[name]) == [spooled.path.name]
        assert net.nodes["b"].counts["forwarded"] == 1 and net.nodes["b"].counts["forwarded_bytes"] == len(PAYLOAD)
        assert net.nodes["a"].counts["pushed_bytes"] == len(PAYLOAD)
        await tasks.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("damage, status, problem", [
    (lambda p: p[:-1] + b"!", 400, "do not have BLAKE3 digest"),  # altered by a relay
    (lambda p: p[:16384], 400, "ended after 16,384 of 22,000 bytes"),  # cut short after whole chunks
])
def test_a_stream_with_altered_or_missing_bytes_is_refused_and_its_spool_file_deleted(tmp_path, damage, status,
                                                                                      problem):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b", "c"])
        b = net.nodes["b"]
        tree = plan_relay_tree("a", ["b", "c"], 1)
        digest = blake3.blake3(PAYLOAD).digest()
        head = wire.PayloadOpen(b"s" * 16, digest, len(PAYLOAD), 4096, "a", dict(tree.parent))
        with pytest.raises(PeerRefused, match=problem) as refused:
            await net.client("a").send_sequence("http://b", stream_frames(head, damage(PAYLOAD), 4096),
                                                peer="b", deadline_s=1.0)
        assert refused.value.status == status
        await settle_network()
        assert digest not in b.store and spool_files(b) == [] and b.counts["refused"] == 1
        assert not [sent for sent in net.sent if sent[0] == "b"]  # nothing forwarded
        await tasks.close()

    asyncio.run(scenario())


def test_a_body_that_breaks_off_leaves_no_spool_file(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b"])
        b = net.nodes["b"]
        head = wire.PayloadOpen(b"s" * 16, blake3.blake3(PAYLOAD).digest(), len(PAYLOAD), 4096, "", {})

        async def broken():
            async for frame in stream_frames(head, PAYLOAD[:8192], 4096):
                yield frame
            raise ConnectionResetError("the link went down")

        with pytest.raises(ConnectionResetError):
            await net.client("a").send_sequence("http://b", broken(), peer="b", deadline_s=1.0)
        assert spool_files(b) == [] and len(b.store) == 0 and b.follower.incoming == {}
        await tasks.close()

    asyncio.run(scenario())


def test_a_declared_size_over_the_runs_bound_is_refused_before_any_byte_is_spooled(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b"], max_payload_bytes=len(PAYLOAD))
        b = net.nodes["b"]
        for size, refused in ((len(PAYLOAD) + 1, True), (len(PAYLOAD), False)):
            head = wire.PayloadOpen(b"s" * 16, blake3.blake3(PAYLOAD).digest(), size, 4096, "", {})
            if refused:
                with pytest.raises(RemoteProtocolError, match="declares 22,001 bytes, more than the 22,000") as error:
                    b.open_stream(head, "a")
                assert error.value.status_hint == 413 and spool_files(b) == []
            else:
                assert b.open_stream(head, "a").max_remaining_bytes == len(PAYLOAD)
        await tasks.close()

    asyncio.run(scenario())


def test_relays_off_a_big_payload_goes_by_digest_to_every_member_in_a_star_and_small_ones_inline(tmp_path):
    from diloco_node.daemon.relays import star_tree

    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b", "c", "d"], inline_max_bytes=len(PAYLOAD) - 1)
        a = net.nodes["a"]
        a.fanout = 0  # relays off: the holder is every member's parent
        small = LogEntry(3, 7, EntryKind.OUTER_COMMIT, b"small delta", fragment=1, round=1)
        message = coord.AppendEntries(3, "a", 4, 3, (*holders_append().entries, small), 4, sent_at=0.0)
        assert a.relayed_entries(message.entries) == {6}
        out = a.relayed_append(message, star_tree("a", {"b", "c", "d"}), leader_commit=4)
        assert [e.relayed for e in out.entries] == [False, True, False] and out.entries[2].payload == b"small delta"
        await settle_network()
        pushes = sorted((src, dst) for src, dst, kind in net.sent if kind == "PayloadOpen")
        assert pushes == [("a", "b"), ("a", "c"), ("a", "d")]  # nobody forwards: they got no tree
        for name in ("b", "c", "d"):
            assert await completed_payloads(net.nodes[name], out) == [b"", PAYLOAD, b"small delta"]
        assert a.counts["pushed"] == 3 and a.counts["pushed_bytes"] == 3 * len(PAYLOAD)
        await tasks.close()

    asyncio.run(scenario())


def test_a_spooled_entry_is_written_to_the_log_file_piece_by_piece_and_then_read_from_there(tmp_path):
    from bootstrap.coordinator_node import PersistentState
    from bootstrap.election import ElectionState
    from bootstrap.entries import StoredPayload
    from bootstrap.replog import LogStore
    from diloco_node.daemon import coordination_store
    from diloco_node.daemon.coordination_store import INITIAL_SNAPSHOT, CoordinationStore

    payload = bytes(range(256)) * 40_000  # ~10 MiB: several write pieces
    spool = tmp_path / "spool.part"
    spool.write_bytes(payload)
    spooled = SpooledPayload(spool, len(payload), blake3.blake3(payload).digest())
    pieces: list[int] = []

    def counted(piece_bytes: int):
        for piece in spooled.pieces(piece_bytes):
            pieces.append(len(piece))
            yield piece

    stored = StoredPayload(len(payload), spooled.read, pieces=counted, transient=True)
    store = CoordinationStore(tmp_path / "coordination")
    entries = [LogEntry(1, 1, EntryKind.NOOP), LogEntry(1, 2, EntryKind.OUTER_COMMIT, stored, fragment=0, round=1)]
    state = PersistentState(ElectionState(1, None), LogStore(INITIAL_SNAPSHOT, entries))
    store.sync(state)
    # CRC, then copy
    assert pieces and max(pieces) <= coordination_store.WRITE_PIECE_BYTES and sum(pieces) == 2 * len(payload)
    kept = state.log.entries[-1].payload
    assert isinstance(kept, StoredPayload) and not kept.transient  # now a reference into log.bin
    spool.unlink()
    assert store.read_payload(2, 1) == payload == kept.read()
    store.close()
    reloaded = CoordinationStore(tmp_path / "coordination")
    assert reloaded.load_persistent().log.entries[-1].payload_bytes() == payload  # a valid record, CRC and all
    reloaded.close()


def test_relays_off_an_append_of_many_inline_payloads_sends_the_ones_past_its_inline_budget_by_digest(
        tmp_path, monkeypatch):
    from diloco_node.daemon import relays

    monkeypatch.setattr(relays, "INLINE_APPEND_MAX_BYTES", 3 * 1000)
    holder = RelayIO(node_id="a", fanout=0, client=None, url_of=lambda peer: None, from_log=lambda i, e: None,
                     tasks=None, clock=SystemClock(), spool_dir=tmp_path, inline_max_bytes=1000)
    catch_up = tuple(LogEntry(3, 10 + i, EntryKind.OUTER_COMMIT, b"x" * 1000) for i in range(16))
    # A lagging follower gets 16 entries at once: three fit the append's budget, the rest go by digest.
    assert holder.relayed_entries(catch_up) == {entry.index for entry in catch_up[3:]}
    assert holder.relayed_entries(catch_up[:3] + (LogEntry(3, 13, EntryKind.NOOP),)) == set()


def test_bytes_already_in_the_log_are_referred_to_not_read_until_used(tmp_path):
    from bootstrap.entries import StoredPayload

    reads: list[int] = []
    in_log = StoredPayload(5, lambda: reads.append(1) or b"seven")
    log = {(7, 2): in_log}
    store = HeldPayloads(lambda index, epoch: log.get((index, epoch)))
    digest = blake3.blake3(b"seven").digest()
    store.put(digest, b"seven")
    store.settle(digest, 7, 2)
    assert digest in store and store.get(digest) is in_log and reads == []  # a reference, not read
    del log[(7, 2)]  # compacted away since
    assert digest not in store and store.get(digest) is None


def test_a_payload_from_the_log_given_to_the_core_again_is_written_into_its_own_record(tmp_path):
    from bootstrap.entries import StoredPayload
    from diloco_node.daemon.relay_spool import entry_payload

    logged = StoredPayload(5, lambda: b"seven")
    again = entry_payload(logged)
    assert again.transient and again.read() == b"seven" and not logged.transient
    assert entry_payload(b"bytes") == b"bytes"


def test_a_stream_of_bytes_already_here_is_declined_before_its_first_chunk(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b"])
        out = net.nodes["a"].relayed_append(holders_append(), plan_relay_tree("a", ["b"], 1), leader_commit=4)
        await settle_network()
        b = net.nodes["b"]
        digest = out.entries[1].payload_digest
        assert digest in b.store and net.chunks == 6
        head = wire.PayloadOpen(b"t" * 16, digest, len(PAYLOAD), 4096, "", {})
        with pytest.raises(PeerRefused, match="already holds payload") as declined:
            await net.client("a").send_sequence("http://b", stream_frames(head, PAYLOAD, 4096), peer="b",
                                                deadline_s=1.0)
        assert declined.value.status == 409 and net.chunks == 6  # not one more chunk went
        assert b.counts["refused"] == 0 and spool_files(b) == [b.store.held(digest).path.name]
        await tasks.close()

    asyncio.run(scenario())


def test_over_real_http_a_payload_streams_into_the_spool_and_a_fetch_streams_back(tmp_path):
    """The transport's on_sequence feeds open_stream frame by frame: loopback HTTP, two nodes."""
    from diloco_node.transport import PeerClient, PeerServer
    from wire.auth import AuthContext, FrameVerifier, derive_frame_key

    run, key = "run-relays", derive_frame_key(b"r" * 32)
    payload = bytes(range(256)) * 1000  # 256,000 bytes: 63 chunks of 4,096 and a short one

    async def scenario() -> None:
        tasks = TaskSet()
        urls: dict[str, str] = {}
        nodes: dict[str, RelayIO] = {}
        runners = []
        clients = []
        for name in ("a", "b"):
            client = PeerClient(AuthContext(run, name, key), FrameVerifier(run, key, node_id=name))
            await client.start()
            clients.append(client)
            node = nodes[name] = RelayIO(node_id=name, fanout=1, client=client, url_of=urls.get,
                                         from_log=lambda index, epoch: None, tasks=tasks, clock=SystemClock(),
                                         spool_dir=tmp_path / name, max_payload_bytes=len(payload))
            node.chunk_bytes = 4096
            server = PeerServer(AuthContext(run, name, key), FrameVerifier(run, key, node_id=name))

            async def opener(head, peer, node=node):
                return node.open_stream(head, peer.node_id)

            async def fetch(message, peer, node=node):
                node.on_fetch(message, peer.node_id)

            server.on_sequence(wire.MessageKind.PAYLOAD_OPEN, wire.MessageKind.PAYLOAD_CHUNK, opener)
            server.on_message(wire.MessageKind.PAYLOAD_FETCH, fetch)
            runner, port = await serve_peer_server(server)
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{port}"
        try:
            a, b = nodes["a"], nodes["b"]
            entry = LogEntry(3, 6, EntryKind.OUTER_COMMIT, payload, fragment=0, round=1)
            out = a.relayed_append(coord.AppendEntries(3, "a", 5, 3, (entry,), 4, sent_at=0.0),
                                   plan_relay_tree("a", ["b"], 1), leader_commit=4)
            digest = out.entries[0].payload_digest
            for _ in range(200):
                if digest in b.store:
                    break
                await asyncio.sleep(0.01)
            spooled = b.store.held(digest)
            assert isinstance(spooled, SpooledPayload) and spooled.read() == payload
            assert a.counts["pushed_bytes"] == len(payload)
            # b serves a fetch: here a itself asks, having dropped its own copy (its log holds none).
            a.store.clear()
            assert digest not in a.store
            await a._fetch("b", digest)
            for _ in range(200):
                if digest in a.store:
                    break
                await asyncio.sleep(0.01)
            assert a.store.held(digest).read() == payload and b.counts["served"] == 1
            # A declaration over b's bound never reaches the spool: refused by the open alone.
            head = wire.PayloadOpen(b"x" * 16, digest, len(payload) + 1, 4096, "", {})
            with pytest.raises(PeerRefused, match="more than the 256,000 bytes") as refused:
                await clients[0].send_sequence(urls["b"], stream_frames(head, payload + b"!", 4096), peer="b",
                                               deadline_s=5.0)
            assert refused.value.status == 413 and len(spool_files(b)) == 1
        finally:
            await tasks.close()
            for client in clients:
                await client.close()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(scenario())


def test_the_planes_wakes_run_on_the_injected_clock_and_its_fetches_go_out_as_payload_fetches(tmp_path):
    async def scenario() -> None:
        clock = FakeClock()
        net, tasks, out = chain_whose_first_push_is_lost(tmp_path, timeout_s=0.5, clock=clock)
        await settle_network()
        c = net.nodes["c"]
        waiting = asyncio.ensure_future(completed_payloads(c, out))
        await asyncio.sleep(0.05)  # real time passes; the relay clock does not: no wake, no fetch
        assert [sent for sent in net.sent if sent[2] == "PayloadFetch"] == []
        clock.advance(0.5)  # one relay timeout on the injected clock: c asks its parent
        await settle_network()
        assert ("c", "b", "PayloadFetch") in net.sent
        waiting.cancel()
        await tasks.close()

    asyncio.run(scenario())


def test_a_declined_fetch_is_answered_404_with_the_planes_reason_and_decisions_reach_status(tmp_path):
    async def scenario() -> None:
        net, tasks, out = chain_whose_first_push_is_lost(tmp_path, timeout_s=0.05, leader_commit=6)
        await settle_network()
        net.lost.clear()
        c = net.nodes["c"]
        assert await completed_payloads(c, out) == [b"", PAYLOAD]  # b declined (it awaits nothing), a served
        fetches = [(src, dst) for src, dst, kind in net.sent if kind == "PayloadFetch"]
        assert fetches[:2] == [("c", "b"), ("c", "a")]
        with pytest.raises(RemoteProtocolError, match="holds no payload .*: not held here, and not on its way") as error:
            net.nodes["b"].on_fetch(wire.PayloadFetch(out.entries[1].payload_digest), "c")
        assert error.value.status_hint == 404
        decisions = c.status()["decisions"]
        assert decisions[0].endswith("release " + out.entries[1].payload_digest.hex()[:8] + ": the bytes are here")
        assert any("fetch" in line and "from b: committed before it reached us (catching up)" in line
                   for line in decisions)
        assert any("b declined our fetch" in line for line in decisions)
        assert any("decline" in line and "to c: not held here" in line for line in net.nodes["b"].status()["decisions"])
        await tasks.close()

    asyncio.run(scenario())


def test_a_want_given_up_by_the_plane_ends_the_hold_at_once(tmp_path):
    async def scenario() -> None:
        clock = FakeClock()
        net, tasks = cluster(tmp_path, ["a", "b"], hold_s=30.0, timeout_s=1.0, clock=clock)
        net.lost.update({"PayloadOpen", "PayloadFetch"})  # nothing ever arrives
        out = net.nodes["a"].relayed_append(holders_append(), plan_relay_tree("a", ["b"], 1), leader_commit=4)
        b = net.nodes["b"]
        started = asyncio.get_running_loop().time()
        held = asyncio.ensure_future(b.complete(out))
        await asyncio.sleep(0.01)
        for _ in range(int(GIVE_UP_S) + 2):  # the relay clock runs past the give-up; no append names them
            clock.advance(1.0)
            await asyncio.sleep(0)
        completed, _ = await asyncio.wait_for(held, 5.0)
        assert asyncio.get_running_loop().time() - started < 5.0  # long before its 30 s hold
        assert [e.index for e in completed.entries] == [5] and b.follower.wants == {}
        assert "given up" in b.status()["decisions"][0]
        await tasks.close()

    asyncio.run(scenario())
