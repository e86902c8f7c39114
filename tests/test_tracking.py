"""Experiment trackers (ops/tracking.py, `[node.tracking]`): TensorBoard event files written and
read back, W&B through a fake module (the real wandb, offline, where the extra is installed:
tests/integration/test_tracking_wandb.py),
a bounded queue that drops its oldest entries, and failing trackers reported, never fatal."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from diloco_node.config.settings import ConfigError, load_config
from diloco_node.config.site_tracking import TrackingSpec
from diloco_node.ops import tracking as tracking_lib
from diloco_node.ops.status import StatusBuilder, StatusDocument
from diloco_node.ops.tracking import SCALARS, Tracking, TrackerWorker

from conftest import write_node_toml


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_tensorboard_event_files_are_written_under_the_data_dir_and_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracking = Tracking.open(TrackingSpec(tensorboard_dir="tb"), tmp_path, "site-a", {})
    for step in (10, 20, 30):
        tracking.log(step, {"learner/loss": 5.0 - step / 10, "learner/mfu": None, "learner/grad_norm": float("nan"),
                            "learner/lr": 1e-3})
    tracking.log(31, {"sync/commit_index": 4})
    tracking.close()
    assert tracking.status().tensorboard.written == 4 and tracking.status().tensorboard.error == ""
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert files
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"learner/loss", "learner/lr", "sync/commit_index"}  # unknown and non-finite left out
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("learner/loss")] == [(10, 4.0), (20, 3.0), (30, 2.0)]
    assert [e.step for e in events.Scalars("sync/commit_index")] == [31]


def test_scalars_outside_the_scheme_are_refused():
    with pytest.raises(ValueError, match="learner/oops"):
        Tracking().log(1, {"learner/oops": 1.0})
    assert "learner/grad_norm" in SCALARS and "eval/loss" in SCALARS


class _Sink:
    def __init__(self, fail: threading.Event) -> None:
        self.fail, self.rows = fail, []

    def write(self, step, wall_time, scalars):
        if self.fail.is_set():
            raise OSError(28, "No space left on device")
        self.rows.append((step, dict(scalars)))

    def flush(self):
        pass

    def close(self):
        pass


def test_a_failing_tracker_is_reported_counts_its_losses_and_recovers(tmp_path):
    fail = threading.Event()
    fail.set()
    sink = _Sink(fail)
    worker = TrackerWorker("tensorboard", str(tmp_path), lambda: sink)
    tracking = Tracking(tensorboard=worker)
    builder = StatusBuilder("site-a", "run", "learner", started_at=0.0)
    builder.tracking = tracking.status
    for step in range(1, 6):  # the learner's path: never raises, never waits
        tracking.log(step, {"learner/loss": 1.0})
    _wait(lambda: worker.status().dropped == 5)
    doc = builder.document(1.0)
    assert "No space left on device" in doc.tracking.tensorboard.error and doc.tracking.tensorboard.written == 0
    assert StatusDocument.from_json(doc.to_json()) == doc  # the tracking block round-trips
    fail.clear()  # room on the disk again
    tracking.log(6, {"learner/loss": 0.5})
    _wait(lambda: worker.status().written == 1)
    assert worker.status().error == "" and sink.rows == [(6, {"learner/loss": 0.5})]
    tracking.close()


def test_a_tracker_that_cannot_start_drops_everything_and_says_why(tmp_path):
    (tmp_path / "tb").write_text("a file where the directory should be")
    tracking = Tracking.open(TrackingSpec(tensorboard_dir="tb"), tmp_path, "site-a", {})
    tracking.log(1, {"learner/loss": 1.0})
    tracking.log(2, {"learner/loss": 1.0})
    _wait(lambda: tracking.status().tensorboard.dropped == 2)
    status = tracking.status().tensorboard
    assert "cannot start" in status.error and status.written == 0 and status.target == str(tmp_path / "tb")
    tracking.close()


def test_the_queue_is_bounded_and_drops_its_oldest_entries():
    release = threading.Event()
    sink = _Sink(threading.Event())

    def slow_start():
        release.wait(10)  # a tracker stuck on the network: nothing drains meanwhile
        return sink

    worker = TrackerWorker("wandb", "p", slow_start, capacity=4)
    started = time.perf_counter()
    for step in range(1, 11):
        worker.put(step, 0.0, {"learner/loss": float(step)})
    assert time.perf_counter() - started < 0.5  # never waits for the tracker
    assert worker.status().dropped == 6
    release.set()
    worker.close()
    assert [step for step, _ in sink.rows] == [7, 8, 9, 10] and worker.status().written == 4


def test_wandb_gets_the_scheme_at_the_learner_step_offline_under_the_data_dir(tmp_path):
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class FakeRun:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finish"].append(True)

    fake = SimpleNamespace(init=lambda **kwargs: calls["init"].append(kwargs) or FakeRun())
    spec = TrackingSpec(wandb_project="diloco", run_name="site-a-run")
    tracking = Tracking.open(spec, tmp_path, "site-a", {"run_id": "r1"}, wandb_module=fake)
    tracking.log(5, {"learner/loss": 2.0, "learner/tokens_per_s": 1000.0})
    tracking.close()
    init = calls["init"][0]
    assert (init["project"], init["mode"], init["name"], init["entity"], init["config"]) == (
        "diloco", "offline", "site-a-run", None, {"run_id": "r1"})
    assert init["dir"] == str(tmp_path / "wandb")
    assert calls["log"] == [(5, {"learner/loss": 2.0, "learner/tokens_per_s": 1000.0})]
    assert calls["finish"] == [True] and tracking.status().wandb.written == 1


def test_a_missing_extra_is_a_config_error_saying_what_to_install(monkeypatch):
    real = tracking_lib.importlib.util.find_spec
    monkeypatch.setattr(tracking_lib.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracking.wandb_project = 'p'.*pip install 'diloco-node\[wandb\]'"):
        tracking_lib.check_available(TrackingSpec(wandb_project="p"))
    with pytest.raises(ConfigError, match=r"tracking.tensorboard_dir = 'tb'.*diloco-node\[tensorboard\]"):
        tracking_lib.check_available(TrackingSpec(tensorboard_dir="tb"))
    tracking_lib.check_available(TrackingSpec())  # nothing on: nothing needed


def test_tracking_table_from_the_file_and_the_environment_and_errors_name_the_key(tmp_path):
    path = write_node_toml(tmp_path, '[node.tracking]\ntensorboard_dir = "tb"\nwandb_project = "diloco"\n')
    effective = load_config(path, {"DILOCO_TRACKING_WANDB_MODE": "online", "DILOCO_TRACKING_RUN_NAME": "a-1",
                                   "DILOCO_TRACKING_WANDB_ENTITY": "team"})
    assert effective.node.tracking == TrackingSpec("tb", "diloco", "online", "team", "a-1")
    assert effective.sources["tracking.wandb_mode"] == "env:DILOCO_TRACKING_WANDB_MODE"
    assert load_config(write_node_toml(tmp_path, ""), {}).node.tracking == TrackingSpec()
    with pytest.raises(ConfigError, match="tracking.wandb_mode = 'cloud': must be one of offline, online, disabled"):
        load_config(write_node_toml(tmp_path, '[node.tracking]\nwandb_mode = "cloud"\n'), {})
    with pytest.raises(ConfigError, match="tracking.wandb_project = 'a/b'"):
        load_config(write_node_toml(tmp_path, '[node.tracking]\nwandb_project = "a/b"\n'), {})
    with pytest.raises(ConfigError, match=r"node.tracking.tensorbord_dir .*unknown key"):
        load_config(write_node_toml(tmp_path, '[node.tracking]\ntensorbord_dir = "x"\n'), {})
