"""The model interface: from a run's `[run.model]` to a checked flax NNX module.

A model factory is a function `factory(config, rngs) -> nnx.Module` (docs/MODELS.md):

- `config` is a dict of every key of `[run.model]` except `factory`, with `vocab_size` and
  `seq_len` always present; `rngs` is an `nnx.Rngs` seeded from the run's seed, the same at every
  site, so every site builds bit-identical initial weights.
- The module maps int32 tokens `[B, L]` to logits `[B, L, V]`; its state is float32 `nnx.Param`s
  only (no batch statistics, no RNG state: the learner steps pure functions of the parameters).
- Optional: `loss(inputs_BxL, targets_BxL) -> scalar` replaces the default mean next-token
  cross-entropy; `embedding_names() -> list of flat names` says which parameters the merge treats
  as embeddings (default: top-level names containing "embed", except "unembed").

`factory` in `[run.model]` is "bytes", "llama", or "package.module:function". Whatever goes wrong
while resolving, calling or checking a factory is a `ModelFactoryError` naming the factory.

The run manifest carries the founding site's *parameter signature* (names, shapes, dtypes):
`seal` writes it when a run is founded, and `check_signature` refuses a site whose factory builds
anything else, naming the differing tensors. Signatures come from `nnx.eval_shape`, so sealing
and checking a 1B-parameter model allocates nothing.

A run may start from a Hugging Face Llama (`[run.model] init_from`, learn/hf_llama.py): `seal`
then also takes the model's shape from its config.json into the options and seals the digest of
the imported weights (`init_sha256`); `imported_initial` reads them again where the run's state at
index 0 is built (daemon/site_model.py). The factory itself never sees the directory, so every
other site builds the same model from the manifest alone.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
import gc
import importlib
import logging
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diloco_node.config.manifest import ConfigError, ModelSpec, RunManifest, TensorSignature, tensor_differences
from diloco_node.learn import hf_llama
from diloco_node.learn.model import make_eval_fn, path_name
from diloco_node.sync.fragments import is_embedding

BUILTIN_FACTORIES = {
    "bytes": "diloco_node.learn.model:byte_transformer",
    "llama": "diloco_node.learn.llama:llama",
}
log = logging.getLogger(__name__)
PROBE_BATCH = 2  # tokens [2, min(seq_len, 16)] probe the call's output shape (abstractly)

Factory = Callable[[dict[str, Any], nnx.Rngs], nnx.Module]


class ModelFactoryError(ConfigError):
    """The model factory cannot be imported, fails, or builds something the learner cannot train."""


def recipe(spec: ModelSpec) -> ModelSpec:
    """What builds the model: the spec without its sealed signature (a cache key for compiled steps)."""
    return dataclasses.replace(spec, tensors=()) if spec.tensors else spec


def resolve_factory(name: str) -> Factory:
    """The factory function named by `[run.model] factory`."""
    target = BUILTIN_FACTORIES.get(name, name)
    module_name, _, function_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or anything the user's module raises at import
        raise ModelFactoryError(f"model factory {name!r}: cannot import module {module_name!r} "
                                f"({type(error).__name__}: {error}); it must be importable at every site, "
                                "witnesses included") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ModelFactoryError(f"model factory {name!r}: module {module_name!r} has no callable {function_name!r}")
    return function


def _call_factory(spec: ModelSpec, seed: int) -> nnx.Module:
    factory = resolve_factory(spec.factory)
    try:
        module = factory(spec.factory_config(), nnx.Rngs(params=seed))
    except ModelFactoryError:
        raise
    except Exception as error:
        raise ModelFactoryError(f"model factory {spec.factory!r} raised {type(error).__name__}: {error}") from None
    if not isinstance(module, nnx.Module):
        raise ModelFactoryError(f"model factory {spec.factory!r} returned {type(module).__name__}, "
                                "not a flax nnx.Module")
    return module


def _check_structure(spec: ModelSpec, module: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params); the module's state must be float32 parameters only."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    leftover = [path_name(path) for path, _ in nnx.to_flat_state(rest)]
    if leftover:
        raise ModelFactoryError(f"model factory {spec.factory!r}: state that is not nnx.Param ("
                                f"{', '.join(leftover[:5])}); the learner trains modules whose state is "
                                "parameters only (no batch statistics, dropout RNGs or caches)")
    flat = list(nnx.to_flat_state(params))
    if not flat:
        raise ModelFactoryError(f"model factory {spec.factory!r}: the module has no parameters")
    wrong = [f"{path_name(path)} ({leaf.dtype})" for path, leaf in flat if leaf.dtype != jnp.float32]
    if wrong:
        raise ModelFactoryError(f"model factory {spec.factory!r}: parameters must be float32 (use a compute "
                                f"dtype for lower precision): {', '.join(wrong[:5])}")
    return graphdef, params


def _check_output(spec: ModelSpec, graphdef: nnx.GraphDef, params: nnx.State) -> None:
    length = min(spec.seq_len, 16)
    tokens = jax.ShapeDtypeStruct((PROBE_BATCH, length), jnp.int32)
    try:
        out = jax.eval_shape(lambda p, t: nnx.merge(graphdef, p)(t), params, tokens)
    except Exception as error:
        raise ModelFactoryError(f"model factory {spec.factory!r}: calling the module on int32 tokens "
                                f"[{PROBE_BATCH}, {length}] failed: {type(error).__name__}: {error}") from None
    expected = (PROBE_BATCH, length, spec.vocab_size)
    if getattr(out, "shape", None) != expected or not jnp.issubdtype(out.dtype, jnp.floating):
        raise ModelFactoryError(f"model factory {spec.factory!r}: the module maps tokens [{PROBE_BATCH}, {length}] "
                                f"to {getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}; "
                                f"expected float logits {list(expected)} (vocab_size = {spec.vocab_size})")


@functools.lru_cache(maxsize=16)
def abstract_model(spec: ModelSpec) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract params) of the checked model, without allocating its weights."""
    spec = recipe(spec)
    module = nnx.eval_shape(lambda: _call_factory(spec, 0))
    graphdef, params = _check_structure(spec, module)
    _check_output(spec, graphdef, params)
    return graphdef, params


