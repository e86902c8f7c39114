"""Fast checks of the daemon's pure pieces: wire mapping, durable log, replica apply rules, join refusal."""

from __future__ import annotations

import numpy as np
import pytest

from bootstrap import messages as coord
from bootstrap.coordinator_node import PersistentState
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry
from diloco_node.daemon import peers
from diloco_node.sync.replica import CommitPayload, Replica
from diloco_node.daemon.coordination_store import CoordinationStore
from wire import messages as wire
from wire.codecs import decode_named, encode_named
from wire.errors import RemoteProtocolError

from conftest import small_replica
from test_state_download import streamed


def _entries() -> list[LogEntry]:
    return [
        LogEntry(1, 1, EntryKind.MEMBERSHIP, config=ClusterConfig.of(["a", "b"])),
        LogEntry(2, 2, EntryKind.NOOP),
        LogEntry(2, 3, EntryKind.OUTER_COMMIT, b"delta-bytes", fragment=1, round=4, digest="ab" * 32),
    ]


def test_append_entries_round_trip_through_the_wire_form() -> None:
    message = coord.AppendEntries(2, "a", 0, 0, tuple(_entries()), 2, sent_at=12.5)
    out = peers.to_wire(message, epoch=2, commit_index=2, last_index=3)
    assert isinstance(out, wire.LogAppend)
    field_map, payload = out.to_wire()
    back = peers.append_from_wire(wire.LogAppend.from_wire(field_map, payload))
    assert back.entries == message.entries
    assert (back.epoch, back.leader_id, back.leader_commit) == (2, "a", 2)
    ack = wire.LogAck(2, "b", 3, True)
    response = peers.append_response_from_wire(ack, sent_at=12.5)
    assert (response.match_index, response.sent_at, response.success) == (3, 12.5, True)


def test_unknown_entry_kind_from_a_peer_is_its_error() -> None:
    bad = wire.LogEntry(index=1, epoch=1, kind="bogus", metadata={}, payload=b"")
    with pytest.raises(RemoteProtocolError, match="unknown kind 'bogus'"):
        peers.entry_from_wire(bad)


def test_membership_entry_without_voters_is_refused() -> None:
    bad = wire.LogEntry(index=1, epoch=1, kind="membership", metadata={"fragment": None}, payload=b"")
    with pytest.raises(RemoteProtocolError, match="without a voter list"):
        peers.entry_from_wire(bad)


def test_leave_and_probe_mapping() -> None:
    left = coord.MemberRecord("a", "http://x:1", coord.MemberRole.LEARNER, 3, coord.MemberState.LEFT)
    assert isinstance(peers.to_wire(coord.Ping(1, "a", (left,)), epoch=1, commit_index=0, last_index=0), wire.Leave)
    beat = peers.to_wire(coord.Ping(7, "a", ()), epoch=4, commit_index=9, last_index=9)
    assert isinstance(beat, wire.Heartbeat) and beat.seq == 7 and beat.leader == "a"
    assert peers.to_wire(coord.PingRequest(1, "a", "b", ()), epoch=1, commit_index=0, last_index=0) is None


def test_revived_record_raises_the_incarnation_only_when_needed() -> None:
    dead = coord.MemberRecord("b", "http://b:1", coord.MemberRole.LEARNER, 4, coord.MemberState.DEAD)
    revived = peers.revived_record(dead, "b", "http://b:1", coord.MemberRole.LEARNER)
    assert revived is not None and revived.incarnation == 5 and revived.state is coord.MemberState.ALIVE
    assert revived.supersedes(dead)
    alive = coord.MemberRecord("b", "http://b:1", coord.MemberRole.LEARNER, 4, coord.MemberState.ALIVE)
    assert peers.revived_record(alive, "b", "http://b:1", coord.MemberRole.LEARNER) is None


def test_coordination_store_survives_restart_truncation_and_a_torn_tail(tmp_path) -> None:
    store = CoordinationStore(tmp_path)
    state = PersistentState.founding(["a"])
    state.election.current_epoch = 2
    state.election.voted_for = "a"
    state.log.entries.extend(_entries()[1:])
    store.sync(state)
    store.close()
    loaded = CoordinationStore(tmp_path).load_persistent()
    assert loaded.log.entries == state.log.entries
    assert (loaded.election.current_epoch, loaded.election.voted_for) == (2, "a")
    # A new leader replaced index 3 with a different entry of epoch 3: the file is rewritten.
    store2 = CoordinationStore(tmp_path)
    state2 = store2.load_persistent()
    state2.log.entries[2:] = [LogEntry(3, 3, EntryKind.NOOP)]
    store2.sync(state2)
    store2.close()
    assert CoordinationStore(tmp_path).load_persistent().log.entries[2] == LogEntry(3, 3, EntryKind.NOOP)
    # A crash mid-append leaves a torn record: it is dropped, the rest survives.
    with open(tmp_path / "log.bin", "ab") as handle:
        handle.write(b"\x10\x00\x00\x00garbage")
    reloaded = CoordinationStore(tmp_path).load_persistent()
    assert [e.index for e in reloaded.log.entries] == [1, 2, 3]


