"""A full or failing disk under the coordination state (coordination_store.py, coordination.py).

Every write point of the store x {ENOSPC, EIO}: nothing is acknowledged that is not on disk (the
reply is a 503, the file read back lacks the change), the failing point is named (STORAGE, the
readiness reason), and once writes succeed again the same request is answered and what was held
(applies) happens exactly once. The ticker survives a failing disk and retries with backoff; a
lease holder that cannot persist its log steps down. Read points fail the load with the file named.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.election import Role
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot
from diloco_node.clock import FakeClock
from diloco_node.daemon import peers
from diloco_node.daemon.coordination import STORAGE_RETRY_MAX_S, CoordinationIO
from diloco_node.daemon.coordination_store import CoordinationStore, CoordinationStoreError
from diloco_node.daemon.readiness import ReadinessFacts, readiness, storage_failures
from diloco_node.daemon.tasks import TaskSet
from diloco_node.ops.storage_health import STORAGE
from diloco_node.storage import failpoints
from wire.errors import RemoteProtocolError

from conftest import NoDisk

VOTERS = ["a", "b", "c"]
ERRORS = ["enospc", "eio"]


pytestmark = pytest.mark.usefixtures("clean_storage_state")


class SteppingClock(FakeClock):
    """A fake clock whose sleep also yields to the loop (so a ticker task can be driven)."""

    def __init__(self) -> None:
        super().__init__(1000.0)
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(seconds)
        await asyncio.sleep(0)


class QuietClient:
    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, url, message, *, peer=None, deadline_s=None):
        self.sent.append(message)
        return []


class Signed:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id


class Node:
    """One node's coordination I/O over a real store in `directory`."""

    def __init__(self, directory: Path, node_id: str = "b") -> None:
        self.directory = directory
        self.store = CoordinationStore(directory)
        if self.store.exists():
            self.persistent = self.store.load_persistent()
        else:
            self.persistent = PersistentState.founding(VOTERS)
            self.store.save_identity({"node_id": node_id, "manifest": {}})
            self.store.sync(self.persistent)
        self.clock = SteppingClock()
        self.core = CoordinatorNode(node_id, self.persistent, now=0.0, rng=random.Random(0))
        self.applied: list[int] = []
        self.errors: list[str] = []
        self.client = QuietClient()
        self.tasks = TaskSet()
        self.io = CoordinationIO(
            core=self.core, persistent=self.persistent, store=self.store, history=NoDisk(), client=self.client,
            addresses=peers.AddressBook({n: f"https://{n}:7070" for n in VOTERS}), clock=self.clock, tasks=self.tasks,
            on_apply=lambda entry: self.applied.append(entry.index), on_restore_snapshot=lambda s: None,
            after_step=lambda: None, remember_member=lambda *a: None, report_error=self.errors.append)

    def on_disk(self) -> PersistentState:
        return CoordinationStore(self.directory).load_persistent()

    def lead(self) -> None:
        """Win epoch 2 with b's votes (pre-vote, then vote)."""
        now = self.clock.monotonic()
        self.io.dispatch(self.core.tick(now))
        self.io.dispatch(self.io.handle(coord.VoteResponse(2, "b", True, "", pre_vote=True)))
        self.io.dispatch(self.io.handle(coord.VoteResponse(2, "b", True, "")))
        self.io.dispatch(self.io.handle(coord.AppendResponse(2, "b", True, self.core.log.last_index, now, "")))
        assert self.core.is_lease_holder(now)


def _append(entries: list[LogEntry], *, epoch: int = 2, prev: tuple[int, int] = (1, 1), commit: int = 0):
    message = coord.AppendEntries(epoch, "a", prev[0], prev[1], tuple(entries), commit, sent_at=5.0)
    return peers.to_wire(message, epoch=epoch, commit_index=commit, last_index=prev[0] + len(entries))


def _commits(epoch: int, indices: range) -> list[LogEntry]:
    return [LogEntry(epoch, i, EntryKind.OUTER_COMMIT, bytes([i]) * 64, fragment=0, round=i) for i in indices]


