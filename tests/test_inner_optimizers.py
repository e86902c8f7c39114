"""The inner optimizers and schedules of issue 23: Muon beside AdamW, warm-up-stable-decay, and the
schedule's horizon following [run.stop]."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from diloco_node.config.manifest import (COSINE_FALLBACK_STEPS, ConfigError, InnerOptimizer, ModelSpec, RunManifest,
                                         StopSpec)
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.learn.inner import (ADAMW, MUON, InnerLearner, StackedLearners, host_learning_rate, key_path_name,
                                     make_optimizer, make_schedule, muon_label)

from conftest import byte_batches

BYTES = ModelSpec.of(seq_len=16, size="tiny")
LLAMA_TIED = ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1, d_model=64, d_ff=128,
                          tie_embeddings=True)
LLAMA_UNTIED = dataclasses.replace(LLAMA_TIED, options=tuple((k, False if k == "tie_embeddings" else v)
                                                             for k, v in LLAMA_TIED.options))
MUON_INNER = InnerOptimizer(batch_size=2, optimizer="muon", warmup_steps=2, total_steps=40)


def _muon_leaves(learner: InnerLearner) -> set[str]:
    """The parameters Muon holds a momentum for: what the partition actually routed to Muon."""
    muon_state = learner.opt_state[1].inner_states[MUON].inner_state[0]
    assert isinstance(muon_state, optax.contrib.MuonState)
    named, _ = jax.tree_util.tree_flatten_with_path(muon_state.mu)
    return {key_path_name(path) for path, _ in named}


# ------------------------------------------------------------------ which parameters Muon updates


@pytest.mark.parametrize("spec", [BYTES, LLAMA_TIED, LLAMA_UNTIED], ids=["bytes", "llama-tied", "llama-untied"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_head_norms_and_vectors(spec: ModelSpec) -> None:
    learner = InnerLearner(spec, MUON_INNER, seed=0)
    shapes = {name: value.shape for name, value in learner.get_flat().items()}
    embeddings = set(factory.embedding_names(spec, shapes))
    heads = {n for n in shapes if n.split("/")[0] in ("head", "lm_head")}
    expected = {n for n, s in shapes.items() if len(s) == 2} - embeddings - heads
    assert _muon_leaves(learner) == expected
    assert expected and all(n.startswith("blocks/") for n in expected)
    assert "embed/embedding" in shapes and "embed/embedding" not in expected  # a tied head stays AdamW too
    if spec is LLAMA_UNTIED:
        assert "lm_head/kernel" in shapes and "lm_head/kernel" not in expected
    if spec is BYTES:
        assert {"head/kernel", "pos_embed/embedding"} <= set(shapes) - expected
    # The label function itself: a matrix, an embedding, an output head, a vector.
    assert muon_label("blocks/0/mlp/up/kernel", 2, False) == MUON
    assert muon_label("embed/embedding", 2, True) == ADAMW
    assert muon_label("lm_head/kernel", 2, False) == ADAMW
    assert muon_label("unembed/kernel", 2, False) == ADAMW
    assert muon_label("blocks/0/ln1/scale", 1, False) == ADAMW
    assert muon_label("blocks/0/conv/kernel", 3, False) == ADAMW


def test_muon_steps_reduce_the_loss_and_differ_from_adamw() -> None:
    rng = np.random.default_rng(0)
    inputs, targets = (a[0] for a in byte_batches(rng, 1))
    muon = InnerLearner(BYTES, MUON_INNER, seed=0)
    adamw = InnerLearner(BYTES, dataclasses.replace(MUON_INNER, optimizer="adamw"), seed=0)
    losses = [float(muon.step(inputs, targets)) for _ in range(8)]
    for _ in range(8):
        adamw.step(inputs, targets)
    assert losses[-1] < losses[0] - 0.5, losses
    a, b = muon.get_flat(), adamw.get_flat()
    assert not np.allclose(a["blocks/0/mlp/up/kernel"], b["blocks/0/mlp/up/kernel"], atol=1e-5)


def test_stacked_muon_learners_step_together_and_masked_ones_keep_their_state_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    inputs, targets = byte_batches(rng, 3)
    stack = StackedLearners(LLAMA_TIED, MUON_INNER, num_learners=3, seed=0)
    single = InnerLearner(LLAMA_TIED, MUON_INNER, seed=0)
    before = stack.get_flat(1)
    before_opt = [np.asarray(leaf)[1].copy() for leaf in jax.tree.leaves(stack.opt_state)]
    for _ in range(3):
        losses = np.asarray(stack.step(inputs, targets, np.array([True, False, True])))
        loss = float(single.step(inputs[2], targets[2]))
    assert stack.steps.tolist() == [3, 0, 3]
    after = stack.get_flat(1)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    for old, new in zip(before_opt, jax.tree.leaves(stack.opt_state)):
        np.testing.assert_array_equal(np.asarray(new)[1], old)
    assert abs(losses[2] - loss) < 1e-4
    a, b = stack.get_flat(2), single.get_flat()
    assert max(float(np.abs(a[n] - b[n]).max()) for n in a) < 1e-4


def test_muon_learner_on_a_sharded_mesh_steps_like_the_unsharded_one() -> None:
    from diloco_node.learn.mesh import MeshShape, build_site_mesh

    mesh = build_site_mesh(MeshShape(data=1, fsdp=2), jax.devices()[:2], min_sharded_elements=1)
    inner = dataclasses.replace(MUON_INNER, batch_size=2)
    sharded = InnerLearner(LLAMA_TIED, inner, seed=0, site_mesh=mesh)
    plain = InnerLearner(LLAMA_TIED, inner, seed=0)
    rng = np.random.default_rng(2)
    for _ in range(2):
        inputs, targets = (a[0] for a in byte_batches(rng, 1))
        sharded.step(inputs, targets)
        plain.step(inputs, targets)
    a, b = sharded.get_flat(), plain.get_flat()
    assert max(float(np.abs(a[n] - b[n]).max()) for n in a) < 1e-4


def test_a_muon_learners_checkpoint_round_trips_its_optimizer_state() -> None:
    from diloco_node.learn.learner_thread import LearnerSnapshot, snapshot_from_checkpoint, snapshot_meta_and_arrays

    rng = np.random.default_rng(3)
    batches = [tuple(a[0] for a in byte_batches(rng, 1)) for _ in range(5)]
    first = InnerLearner(BYTES, MUON_INNER, seed=0)
    for inputs, targets in batches[:3]:
        first.step(inputs, targets)
    # What the learner thread writes (host copies of the leaves) and reads back.
    snap = LearnerSnapshot(step=first.steps, tokens=first.tokens, params=first.get_flat(),
                           opt_leaves=[np.asarray(leaf) for leaf in jax.tree.leaves(first.opt_state)],
                           base_rounds=[0], c_steps=[0], c_tokens=[0])
    restored = snapshot_from_checkpoint(*snapshot_meta_and_arrays(snap))
    second = InnerLearner(BYTES, MUON_INNER, seed=7)
    second.set_flat(restored.params)
    second.put_opt_leaves(restored.opt_leaves)
    for a, b in zip(jax.tree.leaves(first.opt_state), jax.tree.leaves(second.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for inputs, targets in batches[3:]:
        first.step(inputs, targets)
        second.step(inputs, targets)
    a, b = first.get_flat(), second.get_flat()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


# ------------------------------------------------------------------ the Muon keys change the update


def _two_steps(inner: InnerOptimizer) -> dict[str, np.ndarray]:
    """A hidden matrix and a bias after two steps with gradients of different sizes and directions."""
    import jax.numpy as jnp

    tx = make_optimizer(inner)
    params = {"w": jnp.full((3, 2), 1.0), "b": jnp.full((2,), 1.0)}
    state = tx.init(params)
    grads = [{"w": jnp.array([[3.0, -1.0], [0.5, 0.0], [0.2, 0.7]]), "b": jnp.array([2.0, 0.0])},
             {"w": jnp.array([[0.1, 0.2], [-0.3, 0.05], [0.4, -0.1]]), "b": jnp.array([-0.1, 0.3])}]
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return {k: np.asarray(v) for k, v in params.items()}


MUON_BASE = InnerOptimizer(optimizer="muon", warmup_steps=1, total_steps=100, lr_peak=0.01, muon_weight_decay=0.1)


@pytest.mark.parametrize("key, other", [("muon_lr_peak", 0.05), ("muon_momentum", 0.5), ("muon_weight_decay", 0.0),
                                        ("optimizer", "adamw")])
def test_the_muon_keys_change_the_matrices_update(key: str, other: object) -> None:
    base = _two_steps(MUON_BASE)
    changed = _two_steps(dataclasses.replace(MUON_BASE, **{key: other}))
    assert not np.allclose(base["w"], changed["w"], rtol=0, atol=1e-7), f"run.inner.{key} changed nothing"
    if key != "optimizer":  # the bias is AdamW's in both: the Muon keys leave it alone
        np.testing.assert_array_equal(base["b"], changed["b"])


def test_lr_peak_is_the_adamw_groups_peak_under_muon() -> None:
    base = _two_steps(MUON_BASE)
    changed = _two_steps(dataclasses.replace(MUON_BASE, lr_peak=0.05))
    np.testing.assert_array_equal(base["w"], changed["w"])
    assert not np.allclose(base["b"], changed["b"], rtol=0, atol=1e-7)


# ------------------------------------------------------------------ schedules


def test_wsd_warms_up_holds_the_peak_then_decays_linearly_over_its_last_fraction() -> None:
    inner = InnerOptimizer(lr_peak=1e-2, lr_final_fraction=0.1, warmup_steps=10, total_steps=100, schedule="wsd",
                           decay_fraction=0.2)
    lr = make_schedule(inner)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(5e-3)
    for step in (10, 50, 80):
        assert float(lr(step)) == pytest.approx(1e-2)
    assert float(lr(90)) == pytest.approx((1e-2 + 1e-3) / 2)
    assert float(lr(100)) == pytest.approx(1e-3)
    assert float(lr(500)) == pytest.approx(1e-3)  # past the horizon: the floor
    muon = make_schedule(inner, peak=0.02)  # the Muon group: the same shape at its own peak
    assert float(muon(50)) == pytest.approx(0.02) and float(muon(100)) == pytest.approx(0.002)
    longer = make_schedule(dataclasses.replace(inner, decay_fraction=0.5))
    assert float(longer(60)) < float(lr(60)) == pytest.approx(1e-2)


def test_wsd_without_a_horizon_stays_at_its_peak_and_cosine_falls_back() -> None:
    unbounded = InnerOptimizer(lr_peak=1e-2, warmup_steps=10, schedule="wsd")
    assert unbounded.horizon() == 0
    lr = make_schedule(unbounded)
    assert float(lr(5)) == pytest.approx(5e-3) and float(lr(10**6)) == pytest.approx(1e-2)
    cosine = InnerOptimizer(lr_peak=1e-2, warmup_steps=10)
    assert cosine.total_steps == 0 and cosine.horizon() == COSINE_FALLBACK_STEPS
    explicit = dataclasses.replace(cosine, total_steps=COSINE_FALLBACK_STEPS)
    for step in (0, 5, 10, 400, 999, 1000, 2000):  # the same schedule as the explicit horizon, bit for bit
        assert float(make_schedule(cosine)(step)) == float(make_schedule(explicit)(step))


@pytest.mark.parametrize("inner", [
    InnerOptimizer(lr_peak=1e-2, lr_final_fraction=0.1, warmup_steps=10, total_steps=100),
    InnerOptimizer(lr_peak=3e-4, warmup_steps=0, total_steps=7),
    InnerOptimizer(lr_peak=1e-2, warmup_steps=10),  # cosine's fallback horizon
    InnerOptimizer(lr_peak=1e-2, lr_final_fraction=0.1, warmup_steps=10, total_steps=100, schedule="wsd",
                   decay_fraction=0.2),
    InnerOptimizer(lr_peak=1e-2, warmup_steps=0, total_steps=9, schedule="wsd", decay_fraction=1.0),
    InnerOptimizer(lr_peak=1e-2, warmup_steps=10, schedule="wsd"),  # no horizon: the peak
], ids=["cosine", "cosine-no-warmup", "cosine-fallback", "wsd", "wsd-all-decay", "wsd-unbounded"])
def test_the_host_learning_rate_is_the_schedule_the_step_applies(inner: InnerOptimizer) -> None:
    """The figures' lr is read on the host with plain numbers (no device: on a multi-host site the
    default one may be another process's); it is the step's schedule, to float32 rounding."""
    for peak in (None, 0.02):
        schedule = make_schedule(inner, peak)
        for count in (0, 1, 5, 9, 10, 11, 50, 80, 90, 99, 100, 101, 999, 1000, 5000):
            rate = host_learning_rate(inner, count, peak)
            assert isinstance(rate, float)
            assert rate == pytest.approx(float(schedule(count)), rel=1e-5, abs=1e-9), (count, peak)


def test_the_stacked_learners_follow_the_wsd_schedule() -> None:
    inner = InnerOptimizer(batch_size=2, warmup_steps=1, total_steps=4, schedule="wsd", decay_fraction=0.5)
    learner = InnerLearner(BYTES, inner, seed=0)
    assert [round(learner.learning_rate(s), 6) for s in (1, 2, 3, 4, 5)] == [0.0, 0.003, 0.003, 0.00165, 0.0003]


# ------------------------------------------------------------------ the horizon follows [run.stop]


def _manifest(inner: dict, stop: dict, seq_len: int = 128) -> RunManifest:
    return RunManifest.from_dict({"model": {"seq_len": seq_len}, "inner": inner, "stop": stop})


def test_the_horizon_follows_stop_steps_and_tokens_shared_by_the_learners() -> None:
    steps = _manifest({"warmup_steps": 10}, {"steps": 3000})
    assert steps.inner_horizon()[0] == 3000 and steps.learner_inner().total_steps == 3000
    assert "stop.steps = 3000" in steps.inner_horizon()[1]
    shared = _manifest({"warmup_steps": 10, "horizon_learners": 4}, {"steps": 3001})
    assert shared.inner_horizon()[0] == 751  # a learner's share, rounded up
    # 16 x 128 = 2048 tokens per step; 4 learners share 2^24 tokens: 2048 steps each.
    tokens = _manifest({"batch_size": 16, "warmup_steps": 10, "horizon_learners": 4}, {"tokens": 1 << 24})
    assert tokens.inner_horizon()[0] == 2048 and "stop.tokens" in tokens.inner_horizon()[1]
    both = _manifest({"batch_size": 16, "warmup_steps": 10}, {"tokens": 1 << 24, "steps": 5000})
    assert both.inner_horizon()[0] == 5000  # the limit reached first
    short = _manifest({"warmup_steps": 100}, {"steps": 20})
    assert short.inner_horizon()[0] == 101  # never shorter than the warm-up
    assert short.learner_inner().total_steps == 101


def test_an_explicit_total_steps_wins_and_an_unbounded_run_keeps_the_fallbacks() -> None:
    explicit = _manifest({"total_steps": 777}, {"tokens": 1 << 30})
    assert explicit.inner_horizon() == (777, "inner.total_steps = 777")
    assert explicit.learner_inner() == explicit.inner  # bit-identical: nothing is replaced
    wall_only = _manifest({}, {"wall_s": 3600})
    assert wall_only.inner_horizon()[0] == COSINE_FALLBACK_STEPS and "falls back" in wall_only.inner_horizon()[1]
    wsd = _manifest({"schedule": "wsd"}, {})
    assert wsd.inner_horizon()[0] == 0 and wsd.learner_inner().horizon() == 0


def test_the_daemons_learner_runs_the_resolved_schedule() -> None:
    from diloco_node.daemon.site_model import build_site_model

    manifest = RunManifest(model=ModelSpec.of(seq_len=16, size="tiny"),
                           inner=InnerOptimizer(batch_size=2, warmup_steps=2, schedule="wsd", decay_fraction=0.5),
                           stop=StopSpec(steps=20))
    site = build_site_model(manifest, learner=True)
    assert manifest.inner.total_steps == 0 and manifest.learner_inner().total_steps == 20
    assert site.inner.learning_rate(11) == pytest.approx(3e-3)  # update 11 runs at count 10: the decay's start
    assert site.inner.learning_rate(12) < 3e-3  # decaying over the last half of the 20 steps
    assert site.inner.learning_rate(21) == pytest.approx(3e-4)


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize("key, value, message", [
    ("optimizer", "sgd", "inner.optimizer = 'sgd': must be one of adamw, muon"),
    ("schedule", "linear", "inner.schedule = 'linear': must be one of cosine, wsd"),
    ("decay_fraction", 0.0, "inner.decay_fraction = 0.0"),
    ("decay_fraction", 1.5, "inner.decay_fraction = 1.5"),
    ("horizon_learners", 0, "inner.horizon_learners = 0"),
    ("total_steps", -1, "inner.total_steps = -1"),
    ("muon_lr_peak", 0.0, "inner.muon_lr_peak = 0.0"),
    ("muon_momentum", 1.0, "inner.muon_momentum = 1.0"),
    ("muon_weight_decay", -0.1, "inner.muon_weight_decay = -0.1"),
    ("optimizer", 1, "inner.optimizer = 1: must be a string"),
])
def test_bad_inner_values_are_config_errors_naming_the_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        RunManifest.from_dict({"inner": {key: value}})


def test_params_tree_paths_name_the_flat_parameters() -> None:
    _, params = factory.init_params(factory.recipe(BYTES), 0)
    named, _ = jax.tree_util.tree_flatten_with_path(params)
    assert sorted(key_path_name(path) for path, _ in named) == sorted(model_lib.flat_params(params))
