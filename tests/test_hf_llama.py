"""A Hugging Face Llama in and out (learn/hf_llama.py, `[run.model] init_from`, `export --format hf`).

Every check here runs without torch or transformers: the Hugging Face side is tests/_hf_reference.py,
a numpy forward pass written from Hugging Face's conventions (names, [out, in], `rotate_half`), so
an error in the name map, a transpose or the rotary permutation shows as different logits.
tests/test_hf_transformers.py checks the same against transformers itself, where it is installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from _hf_reference import TINY, hf_config, hf_logits, random_hf_weights, write_hf_dir
from diloco_node.cli import main
from diloco_node.config.manifest import ConfigError, ModelSpec, RunManifest, SyncSpec
from diloco_node.config.settings import load_config
from diloco_node.daemon.coordination_store import CoordinationStore
from diloco_node.daemon.persistence import Checkpointer
from diloco_node.daemon.site_model import build_site_model
from diloco_node.learn import factory, hf_llama, llama
from diloco_node.learn import model as model_lib
from diloco_node.ops.checkpoint import CheckpointStore
from diloco_node.ops.export import ExportError, llama_shape
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.replica import Replica

TOKENS = np.random.default_rng(1).integers(0, TINY["vocab_size"], (2, 12))
TOLERANCE = 1e-4  # float32 against float64, two layers: measured differences are ~1e-6


def our_logits(options: dict, params: dict[str, np.ndarray], tokens: np.ndarray = TOKENS) -> np.ndarray:
    module = llama.llama({**options, "seq_len": 16}, nnx.Rngs(params=0))
    graphdef, state = nnx.split(module, nnx.Param)
    module = nnx.merge(graphdef, model_lib.load_flat_params(state, params))
    return np.asarray(module(jnp.asarray(tokens, jnp.int32)))


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def hf_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    config = hf_config(request.param)
    return write_hf_dir(tmp_path / "hf", config, random_hf_weights(config))


# ---------------------------------------------------------------- the rotary permutation


def test_the_permutation_turns_hugging_faces_halves_into_our_interleaved_pairs() -> None:
    """Derivation, checked: with ours[2j] = theirs[j] and ours[2j+1] = theirs[j + K/2], our
    rotary of the permuted vector is their rotary permuted the same way, so q . k is unchanged."""
    K, L, theta = 16, 12, 1000.0
    perm = hf_llama.rotary_permutation(1, K)
    assert perm.tolist() == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 1, L, 1, K))
    inv_freq = 1.0 / theta ** (np.arange(0, K, 2) / K)
    angles = np.arange(L)[:, None] * inv_freq[None, :]
    cos, sin = (f(np.concatenate([angles, angles], -1))[None, :, None, :] for f in (np.cos, np.sin))

    def theirs(x: np.ndarray) -> np.ndarray:
        return x * cos + np.concatenate([-x[..., K // 2:], x[..., :K // 2]], -1) * sin

    def ours(x: np.ndarray) -> np.ndarray:
        return np.asarray(llama.rotary(jnp.asarray(x, jnp.float32), theta), np.float64)

    np.testing.assert_allclose(ours(q[..., perm]), theirs(q)[..., perm], atol=1e-5)
    scores_theirs = np.einsum("blhk,bmhk->lm", theirs(q), theirs(k))
    np.testing.assert_allclose(np.einsum("blhk,bmhk->lm", ours(q[..., perm]), ours(k[..., perm])), scores_theirs,
                               atol=1e-4)
    # Without the permutation the scores differ: the test can fail.
    assert np.abs(np.einsum("blhk,bmhk->lm", ours(q), ours(k)) - scores_theirs).max() > 1e-2
    # Per head: head h's channels stay in head h.
    assert hf_llama.rotary_permutation(2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


# ---------------------------------------------------------------- importing


def test_an_imported_llama_computes_hugging_faces_logits(hf_dir: Path) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    imported = hf_llama.import_llama(hf_dir)
    assert imported.options == {"vocab_size": 128, "d_model": 64, "d_ff": 96, "num_layers": 2, "num_heads": 4,
                                "num_kv_heads": 2, "rope_theta": 1000.0, "norm_eps": 1e-5,
                                "tie_embeddings": config["tie_word_embeddings"]}
    assert list(imported.params) == sorted(imported.params)
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in imported.params.values())
    expected = hf_logits(load_file(hf_dir / "model.safetensors"), config, TOKENS)
    assert np.abs(our_logits(imported.options, imported.params) - expected).max() < TOLERANCE


def test_without_the_rotary_permutation_the_logits_differ(hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    monkeypatch.setattr(hf_llama, "rotary_permutation", lambda heads, head_dim: np.arange(heads * head_dim))
    imported = hf_llama.import_llama(hf_dir)
    expected = hf_logits(load_file(hf_dir / "model.safetensors"), config, TOKENS)
    assert np.abs(our_logits(imported.options, imported.params) - expected).max() > 1e-2


def test_sharded_and_bf16_checkpoints_import_as_float32(tmp_path: Path) -> None:
    config = hf_config(False)
    weights = random_hf_weights(config)
    single = hf_llama.import_llama(write_hf_dir(tmp_path / "one", config, weights))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(sharded / file), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    imported = hf_llama.import_llama(sharded)
    assert imported.sha256 == single.sha256
    assert all(np.array_equal(imported.params[n], single.params[n]) for n in single.params)

    # bf16 (what most published checkpoints hold): written by hand, numpy has no bfloat16. A
    # bf16 value is a float32's top half, so the import must give exactly the truncated float32.
    truncated = {n: (a.view(np.uint32) & 0xFFFF0000).view(np.float32) for n, a in weights.items()}
    header, offset, blobs = {}, 0, []
    for name in names:
        blob = (weights[name].view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(weights[name].shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(json.dumps(config))
    head = json.dumps(header).encode()
    (bf16 / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    from_bf16 = hf_llama.import_llama(bf16)
    from_truncated = hf_llama.import_llama(write_hf_dir(tmp_path / "truncated", config, truncated))
    assert all(np.array_equal(from_bf16.params[n], from_truncated.params[n]) for n in from_bf16.params)
    assert from_bf16.sha256 != single.sha256

    # A shard the index names but that does not hold the tensor: named.
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}))
    with pytest.raises(hf_llama.HFLlamaError, match="model-00001-of-00002.safetensors: does not hold"):
        hf_llama.import_llama(sharded)


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling = .*rope type 'llama3' scales"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0}}, "rope_parameters = .*rope type 'yarn'"),
    ({"attention_bias": True}, "attention_bias = true: must be false"),
    ({"mlp_bias": True}, "mlp_bias = true: must be false"),
    ({"head_dim": 32}, "head_dim = 32: must be hidden_size / num_attention_heads = 16"),
    ({"hidden_act": "gelu"}, "hidden_act = \"gelu\": must be \"silu\""),
    ({"model_type": "mistral"}, "model_type = \"mistral\": must be 'llama'"),
    ({"num_key_value_heads": 3}, None),  # does not divide the heads: the factory refuses it at seal
])
def test_configs_we_cannot_represent_are_refused_naming_the_key(tmp_path: Path, change: dict, message: str | None) -> None:
    config = hf_config(False, **change)
    if message is None:
        options = hf_llama.options_from_config(config)
        with pytest.raises(ValueError, match="num_kv_heads = 3: must divide num_heads = 4"):
            llama.LlamaConfig.from_dict({**options, "seq_len": 16})
        return
    with pytest.raises(hf_llama.HFLlamaError, match=f"config.json: {message}"):
        hf_llama.options_from_config(config)


def test_version_4_and_5_spellings_and_omitted_defaults_read_the_same() -> None:
    v5 = hf_config(False, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    del v5["rope_theta"]
    assert hf_llama.options_from_config(v5) == hf_llama.options_from_config(hf_config(False))
    # transformers 4.x leaves out values equal to LlamaConfig's defaults.
    sparse = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    options = hf_llama.options_from_config(sparse)
    assert (options["num_kv_heads"], options["rope_theta"], options["norm_eps"], options["tie_embeddings"]) == \
        (4, 10000.0, 1e-6, False)


def test_every_weight_is_checked_by_name_and_shape(tmp_path: Path) -> None:
    config = hf_config(False)
    weights = random_hf_weights(config)
    weights.pop("model.layers.1.mlp.up_proj.weight")
    weights["model.layers.0.self_attn.q_proj.weight"] = weights["model.layers.0.self_attn.q_proj.weight"][:, :32]
    weights["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # old buffer: skipped
    with pytest.raises(hf_llama.HFLlamaError) as refused:
        hf_llama.import_llama(write_hf_dir(tmp_path / "bad", config, weights))
    assert str(refused.value) == (
        f"{tmp_path / 'bad'}: the tensors do not match config.json (3 problem(s)): "
        "missing model.layers.1.mlp.up_proj.weight; unexpected model.layers.0.self_attn.q_proj.bias; "
        "model.layers.0.self_attn.q_proj.weight is [64, 32], expected [64, 64]")
    # A tied model that saved a head: accepted if it is the embedding, refused otherwise.
    tied = hf_config(True)
    weights = random_hf_weights(tied)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].copy()
    hf_llama.import_llama(write_hf_dir(tmp_path / "tied-head", tied, weights))
    weights["lm_head.weight"] = weights["lm_head.weight"] + 1
    with pytest.raises(hf_llama.HFLlamaError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf_llama.import_llama(write_hf_dir(tmp_path / "untied-head", tied, weights))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf_llama.HFLlamaError, match="has neither model.safetensors nor model.safetensors.index.json"):
        hf_llama.import_llama(tmp_path / "empty")
    with pytest.raises(hf_llama.HFLlamaError, match=f"init_from: {tmp_path / 'nowhere' / 'config.json'} does not exist"):
        hf_llama.import_llama(tmp_path / "nowhere")


def test_the_name_maps_shapes_are_the_factorys() -> None:
    for tied in (False, True):
        options = {**hf_llama.options_from_config(hf_config(tied))}
        shape = hf_llama.LlamaShape(**options)
        vocab = options.pop("vocab_size")
        built = factory.model_signature(ModelSpec.of("llama", vocab_size=vocab, seq_len=16, **options))
        assert {n: s for n, s, _ in built} == hf_llama.our_shapes(shape)
        assert sorted(ours for _, ours, _ in hf_llama.name_map(shape)) == sorted(n for n, _, _ in built)


# ---------------------------------------------------------------- init_from: the founder's import


def _founding(hf: Path, **options: object) -> RunManifest:
    spec = ModelSpec.of("llama", seq_len=16, init_from=str(hf), **options)
    return RunManifest(model=spec, sync=SyncSpec(fragments=2, period=4, overlap=1, codec_down="fp32"))


def test_the_founder_seals_the_imported_shape_and_digest_and_its_state_is_the_import(hf_dir: Path) -> None:
    imported = hf_llama.import_llama(hf_dir)
    sealed = factory.seal(_founding(hf_dir, compute_dtype="float32"))
    model = sealed.model
    assert model.vocab_size == 128 and model.init_from == str(hf_dir)
    assert model.init_sha256 == imported.sha256 == hf_llama.weights_sha256(imported.params)
    options = {k: v for k, v in imported.options.items() if k != "vocab_size"}
    assert dict(model.options) == {**options, "compute_dtype": "float32"}
    assert model.tensors == factory.model_signature(model)
    # The manifest carries it, and every other site builds the same model from the manifest alone.
    again = RunManifest.from_dict(json.loads(sealed.canonical_bytes()))
    assert again == sealed and again.model.to_table()["init_sha256"] == imported.sha256
    # The run's state at index 0 is the imported weights, bit for bit (a witness here: no data).
    site = build_site_model(sealed, learner=False)
    state = {n: a for p in range(site.plan.num_fragments) for n, a in site.replica.state.fragment_params(p).items()}
    assert set(state) == set(imported.params)
    assert all(np.array_equal(state[n], imported.params[n]) for n in state)


def test_a_founding_learner_starts_from_the_import(tmp_path: Path) -> None:
    config = hf_config(True, vocab_size=256)  # the stdlib corpus is bytes
    hf = write_hf_dir(tmp_path / "hf", config, random_hf_weights(config))
    sealed = factory.seal(dataclasses.replace(_founding(hf), inner=dataclasses.replace(
        RunManifest().inner, batch_size=2, warmup_steps=1, total_steps=4)))
    site = build_site_model(sealed, learner=True)
    imported = hf_llama.import_llama(hf)
    state = {n: a for p in range(site.plan.num_fragments) for n, a in site.replica.state.fragment_params(p).items()}
    assert all(np.array_equal(state[n], imported.params[n]) for n in imported.params)


def test_init_from_keys_that_contradict_config_json_are_refused_naming_both(hf_dir: Path) -> None:
    where = hf_dir / "config.json"
    with pytest.raises(ConfigError, match=f"model.d_model = 32 but {where} has hidden_size = 64; "
                                          f"model.num_layers = 3 but {where} has num_hidden_layers = 2"):
        factory.seal(_founding(hf_dir, d_model=32, num_layers=3, num_heads=4))
    with pytest.raises(ConfigError, match=f"model.vocab_size = 512 but {where} has vocab_size = 128"):
        factory.seal(dataclasses.replace(_founding(hf_dir), model=dataclasses.replace(
            _founding(hf_dir).model, vocab_size=512)))
    with pytest.raises(ConfigError, match="model.size = '1m' and model.init_from"):
        factory.seal(_founding(hf_dir, size="1m"))
    with pytest.raises(ConfigError, match="not the model this run was configured to start from"):
        factory.seal(_founding(hf_dir).__class__(model=dataclasses.replace(_founding(hf_dir).model,
                                                                           init_sha256="0" * 64)))
    with pytest.raises(ConfigError, match="init_from = '/x' imports a Hugging Face Llama: it needs factory = \"llama\""):
        ModelSpec.of("bytes", init_from="/x")
    with pytest.raises(ConfigError, match="init_sha256: the digest of imported weights needs model.init_from"):
        ModelSpec.of("llama", init_sha256="0" * 64)


def test_other_weights_in_the_directory_are_refused_and_an_absent_directory_is_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = hf_config(False)
    weights = random_hf_weights(config)
    hf = write_hf_dir(tmp_path / "hf", config, weights)
    sealed = factory.seal(_founding(hf))
    weights["model.norm.weight"] = weights["model.norm.weight"] + np.float32(1e-3)
    write_hf_dir(hf, config, weights)
    with pytest.raises(ConfigError, match=f"the weights in {hf} .* are not the ones this run started from "
                                          f"\\(model.init_sha256 = {sealed.model.init_sha256}\\)"):
        build_site_model(sealed, learner=False)
    moved = dataclasses.replace(sealed, model=dataclasses.replace(sealed.model, init_from=str(tmp_path / "gone")))
    with caplog.at_level(logging.WARNING, logger="diloco_node.daemon"):
        build_site_model(moved, learner=False)
    assert f"the run starts from {tmp_path / 'gone'}, which this site does not have" in caplog.text


def test_init_from_is_a_run_model_key_and_absent_from_manifests_without_it(tmp_path: Path) -> None:
    assert "init_from" not in RunManifest().to_dict()["model"]
    assert "init_sha256" not in RunManifest().to_dict()["model"]
    config = tmp_path / "site.toml"
    config.write_text(f'[run.model]\nfactory = "llama"\ninit_from = "{tmp_path / "hf"}"\nseq_len = 16\n')
    effective = load_config(config, {})
    assert effective.run.model.init_from == str(tmp_path / "hf")
    assert effective.run.model.factory_config() == {"vocab_size": 256, "seq_len": 16}  # not a factory option
    config.write_text(f'[run.model]\ninit_from = "{tmp_path / "hf"}"\n')
    with pytest.raises(ConfigError, match="it needs factory = \"llama\""):
        load_config(config, {})


# ---------------------------------------------------------------- export --format hf


def _llama_data_dir(root: Path, hf: Path, tokenizer_sha256: str = "") -> tuple[Path, dict[str, np.ndarray]]:
    """A founder's data directory as the daemon lays it out (identity + a checkpoint) for a run
    started from `hf`, after one commit per fragment moved every weight."""
    manifest = factory.seal(_founding(hf))
    manifest = dataclasses.replace(manifest, data=dataclasses.replace(manifest.data, tokenizer_sha256=tokenizer_sha256))
    data_dir = root / "data"
    initial = factory.imported_initial(manifest.model)
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 2, 4, 1)
    replica = Replica(plan, initial, manifest.outer)
    from bootstrap.entries import EntryKind, LogEntry
    from diloco_node.sync.replica import CommitPayload
    from wire.codecs import decode_named, encode_named

    rng = np.random.default_rng(3)
    for p in range(plan.num_fragments):
        gradient = {n: rng.normal(0, 0.02, a.shape).astype(np.float32)
                    for n, a in replica.state.fragment_params(p).items()}
        encoded = encode_named(gradient, "fp32")
        entry = LogEntry(1, replica.applied_index + 1, EntryKind.OUTER_COMMIT,
                         CommitPayload(encoded, ("a",), (1.0,)).encode(), fragment=p, round=1,
                         digest=replica.digest_after(p, decode_named(encoded)))
        assert replica.apply(entry).applied
    coordination = CoordinationStore(data_dir / "coordination")
    coordination.save_identity({"node_id": "a", "role": "learner", "manifest": manifest.to_dict(), "addresses": {}})
    with CheckpointStore(data_dir / "checkpoints") as store, ThreadPoolExecutor(1) as disk:
        checkpointer = Checkpointer(node_id="a", checkpoints=store, store=coordination, replica=replica,
                                    disk_executor=disk, retain_entries=16, report_error=pytest.fail)
        asyncio.run(checkpointer.checkpoint(None))
    coordination.close()
    final = {n: np.array(a) for p in range(plan.num_fragments) for n, a in replica.state.fragment_params(p).items()}
    assert not np.array_equal(final["embed/embedding"], initial["embed/embedding"])
    return data_dir, final


def test_export_hf_is_hugging_faces_llama_and_imports_back_bit_for_bit(hf_dir: Path, tmp_path: Path, word_tokenizer,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json", ["hello", "<s>", "world", "</s>"])  # ids 1-4
    data_dir, final = _llama_data_dir(tmp_path, hf_dir, hashlib.sha256(tokenizer.read_bytes()).hexdigest())
    out = tmp_path / "export"
    assert main(["export", "--data-dir", str(data_dir), "--out", str(out), "--format", "hf",
                 "--tokenizer", str(tokenizer)]) == 0
    assert capsys.readouterr().out.endswith(f"to {out} (hf)\n")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["torch_dtype"]) == (["LlamaForCausalLM"], "llama",
                                                                                      "float32")
    # bos and eos not given: the tokenizer's own, in every file that names them.
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (2, 4, 16)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 2, "eos_token_id": 4, "pad_token_id": 4}
    assert json.loads((out / "special_tokens_map.json").read_text()) == {"bos_token": "<s>", "eos_token": "</s>"}
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert (tokenizer_config["tokenizer_class"], tokenizer_config["bos_token"], tokenizer_config["eos_token"],
            tokenizer_config["model_max_length"]) == ("PreTrainedTokenizerFast", "<s>", "</s>", 16)
    # Given ids win over the tokenizer's; an id it does not have is refused.
    again = tmp_path / "export-given"
    assert main(["export", "--data-dir", str(data_dir), "--out", str(again), "--format", "hf",
                 "--tokenizer", str(tokenizer), "--eos-token-id", "3"]) == 0
    assert json.loads((again / "special_tokens_map.json").read_text()) == {"bos_token": "<s>", "eos_token": "world"}
    assert json.loads((again / "config.json").read_text())["eos_token_id"] == 3
    assert main(["export", "--data-dir", str(data_dir), "--out", str(tmp_path / "x"), "--format", "hf",
                 "--tokenizer", str(tokenizer), "--bos-token-id", "99"]) == 2
    assert "token id 99 is not an id of the tokenizer" in capsys.readouterr().err
    imported = hf_llama.import_llama(out)
    assert list(imported.params) == sorted(final)
    assert all(np.array_equal(imported.params[n], final[n]) for n in final)  # bit for bit
    # Hugging Face's forward pass on the exported files is our model on the global weights.
    expected = hf_logits(load_file(out / "model.safetensors"), config, TOKENS)
    assert np.abs(our_logits(imported.options, final) - expected).max() < TOLERANCE
    # Existing output: refused, replaced with --force; never a directory that is not an export.
    assert main(["export", "--data-dir", str(data_dir), "--out", str(out), "--format", "hf"]) == 2
    assert f"{out} exists; pass --force" in capsys.readouterr().err
    assert main(["export", "--data-dir", str(data_dir), "--out", str(out), "--format", "hf", "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] is None  # no tokenizer, no id
    (out / "notes.txt").write_text("mine")
    assert main(["export", "--data-dir", str(data_dir), "--out", str(out), "--format", "hf", "--force"]) == 2
    assert "holds notes.txt: not a Hugging Face export" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporaries left


def test_export_hf_refuses_another_tokenizer_a_bytes_run_and_takes_the_sites_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = hf_config(False)
    hf = write_hf_dir(tmp_path / "hf", config, random_hf_weights(config))
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"model": {}}')
    data_dir, _ = _llama_data_dir(tmp_path, hf, "ab" * 32)
    assert main(["export", "--data-dir", str(data_dir), "--out", str(tmp_path / "x"), "--format", "hf",
                 "--tokenizer", str(tokenizer)]) == 2
    assert "is not the run's ([run.data] tokenizer_sha256 = abab" in capsys.readouterr().err
    assert main(["export", "--data-dir", str(data_dir), "--out", str(tmp_path / "x.npz"),
                 "--tokenizer", str(tokenizer)]) == 2
    assert "go into the hf format only" in capsys.readouterr().err
    # The site's config: its data_dir and its [node.data] tokenizer.
    site = tmp_path / "site.toml"
    site.write_text(f'[node]\nnode_id = "a"\ndata_dir = "{data_dir}"\n[node.data]\nsource = "text"\npaths = ["x.txt"]\n'
                    f'tokenizer = "{tokenizer}"\n')
    assert main(["export", "--config", str(site), "--out", str(tmp_path / "y"), "--format", "hf"]) == 2
    assert f"the tokenizer {tokenizer} (sha256" in capsys.readouterr().err
    assert main(["export", "--out", str(tmp_path / "y"), "--format", "hf"]) == 2
    assert "pass --data-dir DIR (or --config FILE" in capsys.readouterr().err

    with pytest.raises(ExportError, match="the hf format writes a Hugging Face Llama; this run's model factory is "
                                          "'bytes' \\(use --format safetensors or npz\\)"):
        llama_shape(RunManifest())
    # A preset is resolved: the export needs every shape key, not only the ones the run spelled out.
    shape = llama_shape(RunManifest(model=ModelSpec.of("llama", vocab_size=300, size="1m")))
    assert (shape.vocab_size, shape.d_model, shape.num_layers, shape.num_heads, shape.num_kv_heads) == (300, 128, 4, 4, 2)
