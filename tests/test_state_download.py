"""The global-state download: several peers at once, pipelined chunks, restarts when a fragment
moves on (the benchmark's real processes: tests/integration/test_state_download_processes.py)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter

import numpy as np
import pytest

from concurrent.futures import ThreadPoolExecutor

from diloco_node.clock import SystemClock
from diloco_node.config.manifest import OuterOptimizer
from diloco_node.daemon import join
from diloco_node.daemon.join import FragmentDownload, JoinRefused
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.replica import CommitPayload, Replica
from bootstrap.entries import EntryKind, LogEntry
from wire import messages as wire
from wire.codecs import decode_named, encode_named
from diloco_node.transport import PeerUnreachable, StreamedReply
from wire.auth import AuthContext, FrameVerifier, derive_frame_key
from wire.frames import FrameDecoder, encode_frame

# The daemon hashes and checks downloaded fragments in its codec pool (pools.py).
POOL_AND_CLOCK = {"executor": ThreadPoolExecutor(2, thread_name_prefix="codec-test"), "clock": SystemClock()}

CHUNK = 1024


def _replica(seed: int = 0) -> Replica:
    rng = np.random.default_rng(seed)
    initial = {f"layer{i}/w": rng.normal(size=(32, 32)).astype(np.float32) for i in range(6)}
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 6, 6, 1)
    return Replica(plan, initial, OuterOptimizer())


def _commit(replica: Replica, index: int, p: int) -> LogEntry:
    names = replica.plan.fragments[p].names
    encoded = encode_named({n: np.full(replica.state.fragment_params(p)[n].shape, 0.01, np.float32) for n in names},
                           "int8")
    payload = CommitPayload(encoded, ("a",), (1.0,)).encode()
    return LogEntry(1, index, EntryKind.OUTER_COMMIT, payload, fragment=p, round=replica.state.round(p) + 1,
                    digest=replica.digest_after(p, decode_named(encoded)))


_KEY = derive_frame_key(b"test-secret-of-the-state-download-tests")


def streamed(message: wire.Message, piece_bytes: int = 700, spoil=lambda frame: frame) -> StreamedReply:
    """`message` as PeerClient.send_for_stream returns it: its frame encoded (then `spoil`ed: what
    a faulty peer or link delivers), cut into pieces as a socket delivers them, and its header
    authenticated by the real decoder."""
    frame = spoil(encode_frame(message, AuthContext("run", "server", _KEY), now_unix=time.time(),
                               nonce=os.urandom(16), to="joiner"))
    pieces = [frame[at:at + piece_bytes] for at in range(0, len(frame), piece_bytes)]
    decoder = FrameDecoder(FrameVerifier("run", _KEY, node_id="joiner"), stream_kinds=(message.KIND,))
    return StreamedReply.read(pieces, decoder, message.KIND, time.time())


class _CountingPeers:
    """A stand-in PeerClient: every URL serves `source`; records who served what and how much was in flight."""

    def __init__(self, source: Replica) -> None:
        self.source = source
        self.spoil = lambda url, request, frame: frame  # what a faulty peer does to a reply's frame
        self.in_flight: Counter[str] = Counter()
        self.most_in_flight: Counter[str] = Counter()
        self.fragments_served: dict[str, set[int]] = {}
        self.before_reply = None  # optional hook(url, request), may raise or change `source`

    async def send_for_stream(self, url, request, **_):
        self.in_flight[url] += 1
        self.most_in_flight[url] = max(self.most_in_flight[url], self.in_flight[url])
        try:
            await asyncio.sleep(0.001)  # a reply takes a moment, so requests overlap
            if self.before_reply is not None:
                self.before_reply(url, request)
            self.fragments_served.setdefault(url, set()).add(request.fragment)
            _, data, digest = self.source.fragment_bytes(request.fragment)
            part = data[request.offset:request.offset + request.max_length]
            return streamed(wire.SnapshotChunk(request.fragment, 5, request.offset, len(data), digest, part),
                            spoil=lambda frame: self.spoil(url, request, frame))
        finally:
            self.in_flight[url] -= 1


PEERS = ["http://a", "http://b", "http://c", "http://d"]


async def test_three_peers_serve_different_fragments_with_chunks_pipelined() -> None:
    source, target = _replica(), _replica(seed=1)
    client = _CountingPeers(source)
    download = FragmentDownload(client, target, lambda: PEERS, chunk_bytes=CHUNK, **POOL_AND_CLOCK)
    await download.run()
    assert target.state.digest() == source.state.digest()
    # The first three peers shared the six fragments; the fourth was not needed.
    assert set(client.fragments_served) == set(PEERS[:join.DOWNLOAD_PEERS])
    assert sorted(p for served in client.fragments_served.values() for p in served) == list(range(6))
    # Each fragment is several chunks long, so every busy peer had a full window outstanding.
    assert len(source.fragment_bytes(0)[1]) > join.CHUNKS_IN_FLIGHT * CHUNK
    assert all(client.most_in_flight[url] == join.CHUNKS_IN_FLIGHT for url in PEERS[:3])
    assert download.bytes_received == sum(len(source.fragment_bytes(p)[1]) for p in range(6))


async def test_a_fragment_that_moves_on_mid_download_starts_again_and_ends_current() -> None:
    source, target = _replica(), _replica(seed=1)
    client = _CountingPeers(source)
    asked = Counter()

    def commit_once_midway(url, request):
        asked[request.fragment] += 1
        if request.fragment == 2 and asked[2] == 2:
            source.apply(_commit(source, 1, 2))  # fragment 2 advances between two of its chunks

    client.before_reply = commit_once_midway
    download = FragmentDownload(client, target, lambda: PEERS[:1], chunk_bytes=CHUNK, **POOL_AND_CLOCK)
    await download.run()
    assert target.state.round(2) == 1
    assert target.state.digest() == source.state.digest()


async def test_a_dying_peer_costs_its_fragment_a_retry_from_the_offset_reached() -> None:
    source, target = _replica(), _replica(seed=1)
    client = _CountingPeers(source)
    requests: list[tuple[str, int, int]] = []

    def b_dies_after_its_first_chunk(url, request):
        requests.append((url, request.fragment, request.offset))
        if url == "http://b" and sum(1 for u, _, _ in requests if u == url) > 1:
            raise PeerUnreachable(url, "connection reset")

    client.before_reply = b_dies_after_its_first_chunk
    download = FragmentDownload(client, target, lambda: PEERS[:3], chunk_bytes=CHUNK, **POOL_AND_CLOCK)
    await download.run()
    assert target.state.digest() == source.state.digest()
    first_from_b = requests[[u for u, _, _ in requests].index("http://b")]
    fragment = first_from_b[1]
    after = [(u, o) for u, p, o in requests if p == fragment and u != "http://b"]
    assert after[0][1] == CHUNK  # resumed where b stopped, on another peer


async def test_when_every_attempt_fails_the_download_says_which_fragment_and_why(monkeypatch) -> None:
    source, target = _replica(), _replica(seed=1)
    client = _CountingPeers(source)

    def everyone_down(url, request):
        raise PeerUnreachable(url, "connection refused")

    client.before_reply = everyone_down
    download = FragmentDownload(client, target, lambda: PEERS[:3], chunk_bytes=CHUNK, **POOL_AND_CLOCK)
    with pytest.raises(JoinRefused, match=r"fragment \d: download failed 2 times; last: .*connection refused"):
        await download.run(attempts=2)
    assert all(client.in_flight[url] == 0 for url in PEERS)  # nothing left running


async def test_one_peer_alone_gets_no_more_chunk_requests_than_its_stream_slots_allow() -> None:
    """M = 2: every download worker asks the one peer; a server answers at most
    MAX_CONCURRENT_STREAMS_PER_PEER requests of one sender at once (and refuses more)."""
    from wire.limits import MAX_CONCURRENT_STREAMS_PER_PEER

    source, target = _replica(), _replica(seed=1)
    client = _CountingPeers(source)
    download = FragmentDownload(client, target, lambda: PEERS[:1], chunk_bytes=CHUNK, **POOL_AND_CLOCK)
    await download.run()
    assert target.state.digest() == source.state.digest()
    assert client.most_in_flight[PEERS[0]] == join.CHUNK_REQUESTS_PER_PEER < MAX_CONCURRENT_STREAMS_PER_PEER
    assert join.CHUNK_REQUESTS_PER_PEER < join.DOWNLOAD_PEERS * join.CHUNKS_IN_FLIGHT  # so the cap is what bound it


@pytest.mark.parametrize(("fault", "error"), [
    (lambda frame: frame[:-1] + bytes([frame[-1] ^ 1]), "does not match its authenticated digest"),
    (lambda frame: frame[:-5], "stream ended inside a frame"),
    (lambda frame: frame + b"trailing", r"stream ended inside a frame \(fixed header, 8 bytes"),
])
async def test_a_bad_short_or_long_chunk_is_refused_and_its_fragment_comes_whole_from_another_peer(
        fault, error) -> None:
    """Each chunk's payload is checked against its authenticated digest as it is hashed into the
    fragment (one pass): a chunk that fails (a flipped bit, bytes missing, bytes after the frame)
    is refused with the reason, the fragment starts again (its bytes are in the state digest
    already), and the state still arrives whole, from the next peer."""
    source, target = _replica(), _replica(seed=1)
    client = _CountingPeers(source)
    asked: list[tuple[str, int]] = []

    def b_spoils_its_second_chunk_of_fragment_0(url, request, frame):
        asked.append((url, request.offset))
        return fault(frame) if (url, request.fragment, request.offset) == ("http://b", 0, CHUNK) else frame

    client.spoil = b_spoils_its_second_chunk_of_fragment_0
    download = FragmentDownload(client, target, lambda: PEERS[1:2], chunk_bytes=CHUNK, **POOL_AND_CLOCK)
    with pytest.raises(JoinRefused, match=error):
        await download.fetch_fragment(0, attempts=1)
    assert download.progress[0].received == 0 and not download.progress[0].done  # to start again, not resume
    asked.clear()
    download = FragmentDownload(client, target, lambda: PEERS[1:2] + PEERS[:1], chunk_bytes=CHUNK, **POOL_AND_CLOCK)
    await download.fetch_fragment(0, attempts=2)
    assert ("http://b", CHUNK) in asked and [o for u, o in asked if u == "http://a"][0] == 0
    assert download.progress[0].done and target.state.fragment_digest(0) == source.state.fragment_digest(0)


def test_served_chunks_are_the_fragment_bytes_and_their_digest_follows_every_change() -> None:
    """The daemon serves chunks read from the state's arrays (state_transfer.ServedFragments): the
    same bytes as the serialized fragment, named by its state digest, remembered only while the
    arrays are the state's (an apply or an install of the same round replaces them)."""
    from diloco_node.daemon.state_transfer import ServedFragments

    source = _replica()
    served = ServedFragments(source)

    def whole(p: int) -> tuple[bytes, bytes]:
        _, total, digest, _ = served.read(p, 0, 0)
        return b"".join(bytes(served.read(p, at, 700)[3]) for at in range(0, total, 700)), digest

    data, digest = whole(2)
    assert data == source.fragment_bytes(2)[1] and digest == bytes.fromhex(source.state.fragment_digest(2))
    other = _replica(seed=3)  # the same round of fragment 2, other values, installed as a repair would
    source.install_fragment_bytes(2, other.fragment_bytes(2)[1])
    assert source.state.round(2) == 0 and whole(2) == (other.fragment_bytes(2)[1], other.fragment_bytes(2)[2])
    source.apply(_commit(source, 1, 2))
    after_apply, digest_after_apply = whole(2)
    assert source.state.round(2) == 1 and digest_after_apply == bytes.fromhex(source.state.fragment_digest(2))
    assert after_apply == source.fragment_bytes(2)[1]
