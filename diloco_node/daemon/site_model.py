"""A site's model side, built from the run manifest and the site's own data: data, model, the
initial global state, the fragment plan, the replica, the syncer, and (on learner sites) the
training thread.

Runs off the event loop (JAX initialisation and the corpus take seconds). A learner's model is
initialised once: its weights are also the run's initial state (the same seed for every site),
unless the run starts from a Hugging Face Llama (`[run.model] init_from`): then the imported
weights are.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diloco_node.config.manifest import RunManifest
from diloco_node.config.site_data import SiteData
from diloco_node.config.settings import ConfigError
from diloco_node.config.site_devices import MeshShape
from diloco_node.daemon.history_ring import DiskVersionRings
from diloco_node.learn import data as data_lib
from diloco_node.learn import factory
from diloco_node.learn.inner import InnerLearner
from diloco_node.learn.cluster import BoundaryFollowing
from diloco_node.learn.learner_thread import DueFragment, LearnerSnapshot, LearnerThread
from diloco_node.learn.mesh import build_site_mesh
from diloco_node.learn.synthetic_learner import SyntheticLearner
from diloco_node.sync.fragments import FragmentPlan, plan_fragments, wire_fit_problems
from diloco_node.sync.replica import Replica
from diloco_node.sync.syncer import Syncer
from wire.limits import MAX_RELAYED_PAYLOAD_BYTES

log = logging.getLogger("diloco_node.daemon")

# Text a learner tokenizes is cached here, under data_dir, so a restart maps it instead of
# tokenizing again (learn/data.py names each cache by its files and encoder).
DATA_CACHE_DIR = "data-cache"


@dataclass
class SiteModel:
    manifest: RunManifest
    corpus: data_lib.Corpus | None  # None on a witness
    inner: InnerLearner | None  # the learner's model, None on a witness
    plan: FragmentPlan
    replica: Replica
    syncer: Syncer
    devices: dict | None = None  # the learner's devices and mesh (`SiteMesh.describe()`), None on a witness
    shapes: Mapping[str, tuple[int, ...]] | None = None  # every parameter's shape (bounds relayed payloads)


def open_learner_data(manifest: RunManifest, data: SiteData, cache_dir: Path | None) -> data_lib.Corpus:
    """A learner's own data (`[node.data]`), checked against what the run fixes: the tokenizer's
    digest and the model's vocabulary (every id scanned). Its separate eval sets (`[node.data.eval.NAME]`)
    are opened with it (`Corpus.eval_sets`): when there are any, no slice of the training data is
    held out. Problems are ConfigErrors naming the file."""
    try:
        warning = data_lib.check_tokenizer(manifest.data.tokenizer_sha256, data)
        if warning:
            log.warning("%s", warning)
        corpus = data_lib.open_site_data(data, cache_dir)
        sets = data_lib.open_eval_sets(data, cache_dir, corpus)
        for name, stream in sets:
            if len(stream) < manifest.model.seq_len + 2:
                raise data_lib.DataError(f"data.eval.{name}: {len(stream)} tokens, too few for one window of "
                                         f"seq_len {manifest.model.seq_len} + 1")
        corpus = dataclasses.replace(corpus, eval_sets=sets)
        data_lib.check_tokens(corpus, manifest.model.vocab_size)
    except data_lib.DataError as error:
        raise ConfigError(str(error)) from None
    log.info("training data: %s (%d train, %d eval tokens)", corpus.description, len(corpus.train), len(corpus.eval))
    for name, stream in corpus.eval_sets:
        log.info("eval set %s: %d tokens (never trained on)", name, len(stream))
    return corpus


def build_site_model(manifest: RunManifest, *, learner: bool, data: SiteData | None = None,
                     cache_dir: Path | None = None, mesh_shape: MeshShape = MeshShape(),
                     synthetic: bool = False, initial_values: bool = True,
                     version_rings: DiskVersionRings | None = None) -> SiteModel:
    """Learners and witnesses build the same model from the manifest alone (its factory, options,
    vocabulary and context), checked against the run's sealed parameter signature. A learner also
    opens its own data (`data`, default the stdlib; tokenized text is cached in `cache_dir`);
    witnesses read none. A learner trains on every device of the site, laid out by `[node.mesh]`
    (learn/mesh.py). A `synthetic` learner (benchmarks and tests, learn/synthetic_learner.py) reads
    no data and builds no model to train: its site is built like a witness's. Without
    `initial_values` (a fresh joiner, whose download replaces every fragment) a site that does not
    train starts from zeros instead of initialising the model. `version_rings`: where the replica keeps
    the fragment versions it rebases on (on disk: no fp32 copy of the model per kept round)."""
    trains = learner and not synthetic
    site_mesh = build_site_mesh(mesh_shape) if trains else None
    # The model derived once (one factory call, under eval_shape) and passed on to the learner.
    build = (factory.build_model(manifest.model, site_mesh.attention, site_mesh.remat) if site_mesh is not None
             else factory.build_model(manifest.model))
    factory.check_signature(manifest, factory.signature_of(build.abstract))
    corpus = open_learner_data(manifest, data or SiteData(), cache_dir) if trains else None
    # A run that starts from a Hugging Face Llama (`[run.model] init_from`): its state at index 0 is
    # the imported weights (digest-checked), not the seed's; the learner's parameters are placed
    # from them, no model is initialised. A site without the directory (not the founder) gets its
    # state from its checkpoint or a peer, as a joiner does.
    imported = factory.imported_initial(manifest.model) if manifest.model.init_from and initial_values else None
    if imported is None:
        factory.drop_sealed_import()
    if manifest.model.init_from and initial_values and imported is None:
        log.warning("the run starts from %s, which this site does not have: its state must come from its "
                    "checkpoint or a peer", manifest.model.init_from)
    inner = None
    if trains:
        # Where the schedule's horizon comes from (total_steps, [run.stop] or the cosine fallback), once at start.
        horizon, source = manifest.inner_horizon()
        inner_cfg, stop = manifest.inner, manifest.stop
        fallback = inner_cfg.schedule == "cosine" and not inner_cfg.total_steps and not (stop.steps or stop.tokens)
        log.log(logging.WARNING if fallback else logging.INFO, "inner optimizer %s, %s schedule over %s (%s)",
                inner_cfg.optimizer, inner_cfg.schedule, f"{horizon} learner steps" if horizon else "no end", source)
        inner = InnerLearner(manifest.model, manifest.learner_inner(), manifest.seed, initial=imported,
                             site_mesh=site_mesh, build=build)
    if imported is not None:
        initial = imported
    elif inner is not None and not inner.site_mesh.multi_process:
        initial = inner.get_flat()
    elif not initial_values:  # every value is about to be downloaded
        initial = build.zeros()
    else:  # a witness, or a multi-host site (no process alone can read its parameters): the same seed
        initial = factory.init_flat_params(manifest.model, manifest.seed)
    shapes = {n: a.shape for n, a in initial.items()}
    sync = manifest.sync
    plan = plan_fragments(shapes, sync.fragments, sync.period, sync.overlap)
    # A commit bigger than one log-append frame is relayed and streamed (daemon/relays.py), so the
    # bound is the streamed payload's, not the 256 MiB frame's.
    too_big = wire_fit_problems(plan, shapes, sync.codec_up, sync.codec_down,
                                max_log_append_bytes=MAX_RELAYED_PAYLOAD_BYTES)
    if too_big:
        raise ConfigError("the run's fragments do not fit the wire limits: " + "; ".join(too_big))
    # `initial` is ours alone (fresh host copies): the replica keeps these arrays, no second copy.
    replica = Replica(plan, initial, manifest.resolved_outer(), manifest.stop, manifest.founded_at, adopt_initial=True)
    if version_rings is not None:
        replica.state.use_history(version_rings)
    syncer = Syncer(manifest, plan, list(build.embeddings))
    return SiteModel(manifest, corpus, inner, plan, replica, syncer,
                     site_mesh.describe() if site_mesh is not None else None, shapes)


def prepare_learner(site: SiteModel, *, node_id: str, base: tuple[Mapping[str, np.ndarray], list[int]],
                    restored: LearnerSnapshot | None, on_contribution: Callable[[DueFragment], None],
                    on_progress: Callable[[int, float, int], None], min_step_interval_s: float) -> LearnerThread:
    """Build the training thread on `base` (global params, rounds) and compile its step (in a worker
    thread; touches no loop state). A restored learner keeps its own weights and counters."""
    assert site.corpus is not None and site.inner is not None
    multi_host = site.inner.site_mesh is not None and site.inner.site_mesh.multi_process
    learner = LearnerThread(
        node_id=node_id, manifest=site.manifest, plan=site.plan, corpus=site.corpus,
        global_params=base[0], global_rounds=base[1], on_contribution=on_contribution, on_progress=on_progress,
        min_step_interval_s=min_step_interval_s, inner=site.inner,
        following=BoundaryFollowing(site.plan.num_fragments) if multi_host else None)
    if restored is not None:
        learner.restore(restored)
        log.info("%s: the learner resumes at step %d (%d tokens) from its checkpoint", node_id, restored.step,
                 restored.tokens)
    seconds = learner.compile()
    log.info("%s: training step compiled in %.1f s", node_id, seconds)
    return learner


def prepare_synthetic_learner(site: SiteModel, *, node_id: str, rounds: list[int],
                              restored: LearnerSnapshot | None, on_contribution: Callable[[DueFragment], None],
                              on_progress: Callable[[int, float, int], None], steps_per_s: float) -> SyntheticLearner:
    """The synthetic learner of `[node] learner = "synthetic"`: random deltas of the model's shapes
    at `steps_per_s`, no training (benchmarks and tests of the data plane only)."""
    assert site.shapes is not None
    shapes = {n: tuple(s) for n, s in site.shapes.items()}
    learner = SyntheticLearner(node_id=node_id, manifest=site.manifest, plan=site.plan, shapes=shapes,
                               global_rounds=rounds, on_contribution=on_contribution, on_progress=on_progress,
                               steps_per_s=steps_per_s)
    if restored is not None:
        learner.restore(restored)
    log.warning("%s: SYNTHETIC learner at %g steps/s: random deltas, no training (benchmarks and tests only)",
                node_id, steps_per_s)
    return learner
