"""Local checkpoints: round trip, atomic writes, verification, rotation and fallback (a real
crash mid-save: tests/integration/test_checkpoint_processes.py)."""

import os

import ml_dtypes
import numpy as np
import pytest

from diloco_node.ops.checkpoint import (
    HEADER_BYTES,
    CheckpointError,
    CheckpointStore,
    read_checkpoint_file,
    write_checkpoint_file,
)


def _state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "params/w": rng.standard_normal((7, 5)).astype(np.float32),
        "params/b": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
        "opt/count": np.array(step, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.uint16),
    }


def test_round_trip_is_bit_exact_with_metadata(tmp_path):
    arrays = _state(3)
    meta = {"node_id": "site-a", "step": 3, "last_applied_index": 41, "loss": 2.5, "counters": [1, 2]}
    with CheckpointStore(tmp_path) as store:
        path = store.save(meta, arrays)
        result = store.load_latest()
    assert path.name == "ckpt-000000000001.bin"
    assert result is not None and result.skipped == ()
    loaded = result.checkpoint
    assert loaded.meta == meta
    assert set(loaded.arrays) == set(arrays)
    for name, array in arrays.items():
        assert loaded.arrays[name].dtype == array.dtype
        assert loaded.arrays[name].shape == array.shape
        assert loaded.arrays[name].tobytes() == array.tobytes()
    # Array data is aligned for numpy/JAX.
    assert all(a.ctypes.data % 16 == 0 for a in loaded.arrays.values() if a.size)


def test_empty_directory_has_no_checkpoint(tmp_path):
    with CheckpointStore(tmp_path / "new") as store:
        assert store.load_latest() is None


def test_rotation_keeps_last_n(tmp_path):
    with CheckpointStore(tmp_path, keep=2) as store:
        for step in range(5):
            store.save({"step": step}, _state(step))
        assert store.sequences() == [4, 5]
        assert store.load_latest().checkpoint.meta == {"step": 4}


def test_truncated_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "ckpt-000000000001.bin"
    write_checkpoint_file(path, 1, {"step": 1}, _state(1))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"ckpt-000000000001\.bin: truncated or padded"):
        read_checkpoint_file(path)
    path.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match="shorter than the 56-byte header"):
        read_checkpoint_file(path)


def test_flipped_byte_fails_the_checksum(tmp_path):
    path = tmp_path / "ckpt-000000000001.bin"
    write_checkpoint_file(path, 1, {"step": 1}, _state(1))
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + len(data) // 2 - HEADER_BYTES // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_checkpoint_file(path)


def test_other_files_and_versions_are_refused(tmp_path):
    path = tmp_path / "ckpt-000000000001.bin"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(CheckpointError, match="not a diloco-node checkpoint"):
        read_checkpoint_file(path)
    write_checkpoint_file(path, 1, {}, {})
    data = bytearray(path.read_bytes())
    data[8] = 99  # format version
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="format version 99"):
        read_checkpoint_file(path)


def test_corrupt_newest_falls_back_and_is_quarantined(tmp_path):
    with CheckpointStore(tmp_path) as store:
        store.save({"step": 1}, _state(1))
        newest = store.save({"step": 2}, _state(2))
        data = bytearray(newest.read_bytes())
        data[-1] ^= 0xFF
        newest.write_bytes(bytes(data))
        result = store.load_latest()
        assert result.checkpoint.meta == {"step": 1}
        assert len(result.skipped) == 1 and "ckpt-000000000002.bin: checksum mismatch" in result.skipped[0]
        assert (tmp_path / "ckpt-000000000002.bin.corrupt-1").exists()  # kept, named on /status
        # The next save does not reuse the quarantined sequence number.
        assert store.save({"step": 3}, _state(3)).name == "ckpt-000000000003.bin"


def test_all_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    with CheckpointStore(tmp_path) as store:
        for step in (1, 2):
            path = store.save({"step": step}, _state(step))
            path.write_bytes(path.read_bytes()[:100])
        with pytest.raises(CheckpointError, match="no loadable checkpoint") as exc:
            store.load_latest()
    assert "ckpt-000000000001.bin" in str(exc.value) and "ckpt-000000000002.bin" in str(exc.value)


def test_partial_temp_file_from_a_crash_is_ignored_and_cleaned(tmp_path):
    with CheckpointStore(tmp_path) as store:
        store.save({"step": 1}, _state(1))
    partial = tmp_path / ".ckpt-000000000002.bin.tmp"
    partial.write_bytes(b"DILOCOCK" + b"\x00" * 30)  # a write cut short before the rename
    with CheckpointStore(tmp_path) as store:
        assert store.removed_partials == (partial,)
        assert not partial.exists()
        assert store.load_latest().checkpoint.meta == {"step": 1}


def test_failure_during_write_leaves_previous_checkpoints_intact(tmp_path, monkeypatch):
    with CheckpointStore(tmp_path) as store:
        store.save({"step": 1}, _state(1))

        def crash(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "fsync", crash)
        with pytest.raises(OSError, match="No space left"):
            store.save({"step": 2}, _state(2))
        monkeypatch.undo()
        assert store.sequences() == [1]
        assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        assert store.load_latest().checkpoint.meta == {"step": 1}


def test_second_store_on_the_same_directory_is_refused(tmp_path):
    with CheckpointStore(tmp_path):
        with pytest.raises(CheckpointError, match="locked by another process"):
            CheckpointStore(tmp_path)
    CheckpointStore(tmp_path).close()  # released on close


def test_bad_inputs_are_refused_before_writing(tmp_path):
    with CheckpointStore(tmp_path) as store:
        with pytest.raises(ValueError, match="dtype 'object' is not allowed"):
            store.save({}, {"x": np.array([object()])})
        with pytest.raises(ValueError, match="not plain data"):
            store.save({"when": object()}, {})
        assert store.sequences() == []
    with pytest.raises(ValueError, match="keep = 1"):
        CheckpointStore(tmp_path, keep=1)


def test_verify_streams_the_same_checks_and_returns_the_metadata(tmp_path):
    """Compaction's read-back check: the checksum over the body in chunks, the metadata out."""
    from diloco_node.ops.checkpoint import verify_checkpoint_file
    path = tmp_path / "ckpt-000000000001.bin"
    write_checkpoint_file(path, 1, {"applied_index": 7}, _state(1))
    assert verify_checkpoint_file(path, chunk_bytes=64) == {"applied_index": 7}
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # in the last array, far past the index
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        verify_checkpoint_file(path, chunk_bytes=64)
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointError, match="truncated or padded"):
        verify_checkpoint_file(path)