def _commit(replica: Replica, index: int, p: int, round_: int, digest: str | None = None) -> LogEntry:
    names = replica.plan.fragments[p].names
    encoded = encode_named({n: np.full(replica.state.fragment_params(p)[n].shape, 0.01, np.float32) for n in names},
                           "int8")
    if digest is None:
        digest = replica.digest_after(p, decode_named(encoded))
    payload = CommitPayload(encoded, ("a",), (1.0,)).encode()
    return LogEntry(1, index, EntryKind.OUTER_COMMIT, payload, fragment=p, round=round_, digest=digest)


def test_replicas_applying_the_same_entries_agree_and_skip_rounds_they_have() -> None:
    leader, follower = small_replica(), small_replica()
    entry = _commit(leader, 1, 0, 1)
    assert leader.apply(entry).applied and follower.apply(entry).applied
    assert leader.state.digest() == follower.state.digest()
    # A joiner that downloaded the fragment already at round 1 skips the entry, with a reason.
    joiner = small_replica()
    joiner.install_fragment_bytes(0, leader.fragment_bytes(0)[1])
    outcome = joiner.apply(entry)
    assert not outcome.applied and "already in the state" in outcome.reason
    assert joiner.state.fragment_digest(0) == leader.state.fragment_digest(0)


def test_digest_mismatch_and_round_gap_mark_the_fragment_for_repair() -> None:
    replica = small_replica()
    outcome = replica.apply(_commit(replica, 1, 1, 1, digest="00" * 32))
    assert outcome.diverged and "refetching" in outcome.reason and 1 in replica.diverged
    other = small_replica()
    gap = other.apply(_commit(other, 1, 0, 3))
    assert gap.diverged and "round 3 but state is at 0" in gap.reason


def test_fragment_bytes_from_a_peer_are_checked_before_install() -> None:
    replica = small_replica()
    with pytest.raises(RemoteProtocolError, match="malformed"):
        replica.install_fragment_bytes(0, b"\x01\x02")
    before = replica.state.digest()
    with pytest.raises(RemoteProtocolError):
        replica.install_fragment_bytes(1, replica.fragment_bytes(0)[1])  # fragment 0's bytes as fragment 1
    assert replica.state.digest() == before


def test_notifications_never_block_when_systemd_stops_reading(tmp_path) -> None:
    import socket

    from diloco_node.daemon.notify import BackgroundNotifier
    from diloco_node.ops.systemd import SystemdNotifier

    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(path))  # bound, never read: its queue fills and sendto blocks
        notifier = BackgroundNotifier(SystemdNotifier({"NOTIFY_SOCKET": str(path)}), max_pending=4)
        notifier.ready("up")
        for i in range(200):
            notifier.status(f"status {i}")  # would hang here if sends ran on the caller's thread
        assert notifier.dropped > 0
        assert listener.recv(4096).startswith(b"READY=1")
        notifier.close()


class _FlakyPeers:
    """A stand-in PeerClient serving fragment bytes from `source`; the first URL dies after one chunk."""

    def __init__(self, source: Replica) -> None:
        self.source = source
        self.requests: list[tuple[str, int, int]] = []  # (url, fragment, offset)

    async def send_for_stream(self, url, request, **_):
        from diloco_node.transport import PeerUnreachable

        self.requests.append((url, request.fragment, request.offset))
        if url == "http://dies" and len([r for r in self.requests if r[0] == url]) > 1:
            raise PeerUnreachable(url, "connection reset")
        _, data, digest = self.source.fragment_bytes(request.fragment)
        part = data[request.offset:request.offset + request.max_length]
        return streamed(wire.SnapshotChunk(request.fragment, 7, request.offset, len(data), digest, part))


