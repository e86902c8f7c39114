"""`diloco-node export`: the global model of a site's newest verified checkpoint, out to a file.

The data directory is built the way the daemon builds it: a Replica initialised from the byte
model's parameters takes real outer commits, the daemon's Checkpointer writes its checkpoints
(global state and a learner's snapshot) through the CheckpointStore, and the run manifest sits
in the coordination store's identity file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from bootstrap.entries import EntryKind, LogEntry
from diloco_node.cli import main
from diloco_node.config.manifest import ModelSpec, RunManifest
from diloco_node.daemon.coordination_store import CoordinationStore
from diloco_node.daemon.persistence import Checkpointer
from diloco_node.learn import data as data_lib
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.learn.learner_thread import LearnerSnapshot
from diloco_node.ops.checkpoint import HEADER_BYTES, CheckpointStore, read_checkpoint_file
from diloco_node.ops.export import EXPORT_FORMAT, ExportError, export_global_model, load_export
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.replica import CommitPayload, Replica
from diloco_node.sync.state_codec import params_from_checkpoint
from wire.codecs import decode_named, encode_named

ROOT = Path(__file__).resolve().parent.parent
SEQ_LEN = 16
MANIFEST = RunManifest.from_dict({"seed": 7, "model": {"seq_len": SEQ_LEN},
                                  "sync": {"fragments": 2, "period": 8, "overlap": 1, "codec_down": "fp32"}})


@dataclass(frozen=True)
class Saved:
    path: Path
    commit_index: int
    state_digest: str
    params: dict[str, np.ndarray]  # the global model's parameters when it was saved


@dataclass(frozen=True)
class Site:
    data_dir: Path
    saved: list[Saved]  # oldest first
    names: set[str]  # the model's flat parameter names
    initial_loss: float
    evaluate: object  # flat params -> eval loss on a fixed held-out set


class _SnapshotLearner:
    """Stands in for the LearnerThread: answers a state request at once, as an idle learner does."""

    def __init__(self, params: dict[str, np.ndarray]) -> None:
        self.params = params

    def request_state(self) -> Future:
        future: Future = Future()
        future.set_result(LearnerSnapshot(step=5, tokens=640, params=self.params,
                                          opt_leaves=[np.zeros(3, np.float32)], base_rounds=[0, 0],
                                          c_steps=[5, 5], c_tokens=[640, 640]))
        return future


def _commit_every_fragment(replica: Replica, rng: np.random.Generator) -> None:
    """One outer commit per fragment, as the lease holder appends them to the log."""
    for p in range(replica.plan.num_fragments):
        gradient = {n: rng.normal(0.0, 0.02, replica.state.fragment_params(p)[n].shape).astype(np.float32)
                    for n in replica.plan.fragments[p].names}
        encoded = encode_named(gradient, MANIFEST.sync.codec_down)
        payload = CommitPayload(encoded, ("a",), (1.0,)).encode()
        entry = LogEntry(1, replica.applied_index + 1, EntryKind.OUTER_COMMIT, payload, fragment=p,
                         round=replica.state.round(p) + 1, digest=replica.digest_after(p, decode_named(encoded)))
        assert replica.apply(entry).applied


def _global_params(replica: Replica) -> dict[str, np.ndarray]:
    flat: dict[str, np.ndarray] = {}
    for p in range(replica.plan.num_fragments):
        flat.update({n: np.array(a) for n, a in replica.state.fragment_params(p).items()})
    return flat


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    data_dir = tmp_path_factory.mktemp("site") / "data"
    graphdef, params = factory.init_params(MANIFEST.model, MANIFEST.seed)
    initial = model_lib.flat_params(params)
    sync = MANIFEST.sync
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, sync.fragments, sync.period, sync.overlap)
    replica = Replica(plan, initial, MANIFEST.outer)

    coordination = CoordinationStore(data_dir / "coordination")
    # As a founding node stores it: sealed with the model's parameter signature.
    coordination.save_identity({"node_id": "a", "role": "learner", "manifest": factory.seal(MANIFEST).to_dict(),
                                "addresses": {"a": "http://127.0.0.1:7070"}})
    # The learner's own weights sit beside the global ones under the same tensor names: the
    # export must take the global model's, not these.
    learner = _SnapshotLearner({n: np.full_like(a, 0.5) for n, a in initial.items()})
    rng = np.random.default_rng(0)
    saved = []
    with CheckpointStore(data_dir / "checkpoints") as store, ThreadPoolExecutor(1) as disk:
        checkpointer = Checkpointer(node_id="a", checkpoints=store, store=coordination, replica=replica,
                                    disk_executor=disk, retain_entries=256, report_error=pytest.fail)
        for _ in range(2):
            _commit_every_fragment(replica, rng)
            path, index = asyncio.run(checkpointer.checkpoint(learner))  # type: ignore[arg-type]
            saved.append(Saved(path, index, replica.state.digest(), _global_params(replica)))
    coordination.close()

    inputs, targets = data_lib.eval_batches(rng.integers(0, 256, 4000).astype(np.uint8), 2, 4, SEQ_LEN)
    evaluate_state = model_lib.make_eval_fn(graphdef)

    def evaluate(flat: dict[str, np.ndarray]) -> float:
        return float(evaluate_state(model_lib.load_flat_params(params, flat), inputs, targets))

    return Site(data_dir, saved, set(initial), evaluate(initial), evaluate)


@pytest.fixture
def node_dir(site: Site, tmp_path: Path) -> Path:
    """A private copy of the site's data directory, for tests that damage it."""
    return Path(shutil.copytree(site.data_dir, tmp_path / "node"))


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = HEADER_BYTES + (len(data) - HEADER_BYTES) // 2  # in the body: the checksum catches it
    data[middle] ^= 0xFF
    path.write_bytes(bytes(data))


