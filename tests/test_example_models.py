"""The examples a user copies: the custom-model module and its site config build, seal and train."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from diloco_node.config.settings import load_config
from diloco_node.learn import factory
from diloco_node.learn.inner import InnerLearner

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def custom_model_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "custom_model"))
    monkeypatch.delitem(sys.modules, "my_lm", raising=False)
    factory.abstract_model.cache_clear()
    yield
    factory.abstract_model.cache_clear()


def test_the_custom_model_site_config_builds_seals_and_trains(custom_model_on_path) -> None:
    effective = load_config(EXAMPLES / "sites" / "custom-model.toml", {}, {})
    manifest = effective.run
    assert manifest.model.factory == "my_lm:build"
    assert manifest.model.factory_config() == {"width": 64, "depth": 2, "kernel": 4, "vocab_size": 256, "seq_len": 64}
    sealed = factory.seal(manifest)
    names = {name for name, _, _ in sealed.model.tensors}
    assert {"embed/embedding", "head/kernel", "blocks/0/mix"} <= names
    assert factory.embedding_names(manifest.model, names) == ["embed/embedding"]
    learner = InnerLearner(manifest.model, manifest.inner, manifest.seed)
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 8, dtype=np.uint8).astype(np.int32)
    inputs = np.stack([text[i:i + 64] for i in range(0, 8 * 5, 5)])
    targets = np.stack([text[i + 1:i + 65] for i in range(0, 8 * 5, 5)])
    losses = [float(learner.step(inputs, targets)) for _ in range(25)]
    assert losses[-1] < losses[0] - 0.5


def test_the_custom_model_is_causal(custom_model_on_path) -> None:
    import my_lm
    from flax import nnx

    model = my_lm.build({"vocab_size": 50, "seq_len": 16, "width": 16}, nnx.Rngs(params=0))
    tokens = np.random.default_rng(0).integers(0, 50, (1, 16)).astype(np.int32)
    changed = tokens.copy()
    changed[0, 10] = (changed[0, 10] + 1) % 50
    a, b = np.asarray(model(tokens)), np.asarray(model(changed))
    assert np.allclose(a[:, :10], b[:, :10]) and not np.allclose(a[:, 10:], b[:, 10:])


def test_the_llama_site_config_on_a_token_file_builds_a_100m_model() -> None:
    effective = load_config(EXAMPLES / "sites" / "llama-tokens.toml", {}, {})
    manifest = effective.run
    assert (manifest.model.factory, manifest.model.vocab_size) == ("llama", 128256)
    data = effective.node.data  # the site's own data, not the run's
    assert (data.source, data.paths, data.token_dtype) == ("tokens", ("/srv/data/train-*.bin",), "uint32")
    assert manifest.stop.tokens == 2_000_000_000
    # The schedule fits the stop: 4 learners' shares of 2B tokens at 8 x 1024 tokens per step.
    assert manifest.inner.total_steps == 0 and manifest.inner_horizon()[0] == 61_036
    sealed = factory.seal(manifest)  # abstract: nothing allocated
    count = sum(int(np.prod(shape)) for _, shape, _ in sealed.model.tensors)
    assert 100e6 <= count <= 250e6, count
