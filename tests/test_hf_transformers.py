"""Proof against the real thing: our llama and `transformers`' LlamaForCausalLM compute the same
logits, both ways (a model transformers built and saved, imported by us; one of our exports,
loaded by transformers). Needs the optional extra (`pip install -e '.[hf]'`: torch and
transformers); skipped where they are absent, so the default suite neither fails nor slows.

    PYTHONPATH=. /work/hfvenv/bin/python -m pytest -q -s tests/test_hf_transformers.py

prints the largest absolute difference of each case (docs/MODELS.md quotes them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402 - after the skips: without the extra nothing below is needed
from flax import nnx  # noqa: E402

from diloco_node.learn import hf_llama, llama  # noqa: E402
from diloco_node.learn import model as model_lib  # noqa: E402

TOLERANCE = 1e-4
SEQ_LEN = 16
# The tiny Llama: 2 layers, d 64, 4 heads, 2 key/value heads, vocabulary 128; a rope
# base other than the default, so that a base that is not carried over shows.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=1000.0, rms_norm_eps=1e-5)
TOKENS = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, SEQ_LEN))


def _ours(options: dict, params: dict[str, np.ndarray]) -> np.ndarray:
    module = llama.llama({**options, "seq_len": SEQ_LEN}, nnx.Rngs(params=0))
    graphdef, state = nnx.split(module, nnx.Param)
    module = nnx.merge(graphdef, model_lib.load_flat_params(state, params))
    return np.asarray(module(jnp.asarray(TOKENS, jnp.int32)))


def _theirs(model: object) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_model_saved_by_transformers_imported_by_us_computes_the_same_logits(tmp_path: Path, tied: bool) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)).eval()
    with torch.no_grad():  # norms away from 1, so a scale put in the wrong place shows
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(tmp_path / "hf")
    imported = hf_llama.import_llama(tmp_path / "hf")
    assert imported.options["tie_embeddings"] is tied
    difference = float(np.abs(_ours(imported.options, imported.params) - _theirs(model)).max())
    print(f"\ntransformers -> ours ({'tied' if tied else 'untied'}): max abs logit difference {difference:.3g}")
    assert difference < TOLERANCE


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_our_export_loaded_by_transformers_computes_the_same_logits(tmp_path: Path, tied: bool) -> None:
    options = {"vocab_size": 128, "d_model": 64, "d_ff": 96, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
               "rope_theta": 1000.0, "norm_eps": 1e-5, "tie_embeddings": tied}
    module = llama.llama({**options, "seq_len": SEQ_LEN}, nnx.Rngs(params=3))
    rng = np.random.default_rng(1)
    params = {name: (a + rng.normal(0, 0.05, a.shape)).astype(np.float32)  # norms away from 1 here too
              for name, a in model_lib.flat_params(nnx.state(module, nnx.Param)).items()}
    out = tmp_path / "export"
    out.mkdir()
    hf_llama.write_llama(out, params, hf_llama.LlamaShape(**options), SEQ_LEN)
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert model.config.tie_word_embeddings is tied
    difference = float(np.abs(_ours(options, params) - _theirs(model)).max())
    print(f"\nours -> transformers ({'tied' if tied else 'untied'}): max abs logit difference {difference:.3g}")
    assert difference < TOLERANCE
    # And back: importing the export gives our parameters bit for bit.
    again = hf_llama.import_llama(out).params
    assert all(np.array_equal(again[name], params[name]) for name in params)