def _tree_fingerprint(directory: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _export(*args: str) -> int:
    return main(["export", *args])


# ---------------------------------------------------------------- what is exported


def test_safetensors_export_is_the_newest_global_model_and_evaluates_the_same(site: Site, tmp_path: Path) -> None:
    newest = site.saved[-1]
    out = tmp_path / "model.safetensors"
    result = export_global_model(site.data_dir, out)
    assert result.format == "safetensors" and result.model.skipped == ()

    params, metadata = load_export(out)
    assert set(params) == site.names
    assert all(a.dtype == np.float32 for a in params.values())
    assert all(np.array_equal(params[n], newest.params[n]) for n in site.names)
    # Loaded into the model, the file gives exactly the loss of the checkpoint's own parameters.
    from_checkpoint = params_from_checkpoint(read_checkpoint_file(newest.path).arrays)
    loss = site.evaluate(params)
    assert loss == site.evaluate(from_checkpoint)
    assert loss != site.initial_loss and loss != site.evaluate(site.saved[0].params)

    assert metadata["format"] == EXPORT_FORMAT
    assert RunManifest.from_dict(json.loads(metadata["manifest"])) == factory.seal(MANIFEST)
    assert metadata["manifest"] == factory.seal(MANIFEST).canonical_bytes().decode()
    assert metadata["checkpoint"] == newest.path.name
    assert metadata["commit_index"] == str(newest.commit_index) == "4"
    assert metadata["state_digest"] == newest.state_digest
    assert json.loads(metadata["rounds"]) == [2, 2] and metadata["node_id"] == "a"

    # The route the module docstring gives to users of other tools.
    assert all(np.array_equal(a, params[n]) for n, a in load_file(str(out)).items())
    with safe_open(str(out), framework="numpy") as handle:
        assert handle.metadata() == metadata


def test_npz_export_holds_the_same_tensors_and_metadata(site: Site, tmp_path: Path) -> None:
    export_global_model(site.data_dir, tmp_path / "model.safetensors")
    result = export_global_model(site.data_dir, tmp_path / "model.npz")  # the format from the suffix
    assert result.format == "npz"
    st_params, st_metadata = load_export(tmp_path / "model.safetensors")
    npz_params, npz_metadata = load_export(tmp_path / "model.npz")
    assert npz_metadata == st_metadata
    assert set(npz_params) == site.names
    assert all(np.array_equal(npz_params[n], st_params[n]) and npz_params[n].dtype == np.float32
               for n in site.names)
    assert site.evaluate(npz_params) == site.evaluate(site.saved[-1].params)
    with np.load(tmp_path / "model.npz", allow_pickle=False) as archive:  # as documented, no pickle
        assert json.loads(str(archive["__metadata__"])) == st_metadata


def test_format_flag_overrides_the_suffix(site: Site, tmp_path: Path) -> None:
    out = tmp_path / "model.bin"
    assert _export("--data-dir", str(site.data_dir), "--out", str(out), "--format", "npz") == 0
    assert out.read_bytes()[:2] == b"PK"  # a zip: npz
    assert set(load_export(out)[0]) == site.names


# ---------------------------------------------------------------- beside a running node


def test_export_beside_a_running_node_takes_no_lock_and_changes_nothing(node_dir: Path, tmp_path: Path) -> None:
    before = _tree_fingerprint(node_dir)
    # A running node holds the checkpoint directory's lock for its whole life.
    with CheckpointStore(node_dir / "checkpoints"):
        assert _export("--data-dir", str(node_dir), "--out", str(tmp_path / "m.safetensors")) == 0
    assert _tree_fingerprint(node_dir) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


# ---------------------------------------------------------------- fallback and errors


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_and_says_so(
        site: Site, node_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    older, newest = site.saved
    damaged = node_dir / "checkpoints" / newest.path.name
    _flip_a_byte(damaged)
    corrupt_bytes = damaged.read_bytes()
    out = tmp_path / "model.safetensors"
    assert _export("--data-dir", str(node_dir), "--out", str(out)) == 0
    err = capsys.readouterr().err
    assert f"skipped a newer checkpoint: {damaged}: checksum mismatch" in err
    params, metadata = load_export(out)
    assert metadata["checkpoint"] == older.path.name and metadata["commit_index"] == str(older.commit_index)
    assert all(np.array_equal(params[n], older.params[n]) for n in site.names)
    assert site.evaluate(params) == site.evaluate(older.params)
    # Not quarantined, not touched: that is the node's business.
    assert damaged.read_bytes() == corrupt_bytes and not list(node_dir.rglob("*.corrupt"))


def test_every_checkpoint_corrupt_is_exit_2_naming_each(
        site: Site, node_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for saved in site.saved:
        _flip_a_byte(node_dir / "checkpoints" / saved.path.name)
    out = tmp_path / "model.safetensors"
    assert _export("--data-dir", str(node_dir), "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"diloco-node export: no verified checkpoint in {node_dir / 'checkpoints'}; skipped:")
    assert all(f"{saved.path.name}: checksum mismatch" in err for saved in site.saved)
    assert list(tmp_path.glob("*model*")) == []


def test_no_checkpoint_or_no_data_dir_is_exit_2_with_a_clear_message(
        node_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(node_dir / "checkpoints")
    out = str(tmp_path / "model.npz")
    assert _export("--data-dir", str(node_dir), "--out", out) == 2
    assert capsys.readouterr().err == (f"diloco-node export: no checkpoint in {node_dir / 'checkpoints'}: the node "
                                       "has not written one yet (or this is not a node's data directory)\n")
    assert _export("--data-dir", str(tmp_path / "nowhere"), "--out", out) == 2
    assert capsys.readouterr().err == f"diloco-node export: no such data directory: {tmp_path / 'nowhere'}\n"
    assert not (tmp_path / "nowhere").exists() and not Path(out).exists()


def test_missing_manifest_is_exit_2_not_an_export_without_one(node_dir: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    (node_dir / "coordination" / "identity.json").unlink()
    assert _export("--data-dir", str(node_dir), "--out", str(tmp_path / "m.npz")) == 2
    assert "no run manifest" in capsys.readouterr().err and not (tmp_path / "m.npz").exists()


def test_a_checkpoint_that_does_not_fit_the_runs_model_is_exit_2_naming_tensors(
        node_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from diloco_node.storage.records import frame, unframe

    identity_path = node_dir / "coordination" / "identity.json"
    identity = unframe(identity_path.read_bytes(), "node_id")
    other = factory.seal(dataclasses.replace(MANIFEST, model=ModelSpec.of(seq_len=2 * SEQ_LEN)))
    identity["manifest"] = other.to_dict()
    identity_path.write_bytes(frame(identity))
    assert _export("--data-dir", str(node_dir), "--out", str(tmp_path / "m.npz")) == 2
    err = capsys.readouterr().err
    assert f"pos_embed/embedding: float32[{SEQ_LEN}, 64] here, float32[{2 * SEQ_LEN}, 64] in the run" in err, err
    assert not (tmp_path / "m.npz").exists()


def test_existing_output_is_refused_without_force_and_replaced_with_it(
        site: Site, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"someone's file")
    assert _export("--data-dir", str(site.data_dir), "--out", str(out)) == 2
    assert capsys.readouterr().err == f"diloco-node export: {out} exists; pass --force to replace it\n"
    assert out.read_bytes() == b"someone's file"
    assert _export("--data-dir", str(site.data_dir), "--out", str(out), "--force") == 0
    assert set(load_export(out)[0]) == site.names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary left


def test_unwritable_output_and_unknown_formats_are_exit_2(site: Site, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = str(site.data_dir)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cases = {
        str(tmp_path / "missing" / "m.npz"): f"{tmp_path / 'missing'} is not a directory",
        str(blocker / "m.npz"): f"{blocker} is not a directory",
        str(tmp_path): "it is a directory",
    }
    for out, reason in cases.items():
        assert _export("--data-dir", data_dir, "--out", out, "--format", "npz") == 2
        assert capsys.readouterr().err == f"diloco-node export: cannot write {out}: {reason}\n"
    assert _export("--data-dir", data_dir, "--out", str(tmp_path / "m.npz"), "--format", "onnx") == 2
    assert capsys.readouterr().err == "diloco-node export: unknown format 'onnx': use one of safetensors, npz, hf\n"
    assert _export("--data-dir", data_dir, "--out", str(tmp_path / "m.pt")) == 2
    assert "cannot tell the format from 'm.pt'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_cli_end_to_end_reports_what_it_wrote(site: Site, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.safetensors"
    assert _export("--data-dir", str(site.data_dir), "--out", str(out)) == 0
    captured = capsys.readouterr()
    newest = site.saved[-1]
    assert captured.err == ""
    assert captured.out.startswith(f"exported {len(site.names)} tensors (")
    assert f"from {newest.path} (commit index {newest.commit_index}, state digest {newest.state_digest[:16]})" \
        in captured.out
    assert captured.out.endswith(f"to {out} (safetensors)\n")
    assert site.evaluate(load_export(out)[0]) == site.evaluate(newest.params)


def test_load_export_refuses_other_files(tmp_path: Path) -> None:
    other = tmp_path / "other.npz"
    np.savez(other, w=np.zeros(2))
    with pytest.raises(ExportError, match="without a __metadata__ entry"):
        load_export(other)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ExportError, match="not a readable safetensors export"):
        load_export(garbage)


def test_a_damaged_identity_file_is_named_not_read(node_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    identity_path = node_dir / "coordination" / "identity.json"
    data = bytearray(identity_path.read_bytes())
    data[len(data) // 2] ^= 0x01
    identity_path.write_bytes(bytes(data))
    assert _export("--data-dir", str(node_dir), "--out", str(tmp_path / "m.npz")) == 2
    assert "no run manifest" in capsys.readouterr().err and not (tmp_path / "m.npz").exists()
