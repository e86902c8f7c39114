"""The inner AdamW step: masking of the stacked learners, exact token counts, flat get/set."""

import numpy as np

from diloco_node.learn.inner import InnerLearner, StackedLearners, make_schedule
from diloco_node.config.manifest import InnerOptimizer, ModelSpec

from conftest import byte_batches

CFG = ModelSpec.of(seq_len=16, size="tiny")
INNER = InnerOptimizer(batch_size=2, lr_peak=3e-3, warmup_steps=4, total_steps=24)


def test_masked_learners_keep_their_state_and_tokens_are_counted_exactly():
    stack = StackedLearners(CFG, INNER, num_learners=3, seed=0)
    before = [stack.get_flat(m) for m in range(3)]
    rng = np.random.default_rng(0)
    inputs, targets = byte_batches(rng, 3)
    stack.step(inputs, targets, np.array([True, False, True]))
    stack.step(inputs, targets, np.array([True, False, False]))
    assert stack.tokens.tolist() == [2 * 2 * 16, 0, 2 * 16]
    assert stack.steps.tolist() == [2, 0, 1]
    after = [stack.get_flat(m) for m in range(3)]
    for name in before[1]:
        np.testing.assert_array_equal(after[1][name], before[1][name])
    assert any(not np.array_equal(after[0][n], before[0][n]) for n in before[0])
    assert any(not np.array_equal(after[0][n], after[2][n]) for n in before[0])


def test_stacked_step_matches_a_single_learner():
    rng = np.random.default_rng(1)
    inputs, targets = byte_batches(rng, 3)
    stack = StackedLearners(CFG, INNER, num_learners=3, seed=0)
    single = InnerLearner(CFG, INNER, seed=0)
    for _ in range(3):
        losses = np.asarray(stack.step(inputs, targets, np.array([True, True, True])))
        loss = float(single.step(inputs[1], targets[1]))
    assert abs(losses[1] - loss) < 1e-4
    a, b = stack.get_flat(1), single.get_flat()
    assert max(float(np.abs(a[n] - b[n]).max()) for n in a) < 1e-4
    assert single.tokens == 3 * 2 * 16 and single.steps == 3


def test_set_flat_overwrites_one_learner_only():
    stack = StackedLearners(CFG, INNER, num_learners=3, seed=0)
    value = np.full_like(stack.get_flat(0, ["head/kernel"])["head/kernel"], 0.5)
    stack.set_flat(1, {"head/kernel": value})
    np.testing.assert_array_equal(stack.get_flat(1, ["head/kernel"])["head/kernel"], value)
    assert not np.array_equal(stack.get_flat(0, ["head/kernel"])["head/kernel"], value)


def test_schedule_warms_up_then_decays_to_the_final_fraction():
    schedule = make_schedule(INNER)
    assert float(schedule(0)) == 0.0
    assert abs(float(schedule(4)) - 3e-3) < 1e-9
    assert abs(float(schedule(24)) - 3e-4) < 1e-9
    assert abs(float(schedule(100)) - 3e-4) < 1e-9  # a fast learner past the horizon stays at the floor
    assert float(schedule(10)) > float(schedule(20))


def test_each_step_reports_its_gradient_norm_before_clipping_and_its_learning_rate():
    import jax
    import optax

    from diloco_node.learn import factory
    from diloco_node.learn import model as model_lib

    clipped = InnerOptimizer(batch_size=2, lr_peak=3e-3, warmup_steps=4, total_steps=24, grad_clip_norm=1e-3)
    learner = InnerLearner(CFG, clipped, seed=0)
    assert learner.last_grad_norm is None
    x, y = (a[0] for a in byte_batches(np.random.default_rng(0), 1))
    before = learner.params
    graphdef = factory.graphdef_of(CFG)
    # Jitted: run eagerly, op by op, the reference gradient costs more compiling than the step itself.
    reference_grads = jax.jit(lambda params, x, y: jax.grad(model_lib.loss_fn, argnums=1)(graphdef, params, x, y))
    grads = reference_grads(jax.tree.map(np.asarray, before), x, y)
    expected = float(optax.tree.norm(grads))
    learner.step(x, y)
    # The norm is the raw gradient's, far above the clip it was clipped to.
    assert expected > 100 * clipped.grad_clip_norm
    assert np.isclose(float(learner.last_grad_norm), expected, rtol=1e-4)
    schedule = make_schedule(clipped)
    assert learner.learning_rate(1) == float(schedule(0)) == 0.0  # the first update of the warm-up
    # computed on the host in float64 (learn/inner.py `host_learning_rate`), the step's in float32
    assert np.isclose(learner.learning_rate(5), float(schedule(4)), rtol=1e-6)
    assert np.isclose(learner.learning_rate(5), clipped.lr_peak)