def graphdef_of(spec: ModelSpec) -> nnx.GraphDef:
    """The model's structure, built once per process (compiled steps key on the spec)."""
    return abstract_model(recipe(spec))[0]


@functools.lru_cache(maxsize=16)
def execution_graphdef(spec: ModelSpec, attention: str = "auto", remat: str = "none") -> nnx.GraphDef:
    """The model's structure with this site's execution choices (`[node.mesh] attention`, `remat`)
    compiled in: a module that defines `set_execution(attention=..., remat=...)` (the llama
    factory does) is told them before it is split, so the choices travel in the graphdef as static
    attributes. The parameters are the same; a module without the method ignores the choices."""
    spec = recipe(spec)
    if (attention, remat) == ("auto", "none"):
        return graphdef_of(spec)
    # The checked abstract model merged back into a module: the factory is not called again.
    module = nnx.merge(*abstract_model(spec))
    configure = getattr(module, "set_execution", None)
    if not callable(configure):
        log.info("model factory %r has no set_execution(): mesh.attention = %r and mesh.remat = %r do not apply "
                 "to it", spec.factory, attention, remat)
        return graphdef_of(spec)
    try:
        configure(attention=attention, remat=remat)
    except Exception as error:
        raise ModelFactoryError(f"model factory {spec.factory!r}: set_execution(attention={attention!r}, "
                                f"remat={remat!r}) raised {type(error).__name__}: {error}") from None
    graphdef, _ = _check_structure(spec, module)
    return graphdef


@functools.lru_cache(maxsize=16)
def site_initialiser(spec: ModelSpec, seed: int, site_mesh: Any) -> Callable[[], nnx.State]:
    """The sharded initialiser of a site's mesh (a `learn.mesh.SiteMesh`), compiled once per
    (model, seed, mesh) in a process: a site that builds its learner again (a rebuilt node in
    tests, a restarted learner) reuses the compilation."""
    spec = recipe(spec)
    return sharded_init_fn(spec, seed, site_mesh.tree_shardings(abstract_model(spec)[1]))


