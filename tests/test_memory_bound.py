"""A replica's memory bound (daemon/memory_bound.py): MemoryMax= computed from the named limits on
every buffer of the fragment path, each limit the one the code enforces, and the figure docs/SCALE.md
gives for 1B parameters."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diloco_node.daemon import join, memory_bound, state_transfer
from diloco_node.daemon.memory_bound import issue_target_bytes, memory_bound_bytes
from diloco_node.transport import server
from wire.limits import MiB

from conftest import replica_with_rounds

ROOT = Path(__file__).resolve().parents[1]
# The data-plane benchmark's 1B model (Llama-3.2-1B shapes, 32,000-token vocabulary) at P = 24:
# its parameters and its largest fragment (the embedding, alone), as benchmarks/dataplane.py reports.
PARAMS_1B = 1_038_682_112
LARGEST_FRAGMENT_1B = 32_000 * 2048


def test_the_1b_bound_is_within_the_issue_target_and_is_the_figure_the_docs_give() -> None:
    bound = memory_bound_bytes(PARAMS_1B, LARGEST_FRAGMENT_1B)
    assert bound <= issue_target_bytes(PARAMS_1B)
    scale = (ROOT / "docs" / "SCALE.md").read_text()
    stated = re.search(r"MemoryMax= of a 1B replica: ([\d,]+) MiB", scale)
    assert stated is not None, "docs/SCALE.md states the 1B bound"
    assert int(stated.group(1).replace(",", "")) == round(bound / MiB)


@pytest.mark.parametrize(("module", "name", "per_unit"), [
    # each limit, and the bytes one more unit of it adds to the bound at 1B
    (join, "DOWNLOAD_PEERS", join.CHUNKS_IN_FLIGHT * join.SNAPSHOT_CHUNK_BYTES * memory_bound.RECEIVE_COPIES),
    (join, "CHUNKS_IN_FLIGHT", join.DOWNLOAD_PEERS * join.SNAPSHOT_CHUNK_BYTES * memory_bound.RECEIVE_COPIES),
    (join, "SNAPSHOT_CHUNK_BYTES", join.DOWNLOAD_PEERS * join.CHUNKS_IN_FLIGHT * memory_bound.RECEIVE_COPIES),
    (server, "MAX_CONCURRENT_STREAMS", state_transfer.SERVED_CHUNK_BYTES + server.STREAMED_REPLY_MIN_BYTES),
    (state_transfer, "SERVED_CHUNK_BYTES", server.MAX_CONCURRENT_STREAMS),
    (server, "STREAMED_REPLY_MIN_BYTES", server.MAX_CONCURRENT_STREAMS),
    (memory_bound, "APPLY_COPIES", 4 * LARGEST_FRAGMENT_1B),  # at 1B the apply's term is the larger
])
def test_the_bound_moves_with_each_named_limit_of_the_code(monkeypatch, module, name: str, per_unit: int) -> None:
    before = memory_bound_bytes(PARAMS_1B, LARGEST_FRAGMENT_1B)
    monkeypatch.setattr(module, name, getattr(module, name) + 1)
    assert memory_bound_bytes(PARAMS_1B, LARGEST_FRAGMENT_1B) - before == per_unit


def test_a_snapshot_install_counts_the_fragments_it_downloads_beside_a_resident_state() -> None:
    fresh = memory_bound.memory_bound(PARAMS_1B, LARGEST_FRAGMENT_1B)
    installing = memory_bound.memory_bound(PARAMS_1B, LARGEST_FRAGMENT_1B, installing=True)
    assert installing.fragment_in_flight == join.DOWNLOAD_PEERS * 8 * LARGEST_FRAGMENT_1B > fresh.fragment_in_flight
    assert installing.total - fresh.total == installing.fragment_in_flight - fresh.fragment_in_flight


def test_the_served_chunk_is_capped_whatever_a_request_asks() -> None:
    """What the serving term assumes: an answer carries at most SERVED_CHUNK_BYTES."""
    import numpy as np

    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.sync.fragments import plan_fragments
    from diloco_node.sync.replica import Replica

    shapes = {"a": (3 * 1024 * 1024,), "b": (8,)}  # 12 MiB of fp32 parameters, 24 MiB with momentum
    replica = Replica(plan_fragments(shapes, 1, 4, 1), {n: np.ones(s, np.float32) for n, s in shapes.items()},
                      OuterOptimizer())
    served = state_transfer.ServedFragments(replica)
    _, total, _, part = served.read(0, 0, 1 << 40)
    assert total > 2 * state_transfer.SERVED_CHUNK_BYTES and len(part) == state_transfer.SERVED_CHUNK_BYTES


@pytest.mark.parametrize(("params", "largest"), [(0, 1), (10, 0), (10, 11)])
def test_a_bound_of_no_model_is_refused(params: int, largest: int) -> None:
    with pytest.raises(ValueError, match="need 0 < largest fragment <= params"):
        memory_bound_bytes(params, largest)


@pytest.mark.parametrize("embedding_names", [[], ["embed/embedding"]])  # RDA (three passes), the weighted mean
def test_the_commit_term_is_what_the_lease_holders_merge_and_commit_hold(monkeypatch, embedding_names) -> None:
    """tracemalloc over a one-tensor fragment of T bytes of fp32 (a large model's embedding), four
    streamed int4 contributions kept encoded, two of them stale (rebased), blocks smaller than the
    tensor: the merge holds its float32 result and at most one block (`merge_block_bytes`), the whole
    commit (merge, codec_down encode and decode, the digest preview) at most the bound's commit term."""
    import math
    import tracemalloc

    import numpy as np

    from diloco_node.config.manifest import RunManifest, SyncSpec
    from diloco_node.sync import merge
    from diloco_node.sync.merge import Contribution, merge_contributions
    from diloco_node.sync.syncer import OpenRound, Syncer, TakenRound
    from wire.contribution_stream import ContributionAssembler, contribution_chunks, open_for
    from wire.limits import Limits

    block = 1 << 18  # the contributions' chunks, as in a run (both 4 Mi values there); T is 8 blocks
    monkeypatch.setattr(merge, "MERGE_BLOCK_ELEMENTS", block)
    shapes = {"embed/embedding": (2048, 1024)}  # 2M values, T = 8 MiB
    tensor_bytes = 4 * math.prod(shapes["embed/embedding"])
    rng = np.random.default_rng(0)
    plan, replica = replica_with_rounds(shapes, rng)  # two rounds to rebase from
    limits = Limits(max_chunk_elements=block)
    pending = {}
    for learner, lag in (("a", 0), ("b", 2), ("c", 0), ("d", 1)):
        delta = {n: (1e-3 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}
        head = open_for(shapes, fragment=0, base_index=0, base_round=0, c_steps=1, c_tokens=1, codec="int4",
                        learner_id=learner, stream=bytes(16), limits=limits)
        assembler = ContributionAssembler(head, shapes, limits)
        for chunk in contribution_chunks(head, delta):
            assembler.add(chunk)
        del delta
        contribution = Contribution(learner, 0, replica.state.round(0) - lag, assembler.finish(), 8, 8 * 64)
        pending[learner] = (contribution, 0.0, None)
    contributions = [c for c, _, _ in pending.values()]
    manifest = RunManifest(sync=SyncSpec(fragments=1, period=2, overlap=0, min_quorum=1))  # codec_down int4
    syncer = Syncer(manifest, plan, embedding_names)
    current = replica.state.fragment_params(0, copies=False)

    tracemalloc.start()
    try:
        result = merge_contributions(contributions, current, replica.state.history(0), caps=syncer.caps,
                                     embedding_names=embedding_names)
        _, merge_peak = tracemalloc.get_traced_memory()
        del result
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        commit = syncer.plan_commit(TakenRound(0, OpenRound(0.0, pending=pending), "due"), replica.state,
                                    replica.digest_after)
        _, commit_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert commit.proposes and "2 rebased" in commit.reason, commit.reason
    # the merge: its float32 result, and one block of temporaries at most
    assert tensor_bytes <= merge_peak <= tensor_bytes + merge.merge_block_bytes(), \
        f"merge peak {merge_peak / tensor_bytes:.2f} T, block {merge.merge_block_bytes() / tensor_bytes:.2f} T"
    # the commit: within the bound's commit term, and its copies not far above what it holds
    held = commit_peak - base
    assert 0.9 * memory_bound.COMMIT_COPIES * tensor_bytes <= held, f"commit peak {held / tensor_bytes:.2f} T"
    assert held <= memory_bound.COMMIT_COPIES * tensor_bytes + merge.merge_block_bytes(), \
        f"commit peak {held / tensor_bytes:.2f} T"