async def test_fragment_download_resumes_at_the_offset_on_another_peer() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from diloco_node.clock import SystemClock
    from diloco_node.daemon.join import FragmentDownload

    source, target = small_replica(), small_replica()
    source.apply(_commit(source, 1, 0, 1))
    client = _FlakyPeers(source)
    download = FragmentDownload(client, target, lambda: ["http://dies", "http://works"], chunk_bytes=64,
                                executor=ThreadPoolExecutor(1), clock=SystemClock())
    await download.run()
    assert target.state.digest() == source.state.digest()
    assert download.max_commit_index == 7
    # Fragment 0: one chunk from the dying peer, then the next peer continues at offset 64, not 0
    # (the requests pipelined to the dying peer behind the first one fail with it).
    fragment0 = [(url, offset) for url, p, offset in client.requests if p == 0]
    assert fragment0[0] == ("http://dies", 0)
    assert [offset for url, offset in fragment0 if url == "http://works"][0] == 64


def _syncer_with(replica: Replica, value: float) -> tuple:
    from diloco_node.sync.syncer import OpenRound, Syncer, TakenRound
    from diloco_node.sync.merge import Contribution
    from diloco_node.config.manifest import RunManifest

    syncer = Syncer(RunManifest(), replica.plan, [])
    names = replica.plan.fragments[0].names
    delta = {n: np.full(replica.state.fragment_params(0)[n].shape, value, np.float32) for n in names}
    rnd = OpenRound(opened_at=0.0)
    rnd.pending["a"] = (Contribution("a", 0, 0, delta, 8, 1024), 0.0, None)
    return syncer, TakenRound(0, rnd, "quorum reached")


def test_a_merge_whose_outer_step_overflows_is_dropped_with_its_reason() -> None:
    from diloco_node.config.manifest import OuterOptimizer

    # Momentum from the first round (no warm-up): Delta + mu * b overflows float32 at round 1.
    replica = small_replica(OuterOptimizer(momentum_warmup_rounds=0))
    before = replica.state.digest()
    # Finite (float32 max is 3.4e38) but the outer step overflows when applied: GlobalStateError.
    syncer, taken = _syncer_with(replica, 3.0e38)
    plan = syncer.plan_commit(taken, replica.state, replica.digest_after)
    assert plan.merged is None and plan.failed
    assert "merged round dropped" in plan.reason and "non-finite" in plan.reason
    assert replica.state.digest() == before and replica.state.round(0) == 0
    # A sane round still goes through, with the digest the replicas will reach.
    syncer, taken = _syncer_with(replica, 0.01)
    plan = syncer.plan_commit(taken, replica.state, replica.digest_after)
    assert plan.merged is not None and not plan.failed and plan.merged.round == 1 and len(plan.digest) == 64


def test_pre_votes_travel_over_the_wire_and_older_frames_decode_as_real_votes() -> None:
    request = coord.VoteRequest(7, "a", 3, 42, pre_vote=True)
    out = peers.to_wire(request, epoch=6, commit_index=0, last_index=0)
    assert isinstance(out, wire.VoteRequest) and out.pre_vote
    field_map, payload = out.to_wire()
    back = peers.vote_request_from_wire(wire.VoteRequest.from_wire(field_map, payload))
    assert back == request
    reply = coord.VoteResponse(7, "b", True, "would vote", pre_vote=True)
    reply_out = peers.to_wire(reply, epoch=0, commit_index=0, last_index=0)
    assert peers.vote_response_from_wire(wire.VoteReply.from_wire(*reply_out.to_wire())) == reply
    # A sender that predates the field omits it: a real vote request, not an error.
    del field_map["pre_vote"]
    assert wire.VoteRequest.from_wire(field_map, b"").pre_vote is False
    with pytest.raises(Exception, match="pre_vote"):
        wire.VoteRequest.from_wire({**field_map, "pre_vote": 1}, b"")


def test_learner_reads_and_writes_parameter_leaves_by_the_models_names() -> None:
    import jax.numpy as jnp

    from diloco_node.learn import model as model_lib
    from diloco_node.learn.learner_thread import _leaf_index

    from flax import nnx

    class Two(nnx.Module):  # nested modules and a list, like the model's blocks, but tiny
        def __init__(self) -> None:
            self.blocks = nnx.List([nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 2, rngs=nnx.Rngs(1))])
            self.head = nnx.LayerNorm(2, rngs=nnx.Rngs(2))

    _, params = nnx.split(Two(), nnx.Param)
    flat = model_lib.flat_params(params)
    index = _leaf_index(params)
    assert set(index) == set(flat)
    import jax

    leaves = jax.tree.leaves(params)
    changed = {name: flat[name] + 1.0 for name in sorted(flat)[:3]}
    for name, value in changed.items():
        leaves[index[name]] = jnp.asarray(value)
    fast = model_lib.flat_params(jax.tree.unflatten(jax.tree.structure(params), leaves))
    slow = model_lib.flat_params(model_lib.load_flat_params(params, changed))
    assert all(np.array_equal(fast[n], slow[n]) for n in flat)
    assert not np.array_equal(fast[sorted(flat)[0]], flat[sorted(flat)[0]])


