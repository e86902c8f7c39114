"""The synthetic learner (learn/synthetic_learner.py): the fragment schedule, random deltas of the
model's shapes with a real learner's counters, the apply rule's counter resets, checkpoints of
counters only, its step rate, and the `[node]` keys that select it."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from diloco_node.config.settings import ConfigError, load_config
from diloco_node.learn.learner_thread import DueFragment
from diloco_node.learn.synthetic_learner import DELTA_SCALE, SYNTHETIC_LOSS, SyntheticLearner
from diloco_node.sync.fragments import plan_fragments

SHAPES = {"embed/embedding": (64, 16), "blocks/0/mlp/kernel": (16, 32), "blocks/0/attn/kernel": (16, 16),
          "head/kernel": (16, 64)}


def _manifest(**extra: str):
    overrides = {"run.model.size": "tiny", "run.model.seq_len": "32", "run.inner.batch_size": "4",
                 "run.sync.fragments": "2", "run.sync.period": "8", **extra}
    return load_config(None, {}, overrides).run


def _learner(sent: list[DueFragment], progress: list[tuple[int, float, int]] | None = None,
             steps_per_s: float = 1000.0, **extra: str) -> SyntheticLearner:
    manifest = _manifest(**extra)
    plan = plan_fragments(SHAPES, manifest.sync.fragments, manifest.sync.period, manifest.sync.overlap)
    return SyntheticLearner(node_id="s1", manifest=manifest, plan=plan, shapes=SHAPES, global_rounds=[0, 0],
                            on_contribution=sent.append,
                            on_progress=lambda *a: progress.append(a) if progress is not None else None,
                            steps_per_s=steps_per_s)


def test_due_fragments_are_sent_on_the_schedule_with_the_fragments_shapes_and_real_counters() -> None:
    sent: list[DueFragment] = []
    progress: list[tuple[int, float, int]] = []
    learner = _learner(sent, progress)
    for _ in range(16):
        learner.step_once()
    plan = learner.plan
    expected = [(step, p) for step in range(1, 17) for p in plan.due(step)]
    assert [(d.step, d.fragment) for d in sent] == expected and len(expected) == 4
    tokens_per_step = 4 * 32
    for due in sent:
        names = plan.fragments[due.fragment].names
        assert set(due.delta) == set(names)
        for name, values in due.delta.items():
            assert values.shape == SHAPES[name] and values.dtype == np.float32
            assert np.all(np.isfinite(values)) and 0.5 * DELTA_SCALE < float(values.std()) < 2 * DELTA_SCALE
        # No offer was taken: counters run from the start, as a real learner's do.
        assert due.c_steps == due.step and due.c_tokens == due.step * tokens_per_step and due.base_round == 0
    assert progress[-1] == (16, SYNTHETIC_LOSS, 16 * tokens_per_step)
    # Fresh draws every time: two sends of one fragment differ.
    first, second = [d for d in sent if d.fragment == sent[0].fragment][:2]
    name = next(iter(first.delta))
    assert not np.array_equal(first.delta[name], second.delta[name])


def test_a_newer_offer_becomes_the_base_and_restarts_the_counters_an_older_one_is_ignored() -> None:
    sent: list[DueFragment] = []
    learner = _learner(sent)
    for _ in range(3):
        learner.step_once()
    learner.offer_fragment(1, 2, {}, contributors={"s1"})
    learner.offer_fragment(1, 1, {})  # older than the pending offer: ignored
    learner.take_offers()
    assert learner.base_rounds == [0, 2] and learner.c_steps == [3, 0] and learner.c_tokens[1] == 0
    learner.offer_fragment(1, 2, {})  # not newer than the base: ignored
    learner.step_once()
    learner.take_offers()
    assert learner.c_steps == [4, 1]
    for _ in range(8):
        learner.step_once()
    due = [d for d in sent if d.fragment == 1]
    assert due and due[-1].base_round == 2 and due[-1].c_steps == due[-1].step - 3


def test_keep_unmerged_keeps_the_counters_when_the_merge_did_not_include_this_learner() -> None:
    learner = _learner([], **{"run.sync.keep_unmerged": "true"})
    for _ in range(3):
        learner.step_once()
    learner.offer_fragment(0, 1, {}, contributors={"other"})
    learner.offer_fragment(1, 1, {}, contributors={"s1"})
    learner.take_offers()
    assert learner.base_rounds == [1, 1] and learner.c_steps == [3, 0]


def test_a_checkpoint_holds_counters_and_no_weights_and_restores_them() -> None:
    learner = _learner([])
    for _ in range(5):
        learner.step_once()
    snap = learner.request_state().result(timeout=1)  # not started: answered at once
    assert (snap.step, snap.tokens, snap.c_steps) == (5, 5 * 128, [5, 5])
    assert snap.params == {} and snap.opt_leaves == []
    other = _learner([])
    other.restore(snap)
    assert (other.steps, other.tokens, other.c_steps) == (5, 640, [5, 5])


def test_the_thread_steps_at_its_rate_and_stops() -> None:
    sent: list[DueFragment] = []
    learner = _learner(sent, steps_per_s=40.0)
    learner.start()
    learner.begin_training()
    time.sleep(1.0)
    snap = learner.request_state().result(timeout=5)
    learner.stop()
    learner.join(5)
    assert not learner.is_alive() and learner.error is None
    # 40 steps/s for ~1 s; wide bounds: the machine is shared.
    assert 15 <= snap.step <= 45, snap.step
    assert learner.stopped_at_step is not None and learner.stopped_at_step >= snap.step
    assert len(sent) == learner.contributions >= 2 * (snap.step // 8)


def test_a_rate_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="synthetic_steps_per_s"):
        _learner([], steps_per_s=0.0)


def test_the_node_keys_select_the_synthetic_learner_and_bad_values_are_config_errors() -> None:
    node = load_config(None, {}, {"learner": "synthetic", "synthetic_steps_per_s": "2.5"}).node
    assert (node.learner, node.synthetic_steps_per_s) == ("synthetic", 2.5)
    assert load_config(None, {}, {}).node.learner == "jax"
    with pytest.raises(ConfigError, match="learner = 'fake': must be one of jax, synthetic"):
        load_config(None, {}, {"learner": "fake"})
    with pytest.raises(ConfigError, match="synthetic_steps_per_s = 0.0: must be a positive"):
        load_config(None, {}, {"synthetic_steps_per_s": "0"})


def test_a_training_learner_restarted_on_a_synthetic_checkpoint_starts_from_the_global_state() -> None:
    from diloco_node.daemon.persistence import learner_to_resume
    from diloco_node.learn.learner_thread import snapshot_from_checkpoint, snapshot_meta_and_arrays

    learner = _learner([])
    learner.adopt_global({}, [3, 4])
    # the checkpoint's learner part, written and read back as the daemon does
    meta, arrays = snapshot_meta_and_arrays(learner.request_state().result(timeout=5))
    assert arrays == {}  # counters only: a synthetic learner has no weights to keep
    snapshot = snapshot_from_checkpoint(meta, arrays)
    assert snapshot.base_rounds == [3, 4]
    assert learner_to_resume(snapshot, "jax", "s1") is None  # nothing to resume: start from the global state
    assert learner_to_resume(snapshot, "synthetic", "s1") is snapshot  # its own counters resume
    trained = dataclasses.replace(snapshot, params={"w": np.zeros(2, np.float32)})
    assert learner_to_resume(trained, "jax", "s1") is trained
    assert learner_to_resume(None, "jax", "s1") is None
