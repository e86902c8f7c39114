"""The daemon's per-peer outbox (daemon/coordination.py): what a queued append carries when it leaves.

An append to a peer waits while the previous one to that peer is in flight. If the previous one's
acknowledgement covered its entries, they must not travel again: their payloads are commits, MBs
each, and at a slow follower several heartbeats queue up behind one large append.
"""

from __future__ import annotations

import random

from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.entries import EntryKind
from diloco_node.clock import FakeClock
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.peers import AddressBook
from diloco_node.daemon.tasks import TaskSet
from wire import messages as wire

from conftest import NoDisk


class _RecordingClient:
    """Keeps what would have gone out; answers nothing (as a peer that went quiet would)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, wire.Message]] = []

    async def send(self, url, message, *, peer, deadline_s):
        self.sent.append((peer, message))
        return []


async def test_a_queued_append_does_not_carry_entries_acknowledged_since_it_was_built(tmp_path) -> None:
    clock = FakeClock(10.0)
    core = CoordinatorNode("a", PersistentState.founding(["a"]), now=0.0, rng=random.Random(0))
    core.tick(10.0)  # a configuration of one elects itself
    assert core.election.may_act_as_leader(10.0)
    client = _RecordingClient()
    tasks = TaskSet()
    io = CoordinationIO(core=core, persistent=core.persistent, store=NoDisk(), history=NoDisk(), client=client,
                        addresses=AddressBook({"b": "https://b.example:7070"}), clock=clock, tasks=tasks,
                        on_apply=lambda entry: None, on_restore_snapshot=lambda s: None, after_step=lambda: None,
                        remember_member=lambda *a: None, report_error=lambda m: None, relay_spool_dir=tmp_path)
    try:
        core.log.track_peer("b")
        first = core.log.last_index + 1
        for round_ in (1, 2, 3):
            core.log.append_local(core.epoch, EntryKind.OUTER_COMMIT, bytes([round_]) * 4096, fragment=0, round=round_)
        queued = core.log.replication_message("b", core.epoch, "a", 10.0)
        assert [e.index for e in queued.entries] == [first, first + 1, first + 2]
        # The previous append's acknowledgement arrives while `queued` waits: b holds all but the last.
        core.log.handle_append_response("b", True, first + 1)

        await io._deliver("b", queued)

        [(peer, out)] = client.sent
        assert peer == "b" and isinstance(out, wire.LogAppend)
        assert [e.index for e in out.entries] == [first + 2]
        assert out.entries[0].payload == bytes([3]) * 4096
        assert (out.prev_index, out.prev_epoch) == (first + 1, core.epoch)

        # Acknowledged through the end: what leaves is a heartbeat, no payload bytes at all.
        core.log.handle_append_response("b", True, first + 2)
        await io._deliver("b", queued)
        assert client.sent[-1][1].entries == ()
    finally:
        await tasks.close()
