"""The daemon's training thread on a device mesh: due fragments taken from sharded parameters (read
one step late, or int4-encoded on the device) carry the delta of the step they were due at,
and merged fragments written back keep every leaf's layout without recompiling the step."""

import dataclasses
import threading

import jax
import numpy as np
import pytest

from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.learn import data as data_lib
from diloco_node.learn import model as model_lib
from diloco_node.learn.device_quantize import EncodedTensor
from diloco_node.learn.inner import InnerLearner
from diloco_node.learn.learner_thread import DueFragment, LearnerThread, learner_index
from diloco_node.learn.mesh import MeshShape, build_site_mesh
from diloco_node.sync.fragments import plan_fragments

MANIFEST = RunManifest(
    model=ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1, d_model=64, d_ff=128),
    inner=InnerOptimizer(batch_size=4, lr_peak=1e-2, warmup_steps=1, total_steps=100),
    sync=SyncSpec(fragments=2, period=2, overlap=1))
CORPUS = data_lib.Corpus(np.random.default_rng(0).integers(0, 256, 8192).astype(np.uint8),
                         np.arange(512, dtype=np.uint8), 256, "random bytes")


def _thread(on_contribution, steps_wanted: int,
            manifest: RunManifest = MANIFEST) -> tuple[LearnerThread, dict[str, np.ndarray], threading.Event]:
    mesh = build_site_mesh(MeshShape(data=1, fsdp=2), jax.devices()[:2], min_sharded_elements=1)
    inner = InnerLearner(MANIFEST.model, MANIFEST.inner, MANIFEST.seed, site_mesh=mesh)
    initial = inner.get_flat()
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 2, 2, 1)
    done = threading.Event()

    def progress(step: int, loss: float, tokens: int) -> None:
        if step >= steps_wanted:
            done.set()

    thread = LearnerThread(node_id="a", manifest=manifest, plan=plan, corpus=CORPUS, global_params=initial,
                           global_rounds=[0, 0], on_contribution=on_contribution, on_progress=progress, inner=inner)
    thread.compile()
    return thread, initial, done


def _run(thread: LearnerThread, done: threading.Event) -> None:
    thread.start()
    thread.begin_training()
    try:
        assert done.wait(120)
    finally:
        thread.stop()
        thread.join(60)
    assert thread.error is None


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_due_fragment_carries_the_delta_of_its_own_step(codec: str):
    """fp32: read to the host one step late, exact; int4: encoded on the device (its decoded values
    within half a quantization step of the exact delta, learn/device_quantize.py)."""
    received: list[DueFragment] = []
    manifest = dataclasses.replace(MANIFEST, sync=dataclasses.replace(MANIFEST.sync, codec_up=codec))
    thread, initial, done = _thread(received.append, 6, manifest)
    _run(thread, done)
    assert received
    # The same model on one device, the same batches: its weights after step `due.step`.
    plain = InnerLearner(MANIFEST.model, MANIFEST.inner, MANIFEST.seed)
    sampler = data_lib.BatchSampler(CORPUS.train, 4, 16, MANIFEST.seed, learner_index("a"))
    after_step = {}
    for step in range(1, max(d.step for d in received) + 1):
        plain.step(*sampler.next())
        after_step[step] = model_lib.flat_params(plain.params)
    for due in received:
        for name, delta in due.delta.items():
            exact = initial[name] - after_step[due.step][name]
            half_step = 0.0 if codec == "fp32" else float(np.abs(exact).max()) / 7 / 2 * 1.01
            assert isinstance(delta, EncodedTensor) == (codec == "int4")
            np.testing.assert_allclose(np.asarray(delta), exact, atol=2e-5 + half_step, err_msg=name)
        assert due.c_steps == due.step  # nothing merged: the counters count every step


def test_merged_fragments_written_back_keep_the_layout_and_never_recompile_the_step():
    holder: dict[str, LearnerThread] = {}
    rounds = [0, 0]

    def merge_back(due: DueFragment) -> None:  # called on the training thread: offers are thread-safe
        rounds[due.fragment] += 1
        merged = {n: np.full(np.shape(d), 0.01, np.float32) for n, d in due.delta.items()}
        holder["thread"].offer_fragment(due.fragment, rounds[due.fragment], merged, contributors=("a",))

    thread, _, done = _thread(merge_back, 10)
    holder["thread"] = thread
    _run(thread, done)
    assert min(thread.base_rounds) >= 2  # merged fragments were taken, more than once each
    inner = thread._inner
    mesh = inner.site_mesh
    for leaf in jax.tree.leaves(inner.params) + jax.tree.leaves(inner.opt_state):
        assert leaf.sharding == mesh.param_sharding(leaf.shape)
    assert inner.compiled_variants() == 1