@pytest.mark.parametrize("action", ERRORS)
async def test_a_failed_append_acknowledges_nothing_and_the_retry_is_answered(tmp_path, action):
    node = Node(tmp_path)
    failpoints.arm(f"log.append={action}")
    message = _append(_commits(2, range(2, 5)), commit=3)
    with pytest.raises(RemoteProtocolError) as refused:
        await node.io.on_log_append(message, Signed("a"))
    assert refused.value.status_hint == 503 and "cannot persist" in str(refused.value)
    assert [e.index for e in node.on_disk().log.entries] == [1]  # nothing of it is durable
    assert node.applied == [] and node.io.storage_error is not None  # committed ones held, not applied
    assert "log.append" in STORAGE.to_status()["failing"]
    verdict = readiness(ReadinessFacts(download=None, learner_compiling=False, has_voters=True, applied_index=1,
                                       consistent_from=0, log_applied_index=1, commit_target=1, replacing_state=False,
                                       was_ready=True, role="follower", epoch=2,
                                       storage_failing=storage_failures(STORAGE.to_status())))
    assert not verdict.ready and verdict.reason.startswith("storage failing: log.append")
    # Another failure in the same streak says nothing new (one report per streak).
    with pytest.raises(RemoteProtocolError):
        await node.io.on_log_append(message, Signed("a"))
    assert len(node.errors) == 1 and STORAGE.to_status()["failing"]["log.append"]["consecutive"] == 2

    failpoints.disarm()
    reply = await node.io.on_log_append(message, Signed("a"))
    assert reply.success and reply.index == 4
    assert [e.index for e in node.on_disk().log.entries] == [1, 2, 3, 4]
    assert node.applied == [1, 2, 3] and node.io.storage_error is None and STORAGE.to_status()["failing"] == {}


async def test_a_partly_written_append_is_cut_back_before_the_next(tmp_path, monkeypatch):
    """A disk that fills mid-record: the torn bytes must not stay between good records."""
    node = Node(tmp_path)
    import diloco_node.daemon.coordination_store as store_module

    real = store_module._write_records

    def half_then_full(handle, start, entries):
        handle.write(b"\x40\x00\x00\x00torn")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "_write_records", half_then_full)
    with pytest.raises(RemoteProtocolError):
        await node.io.on_log_append(_append(_commits(2, range(2, 4))), Signed("a"))
    monkeypatch.setattr(store_module, "_write_records", real)
    reply = await node.io.on_log_append(_append(_commits(2, range(2, 4))), Signed("a"))
    assert reply.success and [e.index for e in node.on_disk().log.entries] == [1, 2, 3]


@pytest.mark.parametrize("action", ERRORS)
async def test_a_vote_that_cannot_be_persisted_is_not_granted(tmp_path, action):
    node = Node(tmp_path)
    failpoints.arm(f"election.write={action}")
    request = peers.to_wire(coord.VoteRequest(2, "c", 1, 1), epoch=0, commit_index=0, last_index=0)
    with pytest.raises(RemoteProtocolError) as refused:
        await node.io.on_vote_request(request, Signed("c"))
    assert refused.value.status_hint == 503
    on_disk = node.on_disk().election
    assert (on_disk.current_epoch, on_disk.voted_for) == (1, None)
    assert "election.write" in STORAGE.to_status()["failing"]
    failpoints.disarm()
    reply = await node.io.on_vote_request(request, Signed("c"))
    assert reply.granted
    assert (node.on_disk().election.current_epoch, node.on_disk().election.voted_for) == (2, "c")


