"""`diloco-node eval` (issue 28 item 7): a data directory's global model, its export and its
Hugging Face export score the same on a site's eval sets; windows are fixed and `--max-tokens`
limits them exactly; the loss is the mean next-token cross-entropy a hand computation gives."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from bootstrap.entries import EntryKind, LogEntry
from diloco_node.cli import main
from diloco_node.config.manifest import RunManifest
from diloco_node.daemon.coordination_store import CoordinationStore
from diloco_node.daemon.persistence import Checkpointer
from diloco_node.learn import factory
from diloco_node.learn.learner_thread import LearnerSnapshot
from diloco_node.ops.checkpoint import CheckpointStore
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.replica import CommitPayload, Replica
from wire.codecs import decode_named, encode_named

SEQ_LEN = 16
VOCAB = 300
# One narrow layer: every property here holds at any depth, and each eval compiles the model again.
MANIFEST = RunManifest.from_dict({"seed": 3, "model": {"factory": "llama", "vocab_size": VOCAB, "seq_len": SEQ_LEN,
                                                       "size": "1m", "num_layers": 1, "d_model": 64, "d_ff": 128},
                                  "sync": {"fragments": 1, "period": 8, "overlap": 1, "codec_down": "fp32"}})


class _Learner:
    def __init__(self, params: dict[str, np.ndarray]) -> None:
        self.params = params

    def request_state(self) -> Future:
        future: Future = Future()
        future.set_result(LearnerSnapshot(step=1, tokens=16, params=self.params, opt_leaves=[np.zeros(1, np.float32)],
                                          base_rounds=[0], c_steps=[1], c_tokens=[16]))
        return future


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory with one checkpoint of a tiny llama (one outer commit off its init), the
    site's config and its token files: training data and two eval sets."""
    root = tmp_path_factory.mktemp("eval")
    data_dir = root / "data"
    initial = factory.init_flat_params(MANIFEST.model, MANIFEST.seed)
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 1, 8, 1)
    replica = Replica(plan, initial, MANIFEST.outer)
    rng = np.random.default_rng(0)
    gradient = {n: rng.normal(0, 0.05, a.shape).astype(np.float32) for n, a in initial.items()}
    encoded = encode_named(gradient, "fp32")
    entry = LogEntry(1, 1, EntryKind.OUTER_COMMIT, CommitPayload(encoded, ("a",), (1.0,)).encode(), fragment=0,
                     round=1, digest=replica.digest_after(0, decode_named(encoded)))
    assert replica.apply(entry).applied
    coordination = CoordinationStore(data_dir / "coordination")
    coordination.save_identity({"node_id": "a", "role": "learner", "manifest": factory.seal(MANIFEST).to_dict(),
                                "addresses": {"a": "http://127.0.0.1:7070"}})
    with CheckpointStore(data_dir / "checkpoints") as store, ThreadPoolExecutor(1) as disk:
        checkpointer = Checkpointer(node_id="a", checkpoints=store, store=coordination, replica=replica,
                                    disk_executor=disk, retain_entries=16, report_error=pytest.fail)
        asyncio.run(checkpointer.checkpoint(_Learner(initial)))  # type: ignore[arg-type]
    coordination.close()
    rng.integers(0, VOCAB, 4000).astype(np.uint16).tofile(root / "train.bin")
    rng.integers(0, VOCAB, 1000).astype(np.uint16).tofile(root / "wiki.bin")
    (np.arange(500) % 11).astype(np.uint16).tofile(root / "code.bin")
    (root / "site.toml").write_text(f"""
[node]
node_id = "a"
bootstrap = []
data_dir = "{data_dir}"
[node.data]
source = "tokens"
token_dtype = "uint16"
paths = ["train.bin"]
[node.data.eval.wiki]
paths = ["wiki.bin"]
[node.data.eval.code]
paths = ["code.bin"]
""")
    return root


