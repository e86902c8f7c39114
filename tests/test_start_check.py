"""The state files read before JAX is imported (daemon/start_check.py, issue 37 item 3): the same
errors the start raises, without the import (that it imports no JAX:
tests/integration/test_commands_without_jax.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bootstrap.coordinator_node import PersistentState
from diloco_node.daemon.coordination_records import DamagedStateError
from diloco_node.daemon.coordination_store import CoordinationStore
from diloco_node.daemon.log_records import CoordinationStoreError
from diloco_node.daemon.start_check import COORDINATION_DIR, check_state_files
from diloco_node.ops.checkpoint import CheckpointError, CheckpointStore
from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import failpoints


pytestmark = pytest.mark.usefixtures("clean_storage_state")


def _node_dir(tmp_path):
    store = CoordinationStore(tmp_path / COORDINATION_DIR)
    store.save_identity({"node_id": "a", "manifest": {"run": "x"}})
    store.sync(PersistentState.founding(["a"]))
    return store.directory


def test_a_readable_node_and_a_new_one_pass(tmp_path) -> None:
    check_state_files(tmp_path / "new")
    _node_dir(tmp_path)
    check_state_files(tmp_path)


@pytest.mark.parametrize("name", ["election.json", "log.bin", "log.mark.json", "vote_floor.bin"])
def test_a_directory_where_a_state_file_should_be_is_named(tmp_path, name) -> None:
    directory = _node_dir(tmp_path)
    path = directory / name
    if path.exists():
        path.unlink()
    path.mkdir()
    with pytest.raises((OSError, CoordinationStoreError), match=name):
        check_state_files(tmp_path)


def test_an_io_error_reading_the_log_is_named_and_a_damaged_identity_refused(tmp_path) -> None:
    directory = _node_dir(tmp_path)
    failpoints.arm("log.read=eio")
    with pytest.raises(CoordinationStoreError, match="log.bin: unreadable: .*Input/output error"):
        check_state_files(tmp_path)
    failpoints.disarm()
    identity = directory / "identity.json"
    identity.write_bytes(identity.read_bytes()[:10])
    with pytest.raises(DamagedStateError, match="restore identity.json"):
        check_state_files(tmp_path)
    assert STORAGE.to_status()["quarantined"][0]["file"].endswith("identity.json")


def test_checkpoints_none_of_which_can_be_read_stop_the_start_and_one_readable_is_enough(tmp_path) -> None:
    checkpoints = tmp_path / "checkpoints"
    with CheckpointStore(checkpoints) as store:
        older = store.save({"applied_index": 1}, {"w": np.zeros(4, np.float32)})
        newer = store.save({"applied_index": 2}, {"w": np.zeros(4, np.float32)})
    newer.unlink()
    newer.mkdir()
    check_state_files(tmp_path)  # the older one reads: the start loads it (or says why not)
    older.unlink()
    older.mkdir()
    failed = "(?s)every candidate failed:.*ckpt-0+2.bin: cannot read: Is a directory.*ckpt-0+1.bin"
    with pytest.raises(CheckpointError, match=failed):
        check_state_files(tmp_path)
