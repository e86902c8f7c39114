"""The W&B tracker (ops/tracking.py `WandbSink`) against the real `wandb` package in offline mode:
the run's files land under the data directory, and its history, read back from the run's
transaction log (`run-<id>.wandb`), holds every scalar at the learner's step. Integration: wandb
starts its own service process. Skipped with the install line where the extra is absent (the
tests/test_tracking.py fake module checks the same calls without it).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from diloco_node.config.site_tracking import TrackingSpec
from diloco_node.ops.tracking import Tracking, eval_set_scalar

pytestmark = pytest.mark.timeout(300)

# The transaction log's framing (W&B's "LevelDB log" layout): a 7-byte file header, then 32 KiB
# blocks of records, each a 7-byte header (CRC-32, length, type) and its bytes; a record split
# over blocks is FIRST, MIDDLE..., LAST.
HEADER = b":W&B\xe1\xbe\x00"
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
# How long the service process may take to write out a finished run (seconds; generous: two loaded cores).
FLUSH_WAIT_S = 30.0


def read_history(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Every history row of a run's .wandb file, in order, as {key: value}; whether the file ends
    the run (holds its exit record)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:len(HEADER)] == HEADER, data[:16]
    pos, records, pending = len(HEADER), [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # the block's zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
    rows, ended = [], False
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        ended = ended or record.WhichOneof("record_type") == "exit"
    return rows, ended


def test_the_real_wandb_offline_run_holds_every_scalar_at_the_learner_step(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install -e '.[wandb]'")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written outside tmp_path
        monkeypatch.setenv(variable, str(tmp_path / variable.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = TrackingSpec(wandb_project="diloco", run_name="site-a-run")  # wandb_mode "offline" by default
    tracking = Tracking.open(spec, tmp_path / "data", "site-a", {"run_id": "r1"})
    tracking.log(5, {"learner/loss": 2.5, "learner/tokens_per_s": 1000.0, "learner/lr": 3e-4})
    tracking.log(10, {"learner/loss": 2.25, eval_set_scalar("wiki"): 3.125, "sync/commit_index": 4.0})
    tracking.close()
    status = tracking.status().wandb
    assert (status.enabled, status.written, status.dropped, status.error) == (True, 2, 0, ""), status

    runs = sorted((tmp_path / "data" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, sorted(p.name for p in (tmp_path / "data").rglob("*"))
    # The file is written by wandb's service process, which (seen once here) had not yet
    # written the history when run.finish() returned: wait for the run's exit record.
    deadline = time.monotonic() + FLUSH_WAIT_S
    rows, ended = read_history(runs[0])
    while not ended and time.monotonic() < deadline:
        time.sleep(0.2)
        rows, ended = read_history(runs[0])
    assert ended, f"{runs[0]} holds no exit record {FLUSH_WAIT_S} s after the tracker closed"
    figures = [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]
    assert [row["_step"] for row in rows] == [5, 10]
    assert figures == [{"learner/loss": 2.5, "learner/tokens_per_s": 1000.0, "learner/lr": 3e-4},
                       {"learner/loss": 2.25, "eval/wiki/loss": 3.125, "sync/commit_index": 4.0}]
