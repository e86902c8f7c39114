"""A learner that stops stepping (hung, not crashed) fails /livez and stops the watchdog pings,
once it has a pace to keep: not while compiling, not before the first steps, not while stopping."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from diloco_node.ops.liveness import (
    ALIVE,
    MIN_STALL_S,
    STALL_FACTOR,
    WARMUP_STEPS,
    StepPace,
    liveness,
    stall_after_s,
)
from diloco_node.ops.status import operator_routes
from diloco_node.ops.systemd import SystemdNotifier, run_watchdog

STEP_S = 10.0  # a slow step, so the factor (not the one-minute floor) sets the stall limit


def _paced(steps: int, every_s: float = STEP_S) -> StepPace:
    pace = StepPace()
    for i in range(steps):
        pace.step(100.0 + i * every_s)
    return pace


def _verdict(pace: StepPace, now: float, **kwargs: object):
    return liveness(now=now, learner_error=None, training=True, pace=pace, **kwargs)


def test_the_expected_step_time_is_the_average_interval():
    pace = _paced(5)
    assert pace.snapshot() == (5, 140.0, STEP_S)
    assert stall_after_s(STEP_S) == STALL_FACTOR * STEP_S
    assert stall_after_s(0.001) == MIN_STALL_S  # millisecond CPU steps: the floor applies


def test_a_stalled_learner_is_not_alive_and_says_why():
    pace = _paced(5)
    last = 140.0
    assert _verdict(pace, last + STALL_FACTOR * STEP_S - 1) == ALIVE
    verdict = _verdict(pace, last + STALL_FACTOR * STEP_S + 1)
    assert not verdict.alive
    assert verdict.reason == "learner stalled: no step for 201.0 s (expected every 10 s; stalled after 200.0 s)"
    pace.step(last + 300.0)  # it came back: alive again (a restart was not needed)
    assert _verdict(pace, last + 301.0) == ALIVE


@pytest.mark.parametrize("steps, training, why", [
    (0, True, "compiling, or no step yet"),
    (WARMUP_STEPS - 1, True, "too few steps for an expectation"),
    (10, False, "stopping at the end of the run or on SIGTERM"),
])
def test_no_stall_is_declared_without_a_pace_to_keep(steps, training, why):
    pace = _paced(steps)
    assert liveness(now=1e9, learner_error=None, training=training, pace=pace) == ALIVE, why


def test_a_crashed_learner_is_not_alive_whatever_its_pace():
    verdict = liveness(now=0.0, learner_error=RuntimeError("device lost"), training=True, pace=None)
    assert verdict.reason == "learner thread failed: RuntimeError: device lost"


async def test_livez_answers_503_with_the_reason_once_the_learner_stalls():
    pace = _paced(5)
    now = {"t": 141.0}
    app = web.Application()
    app.add_routes(operator_routes(lambda: None, live=lambda: _verdict(pace, now["t"])))  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/livez")
        assert response.status == 200
        now["t"] = 140.0 + 1000.0
        response = await client.get("/livez")
        assert response.status == 503
        assert (await response.text()).startswith("learner stalled: no step for 1000.0 s")


async def test_the_watchdog_stops_pinging_while_the_learner_is_stalled(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    try:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
        pace = _paced(5)
        # Watchdog rounds on a fake clock: stepping, then stalled past the limit, then stepping again.
        times = iter([141.0, 140.0 + 1000.0, 140.0 + 1001.0])
        rounds = 0

        async def fake_sleep(seconds: float) -> None:
            nonlocal rounds
            rounds += 1
            if rounds == 2:
                pace.step(140.0 + 1000.5)  # the learner steps again
            if rounds == 3:
                raise asyncio.CancelledError

        with pytest.raises(asyncio.CancelledError):
            await run_watchdog(notifier, lambda: _verdict(pace, next(times)), sleep=fake_sleep)
        received = []
        while True:
            try:
                received.append(sock.recv(100))
            except BlockingIOError:
                break
        assert received == [b"WATCHDOG=1", b"WATCHDOG=1"]  # three rounds, the stalled one silent
        notifier.close()
    finally:
        sock.close()
