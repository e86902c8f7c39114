"""One model build per site: `build_site_model` derives the model once (the factory called once
under `eval_shape`, the execution graphdef from that same module), the site's sharded initialiser
is compiled once per mesh, and the founder reads `init_from` once (seal hands its weights over)."""

from __future__ import annotations

import jax
import numpy as np

from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.config.site_devices import MeshShape
from diloco_node.daemon.site_model import build_site_model
from diloco_node.learn import factory, hf_llama
from diloco_node.learn import inner as inner_lib
from _hf_reference import hf_config, random_hf_weights, write_hf_dir

MANIFEST = RunManifest(model=ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1,
                                          d_model=64, d_ff=128, tie_embeddings=False),
                       inner=InnerOptimizer(batch_size=4, warmup_steps=1, total_steps=10),
                       sync=SyncSpec(fragments=2, period=4, overlap=1))


def _fresh_caches() -> None:
    for cached in (factory.abstract_model, factory.execution_graphdef, factory.site_initialiser,
                   inner_lib._optimizer, inner_lib._compiled_mesh_step):
        cached.cache_clear()


def _counting(monkeypatch) -> tuple[list[int], list[int]]:
    """(seeds of every factory call, one entry per trace of a sharded initialiser)."""
    calls: list[int] = []
    traces: list[int] = []
    real_call, real_init_fn = factory._call_factory, factory.sharded_init_fn

    def call(spec, seed):
        calls.append(seed)
        return real_call(spec, seed)

    def init_fn(spec, seed, shardings):
        jitted = real_init_fn(spec, seed, shardings)
        return jax.jit(lambda: (traces.append(1), jitted())[1])

    monkeypatch.setattr(factory, "_call_factory", call)
    monkeypatch.setattr(factory, "sharded_init_fn", init_fn)
    return calls, traces


def test_a_learner_site_calls_the_factory_once_and_compiles_its_initialiser_once(monkeypatch):
    _fresh_caches()
    calls, traces = _counting(monkeypatch)
    manifest = factory.seal(MANIFEST)  # the founder's seal: the signature from the same abstract model
    mesh = MeshShape(attention="chunked", remat="dots")
    site = build_site_model(manifest, learner=True, mesh_shape=mesh)
    # One abstract build (seal, signature check, structure, execution graphdef, embeddings, shapes
    # share it) and the initialiser's own trace (seeded with the run's seed).
    assert calls == [0, manifest.seed] and traces == [1]
    assert site.inner is not None and site.inner.graphdef == factory.execution_graphdef(manifest.model, "chunked", "dots")
    again = build_site_model(manifest, learner=True, mesh_shape=mesh)  # the same site's mesh: no new compile
    assert calls == [0, manifest.seed] and traces == [1]
    for name, value in site.inner.get_flat().items():
        np.testing.assert_array_equal(value, again.inner.get_flat([name])[name])


def test_the_founder_reads_init_from_once(monkeypatch, tmp_path):
    config = hf_config(False)
    hf = write_hf_dir(tmp_path / "hf", config, random_hf_weights(config))
    reads: list[str] = []
    real_import = hf_llama.import_llama

    def counted(directory):
        reads.append(str(directory))
        return real_import(directory)

    monkeypatch.setattr(hf_llama, "import_llama", counted)
    manifest = factory.seal(RunManifest(model=ModelSpec.of("llama", seq_len=16, init_from=str(hf)),
                                        sync=MANIFEST.sync))
    site = build_site_model(manifest, learner=False)
    assert reads == [str(hf)]
    imported = real_import(hf).params
    state = {n: a for p in range(site.plan.num_fragments) for n, a in site.replica.state.fragment_params(p).items()}
    assert set(state) == set(imported) and all(np.array_equal(state[n], imported[n]) for n in state)
    build_site_model(manifest, learner=False)  # a later build of the same process reads the directory itself
    assert reads == [str(hf), str(hf)]
