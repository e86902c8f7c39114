"""A process crash just before or just after the fsync of each of the node's other files (issue 26),
with what was not fsynced really dropped (`storage/durable.py`), then a restart in this process: each
file comes back as the newest GOOD version, never a partial one.

Points: checkpoint.write, history.write, version_rings.write, spool.write, export.write,
data_cache.write. The log, election, identity and manifest are tested with coordination_store.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from diloco_node.daemon.history_ring import DiskVersionRings
from diloco_node.daemon.relay_spool import SpoolDirectory
from diloco_node.learn import data as data_lib
from diloco_node.ops import export as export_lib
from diloco_node.ops.checkpoint import CheckpointStore
from diloco_node.ops.history import HistoryWriter, read_history
from diloco_node.storage import failpoints

PRELUDE = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    from diloco_node.storage import failpoints
    failpoints.load_from_env()
    root = Path(sys.argv[1])
""")

# Each writer does its point's durable step twice; `@2` crashes the second one.
WRITERS = {
    "checkpoint.write": """
        from diloco_node.ops.checkpoint import CheckpointStore
        store = CheckpointStore(root)
        for step in (1, 2):
            store.save({"applied_index": step}, {"global/w": np.full(64, step, np.float32)})
    """,
    "history.write": """
        from diloco_node.ops.history import HistoryWriter
        writer = HistoryWriter(root / "history.jsonl", "n1")  # fsyncs after each commit
        writer.record("start", index=0)
        for index in (1, 2):
            writer.record("commit", epoch=1, index=index, entry_digest="e")
    """,
    "version_rings.write": """
        from diloco_node.daemon.history_ring import DiskVersionRings
        ring = DiskVersionRings(root)(0, 4)
        for r in (1, 2):
            ring.record(r, {"a": np.full(32, r, np.float32)})
    """,
    "spool.write": """
        import asyncio, hashlib
        from diloco_node.daemon.relay_spool import PayloadReceiver, SpoolDirectory
        from wire import messages as wire
        from wire.payload_stream import PayloadAssembler
        spool = SpoolDirectory(root)
        async def receive(payload):
            digest = hashlib.sha256(payload).digest()
            head = wire.PayloadOpen(b"s" * 16, digest, len(payload), 4096, "a", {})
            receiver = PayloadReceiver(PayloadAssembler(head, 1 << 20), "a", spool.new_file(digest),
                                       progress=lambda n: None, accept=lambda p: None, ended=lambda r: None)
            for offset in range(0, len(payload), 4096):
                await receiver.part(wire.PayloadChunk(head.stream, offset, payload[offset:offset + 4096]))
            await receiver.finish()
        for n in (1, 2):
            asyncio.run(receive(bytes([n]) * 10000))
    """,
    "export.write": """
        from diloco_node.ops import export
        for name in ("first.npz", "second.npz"):
            export.write_export({"w": np.ones(8, np.float32)}, {"format": export.EXPORT_FORMAT}, root / name, "npz")
    """,
    "data_cache.write": """
        from diloco_node.learn import data
        for name in ("first.bin", "second.bin"):
            data._replace_atomically(root / name, lambda out: out.write(b"tokens" * 100))
    """,
}


def _crash(point: str, action: str, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(WRITERS[point]), str(root)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, failpoints.ENV_VAR: f"{point}={action}@2"})
    assert done.returncode == failpoints.CRASH_EXIT_CODE, done.stderr
    assert f"failpoint {point}: crashing" in done.stderr


def _restart_and_check(point: str, root: Path) -> None:
    """What the node (or the operator's command) finds when it starts again."""
    if point == "checkpoint.write":
        with CheckpointStore(root) as store:  # the crashed write's temporary file is removed
            assert [p.name for p in store.removed_partials] == [".ckpt-000000000002.bin.tmp"]
            loaded = store.load_latest()
            assert loaded.checkpoint.meta == {"applied_index": 1} and loaded.skipped == ()
            assert store.save({"applied_index": 2}, {}).name == "ckpt-000000000002.bin"
    elif point == "history.write":
        # The history is not cut back by the crash (a process crash keeps written lines; only the
        # files the node relies on model the power cut): whole lines, the writer goes on after them.
        assert [(e.kind, e.index) for e in read_history(root / "history.jsonl").events] == \
            [("start", 0), ("commit", 1), ("commit", 2)]
        with HistoryWriter(root / "history.jsonl", "n1") as writer:
            writer.record("start", index=2)
        assert len(read_history(root / "history.jsonl").events) == 4
    elif point == "version_rings.write":
        ring = DiskVersionRings(root)(0, 4)  # started afresh: nothing of the crashed run is read
        assert ring.path.stat().st_size == 0 and ring.rounds() == ()
        ring.record(3, {"a": np.full(32, 3, np.float32)})
        assert ring.version(1) is None and ring.version(2) is None and ring.version(3)["a"][0] == 3
    elif point == "spool.write":
        assert len(list(root.iterdir())) == 2  # both files were on disk when it crashed
        SpoolDirectory(root)  # a start deletes every leftover: nothing unverified is ever served
        assert list(root.iterdir()) == []
    elif point == "export.write":
        assert export_lib.load_export(root / "first.npz")[0]["w"].tolist() == [1.0] * 8
        assert not (root / "second.npz").exists()  # the name appears only with the rename
        export_lib.write_export({"w": np.ones(8, np.float32)}, {"format": export_lib.EXPORT_FORMAT},
                                root / "second.npz", "npz")
        assert export_lib.load_export(root / "second.npz")[0]["w"].tolist() == [1.0] * 8
    elif point == "data_cache.write":
        assert (root / "first.bin").read_bytes() == b"tokens" * 100 and not (root / "second.bin").exists()
        leftovers = [p.name for p in root.iterdir() if p.name != "first.bin"]
        assert len(leftovers) == 1 and leftovers[0].startswith(".second.bin.")  # hidden, never read as a cache
        data_lib._replace_atomically(root / "second.bin", lambda out: out.write(b"again"))
        assert (root / "second.bin").read_bytes() == b"again"
    else:
        raise AssertionError(point)


@pytest.mark.parametrize("action", ["crash-before", "crash-after"])
@pytest.mark.parametrize("point", sorted(WRITERS))
def test_a_crash_at_the_fsync_leaves_the_newest_good_version(tmp_path, point, action):
    root = tmp_path / "data"
    _crash(point, action, root)
    if point == "checkpoint.write" and action == "crash-before":
        # Before its fsync the temporary file's bytes were dropped, as a power cut drops them.
        assert (root / ".ckpt-000000000002.bin.tmp").stat().st_size == 0
    _restart_and_check(point, root)


def test_a_crashed_spool_write_of_a_payload_holds_the_whole_file_only_after_the_crash_point(tmp_path):
    """The spool's crash point fires once a payload's file is complete and verified (there is no
    fsync: a start deletes every spool file anyway)."""
    root = tmp_path / "spool"
    _crash("spool.write", "crash-after", root)
    sizes = sorted(p.stat().st_size for p in root.iterdir())
    assert sizes == [10000, 10000]
    digests = {hashlib.sha256(p.read_bytes()).digest() for p in root.iterdir()}
    assert digests == {hashlib.sha256(bytes([n]) * 10000).digest() for n in (1, 2)}
