"""A full, failing or corrupting disk under the node's other files (issue 26): checkpoints, the
history, the fragment-version rings, spooled relay payloads, exports and the data cache.

Each failpoint x {ENOSPC, EIO} in process (crashes around the fsyncs are in
tests/integration/test_storage_crash_files.py): nothing half-written is read back as good, the
failure is recorded for /status (`STORAGE`) and warned once per streak, the node and its learner go
on, and the next write that succeeds clears it. Each file read back x {bit flip, truncation}: the
damage is detected by the file's checksum, the file quarantined (kept, named) and the node recovers.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from bootstrap.relay_tree import plan_relay_tree
from diloco_node.daemon.history_hooks import DaemonHistory
from diloco_node.daemon.history_ring import DiskFragmentHistory
from diloco_node.daemon.persistence import Checkpointer, restart_plan
from diloco_node.daemon.relay_spool import HeldPayloads, SpoolCorrupt, SpooledPayload
from diloco_node.learn import data as data_lib
from diloco_node.ops import export as export_lib
from diloco_node.ops.checkpoint import CheckpointError, CheckpointStore
from diloco_node.ops.history import HistoryWriter, read_history
from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import failpoints
from wire import messages as wire

from test_daemon_relays import PAYLOAD, cluster, completed_payloads, holders_append, settle_network, spool_files

ERRORS = [("enospc", errno.ENOSPC), ("eio", errno.EIO)]
DAMAGE = ["bit-flip", "truncation"]


pytestmark = pytest.mark.usefixtures("clean_storage_state")


def _damage(path: Path, how: str, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    if how == "bit-flip":
        data[len(data) // 2 if at is None else at] ^= 0x10
    else:
        data = data[:len(data) // 2 if at is None else at]
    path.write_bytes(bytes(data))


def _state(step: int) -> dict[str, np.ndarray]:
    return {"global/w": np.full((4, 8), step, np.float32), "learner/m": np.arange(16, dtype=np.float32) * step}


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("action", "code"), ERRORS)
def test_a_refused_checkpoint_leaves_the_previous_ones_and_no_partial_file(tmp_path, action, code):
    with CheckpointStore(tmp_path) as store:
        store.save({"step": 1}, _state(1))
        failpoints.arm(f"checkpoint.write={action}*1")
        with pytest.raises(OSError) as refused:
            store.save({"step": 2}, _state(2))
        assert refused.value.errno == code
        assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.lock", "ckpt-000000000001.bin"]
        assert store.load_latest().checkpoint.meta == {"step": 1}
        assert store.save({"step": 3}, _state(3)).name == "ckpt-000000000002.bin"  # the disk took it again


class _Replica:
    applied_index = 7

    def checkpoint_entries(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return {"rounds": [3]}, {"global/w": np.ones((4, 4), np.float32)}


@pytest.mark.parametrize(("action", "code"), ERRORS)
def test_the_periodic_checkpoint_reports_a_refused_write_goes_on_and_recovers(tmp_path, caplog, action, code):
    errors: list[str] = []
    with CheckpointStore(tmp_path) as store, ThreadPoolExecutor(1) as disk:
        checkpointer = Checkpointer(node_id="n1", checkpoints=store, store=None, replica=_Replica(),  # type: ignore[arg-type]
                                    disk_executor=disk, retain_entries=10, report_error=errors.append)
        failpoints.arm(f"checkpoint.write={action}*2")
        with caplog.at_level(logging.WARNING, logger="diloco_node.daemon"):
            for _ in range(2):  # the periodic job returns: no exception ends the node's periodic task
                asyncio.run(checkpointer.checkpoint_and_compact(None, None, None, stopping=lambda: False))  # type: ignore[arg-type]
        failing = STORAGE.to_status()["failing"]["checkpoint.write"]
        assert failing["consecutive"] == 2 and str(code) in failing["error"]
        assert len(errors) == 2 and "checkpoint not written" in errors[0]
        assert len([r for r in caplog.records if "checkpoint not written" in r.message]) == 1  # once per streak
        assert store.sequences() == []
        written = asyncio.run(checkpointer.checkpoint(None))
        assert written is not None and written[1] == 7 and store.sequences() == [1]
        assert not STORAGE.is_failing("checkpoint.write")
        assert any("written again" in r.message for r in caplog.records)


def test_an_unreadable_checkpoint_is_skipped_but_not_quarantined(tmp_path):
    with CheckpointStore(tmp_path) as store:
        store.save({"step": 1}, _state(1))
        store.save({"step": 2}, _state(2))
        failpoints.arm("checkpoint.read=eio*1")  # the newest's read fails: the disk, maybe not the file
        loaded = store.load_latest()
        assert loaded.checkpoint.meta == {"step": 1} and "cannot read" in loaded.skipped[0]
        assert store.sequences() == [1, 2] and STORAGE.to_status()["quarantined"] == []
        assert store.load_latest().checkpoint.meta == {"step": 2}  # the read works again


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_is_detected_quarantined_and_the_older_one_loaded(tmp_path, how):
    with CheckpointStore(tmp_path) as store:
        store.save({"applied_index": 10}, _state(1))
        newest = store.save({"applied_index": 20}, _state(2))
        _damage(newest, how)
        loaded = store.load_latest()
        assert loaded.checkpoint.meta == {"applied_index": 10}
        assert ("checksum mismatch" if how == "bit-flip" else "truncated") in loaded.skipped[0]
        kept = tmp_path / "ckpt-000000000002.bin.corrupt-1"
        assert kept.exists() and not newest.exists()
        quarantined = STORAGE.to_status()["quarantined"]
        assert [q["kept_as"] for q in quarantined] == [str(kept)]
        assert store.save({"applied_index": 30}, _state(3)).name == "ckpt-000000000003.bin"  # never reused
    # Recovery: the log replays from the older checkpoint if it still holds the entries after it,
    # else the global state is installed from peers (the restart rule).
    assert restart_plan(checkpoint_index=10, snapshot_index=5, log_last_index=25, has_peers=True).install_floor == 0
    assert restart_plan(checkpoint_index=10, snapshot_index=15, log_last_index=25, has_peers=True).install_floor == 15


@pytest.mark.parametrize("how", DAMAGE)
def test_a_checkpoint_damaged_before_compaction_reads_it_is_quarantined_and_the_log_kept(tmp_path, how):
    from types import SimpleNamespace

    errors: list[str] = []
    with CheckpointStore(tmp_path) as store, ThreadPoolExecutor(1) as disk:
        checkpointer = Checkpointer(node_id="n1", checkpoints=store, store=None, replica=_Replica(),  # type: ignore[arg-type]
                                    disk_executor=disk, retain_entries=2, report_error=errors.append)
        path, index = asyncio.run(checkpointer.checkpoint(None))  # type: ignore[misc]
        _damage(path, how)
        # A log long enough to compact below the checkpoint: the compaction reads the checkpoint first.
        coordination = SimpleNamespace(log=SimpleNamespace(commit_index=100, last_index=100, store=SimpleNamespace(
            snapshot=SimpleNamespace(last_index=0))))
        asyncio.run(checkpointer.compact_log(coordination, None, path, index, lambda: False))  # type: ignore[arg-type]
        assert "did not verify; log not compacted" in errors[0]
        assert store.sequences() == [] and (tmp_path / f"{path.name}.corrupt-1").exists()
        assert STORAGE.is_failing("checkpoint.read")


def test_a_bit_flip_anywhere_in_a_checkpoint_is_detected(tmp_path):
    from diloco_node.ops.checkpoint import HEADER_BYTES, read_checkpoint_file, write_checkpoint_file

    path = tmp_path / "ckpt-000000000001.bin"
    write_checkpoint_file(path, 1, {"applied_index": 1}, _state(1))
    good = path.read_bytes()
    for at in [*range(HEADER_BYTES), *range(HEADER_BYTES, len(good), 97)]:  # every header byte, a sample of the body
        damaged = bytearray(good)
        damaged[at] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointError):
            read_checkpoint_file(path)


def test_when_every_checkpoint_is_damaged_the_node_starts_without_one_and_says_so(tmp_path):
    errors: list[str] = []
    with CheckpointStore(tmp_path) as store:
        for step in (1, 2):
            _damage(store.save({"applied_index": step}, _state(step)), "bit-flip")
        checkpointer = Checkpointer(node_id="n1", checkpoints=store, store=None, replica=_Replica(),  # type: ignore[arg-type]
                                    disk_executor=None, retain_entries=10, report_error=errors.append)  # type: ignore[arg-type]
        assert checkpointer._load_latest() is None
        assert "every checkpoint failed its check" in errors[0]
        assert len(STORAGE.to_status()["quarantined"]) == 2
    with CheckpointStore(tmp_path) as store:
        store.save({"applied_index": 1}, _state(1))
        store.save({"applied_index": 2}, _state(2))
        for sequence in store.sequences():
            _damage(store.path_for(sequence), "bit-flip")
        failpoints.arm("checkpoint.read=eio*1")  # one merely unreadable: it may be good, the start stops
        checkpointer.checkpoints = store
        with pytest.raises(CheckpointError, match="no loadable checkpoint"):
            checkpointer._load_latest()


# ---------------------------------------------------------------------------------------------
# History
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("action", "code"), ERRORS)
def test_a_refused_history_line_is_dropped_reported_once_and_lines_resume(tmp_path, caplog, action, code):
    path = tmp_path / "history.jsonl"
    writer = HistoryWriter(path, "n1")
    writer.record("start", index=0)
    failpoints.arm(f"history.write={action}*3")
    with caplog.at_level(logging.WARNING, logger="diloco_node.history"):
        for index in (1, 2, 3):  # no exception reaches the node
            writer.record("commit", epoch=1, index=index, entry_digest="e")
        assert writer.lost_events == 3 and STORAGE.to_status()["failing"]["history.write"]["consecutive"] == 3
        assert str(code) in STORAGE.to_status()["failing"]["history.write"]["error"]
        writer.record("commit", epoch=1, index=4, entry_digest="e")
    writer.close()
    assert not STORAGE.is_failing("history.write")
    warnings = [r.message for r in caplog.records]
    assert len([m for m in warnings if "not written" in m]) == 1 and any("written again" in m for m in warnings)
    history = read_history(path)
    assert [(e.kind, e.index) for e in history.events] == [("start", 0), ("commit", 4)] and not history.torn_tail


def test_a_short_write_is_cut_back_so_the_next_line_starts_clean(tmp_path, monkeypatch):
    import diloco_node.ops.history as history_module

    path = tmp_path / "history.jsonl"
    writer = HistoryWriter(path, "n1", fsync="never")
    writer.record("start", index=0)
    real_write = history_module.os.write
    monkeypatch.setattr(history_module.os, "write", lambda fd, data: real_write(fd, data[:10]))  # the disk filled mid-line
    writer.record("commit", epoch=1, index=1, entry_digest="e")
    monkeypatch.setattr(history_module.os, "write", real_write)
    writer.record("commit", epoch=1, index=2, entry_digest="e")
    writer.close()
    history = read_history(path)  # a malformed line in the middle would raise here
    assert [e.index for e in history.events] == [0, 2] and writer.lost_events == 1


def test_a_torn_last_history_line_is_tolerated_by_the_reader_and_cut_by_the_next_writer(tmp_path):
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path, "n1") as writer:
        writer.record("start", index=0)
    with path.open("ab") as handle:
        handle.write(b'{"t_wall": 1.0, "node": "n1", "ki')  # the process died mid-line
    assert read_history(path).torn_tail and [e.kind for e in read_history(path).events] == ["start"]
    with HistoryWriter(path, "n1") as writer:
        writer.record("stop", index=0)
    assert [e.kind for e in read_history(path).events] == ["start", "stop"] and not read_history(path).torn_tail


def test_a_learner_trains_on_while_its_history_cannot_be_written_and_its_lines_resume(tmp_path):
    """Issue 26's report: a full disk under history.jsonl killed the learner thread for good."""
    from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
    from diloco_node.learn.inner import InnerLearner
    from diloco_node.learn.learner_thread import LearnerThread
    from diloco_node.sync.fragments import plan_fragments

    manifest = RunManifest(  # the model of tests/test_learner_figures.py: one compilation for both
        model=ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1, d_model=32, d_ff=64),
        inner=InnerOptimizer(batch_size=2, lr_peak=1e-2, warmup_steps=5, total_steps=50),
        sync=SyncSpec(fragments=1, period=4, overlap=0))
    corpus = data_lib.Corpus(np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint8),
                             np.arange(512, dtype=np.uint8), 256, "random bytes")
    inner = InnerLearner(manifest.model, manifest.inner, manifest.seed)
    initial = inner.get_flat()
    writer = HistoryWriter(tmp_path / "history.jsonl", "a", step_batch_s=0.0)  # a step line per step
    history = DaemonHistory(writer)
    steps: list[int] = []
    enough = threading.Event()

    def progress(step: int, loss: float, tokens: int) -> None:
        history.learner_step(step, loss, tokens, None)
        steps.append(step)
        if step % 4 == 0:
            raise OSError(errno.ENOSPC, "No space left on device (a status file)")
        if len(steps) >= 12:
            enough.set()

    failpoints.arm("history.write=enospc*5")
    thread = LearnerThread(node_id="a", manifest=manifest, plan=plan_fragments({n: a.shape for n, a in initial.items()}, 1, 4, 0),
                           corpus=corpus, global_params=initial, global_rounds=[0], on_contribution=lambda due: None,
                           on_progress=progress, inner=inner)
    thread.compile()
    thread.start()
    thread.begin_training()
    try:
        assert enough.wait(120)
    finally:
        thread.stop()
        thread.join(60)
    writer.close()
    assert thread.error is None and steps[:12] == list(range(1, 13))  # every step taken, none stopped it
    written = [e.detail["learner_step"] for e in read_history(writer.path).events if e.kind == "step"]
    assert writer.lost_events == 5 and written[0] == 6  # the first 5 refused, then the lines resume
    assert not STORAGE.is_failing("history.write")