@dataclass(frozen=True, eq=False)
class ModelBuild:
    """A site's model derived once (`build_model`) and passed on: the checked structure and
    abstract parameters (one call of the factory, under `eval_shape`), the execution graphdef of
    the site's attention and remat choices, every parameter's shape and the embeddings the merge
    treats as such."""

    spec: ModelSpec  # the recipe (no sealed signature)
    graphdef: nnx.GraphDef
    abstract: nnx.State
    execution: nnx.GraphDef
    shapes: Mapping[str, tuple[int, ...]]
    embeddings: tuple[str, ...]

    def zeros(self) -> dict[str, np.ndarray]:
        """`zero_flat_params` of this model, built from the shapes here."""
        return {name: np.zeros(shape, np.float32) for name, shape in self.shapes.items()}


def build_model(spec: ModelSpec, attention: str = "auto", remat: str = "none") -> ModelBuild:
    """Everything a site derives from its model spec, once (the factory is called once per
    process and spec: `abstract_model`'s cache; the execution graphdef reuses its module)."""
    spec = recipe(spec)
    graphdef, abstract = abstract_model(spec)
    shapes = {path_name(path): tuple(int(d) for d in leaf.shape) for path, leaf in nnx.to_flat_state(abstract)}
    return ModelBuild(spec, graphdef, abstract, execution_graphdef(spec, attention, remat), shapes,
                      tuple(embedding_names(spec, shapes)))


def sharded_init_fn(spec: ModelSpec, seed: int, shardings: Any) -> Callable[[], nnx.State]:
    """The jitted initialiser `init_params_sharded` runs (lower and compile it to read XLA's
    per-device memory analysis of start-up)."""
    abstract_model(recipe(spec))  # structure and output checked without allocating
    spec = recipe(spec)

    def build() -> nnx.State:
        return nnx.split(_call_factory(spec, seed), nnx.Param, ...)[1]

    return jax.jit(build, out_shardings=shardings)


def init_params_sharded(spec: ModelSpec, seed: int, shardings: Any, replicated: Any,
                        initialiser: Callable[[], nnx.State] | None = None) -> nnx.State:
    """The freshly initialised parameters created directly in `shardings`' layout (a pytree of
    shardings shaped like the parameters): the factory runs inside `jit` with those output
    shardings, so each device computes and holds only its own shard and no device, and no host,
    ever holds the whole model. Non-finite initial parameters are refused, named.

    The values are those of the same factory and seed compiled as one program: equal to
    `init_params`' eager ones up to float rounding (XLA fuses the initialisers' arithmetic), not
    bit for bit. A run's initial state is its founder's, whichever way it was built; every other
    site downloads it or adopts it (multi-host sites share process 0's). `initialiser`: the
    compiled one of the site (`site_initialiser`), else one is built for `shardings`."""
    params = (initialiser or sharded_init_fn(spec, seed, shardings))()
    finite = jax.jit(lambda tree: jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]),
                     out_shardings=replicated)(params)
    finite_host = np.asarray(finite if finite.is_fully_addressable else finite.addressable_data(0))
    if not finite_host.all():
        names = [path_name(path) for path, _ in nnx.to_flat_state(params)]
        bad = [name for name, ok in zip(names, finite_host) if not ok]
        raise ModelFactoryError(f"model factory {spec.factory!r}: non-finite initial parameters: {', '.join(bad[:5])}")
    return params


