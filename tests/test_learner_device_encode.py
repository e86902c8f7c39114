"""The training thread with the int4 uplink: a due fragment is encoded on the device and handed
over without the thread waiting for its transfer, so a transfer held back does not hold the steps
back; only codes and scales cross (about an eighth of the float32 bytes); the base may live on
the host instead of the device and the bytes are the same."""

from __future__ import annotations

import threading

import numpy as np

from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.learn import data as data_lib
from diloco_node.learn.device_quantize import EncodedTensor
from diloco_node.learn.inner import InnerLearner
from diloco_node.learn.learner_thread import DueFragment, LearnerThread
from diloco_node.sync.fragments import plan_fragments

MANIFEST = RunManifest(
    model=ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1, d_model=64, d_ff=128),
    inner=InnerOptimizer(batch_size=4, lr_peak=1e-2, warmup_steps=1, total_steps=100),
    sync=SyncSpec(fragments=2, period=2, overlap=1, codec_up="int4"))
CORPUS = data_lib.Corpus(np.random.default_rng(0).integers(0, 256, 8192).astype(np.uint8),
                         np.arange(512, dtype=np.uint8), 256, "random bytes")
HELD_STEPS = 8  # steps the thread must take while the first fragment's transfer is held back


def _thread(on_contribution, on_progress, *, base_on_device: bool = True) -> LearnerThread:
    inner = InnerLearner(MANIFEST.model, MANIFEST.inner, MANIFEST.seed)
    initial = inner.get_flat()
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 2, 2, 1)
    thread = LearnerThread(node_id="a", manifest=MANIFEST, plan=plan, corpus=CORPUS, global_params=initial,
                           global_rounds=[0, 0], on_contribution=on_contribution, on_progress=on_progress,
                           inner=inner, base_on_device=base_on_device)
    thread.compile()
    return thread


def _run_until(thread: LearnerThread, reached: threading.Event) -> None:
    thread.start()
    thread.begin_training()
    try:
        assert reached.wait(120)
    finally:
        thread.stop()
        thread.join(60)
    assert thread.error is None


def test_a_held_back_transfer_of_a_due_fragment_does_not_hold_the_steps_back(monkeypatch):
    """The first due fragment's host copy is held until the thread has taken HELD_STEPS more steps
    (an event, no clock): the thread reaches them, handing over further fragments meanwhile, and
    the held fragment then reads as its encoding."""
    release = threading.Event()
    held_reads: list[int] = []
    real_host_parts = EncodedTensor.host_parts

    def held_host_parts(self):
        held_reads.append(1)
        assert release.wait(120), "the held transfer was never released"
        return real_host_parts(self)

    monkeypatch.setattr(EncodedTensor, "host_parts", held_host_parts)
    received: list[DueFragment] = []
    read_back: dict[str, np.ndarray] = {}
    reader_done = threading.Event()
    first_due_step: list[int] = []

    def read_first(due: DueFragment) -> None:  # the codec pool's part: reads the encoding
        read_back.update({name: np.asarray(tensor) for name, tensor in due.delta.items()})
        reader_done.set()

    def on_contribution(due: DueFragment) -> None:
        received.append(due)
        if len(received) == 1:
            first_due_step.append(due.step)
            threading.Thread(target=read_first, args=(due,), daemon=True).start()

    def on_progress(step: int, loss: float, tokens: int) -> None:
        if first_due_step and step >= first_due_step[0] + HELD_STEPS:
            release.set()

    thread = _thread(on_contribution, on_progress)
    _run_until(thread, release)
    assert reader_done.wait(60) and held_reads
    # Dispatches went on while the transfer was held: the steps, and the fragments due in them.
    assert thread.steps >= first_due_step[0] + HELD_STEPS
    assert len(received) >= 1 + HELD_STEPS // MANIFEST.sync.period
    first = received[0]
    assert set(read_back) == set(first.delta)
    for name, tensor in first.delta.items():
        assert read_back[name].shape == tensor.shape and np.isfinite(read_back[name]).all()


def test_only_codes_and_scales_cross_to_the_host():
    received: list[DueFragment] = []
    reached = threading.Event()
    thread = _thread(received.append, lambda step, loss, tokens: step >= 6 and reached.set())
    _run_until(thread, reached)
    assert received and all(isinstance(t, EncodedTensor) for due in received for t in due.delta.values())
    assert 0 < thread.due_transfer_bytes <= 0.15 * thread.due_fp32_bytes
    assert thread.due_fp32_bytes == sum(4 * t.size for due in received for t in due.delta.values())


def _bodies(base_on_device: bool) -> list[dict[str, bytes]]:
    received: list[DueFragment] = []
    reached = threading.Event()
    thread = _thread(received.append, lambda step, loss, tokens: step >= 5 and reached.set(),
                     base_on_device=base_on_device)
    _run_until(thread, reached)
    return [{name: t.body().tobytes() for name, t in due.delta.items()} for due in received[:3]]


def test_the_base_placed_from_the_host_gives_the_same_bytes_as_the_base_on_the_device():
    on_device, from_host = _bodies(True), _bodies(False)
    assert len(on_device) == 3 and on_device == from_host
