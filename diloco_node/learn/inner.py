"""The learner's inner optimisation: a jitted AdamW or Muon step (warm-up, then cosine or WSD) with donated buffers.

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
import math
from typing import Any, Callable, Collection, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from diloco_node.config.manifest import InnerOptimizer, ModelSpec
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.learn import stacked_rows
from diloco_node.learn.mesh import SiteMesh
from diloco_node.learn.packed_state import Packing, packing_of
from diloco_node.sync.fragments import is_embedding


def make_schedule(inner: InnerOptimizer, peak: float | None = None) -> optax.Schedule:
    """The learning rate at each optimizer count: a linear warm-up from 0 to `peak` (default
    `lr_peak`), then `inner.schedule`'s shape over `inner.horizon()` steps down to
    `peak * lr_final_fraction`:

    - "cosine": cosine decay from the end of the warm-up to the horizon;
    - "wsd": stable at the peak, then a linear decay over the last `decay_fraction` of the horizon
      (never before the warm-up ends); with no horizon (0) it stays at the peak.

    Past the horizon the rate stays at the final value (a fast learner may outrun it).
    """
    peak = inner.lr_peak if peak is None else peak
    floor = peak * inner.lr_final_fraction
    horizon = inner.horizon()
    if inner.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=inner.warmup_steps,
                                                  decay_steps=horizon, end_value=floor)
    warmup = inner.warmup_steps
    decay_start = _wsd_decay_start(inner)

    def warmup_stable_decay(count: Any) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        rate = peak * (jnp.minimum(1.0, step / warmup) if warmup else jnp.ones((), jnp.float32))
        if decay_start is None:
            return rate
        # 0 until decay_start, 1 from the horizon on; decay_start >= warmup, so the warm-up is over.
        decayed = jnp.clip((step - decay_start) / max(horizon - decay_start, 1), 0.0, 1.0)
        return rate + (floor - peak) * decayed

    return warmup_stable_decay


def _wsd_decay_start(inner: InnerOptimizer) -> int | None:
    """The optimizer count where "wsd" starts its decay (None: no horizon, no decay)."""
    horizon = inner.horizon()
    return max(inner.warmup_steps, horizon - round(inner.decay_fraction * horizon)) if horizon else None


def host_learning_rate(inner: InnerOptimizer, count: int, peak: float | None = None) -> float:
    """`make_schedule(inner, peak)(count)` in plain Python numbers: no JAX array and no device.

    The training thread reads the rate for its figures: a JAX evaluation would land on a device,
    which on a multi-host site may be another process's (its value cannot be fetched there) and
    on an accelerator queues behind the step in flight. The same formulas as `make_schedule`
    (optax's warm-up + cosine, our "wsd"), in float64 where the step's are float32.
    """
    peak = inner.lr_peak if peak is None else peak
    floor = peak * inner.lr_final_fraction
    horizon, warmup = inner.horizon(), inner.warmup_steps
    if count < warmup:
        return peak * count / warmup
    if inner.schedule == "cosine":
        alpha = 0.0 if peak == 0.0 else floor / peak
        decay = horizon - warmup
        done = min(count - warmup, decay)
        return peak * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * done / decay)) + alpha)
    decay_start = _wsd_decay_start(inner)
    if decay_start is None:
        return peak
    decayed = min(1.0, max(0.0, (count - decay_start) / max(horizon - decay_start, 1)))
    return peak + (floor - peak) * decayed


MUON, ADAMW = "muon", "adamw"


def is_output_head(name: str) -> bool:
    """True for the output projection: its top-level module is named "head", "*head" ("lm_head")
    or "unembed*" (the built-in models' "head/kernel" and "lm_head/kernel")."""
    first = name.split("/", 1)[0].lower()
    return first.endswith("head") or first.startswith("unembed")


def muon_label(name: str, ndim: int, embedding: bool) -> str:
    """Which group of `inner.optimizer = "muon"` updates a parameter: Muon for the hidden 2-D
    matrices; AdamW for the embedding tables (`embedding`: the model declares it one, so a tied
    embedding that doubles as the output head too), the output head, and every tensor that is
    not 2-D (norm scales, biases). Muon orthogonalises a matrix's update as a linear map between
    hidden spaces; an embedding lookup or the logits' projection is not one (as in MuLoCo)."""
    if ndim != 2 or embedding or is_output_head(name):
        return ADAMW
    return MUON


def key_path_name(path: tuple) -> str:
    """The flat parameter name ("blocks/0/attn/out/kernel") of a leaf's JAX key path, as
    `model.flat_params` names it (the Variable's `.value` attribute is not part of it)."""
    keys = [k for k in path if not isinstance(k, jax.tree_util.GetAttrKey)]
    return "/".join(str(k.key if hasattr(k, "key") else k.idx) for k in keys)


def _scale_by_width() -> optax.GradientTransformation:
    """Muon's update of a (fan_in, fan_out) matrix times sqrt(max(1, fan_out / fan_in)) (optax's
    default for Muon), so wide outputs move as much per unit as narrow ones."""
    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u: u * jnp.sqrt(jnp.maximum(1.0, u.shape[1] / u.shape[0])), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(inner: InnerOptimizer, embeddings: Collection[str] | None = None) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW ("adamw") or Muon with AdamW beside it ("muon").

    AdamW decays only matrices (not norms, biases). With Muon, `muon_label` splits the parameters;
    `embeddings` names the embedding tables (default: the names `sync.fragments.is_embedding`
    recognises; the learners pass their model's declaration).
    """
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(make_schedule(inner), b1=inner.b1, b2=inner.b2, weight_decay=inner.weight_decay,
                        mask=decay_mask)
    if inner.optimizer == ADAMW:
        return optax.chain(optax.clip_by_global_norm(inner.grad_clip_norm), adamw)

    is_table = is_embedding if embeddings is None else frozenset(embeddings).__contains__

    def label(path: tuple, leaf: Any) -> str:
        name = key_path_name(path)
        return muon_label(name, leaf.ndim, is_table(name))

    labels = functools.partial(jax.tree_util.tree_map_with_path, label)

    # Inside the partition the Muon chain sees its own leaves only (the others are masked out):
    # every one is a 2-D matrix, orthogonalised as (fan_in, fan_out).
    dimension_numbers = lambda updates: jax.tree.map(lambda _: MuonDimensionNumbers(), updates)  # noqa: E731
    muon = optax.chain(
        scale_by_muon(beta=inner.muon_momentum, weight_dimension_numbers=dimension_numbers),
        _scale_by_width(),
        optax.add_decayed_weights(inner.muon_weight_decay),
        optax.scale_by_learning_rate(make_schedule(inner, inner.muon_lr_peak)),
    )
    return optax.chain(optax.clip_by_global_norm(inner.grad_clip_norm),
                       optax.partition({MUON: muon, ADAMW: adamw}, labels))


@functools.lru_cache(maxsize=16)
def _optimizer(model: ModelSpec, inner: InnerOptimizer) -> optax.GradientTransformation:
    """The learner's optimizer for this model: Muon's groups from the model's declared embeddings."""
    if inner.optimizer == ADAMW:
        return make_optimizer(inner)
    _, abstract = factory.abstract_model(factory.recipe(model))
    return make_optimizer(inner, frozenset(factory.embedding_names(model, model_lib.param_shapes(abstract))))


def _train_step_fn(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, microbatches: int = 1,
                   microbatch_sharding: jax.sharding.Sharding | None = None) -> Callable:
    """The pure single-learner step: (params, opt_state, inputs, targets) -> (params, opt_state,
    loss, grad_norm).

    With `microbatches` > 1 the batch's gradient is accumulated over equal microbatches in a
    `lax.scan` (one microbatch's activations live at a time); the mean of their losses and
    gradients is the whole batch's, so the update is the same up to float rounding.
    """
    grad_fn = jax.value_and_grad(model_lib.loss_fn, argnums=1)

    def batch_loss_and_grads(params, inputs_BxL, targets_BxL):
        if microbatches == 1:
            return grad_fn(graphdef, params, inputs_BxL, targets_BxL)
        M = microbatches
        B, L = inputs_BxL.shape

        def split(tokens_BxL):
            # Microbatch m takes rows m, M + m, 2M + m, ...: each device's contiguous rows of the
            # batch stay on that device, so every microbatch spans every device (no resharding).
            tokens_MxbxL = tokens_BxL.reshape(B // M, M, L).swapaxes(0, 1)
            if microbatch_sharding is not None:
                tokens_MxbxL = jax.lax.with_sharding_constraint(tokens_MxbxL, microbatch_sharding)
            return tokens_MxbxL

        def accumulate(carry, batch):
            loss_sum, grad_sum = carry
            loss, grads = grad_fn(graphdef, params, batch[0], batch[1])
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss_sum, grad_sum), _ = jax.lax.scan(accumulate, zeros, (split(inputs_BxL), split(targets_BxL)))
        return loss_sum / M, jax.tree.map(lambda g: g / M, grad_sum)

    def step(params, opt_state, inputs_BxL, targets_BxL):
        loss, grads = batch_loss_and_grads(params, inputs_BxL, targets_BxL)
        # The batch gradient's global norm before clipping: what an engineer watches for spikes
        # (the clip in `make_optimizer` hides them from the update, not from this figure).
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, grad_norm

    return step


def _over_buffers(step: Callable, param_def: Any, opt_def: Any, param_packing: Packing,
                  opt_packing: Packing) -> Callable:
    """`step` over the packed buffers of the parameters and the optimizer state (learn/packed_state.py):
    the leaves are sliced out and each tree rebuilt from its treedef inside the trace, and the new
    leaves flattened and packed again on the way out.

    Why: a flax NNX State's leaves sit in `Variable` nodes that JAX flattens and rebuilds in Python
    at every call of a jitted function (about 0.02 ms per leaf), and even a list of arrays costs
    the call about 2 µs per array in and out; a few buffers cost neither. The computation is the
    same (same leaves, same order).
    """
    def flat_step(param_buffers, opt_buffers, inputs_BxL, targets_BxL):
        params, opt_state, loss, grad_norm = step(jax.tree.unflatten(param_def, param_packing.leaves(param_buffers)),
                                                  jax.tree.unflatten(opt_def, opt_packing.leaves(opt_buffers)),
                                                  inputs_BxL, targets_BxL)
        new_params, new_param_def = jax.tree.flatten(params)
        new_opt, new_opt_def = jax.tree.flatten(opt_state)
        if new_param_def != param_def or new_opt_def != opt_def:  # at trace time only
            raise AssertionError("the step changed the structure of the parameters or the optimizer state")
        return param_packing.buffers(new_params), opt_packing.buffers(new_opt), loss, grad_norm

    return flat_step


def _state_defs(model: ModelSpec, inner: InnerOptimizer) -> tuple[Any, Any]:
    """The treedefs of the model's parameters and of its optimizer state."""
    _, abstract = factory.abstract_model(factory.recipe(model))
    return jax.tree.structure(abstract), jax.tree.structure(jax.eval_shape(_optimizer(model, inner).init, abstract))


@functools.lru_cache(maxsize=16)
def _packings(model: ModelSpec, inner: InnerOptimizer, site_mesh: SiteMesh | None) -> tuple[Packing, Packing]:
    """How the parameters and the optimizer state are packed (learn/packed_state.py), on one device
    (`site_mesh` None) or by the mesh's layout rule."""
    _, abstract = factory.abstract_model(factory.recipe(model))
    opt_abstract = jax.eval_shape(_optimizer(model, inner).init, abstract)
    if site_mesh is None:
        return packing_of(abstract), packing_of(opt_abstract)
    replicated = site_mesh.replicated()
    return (packing_of(abstract, site_mesh.tree_shardings(abstract), replicated),
            packing_of(opt_abstract, site_mesh.tree_shardings(opt_abstract), replicated))


@functools.lru_cache(maxsize=16)
def _compiled_single_step(model: ModelSpec, inner: InnerOptimizer) -> Callable:
    """One jitted step over packed buffers (`_over_buffers`) per (model, optimizer) per process:
    later runs reuse its compilation."""
    graphdef = factory.graphdef_of(model)
    return jax.jit(_over_buffers(_train_step_fn(graphdef, _optimizer(model, inner)), *_state_defs(model, inner),
                                 *_packings(model, inner, None)), donate_argnums=(0, 1))


@functools.lru_cache(maxsize=16)
def _compiled_mesh_step(model: ModelSpec, inner: InnerOptimizer, site_mesh: SiteMesh) -> tuple[Callable, Callable]:
    """(step, init) on a site's mesh: the step over packed buffers (`_over_buffers`) with every input
    and output's sharding fixed by the layout rule (parameters and moments keep their layout step
    after step, so a fragment written back with its leaf's sharding never recompiles it), and the
    optimizer's init with the same."""
    _, abstract = factory.abstract_model(factory.recipe(model))
    graphdef = factory.execution_graphdef(factory.recipe(model), site_mesh.attention, site_mesh.remat)
    tx = _optimizer(model, inner)
    param_shardings = site_mesh.tree_shardings(abstract)
    opt_shardings = site_mesh.tree_shardings(jax.eval_shape(tx.init, abstract))
    param_packing, opt_packing = _packings(model, inner, site_mesh)
    param_buffers, opt_buffers = list(param_packing.buffer_shardings), list(opt_packing.buffer_shardings)
    batch = site_mesh.batch_sharding()
    step = jax.jit(_over_buffers(_train_step_fn(graphdef, tx, site_mesh.microbatches, site_mesh.microbatch_sharding()),
                                 *_state_defs(model, inner), param_packing, opt_packing),
                   in_shardings=(param_buffers, opt_buffers, batch, batch),
                   out_shardings=(param_buffers, opt_buffers, site_mesh.replicated(), site_mesh.replicated()),
                   donate_argnums=(0, 1))
    init = jax.jit(tx.init, in_shardings=(param_shardings,), out_shardings=opt_shardings)
    return step, init


@functools.lru_cache(maxsize=16)
def _compiled_masked_step(model: ModelSpec, inner: InnerOptimizer) -> Callable:
    """The vmapped, masked M-learner step (M comes from the input shapes), compiled once per model."""
    graphdef = factory.graphdef_of(model)
    single = _train_step_fn(graphdef, _optimizer(model, inner))

    def masked_step(params, opt_state, inputs_MxBxL, targets_MxBxL, mask_M):
        new_params, new_opt, loss_M, _ = jax.vmap(single)(params, opt_state, inputs_MxBxL, targets_MxBxL)

        def keep(new, old):
            if not hasattr(new, "ndim") or new.ndim == 0:
                return new
            return jnp.where(mask_M.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)

        return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state), loss_M

    return jax.jit(masked_step, donate_argnums=(0, 1))


def _placed_params(abstract: nnx.State, initial: Mapping[str, np.ndarray], site_mesh: SiteMesh) -> nnx.State:
    """The parameters from host values, each tensor placed straight onto its shards (never whole on
    one device first); every parameter must be given."""
    shapes = model_lib.param_shapes(abstract)
    missing = sorted(set(shapes) - set(initial))
    if missing:
        raise KeyError(f"initial values missing for parameter(s): {', '.join(missing[:5])}")
    placed = {}
    for name, shape in shapes.items():
        value = np.asarray(initial[name], dtype=np.float32)
        if value.shape != shape:
            raise ValueError(f"parameter {name}: shape {value.shape} != expected {shape}")
        placed[name] = site_mesh.put(value, site_mesh.param_sharding(shape))
    return model_lib.load_flat_params(abstract, placed)  # placed float32 arrays are taken as they are


def _checked(leaves: list, packing: Packing, what: str) -> list:
    """`leaves`, which must have the step's shapes (else the step would recompile or misread them)."""
    shapes = [tuple(np.shape(leaf)) for leaf in leaves]
    if shapes != list(packing.shapes):
        raise ValueError(f"{what}: leaf shapes {shapes[:4]}... differ from the step's {list(packing.shapes)[:4]}...")
    return leaves


def _leaves_of(tree: Any, treedef: Any, what: str) -> list:
    """The leaves of `tree`, which must have the step's structure (else the step would recompile
    or misread them)."""
    leaves, found = jax.tree.flatten(tree)
    if found != treedef:
        raise ValueError(f"{what}: structure {found} differs from the step's {treedef}")
    return leaves


class InnerLearner:
    """One learner's local model and AdamW state, stepped by a jitted function with donated buffers.

    With `site_mesh` the model trains on the site's device mesh (learn/mesh.py): the batch split
    over every device, parameters and AdamW moments laid out by the mesh's rule. Without it, one
    device and no shardings (the in-process runner's and the tests' learners).
    """

    def __init__(self, model: ModelSpec, inner: InnerOptimizer, seed: int,
                 initial: Mapping[str, np.ndarray] | None = None, site_mesh: SiteMesh | None = None,
                 build: factory.ModelBuild | None = None):
        """`build`: the site's model derived once (`factory.build_model` with the mesh's attention
        and remat), else derived here."""
        if site_mesh is not None:
            site_mesh.check_batch(inner.batch_size)  # before anything is built
        model = factory.recipe(model)
        self.site_mesh = site_mesh
        self.tx = _optimizer(model, inner)
        if site_mesh is None:
            graphdef, params = factory.init_params(model, seed)
            if initial is not None:
                params = model_lib.load_flat_params(params, initial)
            self.graphdef = graphdef
            self._param_def, self._opt_def = _state_defs(model, inner)
            self._param_packing, self._opt_packing = _packings(model, inner, None)
            self.params = params
            self.opt_state = self.tx.init(params)
            self._step = _compiled_single_step(model, inner)
        else:
            # Sharded start-up: parameters and AdamW moments are created in the mesh's layout
            # (shardings from abstract shapes), so no device holds a whole unsharded model.
            self._step, init = _compiled_mesh_step(model, inner, site_mesh)
            if build is None:
                build = factory.build_model(model, site_mesh.attention, site_mesh.remat)
            abstract = build.abstract
            # What the step runs: the model with this site's attention and remat choices.
            self.graphdef = build.execution
            self._param_def, self._opt_def = _state_defs(model, inner)
            self._param_packing, self._opt_packing = _packings(model, inner, site_mesh)
            if initial is None:  # the site's initialiser, compiled once per mesh
                self.params = factory.init_params_sharded(model, seed, site_mesh.tree_shardings(abstract),
                                                          site_mesh.replicated(),
                                                          factory.site_initialiser(model, seed, site_mesh))
            else:  # given values go tensor by tensor to their shards: no model is initialised
                self.params = _placed_params(abstract, initial, site_mesh)
            self.opt_state = init(self.params)
        self._inner_spec = inner  # its schedule, read on the host by `learning_rate`
        self._place_batches = site_mesh is not None and not site_mesh.batch_sharding().is_fully_addressable
        self.steps = 0
        self.tokens = 0
        # The last step's gradient norm (a device scalar; fetch it when convenient), None before one.
        self.last_grad_norm: jax.Array | None = None

    def _put_batch(self, tokens_BxL: np.ndarray) -> Any:
        """The batch as the step takes it: the host array itself where every device is this
        process's (the jitted call places it by its `in_shardings`, in C++: half the host time of
        a `device_put` first), else placed shard by shard (a multi-host site's global array)."""
        if self._place_batches:
            return self.site_mesh.put_batch(tokens_BxL)
        return tokens_BxL

    # The state lives as a few packed buffers between steps (what the step is jitted over: see
    # `_over_buffers`); the leaves and the trees are rebuilt on demand, off the step path.
    @property
    def param_leaves(self) -> list[jax.Array]:
        """Copies of the parameters' leaves (their treedef's order)."""
        return self._param_packing.unpack(self._param_buffers)

    @param_leaves.setter
    def param_leaves(self, leaves: list[jax.Array]) -> None:
        self._param_buffers = self._param_packing.pack(_checked(leaves, self._param_packing, "parameters"))

    @property
    def opt_leaves(self) -> list[jax.Array]:
        """Copies of the optimizer state's leaves."""
        return self._opt_packing.unpack(self._opt_buffers)

    @opt_leaves.setter
    def opt_leaves(self, leaves: list[jax.Array]) -> None:
        self._opt_buffers = self._opt_packing.pack(_checked(leaves, self._opt_packing, "optimizer state"))

    @property
    def params(self) -> nnx.State:
        return jax.tree.unflatten(self._param_def, self.param_leaves)

    @params.setter
    def params(self, params: nnx.State) -> None:
        self.param_leaves = _leaves_of(params, self._param_def, "parameters")

    @property
    def opt_state(self) -> Any:
        return jax.tree.unflatten(self._opt_def, self.opt_leaves)

    @opt_state.setter
    def opt_state(self, opt_state: Any) -> None:
        self.opt_leaves = _leaves_of(opt_state, self._opt_def, "optimizer state")

    @property
    def param_shardings(self) -> list[Any]:
        """Each parameter leaf's layout on the devices (what `read_params` gives, `write_params` takes)."""
        packing = self._param_packing
        if packing.leaf_shardings is not None:
            return list(packing.leaf_shardings)
        return [self._param_buffers[0].sharding] * len(packing.shapes)

    def read_params(self, indices: Iterable[int]) -> list[jax.Array]:
        """Parameter leaves `indices` (treedef order) as device arrays, by one compiled program: a
        packed leaf is a new array; a leaf of its own (split over devices) is the array itself, which
        the next step donates (read it before, or copy it)."""
        return self._param_packing.read(self._param_buffers, list(indices))

    def write_params(self, values: Mapping[int, jax.Array]) -> None:
        """Parameter leaves by index, each a device array with its leaf's layout (`param_shardings`),
        copied in by one compiled program that donates what it overwrites (the values stay the
        caller's). The optimizer state is kept."""
        for i, value in values.items():
            if tuple(value.shape) != self._param_packing.shapes[i]:
                raise ValueError(f"parameter leaf {i}: shape {tuple(value.shape)} != {self._param_packing.shapes[i]}")
        if values:
            self._param_buffers = self._param_packing.write(self._param_buffers, dict(values))

    def step(self, inputs_BxL: np.ndarray, targets_BxL: np.ndarray) -> jax.Array:
        """One AdamW step; returns the loss as a device array (fetch it when convenient)."""
        self._param_buffers, self._opt_buffers, loss, self.last_grad_norm = self._step(
            self._param_buffers, self._opt_buffers, self._put_batch(inputs_BxL), self._put_batch(targets_BxL))
        self.steps += 1
        self.tokens += int(np.size(targets_BxL))
        return loss

    def learning_rate(self, step: int) -> float:
        """The inner learning rate of update number `step` (1 for the first): the schedule at the
        optimizer's count before that update, as AdamW applied it."""
        return host_learning_rate(self._inner_spec, max(0, step - 1))

    def lower_step(self, inputs_BxL: np.ndarray, targets_BxL: np.ndarray) -> jax.stages.Lowered:
        """The step lowered for this state and batch shape (compile it, or read its memory plan)."""
        return self._step.lower(self._param_buffers, self._opt_buffers, self._put_batch(inputs_BxL),
                                self._put_batch(targets_BxL))

    def compile_step(self, inputs_BxL: np.ndarray, targets_BxL: np.ndarray,
                     before_run: Callable[[], None] | None = None) -> None:
        """Compile the jitted step, then run it once on throw-away copies (the state is untouched:
        the step donates its inputs, so it must not see the real buffers). `before_run` is called
        between the two (a multi-host site's processes meet there: learn/cluster.py `meet`)."""
        self.lower_step(inputs_BxL, targets_BxL).compile()  # the call below reuses this compilation
        params = [jnp.copy(buffer) for buffer in self._param_buffers]
        opt_state = [jnp.copy(buffer) for buffer in self._opt_buffers]
        if before_run is not None:
            before_run()
        _, _, loss, _ = self._step(params, opt_state, self._put_batch(inputs_BxL), self._put_batch(targets_BxL))
        jax.block_until_ready(loss)

    def compiled_variants(self) -> int:
        """How many compilations the step holds (1 after any number of steps and fragment writes)."""
        return int(self._step._cache_size())

    def get_flat(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        flat = model_lib.flat_params(self.params)
        return flat if names is None else {name: flat[name] for name in names}

    def set_flat(self, flat: Mapping[str, np.ndarray]) -> None:
        """Overwrite the named tensors (e.g. a merged global fragment); the AdamW state is kept."""
        self.params = model_lib.load_flat_params(self.params, flat)
        if self.site_mesh is not None:  # back to the layout the step was compiled for
            self.params = self.site_mesh.put_tree(self.params)

    def put_opt_leaves(self, leaves: Iterable[np.ndarray]) -> None:
        """The AdamW state from host copies of its leaves (a checkpoint), in the step's layout."""
        state = jax.tree.unflatten(self._opt_def, [jnp.asarray(a) for a in leaves])
        self.opt_state = state if self.site_mesh is None else self.site_mesh.put_tree(state)


class StackedLearners:
    """M learners in one stacked pytree; `step` advances the masked subset in one vmapped call.

    One learner's fragment is read, diffed against its base, or written by compiled programs that
    move only that learner's row (`learn/stacked_rows.py`), never the whole stack; the bytes they
    bring to the host are counted in `device_to_host_bytes`.
    """

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
        self.tx = _optimizer(model, inner)
        opt_state = self.tx.init(params)
        stack = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * num_learners), tree)  # noqa: E731
        self.params = stack(params)
        self.opt_state = stack(opt_state)
        self.steps = np.zeros(num_learners, dtype=np.int64)
        self.tokens = np.zeros(num_learners, dtype=np.int64)
        # Path tuples of every parameter, so flat names map to leaves of the stacked state.
        self._paths = {model_lib.path_name(path): path for path, _ in nnx.to_flat_state(params)}
        self._shapes = {name: tuple(leaf.shape) for name, leaf in
                        ((model_lib.path_name(path), leaf) for path, leaf in nnx.to_flat_state(params))}
        self._step = _compiled_masked_step(model, inner)
        self.device_to_host_bytes = 0  # parameter bytes brought to the host by get_flat / fragment_delta

    def step(self, inputs_MxBxL: Any, targets_MxBxL: Any, mask_M: np.ndarray) -> jax.Array:
        """Step the learners where `mask_M` is True; returns per-learner losses (device array).

        Rows of masked-out learners still need a (any) batch of the right shape; their state is
        left untouched and their loss is meaningless. The batches may be host arrays or device
        arrays placed ahead (`jax.device_put`); nothing here waits for the device.
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

    def _names(self, names: Iterable[str] | None) -> list[str]:
        names = list(self._paths) if names is None else list(names)
        unknown = [n for n in names if n not in self._paths]
        if unknown:
            raise KeyError(f"unknown parameter name(s): {', '.join(unknown[:5])}")
        return names

    def _index(self, learner: int) -> np.int32:
        if not 0 <= learner < self.num_learners:
            raise IndexError(f"learner {learner}: there are {self.num_learners}")
        return np.int32(learner)

    def _stacked(self, names: list[str]) -> tuple[jax.Array, ...]:
        return tuple(self._leaf(name)[...] for name in names)

    def get_flat(self, learner: int, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Host copies of learner `learner`'s named parameters (all when `names` is None); only
        that learner's rows leave the device."""
        names = self._names(names)
        rows = stacked_rows.to_host(stacked_rows.take_rows(self._stacked(names), self._index(learner)))
        self.device_to_host_bytes += stacked_rows.nbytes(rows)
        return dict(zip(names, rows))

    def fragment_delta(self, learner: int, base: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`base[n] - θ_learner[n]` for every tensor of `base` (float32), computed on the device:
        the outer delta a contribution encodes, the same bits as the host's subtraction. Only the
        delta comes to the host."""
        names = self._names(base)
        for name in names:
            if tuple(np.shape(base[name])) != self._shapes[name]:
                raise ValueError(f"parameter {name}: shape {np.shape(base[name])} != expected {self._shapes[name]}")
        values = tuple(np.asarray(base[name], dtype=np.float32) for name in names)
        rows = stacked_rows.to_host(stacked_rows.delta_rows(self._stacked(names), self._index(learner), values))
        self.device_to_host_bytes += stacked_rows.nbytes(rows)
        return dict(zip(names, rows))

    def set_flat(self, learner: int, flat: Mapping[str, np.ndarray]) -> None:
        """Overwrite learner `learner`'s named tensors; its AdamW state is kept (as DiLoCo does).
        One compiled program writes the row on the device (the other learners' rows stay there)."""
        names = self._names(flat)
        for name in names:
            if tuple(np.shape(flat[name])) != self._shapes[name]:
                raise ValueError(f"parameter {name}: shape {np.shape(flat[name])} != expected {self._shapes[name]}")
        values = tuple(np.asarray(flat[name], dtype=np.float32) for name in names)
        updated = stacked_rows.set_rows(self._stacked(names), self._index(learner), values)
        for name, value in zip(names, updated):
            self._leaf(name).set_value(value)  # whole replace: the donated old buffer is never read

    def learner_params(self, learner: int) -> nnx.State:
        """Learner `learner`'s parameters as an (unstacked) State, e.g. for evaluation."""
        return jax.tree.map(lambda x: x[learner], self.params)