def init_params(spec: ModelSpec, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, float32 params) of a freshly initialised, checked model; the same seed gives the
    same parameters bit for bit. Non-finite initial parameters are refused, named."""
    abstract_model(recipe(spec))  # structure and output checked without allocating
    graphdef, params = _check_structure(spec, _call_factory(recipe(spec), seed))
    bad = [path_name(path) for path, leaf in nnx.to_flat_state(params) if not bool(jnp.all(jnp.isfinite(leaf)))]
    if bad:
        raise ModelFactoryError(f"model factory {spec.factory!r}: non-finite initial parameters: {', '.join(bad[:5])}")
    return graphdef, params


def init_flat_params(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """`init_params`' parameters as flat host float32 arrays (`model.flat_params`' names and order).

    Each JAX buffer is let go as soon as its host copy exists, so a site that only needs the
    values (a witness, a replica's founding state) peaks at one model plus one tensor, not two
    models: at 1B parameters that is 4 GB less at start-up.
    """
    _, params = init_params(spec, seed)
    leaves: list[Any] = [(path_name(path), leaf) for path, leaf in nnx.to_flat_state(params)]
    del params
    gc.collect()  # the module built the values in reference cycles: else they outlive `params`
    flat: dict[str, np.ndarray] = {}
    for i, (name, leaf) in enumerate(leaves):
        flat[name] = np.array(leaf, dtype=np.float32)  # a copy: the JAX buffer goes with `leaves[i]`
        leaves[i] = None
        del leaf
    return flat


def zero_flat_params(spec: ModelSpec) -> dict[str, np.ndarray]:
    """Zeros of every parameter's shape, in `init_flat_params`' names and order, with no model
    built: for a site whose every fragment a download replaces (a fresh joiner). The pages of
    `np.zeros` are not resident until written, so a fragment costs memory once it is installed."""
    _, abstract = abstract_model(recipe(spec))
    return {path_name(path): np.zeros(tuple(int(d) for d in leaf.shape), np.float32)
            for path, leaf in nnx.to_flat_state(abstract)}


def signature_of(params: nnx.State) -> tuple[TensorSignature, ...]:
    """(name, shape, dtype) of every parameter, sorted by name."""
    return tuple(sorted((path_name(path), tuple(int(d) for d in leaf.shape), str(np.dtype(leaf.dtype)))
                        for path, leaf in nnx.to_flat_state(params)))


def model_signature(spec: ModelSpec) -> tuple[TensorSignature, ...]:
    """The parameter signature the spec's factory builds at this site (nothing allocated)."""
    return signature_of(abstract_model(recipe(spec))[1])


def seal(manifest: RunManifest) -> RunManifest:
    """The manifest with this site's parameter signature: what a founding site publishes. With
    `init_from`, the imported model's shape fills the options and its digest is sealed first."""
    spec = manifest.model
    if spec.init_from:
        spec, params = import_spec(spec)
        # The founder builds its state from these weights next (`imported_initial`): handed over,
        # so the directory is read once. One slot: a later seal replaces it.
        _SEALED_IMPORT.clear()
        _SEALED_IMPORT[(spec.init_from, spec.init_sha256, _fingerprint(Path(spec.init_from)))] = params
    model = spec.sealed(model_signature(spec))
    return dataclasses.replace(manifest, model=model)


# The weights `seal` imported, until `imported_initial` takes them (or `drop_sealed_import`).
_SEALED_IMPORT: dict[tuple[str, str, tuple], dict[str, np.ndarray]] = {}


def _fingerprint(directory: Path) -> tuple:
    """Every file's name, size and modification time: weights written again since `seal` are read
    again (and refused if they are not the sealed ones)."""
    try:
        return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in directory.iterdir() if f.is_file()))
    except OSError:
        return ()


def drop_sealed_import() -> None:
    """Forget weights `seal` imported that no one will take (a site that starts without them)."""
    _SEALED_IMPORT.clear()


# `[run.model]` keys a Hugging Face import decides: any of them also set must agree with config.json.
# `size` is refused outright: a preset and config.json would be two sources of one shape.
_VOCAB_DEFAULT = ModelSpec().vocab_size


def import_spec(spec: ModelSpec) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """(the spec completed from `init_from`'s config.json with `init_sha256` set, the imported
    float32 parameters), checked against the model that spec builds. A key of `[run.model]`
    config.json also decides must agree (vocab_size left at its default takes config.json's);
    a configured `init_sha256` must be the weights'. Problems are ConfigErrors naming both values."""
    imported = hf_llama.import_llama(Path(spec.init_from))
    where = f"{Path(spec.init_from) / hf_llama.CONFIG_FILE}"
    if spec.option("size") is not None:
        raise ConfigError(f"model.size = {spec.option('size')!r} and model.init_from = {spec.init_from!r}: the "
                          f"imported model's shape comes from {where}; remove size")
    hf_keys = {ours: hf for hf, ours in hf_llama.SHAPE_KEYS.items()}
    disagreements = []
    vocab = imported.options["vocab_size"]
    if spec.vocab_size not in (vocab, _VOCAB_DEFAULT):
        disagreements.append(f"model.vocab_size = {spec.vocab_size} but {where} has vocab_size = {vocab}")
    options = dict(spec.options)
    for key, value in imported.options.items():
        if key != "vocab_size" and key in options and options[key] != value:
            disagreements.append(f"model.{key} = {options[key]!r} but {where} has {hf_keys[key]} = {value!r}")
        options[key] = value
    if disagreements:
        raise ConfigError("the run's [run.model] contradicts the Hugging Face model it starts from: "
                          + "; ".join(disagreements) + ". Remove these keys (init_from decides them) or fix them")
    if spec.init_sha256 and spec.init_sha256 != imported.sha256:
        raise ConfigError(f"model.init_sha256 = {spec.init_sha256} but the weights in {spec.init_from} have digest "
                          f"{imported.sha256}: not the model this run was configured to start from")
    options.pop("vocab_size")
    completed = ModelSpec.of(spec.factory, vocab_size=vocab, seq_len=spec.seq_len, init_from=spec.init_from,
                             init_sha256=imported.sha256, **options)
    _check_imported(completed, imported.params)
    return completed, imported.params


