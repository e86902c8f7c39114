"""The learner's inner optimisation: a jitted AdamW step (warm-up then cosine) with donated buffers.

Two shapes of the same step:
- `InnerLearner`: one learner (a site's local model), as the daemon and data-parallel use it.
- `StackedLearners`: M learners with stacked parameters and optimizer states, stepped by ONE
  jitted `vmap`ped call with a per-learner mask (learners that are not stepping on this tick,
  e.g. a straggler mid-step or a learner that is down, keep their state bit for bit). On two CPU
  cores this makes an M-learner tick cost about one data-parallel step.

Losses come back as device arrays so the caller can fetch them later without stalling the
pipeline; tokens are counted exactly on the host (every target byte of every stepped batch).
Parameters cross the boundary as flat `dict[str, np.ndarray]` (see `model.flat_params`).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from diloco_node.config.manifest import InnerOptimizer, ModelSpec
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib


def make_schedule(inner: InnerOptimizer) -> optax.Schedule:
    """Linear warm-up from 0 to `lr_peak`, then cosine down to `lr_peak * lr_final_fraction`.

    Past `total_steps` the rate stays at the final value (a fast learner may outrun the horizon).
    """
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=inner.lr_peak,
        warmup_steps=inner.warmup_steps,
        decay_steps=inner.total_steps,
        end_value=inner.lr_peak * inner.lr_final_fraction,
    )


def make_optimizer(inner: InnerOptimizer) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW; weight decay only on matrices (not norms, biases)."""
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(inner.grad_clip_norm),
        optax.adamw(make_schedule(inner), b1=inner.b1, b2=inner.b2, weight_decay=inner.weight_decay, mask=decay_mask),
    )


def _train_step_fn(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> Callable:
    """The pure single-learner step: (params, opt_state, inputs, targets) -> (params, opt_state, loss)."""

    def step(params, opt_state, inputs_BxL, targets_BxL):
        loss, grads = jax.value_and_grad(model_lib.loss_fn, argnums=1)(graphdef, params, inputs_BxL, targets_BxL)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return step


@functools.lru_cache(maxsize=16)
def _compiled_single_step(model: ModelSpec, inner: InnerOptimizer) -> Callable:
    """One jitted step per (model, optimizer) per process: later runs reuse its compilation."""
    graphdef = factory.graphdef_of(model)
    return jax.jit(_train_step_fn(graphdef, make_optimizer(inner)), donate_argnums=(0, 1))


@functools.lru_cache(maxsize=16)
def _compiled_masked_step(model: ModelSpec, inner: InnerOptimizer) -> Callable:
    """The vmapped, masked M-learner step (M comes from the input shapes), compiled once per model."""
    graphdef = factory.graphdef_of(model)
    single = _train_step_fn(graphdef, make_optimizer(inner))

    def masked_step(params, opt_state, inputs_MxBxL, targets_MxBxL, mask_M):
        new_params, new_opt, loss_M = jax.vmap(single)(params, opt_state, inputs_MxBxL, targets_MxBxL)

        def keep(new, old):
            if not hasattr(new, "ndim") or new.ndim == 0:
                return new
            return jnp.where(mask_M.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)

        return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state), loss_M

    return jax.jit(masked_step, donate_argnums=(0, 1))


