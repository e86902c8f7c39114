"""Failpoints and the durable file steps: arming by name, each action, and unsynced data dropped."""

from __future__ import annotations

import errno
import os

import pytest

from diloco_node.storage import durable, failpoints


@pytest.fixture(autouse=True)
def _nothing_armed():
    failpoints.disarm()
    yield
    failpoints.disarm()


def test_a_spec_arms_named_points_with_counts_and_stalls():
    armed = failpoints.arm("log.append=enospc*2, checkpoint.write=crash-before,spool.read=stall:0.5")
    assert armed == {"checkpoint.write": "crash-before", "log.append": "enospc*2", "spool.read": "stall:0.5"}
    assert failpoints.disarm("spool.read") == {"checkpoint.write": "crash-before", "log.append": "enospc*2"}
    assert failpoints.disarm() == {}


@pytest.mark.parametrize(("spec", "message"), [
    ("nope.write=eio", "unknown failpoint 'nope.write'"),
    ("log.append", "expected point=action"),
    ("log.append=explode", "unknown action 'explode'"),
    ("log.append=eio*0", "count must be a positive integer"),
    ("log.append=stall:soon", "stall needs seconds"),
    ("log.append=stall:99999", "stall must be 0..3600"),
    ("log.append=eio@0", "@ needs the hit to start at"),
])
def test_a_bad_spec_is_refused_by_name_and_arms_nothing(spec, message):
    with pytest.raises(failpoints.FailpointError, match=message):
        failpoints.arm(f"history.write=eio,{spec}")
    assert failpoints.armed() == {}


def test_the_environment_arms_at_start():
    assert failpoints.load_from_env({failpoints.ENV_VAR: "manifest.read=eio"}) == {"manifest.read": "eio"}
    assert failpoints.load_from_env({}) == {"manifest.read": "eio"}  # nothing new, nothing cleared


@pytest.mark.parametrize(("action", "code"), [("enospc", errno.ENOSPC), ("eio", errno.EIO)])
def test_errors_fire_their_count_then_the_point_disarms(action, code):
    failpoints.arm(f"history.write={action}*2")
    for _ in range(2):
        with pytest.raises(OSError) as raised:
            failpoints.hit("history.write")
        assert raised.value.errno == code and "failpoint history.write" in str(raised.value)
    failpoints.hit("history.write")  # the third passes
    assert failpoints.armed() == {}


def test_other_points_and_unarmed_runs_pass():
    failpoints.hit("log.append")
    failpoints.arm("log.append=eio")
    failpoints.hit("log.read")
    with pytest.raises(failpoints.FailpointError, match="unknown failpoint"):
        failpoints.hit("log.apend")  # a typo in the code is caught as soon as anything is armed


def test_a_stall_blocks_the_caller(monkeypatch):
    slept = []
    monkeypatch.setattr(failpoints.time, "sleep", slept.append)
    failpoints.arm("spool.write=stall:2.5*1")
    failpoints.hit("spool.write")
    failpoints.hit("spool.write")
    assert slept == [2.5]


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "identity.json"
    durable.atomic_write("identity.write", target, b"old")
    failpoints.arm("identity.write=enospc")
    with pytest.raises(OSError):
        durable.atomic_write("identity.write", target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.json"]


def test_drop_unsynced_cuts_each_tracked_file_to_its_last_fsync(tmp_path):
    log = tmp_path / "log.bin"
    log.write_bytes(b"on-disk")
    durable.track(log)
    with open(log, "ab") as handle:
        handle.write(b"+synced")
        handle.flush()
        durable.sync_file("log.append", handle.fileno(), log)
        handle.write(b"+lost")
        handle.flush()
    fresh = tmp_path / "never-synced"
    durable.track(fresh)
    fresh.write_bytes(b"gone")
    dropped = durable.drop_unsynced()
    assert log.read_bytes() == b"on-disk+synced" and fresh.read_bytes() == b""
    assert sorted((p.name, before, kept) for p, before, kept in dropped) == [("log.bin", 19, 14), ("never-synced", 4, 0)]
    durable.forget(log)
    durable.forget(fresh)


def test_a_start_hit_lets_the_first_hits_pass():
    failpoints.arm("log.read=eio@3*1")
    assert failpoints.armed() == {"log.read": "eio@3*1"}
    failpoints.hit("log.read")
    failpoints.hit("log.read")
    with pytest.raises(OSError):
        failpoints.hit("log.read")
    failpoints.hit("log.read")


def test_storage_health_records_failures_recoveries_and_quarantined_files(tmp_path):
    from diloco_node.ops.storage_health import StorageHealth

    health = StorageHealth()
    assert health.succeeded("log.append") is False
    health.failed("log.append", OSError(28, "No space left on device"))
    health.failed("log.append", OSError(28, "No space left on device"))
    assert health.is_failing("log.append")
    status = health.to_status()
    assert status["failing"]["log.append"]["consecutive"] == 2
    assert "No space left on device" in status["failing"]["log.append"]["error"]
    assert health.succeeded("log.append") is True and not health.is_failing("log.append")
    assert health.to_status()["failures_total"] == {"log.append": 2}
    corrupt = tmp_path / "ckpt-7.bin"
    corrupt.write_bytes(b"x")
    (tmp_path / "ckpt-7.bin.corrupt-1").write_bytes(b"earlier")
    kept = health.quarantine(corrupt, "crc mismatch")
    assert kept.name == "ckpt-7.bin.corrupt-2" and kept.read_bytes() == b"x" and not corrupt.exists()
    assert health.to_status()["quarantined"][0]["reason"] == "crc mismatch"