def test_syncer_holds_an_out_of_phase_push_until_the_fragments_next_round() -> None:
    """The daemon's syncer applies the same per-fragment round rate limit as the runner."""
    from diloco_node.sync.merge import Contribution
    from diloco_node.sync.syncer import HELD_RETRY_S

    replica = small_replica()
    syncer, _ = _syncer_with(replica, 0.01)
    syncer.rounds.clear()
    period = syncer.manifest.sync.period
    syncer.prime(step_s=0.25)  # seconds per learner step: a period is period * 0.25 s
    delta = {name: np.full(arr.shape, 0.01, np.float32) for name, arr in replica.state.fragment_params(0).items()}
    four = ["fast", "slow", "c", "d"]
    # No merge yet: a lone contribution with K = 1 and no grace estimates merges at once.
    syncer.add(Contribution("fast", 0, 0, delta, 8, 1024), now=100.0)
    first = syncer.step_round(0, 100.0, four)
    assert first is not None and first.taken is not None, first.reason
    assert syncer.adopt(first.taken, syncer.plan_commit(first.taken, replica.state), 100.0)  # proposed at 100 s
    # Another learner's push soon after that merge, out of phase: held for the next on-time round.
    syncer.add(Contribution("slow", 0, 0, delta, 8, 1024), now=101.0)
    held = syncer.decide(0, 101.0, four)
    assert held is not None and not held.merge_now
    assert held.reason.startswith("holding"), held.reason
    assert held.wake_at is not None and held.wake_at >= 100.0 + 0.5 * period * 0.25
    # A merge the node cannot take now is held with the node's reason, and looked at again soon.
    busy = syncer.decide(0, 100.0 + period * 0.25, four, blocked="replica behind its own log: applied 4 of 5")
    assert busy is not None and not busy.merge_now and busy.wake_at == 100.0 + period * 0.25 + HELD_RETRY_S
    assert busy.reason.startswith("held: replica behind its own log: applied 4 of 5 (due: merging"), busy.reason
    assert syncer.last_decision[0] == busy.reason  # what /status shows for the fragment
    # Losing the lease forgets the schedule: the next holder starts without a last merge time.
    syncer.lease_lost()
    assert syncer.last_merge_at == {} and syncer.rounds == {}


def test_the_norm_reference_travels_in_commits_so_a_new_holder_keeps_checking_outliers() -> None:
    """The running reference norm is merge policy, not state: it rides in each commit's payload,
    every replica keeps the newest per fragment, and a node winning the lease starts from it."""
    holder_replica = small_replica()
    syncer, taken = _syncer_with(holder_replica, 0.01)
    plan = syncer.plan_commit(taken, holder_replica.state, holder_replica.digest_after)
    assert plan.merged is not None and plan.merged.norm_ref is not None
    assert syncer.adopt(taken, plan, 1.0)  # proposed: the holder's reference moves with it
    assert plan.merged.norm_ref == syncer.norm_ref.get(0) > 0.0
    assert CommitPayload.decode(plan.payload).norm_ref == plan.merged.norm_ref
    entry = LogEntry(1, 1, EntryKind.OUTER_COMMIT, plan.payload, fragment=0, round=1, digest=plan.digest)
    follower = small_replica()
    assert follower.apply(entry).applied
    assert follower.norm_refs == {0: plan.merged.norm_ref}
    # The follower wins the lease after a failover: its fresh syncer checks from round one.
    new_syncer, _ = _syncer_with(follower, 0.01)
    assert new_syncer.norm_ref.get(0) is None
    new_syncer.lease_gained(follower.norm_refs, 0.0)
    assert new_syncer.norm_ref.get(0) == plan.merged.norm_ref
    # Payloads from before the field decode without it; a poisoned reference is the peer's error.
    assert CommitPayload.decode(CommitPayload(b"x", ("a",), (1.0,)).encode()).norm_ref is None
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(RemoteProtocolError, match="norm_ref"):
            CommitPayload.decode(CommitPayload(b"x", ("a",), (1.0,), bad).encode())
