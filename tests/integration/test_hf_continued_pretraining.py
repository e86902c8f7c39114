"""Continued pre-training of a Hugging Face Llama across three sites, end to end (docs/MODELS.md,
"Continue pre-training a Hugging Face Llama across three sites"), with a tiny model: an HF-format
Llama directory (config.json + model.safetensors, written here without transformers), a word
tokenizer with an end-of-document token, a jsonl corpus per site and a separate jsonl eval set.
Three real sites train from the imported weights (`[run.model] init_from`) until they agree on a
few commits; they are stopped, the run is exported with `--format hf`, the export must hold
weights other than the initial ones, and `diloco-node eval --json` must report the eval set.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diloco_node.learn import hf_llama
from diloco_node.testbed.launcher import node_env
from diloco_node.testbed.local_cluster import Cluster

from conftest import TOKENIZER_WORDS

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

STARTUP_S = 240.0  # three JAX processes compiling on two shared cores
EOS = "</s>"
WORDS = (*TOKENIZER_WORDS, EOS)
# Tiny, but every Llama feature the import maps: grouped-query attention (4 heads, 2 kv heads),
# an untied head, a non-default rope base.
SHAPE = hf_llama.LlamaShape(vocab_size=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64,
                            tie_embeddings=False, rope_theta=1000.0, norm_eps=1e-5)
SEQ_LEN = 32


def write_hf_llama(directory: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A Hugging Face Llama directory as transformers' save_pretrained lays it out (config.json and
    model.safetensors under HF names), from random weights; returns them under HF names."""
    rng = np.random.default_rng(seed)
    ours = {name: (np.ones(shape, np.float32) if name.endswith("/scale")
                   else (0.05 * rng.standard_normal(shape)).astype(np.float32))
            for name, shape in hf_llama.our_shapes(SHAPE).items()}
    directory.mkdir(parents=True)
    hf_llama.write_llama(directory, ours, SHAPE, SEQ_LEN)
    assert sorted(json.loads((directory / "config.json").read_text())) and (directory / "model.safetensors").is_file()
    return hf_llama.read_safetensors(directory / "model.safetensors")


def write_jsonl(path: Path, documents: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    with path.open("w") as out:
        for _ in range(documents):
            out.write(json.dumps({"text": " ".join(rng.choice(TOKENIZER_WORDS, int(rng.integers(8, 40))))}) + "\n")
    return path


def site_toml(corpus: Path, tokenizer: Path, eval_set: Path | None = None) -> str:
    """A site's [node.data] as the walkthrough writes it (and, for `eval`, its eval set)."""
    text = (f'[node.data]\nsource = "jsonl"\npaths = ["{corpus}"]\ntokenizer = "{tokenizer}"\n'
            f'eos_token = "{EOS}"\n')
    if eval_set is not None:
        text += f'\n[node.data.eval.heldout]\nsource = "jsonl"\npaths = ["{eval_set}"]\n'
    return text


def cli(*args: str, timeout: float = 180, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """This checkout's diloco-node, as a user runs it (not the installed console script)."""
    return subprocess.run([sys.executable, "-m", "diloco_node", *args], env=node_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def test_a_hf_llama_continues_pretraining_across_three_sites_and_exports(tmp_path, word_tokenizer) -> None:
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json", WORDS)
    initial = write_hf_llama(tmp_path / "llama-in")
    corpora = {name: write_jsonl(tmp_path / f"{name}.jsonl", 400, seed) for seed, name in enumerate("abc")}
    eval_set = write_jsonl(tmp_path / "heldout.jsonl", 60, seed=9)  # no site trains on it
    run_keys = ("run.model.factory=llama", f"run.model.init_from={tmp_path / 'llama-in'}",
                f"run.model.seq_len={SEQ_LEN}", "run.inner.batch_size=4", "run.sync.fragments=2",
                "run.sync.period=8")
    node_keys = ("checkpoint_interval_s=3", "eval_interval_commits=2", "eval_batches=2")

    with Cluster.create(tmp_path / "run") as cluster:
        for name in "abc":  # each site's own corpus, in a config file like the walkthrough's
            (tmp_path / f"site-{name}.toml").write_text(site_toml(corpora[name], tokenizer, eval_set))
        a = cluster.add("a", settings=(*run_keys, *node_keys),
                        extra=("--config", str(tmp_path / "site-a.toml")))
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        for name in "bc":  # joiners state no run keys: they take the founder's manifest
            cluster.add(name, bootstrap=a, settings=node_keys, extra=("--config", str(tmp_path / f"site-{name}.toml")))
        index = cluster.common_commit_index({"a", "b", "c"}, STARTUP_S)
        while index < 4:  # a few commits all three agree on, not just the first one
            index = cluster.common_commit_index({"a", "b", "c"}, STARTUP_S)
        assert cluster.conflicting_indices() == {}, cluster.history
        # The separate eval set is evaluated on the sites' schedule and shown on /status.
        shown = cluster.wait_for("an evaluation of the eval set on site a",
                                 lambda s: "heldout" in (s.get("a", {}).get("evaluation", {}).get("sets") or {}),
                                 STARTUP_S)
        assert math.isfinite(shown["a"]["evaluation"]["sets"]["heldout"]["loss"]), shown["a"]["evaluation"]
        logs = {name: site.log_text() for name, site in cluster.sites.items()}
        assert "b.jsonl" in logs["b"], logs["b"][-2000:]  # each site reads its own corpus
        for site in cluster.sites.values():
            site.signal(signal.SIGTERM)  # a clean stop writes each site's final checkpoint
        codes = {name: site.wait(120) for name, site in cluster.sites.items()}
        assert codes == {"a": 0, "b": 0, "c": 0}, {n: s.log_text()[-2000:] for n, s in cluster.sites.items()}
        data_dir = cluster.sites["a"].data_dir

    out = tmp_path / "llama-out"
    exported = cli("export", "--data-dir", str(data_dir), "--out", str(out), "--format", "hf",
                   "--tokenizer", str(tokenizer))
    assert exported.returncode == 0, exported.stderr
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "special_tokens_map.json",
                                               "generation_config.json"}
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_key_value_heads"], config["vocab_size"]) == (32, 2, 32)
    trained = hf_llama.read_safetensors(out / "model.safetensors")
    assert sorted(trained) == sorted(initial)
    assert all(trained[k].shape == initial[k].shape for k in initial)
    moved = [k for k in initial if not np.array_equal(trained[k], initial[k])]
    assert "model.embed_tokens.weight" in moved and len(moved) > len(initial) // 2, moved

    # From the test's own directory: the site's default data_dir (its tokenized-data cache) is relative.
    evaluated = cli("eval", "--model", str(out), "--config", str(tmp_path / "site-a.toml"), "--max-tokens", "2000",
                    "--json", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads(evaluated.stdout)
    heldout = report["sets"]["heldout"]
    assert math.isfinite(heldout["loss"]) and 0 < heldout["loss"] < 10 and heldout["tokens"] > 0, report
