"""The loopback debug routes (ops/debug_routes.py): failpoints armed and disarmed by name, the
wall clock skewed; absent unless the daemon was started with failpoints allowed."""

from __future__ import annotations

import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from diloco_node.clock import SystemClock, set_wall_skew
from diloco_node.ops.debug_routes import DEBUG_ENV_VAR, debug_allowed, debug_routes
from diloco_node.storage import failpoints

ALLOWED = {failpoints.ENV_VAR: ""}


@pytest.fixture(autouse=True)
def _clean():
    failpoints.disarm()
    set_wall_skew(0.0)
    yield
    failpoints.disarm()
    set_wall_skew(0.0)


def _app(environ) -> web.Application:
    app = web.Application()
    app.add_routes(debug_routes(environ))
    return app


async def test_without_failpoints_allowed_the_routes_do_not_exist():
    assert not debug_allowed({}) and debug_allowed(ALLOWED) and debug_allowed({DEBUG_ENV_VAR: "1"})
    assert not debug_allowed({DEBUG_ENV_VAR: "0"})
    async with TestClient(TestServer(_app({}))) as client:
        for path in ("/debug/failpoints", "/debug/clock"):
            assert (await client.post(path, json={})).status == 404
    assert failpoints.armed() == {}


async def test_failpoints_are_armed_and_disarmed_by_name():
    async with TestClient(TestServer(_app(ALLOWED))) as client:
        response = await client.post("/debug/failpoints", json={"arm": "log.append=enospc*2,history.write=eio"})
        assert response.status == 200
        assert await response.json() == {"armed": {"history.write": "eio", "log.append": "enospc*2"}}
        assert failpoints.armed() == {"history.write": "eio", "log.append": "enospc*2"}
        response = await client.post("/debug/failpoints", json={"disarm": ["log.append"]})
        assert await response.json() == {"armed": {"history.write": "eio"}}
        response = await client.post("/debug/failpoints", json={"disarm": "all", "arm": "checkpoint.write=crash-before"})
        assert await response.json() == {"armed": {"checkpoint.write": "crash-before"}}
        assert await (await client.get("/debug/failpoints")).json() == {"armed": {"checkpoint.write": "crash-before"}}
        for body, error in (({"arm": "no.such=eio"}, "unknown failpoint 'no.such'"),
                            ({"arm": "log.append=melt"}, "unknown action 'melt'"),
                            ({"disarm": "some"}, "'disarm' must be a list"),
                            ({"arm": 3}, "'arm' must be a string")):
            response = await client.post("/debug/failpoints", json=body)
            assert response.status == 400 and error in (await response.json())["error"]
        response = await client.post("/debug/failpoints", data=b"[1]", headers={"Content-Type": "application/json"})
        assert response.status == 400 and (await response.json())["error"] == "the body must be a JSON object"
    assert failpoints.armed() == {"checkpoint.write": "crash-before"}  # the refusals changed nothing


async def test_the_wall_clock_is_skewed_and_restored():
    async with TestClient(TestServer(_app(ALLOWED))) as client:
        response = await client.post("/debug/clock", json={"offset_s": 3600, "drift_rate": 0.001})
        assert await response.json() == {"wall_skew": {"offset_s": 3600.0, "drift_rate": 0.001}}
        assert SystemClock().wall() == pytest.approx(time.time() + 3600.0, abs=1.0)
        response = await client.post("/debug/clock", json={"offset_s": "soon"})
        assert response.status == 400 and "must be numbers" in (await response.json())["error"]
        response = await client.post("/debug/clock", json={"offset_s": 1e7})
        assert response.status == 400 and "within" in (await response.json())["error"]
        await client.post("/debug/clock", json={"offset_s": 0})
    assert SystemClock().wall() == pytest.approx(time.time(), abs=1.0)


class _RemoteTransport:
    def get_extra_info(self, name, default=None):
        return ("192.0.2.7", 4000) if name == "peername" else default


async def test_a_client_off_the_loopback_is_refused():
    routes = {route.path: route.handler for route in debug_routes(ALLOWED) if route.method == "POST"}
    request = make_mocked_request("POST", "/debug/failpoints", transport=_RemoteTransport())
    response = await routes["/debug/failpoints"](request)
    assert response.status == 403 and b"only on this host's loopback" in response.body
    response = await routes["/debug/clock"](make_mocked_request("POST", "/debug/clock", transport=_RemoteTransport()))
    assert response.status == 403 and failpoints.armed() == {}


async def test_a_refused_change_changes_nothing():
    failpoints.arm("log.append=enospc,history.write=eio")
    async with TestClient(TestServer(_app(ALLOWED))) as client:
        for body in ({"disarm": ["log.append", "no.such"]}, {"disarm": ["history.write"], "arm": "log.read=melt"}):
            response = await client.post("/debug/failpoints", json=body)
            assert response.status == 400
            assert failpoints.armed() == {"history.write": "eio", "log.append": "enospc"}