class InnerLearner:
    """One learner's local model and AdamW state, stepped by a jitted function with donated buffers."""

    def __init__(self, model: ModelSpec, inner: InnerOptimizer, seed: int,
                 initial: Mapping[str, np.ndarray] | None = None):
        model = factory.recipe(model)
        graphdef, params = factory.init_params(model, seed)
        if initial is not None:
            params = model_lib.load_flat_params(params, initial)
        self.graphdef = graphdef
        self.params = params
        self.tx = make_optimizer(inner)
        self.opt_state = self.tx.init(params)
        self.steps = 0
        self.tokens = 0
        self._step = _compiled_single_step(model, inner)

    def step(self, inputs_BxL: np.ndarray, targets_BxL: np.ndarray) -> jax.Array:
        """One AdamW step; returns the loss as a device array (fetch it when convenient)."""
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, inputs_BxL, targets_BxL)
        self.steps += 1
        self.tokens += int(np.size(targets_BxL))
        return loss

    def compile_step(self, inputs_BxL: np.ndarray, targets_BxL: np.ndarray) -> None:
        """Compile the jitted step by running it once on throw-away copies (the state is untouched:
        the step donates its inputs, so it must not see the real buffers)."""
        params = jax.tree.map(jnp.copy, self.params)
        opt_state = jax.tree.map(jnp.copy, self.opt_state)
        _, _, loss = self._step(params, opt_state, inputs_BxL, targets_BxL)
        jax.block_until_ready(loss)

    def get_flat(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        flat = model_lib.flat_params(self.params)
        return flat if names is None else {name: flat[name] for name in names}

    def set_flat(self, flat: Mapping[str, np.ndarray]) -> None:
        """Overwrite the named tensors (e.g. a merged global fragment); the AdamW state is kept."""
        self.params = model_lib.load_flat_params(self.params, flat)


class StackedLearners:
    """M learners in one stacked pytree; `step` advances the masked subset in one vmapped call."""

    def __init__(self, model: ModelSpec, inner: InnerOptimizer, num_learners: int, seed: int,
                 initial: Mapping[str, np.ndarray] | None = None):
        model = factory.recipe(model)
        if num_learners < 1:
            raise ValueError(f"num_learners = {num_learners}: must be >= 1")
        graphdef, params = factory.init_params(model, seed)
        if initial is not None:
            params = model_lib.load_flat_params(params, initial)
        self.graphdef = graphdef
        self.num_learners = num_learners
        self.tx = make_optimizer(inner)
        opt_state = self.tx.init(params)
        stack = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * num_learners), tree)  # noqa: E731
        self.params = stack(params)
        self.opt_state = stack(opt_state)
        self.steps = np.zeros(num_learners, dtype=np.int64)
        self.tokens = np.zeros(num_learners, dtype=np.int64)
        # Path tuples of every parameter, so flat names map to leaves of the stacked state.
        self._paths = {model_lib.path_name(path): path for path, _ in nnx.to_flat_state(params)}
        self._step = _compiled_masked_step(model, inner)

    def step(self, inputs_MxBxL: np.ndarray, targets_MxBxL: np.ndarray, mask_M: np.ndarray) -> jax.Array:
        """Step the learners where `mask_M` is True; returns per-learner losses (device array).

        Rows of masked-out learners still need a (any) batch of the right shape; their state is
        left untouched and their loss is meaningless.
        """
        mask_M = np.asarray(mask_M, dtype=bool)
        self.params, self.opt_state, loss_M = self._step(self.params, self.opt_state, inputs_MxBxL, targets_MxBxL, mask_M)
        tokens_per_learner = int(np.prod(np.shape(targets_MxBxL)[1:]))
        self.steps += mask_M
        self.tokens += mask_M * tokens_per_learner
        return loss_M

    def _leaf(self, name: str) -> nnx.Variable:
        node = self.params
        for part in self._paths[name]:
            node = node[part]
        return node

    def get_flat(self, learner: int, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Host copies of learner `learner`'s named parameters (all when `names` is None)."""
        names = list(self._paths) if names is None else list(names)
        return {name: np.array(np.asarray(self._leaf(name)[...])[learner], dtype=np.float32) for name in names}

    def set_flat(self, learner: int, flat: Mapping[str, np.ndarray]) -> None:
        """Overwrite learner `learner`'s named tensors; its AdamW state is kept (as DiLoCo does)."""
        for name, value in flat.items():
            if name not in self._paths:
                raise KeyError(f"unknown parameter name: {name}")
            leaf = self._leaf(name)
            # Edited on the host: a device scatter would compile once per tensor shape.
            stacked = np.array(leaf[...], dtype=np.float32)
            if tuple(stacked.shape[1:]) != tuple(np.shape(value)):
                raise ValueError(f"parameter {name}: shape {np.shape(value)} != expected {tuple(stacked.shape[1:])}")
            stacked[learner] = value
            leaf[...] = jnp.asarray(stacked)

    def learner_params(self, learner: int) -> nnx.State:
        """Learner `learner`'s parameters as an (unstacked) State, e.g. for evaluation."""
        return jax.tree.map(lambda x: x[learner], self.params)
