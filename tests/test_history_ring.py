"""The rebase history on disk (daemon/history_ring.py): the same versions, the same rebased merges
and the same digests as the in-memory history, with only the current version in memory."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from diloco_node.config.manifest import OuterOptimizer
from diloco_node.daemon.history_ring import DiskFragmentHistory, DiskVersionRings
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.global_state import FragmentHistory, GlobalState
from diloco_node.sync.merge import Contribution, ContributionCaps, merge_contributions

SHAPES = {"embed/embedding": (32, 8), "blocks/0/w": (8, 8), "blocks/0/b": (8,), "head/kernel": (8, 32)}
OUTER = OuterOptimizer(lr=0.7, momentum=0.9)
CAPS = ContributionCaps(max_tokens_per_step=1 << 20, max_steps=1 << 20)


def _initial(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def _grad(state: GlobalState, p: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {n: (0.05 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in state.fragment_params(p).items()}


def _pair(tmp_path: Path, history_len: int = 4) -> tuple[GlobalState, GlobalState, DiskVersionRings]:
    plan = plan_fragments(SHAPES, 2, 4, 0)
    memory = GlobalState(plan, _initial(), OUTER, history_len=history_len)
    disk = GlobalState(plan, _initial(), OUTER, history_len=history_len)
    rings = DiskVersionRings(tmp_path / "ring")
    disk.use_history(rings)
    return memory, disk, rings


def test_disk_history_holds_the_same_versions_as_the_memory_one(tmp_path: Path) -> None:
    memory, disk, rings = _pair(tmp_path)
    rng = np.random.default_rng(1)
    for i in range(11):  # past the capacity: old slots are overwritten
        p = i % 2
        grad = _grad(memory, p, rng)
        assert memory.apply_outer_gradient(p, grad) == disk.apply_outer_gradient(p, grad)
    for p in range(2):
        m, d = memory.history(p), disk.history(p)
        assert d.rounds() == m.rounds() and len(d) == len(m) == 4
        assert (d.oldest_round, d.newest_round) == (m.oldest_round, m.newest_round)
        for r in m.rounds():
            mv, dv = m.version(r), d.version(r)
            assert mv is not None and dv is not None and set(dv) == set(mv)
            for name in mv:
                assert dv[name].tobytes() == mv[name].tobytes()
                assert not dv[name].flags.writeable
        assert d.version(m.oldest_round - 1) is None
    rings.close()


def test_stale_contributions_rebase_identically_from_disk(tmp_path: Path) -> None:
    """Random data: a merge of contributions against older rounds gives the same bytes either way."""
    memory, disk, rings = _pair(tmp_path, history_len=5)
    rng = np.random.default_rng(7)
    for _ in range(6):
        grad = _grad(memory, 0, rng)
        memory.apply_outer_gradient(0, grad)
        disk.apply_outer_gradient(0, grad)
    current_round = memory.round(0)
    contributions = [
        Contribution(f"l{lag}", 0, current_round - lag,
                     {n: (0.01 * rng.standard_normal(a.shape)).astype(np.float32)
                      for n, a in memory.fragment_params(0).items()}, 8, 800)
        for lag in (0, 1, 3, 4, 6)]  # 6 rounds back is evicted from a ring of 5
    results = [merge_contributions(contributions, state.fragment_params(0), state.history(0), caps=CAPS,
                                   embedding_names=["embed/embedding"]) for state in (memory, disk)]
    assert results[0].reason == results[1].reason
    assert "4 rebased" not in results[0].reason and "3 rebased from older rounds" in results[0].reason
    assert [learner for learner, _ in results[1].rejected] == ["l6"]
    assert "evicted" in results[1].rejected[0][1]
    for name, arr in results[0].outer_gradient.items():
        assert results[1].outer_gradient[name].tobytes() == arr.tobytes()
    rings.close()


def test_a_replaced_ring_serves_only_its_newest_version(tmp_path: Path) -> None:
    """Installing a fragment makes a new ring; a merge still holding the old one is told that older
    bases are gone (a rejection by reason) instead of reading a closed or rewritten file."""
    _, disk, rings = _pair(tmp_path)
    rng = np.random.default_rng(3)
    for _ in range(3):
        disk.apply_outer_gradient(1, _grad(disk, 1, rng))
    old = disk.history(1)
    assert old.version(1) is not None
    state = disk.fragment_state(1)
    disk.install_fragment(state)
    assert disk.history(1) is not old
    assert old.version(1) is None and old.version(3) is not None
    assert disk.history(1).rounds() == (3,)
    with pytest.raises(ValueError, match="closed"):
        old.record(4, disk.fragment_params(1))
    rings.close()


def test_reads_and_writes_from_two_threads_see_whole_versions(tmp_path: Path) -> None:
    ring = DiskFragmentHistory(tmp_path, 0, 3)
    shape = (256, 64)
    ring.record(0, {"w": np.zeros(shape, np.float32)})
    errors: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for r in ring.rounds():
                version = ring.version(r)
                if version is not None and not np.all(version["w"] == np.float32(r)):
                    errors.append(f"round {r} read mixed values")

    thread = threading.Thread(target=reader)
    thread.start()
    for r in range(1, 60):
        ring.record(r, {"w": np.full(shape, r, np.float32)})
    stop.set()
    thread.join()
    ring.close()
    assert errors == []


def test_the_ring_refuses_an_older_round_or_other_tensors(tmp_path: Path) -> None:
    ring = DiskFragmentHistory(tmp_path, 2, 4)
    ring.record(5, {"w": np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError, match="not newer"):
        ring.record(5, {"w": np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError, match="other tensors"):
        ring.record(6, {"v": np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError, match="shape"):
        ring.record(6, {"w": np.ones((3, 2), np.float32)})
    assert ring.rounds() == (5,)
    ring.close()


def test_memory_history_keeps_the_current_version_by_reference() -> None:
    """The current version is the global state's own (frozen) arrays, not a copy."""
    state = GlobalState(plan_fragments(SHAPES, 2, 4, 0), _initial(), OUTER)
    state.apply_outer_gradient(0, _grad(state, 0, np.random.default_rng(0)))
    current = state.history(0).version(state.round(0))
    assert current is not None and isinstance(state.history(0), FragmentHistory)
    for name, arr in current.items():
        assert arr is state._params[0][name] and not arr.flags.writeable