def _check_imported(spec: ModelSpec, params: Mapping[str, np.ndarray]) -> None:
    """The imported parameters are exactly the ones the spec's factory builds (names and shapes)."""
    ours = tuple((name, tuple(a.shape), "float32") for name, a in params.items())
    differences = tensor_differences(ours, model_signature(spec))
    if differences:
        raise ModelFactoryError(f"the weights imported from {spec.init_from} do not fit the llama model their "
                                "config.json describes ('here': imported, 'in the run': what the factory builds): "
                                + "; ".join(differences))


def imported_initial(spec: ModelSpec) -> dict[str, np.ndarray] | None:
    """The run's state at index 0 when it starts from a Hugging Face Llama: `init_from`'s weights,
    refused unless their digest is the sealed `init_sha256`. None where the directory is not here
    (a site other than the founder: its state comes from its checkpoint or a peer)."""
    if not spec.init_from or not Path(spec.init_from).is_dir():
        return None
    key = (spec.init_from, spec.init_sha256, _fingerprint(Path(spec.init_from)))
    sealed = _SEALED_IMPORT.pop(key, None) if spec.init_sha256 else None
    if sealed is not None:  # this process sealed the run from them: read and checked already
        _SEALED_IMPORT.clear()
        return sealed
    imported = hf_llama.import_llama(Path(spec.init_from))
    if spec.init_sha256 and imported.sha256 != spec.init_sha256:  # unsealed (not founded yet): nothing to hold to
        raise ConfigError(f"the weights in {spec.init_from} (digest {imported.sha256}) are not the ones this run "
                          f"started from (model.init_sha256 = {spec.init_sha256}): restore that directory, or "
                          "remove it so that the state comes from a checkpoint or a peer")
    _check_imported(spec, imported.params)
    return imported.params


def check_signature(manifest: RunManifest, ours: tuple[TensorSignature, ...] | None = None) -> None:
    """Refuse to train or replicate a model that differs from the run's, naming the tensors.

    A manifest that is not sealed (a run founded before signatures existed) is accepted."""
    if not manifest.model.tensors:
        return
    ours = model_signature(manifest.model) if ours is None else ours
    differences = tensor_differences(ours, manifest.model.tensors)
    if differences:
        raise ModelFactoryError(f"this site's model (factory {manifest.model.factory!r}) differs from the run's in "
                                f"{len(differences)} tensor(s): " + "; ".join(differences)
                                + ". Every site must run the same factory code and [run.model] options")


def embedding_names(spec: ModelSpec, names: Collection[str]) -> list[str]:
    """The parameters the merge treats as embeddings: the module's own declaration, or the default."""
    module = nnx.merge(*abstract_model(recipe(spec)))  # abstract leaves: the method only names things
    declare = getattr(module, "embedding_names", None)
    if declare is None:
        return [name for name in names if is_embedding(name)]
    try:
        chosen = [str(name) for name in declare()]
    except Exception as error:
        raise ModelFactoryError(f"model factory {spec.factory!r}: embedding_names() raised "
                                f"{type(error).__name__}: {error}") from None
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        raise ModelFactoryError(f"model factory {spec.factory!r}: embedding_names() names unknown parameters: "
                                f"{', '.join(unknown[:5])}")
    return chosen


@functools.lru_cache(maxsize=16)
def eval_fn(spec: ModelSpec) -> Callable:
    """`model.make_eval_fn` for the spec's model, built once per process so compilations are reused."""
    return make_eval_fn(graphdef_of(spec))