@pytest.mark.parametrize("action", ERRORS)
async def test_a_truncation_that_fails_leaves_the_old_log_whole(tmp_path, action):
    node = Node(tmp_path)
    assert (await node.io.on_log_append(_append(_commits(2, range(2, 5))), Signed("a"))).success
    failpoints.arm(f"log.truncate={action}")
    # A leader of epoch 3 replaces the uncommitted entries 3 and 4.
    conflicting = _append([LogEntry(3, 3, EntryKind.NOOP)], epoch=3, prev=(2, 2))
    with pytest.raises(RemoteProtocolError):
        await node.io.on_log_append(conflicting, Signed("a"))
    assert [(e.index, e.epoch) for e in node.on_disk().log.entries] == [(1, 1), (2, 2), (3, 2), (4, 2)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp file left
    failpoints.disarm()
    assert (await node.io.on_log_append(conflicting, Signed("a"))).success
    assert [(e.index, e.epoch) for e in node.on_disk().log.entries] == [(1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("action", ERRORS)
def test_a_compaction_that_fails_leaves_the_log_and_is_retried(tmp_path, action):
    store = CoordinationStore(tmp_path)
    state = PersistentState.founding(VOTERS)
    state.log.entries.extend(_commits(1, range(2, 11)))
    store.sync(state)
    failpoints.arm(f"log.compact={action}")
    snapshot = Snapshot(6, 1, ClusterConfig.of(VOTERS))
    committed = state.log.entries[6:]
    with pytest.raises(OSError):
        store.prepare_compaction(snapshot, committed)
    assert "log.compact" in STORAGE.to_status()["failing"]
    assert [e.index for e in CoordinationStore(tmp_path).load_persistent().log.entries] == list(range(1, 11))
    failpoints.disarm()
    store.prepare_compaction(snapshot, committed)
    assert "log.compact" not in STORAGE.to_status()["failing"]


@pytest.mark.parametrize("point", ["identity.write", "manifest.write"])
@pytest.mark.parametrize("action", ERRORS)
def test_an_identity_write_that_fails_leaves_the_old_file(tmp_path, point, action):
    store = CoordinationStore(tmp_path)
    store.save_identity({"node_id": "b", "manifest": {"run": 1}, "addresses": {}})
    before = (tmp_path / "identity.json").read_bytes()
    failpoints.arm(f"{point}={action}")
    changed = {"node_id": "b", "manifest": {"run": 2} if point == "manifest.write" else {"run": 1},
               "addresses": {"c": "https://c:7070"}}
    with pytest.raises(OSError):
        store.save_identity(changed)
    assert (tmp_path / "identity.json").read_bytes() == before and point in STORAGE.to_status()["failing"]
    failpoints.disarm()
    store.save_identity(changed)
    assert CoordinationStore(tmp_path).load_identity() == changed


@pytest.mark.parametrize("point", ["election.read", "log.read", "identity.read", "manifest.read"])
@pytest.mark.parametrize("action", ERRORS)
def test_a_read_that_fails_refuses_the_load_naming_the_file(tmp_path, point, action):
    Node(tmp_path)  # writes identity, election record and log
    failpoints.arm(f"{point}={action}")
    store = CoordinationStore(tmp_path)
    with pytest.raises(CoordinationStoreError, match="unreadable"):
        store.load_identity() if point in ("identity.read", "manifest.read") else store.load_persistent()
    assert point in STORAGE.to_status()["failing"]
    failpoints.disarm()
    store.load_identity()
    assert [e.index for e in store.load_persistent().log.entries] == [1]


@pytest.mark.parametrize("action", ERRORS)
def test_a_payload_read_that_fails_is_a_missing_payload_not_a_crash(tmp_path, action):
    from bootstrap.entries import PayloadUnavailable

    store = CoordinationStore(tmp_path)
    state = PersistentState.founding(VOTERS)
    state.log.entries.append(LogEntry(1, 2, EntryKind.OUTER_COMMIT, b"x" * 10_000, fragment=0, round=1))
    store.sync(state)
    failpoints.arm(f"log.read={action}")
    with pytest.raises(PayloadUnavailable):
        state.log.entries[1].payload_bytes()
    failpoints.disarm()
    assert state.log.entries[1].payload_bytes() == b"x" * 10_000


async def test_the_ticker_survives_a_full_disk_backs_off_and_recovers(tmp_path):
    """Before: an ENOSPC in the ticker's sync ended the task, and the node never recovered."""
    node = Node(tmp_path, "a")
    node.lead()
    failpoints.arm("log.append=enospc")
    now = node.clock.monotonic()
    entry, _, actions = node.core.propose(now, EntryKind.OUTER_COMMIT, b"m" * 100, fragment=0, round=1)
    assert entry is not None
    assert node.io.dispatch(actions) is None
    assert node.core.role is Role.FOLLOWER  # the holder steps down: it cannot persist its log
    assert "cannot persist the log" in node.core.election.last_step_down_reason
    ticker = asyncio.ensure_future(node.io.ticker())
    try:
        for _ in range(12):
            await asyncio.sleep(0)
        assert not ticker.done()
        retries = [s for s in node.clock.slept]
        assert retries[:4] == [node.io.tick_s * 2 ** k for k in range(4)] and max(retries) <= STORAGE_RETRY_MAX_S
        assert entry.index not in [e.index for e in node.on_disk().log.entries]
        failpoints.disarm()
        for _ in range(4):
            await asyncio.sleep(0)
        assert not ticker.done() and node.io.storage_error is None
        assert entry.index in [e.index for e in node.on_disk().log.entries]
        assert node.clock.slept[-1] == node.io.tick_s  # back to the plain tick
    finally:
        ticker.cancel()
        await node.tasks.close()


def test_status_shows_failing_points_and_quarantined_files(tmp_path):
    from diloco_node.ops.status import StatusBuilder, StatusDocument, render_metrics

    STORAGE.failed("log.append", OSError(28, "No space left on device"))
    damaged = tmp_path / "election.json"
    damaged.write_bytes(b"{")
    STORAGE.quarantine(damaged, "election record damaged: not JSON")
    builder = StatusBuilder("b", "run-1", "learner", 0.0)
    builder.set_storage({**STORAGE.to_status(), "vote_barrier": None})
    doc = builder.document(1.0)
    back = StatusDocument.from_json(doc.to_json())
    assert "No space left on device" in back.storage["failing"]["log.append"]["error"]
    assert back.storage["quarantined"][0]["kept_as"].endswith("election.json.corrupt-1")
    text = render_metrics(doc)
    assert 'diloco_storage_failing{point="log.append"} 1.0' in text and "diloco_storage_quarantined_files 1.0" in text
    raw = doc.to_dict()
    del raw["storage"]  # a node from before the storage section
    assert StatusDocument.from_dict(raw).storage == {}


async def test_an_unreadable_payload_costs_one_warning_per_streak_not_a_traceback_per_send(tmp_path, caplog):
    node = Node(tmp_path, "a")
    node.lead()
    entry, _, actions = node.core.propose(node.clock.monotonic(), EntryKind.OUTER_COMMIT, b"p" * 10_000,
                                          fragment=0, round=1)
    node.io.dispatch(actions)  # on disk: the entry keeps a reference to its record in log.bin
    failpoints.arm("log.read=eio")
    message = coord.AppendEntries(2, "a", entry.index - 1, 2, (node.core.log.entry_at(entry.index),), 0, sent_at=1.0)
    try:
        for _ in range(3):
            node.io.send("b", message)
            for _ in range(3):
                await asyncio.sleep(0)
        warnings = [r for r in caplog.records if "cannot send AppendEntries to b" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].exc_info is None
        assert "log.read" in STORAGE.to_status()["failing"]
    finally:
        await node.tasks.close()


async def test_a_holder_whose_log_record_is_damaged_at_run_time_steps_down(tmp_path):
    node = Node(tmp_path, "a")
    node.lead()
    entry, _, actions = node.core.propose(node.clock.monotonic(), EntryKind.OUTER_COMMIT, b"q" * 10_000,
                                          fragment=0, round=1)
    node.io.dispatch(actions)
    log_bin = tmp_path / "log.bin"
    data = bytearray(log_bin.read_bytes())
    data[data.index(b"q" * 10_000) + 50] ^= 0x01  # a bit flips at rest under the running node
    log_bin.write_bytes(bytes(data))
    message = coord.AppendEntries(2, "a", entry.index - 1, 2, (node.core.log.entry_at(entry.index),), 0, sent_at=1.0)
    try:
        node.io.send("b", message)
        for _ in range(3):
            await asyncio.sleep(0)
        assert node.core.role is Role.FOLLOWER and "its log is damaged" in node.core.election.last_step_down_reason
        assert "fails its checksum" in STORAGE.to_status()["failing"]["log.read"]["error"]
    finally:
        await node.tasks.close()


async def test_an_entry_committed_while_a_write_fails_is_applied_exactly_once_whatever_the_error(tmp_path):
    """Applies the core handed over while the store could not sync are held, also when the store
    fails in a way it does not expect (a bug), and performed once after the next good sync."""
    node = Node(tmp_path)
    real_sync = node.store.sync

    def broken(state, prepared=None):
        raise RuntimeError("unexpected failure inside the store")

    node.store.sync = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await node.io.on_log_append(_append(_commits(2, range(2, 5)), commit=3), Signed("a"))
    assert node.applied == []  # held: the core already counts 2 and 3 as applied
    node.store.sync = real_sync  # type: ignore[method-assign]
    reply = await node.io.on_log_append(_append(_commits(2, range(2, 5)), commit=4), Signed("a"))
    assert reply.success
    assert node.applied == [1, 2, 3, 4]  # each once, in order: nothing lost, nothing twice
