"""The issue's end-to-end run: a model defined only in this test, trained by 3 real daemons and a
witness on a uint32 token file whose vocabulary is above 65,536; the run stops by itself on
run.stop.tokens, every node exits 0, and the exported safetensors file loads back into the model
with the same eval loss as the final checkpoint's global parameters. Every merge needs the three
learners (`run.sync.min_quorum=3`): the founder alone cannot spend the budget before the joiners
are in, however long they take to start on a loaded machine."""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import pytest

from diloco_node.testbed.launcher import DEFAULT_SETTINGS, REPO
from diloco_node.testbed.local_cluster import Cluster

from conftest import one_final_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 150.0
VOCAB = 70_000
# Narrow and short: every learner's step computes logits over the whole 70,000-token vocabulary.
SEQ_LEN = 16
MODEL_CODE = '''
from flax import nnx

WIDTH = 8


class WideVocab(nnx.Module):
    """A tiny language model over a large vocabulary (defined only in the test)."""

    def __init__(self, vocab, rngs):
        self.embed = nnx.Embed(vocab, WIDTH, rngs=rngs)
        self.mix = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        return self.head(nnx.gelu(self.mix(self.embed(tokens))))


def build(config, rngs):
    return WideVocab(config["vocab_size"], rngs)
'''


def test_own_model_on_uint32_tokens_stops_by_tokens_and_exports(tmp_path) -> None:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "wide_vocab_model.py").write_text(textwrap.dedent(MODEL_CODE))
    # A token stream with a learnable pattern over ids far above 65,535.
    rng = np.random.default_rng(0)
    pattern = rng.integers(60_000, VOCAB, 64)
    ids = np.concatenate([pattern] * 400 + [rng.integers(0, VOCAB, 2_000)]).astype(np.uint32)
    token_file = tmp_path / "tokens.bin"
    ids.tofile(token_file)
    settings = tuple(s for s in DEFAULT_SETTINGS if not s.startswith("run.model.size")) + (
        "run.model.factory=wide_vocab_model:build", f"run.model.vocab_size={VOCAB}",
        "data.source=tokens", f"data.paths={token_file}", "data.token_dtype=uint32",
        f"run.model.seq_len={SEQ_LEN}", "run.stop.tokens=6000", "run.sync.min_quorum=3",
    )
    env = {"PYTHONPATH": os.pathsep.join([str(modules), str(REPO)])}
    with Cluster.create(tmp_path / "run") as cluster:
        a = cluster.add("a", settings=settings, env=env)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        for name in ("b", "c"):
            cluster.add(name, bootstrap=a, settings=settings, env=env)
        cluster.add("w", bootstrap=a, settings=settings, env=env, role="witness")
        codes = {name: site.wait(STARTUP_S + 300) for name, site in cluster.sites.items()}
        assert codes == {"a": 0, "b": 0, "c": 0, "w": 0}, {n: s.log_text()[-1500:] for n, s in cluster.sites.items()}
        one_final_state({name: site.log_text() for name, site in cluster.sites.items()})
        assert "stop.tokens = 6000" in cluster.sites["w"].log_text()

        out = tmp_path / "model.safetensors"
        sys.path.insert(0, str(modules))
        try:
            from diloco_node.cli import main

            assert main(["export", "--data-dir", str(cluster.sites["a"].data_dir), "--out", str(out)]) == 0
            _check_export_loads_back(out, cluster.sites["a"].data_dir, ids)
        finally:
            sys.path.remove(str(modules))


def _check_export_loads_back(out, data_dir, ids) -> None:
    from flax import nnx
    from safetensors.numpy import load_file

    import wide_vocab_model
    from diloco_node.learn import data as data_lib
    from diloco_node.learn import model as model_lib
    from diloco_node.ops.checkpoint import CheckpointStore
    from diloco_node.sync.state_codec import params_from_checkpoint

    exported = load_file(str(out))
    assert exported["embed/embedding"].shape == (VOCAB, wide_vocab_model.WIDTH)
    graphdef, params = nnx.split(wide_vocab_model.build({"vocab_size": VOCAB, "seq_len": SEQ_LEN}, nnx.Rngs(params=0)),
                                 nnx.Param)
    evaluate = model_lib.make_eval_fn(graphdef)
    inputs, targets = data_lib.eval_batches(ids[-3000:], 2, 4, SEQ_LEN)
    from_file = float(evaluate(model_lib.load_flat_params(params, exported), inputs, targets))
    with CheckpointStore(data_dir / "checkpoints") as store:
        loaded = store.load_latest()
    from_checkpoint = float(evaluate(model_lib.load_flat_params(params, params_from_checkpoint(loaded.checkpoint.arrays)),
                                     inputs, targets))
    initial = float(evaluate(params, inputs, targets))
    assert from_file == from_checkpoint
    assert from_file < initial  # the run learned something
