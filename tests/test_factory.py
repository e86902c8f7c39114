"""The model interface: a user's factory by name, its checks with errors that name it, the sealed
parameter signature that refuses a differing site, and `[run.model]` options from config."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest
from diloco_node.config.settings import load_config
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.learn.inner import InnerLearner

USER_MODELS = '''
import os

import jax
import jax.numpy as jnp
from flax import nnx


class TinyLM(nnx.Module):
    """Embedding -> one dense layer -> head; declares its embedding and brings its own loss."""

    def __init__(self, vocab, width, rngs):
        self.tokens = nnx.Embed(vocab, width, rngs=rngs)
        self.hidden = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BxL):
        return self.out(jax.nn.relu(self.hidden(self.tokens(tokens_BxL))))

    def embedding_names(self):
        return ["tokens/embedding"]

    def loss(self, inputs_BxL, targets_BxL):
        logp = jax.nn.log_softmax(self(inputs_BxL), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1)) + 100.0


def tiny_lm(config, rngs):
    width = int(config.get("width", os.environ.get("TEST_FACTORY_WIDTH", 16)))
    return TinyLM(config["vocab_size"], width, rngs)


def raises(config, rngs):
    raise RuntimeError("no GPU here")


def not_a_module(config, rngs):
    return {"weights": 1}


def nan_weights(config, rngs):
    model = TinyLM(config["vocab_size"], 8, rngs)
    model.hidden.kernel[...] = model.hidden.kernel[...] * jnp.nan
    return model


class WithBatchStats(TinyLM):
    def __init__(self, vocab, width, rngs):
        super().__init__(vocab, width, rngs)
        self.norm = nnx.BatchNorm(width, rngs=rngs)


def batch_stats(config, rngs):
    return WithBatchStats(config["vocab_size"], 8, rngs)


def wrong_logits(config, rngs):
    return TinyLM(config["vocab_size"] + 1, 8, rngs)


class HalfPrecision(nnx.Module):
    def __init__(self, vocab, rngs):
        self.tokens = nnx.Embed(vocab, 8, param_dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, tokens_BxL):
        return self.tokens.attend(self.tokens(tokens_BxL))


def bf16_params(config, rngs):
    return HalfPrecision(config["vocab_size"], rngs)
'''


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(USER_MODELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_models", raising=False)
    factory.abstract_model.cache_clear()
    yield "user_models"
    factory.abstract_model.cache_clear()


def test_a_users_factory_trains_with_its_own_loss_and_embeddings(user_models) -> None:
    spec = ModelSpec.of(f"{user_models}:tiny_lm", vocab_size=300, seq_len=8, width=12)
    graphdef, params = factory.init_params(spec, seed=3)
    flat = model_lib.flat_params(params)
    assert sorted(flat) == ["hidden/bias", "hidden/kernel", "out/kernel", "tokens/embedding"]
    assert flat["tokens/embedding"].shape == (300, 12)
    assert factory.embedding_names(spec, flat) == ["tokens/embedding"]
    tokens = np.random.default_rng(0).integers(0, 300, (2, 8)).astype(np.int32)
    assert float(model_lib.loss_fn(graphdef, params, tokens, tokens)) > 100.0  # the module's own loss
    learner = InnerLearner(spec, InnerOptimizer(batch_size=2, lr_peak=1e-2, warmup_steps=1, total_steps=10), seed=3)
    losses = [float(learner.step(tokens, tokens)) for _ in range(6)]
    assert losses[-1] < losses[0]
    # The same seed gives the same weights at every site.
    again = model_lib.flat_params(factory.init_params(spec, seed=3)[1])
    assert all(np.array_equal(flat[n], again[n]) for n in flat)


@pytest.mark.parametrize(("function", "message"), [
    ("missing", "has no callable 'missing'"),
    ("raises", "raised RuntimeError: no GPU here"),
    ("not_a_module", "returned dict, not a flax nnx.Module"),
    ("batch_stats", "state that is not nnx.Param"),
    ("wrong_logits", "expected float logits [2, 8, 50]"),
    ("bf16_params", "parameters must be float32"),
    ("nan_weights", "non-finite initial parameters: hidden/kernel"),
])
def test_a_factory_that_cannot_be_trained_is_refused_by_name(user_models, function, message) -> None:
    spec = ModelSpec.of(f"{user_models}:{function}", vocab_size=50, seq_len=8)
    with pytest.raises(factory.ModelFactoryError) as error:
        factory.init_params(spec, seed=0)
    assert f"model factory '{user_models}:{function}'" in str(error.value)
    assert message in str(error.value)


def test_a_module_that_does_not_import_is_named() -> None:
    with pytest.raises(factory.ModelFactoryError, match="cannot import module 'no_such_models'.*every site"):
        factory.model_signature(ModelSpec.of("no_such_models:build"))


def test_the_founder_seals_the_signature_and_a_differing_site_is_refused_naming_tensors(user_models, monkeypatch) -> None:
    manifest = RunManifest(model=ModelSpec.of(f"{user_models}:tiny_lm", vocab_size=70_000, seq_len=8))
    sealed = factory.seal(manifest)
    assert ("tokens/embedding", (70_000, 16), "float32") in sealed.model.tensors
    # The signature travels in the manifest (what joiners receive) and survives the round trip.
    assert RunManifest.from_dict(sealed.to_dict()) == sealed
    factory.check_signature(sealed)  # the same code builds the same model: accepted
    # Another site whose factory code builds a wider model (same manifest) is refused, named.
    monkeypatch.setenv("TEST_FACTORY_WIDTH", "24")
    factory.abstract_model.cache_clear()
    with pytest.raises(factory.ModelFactoryError) as error:
        factory.check_signature(sealed)
    text = str(error.value)
    assert "differs from the run's in 4 tensor(s)" in text
    assert "tokens/embedding: float32[70000, 24] here, float32[70000, 16] in the run" in text
    # The manifest comparison a joiner prints names the same tensors.
    wider = factory.seal(manifest)
    assert any(d.startswith("model.tensors: hidden/kernel: float32[24, 24] here")
               for d in wider.differences(sealed))


def test_an_unsealed_manifest_is_not_checked() -> None:
    factory.check_signature(RunManifest(model=ModelSpec.of("no_such_models:build")))


def test_model_options_come_from_the_config_file_and_flags(tmp_path) -> None:
    config = tmp_path / "site.toml"
    config.write_text('[run.model]\nfactory = "llama"\nvocab_size = 128256\nseq_len = 64\n'
                      'size = "1m"\ntie_embeddings = true\nrope_theta = 500000.0\n')
    effective = load_config(config, {}, {"run.model.num_layers": "3", "run.model.compute_dtype": "bfloat16"})
    model = effective.run.model
    assert (model.factory, model.vocab_size, model.seq_len) == ("llama", 128256, 64)
    assert model.factory_config() == {"size": "1m", "tie_embeddings": True, "rope_theta": 500000.0, "num_layers": 3,
                                      "compute_dtype": "bfloat16", "vocab_size": 128256, "seq_len": 64}
    assert {"model.num_layers", "model.size", "model.factory"} <= effective.explicit_run_keys()
    shown = {s.key: (s.value, s.source) for s in effective.settings()}
    assert shown["run.model.num_layers"] == (3, "flag:--set run.model.num_layers")
    assert shown["run.model.size"][1].startswith("file:")


def test_a_bad_factory_name_is_a_config_error(tmp_path) -> None:
    config = tmp_path / "site.toml"
    config.write_text('[run.model]\nfactory = "my models"\n')
    with pytest.raises(ValueError, match="must be \"bytes\", \"llama\" or \"package.module:function\""):
        load_config(config, {}, {})


def test_the_bytes_factory_takes_options_and_refuses_unknown_ones() -> None:
    spec = ModelSpec.of(seq_len=16, size="tiny", num_layers=1, vocab_size=512)
    names = dict((n, s) for n, s, _ in factory.model_signature(spec))
    assert names["embed/embedding"] == (512, 64) and not any(n.startswith("blocks/1/") for n in names)
    with pytest.raises(factory.ModelFactoryError, match="unknown option.*widht"):
        factory.model_signature(ModelSpec.of(widht=3))


def test_flat_initial_parameters_are_the_models_own_bit_for_bit_in_the_same_order() -> None:
    spec = ModelSpec.of(seq_len=16, size="tiny", num_layers=2, vocab_size=512)
    expected = model_lib.flat_params(factory.init_params(spec, 7)[1])
    flat = factory.init_flat_params(spec, 7)
    assert list(flat) == list(expected)
    for name, value in expected.items():
        assert flat[name].dtype == np.float32 and flat[name].flags.owndata
        assert np.array_equal(flat[name], value), name


def test_zero_parameters_have_the_initial_parameters_names_shapes_and_order() -> None:
    spec = ModelSpec.of(seq_len=16, size="tiny", num_layers=2, vocab_size=512)
    initial = factory.init_flat_params(spec, 7)
    zeros = factory.zero_flat_params(spec)
    assert list(zeros) == list(initial)
    assert all(zeros[n].shape == a.shape and zeros[n].dtype == np.float32 and not zeros[n].any()
               for n, a in initial.items())