# ---------------------------------------------------------------------------------------------
# Fragment-version rings
# ---------------------------------------------------------------------------------------------


def _version(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((16, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}


def _same(got: Any, want: dict[str, np.ndarray]) -> bool:
    return got is not None and all(got[n].tobytes() == want[n].tobytes() for n in want)


@pytest.mark.parametrize(("action", "code"), ERRORS)
def test_a_refused_ring_slot_costs_its_round_never_a_wrong_version(tmp_path, action, code):
    ring = DiskFragmentHistory(tmp_path, 0, 4)
    for r in (1, 2):
        ring.record(r, _version(r))
    failpoints.arm(f"version_rings.write={action}*1")
    ring.record(3, _version(3))  # no exception reaches the apply
    assert _same(ring.version(3), _version(3))  # the newest, held in memory
    assert _same(ring.version(2), _version(2))  # the other slots are untouched
    assert str(code) in STORAGE.to_status()["failing"]["version_rings.write"]["error"]
    ring.record(4, _version(4))
    assert ring.rounds() == (1, 2, 4) and ring.version(3) is None  # never on disk: rejected by reason
    assert _same(ring.version(2), _version(2)) and not STORAGE.is_failing("version_rings.write")
    ring.record(5, _version(5))
    assert _same(ring.version(4), _version(4))
    ring.close()


def test_an_unreadable_ring_slot_is_not_served(tmp_path):
    ring = DiskFragmentHistory(tmp_path, 0, 4)
    for r in (1, 2, 3):
        ring.record(r, _version(r))
    failpoints.arm("version_rings.read=eio*1")
    assert ring.version(2) is None and ring.rounds() == (1, 3)  # that round dropped, never guessed
    assert STORAGE.is_failing("version_rings.read")
    ring.record(4, _version(4))
    assert _same(ring.version(3), _version(3)) and not STORAGE.is_failing("version_rings.read")
    ring.close()


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_ring_is_detected_quarantined_and_refilled(tmp_path, how):
    ring = DiskFragmentHistory(tmp_path, 0, 4)
    for r in (1, 2, 3):
        ring.record(r, _version(r))
    slot_bytes = (16 * 8 + 8) * 4
    _damage(ring.path, how, at=2 * slot_bytes + 5)  # inside round 2's slot (slot 2)
    assert _same(ring.version(1), _version(1))  # slot 1 lies before the damage: still good
    assert ring.version(2) is None  # detected by its CRC32 (or the short read), never served
    kept = tmp_path / "fragment-0.ring.corrupt-1"
    assert kept.exists() and STORAGE.to_status()["quarantined"][0]["kept_as"] == str(kept)
    assert ring.rounds() == (3,) and _same(ring.version(3), _version(3))
    for r in (4, 5):  # the fresh file fills again
        ring.record(r, _version(r))
    assert _same(ring.version(4), _version(4)) and ring.path.exists()
    ring.close()


# ---------------------------------------------------------------------------------------------
# Spooled relay payloads
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("action", "code"), ERRORS)
def test_a_refused_spool_write_refuses_the_stream_and_the_relay_fetches_the_bytes_later(tmp_path, action, code):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b"], hold_s=2.0, timeout_s=0.05)
        failpoints.arm(f"spool.write={action}*1")  # b's first chunk: the holder's push
        out = net.nodes["a"].relayed_append(holders_append(), plan_relay_tree("a", ["b"], 1), leader_commit=4)
        await settle_network()
        assert STORAGE.is_failing("spool.write") and str(code) in STORAGE.to_status()["failing"]["spool.write"]["error"]
        assert spool_files(net.nodes["b"]) == []  # the partial file deleted
        payloads = await completed_payloads(net.nodes["b"], out)  # fetched from the holder
        assert payloads == [b"", PAYLOAD]
        assert any(src == "b" and kind == "PayloadFetch" for src, _, kind in net.sent)
        assert not STORAGE.is_failing("spool.write")
        await tasks.close()

    asyncio.run(scenario())


def test_an_unreadable_spool_file_is_dropped_and_fetched_again(tmp_path):
    path = tmp_path / "p.part"
    path.write_bytes(PAYLOAD)
    digest = blake3.blake3(PAYLOAD).digest()
    held = HeldPayloads(lambda index, epoch: None)
    held.put(digest, SpooledPayload(path, len(PAYLOAD), digest))
    failpoints.arm("spool.read=eio*1")
    with pytest.raises(SpoolCorrupt, match="unreadable"):
        held.get(digest).read()  # type: ignore[union-attr]
    assert digest not in held and STORAGE.is_failing("spool.read")


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("reader", ["read", "pieces"])
def test_a_damaged_spool_file_is_detected_quarantined_and_never_served_whole(tmp_path, how, reader):
    path = tmp_path / "p.part"
    path.write_bytes(PAYLOAD)
    digest = blake3.blake3(PAYLOAD).digest()
    held = HeldPayloads(lambda index, epoch: None)
    spooled = SpooledPayload(path, len(PAYLOAD), digest)
    held.put(digest, spooled)
    _damage(path, how)
    taken = bytearray()
    with pytest.raises(SpoolCorrupt, match="another digest"):
        if reader == "read":
            taken += spooled.read()
        else:
            for piece in spooled.as_stored().pieces(4096):  # as the log store copies it into log.bin
                taken += piece
    assert len(taken) < len(PAYLOAD) * (1 if how == "bit-flip" else 0.5)  # never a whole copy
    assert (tmp_path / "p.part.corrupt-1").exists() and not path.exists()
    assert STORAGE.to_status()["quarantined"][0]["file"] == str(path)
    assert digest not in held  # the relay wants it again


def test_a_corrupt_spooled_payload_is_fetched_again_by_the_relay(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b"], hold_s=2.0, timeout_s=0.05)
        out = net.nodes["a"].relayed_append(holders_append(), plan_relay_tree("a", ["b"], 1), leader_commit=4)
        await settle_network()
        b = net.nodes["b"]
        digest = out.entries[1].payload_digest
        spooled = b.store.held(digest)
        assert isinstance(spooled, SpooledPayload)
        _damage(spooled.path, "bit-flip")
        with pytest.raises(SpoolCorrupt):
            spooled.read()
        assert not any(kind == "PayloadFetch" for _, _, kind in net.sent)
        assert await completed_payloads(b, out) == [b"", PAYLOAD]  # fetched from the holder, good bytes
        assert any(src == "b" and kind == "PayloadFetch" for src, _, kind in net.sent)
        await tasks.close()

    asyncio.run(scenario())


def test_a_spool_stream_that_the_disk_refuses_is_answered_507(tmp_path):
    async def scenario() -> None:
        net, tasks = cluster(tmp_path, ["a", "b"])
        digest = blake3.blake3(PAYLOAD).digest()
        head = wire.PayloadOpen(b"s" * 16, digest, len(PAYLOAD), 4096, "a", {})
        receiver = net.nodes["b"].open_stream(head, "a")
        failpoints.arm("spool.write=enospc")
        from wire.errors import RemoteProtocolError

        with pytest.raises(RemoteProtocolError, match="cannot spool") as refused:
            await receiver.part(wire.PayloadChunk(head.stream, 0, PAYLOAD[:4096]))
        assert refused.value.status_hint == 507
        await receiver.abort("the transport ends the stream")
        assert spool_files(net.nodes["b"]) == []
        await tasks.close()

    asyncio.run(scenario())


def test_a_fresh_copy_of_a_payload_whose_spool_file_was_bad_is_kept(tmp_path):
    digest = blake3.blake3(PAYLOAD).digest()
    held = HeldPayloads(lambda index, epoch: None)
    bad = SpooledPayload(tmp_path / "bad.part", len(PAYLOAD), digest)
    bad.path.write_bytes(PAYLOAD[:-1] + b"!")
    held.put(digest, bad)
    with pytest.raises(SpoolCorrupt):
        bad.read()
    fresh = SpooledPayload(tmp_path / "fresh.part", len(PAYLOAD), digest)
    fresh.path.write_bytes(PAYLOAD)
    held.put(digest, fresh)  # the fetched copy, put before anyone asked for the bad one again
    assert held.get(digest) is fresh and fresh.read() == PAYLOAD and fresh.path.exists()


# ---------------------------------------------------------------------------------------------
# Exports and the data cache (written, and never read back as good unless whole)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("action", "code"), ERRORS)
def test_a_refused_export_is_an_export_error_and_leaves_no_file(tmp_path, action, code):
    failpoints.arm(f"export.write={action}*1")
    out = tmp_path / "model.npz"
    with pytest.raises(export_lib.ExportError, match="cannot write") as refused:
        export_lib.write_export({"w": np.ones(4, np.float32)}, {"format": export_lib.EXPORT_FORMAT}, out, "npz")
    assert f"{os.strerror(code)} (failpoint export.write)" in str(refused.value)
    assert list(tmp_path.iterdir()) == []
    export_lib.write_export({"w": np.ones(4, np.float32)}, {"format": export_lib.EXPORT_FORMAT}, out, "npz")
    assert export_lib.load_export(out)[0]["w"].tolist() == [1.0] * 4


@pytest.mark.parametrize(("action", "code"), ERRORS)
def test_a_refused_data_cache_write_leaves_no_cache_file(tmp_path, action, code):
    failpoints.arm(f"data_cache.write={action}*1")
    with pytest.raises(OSError) as refused:
        data_lib._replace_atomically(tmp_path / "text-k.bin", lambda out: out.write(b"tokens"))
    assert refused.value.errno == code and list(tmp_path.iterdir()) == []
    data_lib._replace_atomically(tmp_path / "text-k.bin", lambda out: out.write(b"tokens"))
    assert (tmp_path / "text-k.bin").read_bytes() == b"tokens"
