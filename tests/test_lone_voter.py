"""The lone voter (issue 37 item 4): a node whose log lost entries, with no other voters to elect a
lease holder who could give them back, says so on /status and in its log, and only an operator's
explicit, recorded acceptance of the loss lets it vote again (daemon/lost_entries.py)."""

from __future__ import annotations

import logging
import random

import pytest

from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.election import ElectionState
from diloco_node.clock import FakeClock
from diloco_node.daemon import peers
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.coordination_store import MARK_FILE, CoordinationStore
from diloco_node.daemon.lost_entries import LOSS_FILE, accept_loss, barrier_help, is_lone_voter, read_acceptances
from diloco_node.daemon.tasks import TaskSet
from diloco_node.storage.records import unframe

from conftest import NoDisk
from test_coordination_corruption import QuietClient
from test_log_cut_at_rest import _cut_at_boundary, _entry


pytestmark = pytest.mark.usefixtures("clean_storage_state")


def _cut_lone_voter(tmp_path, voters: list[str]) -> tuple[CoordinationIO, CoordinationStore]:
    """`a`'s log held 1..8 (mark at 8) and was cut at rest before 6: it lost 6..8."""
    store = CoordinationStore(tmp_path)
    store.mark.interval_s = 0.0
    state = PersistentState.founding(voters)
    state.election = ElectionState(2, "a")
    state.log.entries.extend(_entry(i) for i in range(2, 9))
    store.sync(state)
    _cut_at_boundary(tmp_path / "log.bin", 6)
    store = CoordinationStore(tmp_path)
    persistent = store.load_persistent()
    core = CoordinatorNode("a", persistent, now=0.0, rng=random.Random(0), applied_index=5)
    io = CoordinationIO(core=core, persistent=persistent, store=store, history=NoDisk(), client=QuietClient(),
                        addresses=peers.AddressBook({n: f"https://{n}:7070" for n in voters}),
                        clock=FakeClock(1000.0), tasks=TaskSet(), on_apply=lambda e: None,
                        on_restore_snapshot=lambda s: None, after_step=lambda: None,
                        remember_member=lambda *a: None, report_error=lambda m: None)
    return io, store


def test_who_is_a_lone_voter() -> None:
    assert is_lone_voter("a", ["a"]) and is_lone_voter("a", ["a", "b"])  # b alone is no majority of two
    assert not is_lone_voter("a", ["a", "b", "c"]) and not is_lone_voter("w", ["a", "b"])


def test_the_lone_voter_says_what_happened_and_what_to_do(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="diloco_node.daemon"):
        io, store = _cut_lone_voter(tmp_path, ["a"])
    assert io.vote_barrier is not None and store.damaged_after == 5
    advice = barrier_help("a", io.core.log.config.voters, store.damaged_after, io.vote_barrier)
    assert advice is not None and advice["lone_voter"] and advice["lost_after"] == 5
    assert "accept-loss --lost-after 5" in advice["what_to_do"] and "restore log.bin" in advice["what_to_do"]
    assert any("accept-loss --lost-after 5" in r.getMessage() for r in caplog.records)  # in the log too
    # One of three voters: the others elect a holder who gives the entries back; nothing to accept.
    other = barrier_help("a", ["a", "b", "c"], 5, io.vote_barrier)
    assert other is not None and not other["lone_voter"] and "wait" in other["what_to_do"]


def test_an_accepted_loss_is_recorded_before_the_node_votes_again(tmp_path) -> None:
    io, store = _cut_lone_voter(tmp_path, ["a"])
    # Refused, nothing changed: no name, no reason, another index than the one the node lost after.
    assert accept_loss(io, by="", reason="x", lost_after=5)[0] == 400
    assert accept_loss(io, by="ops", reason="", lost_after=5)[0] == 400
    status, answer = accept_loss(io, by="ops", reason="x", lost_after=4)
    assert status == 409 and answer["lost_after"] == 5 and "--lost-after 5" in answer["error"]
    assert io.vote_barrier is not None and not (tmp_path / LOSS_FILE).exists()

    status, answer = accept_loss(io, by="Ada (on call)", reason="no copy of log.bin", lost_after=5)
    assert status == 200 and io.vote_barrier is None and store.damaged_after is None
    (record,) = read_acceptances(tmp_path)
    assert record == answer["record"]
    assert record["by"] == "Ada (on call)" and record["lost_after"] == 5 and record["fsynced_through"] == 8
    assert record["reason"] == "no copy of log.bin" and "cut at rest" in record["damage"]
    # The witness comes down to what log.bin holds: a restart does not find the same loss again.
    assert unframe((tmp_path / MARK_FILE).read_bytes(), "fsynced_through") == {"fsynced_through": 5}
    restarted = CoordinationStore(tmp_path)
    assert restarted.load_persistent().log.entries[-1].index == 5 and restarted.damaged_after is None
    # Nothing more to accept, and the record is kept as it was.
    assert accept_loss(io, by="ops", reason="again", lost_after=5)[0] == 409
    assert read_acceptances(tmp_path) == [record]


def test_a_disk_that_refuses_the_record_keeps_the_barrier(tmp_path) -> None:
    io, store = _cut_lone_voter(tmp_path, ["a"])
    (tmp_path / LOSS_FILE).mkdir()  # the record cannot be written
    status, answer = accept_loss(io, by="ops", reason="x", lost_after=5)
    assert status == 503 and "the barrier stays" in answer["error"]
    assert io.vote_barrier is not None and store.damaged_after == 5


async def test_the_accept_loss_command_goes_through_the_operator_route_and_records_it(tmp_path) -> None:
    import asyncio
    import io as text_io

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from diloco_node.cli.accept_loss import accept_loss_command
    from diloco_node.ops.status import StatusDocument, operator_routes

    io, store = _cut_lone_voter(tmp_path, ["a"])

    async def route(body):
        return accept_loss(io, by=body.get("by", ""), reason=body.get("reason", ""), lost_after=body.get("lost_after"))

    app = web.Application()
    snapshot = lambda: StatusDocument("a", "r", "learner", True, 1, "a", 1, "")  # noqa: E731
    app.add_routes(operator_routes(snapshot, accept_loss=route))
    async with TestServer(app, host="127.0.0.1") as server:
        peer = f"127.0.0.1:{server.port}"
        runs = []
        for lost_after in (7, 5):
            out, err = text_io.StringIO(), text_io.StringIO()
            code = await asyncio.to_thread(accept_loss_command, peer, lost_after, "Ada", "no copy", 5.0, out, err)
            runs.append((code, out.getvalue(), err.getvalue()))
    assert runs[0][0] == 1 and "lost the entries after 5, not after 7" in runs[0][2]
    assert runs[1][0] == 0 and "votes again" in runs[1][1] and "accepted by Ada" in runs[1][1]
    assert [r["by"] for r in read_acceptances(tmp_path)] == ["Ada"] and io.vote_barrier is None
