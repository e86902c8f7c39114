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


def test_an_export_loads_with_auto_classes_and_generates(tmp_path: Path, word_tokenizer) -> None:
    """`export --format hf` with the site's tokenizer: what `AutoTokenizer` and `AutoModelForCausalLM`
    load as they are, with bos/eos from the tokenizer, and a model that generates."""
    import hashlib

    from _hf_reference import hf_config, random_hf_weights, write_hf_dir
    from test_hf_llama import _llama_data_dir

    from diloco_node.cli import main

    words = ["<s>", "</s>", "hello", "world", "again"]
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json", words)  # ids: [UNK] 0, <s> 1, </s> 2, ...
    config = hf_config(False)
    data_dir, _ = _llama_data_dir(tmp_path, write_hf_dir(tmp_path / "hf", config, random_hf_weights(config)),
                                  hashlib.sha256(tokenizer.read_bytes()).hexdigest())
    out = tmp_path / "export"
    assert main(["export", "--data-dir", str(data_dir), "--out", str(out), "--format", "hf",
                 "--tokenizer", str(tokenizer)]) == 0
    loaded_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (loaded_tokenizer.bos_token, loaded_tokenizer.eos_token) == ("<s>", "</s>")
    assert (loaded_tokenizer.bos_token_id, loaded_tokenizer.eos_token_id) == (1, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (model.generation_config.bos_token_id, model.generation_config.eos_token_id) == (1, 2)
    prompt = loaded_tokenizer("hello world again", return_tensors="pt")
    assert prompt["input_ids"].tolist() == [[3, 4, 5]]
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 7) and generated[0, :3].tolist() == [3, 4, 5]
    assert all(0 <= t < config["vocab_size"] for t in generated[0].tolist())
    print(f"\ngenerated ids {generated[0].tolist()}: {loaded_tokenizer.decode(generated[0])!r}")