def _eval(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["eval", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _sets(capsys: pytest.CaptureFixture[str], model: Path, config: Path, *extra: str) -> dict:
    code, out, err = _eval(capsys, "--model", str(model), "--config", str(config), "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_a_data_dir_its_export_and_its_hf_export_score_the_same(site: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = site / "site.toml"
    from_dir = _sets(capsys, site / "data", config)
    assert main(["export", "--data-dir", str(site / "data"), "--out", str(tmp_path / "m.safetensors")]) == 0
    assert main(["export", "--data-dir", str(site / "data"), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    capsys.readouterr()
    from_export = _sets(capsys, tmp_path / "m.safetensors", config)
    from_hf = _sets(capsys, tmp_path / "hf", config)
    # The JSON shape, exactly: {"sets": {NAME: {"loss": float, "tokens": int}}}.
    assert list(from_dir) == ["sets"] and list(from_dir["sets"]) == ["wiki", "code"]
    assert all(set(s) == {"loss", "tokens"} and isinstance(s["loss"], float) and isinstance(s["tokens"], int)
               for s in from_dir["sets"].values())
    assert from_dir["sets"]["wiki"]["tokens"] == (1000 - 1) // SEQ_LEN * SEQ_LEN
    assert from_dir["sets"]["code"]["tokens"] == (500 - 1) // SEQ_LEN * SEQ_LEN
    assert from_export == from_dir  # the same tensors and manifest: bit for bit
    for name in ("wiki", "code"):  # the HF layout round trip is lossless; the figure agrees within 1e-6
        assert from_hf["sets"][name]["tokens"] == from_dir["sets"][name]["tokens"]
        assert abs(from_hf["sets"][name]["loss"] - from_dir["sets"][name]["loss"]) <= 1e-6
    assert from_dir["sets"]["code"]["loss"] != from_dir["sets"]["wiki"]["loss"]


def _hand_loss(data_dir: Path, tokens: np.ndarray, windows: int) -> float:
    """The mean next-token cross-entropy of the checkpoint's model, window by window in float64."""
    from flax import nnx

    from diloco_node.learn import model as model_lib
    from diloco_node.ops.export import read_global_model

    graphdef, template = factory.abstract_model(MANIFEST.model)
    params = model_lib.load_flat_params(template, read_global_model(data_dir).params)
    model = nnx.merge(graphdef, params)
    losses = []
    for i in range(windows):
        window = tokens[i * SEQ_LEN:(i + 1) * SEQ_LEN + 1].astype(np.int32)
        logits = np.asarray(model(window[None, :-1]), dtype=np.float64)[0]
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        losses.extend(-logp[np.arange(SEQ_LEN), window[1:]])
    assert len(losses) == windows * SEQ_LEN
    return float(np.mean(losses))


def test_max_tokens_limits_the_windows_exactly_and_the_loss_is_the_hand_computed_one(
        site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = site / "site.toml"
    wiki = np.fromfile(site / "wiki.bin", np.uint16)
    for max_tokens, windows in ((3 * SEQ_LEN + 1, 3), (3 * SEQ_LEN, 2), (SEQ_LEN + 1, 1)):
        result = _sets(capsys, site / "data", config, "--max-tokens", str(max_tokens))["sets"]["wiki"]
        assert result["tokens"] == windows * SEQ_LEN
        assert result["loss"] == pytest.approx(_hand_loss(site / "data", wiki, windows), abs=1e-5)
    # More windows than one batch (8): the mean is over tokens whatever the batching.
    result = _sets(capsys, site / "data", config, "--max-tokens", str(11 * SEQ_LEN + 1))["sets"]["wiki"]
    assert result["tokens"] == 11 * SEQ_LEN
    assert result["loss"] == pytest.approx(_hand_loss(site / "data", wiki, 11), abs=1e-5)


def test_without_eval_sets_the_held_out_slice_is_scored(site: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    text = (site / "site.toml").read_text().split("[node.data.eval.wiki]")[0]
    (tmp_path / "plain.toml").write_text(text.replace('"train.bin"', f'"{site / "train.bin"}"'))
    result = _sets(capsys, site / "data", tmp_path / "plain.toml")
    # The last eval_fraction (0.05) of train.bin: 200 tokens, 12 windows of 16.
    assert list(result["sets"]) == ["held_out"] and result["sets"]["held_out"]["tokens"] == 12 * SEQ_LEN


def test_clear_errors_exit_2(site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = site / "site.toml"
    (tmp_path / "junk").mkdir()
    code, _, err = _eval(capsys, "--model", str(tmp_path / "junk"), "--config", str(config))
    assert code == 2 and "not a node's data directory" in err and "Hugging Face Llama directory" in err
    (tmp_path / "junk.bin").write_bytes(b"not an export")
    code, _, err = _eval(capsys, "--model", str(tmp_path / "junk.bin"), "--config", str(config))
    assert code == 2 and "not an export of `diloco-node export`" in err
    # Ids the model's vocabulary (300) does not have.
    np.full(100, 4000, np.uint16).tofile(tmp_path / "big.bin")
    big = config.read_text().replace('"wiki.bin"', f'"{tmp_path / "big.bin"}"').replace(
        '"train.bin"', f'"{site / "train.bin"}"').replace('"code.bin"', f'"{site / "code.bin"}"')
    (tmp_path / "big.toml").write_text(big)
    code, _, err = _eval(capsys, "--model", str(site / "data"), "--config", str(tmp_path / "big.toml"))
    assert code == 2 and "eval set 'wiki': id 4000 is not below the model's vocabulary (300 ids" in err
    (tmp_path / "witness.toml").write_text(f'[node]\nnode_id = "w"\nrole = "witness"\nbootstrap = []\n'
                                           f'data_dir = "{tmp_path / "w"}"\n')
    code, _, err = _eval(capsys, "--model", str(site / "data"), "--config", str(tmp_path / "witness.toml"))
    assert code == 2 and "a witness reads no data, so it has no eval data" in err
    code, _, err = _eval(capsys, "--model", str(site / "data"), "--config", str(config), "--max-tokens", "16")
    assert code == 2 and "eval set 'wiki': --max-tokens 16 hold no window of seq_len 16 + 1 tokens" in err
