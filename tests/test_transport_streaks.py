"""One log line when a peer starts failing and one with the count when the streak ends, not a
line per failed request (the transport's `streaks.py`; the counts per request stay on /status)."""

from __future__ import annotations

import logging
import socket

import pytest

from diloco_node.transport import PeerUnreachable
from diloco_node.transport.streaks import FailureStreaks
from wire.messages import MessageKind

from conftest import vote_request
from test_transport import _client, _server, _serving, _Voter


def test_a_streak_logs_its_first_failure_and_its_end_with_the_count(caplog) -> None:
    now = [100.0]
    streaks = FailureStreaks(logging.getLogger("streaks-test"), "send to", "answered again", clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="streaks-test"):
        streaks.succeeded("b")  # no streak: nothing to say
        for reason in ("failed: connect timeout", "failed: read timeout", "failed: read timeout"):
            streaks.failed("b", reason)
            now[0] += 1.5
        assert streaks.failing("b") == 3
        streaks.failed("c", "failed: ClientConnectorError")
        streaks.succeeded("b")
        streaks.succeeded("b")  # the streak is over: nothing more
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["send to b: failed: connect timeout (failing; counted until answered again)",
                     "send to c: failed: ClientConnectorError (failing; counted until answered again)",
                     "send to b: answered again after 3 failure(s) over 4.5 s (last: failed: read timeout)"]
    assert streaks.failing("b") == 0 and streaks.failing("c") == 1


def test_past_its_bound_an_untracked_peer_is_logged_per_failure(caplog) -> None:
    streaks = FailureStreaks(logging.getLogger("streaks-test"), "refused", "accepted again", max_streaks=1)
    with caplog.at_level(logging.INFO, logger="streaks-test"):
        streaks.failed("a", "x")
        streaks.failed("b", "y")
        streaks.failed("b", "y")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a: x (failing; counted until accepted again)", "refused b: y", "refused b: y"]
    assert streaks.failing("b") == 0


async def test_a_client_logs_one_line_for_many_failed_sends_and_one_when_the_peer_answers(caplog) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    async with _client() as client:
        with caplog.at_level(logging.INFO, logger="diloco_node.transport"):
            for _ in range(5):
                with pytest.raises(PeerUnreachable):
                    await client.send(f"http://127.0.0.1:{closed_port}", vote_request(), deadline_s=5.0)
        lines = [r.getMessage() for r in caplog.records if "send to" in r.getMessage()]
        assert len(lines) == 1 and "(failing;" in lines[0], lines
        assert sum(p["refusals"] for p in client.counters.snapshot().values()) == 5  # each one counted


async def test_a_client_streak_ends_in_one_line_when_the_peer_answers(caplog) -> None:
    server = _server()
    server.on_message(MessageKind.VOTE_REQUEST, _Voter())
    async with _serving(server) as url, _client() as client:
        client._failures.failed("b", "failed: read timeout")  # as if it had been down
        with caplog.at_level(logging.INFO, logger="diloco_node.transport"):
            await client.send(url, vote_request(), peer="b", deadline_s=5.0)
    (line,) = [r.getMessage() for r in caplog.records if "send to" in r.getMessage()]
    assert "answered again after 1 failure(s)" in line
