"""The figures an ML engineer watches: step windows (learn/figures.py) from the real training
thread, and their way to /status, /metrics, the history, the live page's series and MFU."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

from diloco_node.clock import FakeClock
from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.daemon.history_hooks import DaemonHistory
from diloco_node.daemon.learner_figures import SiteFlops
from diloco_node.learn import data as data_lib
from diloco_node.learn import flops
from diloco_node.learn.figures import FigureWindow, StepFigures
from diloco_node.learn.inner import InnerLearner
from diloco_node.learn.learner_thread import LearnerThread
from diloco_node.ops.history import HistoryWriter, read_history
from diloco_node.ops.page import StatusSeries
from diloco_node.ops.status import StatusBuilder, StatusDocument, render_metrics
from diloco_node.sync.fragments import plan_fragments

MANIFEST = RunManifest(
    model=ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1, d_model=32, d_ff=64),
    inner=InnerOptimizer(batch_size=2, lr_peak=1e-2, warmup_steps=5, total_steps=50),
    sync=SyncSpec(fragments=1, period=4, overlap=0))
CORPUS = data_lib.Corpus(np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint8),
                         np.arange(512, dtype=np.uint8), 256, "random bytes")


def test_a_window_closes_after_its_seconds_and_reads_the_device_only_then():
    window = FigureWindow(window_s=1.0)
    window.begin(10.0)
    fetched: list[int] = []

    def grad_norm() -> tuple[float, int]:
        fetched.append(1)
        return 3.5, 2

    assert window.step(1, 100, 10.4, grad_norm, lambda step: 0.1 * step) is None
    assert window.step(2, 100, 10.8, grad_norm, lambda step: 0.1 * step) is None
    assert fetched == []  # nothing fetched while the window is open
    figures = window.step(3, 100, 11.2, grad_norm, lambda step: 0.1 * step)
    assert figures is not None and fetched == [1]
    assert (figures.first_step, figures.step, figures.steps, figures.tokens) == (1, 3, 3, 300)
    assert figures.tokens_per_s == pytest.approx(300 / 1.2)
    assert figures.step_time_s == pytest.approx(0.4)
    assert (figures.grad_norm, figures.grad_norm_step, figures.lr) == (3.5, 2, pytest.approx(0.3))
    # The next window starts where this one ended.
    assert window.step(4, 100, 11.9, lambda: (math.nan, 3), lambda step: None) is None
    after = window.step(5, 100, 12.3, lambda: (math.nan, 4), lambda step: None)
    assert after is not None and after.first_step == 4 and after.seconds == pytest.approx(1.1)
    assert after.grad_norm is None  # not finite: unknown, never NaN on /status


def test_step_figures_refuse_nonsense():
    with pytest.raises(ValueError, match="steps 3..2"):
        StepFigures(2, 3, 1.0, 10, 10.0, 0.5, None, 0, None)
    with pytest.raises(ValueError, match="seconds = 0"):
        StepFigures(2, 1, 0.0, 10, 10.0, 0.5, None, 0, None)


def test_the_training_thread_publishes_windows_with_grad_norm_and_lr():
    inner = InnerLearner(MANIFEST.model, MANIFEST.inner, MANIFEST.seed)
    initial = inner.get_flat()
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 1, 4, 0)
    seen: list[StepFigures] = []
    done = threading.Event()
    holder: dict[str, LearnerThread] = {}

    def progress(step: int, loss: float, tokens: int) -> None:
        figures = holder["thread"].figures
        if figures is not None and (not seen or seen[-1] is not figures):
            seen.append(figures)
        if len(seen) >= 3:
            done.set()

    thread = holder["thread"] = LearnerThread(
        node_id="a", manifest=MANIFEST, plan=plan, corpus=CORPUS, global_params=initial, global_rounds=[0],
        on_contribution=lambda due: None, on_progress=progress, inner=inner)
    thread._window = FigureWindow(window_s=0.05)  # short windows: a few in a second on two CPU cores
    thread.compile()
    thread.start()
    thread.begin_training()
    try:
        assert done.wait(120)
    finally:
        thread.stop()
        thread.join(60)
    assert thread.error is None
    for previous, figures in zip(seen, seen[1:]):
        assert figures.first_step == previous.step + 1  # windows tile the steps
    for figures in seen:
        assert figures.tokens == figures.steps * 2 * 16
        assert figures.step_time_s == pytest.approx(figures.seconds / figures.steps)
        assert figures.lr == pytest.approx(inner.learning_rate(figures.step))
    later = seen[1:]
    assert all(f.grad_norm is not None and f.grad_norm > 0 and f.grad_norm_step == f.step - 1 for f in later)
    # Warm-up: the rate grows with the step while step <= warmup_steps.
    assert seen[0].lr < MANIFEST.inner.lr_peak or seen[0].step > MANIFEST.inner.warmup_steps


def _document(mfu: float | None = 0.42, *, stalled: bool = False) -> StatusDocument:
    builder = StatusBuilder("site-a", "run-1", "learner", started_at=0.0)
    builder.record_learner(step=10, loss=2.5, tokens=1000, now=1.0)
    builder.record_learner(step=20, loss=2.4, tokens=2000, now=2.0)
    builder.set_learner_figures(step_time_s=0.1, mfu=mfu, grad_norm=1.25, lr=3e-4)
    return builder.document(100.0 if stalled else 2.0)


def test_status_shows_the_figures_and_round_trips():
    doc = _document()
    learner = doc.to_dict()["learner"]
    assert learner == {"step": 20, "loss": 2.4, "tokens": 2000, "tokens_per_s": 1000.0, "step_time_s": 0.1,
                       "mfu": 0.42, "grad_norm": 1.25, "lr": 3e-4}
    assert StatusDocument.from_json(doc.to_json()) == doc
    # An older node's learner block (no figures) still parses, the figures unknown.
    older = doc.to_dict()
    older["learner"] = {"step": 1, "loss": None, "tokens": 0, "tokens_per_s": 0.0}
    assert StatusDocument.from_dict(older).learner.mfu is None


def test_a_stalled_learner_shows_no_utilisation_and_unknown_figures_are_null():
    assert _document(stalled=True).learner.mfu == 0.0
    builder = StatusBuilder("site-a", "run-1", "learner", started_at=0.0)
    builder.set_learner_figures(step_time_s=0.1, mfu=None, grad_norm=math.inf, lr=None)
    learner = builder.document(1.0).learner
    assert (learner.mfu, learner.grad_norm, learner.step_time_s) == (None, None, 0.1)


def test_metrics_carry_the_figures_and_leave_unknown_ones_out():
    text = render_metrics(_document())
    for line in ("diloco_learner_mfu 0.42", "diloco_learner_grad_norm 1.25", "diloco_learner_lr 0.0003",
                 "diloco_learner_step_time_seconds 0.1", "diloco_learner_tokens_per_second 1000.0"):
        assert line in text.splitlines(), line
    unknown = render_metrics(_document(mfu=None))
    assert "# TYPE diloco_learner_mfu gauge" in unknown
    assert not [line for line in unknown.splitlines() if line.startswith("diloco_learner_mfu ")]


def test_the_page_series_samples_the_figures():
    clock = FakeClock()
    series = StatusSeries(clock.monotonic)
    series.observe(lambda: _document())
    row = series.to_dict("site-a")["samples"][-1]
    assert (row["mfu"], row["grad_norm"], row["lr"], row["step_time_s"]) == (0.42, 1.25, 3e-4, 0.1)


@dataclass
class FakeLearner:
    step_seconds: float = 0.01
    c_steps: list[int] = field(default_factory=lambda: [0])


def test_the_history_step_event_carries_the_window_that_closed(tmp_path):
    clock = FakeClock()
    writer = HistoryWriter(tmp_path / "history.jsonl", "n1", wall_clock=clock, mono_clock=clock)
    history = DaemonHistory(writer, mono_clock=clock)
    history.learner_step(1, 2.5, 128, FakeLearner())
    clock.now += 0.6
    history.learner_step(2, 2.4, 256, FakeLearner(), figures={"tokens_per_s": 213.0, "step_time_s": 0.6,
                                                              "mfu": None, "grad_norm": 0.9, "lr": 1e-3})
    clock.now += 0.6
    history.learner_step(3, 2.3, 384, FakeLearner())
    writer.flush_steps()
    steps = [e for e in read_history(writer.path).events if e.kind == "step"]
    with_figures = [e.detail for e in steps if "grad_norm" in e.detail]
    assert len(with_figures) == 1
    detail = with_figures[0]
    assert (detail["tokens_per_s"], detail["grad_norm"], detail["lr"], detail["step_time_s"]) == (213.0, 0.9, 1e-3, 0.6)
    assert "mfu" not in detail  # unknown: left out, not invented


def test_site_flops_report_mfu_only_with_a_known_peak():
    devices = {"platform": "cpu", "count": 2, "processes": 1}
    cpu = SiteFlops.resolve(MANIFEST.model, devices, device_kind="cpu")
    assert cpu.peak_per_device is None and cpu.mfu(1e6) is None and "peak_tflops" in cpu.describe()
    overridden = SiteFlops.resolve(MANIFEST.model, devices, override_tflops=1.0, device_kind="cpu")
    per_token = flops.flops_per_token(MANIFEST.model)
    assert overridden.mfu(1000.0) == pytest.approx(1000.0 * per_token / (2 * 1e12))
    h100 = SiteFlops.resolve(MANIFEST.model, {"count": 8}, device_kind="NVIDIA H100 80GB HBM3")
    assert h100.mfu(1e6) == pytest.approx(1e6 * per_token / (8 * 989e12))


def test_the_node_publishes_a_closed_window_once_with_mfu_to_status_history_and_trackers(tmp_path):
    """daemon/training.py `LearnerReports.on_progress`: the learner's figures to every place they show."""
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from diloco_node.clock import FakeClock
    from diloco_node.config.settings import load_config
    from diloco_node.daemon.metrics import DaemonSeries
    from diloco_node.daemon.services import new_status
    from diloco_node.daemon.training import LearnerReports, LearnerSlot
    from diloco_node.ops.liveness import StepPace
    from diloco_node.ops.status import MetricsRegistry
    from diloco_node.ops.tracking import Tracking

    effective = load_config(None, {"DILOCO_TRACKING_TENSORBOARD_DIR": "tb"},
                            {"node_id": "a", "listen": "127.0.0.1:7070", "data_dir": str(tmp_path)})
    clock = FakeClock()
    tracking = Tracking.open(effective.node.tracking, tmp_path, "a", {})
    status = new_status(effective.node, "run", clock, tracking)
    slot = LearnerSlot()
    reports = LearnerReports(node_id="a", slot=slot, status=status, series=DaemonSeries.register(MetricsRegistry()),
                             history=DaemonHistory(HistoryWriter(tmp_path / "history.jsonl", "a")),
                             tracking=tracking, pace=StepPace(), clock=clock)
    reports.site_flops = SiteFlops("NVIDIA H100 80GB HBM3", 2, 989e12, 6e9)
    figures = StepFigures(step=40, first_step=21, seconds=2.0, tokens=20_000, tokens_per_s=10_000.0,
                          step_time_s=0.1, grad_norm=0.75, grad_norm_step=39, lr=2e-4)
    slot.fill(SimpleNamespace(figures=figures, compute_seconds_total=1.0, sync_seconds_total=0.1,  # type: ignore[arg-type]
                              step_seconds=0.09, c_steps=[1], steps=40))
    reports.on_progress(40, 2.25, 40_000)
    clock.advance(0.1)  # a learner that steps: tokens per second above 0
    reports.on_progress(41, 2.2, 41_000)  # the same window: reported once
    learner = status.document(clock.now).learner
    assert learner.mfu == pytest.approx(10_000.0 * 6e9 / (2 * 989e12))
    assert (learner.grad_norm, learner.lr, learner.step_time_s) == (0.75, 2e-4, 0.1)
    tracking.close()
    assert status.document(clock.now).tracking.tensorboard.written == 1
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"learner/loss", "learner/mfu", "learner/grad_norm", "learner/lr", "learner/tokens_per_s",
            "learner/step_time_s", "learner/tokens"} == set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("learner/grad_norm")] == [(40, 0.75)]
    reports.history.writer.flush_steps()
    details = [e.detail for e in read_history(tmp_path / "history.jsonl").events if e.kind == "step"]
    assert [d["mfu"] for d in details if "mfu" in d] == [pytest.approx(learner.mfu)]
