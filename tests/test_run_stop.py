"""[run.stop]: the merged totals every replica keeps, and the one commit at which a run is complete."""

from __future__ import annotations

import numpy as np
import pytest

from bootstrap.entries import EntryKind, LogEntry
from diloco_node.config.manifest import OuterOptimizer, RunManifest, StopSpec, SyncSpec
from diloco_node.sync import state_codec
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.merge import Contribution
from diloco_node.sync.replica import CommitPayload, Replica
from diloco_node.sync.syncer import Syncer
from wire.codecs import decode_named, encode_named
from wire.errors import RemoteProtocolError

INITIAL = {"w": np.arange(16, dtype=np.float32).reshape(4, 4), "b": np.ones(4, np.float32)}


def _replica(stop: StopSpec, founded_at: float = 0.0) -> Replica:
    plan = plan_fragments({n: a.shape for n, a in INITIAL.items()}, 2, 4, 1)
    return Replica(plan, INITIAL, OuterOptimizer(), stop, founded_at)


def _commit(replica: Replica, index: int, p: int, tokens: int, steps: int, wall: float = 0.0) -> LogEntry:
    names = replica.plan.fragments[p].names
    encoded = encode_named({n: np.full(INITIAL[n].shape, 0.01, np.float32) for n in names}, "int8")
    payload = CommitPayload(encoded, ("a",), (1.0,), None, tokens, steps, wall).encode()
    digest = replica.digest_after(p, decode_named(encoded))
    return LogEntry(index=index, epoch=1, kind=EntryKind.OUTER_COMMIT, payload=payload, fragment=p,
                    round=replica.state.round(p) + 1, digest=digest)


def test_the_run_is_complete_when_every_fragment_has_merged_the_limit_and_no_later_commit_applies() -> None:
    replica = _replica(StopSpec(tokens=1000))
    assert replica.apply(_commit(replica, 1, 0, 600, 6)).applied
    assert replica.apply(_commit(replica, 2, 0, 600, 6)).applied  # fragment 0 past the limit...
    assert replica.completion() is None  # ...but fragment 1 has merged nothing yet
    assert replica.apply(_commit(replica, 3, 1, 999, 9)).applied
    assert replica.completion() is None and replica.merged_totals == (999, 9)
    assert replica.apply(_commit(replica, 4, 1, 1, 1)).applied
    assert replica.completion() == "1000 tokens merged into every fragment (stop.tokens = 1000)"
    digest = replica.state.digest()
    late = replica.apply(_commit(replica, 5, 0, 10, 1))
    assert not late.applied and not late.diverged and "the run is complete" in late.reason
    assert replica.state.digest() == digest and replica.applied_index == 5
    assert replica.completed_at_index == 4  # the completing commit, not the last index applied


def test_steps_limit_and_no_limit() -> None:
    replica = _replica(StopSpec(steps=10))
    for index, p in enumerate((0, 1), start=1):
        replica.apply(_commit(replica, index, p, 10**9, 10))
    assert replica.completion() == "10 inner steps merged into every fragment (stop.steps = 10)"
    endless = _replica(StopSpec())
    for index, p in enumerate((0, 1), start=1):
        endless.apply(_commit(endless, index, p, 10**9, 10**6))
    assert endless.completion() is None


def test_wall_time_completes_at_the_first_commit_planned_past_it_and_travels_with_the_state() -> None:
    founded = 1_700_000_000.0
    replica = _replica(StopSpec(wall_s=60.0), founded)
    assert replica.apply(_commit(replica, 1, 0, 1, 1, wall=founded + 30)).applied
    assert replica.completion() is None
    assert replica.apply(_commit(replica, 2, 1, 1, 1, wall=founded + 61)).applied
    assert replica.completion() == "a commit 61 s after the run was founded (stop.wall_s = 60)"
    joiner = _replica(StopSpec(wall_s=60.0), founded)
    for p in (0, 1):
        joiner.install_fragment_bytes(p, replica.fragment_bytes(p)[1])
    assert joiner.completion() == replica.completion()
    meta, arrays = replica.checkpoint_entries()
    restored = _replica(StopSpec(wall_s=60.0), founded)
    restored.restore_checkpoint(meta, arrays)
    assert restored.commit_wall == [founded + 30, founded + 61] and restored.completion() is not None


def test_the_totals_travel_with_downloads_and_checkpoints() -> None:
    replica = _replica(StopSpec(tokens=50))
    replica.apply(_commit(replica, 1, 0, 30, 3))
    replica.apply(_commit(replica, 2, 1, 70, 7))
    # A joiner's download: fragment bytes carry the totals.
    joiner = _replica(StopSpec(tokens=50))
    for p in (0, 1):
        joiner.install_fragment_bytes(p, replica.fragment_bytes(p)[1])
    assert joiner.merged == [(30, 3), (70, 7)] and joiner.completion() is None
    # A restart: the checkpoint carries them too.
    meta, arrays = replica.checkpoint_entries()
    restored = _replica(StopSpec(tokens=50))
    restored.restore_checkpoint(meta, arrays)
    assert restored.merged == [(30, 3), (70, 7)]
    # Checkpoints from before the totals existed restore at zero.
    old_meta = {k: v for k, v in meta.items() if k != "merged"}
    older = _replica(StopSpec(tokens=50))
    older.restore_checkpoint(old_meta, arrays)
    assert older.merged == [(0, 0), (0, 0)]
    with pytest.raises(state_codec.StateCodecError, match="must not be negative"):
        state_codec.from_checkpoint({**meta, "merged": [[-1, 0], [0, 0]]}, arrays, replica.plan)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "9"])
def test_a_commit_payload_with_bad_totals_is_refused(bad) -> None:
    import msgpack

    raw = {"delta": b"x", "contributors": ["a"], "weights": [1.0], "tokens": bad, "steps": 0}
    with pytest.raises(RemoteProtocolError, match="tokens"):
        CommitPayload.decode(msgpack.packb(raw, use_bin_type=True))


def test_the_syncer_commits_the_accepted_work_capped_as_the_weights_are() -> None:
    manifest = RunManifest(sync=SyncSpec(fragments=2, period=4, overlap=1, min_quorum=1, max_tokens_per_step=100,
                                         max_steps_per_contribution=50))
    replica = _replica(StopSpec())
    syncer = Syncer(manifest, replica.plan, [])
    names = replica.plan.fragments[0].names
    delta = {n: np.full(INITIAL[n].shape, 0.01, np.float32) for n in names}
    syncer.add(Contribution("honest", 0, 0, delta, 8, 512), now=0.0)
    syncer.add(Contribution("greedy", 0, 0, delta, 80, 10**9), now=0.0)  # claims 80 steps, 1e9 tokens
    step = syncer.step_round(0, 0.0, ["honest", "greedy"])
    assert step is not None and step.taken is not None
    plan = syncer.plan_commit(step.taken, replica.state)
    payload = CommitPayload.decode(plan.payload)
    assert set(payload.contributors) == {"honest", "greedy"}
    assert (payload.tokens, payload.steps) == (512 + 50 * 100, 8 + 50)
