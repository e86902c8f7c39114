"""Eviction (issue 12): a site removed from the run for good.

The EVICTION entry's payload and the register it builds (sync/evictions.py), the replica applying
it and carrying it through checkpoints and state downloads, the lease holder dropping an evicted
voter and never re-adding it (bootstrap/coordinator_node.py), and the transport refusing an
evicted site's frames and certificates with the reason (transport/server.py's gate).
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import msgpack
import numpy as np
import pytest
from aiohttp import web

from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.entries import EntryKind, LogEntry
from bootstrap.messages import Send
from diloco_node.config.manifest import OuterOptimizer
from diloco_node.ops import pki
from diloco_node.ops.status import is_loopback
from diloco_node.sync.evictions import (
    MAX_EVICTION_REASON_CHARS,
    EvictionError,
    EvictionRecord,
    Evictions,
    decode_payload,
    encode_payload,
)
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.replica import Replica
from diloco_node.sync.state_codec import StateCodecError, evictions_from_checkpoint
from diloco_node.transport import PeerClient, PeerRefused, PeerServer
from diloco_node.transport.tls import SiteTls, TlsFiles
from wire.auth import AuthContext, FrameVerifier, derive_frame_key
from wire.messages import MAX_NODE_ID_CHARS, MAX_REASON_CHARS, U63_MAX, VoteReply, VoteRequest

from conftest import NoDisk, serve_peer_server

FINGERPRINT = "ab" * 32
SHAPES = {"embed/embedding": (8, 4), "head/kernel": (4, 8)}
PLAN = plan_fragments(SHAPES, 2, 4, 1)


# ------------------------------------------------------------------ payload and register

def test_payload_round_trips_and_names_what_is_malformed() -> None:
    payload = encode_payload("site-c", [FINGERPRINT, FINGERPRINT], "key leaked")
    record = decode_payload(payload, 7)
    assert record == EvictionRecord("site-c", 7, (FINGERPRINT,), "key leaked")
    assert record.refusal() == "node site-c was evicted from this run at index 7: key leaked"
    with pytest.raises(EvictionError, match="not a valid node id"):
        encode_payload("no spaces allowed", [], "")
    with pytest.raises(EvictionError, match="not 64 lowercase hex digits"):
        encode_payload("c", ["ABC"], "")
    with pytest.raises(EvictionError, match="exceeds 200"):
        encode_payload("c", [], "x" * 201)
    with pytest.raises(EvictionError, match="eviction entry #3: payload is not msgpack"):
        decode_payload(b"\xc1", 3)
    with pytest.raises(EvictionError, match="eviction entry #3: payload must be a map"):
        decode_payload(msgpack.packb([1, 2]), 3)


def test_the_register_refuses_by_node_id_and_by_fingerprint_and_only_grows() -> None:
    register = Evictions()
    assert register.refusal("c", FINGERPRINT) is None
    register.apply_entry(encode_payload("c", [FINGERPRINT], "stolen"), 9)
    assert register.refusal("c") == "node c was evicted from this run at index 9: stolen"
    # Another node id presenting the evicted certificate is refused too.
    assert register.refusal("d", FINGERPRINT) == "node c was evicted from this run at index 9: stolen"
    assert register.refusal("d", "cd" * 32) is None and register.refusal(None) is None
    # A second eviction of c keeps the first index and adds its certificates.
    register.add(EvictionRecord("c", 12, ("cd" * 32,), "again"))
    assert register.record("c") == EvictionRecord("c", 9, tuple(sorted((FINGERPRINT, "cd" * 32))), "stolen")
    copy = Evictions.from_plain(register.to_plain())
    assert copy.records() == register.records()
    with pytest.raises(EvictionError, match=r"evicted\[0\]: index 0 must be an int >= 1"):
        Evictions.from_plain([{"node_id": "c", "index": 0}])


def test_the_longest_refusal_fits_the_wire_bound_on_a_reason_so_the_operators_words_arrive_whole() -> None:
    # The transport cuts a refusal to wire.messages.MAX_REASON_CHARS; the eviction's own bound is
    # what keeps the operator's reason, at the refusal's end, out of the cut.
    longest = EvictionRecord("n" * MAX_NODE_ID_CHARS, U63_MAX, (), "r" * MAX_EVICTION_REASON_CHARS).refusal()
    assert len(longest) <= MAX_REASON_CHARS, (len(longest), MAX_REASON_CHARS)


# ------------------------------------------------------------------ the replica and its serialized forms

def _replica() -> Replica:
    rng = np.random.default_rng(0)
    return Replica(PLAN, {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()},
                   OuterOptimizer(lr=0.7, momentum=0.9))


def _eviction_entry(index: int = 5, node: str = "c") -> LogEntry:
    return LogEntry(2, index, EntryKind.EVICTION, encode_payload(node, [FINGERPRINT], "compromised"))


def test_the_replica_applies_an_eviction_and_keeps_it_through_a_checkpoint(tmp_path: Path) -> None:
    replica = _replica()
    outcome = replica.apply(_eviction_entry())
    assert outcome.applied and outcome.reason == "node c was evicted from this run at index 5: compromised"
    assert replica.applied_index == 5 and "c" in replica.evictions
    meta, arrays = replica.checkpoint_entries()
    restarted = _replica()
    restarted.restore_checkpoint(meta, arrays)
    assert restarted.evictions.records() == replica.evictions.records()
    # A checkpoint written before evictions existed has none; a malformed one is refused by name.
    del meta["evicted"]
    assert len(evictions_from_checkpoint(meta)) == 0
    with pytest.raises(StateCodecError, match="checkpoint: evicted"):
        evictions_from_checkpoint({"evicted": "c"})


def test_a_malformed_eviction_entry_changes_nothing() -> None:
    replica = _replica()
    outcome = replica.apply(LogEntry(2, 4, EntryKind.EVICTION, b"\xc1"))
    assert not outcome.applied and "eviction entry #4: payload is not msgpack" in outcome.reason
    assert len(replica.evictions) == 0


def test_a_joiner_learns_evictions_from_any_fragment_it_downloads() -> None:
    source = _replica()
    _, before, _ = source.fragment_bytes(1)
    source.apply(_eviction_entry())
    _, after, _ = source.fragment_bytes(1)
    assert after != before  # the cached bytes of an unchanged round are rebuilt after an eviction
    joiner = _replica()
    joiner.install_fragment_bytes(1, after)
    assert joiner.evictions.records() == source.evictions.records()
    # Bytes from a peer without evictions do not forget what the joiner already applied.
    joiner.install_fragment_bytes(0, _replica().fragment_bytes(0)[1])
    assert "c" in joiner.evictions


# ------------------------------------------------------------------ the lease holder

def _run(nodes: dict[str, CoordinatorNode], until: float, pending: list[Send], now: float) -> tuple[float, list[Send]]:
    """A perfect zero-latency network and 100 ms ticks; returns the time and every send."""
    sent: list[Send] = []
    while now < until:
        while pending:
            send = pending.pop(0)
            sent.append(send)
            pending += [a for a in nodes[send.to].handle(send.message, now) if isinstance(a, Send)]
        for node in nodes.values():
            pending += [a for a in node.tick(now) if isinstance(a, Send)]
        now += 0.1
    return now, sent


def test_an_evicted_voter_is_removed_never_re_added_and_sent_nothing() -> None:
    leader = CoordinatorNode("a", PersistentState.founding(["a"]), now=0.0, rng=random.Random(0))
    leader.tick(10.0)
    site = CoordinatorNode("b", PersistentState.joining(), now=10.0, rng=random.Random(1))
    nodes = {"a": leader, "b": site}
    now, _ = _run(nodes, 14.0, list(site.start_join(["a"], 10.0)), 10.0)
    assert leader.log.committed_config.voters == {"a", "b"}
    leader.is_evicted = lambda node_id: node_id == "b"
    now, _ = _run(nodes, now + 2.0, [], now)
    assert leader.log.committed_config.voters == {"a"}
    # b is alive and caught up, which would get a routine leaver re-added; an evicted site is not.
    now, sent = _run(nodes, now + 5.0, [], now)
    assert leader.log.committed_config.voters == {"a"}
    assert not [s for s in sent if s.to == "b" and type(s.message).__name__ in ("AppendEntries", "InstallSnapshot")]


# ------------------------------------------------------------------ the transport refuses

RUN = "run-evict"
KEY = derive_frame_key(b"e" * 32)


class _Voter:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, message: VoteRequest, peer) -> VoteReply:
        self.calls += 1
        return VoteReply(epoch=message.epoch, voter="b", granted=True, reason="ok")


async def _vote(url: str, sender: str, tls: SiteTls | None = None) -> None:
    async with PeerClient(AuthContext(RUN, sender, KEY), FrameVerifier(RUN, KEY, node_id=sender), tls=tls) as client:
        await client.send(url, VoteRequest(epoch=3, candidate=sender, last_log_epoch=1, last_log_index=1),
                          peer="b")


async def test_frames_from_an_evicted_sender_are_refused_without_tls() -> None:
    register = Evictions([EvictionRecord("a", 4, (), "spam")])
    voter = _Voter()
    server = PeerServer(AuthContext(RUN, "b", KEY), FrameVerifier(RUN, KEY, node_id="b"))
    server.on_message(VoteRequest.KIND, voter)
    server.gate = register.refusal
    runner, port = await serve_peer_server(server)
    try:
        with pytest.raises(PeerRefused) as refused:
            await _vote(f"http://127.0.0.1:{port}", "a")
        await _vote(f"http://127.0.0.1:{port}", "c")  # everyone else is still answered
    finally:
        await runner.cleanup()
    assert refused.value.status == 403
    assert refused.value.reason == "node a was evicted from this run at index 4: spam"
    assert voter.calls == 1


@pytest.fixture(scope="module")
def run_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root / "ca")
    for node in ("a", "b", "c"):
        pki.issue_site(root / "ca", node, root / node)
    return root


def _tls(root: Path, site: str) -> SiteTls:
    return SiteTls(TlsFiles(root / site / pki.SITE_CERT, root / site / pki.SITE_KEY, root / "ca" / pki.CA_CERT))


def _fingerprint(root: Path, site: str) -> str:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding
    cert = x509.load_pem_x509_certificate((root / site / pki.SITE_CERT).read_bytes())
    return hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()


async def test_an_evicted_certificate_is_refused_before_its_body_is_read(run_pki: Path) -> None:
    voter = _Voter()
    server = PeerServer(AuthContext(RUN, "b", KEY), FrameVerifier(RUN, KEY, node_id="b"), certified_senders=True)
    server.on_message(VoteRequest.KIND, voter)
    register = Evictions()
    server.gate = register.refusal
    runner, port = await serve_peer_server(server, _tls(run_pki, "b").server_context)
    url = f"https://127.0.0.1:{port}"
    try:
        await _vote(url, "a", _tls(run_pki, "a"))
        # The holder saw a's certificate: its fingerprint is what an eviction of a records.
        assert server.seen_certificates == {"a": {_fingerprint(run_pki, "a")}}
        register.add(EvictionRecord("z", 6, (_fingerprint(run_pki, "a"),), "laptop stolen"))
        with pytest.raises(PeerRefused) as by_certificate:
            await _vote(url, "a", _tls(run_pki, "a"))
        register.add(EvictionRecord("c", 7, (), "left the project"))
        with pytest.raises(PeerRefused) as by_node_id:
            await _vote(url, "c", _tls(run_pki, "c"))
    finally:
        await runner.cleanup()
    assert (by_certificate.value.status, by_certificate.value.reason) == (
        403, "node z was evicted from this run at index 6: laptop stolen")
    assert (by_node_id.value.status, by_node_id.value.reason) == (
        403, "node c was evicted from this run at index 7: left the project")
    assert voter.calls == 1


def test_evict_is_answered_only_on_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("127.0.0.2")
    assert not is_loopback("10.0.0.5") and not is_loopback("2001:db8::1")
    assert not is_loopback(None) and not is_loopback("unix-socket")


# ------------------------------------------------------------------ the operator's request (POST /evict)

def _coordination(core: CoordinatorNode, register: Evictions, tasks):
    from diloco_node.clock import FakeClock
    from diloco_node.daemon.coordination import CoordinationIO
    from diloco_node.daemon.peers import AddressBook

    def apply(entry: LogEntry) -> None:
        if entry.kind is EntryKind.EVICTION:
            register.apply_entry(entry.payload, entry.index)

    core.is_evicted = register.__contains__
    return CoordinationIO(core=core, persistent=core.persistent, store=NoDisk(), history=NoDisk(), client=None,
                          addresses=AddressBook({"b": "https://b.example:7070"}), clock=FakeClock(10.0), tasks=tasks,
                          on_apply=apply, on_restore_snapshot=lambda s: None, after_step=lambda: None,
                          remember_member=lambda *a: None, report_error=lambda m: None)


async def test_the_lease_holder_evicts_through_the_operator_route_and_refusals_change_nothing() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from diloco_node.daemon.tasks import TaskSet
    from diloco_node.ops.status import StatusDocument, operator_routes

    tasks = TaskSet()
    holder = CoordinatorNode("a", PersistentState.founding(["a"]), now=0.0, rng=random.Random(0))
    holder.tick(10.0)
    holder.membership.learn("c", 10.0)
    register = Evictions()
    io = _coordination(holder, register, tasks)
    app = web.Application()
    snapshot = lambda: StatusDocument("a", "r", "learner", True, 1, "a", 1, "")  # noqa: E731
    app.add_routes(operator_routes(snapshot, evict=lambda node, why: io.evict(node, why, [FINGERPRINT],
                                                                              register.record, 6.0)))
    try:
        async with TestClient(TestServer(app)) as client:
            async def post(body) -> tuple[int, dict]:
                response = await client.post("/evict", data=body if isinstance(body, bytes) else None,
                                             json=None if isinstance(body, bytes) else body)
                return response.status, await response.json()

            assert await post(b"{not json") == (400, {"error": "the body is not JSON: Expecting property name "
                                                              "enclosed in double quotes: line 1 column 2 (char 1)"})
            assert (await post({"reason": "x"}))[0] == 400
            assert await post({"node_id": "a"}) == (
                400, {"error": "a cannot evict itself: ask another member's operator listener"})
            assert await post({"node_id": "zz"}) == (404, {"error": "no member 'zz' in this run"})
            status, answer = await post({"node_id": "c", "reason": "x" * 201})
            assert status == 400 and "exceeds 200" in answer["error"]
            assert len(register) == 0 and holder.log.last_index == 2  # the refusals appended nothing
            status, answer = await post({"node_id": "c", "reason": "key leaked"})
            assert status == 200 and answer == {"node_id": "c", "index": 3, "committed": True,
                                                "message": "node c was evicted from this run at index 3: key leaked"}
            assert register.record("c") == EvictionRecord("c", 3, (FINGERPRINT,), "key leaked")
            status, again = await post({"node_id": "c", "reason": "twice"})
            assert status == 200 and again["message"].endswith("(already)") and holder.log.last_index == 3
    finally:
        await tasks.close()


async def test_a_member_without_the_lease_names_the_holder_and_appends_nothing() -> None:
    from diloco_node.daemon.tasks import TaskSet

    tasks = TaskSet()
    follower = CoordinatorNode("a", PersistentState.founding(["a", "b", "c"]), now=0.0, rng=random.Random(0))
    follower.election.leader_id = "b"
    io = _coordination(follower, Evictions(), tasks)
    try:
        status, answer = await io.evict("c", "why", [], lambda node: None, 1.0)
    finally:
        await tasks.close()
    assert status == 409 and answer["lease_holder"] == "b" and answer["lease_holder_url"] == "https://b.example:7070"
    assert "a does not hold the lease" in answer["error"] and follower.log.last_index == 1


async def test_the_evict_command_prints_the_eviction_or_what_to_do_instead() -> None:
    import asyncio
    import io as text_io

    from aiohttp.test_utils import TestServer

    from diloco_node.cli.evict import evict_command

    answers = {"c": (200, {"message": "node c was evicted from this run at index 3: gone"}),
               "d": (409, {"error": "a does not hold the lease: run `diloco-node evict` against the lease "
                                    "holder's operator listener (b)", "lease_holder": "b",
                           "lease_holder_url": "https://b.example:7070"})}
    seen: list[dict] = []

    async def evict(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        status, answer = answers[body["node_id"]]
        return web.json_response(answer, status=status)

    app = web.Application()
    app.router.add_post("/evict", evict)
    async with TestServer(app, host="127.0.0.1") as server:
        peer = f"127.0.0.1:{server.port}"
        results = {}
        for node in ("c", "d"):
            out, err = text_io.StringIO(), text_io.StringIO()
            code = await asyncio.to_thread(evict_command, peer, node, "gone", 5.0, out, err)
            results[node] = (code, out.getvalue(), err.getvalue())
    assert results["c"] == (0, "node c was evicted from this run at index 3: gone\n", "")
    code, out, err = results["d"]
    assert code == 1 and out == "" and "(b); its peer URL is https://b.example:7070" in err
    assert seen == [{"node_id": "c", "reason": "gone"}, {"node_id": "d", "reason": "gone"}]
    unreachable = text_io.StringIO()
    assert evict_command("127.0.0.1:1", "c", "", 2.0, text_io.StringIO(), unreachable) == 1
    assert "http://127.0.0.1:1/evict: unreachable" in unreachable.getvalue()


def test_status_lists_the_evicted_sites_and_reads_older_documents_without_them() -> None:
    from diloco_node.ops.status import EvictedStatus, StatusBuilder, StatusDocument

    builder = StatusBuilder("a", "run", "learner", started_at=0.0)
    builder.set_evicted([EvictedStatus("c", 9, "stolen")])
    raw = builder.document(1.0).to_dict()
    assert raw["evicted"] == [{"node_id": "c", "index": 9, "reason": "stolen"}]
    assert StatusDocument.from_dict(raw).evicted == (EvictedStatus("c", 9, "stolen"),)
    del raw["evicted"]
    assert StatusDocument.from_dict(raw).evicted == ()


async def test_an_evicted_site_is_never_offered_to_joiners_nor_used_as_a_download_source() -> None:
    from diloco_node.config.manifest import RunManifest
    from diloco_node.daemon.state_transfer import StateKeeper
    from diloco_node.daemon.tasks import TaskSet
    from wire.messages import JoinRequest, Role

    class Signed:
        node_id = "d"

    tasks = TaskSet()
    holder = CoordinatorNode("a", PersistentState.founding(["a"]), now=0.0, rng=random.Random(0))
    holder.tick(10.0)
    register = Evictions([EvictionRecord("b", 4, (), "gone")])
    io = _coordination(holder, register, tasks)  # its address book knows a and b
    io.addresses.learn("a", "https://a.example:7070")
    manifest = RunManifest()
    request = JoinRequest("d", "https://d.example:7070", Role.LEARNER, manifest.digest_bytes())
    try:
        answer = await io.on_join_request(request, Signed(), manifest)
        holder.is_evicted = lambda node_id: False
        unevicted = await io.on_join_request(request, Signed(), manifest)
    finally:
        await tasks.close()
    assert [m.node_id for m in answer.members] == ["a"]  # b, evicted, is not listed
    assert [m.node_id for m in unevicted.members] == ["a", "b"]

    replica = _replica()
    replica.evictions.merge(register.records())
    keeper = StateKeeper(node_id="d", replica=replica, client=None, addresses=io.addresses, executor=None,
                         clock=None, tasks=None, history=None, leader_id=lambda: "b", epoch=lambda: 1,
                         report_error=lambda m: None, commits_applied=None, learner=None)
    # b is named as the lease holder (stale news) and has an address: still never asked.
    assert keeper.repair_peers() == ["https://a.example:7070"]
    assert keeper._join_peers() == ["https://a.example:7070"]
