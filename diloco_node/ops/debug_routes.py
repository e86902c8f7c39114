"""Loopback-only fault injection for tests and chaos runs: arm failpoints, skew the wall clock.

Two operator routes, present only in a daemon started with failpoints allowed (the environment
sets `DILOCO_X_DEBUG_ROUTES=1`, or names `DILOCO_X_FAILPOINTS`) and answered only to a client on
this host's loopback:

- `POST /debug/failpoints`, body `{"arm": "point=action,...", "disarm": ["point", ...] | "all"}`
  (either or both; disarming first): arms and disarms failpoints by name (storage/failpoints.py) and
  answers `{"armed": {point: action}}`. `GET /debug/failpoints` answers the same without a change.
- `POST /debug/clock`, body `{"offset_s": S, "drift_rate": R}`: from now on this process's wall
  clock reads S seconds (plus R seconds per second) off the host's (clock.py `set_wall_skew`);
  `{"offset_s": 0}` restores it. Monotonic time is untouched. Answers `{"wall_skew": {...}}`.

A production daemon never has them: without the environment variable the routes do not exist
(404), so a stray request cannot break a node's disk or clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from diloco_node import clock
from diloco_node.ops.status import is_loopback
from diloco_node.storage import failpoints

MAX_DEBUG_BODY_BYTES = 4096
# A tooling variable (DILOCO_X_*: never read as configuration), so a chaos run can allow the routes
# without arming anything at start.
DEBUG_ENV_VAR = "DILOCO_X_DEBUG_ROUTES"


def debug_allowed(environ: Mapping[str, str]) -> bool:
    """Whether the daemon was started with failpoints allowed: `DILOCO_X_DEBUG_ROUTES=1`, or
    failpoints armed from the environment (`DILOCO_X_FAILPOINTS`, even empty)."""
    return environ.get(DEBUG_ENV_VAR) == "1" or failpoints.ENV_VAR in environ


def debug_routes(environ: Mapping[str, str]) -> web.RouteTableDef:
    """The debug routes when `environ` allows them, else an empty table."""
    routes = web.RouteTableDef()
    if not debug_allowed(environ):
        return routes

    @routes.get("/debug/failpoints")
    async def show_failpoints(request: web.Request) -> web.Response:
        refused = _refusal(request)
        return refused or web.json_response({"armed": failpoints.armed()})

    @routes.post("/debug/failpoints")
    async def change_failpoints(request: web.Request) -> web.Response:
        body, error = await _loopback_json_object(request)
        if error is not None:
            return error
        disarm, arm = body.get("disarm", []), body.get("arm", "")
        if not (disarm == "all" or isinstance(disarm, list) and all(isinstance(n, str) for n in disarm)):
            return _bad("'disarm' must be a list of failpoint names or \"all\"")
        if not isinstance(arm, str):
            return _bad("'arm' must be a string: point=action,...")
        unknown = [] if disarm == "all" else [name for name in disarm if name not in failpoints.POINTS]
        if unknown:  # refused before anything changes, so a typo disarms nothing
            return _bad(f"unknown failpoints {unknown}; known: {', '.join(sorted(failpoints.POINTS))}")
        try:
            failpoints.parse(arm)  # the same: a bad spec changes nothing
            if disarm == "all":
                failpoints.disarm()
            else:
                for name in disarm:
                    failpoints.disarm(name)
            armed = failpoints.arm(arm) if arm else failpoints.armed()
        except failpoints.FailpointError as exc:
            return _bad(str(exc))
        return web.json_response({"armed": armed})

    @routes.post("/debug/clock")
    async def skew_clock(request: web.Request) -> web.Response:
        body, error = await _loopback_json_object(request)
        if error is not None:
            return error
        offset, drift = body.get("offset_s", 0.0), body.get("drift_rate", 0.0)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (offset, drift)):
            return _bad("'offset_s' and 'drift_rate' must be numbers")
        try:
            skew = clock.set_wall_skew(float(offset), float(drift))
        except ValueError as exc:
            return _bad(str(exc))
        return web.json_response({"wall_skew": skew})

    return routes


def _refusal(request: web.Request) -> web.Response | None:
    if is_loopback(request.remote):
        return None
    return web.json_response({"error": f"{request.path} is answered only on this host's loopback, "
                                       f"not to {request.remote}"}, status=403)


def _bad(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


async def _loopback_json_object(request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
    """A POST's JSON object body, or the refusal to answer (403 off loopback, 400 for a bad body)."""
    refused = _refusal(request)
    if refused is not None:
        return {}, refused
    if request.content_length is None or request.content_length > MAX_DEBUG_BODY_BYTES:
        return {}, _bad(f"the body must be a JSON object of at most {MAX_DEBUG_BODY_BYTES} bytes with a Content-Length")
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        return {}, _bad(f"the body is not JSON: {exc}")
    if not isinstance(body, dict):
        return {}, _bad("the body must be a JSON object")
    return body, None
