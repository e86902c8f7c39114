"""Separate eval sets (`[node.data.eval.NAME]`, issue 28 item 3): parsed from the file and the
environment, opened whole and never trained on, refused when they share a training file, scored
on the learner's schedule and reported per set on /status, /metrics, the history and trackers."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from diloco_node.config.manifest import ConfigError, InnerOptimizer, ModelSpec, RunManifest
from diloco_node.config.settings import load_config
from diloco_node.config.site_data import SiteData
from diloco_node.daemon.evaluation import EvalSetsLoss, GlobalEvaluator
from diloco_node.daemon.metrics import DaemonSeries
from diloco_node.daemon.tasks import TaskSet
from diloco_node.learn import data as data_lib
from diloco_node.ops import tracking as tracking_lib
from diloco_node.ops.status import EvalSetStatus, EvalStatus, MetricsRegistry, StatusBuilder, StatusDocument

SITE = """
[node]
node_id = "a"
bootstrap = []
[node.data]
source = "tokens"
token_dtype = "uint16"
paths = ["train.bin"]
[node.data.eval.wiki]
paths = ["wiki.bin"]
[node.data.eval.code]
paths = ["code.bin"]
token_dtype = "uint32"
"""


def _tokens(path: Path, count: int, dtype: str = "uint16", seed: int = 0) -> Path:
    np.random.default_rng(seed).integers(0, 256, count).astype(dtype).tofile(path)
    return path


def test_eval_sets_from_the_file_and_the_environment(tmp_path: Path) -> None:
    (tmp_path / "site.toml").write_text(SITE)
    data = load_config(tmp_path / "site.toml", {}).node.data
    sets = dict(data.eval_sets())
    assert list(sets) == ["wiki", "code"]
    # Relative to the file; unset keys inherited from [node.data]; a key the set names wins.
    assert sets["wiki"].paths == (str(tmp_path / "wiki.bin"),) and sets["wiki"].token_dtype == "uint16"
    assert sets["code"].token_dtype == "uint32" and sets["code"].source == "tokens"
    env = {"DILOCO_DATA_EVAL": 'web = {paths = ["/srv/web.bin"]}'}
    assert [name for name, _ in load_config(tmp_path / "site.toml", env).node.data.eval_sets()] == ["web"]


@pytest.mark.parametrize("table, message", [
    ({"wiki": {"paths": ["w.bin"], "weight": 2}}, "data.eval.wiki: unknown key 'weight' (eval sets are evaluated"),
    ({"wiki": {"paths": ["w.bin"], "eval_fraction": 0.1}}, "unknown key 'eval_fraction' (an eval set is read whole)"),
    ({"held_out": {"paths": ["w.bin"]}}, "'held_out' names the held-out slice"),
    ({"wiki": {"paths": ["w.bin"], "tokenizer": "/other.json"}}, "data.eval.wiki.tokenizer: a site tokenizes with one"),
    ({"wiki": {"source": "tokens"}}, "data.eval.wiki.paths: source 'tokens' needs at least one file"),
])
def test_an_eval_set_with_a_wrong_key_is_refused_naming_it(table: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SiteData(source="tokens", token_dtype="uint16", paths=("t.bin",), eval=table)


def test_an_eval_set_that_is_also_training_data_is_refused_naming_the_file(tmp_path: Path) -> None:
    train = _tokens(tmp_path / "train.bin", 5000)
    _tokens(tmp_path / "other.bin", 3000, seed=1)  # the set's own file
    spec = SiteData(source="tokens", token_dtype="uint16", paths=(str(train),),
                    eval={"wiki": {"paths": [str(tmp_path / "*.bin")]}})  # a glob that also matches train.bin
    training = data_lib.open_site_data(spec, None)
    with pytest.raises(data_lib.DataError, match=f"data.eval.wiki: '{train}' is also a training file"):
        data_lib.open_eval_sets(spec, None, training)


def test_with_eval_sets_every_training_token_trains_and_each_set_is_read_whole(tmp_path: Path) -> None:
    train = _tokens(tmp_path / "train.bin", 5000)
    wiki = _tokens(tmp_path / "wiki.bin", 700, seed=2)
    without = data_lib.open_site_data(SiteData(source="tokens", token_dtype="uint16", paths=(str(train),)), None)
    assert len(without.train) == 5000 - 250 and len(without.eval) == 250  # eval_fraction 0.05 held out
    spec = SiteData(source="tokens", token_dtype="uint16", paths=(str(train),), eval={"wiki": {"paths": [str(wiki)]}})
    corpus = data_lib.open_site_data(spec, None)
    assert len(corpus.train) == 5000 and len(corpus.eval) == 0  # no slice beside eval sets
    np.testing.assert_array_equal(np.asarray(corpus.train[0:5000]), np.fromfile(train, np.uint16))
    [(name, stream)] = data_lib.open_eval_sets(spec, None, corpus)
    assert name == "wiki" and len(stream) == 700
    np.testing.assert_array_equal(np.asarray(stream[0:700]), np.fromfile(wiki, np.uint16))


def test_an_eval_set_id_above_the_vocabulary_is_refused_naming_the_set(tmp_path: Path) -> None:
    ids = np.zeros(100, np.uint16)
    ids[42] = 999
    ids.tofile(tmp_path / "wiki.bin")
    corpus = data_lib.Corpus(np.zeros(10, np.uint8), np.zeros(10, np.uint8), 256, "x",
                             eval_sets=(("wiki", np.fromfile(tmp_path / "wiki.bin", np.uint16)),))
    with pytest.raises(data_lib.DataError, match="eval set 'wiki'.*id 999 at position 42"):
        data_lib.check_tokens(corpus, 256)


MANIFEST = RunManifest(model=ModelSpec.of("bytes", vocab_size=256, seq_len=16, size="tiny", num_layers=1),
                       inner=InnerOptimizer(batch_size=2))


def test_each_set_is_scored_on_fixed_windows_the_same_every_time() -> None:
    from diloco_node.learn import factory

    rng = np.random.default_rng(3)
    wiki, code = rng.integers(0, 256, 3000).astype(np.uint8), (np.arange(2000) % 7).astype(np.uint8)
    loss = EvalSetsLoss(MANIFEST, {"wiki": wiki, "code": code}, batches=3)
    flat = factory.init_flat_params(MANIFEST.model, 0)
    first, again = loss(flat), loss(flat)
    assert first == again  # deterministic windows: comparable across evaluations
    assert set(first) == {"wiki", "code"} and first["wiki"][1] == first["code"][1] == 3 * 2 * 16
    assert first["code"][0] != first["wiki"][0]  # each set its own figure


async def test_the_evaluator_scores_each_eval_set_and_no_slice_is_held_out() -> None:
    published: list[EvalStatus] = []
    tasks = TaskSet()

    def loss(flat):
        return {"wiki": (2.5, 96), "code": (1.25, 96)}

    evaluator = GlobalEvaluator(node_id="a", every_commits=2, loss=loss, global_params=lambda: {},
                                consistent=lambda: True, executor=ThreadPoolExecutor(1), tasks=tasks,
                                publish=published.append)
    evaluator.after_apply(2)
    while evaluator.running:
        await asyncio.sleep(0.01)
    [result] = published
    assert result.loss is None and result.commit_index == 2  # no held-out slice beside eval sets
    assert result.sets == {"wiki": EvalSetStatus(2.5, 96), "code": EvalSetStatus(1.25, 96)}
    assert result.figures() == [("wiki", 2.5), ("code", 1.25)]
    await tasks.close()


def test_the_status_document_carries_each_set_and_round_trips() -> None:
    builder = StatusBuilder("a", "run", "learner", 0.0)
    builder.set_evaluation(EvalStatus(3.5, 12, 0.25, {"wiki": EvalSetStatus(2.5, 4096)}))
    doc = builder.document(1.0)
    raw = json.loads(doc.to_json())
    assert raw["evaluation"] == {"loss": 3.5, "commit_index": 12, "seconds": 0.25,
                                 "sets": {"wiki": {"loss": 2.5, "tokens": 4096}}}
    assert StatusDocument.from_json(doc.to_json()) == doc
    del raw["evaluation"]["sets"]  # an older node's document: no sets
    assert StatusDocument.from_dict(raw).evaluation == EvalStatus(3.5, 12, 0.25)


def test_metrics_label_each_set_and_trackers_name_it() -> None:
    registry = MetricsRegistry()
    series = DaemonSeries.register(registry)
    series.eval_loss.set(3.5, set="held_out")
    series.eval_loss.set(2.5, set="wiki")
    builder = StatusBuilder("a", "run", "learner", 0.0)
    doc = builder.document(1.0)
    text = registry.render(doc).decode()
    assert 'diloco_eval_loss{set="held_out"} 3.5' in text and 'diloco_eval_loss{set="wiki"} 2.5' in text
    assert tracking_lib.eval_set_scalar("wiki") == "eval/wiki/loss"
    tracking_lib.Tracking().log(1, {"eval/wiki/loss": 2.5, "eval/loss": 3.5})  # in the scheme: accepted
    with pytest.raises(ValueError, match="not in the scheme"):
        tracking_lib.Tracking().log(1, {"eval/wiki/accuracy": 0.5})


def test_the_history_records_one_eval_event_per_set() -> None:
    from diloco_node.daemon.history_hooks import DaemonHistory

    class Writer:
        def __init__(self) -> None:
            self.events: list[tuple[str, dict]] = []
            self.node = "a"

        def record(self, kind: str, **fields) -> None:
            self.events.append((kind, fields))

    writer = Writer()
    history = DaemonHistory(writer)  # type: ignore[arg-type]
    for name, loss in EvalStatus(None, 4, 0.5, {"wiki": EvalSetStatus(2.5, 96),
                                                "code": EvalSetStatus(1.0, 96)}).figures():
        history.evaluated(4, loss, 0.5, set_name=name)
    assert [(kind, f["detail"]["set"], f["detail"]["loss"]) for kind, f in writer.events] == [
        ("eval", "wiki", 2.5), ("eval", "code", 1.0)]
