"""`diloco-node profile` (ops/profiling.py, `POST /profile`): a real JAX trace of a short capture,
one capture at a time, bounded durations, loopback only, and the command's output."""

from __future__ import annotations

import asyncio
import io
import threading

import jax
import jax.numpy as jnp
from aiohttp import web
from aiohttp.test_utils import TestServer

from diloco_node.cli.profile import profile_command
from diloco_node.ops.profiling import MAX_PROFILE_SECONDS, ProfileCapture
from diloco_node.ops.status import StatusDocument, operator_routes


def _busy_until(stop: threading.Event) -> threading.Thread:
    """A stand-in for the learner: a tiny jitted computation stepping while the trace runs."""
    step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())

    def loop() -> None:
        x = jnp.ones((64, 64))
        while not stop.is_set():
            step(x).block_until_ready()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


async def test_a_one_second_capture_writes_a_trace_into_a_timestamped_directory(tmp_path):
    capture = ProfileCapture(tmp_path, wall=lambda: 1_700_000_000.0)
    stop = threading.Event()
    worker = _busy_until(stop)
    try:
        status, answer = await capture.capture(1)
    finally:
        stop.set()
        worker.join(10)
    assert status == 200, answer
    assert answer["dir"] == str(tmp_path / "profiles" / "20231114T221320Z")
    assert any(name.endswith(".xplane.pb") for name in answer["files"]), answer["files"]
    assert capture.running is None
    # A second capture in the same second gets a directory of its own.
    assert capture._claim() == tmp_path / "profiles" / "20231114T221320Z-2"


def _server_app(capture: ProfileCapture, remote: str | None = None) -> web.Application:
    doc = StatusDocument("a", "r", "learner", True, 1, "a", 1, "")

    @web.middleware
    async def from_elsewhere(request: web.Request, handler):  # the peer address a proxy would show
        return await handler(request.clone(remote=remote) if remote else request)

    app = web.Application(middlewares=[from_elsewhere])
    app.add_routes(operator_routes(lambda: doc, profile=capture.capture))
    return app


async def test_the_route_refuses_a_second_capture_bad_durations_and_strangers(tmp_path):
    import aiohttp

    started = asyncio.Event()

    class SlowCapture(ProfileCapture):  # no real profiler: the route's rules are under test here
        async def capture(self, seconds):
            if seconds is True or not isinstance(seconds, (int, float)) or not 1 <= seconds <= MAX_PROFILE_SECONDS:
                return await super().capture(seconds)
            if self._claim() is None:
                return 409, {"error": "busy"}
            started.set()
            await asyncio.sleep(0.5)
            self._running = None
            return 200, {"dir": "d", "seconds": seconds, "files": []}

    capture = SlowCapture(tmp_path)
    async with TestServer(_server_app(capture), host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{server.port}/profile"
        first = asyncio.ensure_future(session.post(url, json={"seconds": 1}))
        await asyncio.wait_for(started.wait(), 5)
        async with session.post(url, json={"seconds": 1}) as second:
            assert second.status == 409
        async with await first as answer:
            assert answer.status == 200 and (await answer.json())["dir"] == "d"
        for bad in (0, 301, "5", True):
            async with session.post(url, json={"seconds": bad}) as answer:
                assert answer.status == 400 and "from 1 to 300" in (await answer.json())["error"]
        async with session.post(url, json={"secs": 1}) as answer:
            assert answer.status == 400
    async with TestServer(_server_app(capture, remote="10.0.0.5"), host="127.0.0.1") as server, \
            aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{server.port}/profile", json={"seconds": 1}) as answer:
            assert answer.status == 403 and "loopback" in (await answer.json())["error"]


async def test_the_profile_command_prints_the_directory_or_why_not(tmp_path):
    async def capture(seconds):
        return 200, {"dir": str(tmp_path / "profiles" / "x"), "seconds": seconds, "files": ["a.xplane.pb"]}

    app = web.Application()
    app.add_routes(operator_routes(lambda: StatusDocument("a", "r", "learner", True, 1, "a", 1, ""), profile=capture))
    async with TestServer(app, host="127.0.0.1") as server:
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(profile_command, f"127.0.0.1:{server.port}", 2.0, out, err)
    assert code == 0 and out.getvalue() == f"{tmp_path / 'profiles' / 'x'}\n" and "perfetto" in err.getvalue()
    unreachable = io.StringIO()
    assert profile_command("127.0.0.1:1", 1.0, io.StringIO(), unreachable) == 1
    assert "http://127.0.0.1:1/profile: unreachable" in unreachable.getvalue()
